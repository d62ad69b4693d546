"""This peer as the swarm sees it: its signed progress record and the run's manifest, kept alive.

A background thread refreshes the record every few seconds, so it stays alive
even while the training thread is blocked in a round, and republishes the
manifest well before it expires, so the run outlives its creator.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import hivemind

from swarm.dht.progress import ProgressReporter
from swarm.dht.records import PeerState
from swarm.dht.registry import MANIFEST_TTL, publish_manifest
from swarm.manifest import RunManifest

logger = logging.getLogger(__name__)


class Presence:
    def __init__(
        self,
        dht: hivemind.DHT,
        manifest: RunManifest,
        *,
        name: str,
        device: str,
        interval: float,
        ttl: float,
        download_progress: Callable[[], float],
    ):
        self.dht, self.manifest = dht, manifest
        self._download_progress = download_progress
        self._manifest_published_at = 0.0
        self.publish_manifest()
        peer_id = dht.peer_id.to_base58()
        self.reporter = ProgressReporter(
            dht,
            manifest.run_id,
            dict(
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
                relayed=self._relayed(),
                checksums=[],
                accusations=[],
            ),
            interval=interval,
            ttl=ttl,
            on_tick=self._on_tick,
        )
        self.reporter.start()

    def publish_manifest(self) -> None:
        publish_manifest(self.dht, self.manifest)
        self._manifest_published_at = time.monotonic()

    def update(self, *, publish_now: bool = False, **fields: Any) -> None:
        self.reporter.update(publish_now=publish_now, **fields)

    def set_state(self, state: PeerState, epoch: int, inner_step: int, publish: bool = False) -> None:
        self.reporter.update(state=state.value, epoch=epoch, inner_step=inner_step, publish_now=publish)

    def add_checksum(self, epoch: int, checksum: str) -> None:
        self.reporter.add_checksum(epoch, checksum)

    def say_leaving(self, timeout: float) -> None:
        self.reporter.update(state=PeerState.leaving.value)
        self.reporter.publish_now(timeout=timeout)

    def stop(self, timeout: float) -> None:
        """A short-lived final ``left`` record, then no more refreshes."""
        self.reporter.stop(PeerState.left, timeout=timeout)

    def _relayed(self) -> bool:
        """True when others can reach us only through a relay (a /p2p-circuit/ address)."""
        try:
            return any("/p2p-circuit" in str(a) for a in self.dht.get_visible_maddrs())
        except Exception:
            logger.debug("could not read our visible addresses", exc_info=True)
            return False

    def _on_tick(self) -> None:
        """On the reporter's thread: the manifest stays alive even while a round blocks training, and
        others see how far a state download has got."""
        if time.monotonic() - self._manifest_published_at > MANIFEST_TTL / 3:
            self.publish_manifest()
        self.reporter.update(download_progress=min(1.0, max(0.0, self._download_progress())))
