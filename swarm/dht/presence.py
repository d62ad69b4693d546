"""This peer as the swarm sees it: its signed progress record, and the run's manifest, kept alive.

A background thread re-signs and stores the record every ``interval`` seconds, so it stays alive in the DHT even
while the training thread is blocked in a round; a peer that stops refreshing simply expires, which is how the
swarm notices a vanished volunteer. The same thread republishes the manifest well before it expires, so the run
outlives its creator, and copies the state download's progress into the record.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time

from swarm.dht import calls
from swarm.dht.records import (
    CHECKSUM_HISTORY,
    CONTROL,
    MANIFEST_TTL,
    MAX_DEVICE,
    MAX_NAME,
    MAX_RATE,
    RECORD_TTL,
    EpochChecksum,
    PeerState,
    ProgressRecord,
    bucket_of,
    progress_key,
    write_levels,
)
from swarm.dht.registry import publish_manifest
from swarm.manifest import RunManifest

logger = logging.getLogger(__name__)

PUBLISH_INTERVAL = 2.0


class Presence:
    """Owns this peer's progress record and keeps it fresh in the DHT (and, given one, the run's manifest)."""

    def __init__(
        self,
        dht: hivemind.DHT,
        run_id: str,
        initial: dict[str, Any],
        *,
        interval: float = PUBLISH_INTERVAL,
        ttl: float = RECORD_TTL,
        manifest: RunManifest | None = None,
        download_progress: Callable[[], float] | None = None,
        level: Callable[[], int] = lambda: 0,
    ):
        """``level``: the bucket level this peer's reader reads; the record goes to the buckets of that level and its
        neighbours (``records.write_levels``)."""
        if not 0 < ttl <= RECORD_TTL:  # readers refuse a record set to live longer (``records.fresh``)
            raise ValueError(f"a progress record lives at most {RECORD_TTL} s, not {ttl}")
        self.dht, self.run_id, self.interval, self.ttl = dht, run_id, interval, ttl
        self._level = level
        self.records_written = 0  # records stored so far (one per key per refresh): the peer's DHT traffic
        self._manifest, self._download_progress = manifest, download_progress
        self._manifest_published_at = 0.0
        self._subkey = RSASignatureValidator().local_public_key
        self._lock = threading.Lock()
        self._fields: dict[str, Any] = dict(initial)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="swarm-progress", daemon=True)

    @classmethod
    def of_peer(
        cls,
        dht: hivemind.DHT,
        manifest: RunManifest,
        *,
        name: str,
        device: str,
        interval: float,
        ttl: float,
        download_progress: Callable[[], float],
        level: Callable[[], int] = lambda: 0,
    ) -> Presence:
        """A training peer's presence: the manifest published, the record starting, both refreshed from now on."""
        peer_id = dht.peer_id.to_base58()
        initial = dict(
            peer_id=peer_id,
            name=name or peer_id[-6:],
            device=device,
            epoch=0,
            inner_step=0,
            samples_per_second=0.0,
            tokens_processed=0,
            state=PeerState.starting.value,
            last_loss=None,
            client_mode=bool(dht.client_mode),
            relayed=_relayed(dht),
            checksums=[],
            accusations=[],
        )
        presence = cls(dht, manifest.run_id, initial, interval=interval, ttl=ttl, manifest=manifest,
                       download_progress=download_progress, level=level)  # fmt: skip
        presence.publish_manifest()
        presence.start()
        return presence

    def start(self) -> None:
        self._publish()
        self._thread.start()

    # ---- what the record says ---------------------------------------------------------------------------------

    def update(self, *, publish_now: bool = False, **fields: Any) -> None:
        with self._lock:
            self._fields.update(fields)
        if publish_now:
            self._wake.set()

    def set_state(self, state: PeerState, epoch: int, inner_step: int, publish: bool = False) -> None:
        self.update(state=state.value, epoch=epoch, inner_step=inner_step, publish_now=publish)

    def add_checksum(self, epoch: int, checksum: str) -> None:
        with self._lock:
            history = [c for c in self._fields.get("checksums", []) if c["epoch"] != epoch]
            history.append(EpochChecksum(epoch=epoch, checksum=checksum).dict())
            self._fields["checksums"] = sorted(history, key=lambda c: c["epoch"])[-CHECKSUM_HISTORY:]
        self._wake.set()

    def snapshot(self) -> ProgressRecord:
        with self._lock:
            return ProgressRecord(**within_bounds({**self._fields, "time": time.time()}))

    # ---- publishing -------------------------------------------------------------------------------------------

    def publish_now(self, timeout: float = calls.DHT_TIMEOUT) -> bool:
        return self._publish(timeout=timeout)

    def publish_manifest(self) -> None:
        if self._manifest is not None:
            publish_manifest(self.dht, self._manifest)
            self._manifest_published_at = time.monotonic()

    def _publish(self, ttl: float | None = None, timeout: float = calls.DHT_TIMEOUT) -> bool:
        record = self.snapshot()
        expiration = get_dht_time() + (ttl or self.ttl)
        levels = write_levels(self._level())
        keys = [progress_key(self.run_id, level, bucket_of(record.peer_id, level)) for level in levels]
        self.records_written += len(keys)
        return calls.store_many(self.dht, keys, self._subkey, record.dict(), expiration, timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if not self._stop.is_set():
                self._publish()
                self._on_tick()

    def _on_tick(self) -> None:
        """On the refresh thread: the manifest stays alive even while a round blocks training, and others see how
        far a state download has got."""
        if self._manifest is not None and time.monotonic() - self._manifest_published_at > MANIFEST_TTL / 3:
            self.publish_manifest()
        if self._download_progress is not None:
            self.update(download_progress=min(1.0, max(0.0, self._download_progress())))

    # ---- leaving ----------------------------------------------------------------------------------------------

    def say_leaving(self, timeout: float) -> None:
        self.update(state=PeerState.leaving.value)
        self.publish_now(timeout=timeout)

    def stop(self, final_state: PeerState = PeerState.left, ttl: float = 5.0, timeout: float = 5.0) -> None:
        """Mark this peer as gone: a short-lived final record, then no more refreshes."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)
        self.update(state=final_state.value)
        self._publish(ttl=ttl, timeout=timeout)


def within_bounds(fields: dict[str, Any]) -> dict[str, Any]:
    """Our record's fields made to fit the schema's bounds (``swarm.dht.records``), which would refuse the whole
    record otherwise: a loss that is not finite is published as unknown (None), the speed is kept finite and in range,
    and the name and device lose control characters and are cut to their lengths."""
    fitted = dict(fields)
    loss = fitted.get("last_loss")
    if isinstance(loss, float) and not math.isfinite(loss):
        fitted["last_loss"] = None
    speed = fitted.get("samples_per_second")
    if isinstance(speed, float):
        fitted["samples_per_second"] = 0.0 if math.isnan(speed) else min(MAX_RATE, max(0.0, speed))
    for field, limit in (("name", MAX_NAME), ("device", MAX_DEVICE)):
        if isinstance(fitted.get(field), str):
            fitted[field] = CONTROL.sub("", fitted[field])[:limit]
    return fitted


def _relayed(dht: hivemind.DHT) -> bool:
    """True when others can reach us only through a relay (a /p2p-circuit/ address)."""
    try:
        return any("/p2p-circuit" in str(a) for a in dht.get_visible_maddrs())
    except Exception:
        logger.debug("could not read our visible addresses", exc_info=True)
        return False
