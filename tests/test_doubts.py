"""An epoch that nobody serves is not believed (``swarm.state.doubts``, and ``StateSync`` with fakes for the
averager's download and the DHT; the records, the view, the state files and their checks are the real ones).

The attack: half of the keys (a stranger's peer and its extra keys) say the swarm is two epochs ahead, with a
made-up checksum. The global epoch is the upper median of the keys' epochs, so every honest peer reads itself
behind; the extra keys serve nothing and the stranger serves its own epoch. Before, every honest round was thrown
away by a re-sync that could not succeed, and a joiner gave up."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import test_bad_donor as bad_donor
import torch
from test_bad_donor import RUN, SHAPES, state, write
from test_swarm_view import record

from swarm.dht.records import PeerEntry, PeerState
from swarm.dht.view import ResyncReason, build_view
from swarm.events import ClaimDoubted, DownloadFailed, StateLoaded
from swarm.manifest import AveragingSpec
from swarm.state import sync as sync_module
from swarm.state.doubts import DOUBT_ROUNDS, MAX_DOUBT_ROUNDS, MAX_DOUBTED, Doubts, unserved_claimants
from swarm.state.store import StateStore
from swarm.state.sync import Resynced, StateSync

BAD = "f" * 64
AHEAD = 2


def entries(*records):
    return [PeerEntry(r, time.time() + 60) for r in records]


def view(*records, doubts: Doubts | None = None):
    found = entries(*records)
    return build_view(doubts.filter(found) if doubts else found, time.time(), 10, 8)


class Donors(bad_donor.Donors):
    """Each donor serves its file, or (no file: a key that is only a record) cannot be reached."""

    def download_state(self, donor: str, destination: Path, **kwargs) -> dict:
        if donor not in self.files:
            self.asked.append(donor)
            raise ConnectionError(f"failed to connect to {donor}")
        return super().download_state(donor, destination, **kwargs)


def sybil_swarm(tmp_path: Path, me: str, honest_peers: list[str], epoch: int = 0, ghosts: int = 1):
    """``honest_peers`` at ``epoch`` holding the honest state (``me`` among them, or a joiner at the seed); a liar
    and ``ghosts`` extra keys voting ``epoch + AHEAD`` with a made-up checksum; the liar serves its own state of
    ``epoch`` (the honest one: it trains honestly), the ghosts nothing."""
    honest = state(1, epoch=epoch)
    good = honest.checksum()
    served = write(tmp_path / "honest.st", honest)
    lie = [(e, BAD) for e in range(epoch, epoch + AHEAD + 1)]
    records = [record(p, epoch, checksums=[(epoch, good)]) for p in honest_peers]
    records += [record(k, epoch + AHEAD, checksums=lie) for k in ["liar", *(f"ghost{i}" for i in range(ghosts))]]
    files = {p: served for p in [*honest_peers, "liar"] if p != me}
    events: list = []
    ours = state(1, epoch=epoch) if me in honest_peers else state(99, epoch=0)
    averaging = AveragingSpec(chunk_timeout=5.0, allreduce_timeout=30.0)  # a download bounded by its size too
    ctx = SimpleNamespace(
        manifest=SimpleNamespace(run_id=RUN, averaging=averaging),
        me=me,
        outer=ours,
        params=[torch.full(s, 7.0) for s in SHAPES],  # the model mid-round: inner steps away from the global copy
        averager=Donors(files),
        emit=events.append,
        set_state=lambda state, now: None,
        shield=contextlib.nullcontext,
        stop_requested=lambda: False,
    )
    announced = []
    checkpoints = SimpleNamespace(
        store=StateStore(tmp_path / "state", RUN), extra=dict, announce=lambda inner_step: announced.append(inner_step)
    )
    sync = StateSync(ctx, checkpoints, begin_round=lambda: None)
    ctx.reader = SimpleNamespace(view=lambda: view(*records, doubts=sync.doubts))  # as the peer's reader does
    sync.replay.missed_rounds = lambda: False
    return sync, ctx, events, honest, records


@pytest.fixture(autouse=True)
def no_sleeping(monkeypatch):
    monkeypatch.setattr(sync_module.time, "sleep", lambda s: None)


# ---- the rule -------------------------------------------------------------------------------------------


def test_the_claimants_are_every_key_at_the_claimed_epoch_or_later():
    swarm = view(record("me", 3), record("b", 3), record("x", 5), record("y", 5), record("z", 6))
    assert swarm.global_epoch == 5
    assert unserved_claimants(swarm, "me", 3, None, joining=False) == ("x", "y", "z")
    assert unserved_claimants(swarm, "me", 5, None, joining=False) == ()  # nobody vouches for a checksum of 5
    assert unserved_claimants(swarm, "me", 6, None, joining=False) == ()  # we ran ahead: they are the swarm


def test_at_our_epoch_the_claimants_are_the_holders_of_a_majority_checksum_that_is_not_ours():
    good = "a" * 64
    ours = [record(p, 5, checksums=[(5, good)]) for p in ("me", "b")]
    sybils = [record(k, 5, checksums=[(5, BAD)]) for k in ("x", "y", "z")]
    swarm = view(*ours, *sybils)
    assert unserved_claimants(swarm, "me", 5, good, joining=False) == ("x", "y", "z")
    assert unserved_claimants(swarm, "me", 5, BAD, joining=False) == ()  # the majority's state is ours
    assert unserved_claimants(view(*ours), "me", 5, good, joining=False) == ()
    # a joiner at the seed, with the majority held by keys that serve nothing and one honest peer to say otherwise
    assert unserved_claimants(view(*ours[1:], *sybils), "me", 5, None, joining=True) == ("x", "y", "z")
    assert unserved_claimants(view(*sybils), "me", 5, None, joining=True) == ()


def test_a_joiner_doubts_only_while_someone_else_says_otherwise():
    alone = view(record("me", 0, state=PeerState.downloading_state), record("x", 4), record("y", 4))
    assert unserved_claimants(alone, "me", 0, None, joining=True) == ()  # it may be the one cut off: no seed start
    assert unserved_claimants(alone, "me", 0, None, joining=False) == ("x", "y")  # a peer with a state goes on with it
    starting = view(record("s", 0, state=PeerState.starting), record("x", 4), record("y", 4))
    assert unserved_claimants(starting, "me", 0, None, joining=True) == ()  # a starting key vouches for nothing
    witnessed = view(record("w", 2), record("x", 4), record("y", 4))
    assert unserved_claimants(witnessed, "me", 0, None, joining=True) == ("x", "y")


def test_doubts_end_past_the_claimed_epoch_and_double_when_repeated():
    epoch = [3]
    doubts = Doubts(lambda: epoch[0])
    assert doubts.add(["x", "y"], 5) == DOUBT_ROUNDS
    kept = doubts.filter(entries(record("x", 5), record("b", 3)))
    assert [e.record.peer_id for e in kept] == ["b"] and sorted(doubts.active) == ["x", "y"]
    epoch[0] = 5 + DOUBT_ROUNDS - 1
    assert doubts.doubted("x")
    epoch[0] = 5 + DOUBT_ROUNDS
    assert not doubts.doubted("x") and doubts.active == []  # believed (and asked) again
    assert doubts.add(["x"], 9) == 2 * DOUBT_ROUNDS  # the same key again: twice as long
    for _ in range(20):
        rounds = doubts.add(["x"], 9)
    assert rounds == MAX_DOUBT_ROUNDS  # never shut out for good


def test_the_memory_of_doubts_is_bounded():
    doubts = Doubts(lambda: 0)
    doubts.add((f"key{i}" for i in range(MAX_DOUBTED + 10)), 4)
    assert len(doubts.active) == MAX_DOUBTED and not doubts.doubted("key0") and doubts.doubted(f"key{MAX_DOUBTED + 9}")


# ---- the state download, with half of the keys lying -------------------------------------------------


def test_a_peer_told_it_is_behind_by_keys_that_serve_nothing_keeps_its_round(tmp_path):
    sync, ctx, events, honest, records = sybil_swarm(tmp_path, "a", ["a", "b"])
    assert sync.resync_needed(0, last_round_local=False).reason == ResyncReason.behind
    model = [p.clone() for p in ctx.params]

    assert sync.resync("behind the swarm", keep_model_if_doubted=True) == Resynced.doubted
    assert sorted(ctx.averager.asked) == ["ghost0", "ghost0", "liar", "liar"]  # two passes, then doubted
    assert [(e.peers, e.epoch, e.rounds) for e in events if isinstance(e, ClaimDoubted)] == [(2, AHEAD, DOUBT_ROUNDS)]
    assert not [e for e in events if isinstance(e, StateLoaded)]
    assert all(torch.equal(p, m) for p, m in zip(ctx.params, model))  # the round's steps are kept
    assert ctx.outer.checksum() == honest.checksum() and ctx.outer.epoch == 0
    assert sync.resync_needed(0, last_round_local=False) is None  # the view without them: our state is the swarm's
    assert ctx.reader.view().global_epoch == 0 and len(ctx.reader.view().peers) == 2

    # the next round's re-check asks nobody: the doubts hold until we pass epoch AHEAD + DOUBT_ROUNDS
    ctx.averager.asked.clear()
    assert sync.resync_needed(0, last_round_local=False) is None and ctx.averager.asked == []


def test_without_keeping_the_round_a_doubted_claim_is_not_a_resync(tmp_path):
    """The check after a round (its model is the global one already): nothing taken, nothing counted."""
    sync, ctx, events, honest, _ = sybil_swarm(tmp_path, "a", ["a", "b"])
    assert sync.resync("behind the swarm") == Resynced.doubted
    assert all(torch.equal(p, q) for p, q in zip(ctx.params, honest.params))  # the global copy
    assert ctx.outer.checksum() == honest.checksum()


def test_keys_that_outvote_our_checksum_and_serve_nothing_do_not_replace_our_state(tmp_path):
    """Three extra keys vote a made-up checksum of our own epoch against two honest peers: "disagreed with the
    majority's checksum"; nobody serves it, the keys are doubted, and the round goes on from our state."""
    sync, ctx, events, honest, records = sybil_swarm(tmp_path, "a", ["a", "b"], epoch=3, ghosts=3)
    lie = [record(k, 3, checksums=[(3, BAD)]) for k in ("ghost0", "ghost1", "ghost2")]
    records[2:] = lie  # the liar stays out: only keys that serve nothing
    assert sync.resync_needed(3, last_round_local=False).reason == ResyncReason.disagreed
    model = [p.clone() for p in ctx.params]
    assert sync.resync("disagreed", keep_model_if_doubted=True) == Resynced.doubted
    assert [(e.peers, e.epoch) for e in events if isinstance(e, ClaimDoubted)] == [(3, 3)]
    assert all(torch.equal(p, m) for p, m in zip(ctx.params, model)) and ctx.outer.checksum() == honest.checksum()
    assert sync.resync_needed(3, last_round_local=False) is None


def test_a_joiner_downloads_the_honest_state_instead_of_giving_up(tmp_path, monkeypatch):
    monkeypatch.setattr(sync_module.random, "shuffle", lambda donors: donors.sort())
    sync, ctx, events, honest, _ = sybil_swarm(tmp_path, "joiner", ["a"], epoch=4)
    assert ctx.outer.checksum() != honest.checksum()
    sync.catch_up(resumed=False, expect_others=False)
    assert [e.donor for e in events if isinstance(e, StateLoaded)] == ["a"]
    assert ctx.outer.checksum() == honest.checksum() and ctx.outer.epoch == 4
    assert [(e.peers, e.epoch) for e in events if isinstance(e, ClaimDoubted)] == [(2, 4 + AHEAD)]
    failed = [e for e in events if isinstance(e, DownloadFailed)]
    assert {e.donor for e in failed} == {"liar", "ghost0"} and any("older" in e.reason for e in failed)


def test_a_joiner_at_the_seed_of_a_run_still_there_downloads_nothing(tmp_path):
    sync, ctx, events, honest, records = sybil_swarm(tmp_path, "joiner", ["m", "n"], ghosts=0)
    records.pop()  # no liar
    ctx.outer = state(1, epoch=0)  # the seed's weights, as the joiner built them
    sync.checkpoints.save = lambda: None
    sync.catch_up(resumed=False, expect_others=False)
    assert ctx.averager.asked == [] and ctx.outer.checksum() == honest.checksum()
    assert [e.reason for e in events if e.kind == "initialized"] == ["the swarm holds the seed"]


def test_a_joiner_at_the_seed_doubts_a_liar_whose_vote_won_the_tie(tmp_path):
    """One honest peer and one liar voting a made-up checksum of epoch 0: a tie, which goes to the lower id, the
    liar's. It serves its real (honest) state, so it is distrusted, then doubted; the joiner holds the seed."""
    sync, ctx, events, honest, records = sybil_swarm(tmp_path, "joiner", ["m"], ghosts=0)
    records[-1] = record("liar", 0, checksums=[(0, BAD)])  # "liar" < "m": its checksum wins the tie
    ctx.outer = state(1, epoch=0)
    sync.checkpoints.save = lambda: None
    sync.catch_up(resumed=False, expect_others=False)
    assert ctx.averager.asked == ["liar"] and list(sync.distrusted) == ["liar"]
    assert [(e.peers, e.epoch) for e in events if isinstance(e, ClaimDoubted)] == [(1, 0)]
    assert ctx.outer.checksum() == honest.checksum()


def test_a_joiner_that_only_reaches_the_claimants_still_gives_up(tmp_path):
    from swarm.errors import StateDownloadError

    sync, ctx, events, _, _ = sybil_swarm(tmp_path, "joiner", [], epoch=4)
    seed = ctx.outer.checksum()
    with pytest.raises(StateDownloadError, match="none of them served a verified copy"):
        sync.catch_up(resumed=False, expect_others=False)
    assert not [e for e in events if isinstance(e, ClaimDoubted)] and ctx.outer.checksum() == seed


def test_an_epoch_the_swarm_reached_is_served_and_nobody_is_doubted(tmp_path):
    """Honest peers ahead of us serve the epoch they hold: downloaded at the first pass."""
    ahead = state(1, epoch=3)
    files = {"b": write(tmp_path / "b.st", ahead), "c": write(tmp_path / "c.st", ahead)}
    sync, ctx, events, _, _ = sybil_swarm(tmp_path, "a", ["a"], epoch=2, ghosts=0)
    records = [record("a", 2, checksums=[(2, "a" * 64)])]
    records += [record(p, 3, checksums=[(3, ahead.checksum())]) for p in files]
    ctx.reader.view = lambda: view(*records, doubts=sync.doubts)
    ctx.averager = Donors(files)
    assert sync.resync("behind the swarm", keep_model_if_doubted=True) == Resynced.taken
    assert ctx.outer.epoch == 3 and ctx.outer.checksum() == ahead.checksum()
    assert not [e for e in events if isinstance(e, ClaimDoubted)] and sync.doubts.active == []


# ---- the round ----------------------------------------------------------------------------------------


def test_a_round_whose_resync_found_only_doubted_claims_goes_on_with_its_steps():
    """``OuterRound``'s begin: told it is behind, the re-sync doubts the claim (faked here as the view losing the
    claimants), and the round goes on (None: no report replaces it), its steps kept and its state offered again."""
    from test_last_round_check import MINE, FakePeer

    from swarm.events import PeerStats
    from swarm.round.pipeline import OuterRound
    from swarm.round.steps import RoundSteps

    claimants = [record(k, 7, checksums=[(7, BAD)]) for k in ("x", "y")]
    peer = FakePeer([record("a", 5, checksums=[(5, MINE)]), record("b", 5, checksums=[(5, MINE)]), *claimants], 5, MINE)
    peer.peer_id = "a"

    def resync(why: str, keep_model_if_doubted: bool = False) -> Resynced:
        peer.resyncs.append(why)
        peer.records = peer.records[:2]  # as the doubts leave the claimants out of the view
        return Resynced.doubted

    peer.sync.resync = resync
    announced: list[int] = []
    steps = RoundSteps(inner_step=13, compute_seconds=1.0, started=0.0)
    stats = PeerStats()
    rounds = OuterRound(peer.context(), peer.sync, SimpleNamespace(announce=announced.append), steps, stats, None)
    why = rounds.resync_needed(5)
    assert why.reason == ResyncReason.behind
    seconds: dict[str, float] = {}
    assert rounds._resync_at_begin(seconds, why) is None
    assert announced == [13] and steps.inner_step == 13 and stats.resyncs == 0 and "resync" in seconds
    assert len(peer.resyncs) == 1

    # a claim that still stands after the re-sync (nobody doubted, nobody served): the round is replaced
    peer.records = [*peer.records, *claimants]
    peer.sync.resync = lambda why, keep_model_if_doubted=False: Resynced.failed
    report = rounds._resync_at_begin({}, rounds.resync_needed(5))
    assert report is not None and not report.resynced and not report.counted and steps.inner_step == 0


def test_a_round_given_up_on_a_claim_nobody_serves_ends_local_instead_of_thrown_away():
    """The view said the swarm finished our round without us (keys two epochs ahead) while it matchmade; the re-sync
    found nobody serving that, doubted them, and the round ends as a local one with our own update (None: the caller
    goes on to ``finish``'s local step) instead of a report that throws its work away."""
    from test_last_round_check import MINE, FakePeer

    from swarm.averager.handle import RoundAborted
    from swarm.events import PeerStats
    from swarm.round.flight import Flight
    from swarm.round.pipeline import OuterRound
    from swarm.round.steps import RoundSteps

    claimants = [record(k, 7, checksums=[(7, BAD)]) for k in ("x", "y")]
    peer = FakePeer([record("a", 5, checksums=[(5, MINE)]), record("b", 5, checksums=[(5, MINE)]), *claimants], 5, MINE)
    peer.peer_id = "a"

    def resync(why: str, keep_model_if_doubted: bool = False) -> Resynced:
        peer.resyncs.append((why, keep_model_if_doubted))
        peer.records = peer.records[:2]
        return Resynced.doubted

    peer.sync.resync = resync
    steps = RoundSteps(inner_step=4, compute_seconds=1.0, started=0.0)
    rounds = OuterRound(
        peer.context(), peer.sync, SimpleNamespace(announce=lambda step: None), steps, PeerStats(), None
    )
    flight = Flight(5, samples=32, seconds={}, wait_until=0.0, aborted=RoundAborted("moved on"))
    assert rounds._given_up(flight) is None
    assert flight.aborted is None and "not served" in flight.fallback  # finish steps it as a local round
    assert peer.resyncs == [("the swarm finished this round without us", True)] and "resync" in flight.seconds
    assert steps.inner_step == 4  # nothing thrown away

    # a claim still standing (nobody doubted): the round is replaced, its work not counted
    peer.records = [*peer.records, *claimants]
    peer.sync.resync = lambda why, keep_model_if_doubted=False: Resynced.failed
    report = rounds._given_up(Flight(5, samples=32, seconds={}, wait_until=0.0, aborted=RoundAborted("moved on")))
    assert report is not None and not report.counted and not report.resynced and steps.inner_step == 0
