"""One outer round's averaging while it is under way (``OuterRound`` drives it), and the failures of a round
that come from other machines and the network rather than from a bug of ours."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException
from hivemind.p2p import P2PDaemonError, P2PHandlerError

from swarm.averager.process import AllReduceOutcome, Averaging, RoundAborted

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
    stage_times: dict[str, float] = field(default_factory=dict)
    stand_in: list[torch.Tensor] | None = None  # overlapped: the step the local model took ahead of the group
    outcome: AllReduceOutcome | None = None
    fallback: str | None = None  # why the group's average is not used
    aborted: RoundAborted | None = None
    done: bool = False
    blocking: bool = False  # the training loop waits on it: its checks may read the DHT, not only the feed
