"""One outer round, as a pipeline: ``begin`` (check, pseudo-gradient, start averaging), ``poll`` or ``wait``
while it runs, ``finish`` (apply, save, announce), and the consistency checks of ``swarm.round.consistency``.

``begin``: a late consistency check of the epoch we are leaving; the pseudo-gradient
written into the averager's buffer (never sent when not finite), with error feedback
for the codecs that use it; then matchmaking and the all-reduce start in the averager
process. In an **overlapped** round the model restarts at once from the global copy moved
by the step our own pseudo-gradient would make (its stand-in: eager updates, arXiv
2502.12996), and training goes on while the round runs; in a **blocking** one the loop
waits.

``poll``: the averaging is retried while epoch-mates are still on their way, given up
when the swarm finished the round without us, and bounded by the manifest's timeouts.

``finish``: the outer step with the group's average or, failing a group, our own
pseudo-gradient (a "local" round, whose step is kept for replay as a group's average is:
``swarm.round.local_update``); a group whose values cannot be used (groupmates at
another epoch, non-finite values) is skipped. An overlapped round moves the model by
the same step and takes the stand-in back, so the inner steps taken meanwhile are kept
on top of the group's step. Then the new state's file,
its checksum, and (blocking) a comparison with the groupmates' checksums.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from swarm.averager.codecs import apply_error_feedback
from swarm.averager.process import RoundAborted, epoch_group_bits
from swarm.dht.records import PeerState
from swarm.dht.view import mates_coming, swarm_moved_on
from swarm.errors import LeaveRequested
from swarm.events import PeerEvent, ResyncReason, RoundOutcome, RoundReport, short_reason
from swarm.manifest import StandIn
from swarm.round.consistency import RoundChecks
from swarm.round.flight import EXPECTED_FAILURES, Flight
from swarm.round.local_update import keep_local_update, round_to_codec

if TYPE_CHECKING:
    from swarm.peer import Peer

logger = logging.getLogger(__name__)
ERROR_FEEDBACK = ("fp4", "sparse")


class OuterRound:
    def __init__(self, peer: Peer):
        self.peer = peer
        # (epoch, group size) while the averaging buffers hold the group's average that moved us to that epoch
        self._last_average: tuple[int, int] | None = None
        self.checks = RoundChecks(peer)  # did the groupmates end our rounds on our state?

    @property
    def overlapped(self) -> bool:
        return self.peer.manifest.averaging.overlap

    # ---- begin ---------------------------------------------------------------------------------

    def begin(self) -> Flight | RoundReport:
        """Start the round; a report instead when it was replaced by a re-sync."""
        peer = self.peer
        seconds: dict[str, float] = {"compute": peer.compute_seconds or (time.monotonic() - peer.round_started)}
        epoch = peer.outer.epoch
        self.checks.before_next_round(epoch)
        why = peer.sync.resync_needed(epoch)  # a late re-check of the last epoch, now that everyone published
        if why is not None:
            return self._resync_round(seconds, str(why), reason=why.reason)
        # no longer training from here: the hand-over below takes seconds at 100M+ in fp4 (error feedback); the
        # record goes out with the next refresh, and at once once the averager has the round
        peer.set_state(PeerState.matchmaking)
        t0 = time.monotonic()
        plan = self._stand_in_plan()  # before our own pseudo-gradient overwrites the last average
        if not self._fill_pseudo_gradient():  # never send NaN/inf to others: take the swarm's state instead
            return self._resync_round(seconds, "non-finite pseudo-gradient", RoundOutcome.non_finite)
        flight = Flight(epoch, peer.round_samples, seconds, time.monotonic() + peer.manifest.averaging.wait_for_peers)
        if self.overlapped:
            # the stand-in comes from the pseudo-gradient as computed, before a codec rounds it: made of fp4's coarse
            # values it put the next inner steps at a noisy point, and what they learnt there to undo the noise
            # stayed after the average replaced it (overlapped fp4 landing 1 step late: 1.065 of blocking, 1.029
            # from the raw values; docs/benchmarks.md, section 6)
            with peer.averager.get_tensors() as buffers:
                flight.stand_in = peer.outer.stand_in(buffers, **plan)
        self._apply_error_feedback()
        seconds["pseudo_gradient"] = time.monotonic() - t0
        if self.overlapped:  # the next round starts at once from the global model moved by the stand-in's step
            with peer.shield():
                peer.outer.write_to(peer.params)
                _add(peer.params, flight.stand_in, 1.0)
            peer.begin_round()
        peer.set_state(PeerState.matchmaking, publish=True)
        self._attempt(flight)
        return flight

    def _stand_in_plan(self) -> dict:
        """How ``OuterState.stand_in`` makes this round's stand-in: ``StandIn.share``, the step of our own
        1/N share of the coming average (N the last group's size); ``blend``, that share plus, for the others',
        the step of the last round's average (still in the buffers, finite, and what moved us to this epoch);
        our own pseudo-gradient's whole step for ``own``, or when there is no last group to go by."""
        last, self._last_average = self._last_average, None
        peer, kind = self.peer, self.peer.manifest.averaging.stand_in
        if not self.overlapped or kind == StandIn.own:
            return {}
        if last is None or last[0] != peer.outer.epoch:  # a local, skipped or replayed round since
            return {}
        if kind == StandIn.share:
            return dict(grad_scale=1.0 / last[1])
        with peer.averager.get_tensors() as buffers:
            return dict(blend_into=peer.outer.stand_in(buffers), weight=1.0 / last[1])

    def _fill_pseudo_gradient(self) -> bool:
        """``global - local`` into the averaging buffers; False if it is not finite."""
        peer = self.peer
        with peer.averager.get_tensors() as buffers:
            peer.outer.pseudo_gradient_into(buffers, peer.params)
            return _all_finite(buffers)

    def _apply_error_feedback(self) -> None:
        """A codec that keeps a residual: add it to the pseudo-gradient in the buffers, round the sum to what
        will be sent, and keep what rounding dropped for the next round."""
        peer = self.peer
        if peer.manifest.averaging.compression in ERROR_FEEDBACK:
            with peer.averager.get_tensors() as buffers, peer.outer.lock:
                apply_error_feedback(buffers, peer.outer.residual, peer.manifest.averaging.compression)
                peer.outer.residual_version += 1

    def _attempt(self, flight: Flight) -> None:
        peer, avg = self.peer, self.peer.manifest.averaging
        flight.stage_times.clear()
        flight.attempt_started = time.monotonic()
        flight.outcome = flight.fallback = None

        def on_stage(stage: str) -> None:
            flight.stage_times.setdefault(stage, time.monotonic())
            if stage == "RUNNING_ALLREDUCE":
                peer.set_state(PeerState.averaging, publish=True)

        flight.attempt = peer.averager.start_averaging(
            weight=float(max(1, flight.samples)),
            gather=dict(epoch=flight.epoch, samples=flight.samples),
            group_bits=epoch_group_bits(flight.epoch),
            timeout=avg.matchmaking_timeout,
            hard_timeout=avg.attempt_limit,
            on_stage=on_stage,
            abort_if=lambda: "moved on" if self._moved_on(flight) else None,
            leaving=lambda: peer.stop_requested,
        )

    def _moved_on(self, flight: Flight) -> bool:
        """Whether the swarm finished this round without us: from the records read in the background while
        inner steps run (they must not wait on the DHT), from the DHT itself once the loop waits for the round
        (a second sooner: an overlapped peer that missed the round still has the next one to catch)."""
        view = self.peer.view() if flight.blocking else self.peer.recent_view()
        return view is not None and swarm_moved_on(view, flight.epoch)

    # ---- while it runs -------------------------------------------------------------------------

    def poll(self, flight: Flight) -> bool:
        """Advance the round; True once it is over (then ``finish`` it)."""
        if flight.done:
            return True
        peer = self.peer
        try:
            if not flight.attempt.poll():
                return False
            outcome = flight.attempt.result()
            epochs = {data.get("epoch") for data in outcome.gathered.values() if isinstance(data, dict)}
            flight.outcome = outcome
            if epochs != {flight.epoch}:
                flight.fallback = f"groupmates were at epochs {sorted(map(str, epochs))}"
        except LeaveRequested:
            raise
        except RoundAborted as e:
            flight.aborted = e
            if not e.leaving:  # a leaving peer writes no buffer
                peer.averager.ensure_idle()  # a cancelled step may still run: the buffers are not ours till it ends
        except Exception as e:  # no group, a vanished groupmate, a timeout; or a bug
            logger.debug("averaging attempt failed", exc_info=True)
            peer.averager.ensure_idle()  # a step that timed out was cancelled: as above
            flight.fallback = short_reason(e)
            if not isinstance(e, EXPECTED_FAILURES):  # a bug is not "no group": say so, and what the log holds
                flight.fallback = f"internal error ({type(e).__name__}: {short_reason(e)}; details in the log)"
                peer.emit(PeerEvent.averaging_error, dict(reason=flight.fallback))
            # epoch-mates still on their way to the round: wait for them rather than step alone and run ahead
            coming = mates_coming(peer.view(), peer.peer_id, flight.epoch)
            if time.monotonic() < flight.wait_until and coming and not peer.stop_requested:
                self._attempt(flight)
                return False
        flight.done = True
        return True

    def wait(self, flight: Flight) -> None:
        flight.blocking = True
        while not self.poll(flight):
            time.sleep(0.02)

    # ---- finish --------------------------------------------------------------------------------

    def finish(self, flight: Flight) -> RoundReport:
        peer = self.peer
        seconds = flight.seconds
        t1 = time.monotonic()
        t_allreduce, t_ready = flight.stage_times.get("RUNNING_ALLREDUCE", t1), t1
        if flight.outcome is not None and flight.outcome.allreduce_started is not None:  # timed where it ran
            t_allreduce, t_ready = flight.outcome.allreduce_started, flight.outcome.allreduce_finished
        seconds["matchmaking"] = t_allreduce - flight.attempt_started
        seconds["allreduce"] = t_ready - t_allreduce
        seconds["landing"] = t1 - t_ready  # the average ready, until the host took it (overlapped: next step's end)
        seconds["audit"] = flight.outcome.audit_seconds if flight.outcome is not None else 0.0  # within all-reduce
        if flight.aborted is not None:
            if flight.aborted.leaving:  # keep the last agreed state: it is what a restart resumes from
                peer.set_state(PeerState.leaving, publish=True)
                return RoundReport(
                    epoch=flight.epoch,
                    averaged=False,
                    group_size=1,
                    outcome=RoundOutcome.abandoned,
                    fallback_reason="the peer is leaving",
                    checksum=peer.outer.checksum(),
                    seconds=seconds,
                )
            if flight.stand_in is not None:  # overlapped: keep the steps taken since, on the swarm's average
                adopted = self._adopt_round(flight)
                if adopted is not None:
                    return adopted
            # our pseudo-gradient is for a round that is over: take the swarm's state
            return self._resync_round(seconds, "the swarm finished this round without us", reason=ResyncReason.behind)

        outcome = flight.outcome
        if outcome is not None and outcome.findings:  # caught reducers: ban them, publish the accusations
            peer.guard.on_findings(outcome.findings, flight.epoch)
        group: tuple[str, ...] = (peer.peer_id,)
        if outcome is not None and flight.fallback is None:
            if self._buffers_finite():
                group = outcome.group
            else:
                flight.fallback = "groupmates sent non-finite values"
        skipped = outcome is not None and flight.fallback is not None  # the buffers hold someone else's values
        kept_setting = peer.manifest.averaging.in_flight_steps_kept
        steps_kept = share_kept(kept_setting, peer.inner_step) if flight.stand_in is not None else 1.0
        with peer.shield():  # a stop signal waits for the outer state to be whole again
            if skipped:
                if peer.outer.residual is not None:
                    for residual in peer.outer.residual:
                        residual.zero_()
            else:
                kept = outcome is None and peer.manifest.averaging.replay_rounds > 0  # local: kept for replay
                compression, held = peer.manifest.averaging.compression, None
                with peer.averager.get_tensors() as buffers:
                    if kept:
                        held = round_to_codec(buffers, compression)
                    peer.outer.step(buffers, shift=peer.params if self.overlapped else None)
                if kept:
                    keep_local_update(peer.averager, peer.outer.epoch - 1, compression, held)
                if not self.overlapped:
                    peer.outer.write_to(peer.params)
            if flight.stand_in is not None:  # the group's step (or none) replaces the one taken ahead
                _add(peer.params, flight.stand_in, -1.0)
                flight.stand_in = None
            if steps_kept != 1.0:  # of the inner steps taken since the round took off, keep only that share
                _damp_steps(peer.params, peer.outer.params, steps_kept)
            peer.outer.checksum()
            peer.checkpoints.save()
        if flight.fallback is None and len(group) > 1:
            self._last_average = (peer.outer.epoch, len(group))
        seconds["outer"] = time.monotonic() - t1

        averaged = flight.fallback is None
        peer.stats.rounds += 1
        peer.last_round_local = not averaged
        if averaged:
            peer.stats.averaged_rounds += 1
        else:
            peer.stats.local_rounds += 1
        kind = RoundOutcome.averaged if averaged else RoundOutcome.skipped if skipped else RoundOutcome.local
        report = RoundReport(
            epoch=peer.outer.epoch,
            averaged=averaged,
            group_size=len(group),
            outcome=kind,
            fallback_reason=flight.fallback,
            dropped_fraction=outcome.dropped_fraction if outcome is not None else 0.0,
            checksum=peer.outer.checksum(),
            samples=flight.samples,
            seconds=seconds,
            bytes_sent=outcome.bytes_sent if outcome is not None else 0,
            bytes_received=outcome.bytes_received if outcome is not None else 0,
            audit_bytes=outcome.audit_bytes if outcome is not None else 0,
            repair_failures=outcome.repair_failures if outcome is not None else (),
        )
        if not self.overlapped:
            peer.begin_round()
        peer.checkpoints.announce()
        peer.set_state(PeerState.training, publish=True)
        peer.emit(PeerEvent.round, dict(report=report))
        self.checks.after_round(report, group, averaged, self.overlapped)
        return report

    def _adopt_round(self, flight: Flight) -> RoundReport | None:
        """The swarm finished our round without us (overlapped): apply its average, as a replay, to the outer
        state and to the model less our stand-in step; the inner steps taken since stay (``StateSync.adopt_round``),
        all of them whatever ``in_flight_steps_kept`` says: damping them first would leave the model unusable if the
        replay then failed and no re-sync could replace it. None when that round cannot be replayed: the caller
        re-syncs."""
        peer, t0 = self.peer, time.monotonic()
        with peer.shield():
            _add(peer.params, flight.stand_in, -1.0)  # the model is the global one plus our inner steps again
            flight.stand_in = None
        self._last_average = None
        if not peer.sync.adopt_round(peer.params):
            return None
        flight.seconds.update(matchmaking=0.0, allreduce=0.0, audit=0.0, outer=0.0, resync=time.monotonic() - t0)
        peer.last_round_local = False
        peer.stats.rounds += 1
        report = RoundReport(
            epoch=peer.outer.epoch,
            averaged=False,
            group_size=1,
            outcome=RoundOutcome.adopted,
            fallback_reason="the swarm finished this round without us: its average was applied",
            checksum=peer.outer.checksum(),
            samples=flight.samples,
            seconds=flight.seconds,
        )
        peer.checkpoints.announce()
        peer.set_state(PeerState.training, publish=True)
        peer.emit(PeerEvent.round, dict(report=report))
        return report

    def _buffers_finite(self) -> bool:
        with self.peer.averager.get_tensors() as buffers:
            return _all_finite(buffers)

    def _resync_round(
        self,
        seconds: dict[str, float],
        why: str,
        outcome: RoundOutcome = RoundOutcome.resynced,
        reason: ResyncReason | None = None,
    ) -> RoundReport:
        peer = self.peer
        self._last_average = None
        t0 = time.monotonic()
        resynced = peer.sync.resync(why)
        seconds.update(matchmaking=0.0, allreduce=0.0, audit=0.0, outer=0.0, resync=time.monotonic() - t0)
        peer.begin_round()
        return RoundReport(
            epoch=peer.epoch,
            averaged=False,
            group_size=1,
            outcome=outcome,
            fallback_reason=why,
            resynced=resynced,
            resync_reason=reason if resynced else None,
            checksum=peer.outer.checksum(),
            seconds=seconds,
        )


def _add(params: Sequence[torch.Tensor], steps: Sequence[torch.Tensor], sign: float) -> None:
    with torch.no_grad():
        for p, step in zip(params, steps):
            p.add_(step.to(p.device, p.dtype), alpha=sign)


DAMP_FROM_STEPS = 2  # an average landing fewer inner steps late keeps them all (see ``share_kept``)


def share_kept(kept: float, steps_late: int) -> float:
    """The share of the inner steps taken since the round took off that stays when its average lands
    ``steps_late`` steps into the next round: ``kept`` (``averaging.in_flight_steps_kept``) from
    ``DAMP_FROM_STEPS`` late, all of them before. In the simulator (``tiny``, fp4, H = 10, five seeds each),
    damping by half cost 1.0% of held-out loss at 1 step late and gained 2.9% at 2 and 10.9% at 5
    (``benchmarks/results/convergence-merge``)."""
    return kept if steps_late >= DAMP_FROM_STEPS else 1.0


def _damp_steps(params: Sequence[torch.Tensor], global_params: Sequence[torch.Tensor], kept: float) -> None:
    """``p <- global + kept * (p - global)``: the model is the global one plus the inner steps taken since the round
    took off; of those, keep ``kept``."""
    with torch.no_grad():
        for p, g in zip(params, global_params):
            g = g.to(p.device, p.dtype)
            p.sub_(g).mul_(kept).add_(g)


def _all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)
