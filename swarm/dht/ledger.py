"""Keys this peer holds apart for a number of its own rounds: a bounded memory, the same for every reason.

A key is held until our epoch has passed the one it was noted at by ``rounds``, twice as long each time the same
key is noted again (up to ``max_rounds``: an honest peer that once failed is not shut out for good), and at most
``max_keys`` keys are remembered (a stranger can make keys: the oldest go first). Used for the keys that vouched for
a state nobody served (``swarm.state.doubts``) and the keys we waited for that did not come
(``swarm.round.no_shows``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass
class _Held:
    until: int  # our epoch at which the key is let back
    times: int  # how often it was noted


class EpochLedger:
    """The keys held apart now; ``epoch()`` is ours."""

    def __init__(self, epoch: Callable[[], int], rounds: int, max_rounds: int, max_keys: int):
        self._epoch, self.rounds, self.max_rounds, self.max_keys = epoch, rounds, max_rounds, max_keys
        self._held: dict[str, _Held] = {}

    def add(self, peers: Iterable[str], epoch: int) -> int:
        """Hold ``peers`` apart, noted at ``epoch``; how many of our rounds the longest hold lasts."""
        longest = 0
        for peer in peers:
            held = self._held.pop(peer, None)
            times = held.times + 1 if held is not None else 1
            rounds = min(self.max_rounds, self.rounds << min(times - 1, 16))
            if len(self._held) >= self.max_keys:
                self._held.pop(next(iter(self._held)))  # the oldest
            self._held[peer] = _Held(until=epoch + rounds, times=times)  # last in insertion order
            longest = max(longest, rounds)
        return longest

    def holds(self, peer: str) -> bool:
        held = self._held.get(peer)
        return held is not None and self._epoch() < held.until

    @property
    def active(self) -> list[str]:
        return [peer for peer in self._held if self.holds(peer)]

    def __bool__(self) -> bool:
        return bool(self._held)
