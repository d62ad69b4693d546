"""What a peer tells the program that runs it: typed events, and what an outer round reports.

A listener (``Peer(listener=...)``) gets one ``PeerEvent`` at a time, a frozen dataclass whose type says what
happened and whose fields say the rest; the loop branches on the type (``match event: case DownloadStarted(
donor=d): ...``). Each type's ``kind`` is the name ``--log-json`` and older listeners know it by.

Where this module stands: above ``dht`` (a peer's state, why it re-synced) and ``defence`` (a ban), below
``averager``, ``state`` and ``round``, which emit these events.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from swarm.defence.bans import Ban
from swarm.dht.records import PeerState
from swarm.dht.view import ResyncReason


class RoundOutcome(enum.Enum):
    averaged = "averaged"  # the group's average was applied
    local = "local"  # no usable group: our own pseudo-gradient was applied
    resynced = "resynced"  # the round was replaced by the swarm's state (behind, disagreed, ...)
    adopted = "adopted"  # overlapped, the swarm finished it without us: its average was applied, our steps kept
    skipped = "skipped"  # the group's values could not be used (another epoch, not finite): nothing was applied
    non_finite = "non-finite"  # our pseudo-gradient was not finite: the loop should reset its inner optimizer
    abandoned = "abandoned"  # the peer is leaving: nothing was applied


class MergeSource(enum.Enum):
    """Two-stage rounds: where a peer got the swarm's average it stepped with."""

    held = "held"  # it made it (a second-stage delegate), or it is its own group's average
    groupmate = "groupmate"  # from a member of its group that had it (the group's tree: ``groups.fetch_sources``)
    holder = "holder"  # from a delegate that registered it


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
    merged_groups: int = 1  # two-stage rounds: the groups whose averages the swarm's average of the round holds
    merge_source: MergeSource | None = None  # two-stage rounds: where it came from
    # this peer's pseudo-gradient is in the state the round ended on, and that state is the swarm's: not re-synced,
    # not adopted from other groups, and (two-stage rounds) not stepped with our group's own average for want of it
    counted: bool = True
    records_read: int = 0  # DHT records this peer has read so far (all of them; its traffic, for the benchmarks)
    records_written: int = 0  # and written


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


# ---- events ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerEvent:
    """Something that happened to a peer; the subclasses below are every kind there is."""

    kind: ClassVar[str] = ""


@dataclass(frozen=True)
class StateChanged(PeerEvent):
    kind: ClassVar[str] = "state"
    state: PeerState


@dataclass(frozen=True)
class Left(PeerEvent):
    kind: ClassVar[str] = "left"
    checkpoint_written: bool


@dataclass(frozen=True)
class RoundFinished(PeerEvent):
    kind: ClassVar[str] = "round"
    report: RoundReport


@dataclass(frozen=True)
class AveragingFailed(PeerEvent):
    """A bug in averaging (the round went local); the details are in the log."""

    kind: ClassVar[str] = "averaging_error"
    reason: str


@dataclass(frozen=True)
class Resyncing(PeerEvent):
    kind: ClassVar[str] = "resync"
    reason: str
    epoch: int


@dataclass(frozen=True)
class Initialized(PeerEvent):
    kind: ClassVar[str] = "initialized"
    epoch: int
    reason: str


@dataclass(frozen=True)
class CheckpointUnusable(PeerEvent):
    kind: ClassVar[str] = "checkpoint_unusable"
    path: Path
    reason: str


@dataclass(frozen=True)
class DownloadDeferred(PeerEvent):
    """The state download waits for the swarm's round to end: at the last download's speed it takes ``expected``
    seconds, more than the ``eta`` left of the round."""

    kind: ClassVar[str] = "download_deferred"
    eta: float
    expected: float


@dataclass(frozen=True)
class DownloadStarted(PeerEvent):
    kind: ClassVar[str] = "download_started"
    donor: str


@dataclass(frozen=True)
class DownloadFailed(PeerEvent):
    kind: ClassVar[str] = "download_failed"
    donor: str
    reason: str


@dataclass(frozen=True)
class DonorDistrusted(PeerEvent):
    """A donor served a state file that is not what it voted for (or whose bytes do not match their own header):
    it is not asked for the state again by this peer."""

    kind: ClassVar[str] = "donor_distrusted"
    donor: str
    reason: str


@dataclass(frozen=True)
class AwaitingMajority(PeerEvent):
    """A joiner waits (at most ``seconds``) for a state of the swarm's ``epoch`` that half of the keys hold, and a
    donor still at it: a round ended with its groups apart, and the running peers' re-syncs mend that."""

    kind: ClassVar[str] = "awaiting_majority"
    epoch: int
    seconds: float


@dataclass(frozen=True)
class ClaimDoubted(PeerEvent):
    """Nobody served the state of ``epoch`` that ``peers`` keys vouched for (an epoch ahead of ours, or the majority's
    checksum of ours): they are left out of this peer's view for ``rounds`` rounds past it (``swarm.state.doubts``)."""

    kind: ClassVar[str] = "claim_doubted"
    peers: int
    epoch: int
    rounds: int


@dataclass(frozen=True)
class StateLoaded(PeerEvent):
    kind: ClassVar[str] = "state_loaded"
    donor: str
    epoch: int
    checksum: str


@dataclass(frozen=True)
class ReplayStarted(PeerEvent):
    kind: ClassVar[str] = "replay_started"
    epoch: int
    target: int


@dataclass(frozen=True)
class Replayed(PeerEvent):
    kind: ClassVar[str] = "replayed"
    epoch: int
    target: int
    kept_steps: bool  # one round adopted while the next one's inner steps went on (overlapped)


@dataclass(frozen=True)
class ReplayFailed(PeerEvent):
    kind: ClassVar[str] = "replay_failed"
    epoch: int
    reason: str


@dataclass(frozen=True)
class StateSaved(PeerEvent):
    kind: ClassVar[str] = "state_saved"
    path: Path
    epoch: int
    bytes: int
    seconds: float


@dataclass(frozen=True)
class StateSaveFailed(PeerEvent):
    kind: ClassVar[str] = "state_save_failed"
    reason: str


@dataclass(frozen=True)
class Banned(PeerEvent):
    """A peer banned by us: caught by our audits, or proven guilty by others' accusations (``swarm.defence.bans``)."""

    kind: ClassVar[str] = "banned"
    ban: Ban


EVENT_TYPES: tuple[type[PeerEvent], ...] = tuple(PeerEvent.__subclasses__())
