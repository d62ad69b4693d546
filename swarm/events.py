"""What an outer round reports: its outcome, as a type the loop branches on, and its figures."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class PeerEvent(enum.StrEnum):
    """What a peer tells its listener (``Peer(listener=...)``), with a dict of details."""

    state = "state"  # state: the PeerState value
    left = "left"  # checkpoint_written
    round = "round"  # report: the RoundReport
    averaging_error = "averaging_error"  # reason: a bug in averaging (the round went local); details in the log
    resync = "resync"  # reason, epoch
    initialized = "initialized"  # epoch, reason
    checkpoint_unusable = "checkpoint_unusable"  # path, reason
    download_deferred = "download_deferred"  # eta, expected
    download_started = "download_started"  # donor
    download_failed = "download_failed"  # donor, reason
    state_loaded = "state_loaded"  # donor, epoch, checksum
    replay_started = "replay_started"  # epoch, target
    replayed = "replayed"  # epoch, target
    replay_failed = "replay_failed"  # epoch, reason
    state_saved = "state_saved"  # path, epoch, bytes, seconds
    state_save_failed = "state_save_failed"  # reason
    banned = "banned"  # ban: a swarm.defence.bans.Ban (caught by our audits, or by a quorum of a peer's groupmates)


class ResyncReason(enum.Enum):
    """Why a round was replaced by the swarm's state (``swarm_view.resync_needed``)."""

    behind = "behind the swarm"
    ran_ahead = "ran ahead of the swarm on local rounds"
    disagreed = "disagreed with the majority's checksum"


class RoundOutcome(enum.Enum):
    averaged = "averaged"  # the group's average was applied
    local = "local"  # no usable group: our own pseudo-gradient was applied
    resynced = "resynced"  # the round was replaced by the swarm's state (behind, disagreed, ...)
    adopted = "adopted"  # overlapped, the swarm finished it without us: its average was applied, our steps kept
    skipped = "skipped"  # the group's values could not be used (another epoch, not finite): nothing was applied
    non_finite = "non-finite"  # our pseudo-gradient was not finite: the loop should reset its inner optimizer
    abandoned = "abandoned"  # the peer is leaving: nothing was applied


@dataclass
class RoundReport:
    """What one outer round did, for logs, the dashboard and tests."""

    epoch: int  # the epoch reached by this round
    averaged: bool  # False: the local pseudo-gradient was used
    group_size: int
    outcome: RoundOutcome = RoundOutcome.local
    fallback_reason: str | None = None  # for people: why the round was not averaged
    dropped_fraction: float = 0.0
    resynced: bool = False
    checksum: str = ""
    samples: int = 0
    seconds: dict[str, float] = field(default_factory=dict)  # compute, matchmaking, allreduce, outer, consistency
    bytes_sent: int = 0  # all-reduce tensor payload, framing excluded, as of when our own results were complete
    bytes_received: int = 0
    audit_bytes: int = 0  # checked reducers: parts downloaded to recompute a groupmate's average (seconds["audit"])
    repair_failures: tuple[dict, ...] = ()  # checked reducers: slices that came in part and stayed so (dropped)
    # overlapped: the inner steps taken from the stand-in while the round was in flight (H when it landed at the next
    # round's end); what the overlap costs in loss grows with it (docs/benchmarks.md, section 6). None: blocking
    steps_late: int | None = None
    resync_reason: ResyncReason | None = None  # why the swarm's state replaced this round's (None: it did not)


@dataclass
class PeerStats:
    rounds: int = 0
    averaged_rounds: int = 0
    local_rounds: int = 0
    resyncs: int = 0
    tokens_processed: int = 0


def short_reason(error: BaseException) -> str:
    """The first line of an error, for a report or an event."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text[:200]
