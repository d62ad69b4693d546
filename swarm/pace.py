"""hivemind's search for a group leader, paced: a peer waiting for groupmates no longer spins.

In hivemind 1.1.12 a follower that knows of no leader (``PotentialLeaders.pop_next_leader``
with an empty queue) asks the queue to refresh and waits for it; the refresh
(``_update_queue_periodically``) reads the DHT and goes straight back to waiting for the next
ask. Each read crosses from the averager process to the DHT process (pickled futures, file
descriptors passed through ``multiprocessing``'s resource sharer), so a peer alone in
matchmaking, or waiting for slower peers, kept both processes busy: measured at 0.5 CPU-seconds
per second each for an idle `tiny` peer, a whole core per peer. On the volunteer's machine that
is a core taken from the data loader and the GPU's feeding; with several peers per host it is
all of them.

The loop below is hivemind's, with one change: two reads of the same search are at least
``MIN_READ_INTERVAL`` apart. A leader that declares itself is then seen at most that much later,
well inside any matchmaking time a run can set.
"""

from __future__ import annotations

import asyncio
import time
from math import isfinite

from hivemind.averaging import matchmaking

MIN_READ_INTERVAL = 0.25  # seconds between two DHT reads of one search for a leader

_original = matchmaking.PotentialLeaders._update_queue_periodically


async def _update_queue_paced(self: matchmaking.PotentialLeaders, key_manager) -> None:
    discrepancy = matchmaking.MAX_DHT_TIME_DISCREPANCY_SECONDS
    while matchmaking.get_dht_time() < self.search_end_time:
        read_at = time.monotonic()
        new_peers = await key_manager.get_averagers(key_manager.current_key, only_active=True)
        self.max_assured_time = max(
            self.max_assured_time, matchmaking.get_dht_time() + self.min_matchmaking_time - discrepancy
        )
        self.leader_queue.clear()
        for peer, peer_expiration_time in new_peers:
            if peer == self.peer_id or (peer, peer_expiration_time) in self.past_attempts:
                continue
            self.leader_queue.store(peer, peer_expiration_time, peer_expiration_time)
            self.max_assured_time = max(self.max_assured_time, peer_expiration_time - discrepancy)
        self.update_finished.set()

        left = self.search_end_time - matchmaking.get_dht_time()
        await asyncio.wait(
            {asyncio.create_task(self.running.wait()), asyncio.create_task(self.update_triggered.wait())},
            return_when=asyncio.ALL_COMPLETED,
            timeout=left if isfinite(self.search_end_time) else None,
        )
        self.update_triggered.clear()
        pause = MIN_READ_INTERVAL - (time.monotonic() - read_at)
        if pause > 0:
            await asyncio.sleep(pause)


def pace_matchmaking() -> None:
    """Use the paced refresh in this process (the averager's) from now on."""
    matchmaking.PotentialLeaders._update_queue_periodically = _update_queue_paced


def unpaced() -> None:
    """hivemind's own refresh again (for the tests that compare the two)."""
    matchmaking.PotentialLeaders._update_queue_periodically = _original
