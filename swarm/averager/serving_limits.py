"""How much of this peer's serving one requester may take: state files and rounds' updates (``transfer``).

A state file is the whole model and its momentum; a stranger that asks for it in a loop, or many times at once,
would spend this peer's upload and disk on nothing. Each requester (as libp2p authenticated it) may hold
``per_peer`` streams at once and start at most ``per_minute`` in any minute, and the peer serves at most ``total``
streams at once. Keys are free, so where ``per_network`` is set, the requesters of one network (an IPv4 /24, an IPv6
/48, or one relay: ``swarm.hivemind_fixes.remote_addrs.network_of``) hold at most that many of them at once: one
machine's keys that take streams and read them slowly hold a share, not all; and ``reserved`` of the streams are
only for requesters the caller knows (our last rounds' groupmates, fetching a round's average down the group's
tree), within their networks' shares: strangers from many networks cannot hold those. A request over a limit is
refused at once (the requester tries another donor), never queued.
A pure bookkeeping class, fed a clock, so it is tested without a network.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

NETWORK_SHARE = 16  # of a donor's 64 streams (state files, updates, the swarm's average), at once from one network
GROUPMATES_RESERVE = 16  # of them, kept for the keys of our last rounds' groups (members fetching the average)
GROUPS_KEPT = 3  # first-stage groups whose members are groupmates to the serving (a round's, and the next's)


class ServingLimits:
    def __init__(
        self,
        per_peer: int = 2,
        total: int = 64,  # other groups' delegates, and two children in the group's tree, fetch the swarm's average
        per_minute: int = 60,  # a merging member asks its parent once a second at most (``merge.FETCH_EVERY``)
        per_network: int | None = None,  # streams at once from one network (None: no such limit)
        reserved: int = 0,  # streams only known requesters may take
        clock: Callable[[], float] = time.monotonic,
    ):
        self.per_peer, self.total, self.per_minute, self.clock = per_peer, total, per_minute, clock
        self.per_network, self.reserved = per_network, reserved
        self.open: dict[str, int] = {}
        self.started: dict[str, deque[float]] = {}
        self.networks: dict[str, int] = {}  # streams open per network

    def acquire(self, peer: str, network: str | None = None, known: bool = False) -> bool:
        """Whether ``peer``, on ``network`` (None: unknown), may start a stream now (then ``release`` it, with the
        same network, when the stream ends); a ``known`` requester may take the reserved streams."""
        now = self.clock()
        recent = self.started.get(peer, deque())
        while recent and recent[0] <= now - 60.0:
            recent.popleft()
        if sum(self.open.values()) >= self.total - (0 if known else self.reserved):
            return False
        if self.open.get(peer, 0) >= self.per_peer or len(recent) >= self.per_minute:
            return False
        counted = network is not None and self.per_network is not None
        if counted and self.networks.get(network, 0) >= self.per_network:
            return False  # (a refused key leaves nothing behind: keys are free)
        self.started[peer] = recent
        recent.append(now)
        self.open[peer] = self.open.get(peer, 0) + 1
        if counted:
            self.networks[network] = self.networks.get(network, 0) + 1
        self._forget_idle(now)
        return True

    def release(self, peer: str, network: str | None = None) -> None:
        self.open[peer] = self.open.get(peer, 0) - 1
        if self.open[peer] <= 0:
            del self.open[peer]
        if network is not None and network in self.networks:
            self.networks[network] -= 1
            if self.networks[network] <= 0:
                del self.networks[network]

    def _forget_idle(self, now: float) -> None:
        """Requesters with no stream open and none started in the last minute take no memory."""
        if len(self.started) > 4 * self.total:
            for peer in [p for p, r in self.started.items() if p not in self.open and (not r or r[-1] <= now - 60)]:
                del self.started[peer]


class RecentGroupmates:
    """The members of our last ``GROUPS_KEPT`` first-stage groups, noted as each all-reduce starts (audited or not):
    the peers that fetch a round's average from us down the group's tree, and may take the slots kept for them."""

    def __init__(self) -> None:
        self._groups: deque[frozenset[str]] = deque(maxlen=GROUPS_KEPT)

    def note(self, members: Sequence[str]) -> None:
        """A first stage's ``members`` (none: a second stage, whose delegates fetch from holders of any group)."""
        if members:
            self._groups.append(frozenset(members))

    def __contains__(self, peer: str) -> bool:
        return any(peer in group for group in self._groups)
