"""One outer round, as a pipeline: ``begin`` (check, hand over the pseudo-gradient, start averaging), ``poll`` or
``wait`` while it runs, ``finish`` (apply, save, announce), and the consistency checks of ``swarm.round.consistency``.

``begin``: a late consistency check of the epoch we are leaving; the pseudo-gradient
written into the averager's buffer (never sent when not finite), with error feedback
for the codecs that use it; then matchmaking and the all-reduce start in the averager
process. In an **overlapped** round the model restarts at once from the global copy moved
by the step our own pseudo-gradient would make (its stand-in: eager updates, arXiv
2502.12996), and training goes on while the round runs; in a **blocking** one the loop
waits.

``poll``: the averaging is retried while epoch-mates are still on their way, given up
when the swarm finished the round without us, and bounded by the manifest's timeouts.

``finish``: the outer step with the group's average or, failing a group, our own pseudo-gradient (a "local"
round, whose step is kept for replay as a group's average is: ``swarm.round.local_update``); a group whose values
cannot be used (another epoch, non-finite values) is skipped. An overlapped round moves the model by the same step
and takes the stand-in back, so the inner steps taken meanwhile are kept on top of the group's step
(``swarm.round.landing``). Then the new state's file, its checksum, and (blocking) a comparison with the
groupmates' checksums.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from hivemind.utils import get_dht_time

from swarm.averager.codecs import apply_error_feedback
from swarm.averager.handle import RoundAborted
from swarm.averager.process import attempt_timeout, epoch_group_bits, matchmaking_bucket
from swarm.dht.records import PeerState
from swarm.dht.view import SwarmView, mates_coming, nobody_to_group_with, swarm_moved_on
from swarm.errors import LeaveRequested
from swarm.events import AveragingFailed, PeerStats, RoundFinished, RoundOutcome, RoundReport, short_reason
from swarm.manifest import StandIn
from swarm.round.consistency import RoundChecks
from swarm.round.flight import EXPECTED_FAILURES, Flight
from swarm.round.gathered import gathered_epochs, gathered_samples
from swarm.round.landing import add_steps, all_finite, damp_steps, share_kept
from swarm.round.local_update import keep_local_update, round_to_codec
from swarm.round.merge import Merger
from swarm.round.no_shows import NoShows, no_shows, working_towards
from swarm.round.recovery import RoundRecovery
from swarm.round.steps import RoundSteps
from swarm.state.checkpoints import Checkpoints
from swarm.state.context import PeerContext
from swarm.state.sync import Resynced, StateSync

logger = logging.getLogger(__name__)


class OuterRound(RoundRecovery):
    """``on_findings(findings, epoch)``: what a round's audits found, for the peer's bans."""

    def __init__(
        self,
        ctx: PeerContext,
        sync: StateSync,
        checkpoints: Checkpoints,
        steps: RoundSteps,
        stats: PeerStats,
        on_findings: Callable[[Sequence[dict], int], None],
    ):
        self.ctx, self.sync, self.checkpoints, self.steps, self.stats = ctx, sync, checkpoints, steps, stats
        self._on_findings = on_findings
        self.overlapped = ctx.manifest.averaging.overlap
        # (epoch, group size) while the averaging buffers hold the group's average that moved us to that epoch
        self._last_average: tuple[int, int] | None = None
        self.last_round_local = False  # our last round stepped alone: we may have run ahead of the swarm
        resync = lambda why: self.resync(why) == Resynced.taken  # noqa: E731
        self.checks = RoundChecks(ctx, self.resync_needed, resync)  # did the groupmates end on our state?
        self.no_shows = NoShows(lambda: ctx.outer.epoch)  # keys we waited for that did not come: not waited for
        merger = Merger(ctx, checkpoints, self.no_shows, lambda: sync.groupmates.keys())
        self.merger = merger if ctx.manifest.averaging.merge_groups else None

    # ---- begin ---------------------------------------------------------------------------------

    def begin(self) -> Flight | RoundReport:
        """Start the round; a report instead when it was replaced by a re-sync."""
        ctx, steps = self.ctx, self.steps
        seconds: dict[str, float] = {"compute": steps.compute_seconds or (time.monotonic() - steps.started)}
        epoch = ctx.outer.epoch
        self.checks.before_next_round(epoch)
        why = self.resync_needed(epoch)  # a late re-check of the last epoch, now that everyone published
        if why is not None and (resynced := self._resync_at_begin(seconds, why)) is not None:
            return resynced
        # no longer training from here: the hand-over below takes seconds at 100M+ in fp4 (error feedback); the
        # record goes out with the next refresh, and at once once the averager has the round
        ctx.set_state(PeerState.matchmaking, False)
        flight = self._hand_over(epoch, seconds)
        if flight is None:  # never send NaN/inf to others: take the swarm's state instead
            return self._resync_round(seconds, "non-finite pseudo-gradient", RoundOutcome.non_finite)
        if self.overlapped:
            self._take_off(flight)
        ctx.set_state(PeerState.matchmaking, True)
        self._attempt(flight)
        return flight

    def _hand_over(self, epoch: int, seconds: dict[str, float]) -> Flight | None:
        """Our pseudo-gradient into the averaging buffers, as it will go on the wire (with the codec's error
        feedback), and an overlapped round's stand-in; None when the pseudo-gradient is not finite."""
        ctx, t0 = self.ctx, time.monotonic()
        plan = self._stand_in_plan()  # before our own pseudo-gradient overwrites the last average
        with ctx.averager.get_tensors() as buffers:
            ctx.outer.pseudo_gradient_into(buffers, ctx.params)
            if not all_finite(buffers):
                return None
        flight = Flight(epoch, self.steps.samples, seconds, time.monotonic() + ctx.manifest.averaging.wait_for_peers)
        if self.overlapped:
            # the stand-in comes from the pseudo-gradient as computed, before a codec rounds it: made of fp4's coarse
            # values it put the next inner steps at a noisy point, and what they learnt there to undo the noise
            # stayed after the average replaced it (overlapped fp4 landing 1 step late: 1.065 of blocking, 1.029
            # from the raw values; benchmarks/results/convergence-rawstandin)
            with ctx.averager.get_tensors() as buffers:
                flight.stand_in = ctx.outer.stand_in(buffers, **plan)
        self._apply_error_feedback()
        seconds["pseudo_gradient"] = time.monotonic() - t0
        return flight

    def _take_off(self, flight: Flight) -> None:
        """Overlapped: the next round starts at once from the global model moved by the stand-in's step."""
        with self.ctx.shield():
            self.ctx.outer.write_to(self.ctx.params)
            add_steps(self.ctx.params, flight.stand_in, 1.0)
        self.steps.begin()

    def _stand_in_plan(self) -> dict:
        """How ``OuterState.stand_in`` makes this round's stand-in: ``StandIn.share``, the step of our own
        1/N share of the coming average (N the last group's size); ``blend``, that share plus, for the others',
        the step of the last round's average (still in the buffers, finite, and what moved us to this epoch);
        our own pseudo-gradient's whole step for ``own``, or when there is no last group to go by."""
        last, self._last_average = self._last_average, None
        ctx, kind = self.ctx, self.ctx.manifest.averaging.stand_in
        if not self.overlapped or kind == StandIn.own:
            return {}
        if last is None or last[0] != ctx.outer.epoch:  # a local, skipped or replayed round since
            return {}
        if kind == StandIn.share:
            return dict(grad_scale=1.0 / last[1])
        with ctx.averager.get_tensors() as buffers:
            return dict(blend_into=ctx.outer.stand_in(buffers), weight=1.0 / last[1])

    def _apply_error_feedback(self) -> None:
        """A codec that keeps a residual: add it to the pseudo-gradient in the buffers, round the sum to what
        will be sent, and keep what rounding dropped for the next round."""
        ctx, compression = self.ctx, self.ctx.manifest.averaging.compression
        if compression.error_feedback:
            with ctx.averager.get_tensors() as buffers, ctx.outer.lock:
                apply_error_feedback(buffers, ctx.outer.residual, compression)
                ctx.outer.residual_version += 1

    def _attempt(self, flight: Flight) -> None:
        ctx, avg = self.ctx, self.ctx.manifest.averaging
        flight.stage_times.clear()
        flight.attempt_started = time.monotonic()
        flight.outcome = flight.fallback = None

        def on_stage(stage: str) -> None:
            flight.stage_times.setdefault(stage, time.monotonic())
            if stage == "RUNNING_ALLREDUCE":
                ctx.set_state(PeerState.averaging, True)

        bucket = self._matchmaking_bucket(flight.retries)
        flight.attempt = ctx.averager.start_averaging(
            weight=float(max(1, flight.samples)),
            gather=dict(epoch=flight.epoch, samples=flight.samples),
            group_bits=epoch_group_bits(flight.epoch, bucket=bucket),
            timeout=attempt_timeout(bucket, avg.matchmaking_time, avg.matchmaking_timeout),
            hard_timeout=avg.attempt_limit(ctx.outer.numel),
            on_stage=on_stage,
            abort_if=lambda: self._why_give_up(flight),
            leaving=ctx.stop_requested,
        )

    def _matchmaking_bucket(self, retries: int) -> str:
        """With two-stage rounds, a large swarm matchmakes in keys of about a group each (merged afterwards); a
        retry in a coarser one."""
        if self.merger is None:
            return ""
        group_size = self.ctx.manifest.averaging.target_group_size
        return matchmaking_bucket(self.ctx.me, self.ctx.reader.peers_estimate, group_size, retries)

    def _why_give_up(self, flight: Flight) -> str | None:
        """Why looking for a group is pointless now, from the records read in the background while inner steps run
        (they must not wait on the DHT), from the DHT once the loop waits (a second sooner): the swarm finished
        this round without us; or (two-stage rounds) every epoch-mate is merging its group's average, so nobody
        is left to form a group with: join their second stage as a group of one (``flight.join_merge``)."""
        view = self.no_shows.waiting_view(self.ctx.reader.view() if flight.blocking else self.ctx.reader.recent_view())
        if view is None:
            return None
        if swarm_moved_on(view, flight.epoch):
            return "moved on"
        if self.merger is not None and nobody_to_group_with(view, self.ctx.me, flight.epoch):
            flight.join_merge = True
            return "the others merge their groups"
        return None

    # ---- while it runs -------------------------------------------------------------------------

    def poll(self, flight: Flight) -> bool:
        """Advance the round; True once it is over (then ``finish`` it)."""
        if flight.done:
            return True
        if flight.merge is not None:  # the second stage: the groups' averages made into the swarm's
            flight.done = self.merger.poll(flight.merge, flight.blocking)
            return flight.done
        ctx = self.ctx
        try:
            if not flight.attempt.poll():
                return False
            self._await_others(flight)
            outcome = flight.attempt.result()
            epochs = gathered_epochs(outcome.gathered)
            flight.outcome = outcome
            if epochs != {flight.epoch}:
                flight.fallback = f"groupmates were at epochs {sorted(map(str, epochs))}"
            elif self.merger is not None:
                samples = gathered_samples(outcome.gathered, ctx.manifest.inner_steps * ctx.manifest.samples_per_step)
                flight.merge = self.merger.after_group(flight.epoch, outcome, samples)
                return False
        except LeaveRequested:
            raise
        except RoundAborted as e:
            if not e.leaving:  # a leaving peer writes no buffer
                ctx.averager.ensure_idle()  # a cancelled step may still run: the buffers are not ours till it ends
            if flight.join_merge and not e.leaving:
                flight.fallback = "no group: joined the others' second stage"
                flight.merge = self.merger.alone(flight.epoch, flight.samples)
                return False
            flight.aborted = e
        except Exception as e:  # no group, a vanished groupmate, a timeout; or a bug
            logger.debug("averaging attempt failed", exc_info=True)
            ctx.averager.ensure_idle()  # a step that timed out was cancelled: as above
            flight.fallback = short_reason(e)
            if not isinstance(e, EXPECTED_FAILURES):  # a bug is not "no group": say so, and what the log holds
                flight.fallback = f"internal error ({type(e).__name__}: {short_reason(e)}; details in the log)"
                ctx.emit(AveragingFailed(flight.fallback))
            if self.merger is not None and not ctx.stop_requested() and self.merger.others_at(flight.epoch):
                flight.merge = self.merger.alone(flight.epoch, flight.samples)  # others formed groups: join them
                return False
            # epoch-mates still on their way to the round: wait for them rather than step alone and run ahead
            coming = mates_coming(self.no_shows.waiting_view(ctx.reader.view()), ctx.me, flight.epoch)
            if time.monotonic() < flight.wait_until and coming and not ctx.stop_requested():
                flight.retries += 1
                self._attempt(flight)
                return False
        flight.done = True
        return True

    def _await_others(self, flight: Flight) -> None:
        """Our first stage is over: note who is still working towards the round (``swarm.round.no_shows``), of the
        keys we wait for (one held already is not held longer for a round nobody waited for it)."""
        if flight.awaited is None and (view := self.waiting_view()) is not None:
            flight.awaited, flight.awaited_at = working_towards(view, self.ctx.me, flight.epoch), get_dht_time()

    def waiting_view(self) -> SwarmView | None:
        """The recent view without the no-shows: what the waits for epoch-mates read (``EarlyEnd`` too)."""
        return self.no_shows.waiting_view(self.ctx.reader.recent_view())

    def wait(self, flight: Flight) -> None:
        flight.blocking = True
        while not self.poll(flight):
            time.sleep(0.02)

    # ---- finish --------------------------------------------------------------------------------

    def finish(self, flight: Flight) -> RoundReport:
        """Apply the round that is over: the phases below, in order."""
        started = time.monotonic()
        flight.time_stages(started)
        if flight.aborted is not None and (given_up := self._given_up(flight)) is not None:
            return given_up
        self._ban_caught_reducers(flight)
        group = self._usable_group(flight)
        self._step(flight)
        if flight.fallback is None and flight.contributors > 1:
            self._last_average = (self.ctx.outer.epoch, flight.contributors)
        flight.seconds["outer"] = time.monotonic() - started
        report = self._count(flight, group)
        self._announce(report)
        self.checks.after_round(report, group, report.averaged, self.overlapped)
        self._note_no_shows(flight)
        self._note_groupmates(flight, report.averaged)
        return report

    def _note_groupmates(self, flight: Flight, averaged: bool) -> None:
        """The groupmates whose parts are in our average (none absent, none caught), and, as a delegate, the
        delegates our second stage ran whole with: our evidence that they train, which lets us take a state they
        hold without a majority's vote (``swarm.state.trust.Groupmates``). A peer's first-stage groupmates are
        mostly its own matchmaking key's; the second stage's reach the other keys."""
        outcome, merge = flight.outcome, flight.merge
        findings = (*(outcome.findings if outcome else ()), *(merge.findings if merge else ()))
        caught = {f.get("peer") for f in findings if f.get("banned")}
        self.sync.groupmates.forget(caught)
        mates = set(merge.partners) if merge is not None else set()
        if outcome is not None and averaged and flight.fallback is None:
            mates |= set(outcome.group) - set(outcome.absent)
        self.sync.groupmates.note(sorted(mates - caught), self.ctx.me)

    def _note_no_shows(self, flight: Flight) -> None:
        """The keys we waited for that are still working towards the round now it is over: not waited for a while."""
        view = self.ctx.reader.recent_view()
        if not flight.awaited or view is None:
            return
        group = flight.outcome.group if flight.outcome is not None else ()
        missed = no_shows(flight.awaited, view, self.ctx.me, flight.epoch, group, flight.awaited_at)
        self.no_shows.note(missed, flight.epoch, "still working towards it after it ended")

    def _ban_caught_reducers(self, flight: Flight) -> None:
        """Reducers our audits caught (in either stage): banned, and the accusations published
        (``swarm.defence.bans``)."""
        findings = (
            *(flight.outcome.findings if flight.outcome else ()),
            *(flight.merge.findings if flight.merge else ()),
        )
        if findings:
            self._on_findings(findings, flight.epoch)

    def _usable_group(self, flight: Flight) -> tuple[str, ...]:
        """The group whose average the buffers hold (or whose swarm's average they hold), or ourselves alone: no
        group, or one whose values cannot be used (``flight.fallback`` then says why)."""
        if flight.merged:  # the swarm's average: a group of one that joined the second stage used it too
            flight.fallback = None
        if flight.outcome is None and not flight.merged or flight.fallback is not None:
            return (self.ctx.me,)
        with self.ctx.averager.get_tensors() as buffers:
            if all_finite(buffers):
                return flight.outcome.group if flight.outcome is not None else (self.ctx.me,)
        flight.fallback = "groupmates sent non-finite values"
        return (self.ctx.me,)

    def _step(self, flight: Flight) -> None:
        """The outer step with what the buffers hold (the group's average, or our own pseudo-gradient), or none for
        a skipped group; an overlapped round's stand-in taken back and its in-flight steps damped; then the new
        state's checksum and file. Under the shield: a stop signal waits for the outer state to be whole again."""
        ctx, avg = self.ctx, self.ctx.manifest.averaging
        skipped = flight.outcome is not None and flight.fallback is not None  # the buffers hold others' values
        local = flight.outcome is None and not flight.merged  # our own pseudo-gradient: kept for replay here
        steps_kept = share_kept(avg.in_flight_steps_kept, self.steps.inner_step) if flight.stand_in is not None else 1.0
        with ctx.shield():
            if skipped:
                ctx.outer.reset_residual()
            else:
                self._outer_step(kept_for_replay=local and avg.replay_rounds > 0)
                if flight.merge is None and flight.outcome is not None:  # one stage: the group's average is final
                    ctx.averager.finalize_update(flight.epoch)
            if flight.stand_in is not None:  # the group's step (or none) replaces the one taken ahead
                add_steps(ctx.params, flight.stand_in, -1.0)
                flight.stand_in = None
            if steps_kept != 1.0:  # of the inner steps taken since the round took off, keep only that share
                damp_steps(ctx.params, ctx.outer.params, steps_kept)
            ctx.outer.checksum()
            self.checkpoints.save()

    def _outer_step(self, kept_for_replay: bool) -> None:
        """Nesterov with the buffers; a local round's step is kept for replay, as a group's average is."""
        ctx, compression, held = self.ctx, self.ctx.manifest.averaging.compression, None
        with ctx.averager.get_tensors() as buffers:
            if kept_for_replay:
                held = round_to_codec(buffers, compression)
            ctx.outer.step(buffers, shift=ctx.params if self.overlapped else None)
        if kept_for_replay:
            keep_local_update(ctx.averager, ctx.outer.epoch - 1, compression, held)
        if not self.overlapped:
            ctx.outer.write_to(ctx.params)

    def _count(self, flight: Flight, group: tuple[str, ...]) -> RoundReport:
        """The round in the peer's stats, and its report."""
        report = flight.report(self.ctx.outer.epoch, group, self.ctx.outer.checksum())
        adopted = report.outcome == RoundOutcome.adopted  # the swarm's average, without ours
        self.stats.rounds += 1
        self.last_round_local = not report.averaged and not adopted
        if report.averaged:
            self.stats.averaged_rounds += 1
        elif not adopted:
            self.stats.local_rounds += 1
        return report

    def _announce(self, report: RoundReport) -> None:
        """The new state's checksum published and its file offered; training again (blocking: a new round)."""
        if not self.overlapped:
            self.steps.begin()
        self.checkpoints.announce(self.steps.inner_step)
        self.ctx.set_state(PeerState.training, True)
        self.ctx.emit(RoundFinished(report))
