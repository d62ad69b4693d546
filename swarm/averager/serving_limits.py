"""How much of this peer's serving one requester may take: state files and rounds' updates (``transfer``).

A state file is the whole model and its momentum; a stranger that asks for it in a loop, or many times at once,
would spend this peer's upload and disk on nothing. Each requester (as libp2p authenticated it) may hold
``per_peer`` streams at once and start at most ``per_minute`` in any minute, and the peer serves at most ``total``
streams at once. A request over a limit is refused at once (the requester tries another donor), never queued.
A pure bookkeeping class, fed a clock, so it is tested without a network.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class ServingLimits:
    def __init__(
        self,
        per_peer: int = 2,
        total: int = 64,  # other groups' delegates, and two children in the group's tree, fetch the swarm's average
        per_minute: int = 60,  # a merging member asks its parent once a second at most (``merge.FETCH_EVERY``)
        clock: Callable[[], float] = time.monotonic,
    ):
        self.per_peer, self.total, self.per_minute, self.clock = per_peer, total, per_minute, clock
        self.open: dict[str, int] = {}
        self.started: dict[str, deque[float]] = {}

    def acquire(self, peer: str) -> bool:
        """Whether ``peer`` may start a stream now (then ``release`` it when the stream ends)."""
        now = self.clock()
        recent = self.started.setdefault(peer, deque())
        while recent and recent[0] <= now - 60.0:
            recent.popleft()
        if sum(self.open.values()) >= self.total or self.open.get(peer, 0) >= self.per_peer:
            return False
        if len(recent) >= self.per_minute:
            return False
        recent.append(now)
        self.open[peer] = self.open.get(peer, 0) + 1
        self._forget_idle(now)
        return True

    def release(self, peer: str) -> None:
        left = self.open.get(peer, 0) - 1
        if left > 0:
            self.open[peer] = left
        else:
            self.open.pop(peer, None)

    def _forget_idle(self, now: float) -> None:
        """Requesters with no stream open and none started in the last minute take no memory."""
        if len(self.started) > 4 * self.total:
            for peer in [p for p, r in self.started.items() if p not in self.open and (not r or r[-1] <= now - 60)]:
                del self.started[peer]
