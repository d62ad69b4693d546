"""A donor's state file is accepted for the epoch the joiner chose from the swarm's view, held by enough peers
(``swarm.state.trust``): not for whatever epoch and checksum the donor wrote into its header."""

from __future__ import annotations

from types import SimpleNamespace

from test_groups import view_of
from test_swarm_view import record

from swarm.dht.records import PeerState
from swarm.dht.view import ResyncReason, consensus, resync_needed, running_consensus, trusted_consensus
from swarm.round.pipeline import OuterRound
from swarm.state.trust import GROUPMATE_ROUNDS, MIN_HOLDERS, Groupmates, refusal
from swarm.state.trust import wanted as trust_wanted

GOOD, BAD, NEXT = "a" * 64, "b" * 64, "c" * 64
ME = "joiner"


def test_a_state_held_by_two_peers_at_the_wanted_epoch_is_accepted():
    view = view_of(record("p1", 5, checksums=[(5, GOOD)]), record("p2", 5, checksums=[(5, GOOD)]))
    wanted = consensus(view.peers, 5)
    assert MIN_HOLDERS == 2 and refusal(view, 5, GOOD, wanted, ME) is None
    assert "not the one" in refusal(view, 5, BAD, wanted, ME)


def test_a_donor_cannot_choose_the_epoch_it_is_checked_against():
    honest = [record(f"p{i}", 5, checksums=[(5, GOOD)]) for i in range(3)]
    # the donor publishes a checksum of its own poisoned file for epoch 6, which nobody else has reached
    donor = record("donor", 5, checksums=[(5, GOOD), (6, BAD)])
    view = view_of(*honest, donor)
    wanted = consensus(view.peers, 5)
    assert "not reached" in refusal(view, 6, BAD, wanted, ME)
    assert "older" in refusal(view, 4, GOOD, wanted, ME)
    # the swarm really moved on during the download: epoch 6 is checked as the wanted one was; one vote for the
    # donor's own file is not enough where two peers voted
    moved = view_of(
        *[record(f"p{i}", 6, checksums=[(6, NEXT)]) for i in range(2)], record("donor", 6, checksums=[(6, BAD)])
    )
    assert refusal(moved, 6, NEXT, wanted, ME) is None
    assert refusal(moved, 6, BAD, wanted, ME) is not None


def test_one_holder_is_not_enough_where_others_voted_and_is_where_it_is_the_only_voter():
    view = view_of(record("donor", 5, checksums=[(5, BAD)]), record("p1", 5, checksums=[(5, GOOD)]))
    wanted = consensus(view.peers, 5)  # a tie of one vote each: the lower peer id wins, here the donor's
    assert wanted.checksum == BAD and "1 peer(s), 2 needed" in refusal(view, 5, BAD, wanted, ME)
    alone = view_of(record("p1", 5, checksums=[(5, GOOD)]))  # the run's only other peer: nobody to compare with
    assert refusal(alone, 5, GOOD, consensus(alone.peers, 5), ME) is None
    # our own vote never counts for the file we are checking
    ours = view_of(record("p1", 5, checksums=[(5, GOOD)]), record(ME, 5, checksums=[(5, GOOD)]))
    assert refusal(ours, 5, GOOD, consensus(ours.peers, 5), ME) is None  # p1 is the one other voter
    three = view_of(record("p1", 5, checksums=[(5, GOOD)]), record("p2", 5, checksums=[(5, BAD)]),
                    record(ME, 5, checksums=[(5, GOOD)]))  # fmt: skip
    assert "1 peer(s), 2 needed" in refusal(three, 5, GOOD, consensus(three.peers, 5), ME)


# ---- a state a minority of keys cannot make a joiner take (``trusted_consensus``, ``wanted``) ----------------

OLD, H1, H2 = "0" * 64, "1" * 64, "2" * 64


def split_swarm_and_a_third_of_keys(attacker_votes_old: bool = True):
    """Four honest peers whose round at epoch 6 ended in two groups (H1, H2), all from the same state of epoch 5,
    and two attacker keys (a third of six, ids that sort first) voting and serving a poisoned checksum of 6."""
    honest = [record(f"p{i}", 6, checksums=[(5, OLD), (6, H1 if i < 2 else H2)]) for i in range(4)]
    liars = [record(f"0liar{i}", 6, checksums=[(5, OLD if attacker_votes_old else BAD), (6, BAD)]) for i in range(2)]
    return view_of(*honest, *liars)


def test_a_third_of_the_keys_wins_the_plurality_of_a_split_swarm_but_no_joiner_takes_its_state():
    view = split_swarm_and_a_third_of_keys()
    assert consensus(view.peers, 6).checksum == BAD  # a tie of two, the lowest ids: what a joiner took before
    assert trusted_consensus(view.peers, 6) is None  # two of six is not half
    wanted = trust_wanted(view)
    assert (wanted.epoch, wanted.checksum) == (5, OLD)  # the last state the honest swarm held as one
    assert refusal(view, 6, BAD, wanted, ME, joining=True) is not None
    assert refusal(view, 5, OLD, wanted, ME, joining=True) is None
    # the attacker's keys cannot move the epoch before either: four of six still hold it
    assert trust_wanted(split_swarm_and_a_third_of_keys(attacker_votes_old=False)).checksum == OLD
    # a running peer converges on the most common state that it or a recent groupmate holds: not the attacker's
    assert resync_needed(view, "p2", 6, H2, False) is None  # no groupmates yet: ours is the only candidate
    assert resync_needed(view, "p2", 6, H2, False, vouched={"p0"}).reason == ResyncReason.disagreed
    assert running_consensus(view.peers, 6, {"p2", "p0"}).checksum == H1  # a tie of two, the lower ids
    assert refusal(view, 6, BAD, running_consensus(view.peers, 6, {"p2", "p0"}), "p2", vouched={"p0"}) is not None
    assert refusal(view, 6, H1, running_consensus(view.peers, 6, {"p2", "p0"}), "p2", vouched={"p0"}) is None
    # only a liar that averaged with it lately (its parts taken, not caught) makes the attacker's state a candidate
    assert running_consensus(view.peers, 6, {"p2", "0liar1"}).checksum == BAD


def test_extra_keys_that_never_averaged_with_a_running_peer_never_make_it_take_their_state():
    """A split swarm (groups ended apart, four ways) and any number of extra keys voting one poisoned checksum: a
    running peer whose groupmates are honest takes an honest state, and every honest peer that has met a holder of
    each honest state takes the same one (they converge)."""
    for honest in (4, 10, 30):
        for liars in range(0, honest):  # fewer than half of all keys: a majority of keys makes a trusted consensus
            peers = [record(f"p{i:02d}", 6, checksums=[(6, f"{1 + i % 4:064x}")]) for i in range(honest)]
            peers += [record(f"0l{i:02d}", 6, checksums=[(6, BAD)]) for i in range(liars)]
            view = view_of(*peers)
            winners = set()
            for i in range(honest):
                me = f"p{i:02d}"
                met = {f"p{(i + k) % honest:02d}" for k in range(1, 5)}  # four groupmates, one of each state
                agreed = running_consensus(view.peers, 6, {me, *met})
                assert agreed.checksum != BAD
                winners.add(agreed.checksum)
            assert len(winners) == 1


def test_a_minority_of_keys_never_makes_a_trusted_consensus():
    for honest in range(1, 12):
        for liars in range(honest):  # fewer than the honest keys, however the honest peers are split
            for groups in range(1, honest + 1):
                peers = [record(f"p{i:02d}", 6, checksums=[(6, f"{i % groups:064x}")]) for i in range(honest)]
                peers += [record(f"0l{i:02d}", 6, checksums=[(6, BAD)]) for i in range(liars)]
                agreed = trusted_consensus(view_of(*peers).peers, 6)
                assert agreed is None or agreed.checksum != BAD


def test_the_finishers_of_a_round_are_half_of_the_swarm_when_their_epoch_is_the_global_one():
    for n in range(1, 10):
        done = (n + 1) // 2  # the upper median's epoch is 7 once this many finished
        peers = [record(f"p{i}", 7, checksums=[(6, OLD), (7, H1)]) for i in range(done)]
        peers += [record(f"q{i}", 6, checksums=[(6, OLD)]) for i in range(n - done)]
        assert trust_wanted(view_of(*peers)).epoch == 7
        # stragglers two epochs behind and joiners still downloading have no say in epoch 7's checksum
        peers += [record(f"s{i}", 2, checksums=[(2, H2)]) for i in range(n)]
        peers += [record(f"d{i}", 0, state=PeerState.downloading_state) for i in range(n)]
        # nor keys that say they are at the epoch, or past it, without a checksum of it (extra keys that only count)
        peers += [record(f"g{i}", 7) for i in range(n)] + [record(f"h{i}", 9, checksums=[(9, H2)]) for i in range(n)]
        assert trusted_consensus(view_of(*peers).peers, 7).checksum == H1


def test_a_round_notes_the_groupmates_whose_parts_it_took_and_forgets_those_caught_lying():
    """``OuterRound._note_groupmates``: the evidence ``running_consensus`` reads, with a fake round's outcome."""
    sync = SimpleNamespace(groupmates=Groupmates())
    host = SimpleNamespace(sync=sync, ctx=SimpleNamespace(me="me"))
    caught = ({"peer": "liar", "banned": True}, {"peer": "b", "banned": False})
    outcome = SimpleNamespace(group=("me", "a", "b", "gone", "liar"), absent=("gone",), findings=caught)
    OuterRound._note_groupmates(host, SimpleNamespace(outcome=outcome, fallback=None, merge=None), True)
    assert sync.groupmates.keys() == {"a", "b"}  # not us, not a groupmate that dropped out, not a caught liar
    later = SimpleNamespace(group=("me", "c"), absent=(), findings=())
    OuterRound._note_groupmates(host, SimpleNamespace(outcome=later, fallback="non-finite values", merge=None), True)
    OuterRound._note_groupmates(host, SimpleNamespace(outcome=later, fallback=None, merge=None), False)
    assert sync.groupmates.keys() == {"a", "b"}  # values not used, or a round not averaged: no evidence
    # a groupmate caught lying in a later round is evidence of nothing any more
    liar = SimpleNamespace(group=("me", "d"), absent=(), findings=({"peer": "a", "banned": True},))
    OuterRound._note_groupmates(host, SimpleNamespace(outcome=liar, fallback=None, merge=None), True)
    assert sync.groupmates.keys() == {"b", "d"}
    # a delegate's second stage: the other delegates it ran whole with, less any its audits caught
    stage2 = SimpleNamespace(partners=frozenset({"x", "y", "z"}), findings=({"peer": "z", "banned": True},))
    alone = SimpleNamespace(outcome=None, fallback=None, merge=stage2)  # a group of one in the second stage
    OuterRound._note_groupmates(host, alone, True)
    assert sync.groupmates.keys() == {"b", "d", "x", "y"}
    # the memory is the last GROUPMATE_ROUNDS averaged rounds
    for i in range(GROUPMATE_ROUNDS):
        sync.groupmates.note(["me", f"q{i}"], "me")
    assert sync.groupmates.keys() == {f"q{i}" for i in range(GROUPMATE_ROUNDS)}
