"""Signed progress records: publishing our own, reading everyone's.

A background thread refreshes this peer's record so that it stays alive in the
DHT even while the training thread is blocked in an all-reduce. A peer that
stops refreshing simply expires, which is how the swarm notices a vanished
volunteer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time

from swarm.dht import calls as dht_calls
from swarm.dht.identity import peer_id_of_owner
from swarm.dht.records import CHECKSUM_HISTORY, EpochChecksum, PeerState, ProgressRecord, progress_key

logger = logging.getLogger(__name__)

PUBLISH_INTERVAL = 2.0
RECORD_TTL = 15.0


@dataclass(frozen=True)
class PeerEntry:
    """A progress record as read back, with when it expires."""

    record: ProgressRecord
    expiration: float


class ProgressReporter:
    """Owns this peer's progress record and keeps it fresh in the DHT."""

    def __init__(
        self,
        dht: hivemind.DHT,
        run_id: str,
        initial: dict[str, Any],
        *,
        interval: float = PUBLISH_INTERVAL,
        ttl: float = RECORD_TTL,
        on_tick: Callable[[], object] = lambda: None,
    ):
        """``on_tick`` runs on the refresh thread after each refresh, for other periodic announcements."""
        self.dht, self.run_id, self.interval, self.ttl = dht, run_id, interval, ttl
        self._on_tick = on_tick
        self._subkey = RSASignatureValidator().local_public_key
        self._lock = threading.Lock()
        self._fields: dict[str, Any] = dict(initial)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="swarm-progress", daemon=True)

    def start(self) -> None:
        self._publish()
        self._thread.start()

    def update(self, *, publish_now: bool = False, **fields: Any) -> None:
        with self._lock:
            self._fields.update(fields)
        if publish_now:
            self._wake.set()

    def add_checksum(self, epoch: int, checksum: str) -> None:
        with self._lock:
            history = [c for c in self._fields.get("checksums", []) if c["epoch"] != epoch]
            history.append(EpochChecksum(epoch=epoch, checksum=checksum).dict())
            self._fields["checksums"] = sorted(history, key=lambda c: c["epoch"])[-CHECKSUM_HISTORY:]
        self._wake.set()

    def snapshot(self) -> ProgressRecord:
        with self._lock:
            return ProgressRecord(**{**self._fields, "time": time.time()})

    def publish_now(self, timeout: float = dht_calls.DHT_TIMEOUT) -> bool:
        return self._publish(timeout=timeout)

    def _publish(self, ttl: float | None = None, timeout: float = dht_calls.DHT_TIMEOUT) -> bool:
        record = self.snapshot()
        expiration = get_dht_time() + (ttl or self.ttl)
        return dht_calls.store(self.dht, progress_key(self.run_id), self._subkey, record.dict(), expiration, timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if not self._stop.is_set():
                self._publish()
                self._on_tick()

    def stop(self, final_state: PeerState = PeerState.left, ttl: float = 5.0, timeout: float = 5.0) -> None:
        """Mark this peer as gone: a short-lived final record, then no more refreshes."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)
        self.update(state=final_state.value)
        self._publish(ttl=ttl, timeout=timeout)


def read_peers(dht: hivemind.DHT, run_id: str) -> list[PeerEntry]:
    """Every well-formed, unexpired progress record of a run whose ``peer_id`` is its signer's (``swarm.dht.identity``);
    malformed and mismatched ones are dropped."""
    return parse_peers(dht_calls.get(dht, progress_key(run_id)))


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

    def __init__(self, dht: hivemind.DHT, run_id: str, max_age: float = 1.0, timeout: float = dht_calls.DHT_TIMEOUT):
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
