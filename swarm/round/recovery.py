"""What a round does when it cannot finish as planned: the peer is leaving, or the swarm finished the round
without us (an overlapped round adopts the swarm's average by replay; otherwise, or failing that, a re-sync), or
our state is not the swarm's. A mixin of ``OuterRound``: its state (the context, the sync, the stats) is the
round's."""

from __future__ import annotations

import time

from swarm.dht.records import PeerState
from swarm.dht.view import Resync, ResyncReason
from swarm.events import PeerStats, RoundFinished, RoundOutcome, RoundReport
from swarm.round.flight import Flight
from swarm.round.landing import add_steps
from swarm.round.steps import RoundSteps
from swarm.state.checkpoints import Checkpoints
from swarm.state.context import PeerContext
from swarm.state.sync import Resynced, StateSync


class RoundRecovery:
    ctx: PeerContext
    sync: StateSync
    checkpoints: Checkpoints
    steps: RoundSteps
    stats: PeerStats
    last_round_local: bool
    _last_average: tuple[int, int] | None

    def resync_needed(self, epoch: int) -> Resync | None:
        return self.sync.resync_needed(epoch, self.last_round_local)

    def resync(self, why: str, keep_model_if_doubted: bool = False) -> Resynced:
        """Take the swarm's state instead of ours (``StateSync.resync``)."""
        result = self.sync.resync(why, keep_model_if_doubted)
        if result == Resynced.taken:
            self.stats.resyncs += 1
            self.last_round_local = False
        return result

    def _resync_at_begin(self, seconds: dict[str, float], why: Resync) -> RoundReport | None:
        """A round's begin found our state is not the swarm's: re-sync, or (None) go on with the round when nobody
        served the state the view said is the swarm's and the view without the keys that vouched for it says ours is
        (``swarm.state.doubts``): the round's steps are kept, and our state is offered again."""
        t0 = time.monotonic()
        result = self.resync(str(why), keep_model_if_doubted=True)  # doubted: the view now says ours is the swarm's
        if result != Resynced.doubted:
            return self._resynced_report(seconds, str(why), t0, result, reason=why.reason)
        seconds["resync"] = time.monotonic() - t0
        self.checkpoints.announce(self.steps.inner_step)
        self.ctx.set_state(PeerState.training, True)
        return None

    def _given_up(self, flight: Flight) -> RoundReport | None:
        """A round given up on: the peer is leaving (nothing applied), or the swarm finished it without us
        (overlapped: adopt its average; otherwise, or failing that, take the swarm's state). None when nothing of
        that round reached us and nobody served the state the swarm was said to be at: the keys that said so are
        doubted (``swarm.state.doubts``), and the round goes on to ``finish``'s local step with our own update."""
        ctx = self.ctx
        if flight.aborted.leaving:  # keep the last agreed state: it is what a restart resumes from
            ctx.set_state(PeerState.leaving, True)
            return RoundReport(
                epoch=flight.epoch,
                averaged=False,
                group_size=1,
                outcome=RoundOutcome.abandoned,
                fallback_reason="the peer is leaving",
                checksum=ctx.outer.checksum(),
                seconds=flight.seconds,
            )
        before = (ctx.outer.epoch, ctx.outer.checksum())
        if flight.stand_in is not None:  # overlapped: keep the steps taken since, on the swarm's average
            adopted = self._adopt_round(flight)
            if adopted is not None:
                return adopted
        # our pseudo-gradient is for a round that is over: take the swarm's state
        why, t0 = "the swarm finished this round without us", time.monotonic()
        if (ctx.outer.epoch, ctx.outer.checksum()) != before:  # a replay moved the state, then broke: re-sync
            return self._resync_round(flight.seconds, why, reason=ResyncReason.behind)
        result = self.resync(why, keep_model_if_doubted=True)  # the buffers still hold our own pseudo-gradient
        if result == Resynced.doubted:
            flight.seconds["resync"] = time.monotonic() - t0
            flight.aborted, flight.fallback = None, "the swarm's claim to have finished it was not served"
            return None
        return self._resynced_report(flight.seconds, why, t0, result, reason=ResyncReason.behind)

    def _adopt_round(self, flight: Flight) -> RoundReport | None:
        """The swarm finished our round without us (overlapped): its average, replayed (``Replay.adopt``), moves the
        outer state and the model less our stand-in step, and every inner step taken since stays (damped first, the
        model would be unusable if the replay then failed and no re-sync replaced it). None: the caller re-syncs."""
        ctx, t0 = self.ctx, time.monotonic()
        with ctx.shield():
            add_steps(ctx.params, flight.stand_in, -1.0)  # the model is the global one plus our inner steps again
            flight.stand_in = None
        self._last_average = None
        if not self.sync.replay.adopt(ctx.params):
            return None
        flight.seconds.update(matchmaking=0.0, allreduce=0.0, audit=0.0, outer=0.0, resync=time.monotonic() - t0)
        self.last_round_local = False
        self.stats.rounds += 1
        report = RoundReport(
            epoch=ctx.outer.epoch,
            averaged=False,
            group_size=1,
            outcome=RoundOutcome.adopted,
            fallback_reason="the swarm finished this round without us: its average was applied",
            checksum=ctx.outer.checksum(),
            samples=flight.samples,
            seconds=flight.seconds,
        )
        self.checkpoints.announce(self.steps.inner_step)
        ctx.set_state(PeerState.training, True)
        ctx.emit(RoundFinished(report))
        return report

    def _resync_round(
        self,
        seconds: dict[str, float],
        why: str,
        outcome: RoundOutcome = RoundOutcome.resynced,
        reason: ResyncReason | None = None,
    ) -> RoundReport:
        t0 = time.monotonic()
        return self._resynced_report(seconds, why, t0, self.resync(why), outcome, reason)

    def _resynced_report(
        self,
        seconds: dict[str, float],
        why: str,
        t0: float,
        result: Resynced,
        outcome: RoundOutcome = RoundOutcome.resynced,
        reason: ResyncReason | None = None,
    ) -> RoundReport:
        """The report of a round replaced by a re-sync (begun at ``t0``): its work is not in the swarm's state."""
        self._last_average = None
        resynced = result == Resynced.taken
        seconds.update(matchmaking=0.0, allreduce=0.0, audit=0.0, outer=0.0, resync=time.monotonic() - t0)
        self.steps.begin()
        return RoundReport(
            epoch=self.ctx.outer.epoch,
            averaged=False,
            group_size=1,
            outcome=outcome,
            fallback_reason=why,
            resynced=resynced,
            resync_reason=reason if resynced else None,
            checksum=self.ctx.outer.checksum(),
            seconds=seconds,
            counted=False,  # the swarm's state replaced this round's: its work is not in it
        )
