"""An overlapped round leaves its consistency check to the next round's begin; a peer that ends its run after it
checks it before leaving (``Peer.check_last_round``). The real ``OuterRound`` with a fake peer: the records are
real ``SwarmView``s, the re-sync is counted."""

from __future__ import annotations

import time
from types import SimpleNamespace

from test_swarm_view import A, B, C, record

from swarm.dht.records import PeerEntry, PeerState
from swarm.dht.view import build_view, mates_finishing, resync_needed
from swarm.events import PeerStats, RoundOutcome, RoundReport
from swarm.round.consistency import RoundChecks
from swarm.round.pipeline import OuterRound
from swarm.round.steps import RoundSteps
from swarm.state.sync import Resynced

MINE, THEIRS, OLD = "1" * 64, "2" * 64, "3" * 64


class FakePeer:
    """What the round's checks read of a peer (``PeerContext``): its records, epoch and checksum; and a re-sync,
    counted."""

    def __init__(self, records, epoch: int, checksum: str, overlap: bool = True):
        self.records = records
        self.peer_id = A
        averaging = SimpleNamespace(consistency_timeout=1.0, overlap=overlap, allreduce_timeout=1.0, merge_groups=False)
        self.manifest = SimpleNamespace(averaging=averaging)
        self.stop_requested = False
        self.views = 0  # DHT reads
        self.outer = SimpleNamespace(epoch=epoch, checksum=lambda: checksum)
        self.resyncs: list[str] = []
        self.sync = SimpleNamespace(resync_needed=self._resync_needed, resync=self._sync_resync)
        self.late = ()
        self.late_after = float("inf")  # records in ``late`` are seen from this time.monotonic() on

    def context(self) -> SimpleNamespace:
        return SimpleNamespace(
            manifest=self.manifest,
            me=self.peer_id,
            outer=self.outer,
            reader=SimpleNamespace(view=self.view),
            stop_requested=lambda: self.stop_requested,
            set_state=lambda state, publish=False: None,
        )

    def view(self, including=()):
        self.views += 1
        now = time.time()
        records = {r.peer_id: r for r in self.records}
        if time.monotonic() >= self.late_after:
            records.update({r.peer_id: r for r in self.late})
        records = list(records.values())
        return build_view([PeerEntry(r, now + 10) for r in records], now, inner_steps=10, samples_per_step=4)

    def _resync_needed(self, epoch: int, last_round_local: bool = False):
        return resync_needed(self.view(), self.peer_id, epoch, self.outer.checksum(), last_round_local)

    def _resync(self, why: str) -> bool:
        self.resyncs.append(why)
        return True

    def _sync_resync(self, why: str, keep_model_if_doubted: bool = False) -> Resynced:
        return Resynced.taken if self._resync(why) else Resynced.failed


def checks_of(peer: FakePeer) -> RoundChecks:
    return RoundChecks(peer.context(), peer._resync_needed, peer._resync)


def finished(epoch: int, checksum: str) -> RoundReport:
    return RoundReport(epoch=epoch, averaged=True, group_size=3, outcome=RoundOutcome.averaged, checksum=checksum)


def rounds_with_unchecked(peer: FakePeer, epoch: int, checksum: str) -> OuterRound:
    steps = RoundSteps(compute_seconds=1.0, started=0.0)
    rounds = OuterRound(peer.context(), peer.sync, None, steps, PeerStats(), on_findings=lambda findings, epoch: None)
    rounds.checks.unchecked = (finished(epoch, checksum), (A, B, C))  # as ``finish`` leaves an overlapped round
    return rounds


def test_a_last_round_that_left_the_group_is_resynced_before_the_peer_leaves():
    records = [
        record(A, epoch=5, checksums=[(5, MINE)]),
        record(B, epoch=5, checksums=[(5, THEIRS)]),
        record(C, epoch=5, checksums=[(5, THEIRS)]),
    ]
    peer = FakePeer(records, epoch=5, checksum=MINE)
    rounds = rounds_with_unchecked(peer, 5, MINE).checks
    report = rounds.check_unchecked()
    assert report is not None and report.resynced and len(peer.resyncs) == 1, peer.resyncs
    assert "consistency" in report.seconds
    assert rounds.check_unchecked() is None  # checked once


def test_a_last_round_that_agrees_with_the_group_is_kept():
    records = [record(p, epoch=5, checksums=[(5, MINE)]) for p in (A, B, C)]
    peer = FakePeer(records, epoch=5, checksum=MINE)
    report = rounds_with_unchecked(peer, 5, MINE).checks.check_unchecked()
    assert report is not None and not report.resynced and peer.resyncs == []


def test_the_check_waits_for_groupmates_that_have_not_published_yet_but_not_for_ever():
    records = [record(A, epoch=5, checksums=[(5, MINE)]), record(B, epoch=4), record(C, epoch=4)]
    peer = FakePeer(records, epoch=5, checksum=MINE)
    t0 = time.monotonic()
    report = rounds_with_unchecked(peer, 5, MINE).checks.check_unchecked()
    waited = time.monotonic() - t0
    assert report is not None and not report.resynced  # nobody else holds epoch 5: nothing to go by
    assert 0.9 <= waited  # consistency_timeout (1 s) was waited out; an upper bound is not asserted (noisy host)


def test_nothing_is_checked_when_no_round_was_left_unchecked_or_the_state_moved_on():
    records = [record(p, epoch=6, checksums=[(6, MINE)]) for p in (A, B, C)]
    peer = FakePeer(records, epoch=6, checksum=MINE)
    assert checks_of(peer).check_unchecked() is None
    moved = rounds_with_unchecked(peer, 5, OLD).checks  # a re-sync or replay took the state past that round
    assert moved.check_unchecked() is None and peer.resyncs == []


def test_the_next_round_waits_for_its_groupmates_checksums_before_its_late_check():
    """Two diverged groupmates landed together: at the next round's begin the other's checksum may not be
    published yet. Seeing only our own vote there is no majority against it, and the two would average on from
    two states for good; begin waits for it (up to consistency_timeout) and re-syncs."""
    records = [record(A, epoch=5, checksums=[(5, MINE)]), record(B, epoch=5), record(C, epoch=5)]
    peer = FakePeer(records, epoch=5, checksum=MINE)
    peer.late = (record(B, epoch=5, checksums=[(5, THEIRS)]), record(C, epoch=5, checksums=[(5, THEIRS)]))
    peer.late_after = time.monotonic() + 0.4
    started = rounds_with_unchecked(peer, 5, MINE).begin()
    assert isinstance(started, RoundReport) and started.outcome == RoundOutcome.resynced, started
    assert len(peer.resyncs) == 1 and "disagreed" in peer.resyncs[0], peer.resyncs


def local(epoch: int, checksum: str) -> RoundReport:
    return RoundReport(epoch=epoch, averaged=False, group_size=1, outcome=RoundOutcome.local, checksum=checksum)


def test_a_blocking_last_round_without_a_group_waits_for_the_peers_still_finishing_it():
    """Our last round found no group and ended local while the two others were still averaging it: they publish
    the state they agree on a moment later, and we re-sync to it before leaving instead of ending on our own."""
    records = [
        record(A, epoch=5, checksums=[(5, MINE)]),
        record(B, epoch=4, state=PeerState.averaging),
        record(C, epoch=4, state=PeerState.averaging),
    ]
    peer = FakePeer(records, epoch=5, checksum=MINE, overlap=False)
    peer.late = (record(B, epoch=5, checksums=[(5, THEIRS)]), record(C, epoch=5, checksums=[(5, THEIRS)]))
    peer.late_after = time.monotonic() + 0.4
    rounds = checks_of(peer)
    rounds.unchecked = (local(5, MINE), (A,))  # as ``finish`` leaves a blocking round that found no group
    report = rounds.check_unchecked()
    assert report is not None and report.resynced and len(peer.resyncs) == 1, peer.resyncs


def test_peers_training_or_at_other_epochs_are_not_finishing_our_round():
    records = [
        record(A, epoch=5, checksums=[(5, MINE)]),
        record(B, epoch=4, state=PeerState.matchmaking),
        record(C, epoch=4, state=PeerState.training),  # a whole round away: not waited for
        record("d" * 8, epoch=3, state=PeerState.averaging),
    ]
    peer = FakePeer(records, epoch=5, checksum=MINE, overlap=False)
    assert mates_finishing(peer.view(), A, 5) == (B,)


def test_a_peer_leaving_after_its_round_serves_its_groupmates_until_they_published_it():
    """``Peer.leave`` without a stop signal (--max-epochs): the averager stays up until the last round's groupmates
    have published that epoch's checksum, since their audits and repairs of our slice fetch from it."""
    peer = FakePeer([record(A, epoch=5, checksums=[(5, MINE)]), record(B, epoch=4)], epoch=5, checksum=MINE)
    peer.late = [record(B, epoch=5, checksums=[(5, MINE)])]  # B publishes a moment later, after its repairs
    peer.late_after = time.monotonic() + 0.5
    peer.manifest.averaging.allreduce_timeout = 60.0  # the window: about 300 reads of the records if waited out
    rounds = checks_of(peer)
    rounds.last_group = (5, (A, B), time.monotonic())
    rounds.serve_last_round(until=time.monotonic() + 60)
    assert time.monotonic() >= peer.late_after  # it did not leave before B was done
    assert peer.views < 100  # and went once B had published (about 3 reads), not at the end of the window


def test_serving_the_last_round_is_bounded_and_a_stop_signal_or_no_group_ends_it_at_once():
    records = [record(A, epoch=5, checksums=[(5, MINE)]), record(B, epoch=4)]  # B never publishes epoch 5
    peer = FakePeer(records, epoch=5, checksum=MINE)
    rounds = checks_of(peer)
    rounds.serve_last_round(until=time.monotonic() + 30)
    assert peer.views == 0  # no averaged round: nobody to serve
    rounds.last_group = (5, (A, B), time.monotonic())
    rounds.serve_last_round(until=time.monotonic() + 30)  # ends with the round's window (allreduce_timeout, 1 s)
    assert peer.views > 1
    peer.views, peer.stop_requested = 0, True
    rounds.last_group = (5, (A, B), time.monotonic())
    rounds.serve_last_round(until=time.monotonic() + 30)
    assert peer.views == 1  # SIGTERM: leave now
