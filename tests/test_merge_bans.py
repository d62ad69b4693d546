"""A group whose delegate this peer banned is no part of its second stage: not waited for, not in a roster it
writes. The averager refuses a banned peer's group anyway, so every round with it cost a failed try of the second
stage (30 s a round in the byzantine benchmark, the liar banned and registering as a group of one)."""

from __future__ import annotations

from types import SimpleNamespace

from swarm.dht import groups
from swarm.dht.groups import group_record, group_tag
from swarm.round.merge import Merger
from swarm.round.no_shows import NoShows

HONEST, LIAR = "Qm" + "h" * 44, "Qm" + "l" * 44


def test_the_groups_of_banned_delegates_are_not_read_into_the_second_stage(monkeypatch):
    records = [
        group_record(3, group_tag(b"honest"), HONEST, 2, 64.0, "a" * 64, False),
        group_record(3, group_tag(b"liar"), LIAR, 1, 32.0, None, False),
    ]
    monkeypatch.setattr(groups, "read_groups", lambda dht, run_id: list(records))
    reader = SimpleNamespace(dht=None, other_records=0, banned=lambda peer: peer == LIAR)
    ctx = SimpleNamespace(reader=reader, manifest=SimpleNamespace(run_id="0" * 16))
    merger = Merger(ctx, checkpoints=None, no_shows=NoShows(lambda: 0))
    assert [r.delegate for r in merger._read_wide()] == [HONEST]
    assert reader.other_records == 2  # both were read: the DHT traffic is counted as it was
    reader.banned = lambda peer: False
    assert [r.delegate for r in merger._read_wide()] == [HONEST, LIAR]


def test_a_liar_a_second_stage_caught_is_kept_for_the_ban_and_none_of_its_records_is_read(monkeypatch):
    """Seen with five peers (byzantine ``split``): every honest delegate caught a lying delegate in the second stage,
    dropped its slice and so did not register, and then took the one swarm's average registered, the liar's own.
    Its findings were dropped with the try, so no peer banned it. Now the try's findings are kept for the round's end
    (the ban, the accusation), the liar's records are not read again this round, and the next try runs without it."""
    from swarm.averager.handle import AllReduceOutcome
    from swarm.round.merge_state import MergeState

    records = [
        group_record(3, group_tag(b"honest"), HONEST, 2, 64.0, "a" * 64, False),
        group_record(3, group_tag(b"liar"), LIAR, 1, 32.0, None, False, merged="b" * 64),
    ]
    monkeypatch.setattr(groups, "read_groups", lambda dht, run_id: list(records))
    reader = SimpleNamespace(dht=None, other_records=0, banned=lambda peer: False)  # not banned by the host yet
    manifest = SimpleNamespace(run_id="0" * 16, averaging=SimpleNamespace(merge_timeout=60.0))
    ctx = SimpleNamespace(reader=reader, manifest=manifest, me=HONEST)
    merger = Merger(ctx, checkpoints=None, no_shows=NoShows(lambda: 0))
    caught = dict(peer=LIAR, verdict="equivocated", banned=True, discarded=True, receipt=b"proof")
    outcome = AllReduceOutcome(group=(HONEST, LIAR), gathered={}, dropped_fraction=0.4, excluded_senders=0,
                               findings=(caught,))  # fmt: skip
    state = MergeState(epoch=3, tag=group_tag(b"honest"), delegate=HONEST, members=(HONEST,), size=2, weight=64.0,
                       digest="a" * 64, deadline=1e18)  # fmt: skip
    state.stage2 = SimpleNamespace(poll=lambda: True, result=lambda: outcome)
    assert merger._poll_stage2(state) is True
    assert state.findings == (caught,) and state.caught == {LIAR} and LIAR in state.absent
    assert state.fallback is not None and state.registered_at is None  # not registered: a slice was dropped
    assert [r.delegate for r in merger._read(state, now=0.0)] == [HONEST]
    assert groups.result_of(merger._read(state, now=0.0), 3) is None  # the liar's swarm's average is not taken
    assert groups.result_of(records, 3) is not None  # as it was before


def test_a_second_stage_the_merge_discards_is_never_written_into_a_delegates_buffers():
    """Seen with four peers (byzantine ``collude``): a delegate that caught the liar in the second stage discarded it
    (a slice dropped), went on from its group's own average, and stepped apart from its members, once a round, with
    the discarded merge still in its buffers. The merge and the averager now read one rule (``partial_merge``): the
    try the merge discards is the one the averager does not write (nor keep as the epoch's update)."""
    import inspect

    from swarm.averager import process
    from swarm.averager.fixed_group import partial_merge
    from swarm.round import merge

    assert partial_merge(0.25, 0) and partial_merge(0.0, 1) and not partial_merge(0.0, 0)
    assert "partial_merge(outcome.dropped_fraction, outcome.excluded_senders)" in inspect.getsource(merge)
    source = inspect.getsource(process.PseudoGradientAverager)
    assert "partial_merge(dropped, len(runner.banned_senders))" in source and "if not partial:" in source
