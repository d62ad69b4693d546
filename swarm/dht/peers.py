"""Everyone's progress records: read on demand, or in the background for the training thread; and the swarm view
they give.

A record is kept only if it is well formed, unexpired, and its ``peer_id`` is its signer's (``swarm.dht.identity``).
``SwarmReader`` builds the view the rules read (``swarm.dht.view``) after the caller's own filter (a peer drops the
peers it banned).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import hivemind
from hivemind.utils import get_dht_time

from swarm.dht import calls
from swarm.dht.identity import peer_id_of_owner
from swarm.dht.records import PeerEntry, ProgressRecord, progress_key
from swarm.dht.view import SwarmView, build_view

logger = logging.getLogger(__name__)


def read_peers(dht: hivemind.DHT, run_id: str) -> list[PeerEntry]:
    """Every well-formed, unexpired progress record of a run whose ``peer_id`` is its signer's (``swarm.dht.identity``);
    malformed and mismatched ones are dropped."""
    return parse_peers(calls.get(dht, progress_key(run_id)))


def parse_peers(found: Any) -> list[PeerEntry]:
    """``read_peers``'s rules, applied to what a DHT read of the run's progress key returned (None: nothing)."""
    if found is None or not isinstance(found.value, dict):
        return []
    now = get_dht_time()
    entries = []
    for subkey, item in found.value.items():
        if item.value is None or item.expiration_time < now:
            continue
        try:
            record = ProgressRecord.parse_obj(item.value)
        except ValueError:
            continue
        if record.peer_id != peer_id_of_owner(subkey):  # posing as another peer, or as a second one
            continue
        entries.append(PeerEntry(record, item.expiration_time))
    return entries


class PeerFeed:
    """Everyone's progress records for the training thread's frequent checks, read without waiting on the DHT.

    ``latest()`` returns the newest copy read so far (None before the first has arrived) and, when that copy
    is older than ``max_age``, starts the next read, which the DHT process answers into a future. A read not
    answered within ``timeout`` is given up and another one started. A blocking read costs the caller a round
    trip through the DHT process and its neighbours (7 ms median, 22 ms at worst on this project's 2-core test
    host under load), and these checks run once a second and whenever matchmaking is polled.
    """

    def __init__(self, dht: hivemind.DHT, run_id: str, max_age: float = 1.0, timeout: float = calls.DHT_TIMEOUT):
        self.dht, self.key, self.max_age, self.timeout = dht, progress_key(run_id), max_age, timeout
        self._future: Any = None
        self._started = 0.0
        self._read_at = -float("inf")
        self._entries: list[PeerEntry] | None = None

    def latest(self) -> list[PeerEntry] | None:
        now = time.monotonic()
        if self._future is not None:
            if self._future.done():
                self._entries = self._collect(self._future)
                self._read_at, self._future = self._started, None
            elif now - self._started > self.timeout:  # the DHT process did not answer: try again
                logger.debug("a background read of %s took over %.0f s; starting another", self.key, self.timeout)
                self._future = None
        if self._future is None and now - self._read_at >= self.max_age:
            try:
                self._future = self.dht.get(self.key, latest=True, return_future=True)
                self._started = now
            except Exception:  # a DHT that is shutting down: no new copy, the last one stands
                logger.debug("could not start a read of %s", self.key, exc_info=True)
                self._read_at = now
        return self._entries

    def _collect(self, future: Any) -> list[PeerEntry] | None:
        try:
            return parse_peers(future.result(timeout=0))
        except Exception:
            logger.debug("a background read of %s failed", self.key, exc_info=True)
            return self._entries


class SwarmReader:
    """One run's records and view, for a peer: ``view()`` reads the DHT now, ``recent_view()`` takes the newest copy
    ``PeerFeed`` read in the background (about a second old at most; None before the first arrived). ``keep``
    drops records before the view is built (a peer's bans); ``entries()`` is every live record, for dashboards."""

    def __init__(
        self,
        dht: hivemind.DHT,
        run_id: str,
        inner_steps: int,
        samples_per_step: int,
        keep: Callable[[list[PeerEntry]], list[PeerEntry]] = lambda entries: entries,
    ):
        self.dht, self.run_id, self._keep = dht, run_id, keep
        self._inner_steps, self._samples_per_step = inner_steps, samples_per_step
        self.feed = PeerFeed(dht, run_id)

    def entries(self) -> list[PeerEntry]:
        return read_peers(self.dht, self.run_id)

    def view(self) -> SwarmView:
        return self._build(self.entries())

    def recent_view(self) -> SwarmView | None:
        entries = self.feed.latest()
        return None if entries is None else self._build(entries)

    def _build(self, entries: list[PeerEntry]) -> SwarmView:
        return build_view(self._keep(entries), get_dht_time(), self._inner_steps, self._samples_per_step)
