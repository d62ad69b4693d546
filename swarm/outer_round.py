"""One outer round: average the pseudo-gradient with whoever is ready, take the outer step, check.

The steps, in order: a late consistency check of the epoch we are leaving; the
pseudo-gradient written into the averager's buffer (never sent when not finite);
matchmaking and the all-reduce, retried while epoch-mates are still on their way;
the outer step with the group's average or, failing that, our own; then the new
state's file, its checksum, and a comparison with the groupmates' checksums.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from swarm.averaging import RoundAborted, epoch_group_bits
from swarm.records import PeerState
from swarm.rounds import RoundOutcome, RoundReport, short_reason
from swarm.swarm_view import groupmates_published, mates_coming, swarm_moved_on

if TYPE_CHECKING:
    from swarm.peer import Peer

logger = logging.getLogger(__name__)


class OuterRound:
    def __init__(self, peer: Peer):
        self.peer = peer

    def _fill_pseudo_gradient(self) -> bool:
        """Write ``global - local`` into the averaging buffers; False if it is not finite."""
        peer = self.peer
        with peer.averager.get_tensors() as buffers:
            peer.outer.pseudo_gradient_into(buffers, peer.params)
            return _all_finite(buffers)

    def run(self) -> RoundReport:
        """The round; ``Peer.run_outer_round`` is the entry point."""
        peer = self.peer
        assert peer.outer is not None and peer.averager is not None
        avg = peer.manifest.averaging
        seconds: dict[str, float] = {"compute": peer.compute_seconds or (time.monotonic() - peer.round_started)}
        start_epoch = peer.outer.epoch

        # a late re-check of the previous epoch, now that every peer had time to publish it
        why = peer.sync.resync_needed(start_epoch)
        if why is not None:
            return self._resync_round(seconds, str(why))

        t_fill = time.monotonic()
        if not self._fill_pseudo_gradient():  # never send NaN/inf to others: take the swarm's state instead
            return self._resync_round(seconds, "non-finite pseudo-gradient", RoundOutcome.non_finite)
        seconds["pseudo_gradient"] = time.monotonic() - t_fill

        t0 = time.monotonic()
        stage_times: dict[str, float] = {}
        fallback: str | None = None
        group: tuple[str, ...] = (peer.peer_id,)
        dropped = 0.0
        traffic = (0, 0)
        touched = False  # the buffers may hold something other than our own pseudo-gradient

        def on_stage(stage: str) -> None:
            stage_times.setdefault(stage, time.monotonic())
            if stage == "RUNNING_ALLREDUCE":
                peer.set_state(PeerState.averaging, publish=True)

        peer.set_state(PeerState.matchmaking, publish=True)
        wait_until = time.monotonic() + avg.wait_for_peers
        while True:
            fallback = None
            stage_times.clear()
            if touched:
                self._fill_pseudo_gradient()
                touched = False
            try:
                outcome = peer.averager.average(
                    weight=float(max(1, peer.round_samples)),
                    gather=dict(epoch=start_epoch, samples=peer.round_samples),
                    group_bits=epoch_group_bits(start_epoch),
                    timeout=avg.matchmaking_timeout,
                    hard_timeout=avg.matchmaking_timeout + avg.allreduce_timeout + 10,
                    on_stage=on_stage,
                    abort_if=lambda: "moved on" if swarm_moved_on(peer.view(), start_epoch) else None,
                    leaving=lambda: peer.stop_requested,
                )
                touched = True
                epochs = {data.get("epoch") for data in outcome.gathered.values() if isinstance(data, dict)}
                if epochs != {start_epoch}:
                    fallback = f"groupmates were at epochs {sorted(map(str, epochs))}"
                else:
                    group, dropped = outcome.group, outcome.dropped_fraction
                traffic = (outcome.bytes_sent, outcome.bytes_received)
            except RoundAborted as e:
                if e.leaving:  # keep the last agreed state: it is what a restart resumes from
                    peer.set_state(PeerState.leaving, publish=True)
                    return RoundReport(
                        epoch=start_epoch,
                        averaged=False,
                        group_size=1,
                        outcome=RoundOutcome.abandoned,
                        fallback_reason="the peer is leaving",
                        checksum=peer.outer.checksum(),
                        seconds=seconds,
                    )
                # our pseudo-gradient is for a round that is over: take the swarm's state
                return self._resync_round(seconds, "the swarm finished this round without us")
            except Exception as e:  # no group, a vanished groupmate, a timeout
                logger.debug("averaging attempt failed", exc_info=True)
                touched = True  # a failed all-reduce leaves the buffers alone, but a broken reducer might not
                fallback = short_reason(e)
                # epoch-mates still on their way to step H: wait for them rather than step alone and run
                # ahead of the swarm
                coming = mates_coming(peer.view(), peer.peer_id, start_epoch)
                if time.monotonic() < wait_until and coming and not peer.stop_requested:
                    continue
            break
        t1 = time.monotonic()
        t_allreduce = stage_times.get("RUNNING_ALLREDUCE", t1)
        seconds["matchmaking"] = t_allreduce - t0
        seconds["allreduce"] = t1 - t_allreduce

        if fallback is None and not self._buffers_finite():
            fallback, group = "groupmates sent non-finite values", (peer.peer_id,)
        with peer.shield():  # a stop signal waits for the outer state to be whole again
            if fallback is not None and touched:
                self._fill_pseudo_gradient()  # the local update: our own pseudo-gradient
            with peer.averager.get_tensors() as buffers:
                peer.outer.step(buffers)
            peer.outer.write_to(peer.params)
            peer.outer.checksum()
            peer.save_state()
        seconds["outer"] = time.monotonic() - t1

        peer.stats.rounds += 1
        peer.last_round_local = fallback is not None
        if fallback is None:
            peer.stats.averaged_rounds += 1
        else:
            peer.stats.local_rounds += 1
        report = RoundReport(
            epoch=peer.outer.epoch,
            averaged=fallback is None,
            group_size=len(group),
            outcome=RoundOutcome.averaged if fallback is None else RoundOutcome.local,
            fallback_reason=fallback,
            dropped_fraction=dropped,
            checksum=peer.outer.checksum(),
            samples=peer.round_samples,
            seconds=seconds,
            bytes_sent=traffic[0],
            bytes_received=traffic[1],
        )
        peer.begin_round()
        peer.announce_state()
        peer.set_state(PeerState.training, publish=True)
        peer.emit("round", dict(report=report))

        t2 = time.monotonic()
        self._await_groupmates(group, peer.outer.epoch, avg.consistency_timeout)
        why = peer.sync.resync_needed(peer.outer.epoch)
        if why is not None:
            report.resynced = peer.sync.resync(f"after the round: {why}")
            report.checksum = peer.outer.checksum()
            report.epoch = peer.outer.epoch
        seconds["consistency"] = time.monotonic() - t2
        return report

    def _buffers_finite(self) -> bool:
        peer = self.peer
        with peer.averager.get_tensors() as buffers:
            return _all_finite(buffers)

    def _await_groupmates(self, group: Sequence[str], epoch: int, timeout: float) -> None:
        """Give groupmates a moment to publish their checksum for ``epoch`` before comparing."""
        peer = self.peer
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not groupmates_published(peer.view(), group, peer.peer_id, epoch):
            time.sleep(0.2)

    def _resync_round(
        self, seconds: dict[str, float], why: str, outcome: RoundOutcome = RoundOutcome.resynced
    ) -> RoundReport:
        peer = self.peer
        t0 = time.monotonic()
        resynced = peer.sync.resync(why)
        seconds.update(matchmaking=0.0, allreduce=0.0, outer=0.0, resync=time.monotonic() - t0)
        peer.begin_round()
        return RoundReport(
            epoch=peer.epoch,
            averaged=False,
            group_size=1,
            outcome=outcome,
            fallback_reason=why,
            resynced=resynced,
            checksum=peer.outer.checksum(),
            seconds=seconds,
        )


def _all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)
