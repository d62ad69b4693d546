"""Keys a round waited for that never came are not waited for again a while (``swarm.round.no_shows``), as pure
rules on real records and views: who missed a round, how long the hold lasts, and that each wait for epoch-mates
(the retry, the second stage's delegate, ending a round early, joining the others' second stage) reads the view
without them while the votes do not change."""

from __future__ import annotations

import time
from types import SimpleNamespace

from test_groups import group, view_of
from test_swarm_view import A, B, C, record

from swarm.dht import groups
from swarm.dht.groups import Decision, delegate_decision, group_record, group_tag
from swarm.dht.records import PeerState
from swarm.dht.view import mates_coming, nobody_to_group_with, round_due
from swarm.round.merge import Merger
from swarm.round.merge_state import MergeState
from swarm.round.no_shows import (
    MAX_NO_SHOW_ROUNDS,
    MAX_NO_SHOWS,
    NO_SHOW_ROUNDS,
    NoShows,
    given_up_on,
    no_shows,
    working_towards,
)

G1, G2 = "9" * 40, "8" * 40  # extra keys: records that say "training" and never come


def aged(rec, seconds: float):
    return rec.copy(update={"time": rec.time - seconds})


def test_the_keys_still_working_towards_a_round_after_it_ended_missed_it():
    at_end = view_of(
        record(A, 3, PeerState.merging),  # me
        record(B, 3, PeerState.averaging),  # my groupmate, its record a moment behind
        record(C, 4),  # went on to the next epoch: it came
        record(G1, 3),  # still "training" towards epoch 3
        record(G2, 3, PeerState.matchmaking),
        aged(record("7" * 40, 3), 30),  # no record since our first stage ended: not known to have missed it
        record("6" * 40, 3, PeerState.merging),  # merging in a group of its own: it came
    )
    awaited = {B, C, G1, G2, "7" * 40, "6" * 40}
    since = time.time() - 5
    assert no_shows(awaited, at_end, A, 3, (A, B), since) == tuple(sorted([G1, G2]))
    assert no_shows({G1}, at_end, A, 3, (A, B), since) == (G1,)  # only the awaited ones
    assert no_shows({G1, G2}, at_end, A, 4, (A, B), since) == ()  # awaited at another round
    assert working_towards(at_end, A, 3) == {B, G1, G2, "7" * 40}


def test_a_no_show_is_held_for_rounds_doubling_and_bounded():
    epoch = [5]
    held = NoShows(lambda: epoch[0])
    assert held.add([G1], 5) == NO_SHOW_ROUNDS and held.holds(G1) and not held.holds(G2)
    epoch[0] = 5 + NO_SHOW_ROUNDS
    assert not held.holds(G1) and held.active == []  # waited for again
    assert held.add([G1], 8) == 2 * NO_SHOW_ROUNDS  # missed again: twice as long
    for e in range(9, 30):
        rounds = held.add([G1], e)
    assert rounds == MAX_NO_SHOW_ROUNDS
    many = NoShows(lambda: 0)
    many.add((f"key{i}" for i in range(MAX_NO_SHOWS + 5)), 1)
    assert len(many.active) == MAX_NO_SHOWS and not many.holds("key0")


def test_every_wait_for_epoch_mates_reads_the_view_without_no_shows():
    held = NoShows(lambda: 3)
    held.add([G1, G2], 2)
    now = time.time()
    # G1 says it is one step from the end of the round (a sample a second, 2 of 10 steps of 8 samples left)
    ghosts = view_of(record(A, 3), record(G1, 3, inner_step=9, sps=1000.0), record(G2, 3, checksums=[(3, "f" * 64)]))
    waiting = held.waiting_view(ghosts)
    assert [p.peer_id for p in waiting.peers] == [A] and waiting.global_epoch == ghosts.global_epoch
    # a peer that found no group: retried for them before, not now
    assert mates_coming(ghosts, A, 3) and not mates_coming(waiting, A, 3)
    # a peer with 5 steps left: its round was cut short by G1's claim, not now
    assert round_due(ghosts, A, 3, 2, 10, 8, my_step_seconds=1.0, now=now, my_steps_left=5)
    assert not round_due(waiting, A, 3, 2, 10, 8, my_step_seconds=1.0, now=now, my_steps_left=5)
    # a delegate held its second stage for them (up to its patience), not now
    mine = "1" * 16
    merging = view_of(record(A, 3, PeerState.merging), record(B, 3, PeerState.merging), record(G1, 3))
    ours = [group(3, mine, A)]
    assert delegate_decision(merging, ours, 3, (A, B), mine, waited=5, patience=30) == Decision.wait
    assert delegate_decision(held.waiting_view(merging), ours, 3, (A, B), mine, 5, 30) == Decision.alone
    # a peer looking for a group while the others merge: it waited out its matchmaking for G1, not now
    others = view_of(record(A, 3, PeerState.matchmaking), record(B, 3, PeerState.merging), record(G1, 3))
    assert not nobody_to_group_with(others, A, 3) and nobody_to_group_with(held.waiting_view(others), A, 3)
    assert held.waiting_view(None) is None and NoShows(lambda: 0).waiting_view(ghosts) is ghosts


def test_a_delegate_that_waited_out_its_patience_holds_the_keys_that_never_came(monkeypatch):
    """``Merger.poll`` with the real rules and records, fakes for the DHT: the delegate of the round's only group
    waits half of ``merge_timeout`` for a key that says it is training, registers its group's average as the
    swarm's, and from then on does not wait for that key (a key that follows the swarm's epoch is at the next one
    by the time the round ends, so the end of the round alone would not catch it)."""
    me, mate, tag, epoch = A, B, group_tag(b"ours"), 3
    records = [group_record(epoch, tag, me, 2, 64.0, "a" * 64, False)]
    monkeypatch.setattr(groups, "read_groups", lambda dht, run_id: list(records))
    monkeypatch.setattr(groups, "register", lambda dht, run_id, record: records.append(record) or True)
    live = [record(me, epoch, PeerState.merging), record(mate, epoch, PeerState.merging), record(G1, epoch)]
    reader = SimpleNamespace(dht=None, other_records=0, banned=lambda peer: False, recent_view=lambda: view_of(*live))
    averaging = SimpleNamespace(merge_timeout=4.0, allreduce_limit=lambda numel: 0.0)
    ctx = SimpleNamespace(
        me=me,
        reader=reader,
        manifest=SimpleNamespace(run_id="0" * 16, averaging=averaging),
        averager=SimpleNamespace(client_mode=False, finalize_update=lambda e: True),
        outer=SimpleNamespace(numel=1000),
        set_state=lambda *a: None,
    )
    held = NoShows(lambda: epoch)
    merger = Merger(ctx, checkpoints=None, no_shows=held)
    state = MergeState(epoch, tag, me, (me, mate), 2, 64.0, "a" * 64, deadline=time.monotonic() + 60)
    state.registered_at = time.monotonic() - 1.5  # past SETTLE, within the patience (2 s)
    assert not merger.poll(state, blocking=False) and not state.decided and not held.holds(G1)  # waits for G1
    state.registered_at, state.read_at = time.monotonic() - 2.5, -float("inf")  # the patience is over
    merger.poll(state, blocking=False)
    assert state.decided and held.holds(G1) and not held.holds(mate)  # alone: ours is the swarm's; G1 held
    # the next round's delegate does not wait for it
    assert held.waiting_view(view_of(*live)).peers == tuple(sorted(live[:2], key=lambda p: p.peer_id))


def test_a_delegate_gives_up_on_keys_that_say_merging_only_while_they_outnumber_the_registered_groups():
    mine, theirs = "1" * 16, "2" * 16
    d = "d" * 40
    registered = [group(3, mine, A), group(3, theirs, d, size=2)]  # C and d merge in theirs
    honest = [record(A, 3, PeerState.merging), record(B, 3, PeerState.merging), record(C, 3, PeerState.merging)]
    honest.append(record(d, 3, PeerState.merging))
    assert given_up_on(view_of(*honest, record(G1, 3)), registered, A, 3, (A, B), mine) == (G1,)
    # a key that says "merging" in no registered group: more merging keys than the registered groups hold
    crowd = view_of(*honest, record(G1, 3), record(G2, 3, PeerState.merging))
    assert given_up_on(crowd, registered, A, 3, (A, B), mine) == tuple(sorted([G1, G2, C]))  # not d: it speaks
    assert given_up_on(crowd, registered, A, 4, (A, B), mine) == ()


def test_a_key_is_noted_once_a_round_and_the_log_names_only_the_new_ones():
    held = NoShows(lambda: 3)
    assert held.note([G1], 3, "never came to the merge") == [G1]
    assert held.note([G1, G2], 3, "still working towards it after it ended") == [G2]  # G1: held already this round
    assert held.add([G1], 3) == 2 * NO_SHOW_ROUNDS  # only a real second miss doubles it
