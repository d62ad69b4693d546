"""A background thread that keeps an up-to-date picture of the swarm for the dashboard and the logs.

Reading the DHT takes milliseconds to seconds, so it never happens on the
training thread nor on the dashboard's render thread: this thread polls, and
everyone else reads its latest snapshot. It also remembers peers, so a peer that
left fades out of the table instead of vanishing, and joins and leaves become
events.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from client.telemetry import Telemetry
from swarm import ProgressRecord, RunManifest, SwarmView
from swarm.dht.records import PeerEntry
from swarm.dht.view import GONE_STATES
from swarm.observer import view_of

FADE_SECONDS = 60.0  # how long a departed peer stays (dimmed) in the table
POLL_INTERVAL = 1.0


@dataclass
class TrackedPeer:
    record: ProgressRecord
    first_seen: float
    gone_since: float | None = None
    gone_reason: str = ""  # "left" (said goodbye) or "vanished" (its record expired)

    @property
    def gone(self) -> bool:
        return self.gone_since is not None


class PeerTracker:
    """Peers seen so far; turns successive reads of the records into joined/left events."""

    def __init__(self, self_id: str | None = None) -> None:
        """``self_id``: our own peer, listed in the table but never announced as joining or leaving."""
        self.peers: dict[str, TrackedPeer] = {}
        self.self_id = self_id
        self._first_update = True

    def update(self, entries: list[PeerEntry], now: float) -> list[tuple[str, str]]:
        events: list[tuple[str, str]] = []
        announce = not self._first_update
        present = {e.record.peer_id: e.record for e in entries}
        for peer_id, record in present.items():
            known = self.peers.get(peer_id)
            leaving = record.state in GONE_STATES
            if known is None:
                if leaving:
                    continue
                self.peers[peer_id] = TrackedPeer(record, now)
                if announce and peer_id != self.self_id:
                    events.append(("joined", f"{_label(record)} joined ({record.device})"))
                continue
            known.record = record
            if peer_id == self.self_id:
                continue
            if leaving and not known.gone:
                known.gone_since, known.gone_reason = now, "left"
                events.append(("left", f"{_label(record)} left"))
            elif not leaving and known.gone:
                known.gone_since, known.gone_reason = None, ""
                events.append(("joined", f"{_label(record)} is back"))
        for peer_id, known in self.peers.items():
            if peer_id not in present and not known.gone and peer_id != self.self_id:
                known.gone_since, known.gone_reason = now, "vanished"
                events.append(("left", f"{_label(known.record)} vanished (its record expired)"))
        for peer_id in [p for p, k in self.peers.items() if k.gone and now - k.gone_since > FADE_SECONDS]:
            del self.peers[peer_id]
        others = [p for p in self.peers if p != self.self_id]
        if self._first_update and others:
            events.append(("found", f"found {len(others)} other peer(s) in the run"))
        self._first_update = False
        return events

    def rows(self) -> list[TrackedPeer]:
        """Live peers first (by name), then departed ones, most recent first."""
        live = sorted((p for p in self.peers.values() if not p.gone), key=lambda p: (p.record.name, p.record.peer_id))
        gone = sorted((p for p in self.peers.values() if p.gone), key=lambda p: -(p.gone_since or 0))
        return live + gone


@dataclass(frozen=True)
class SwarmSnapshot:
    view: SwarmView | None = None
    peers: list[TrackedPeer] = field(default_factory=list)
    updated_at: float = 0.0  # unix time of the read; 0: not read yet


class SwarmWatch:
    def __init__(
        self,
        read_entries: Callable[[], list[PeerEntry]],
        manifest: RunManifest,
        telemetry: Telemetry,
        *,
        interval: float = POLL_INTERVAL,
        announce_epochs: bool = False,
        self_id: str | None = None,
        on_tick: Callable[[SwarmSnapshot], None] = lambda snapshot: None,
    ):
        """``on_tick`` runs on this thread after each read: status file, plain log lines."""
        self._read, self.manifest, self.telemetry = read_entries, manifest, telemetry
        self.interval, self._announce_epochs, self._on_tick = interval, announce_epochs, on_tick
        self.tracker = PeerTracker(self_id)
        self.snapshot = SwarmSnapshot()
        self._last_epoch: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="swarm-watch", daemon=True)

    def start(self) -> SwarmWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=15)

    def poll(self) -> SwarmSnapshot:
        """One read of the records; the thread calls this every ``interval`` seconds."""
        entries = self._read()
        now = time.time()
        view = view_of(self.manifest, entries)
        for kind, message in self.tracker.update(entries, now):
            self.telemetry.event(kind, message)
        if self._announce_epochs and view.global_epoch is not None:
            if self._last_epoch is not None and view.global_epoch > self._last_epoch:
                self.telemetry.event("epoch", f"the swarm reached epoch {view.global_epoch}")
            self._last_epoch = view.global_epoch
        self.snapshot = SwarmSnapshot(view, self.tracker.rows(), now)
        return self.snapshot

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                snapshot = self.poll()
                self._on_tick(snapshot)
            except Exception as e:  # the picture may go stale, but training must not notice
                self.telemetry.event("log", f"swarm view not updated: {e}")
            self._stop.wait(self.interval)


def _label(record: ProgressRecord) -> str:
    return f"{record.name} ({record.peer_id[-6:]})"
