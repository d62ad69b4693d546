"""One outer round's averaging while it is under way (``OuterRound`` drives it), its timings and its report; and
the failures of a round that come from other machines and the network rather than from a bug of ours."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException
from hivemind.p2p import P2PDaemonError, P2PHandlerError

from swarm.averager.handle import AllReduceOutcome, Averaging, RoundAborted
from swarm.events import RoundOutcome, RoundReport
from swarm.round.merge_state import MergeState

# what other machines and the network do to a round; anything else is a bug of ours
EXPECTED_FAILURES = (
    AllreduceException,
    MatchmakingException,
    TimeoutError,
    asyncio.TimeoutError,
    ConnectionError,
    P2PDaemonError,
    P2PHandlerError,
    RuntimeError,  # hivemind wraps remote failures in it
)


@dataclass
class Flight:
    """One round's averaging, under way in the averager process."""

    epoch: int
    samples: int
    seconds: dict[str, float]
    wait_until: float  # retries stop here (averaging.wait_for_peers)
    attempt: Averaging | None = None
    attempt_started: float = 0.0
    retries: int = 0  # attempts after one that found no group (each in a coarser matchmaking key)
    awaited: frozenset[str] | None = None  # others working towards the round when our first stage ended
    awaited_at: float = 0.0  # (DHT time) ``swarm.round.no_shows``
    stage_times: dict[str, float] = field(default_factory=dict)
    stand_in: list[torch.Tensor] | None = None  # overlapped: the step the local model took ahead of the group
    outcome: AllReduceOutcome | None = None
    fallback: str | None = None  # why the group's average is not used
    aborted: RoundAborted | None = None
    done: bool = False
    blocking: bool = False  # the training loop waits on it: its checks may read the DHT, not only the feed
    merge: MergeState | None = None  # two-stage rounds: the second stage, once the first is over
    join_merge: bool = False  # the first stage was given up because every epoch-mate is merging: join them

    @property
    def merged(self) -> bool:
        """The buffers hold the swarm's average (the second stage's, or the only group's)."""
        return self.merge is not None and self.merge.result is not None

    @property
    def contributors(self) -> int:
        """The peers whose pseudo-gradients the buffers' average holds."""
        if self.merged:
            return self.merge.contributors
        return len(self.outcome.group) if self.outcome is not None and self.fallback is None else 1

    def time_stages(self, now: float) -> None:
        """Into ``seconds``: matchmaking, the all-reduce (timed in the averager process when it ran there, since
        an overlapped host looks only once per inner step), the landing until ``now``, and the audits within."""
        outcome = self.outcome
        t_allreduce, t_ready = self.stage_times.get("RUNNING_ALLREDUCE", now), now
        if outcome is not None and outcome.allreduce_started is not None:
            t_allreduce, t_ready = outcome.allreduce_started, outcome.allreduce_finished
        self.seconds["matchmaking"] = t_allreduce - self.attempt_started
        self.seconds["allreduce"] = t_ready - t_allreduce
        self.seconds["landing"] = now - t_ready  # the average ready, until the host took it (overlapped: a step's end)
        self.seconds["audit"] = outcome.audit_seconds if outcome is not None else 0.0  # within the all-reduce

    def report(self, epoch: int, group: tuple[str, ...], checksum: str) -> RoundReport:
        """What the finished round did: averaged with ``group``, or not (``fallback`` says why), reaching ``epoch``
        with ``checksum``."""
        outcome, merge = self.outcome, self.merge
        adopted = self.merged and not merge.counted  # the swarm's average holds the other groups' work, not ours
        averaged = self.fallback is None and not adopted and (outcome is not None or self.merged)
        skipped = outcome is not None and self.fallback is not None  # a group's values, not used
        apart = merge is not None and merge.fallback is not None  # stepped without the swarm's average
        kind = RoundOutcome.averaged if averaged else RoundOutcome.skipped if skipped else RoundOutcome.local
        return RoundReport(
            epoch=epoch,
            averaged=averaged,
            group_size=len(group),
            outcome=RoundOutcome.adopted if adopted else kind,
            fallback_reason=self.fallback or (merge.fallback if merge else None),
            dropped_fraction=outcome.dropped_fraction if outcome is not None else 0.0,
            checksum=checksum,
            samples=self.samples,
            seconds=self.seconds,
            bytes_sent=(outcome.bytes_sent if outcome is not None else 0) + (merge.bytes_sent if merge else 0),
            bytes_received=(outcome.bytes_received if outcome else 0) + (merge.bytes_received if merge else 0),
            audit_bytes=outcome.audit_bytes if outcome is not None else 0,
            repair_failures=outcome.repair_failures if outcome is not None else (),
            merged_groups=merge.groups if self.merged else 1,
            merge_source=merge.source if self.merged else None,
            counted=not adopted and not skipped and not apart,
        )
