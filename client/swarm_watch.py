"""A background thread that keeps an up-to-date picture of the swarm for the dashboard and the logs.

Reading the DHT takes milliseconds to seconds, so it never happens on the
training thread nor on the dashboard's render thread: this thread polls, and
everyone else reads its latest snapshot. It also remembers peers, so a peer that
left fades out of the table instead of vanishing, and joins and leaves become
events: one by one while they are few, summed up ("12 peers joined: ...") when a
read brings many or they keep coming, so a swarm of a thousand peers does not
flood the event log.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from client.telemetry import Telemetry
from swarm import ProgressRecord, RunManifest, SwarmView
from swarm.dht.records import PeerEntry
from swarm.dht.view import GONE_STATES
from swarm.observer import view_of

FADE_SECONDS = 60.0  # how long a departed peer stays (dimmed) in the table
POLL_INTERVAL = 1.0
BURST = 3  # joins and leaves one read announces peer by peer; more become one line per kind
RATE, WINDOW = 6, 60.0  # peer-by-peer announcements per WINDOW seconds; past that, changes are held...
HOLD = 15.0  # ...and summed up once they have waited this long
NAMED = 3  # peers a summary names before "and N more"
# kind of change: (event kind, one peer's message, a summary's words)
_CHANGES = {
    "joined": ("joined", "{label} joined ({device})", "joined"),
    "back": ("joined", "{label} is back", "are back"),
    "left": ("left", "{label} left", "left"),
    "vanished": ("left", "{label} vanished (its record expired)", "vanished (their records expired)"),
}


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
        self._told: deque[float] = deque()  # when the peer-by-peer announcements of the last WINDOW went out
        self._held: list[tuple[str, ProgressRecord]] = []  # changes to sum up, held since ``_held_since``
        self._held_since = 0.0

    def update(self, entries: list[PeerEntry], now: float) -> list[tuple[str, str]]:
        changes: list[tuple[str, ProgressRecord]] = []  # (kind of change, record), for ``_announce``
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
                    changes.append(("joined", record))
                continue
            known.record = record
            if peer_id == self.self_id:
                continue
            if leaving and not known.gone:
                known.gone_since, known.gone_reason = now, "left"
                changes.append(("left", record))
            elif not leaving and known.gone:
                known.gone_since, known.gone_reason = None, ""
                changes.append(("back", record))
        for peer_id, known in self.peers.items():
            if peer_id not in present and not known.gone and peer_id != self.self_id:
                known.gone_since, known.gone_reason = now, "vanished"
                changes.append(("vanished", known.record))
        for peer_id in [p for p, k in self.peers.items() if k.gone and now - k.gone_since > FADE_SECONDS]:
            del self.peers[peer_id]
        events = self._announce(changes, now)
        others = [p for p in self.peers if p != self.self_id]
        if self._first_update and others:
            events.append(("found", f"found {len(others)} other peer(s) in the run"))
        self._first_update = False
        return events

    def _announce(self, changes: list[tuple[str, ProgressRecord]], now: float) -> list[tuple[str, str]]:
        """Peer by peer while few (``BURST`` a read, ``RATE`` a minute); else one line per kind of change: at once
        for a burst, and ``HOLD`` seconds after the first held change for a steady stream."""
        while self._told and now - self._told[0] > WINDOW:
            self._told.popleft()
        if not self._held and len(changes) <= BURST and len(self._told) + len(changes) <= RATE:
            self._told.extend([now] * len(changes))
            return [_one(change, record) for change, record in changes]
        if not self._held:
            self._held_since = now
        self._held.extend(changes)
        if len(changes) <= BURST and now - self._held_since < HOLD:
            return []
        held, self._held = self._held, []
        by_change: dict[str, list[ProgressRecord]] = {}
        for change, record in held:
            by_change.setdefault(change, []).append(record)
        return [_summed(change, records) for change, records in by_change.items()]

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

    def stop(self, timeout: float = 15.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)

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


def _one(change: str, record: ProgressRecord) -> tuple[str, str]:
    kind, message, _ = _CHANGES[change]
    return kind, message.format(label=_label(record), device=record.device)


def _summed(change: str, records: list[ProgressRecord]) -> tuple[str, str]:
    """One line for many peers' same change: "12 peers joined: a (1a2b3c), b (4d5e6f), c (7a8b9c) and 9 more"."""
    if len(records) == 1:
        return _one(change, records[0])
    kind, _, words = _CHANGES[change]
    named = ", ".join(_label(r) for r in records[:NAMED])
    more = f" and {len(records) - NAMED} more" if len(records) > NAMED else ""
    return kind, f"{len(records)} peers {words}: {named}{more}"
