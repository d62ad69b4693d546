"""A member whose every source of the swarm's average has left steps with its group's own at once, not after the
rest of ``merge_limit`` (121 s for ``tiny``, 576 s for ``150m``). Seen in a suite run: a joiner kept dialling a
delegate that had finished its run, once a second, until the bound. The rule (``groups.fetch_candidates``,
``groups.all_left``) on real views, and the merge on fakes of its DHT and averager."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from test_groups import view_of
from test_swarm_view import A, B, C, record

from swarm.dht import groups
from swarm.dht.groups import Merged, all_left, fetch_candidates
from swarm.dht.records import PeerState
from swarm.manifest import AveragingSpec
from swarm.round import merge
from swarm.round.merge import STAND_IN_EVERY, Merger
from swarm.round.merge_state import MergeState
from swarm.round.no_shows import NoShows

DIGEST, OURS = "a" * 64, "b" * 64


def test_the_candidates_are_our_ancestors_then_the_other_holders():
    members, tag = (A, B, C), "1" * 16
    candidates = fetch_candidates(members, tag, A, C, holders=(A, "Qm" + "x" * 44, C))
    assert candidates[-1] == "Qm" + "x" * 44 and C not in candidates and candidates.count(A) == 1
    assert candidates[: len(groups.ancestors_of(members, tag, A, C))] == groups.ancestors_of(members, tag, A, C)
    assert fetch_candidates((A,), tag, A, A, holders=(B,)) == [B]  # the root of no tree: the holders only


def test_a_peer_is_left_once_its_record_is_gone_or_says_it_left():
    view = view_of(record(A, 3), record(B, 4, state=PeerState.left))
    assert not all_left(view, [A, B])  # A is live, even at another epoch: it still serves what it kept
    assert all_left(view, [B, C])  # B said it left, C has no record
    assert all_left(view, [])


def merger_with(live: list, fetches: list) -> tuple[Merger, MergeState, Merged]:
    def download_update(holder, *args, **kwargs):
        fetches.append(holder)
        raise RuntimeError("Connect failed: all dials failed")

    reader = SimpleNamespace(
        dht=None, other_records=0, banned=lambda peer: False, view=lambda including=(): view_of(*live),
        recent_view=lambda: view_of(*live),
    )  # fmt: skip
    ctx = SimpleNamespace(
        me=C, reader=reader, manifest=SimpleNamespace(run_id="0" * 16, averaging=AveragingSpec()),
        averager=SimpleNamespace(download_update=download_update, finalize_update=lambda epoch: True),
        outer=SimpleNamespace(numel=1000, numels=[1000], nbytes=4000, params=[None]), stop_requested=lambda: False,
    )  # fmt: skip
    store = SimpleNamespace(temporary_path=lambda name: Path("/nonexistent") / name)
    merger = Merger(ctx, checkpoints=SimpleNamespace(store=store), no_shows=NoShows(lambda: 0))
    state = MergeState(epoch=3, tag="1" * 16, delegate=A, members=(A, B, C), size=3, weight=48.0, digest=OURS,
                       deadline=1000.0)  # fmt: skip
    return merger, state, Merged(DIGEST, frozenset({"1" * 16}), 48.0, (A,), peers=3)


def take_for(merger, state, result, monkeypatch, seconds: float) -> float | None:
    """Poll ``_take`` once a second from t = 0 for ``seconds``; when it finished, the time."""
    for t in range(int(seconds)):
        monkeypatch.setattr(merge.time, "monotonic", lambda t=t: float(t))
        if merger._take(state, result, blocking=True):
            return float(t)
    return None


def test_a_member_whose_sources_all_left_steps_with_its_own_after_two_looks(monkeypatch):
    fetches = []
    merger, state, result = merger_with([record(C, 3)], fetches)  # A (delegate, holder) and B (our parent) gone
    ended = take_for(merger, state, result, monkeypatch, 60)
    assert ended is not None and ended <= 2 * STAND_IN_EVERY + 1, ended
    assert state.done and not state.counted and "left with it" in state.fallback
    assert fetches and set(fetches) <= {A, B}  # it did try them first


def test_a_member_keeps_fetching_while_one_source_is_live(monkeypatch):
    fetches = []
    merger, state, result = merger_with([record(C, 3), record(A, 4)], fetches)  # the delegate moved on: it serves
    assert take_for(merger, state, result, monkeypatch, 60) is None
    assert not state.done and state.left_looks == 0 and len(fetches) >= 30
