"""hivemind's search for a group leader, paced: a peer waiting for groupmates no longer spins.

Works around: ``PotentialLeaders._update_queue_periodically`` reading the DHT in a tight loop while no leader is
known (checked on hivemind 1.1.12, ``averaging/matchmaking.py``).

In hivemind 1.1.12 a follower that knows of no leader (``PotentialLeaders.pop_next_leader``
with an empty queue) asks the queue to refresh and waits for it; the refresh
(``_update_queue_periodically``) reads the DHT and goes straight back to waiting for the next
ask. Each read crosses from the averager process to the DHT process (pickled futures, file
descriptors passed through ``multiprocessing``'s resource sharer), so a peer alone in
matchmaking, or waiting for slower peers, kept both processes busy: measured at 0.5 CPU-seconds
per second each for an idle `tiny` peer, a whole core per peer. On the volunteer's machine that
is a core taken from the data loader and the GPU's feeding; with several peers per host it is
all of them.

hivemind's loop is kept as it is; the key manager it reads through is wrapped so that two reads of
one search are at least ``MIN_READ_INTERVAL`` apart. A leader that declares itself is then seen at
most that much later, well inside any matchmaking time a run can set.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from hivemind.averaging import matchmaking

MIN_READ_INTERVAL = 0.25  # seconds between two DHT reads of one search for a leader

_unpaced = matchmaking.PotentialLeaders._update_queue_periodically


class _PacedKeys:
    """A group key manager whose ``get_averagers`` waits out the rest of MIN_READ_INTERVAL since its last read."""

    def __init__(self, keys: Any) -> None:
        self._keys, self._last_read = keys, float("-inf")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._keys, name)

    async def get_averagers(self, *args: Any, **kwargs: Any) -> Any:
        pause = self._last_read + MIN_READ_INTERVAL - time.monotonic()
        if pause > 0:
            await asyncio.sleep(pause)
        self._last_read = time.monotonic()
        return await self._keys.get_averagers(*args, **kwargs)


async def _update_queue_paced(self: matchmaking.PotentialLeaders, key_manager: Any) -> None:
    await _unpaced(self, _PacedKeys(key_manager))


def pace_matchmaking() -> None:
    """Use the paced refresh in this process (the averager's) from now on."""
    matchmaking.PotentialLeaders._update_queue_periodically = _update_queue_paced
