"""A DiLoCo peer: the object a training loop calls after every inner step.

The loop owns the model, the data and the inner AdamW optimizer; the peer owns
everything that involves other machines: joining, catching up, the outer round
every H inner steps, keeping the global model consistent with the swarm, its
state files, and leaving. Every network wait in here is bounded, so a volunteer
who vanishes at any moment costs the others at most the timeouts of the manifest.

Memory, per parameter: the global copy and its momentum (8 bytes), the shared
pseudo-gradient buffer (4), and while a round runs the averaged values as they
came off the wire (2 in FP16). ``connect`` forks the averager process before the
model exists, so that process shares none of the model's pages.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import signal
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import hivemind
import torch
from hivemind.utils import get_dht_time

from swarm.averager.process import PseudoGradientAverager, averager_options
from swarm.defence.bans import BanList, Guard
from swarm.dht.access import check_access
from swarm.dht.network import NetworkConfig, start_dht
from swarm.dht.presence import Presence
from swarm.dht.progress import PUBLISH_INTERVAL, RECORD_TTL, PeerEntry, PeerFeed, read_peers
from swarm.dht.records import PeerState, run_prefix, run_validator
from swarm.dht.view import SwarmView, build_view
from swarm.errors import LeaveRequested
from swarm.events import PeerEvent, PeerStats, RoundOutcome, RoundReport
from swarm.hivemind_fixes.helpers import check_alive
from swarm.hivemind_fixes.orphans import install_orphan_reaper
from swarm.manifest import RunManifest
from swarm.round.early_end import EarlyEnd
from swarm.round.flight import Flight
from swarm.round.pipeline import ERROR_FEEDBACK, OuterRound
from swarm.state.checkpoints import Checkpoints
from swarm.state.outer import OuterState
from swarm.state.store import StateStore
from swarm.state.sync import StateSync

logger = logging.getLogger(__name__)

LEAVE_SECONDS = 10.0  # the most leave() spends telling others and stopping its processes
# an overlapped round's outcomes that leave the steps taken meanwhile in place (a re-sync replaces them)
_LANDED = (RoundOutcome.averaged, RoundOutcome.local, RoundOutcome.skipped, RoundOutcome.adopted)


Listener = Callable[[PeerEvent, dict[str, Any]], None]


class Peer:
    """One training peer of one run.

    ``connect(shapes)`` joins the swarm and starts the averager; ``start(model)`` brings
    the model up to the swarm's state. The model must have been built with
    ``swarm.seeded_init(manifest)`` so that peers who start a run together start from
    the same weights. State files (the checkpoints of the outer state, and what
    joiners download) go to ``state_dir``. ``shield`` is a context manager under which
    the outer state is changed (a loop that stops on signals holds them off there).
    """

    def __init__(
        self,
        manifest: RunManifest,
        network: NetworkConfig | None = None,
        *,
        dht: hivemind.DHT | None = None,
        state_dir: Path | None = None,
        state_extra: Callable[[], dict[str, Any]] = dict,
        shield: Callable[[], AbstractContextManager] = contextlib.nullcontext,
        name: str = "",
        device: str = "cpu",
        listener: Listener | None = None,
        progress_interval: float = PUBLISH_INTERVAL,
        progress_ttl: float = RECORD_TTL,
    ):
        if (network is None) == (dht is None):
            raise ValueError("pass exactly one of network= or dht=")
        self.manifest = manifest
        self.run_id = manifest.run_id
        self._network, self._dht, self._owns_dht = network, dht, dht is None
        self._owns_state_dir = not state_dir  # a temporary one goes when the peer leaves
        self.state_dir = Path(state_dir) if state_dir else Path(tempfile.mkdtemp(prefix=f"swarm-{self.run_id}-"))
        self._shield = shield
        self.checkpoints = Checkpoints(self, state_extra)
        self.name, self.device = name, device
        self._listener = listener or (lambda kind, data: None)
        self._progress_interval, self._progress_ttl = progress_interval, progress_ttl
        self.params: list[torch.Tensor] = []
        self.stats = PeerStats()
        self.inner_step = 0
        self.round_samples = 0
        self.round_started = time.monotonic()
        self.compute_seconds = 0.0
        self._speed = 0.0  # samples per second, smoothed
        self.outer: OuterState | None = None
        self.averager: PseudoGradientAverager | None = None
        self.presence: Presence | None = None
        self.guard: Guard | None = None  # bans (swarm.defence.bans): set up in connect
        self.feed: PeerFeed | None = None  # everyone's records, read in the background: set up in connect
        self.store: StateStore | None = None
        self.sync = StateSync(self)
        self.rounds = OuterRound(self)
        self._buffers: list[torch.Tensor] = []
        self._connected = self._started = self._stopped = self._stop_requested = False
        self.early_end = EarlyEnd(self)  # joining rounds early (averaging.join_rounds_early)
        self.last_round_local = False
        self.in_round = False  # inside run_outer_round: matchmaking, all-reduce, outer step or consistency check
        self.flight: Flight | None = None  # a round averaging in the background (overlapped)
        self.landing = False  # a round's average being applied (its record still says matchmaking or averaging)
        self._reports: deque[RoundReport] = deque()
        self.abandoned_round = False  # a stop signal arrived in the middle of a round

    # ---- lifecycle -----------------------------------------------------------------------------

    @property
    def dht(self) -> hivemind.DHT:
        assert self._dht is not None, "the peer is not connected"
        return self._dht

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    @property
    def epoch(self) -> int:
        return self.outer.epoch if self.outer is not None else 0

    @property
    def client_mode(self) -> bool:
        return bool(self.dht.client_mode)

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    def connect(self, shapes: Sequence[Sequence[int]]) -> None:
        """Join the DHT, announce the run and start the averager over buffers of these parameter shapes.

        Call it before building the model: the averager is a forked process, and a fork made
        while the model exists keeps a private copy of every page the training loop rewrites.
        Call it before starting threads that use the DHT, too (see ``on_connected`` in the client).
        """
        assert not self._connected, "already connected"
        install_orphan_reaper()
        if self._dht is None:
            assert self._network is not None
            self._dht = start_dht(self._network)
        secret = getattr(self.dht, "run_secret", None)
        check_access(self.run_id, self.manifest.access, secret)
        self.dht.add_validators([run_validator(self.run_id)])
        self._buffers = [torch.zeros(tuple(shape)) for shape in shapes]
        handler = signal.getsignal(signal.SIGINT)
        self.averager = PseudoGradientAverager(
            self._buffers,
            self.dht,
            run_id=self.run_id,
            update_dir=self.state_dir,
            secret=secret,
            start=True,
            prefix=run_prefix(self.run_id),
            client_mode=self.dht.client_mode,
            **averager_options(self.manifest.averaging),
        )
        signal.signal(signal.SIGINT, handler)  # hivemind leaves SIGINT ignored in the process that starts it
        # only now the presence thread: a fork while another thread is inside a DHT call can leave the child
        # with a half-written pipe message or a lock held by a thread it does not have
        self.presence = Presence(
            self.dht,
            self.manifest,
            name=self.name,
            device=self.device,
            interval=self._progress_interval,
            ttl=self._progress_ttl,
            download_progress=lambda: self.download_progress,
        )
        self.guard = Guard(
            BanList(self.state_dir / "bans.json"),
            self.peer_id,
            publish=lambda accusations: self.presence.update(accusations=accusations, publish_now=True),
            refuse=self.averager.set_bans,
            announce=lambda ban: self._emit(PeerEvent.banned, dict(ban=ban)),
        )
        self.feed = PeerFeed(self.dht, self.run_id)
        self._connected = True

    def start(self, model: torch.nn.Module, resume: Path | None = None) -> None:
        """Catch up with the swarm before the first inner step.

        ``resume`` is a state file from an earlier run of this peer (``state_store.find_latest``):
        it is kept if the swarm is empty or agrees with it, and replaced by a download otherwise.
        """
        self.params = [p for p in model.parameters()]
        shapes = [tuple(p.shape) for p in self.params]
        if not self._connected:
            self.connect(shapes)
        if shapes != [tuple(b.shape) for b in self._buffers]:
            raise ValueError("the model's parameters do not have the shapes the peer was connected with")
        self.outer = OuterState(self.params, self.manifest.outer)
        if self.manifest.averaging.compression in ERROR_FEEDBACK:
            self.outer.keep_residual()
        self.store = self.checkpoints.open_store()
        self._started = True
        resumed = False
        if resume is not None:
            resumed = self.sync.load_file(resume)
        self.sync.catch_up(resumed=resumed)
        self.checkpoints.announce()  # catching up left the state in a file: ours, or the download
        self._set_state(PeerState.training, publish=True)
        self.round_started = time.monotonic()

    def leave(self, timeout: float = LEAVE_SECONDS) -> bool:
        """Mark this peer as gone, wait (up to ``timeout``) for the newest state file to be on disk, stop the
        averager and the DHT, and leave no p2pd behind. Returns whether the newest state file was written."""
        if self._stopped:
            return True
        self._stopped = True
        deadline = time.monotonic() + timeout
        remaining = lambda: max(0.5, deadline - time.monotonic())  # noqa: E731
        if self.flight is not None:  # an overlapped round still averaging: nothing of it was applied
            self.abandoned_round, self.flight = True, None
        elif self.averager is not None and not self._stop_requested:  # unhurried: groupmates may need us still
            self.rounds.checks.serve_last_round(until=deadline - 5.0)
        if self.presence is not None:
            self.presence.say_leaving(timeout=min(2.0, remaining()))
        if self.averager is not None:
            try:
                self.averager.allow_state_sharing = False
            except Exception:
                logger.debug("could not turn state sharing off", exc_info=True)
            self.averager.shutdown()
        if self.store is not None:
            self.store.discard_downloads()
        saved = self.store.close(timeout=remaining()) if self.store is not None else True
        if self.presence is not None:
            self.presence.stop(timeout=min(2.0, remaining()))
        if self._owns_dht and self._dht is not None:
            self._dht.shutdown()
        if self._owns_state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)
        self._emit(PeerEvent.left, dict(checkpoint_written=saved))
        return saved

    def request_stop(self) -> None:
        """Ask a round or a download in progress to give up, so a leaving peer is not held up."""
        self._stop_requested = True

    # ---- the training loop's side ---------------------------------------------------------------

    def report_step(
        self, samples: int, loss: float | None = None, compute_seconds: float | None = None
    ) -> RoundReport | None:
        """Count one finished inner step; after the H-th, run the outer round and return its report."""
        assert self._started and not self._stopped, "start() the peer first"
        now = time.monotonic()
        self.inner_step += 1
        self.round_samples += samples
        self.stats.tokens_processed += samples * self.manifest.seq_len
        if compute_seconds is not None:
            self.compute_seconds += compute_seconds
            if compute_seconds > 0:
                rate = samples / compute_seconds
                self._speed = rate if self._speed == 0 else 0.8 * self._speed + 0.2 * rate
        fields: dict[str, Any] = dict(
            inner_step=self.inner_step,
            tokens_processed=self.stats.tokens_processed,
            samples_per_second=float(self._speed),
        )
        if loss is not None and loss == loss:  # not NaN
            fields["last_loss"] = float(loss)
        self.presence.update(**fields)
        if self.flight is not None and self.rounds.poll(self.flight):  # an overlapped round's average arrived
            self._finish_flight()
        if self.inner_step >= self.manifest.inner_steps or self.early_end.due(now):
            self.run_outer_round()
        return self._reports.popleft() if self._reports else None

    def run_outer_round(self) -> None:
        """End the current round: wait for the previous one if it is still averaging (overlapped), then
        begin this one; a blocking round is also waited for and finished here. Reports are queued for
        ``report_step`` to return, one per call."""
        self.in_round = True
        epoch = self.epoch
        try:
            check_alive({"DHT": self._dht, "averager": self.averager})  # else a dead one fails the round 30 s later
            if self.flight is not None:
                t0 = time.monotonic()
                self.rounds.wait(self.flight)
                self._finish_flight(waited=time.monotonic() - t0)
            started = self.rounds.begin()
            if isinstance(started, RoundReport):  # replaced by a re-sync
                self._reports.append(started)
                return
            self.flight = started
            if not self.rounds.overlapped:
                self.rounds.wait(self.flight)
                self._finish_flight()
        except LeaveRequested:  # a stop signal cut the round short
            self.abandoned_round = self.flight is not None or self.epoch == epoch  # nothing of it was applied
            raise
        finally:
            self.in_round = False

    def settle(self) -> None:
        """Wait for an overlapped round still averaging and apply it now (tests and tools that need the
        outer step at a known point; its report comes out of the next ``report_step``)."""
        if self.flight is not None:
            self.rounds.wait(self.flight)
            self._finish_flight()

    def check_last_round(self) -> RoundReport | None:
        """Before a peer that ends its run leaves: compare the last round's state with its group's, or (a round
        that found no group) with that of the peers still finishing it, waiting up to
        ``averaging.consistency_timeout`` for their checksums, and re-sync if the majority holds another, so a
        finished run ends on the swarm's model. The round's report, or None when there was nothing unchecked
        (a blocking round that averaged was checked as it finished)."""
        return self.rounds.checks.check_unchecked()

    def _finish_flight(self, waited: float = 0.0) -> None:
        self.landing = True  # before the flight goes: a reader of the two never sees neither
        flight, self.flight = self.flight, None
        try:
            report = self.rounds.finish(flight)
        finally:
            self.landing = False
        report.seconds["waited"] = waited  # training stood still for the previous round (overlapped)
        if self.rounds.overlapped and report.outcome in _LANDED:  # steps since it took off (a re-sync: none)
            report.steps_late = self.inner_step
        self._reports.append(report)

    def resync_now(self, reason: str) -> bool:
        """Replace our state with the swarm's (e.g. after repeated NaN losses); False if nobody could serve it."""
        return self.sync.resync(reason)

    @property
    def round_in_background(self) -> bool:
        """An overlapped round is in the air, or landing between two steps, while the loop trains: its record says
        matchmaking or averaging (for the others' matchmaking), though this peer is not waiting for it."""
        return (self.flight is not None or self.landing) and not self.in_round

    @property
    def download_progress(self) -> float:
        return self.averager.download_progress if self.averager is not None else 0.0

    def view(self) -> SwarmView:
        """The swarm as the rules see it: banned peers are not in it (no donor, vote or mate of ours)."""
        return self._build_view(read_peers(self.dht, self.run_id))

    def recent_view(self) -> SwarmView | None:
        """``view`` from the newest copy of the records read in the background (at most about a second old), for
        the checks the training thread makes between inner steps; None until the first copy has arrived."""
        entries = self.feed.latest()
        return None if entries is None else self._build_view(entries)

    def _build_view(self, entries: list[PeerEntry]) -> SwarmView:
        entries = self.guard.filter(entries)
        return build_view(entries, get_dht_time(), self.manifest.inner_steps, self.manifest.samples_per_step)

    def entries(self) -> list[PeerEntry]:
        """Every live record of the run, including peers that are leaving: for dashboards."""
        return read_peers(self.dht, self.run_id)

    # ---- bookkeeping ---------------------------------------------------------------------------

    def begin_round(self) -> None:
        self.inner_step = 0
        self.round_samples = 0
        self.compute_seconds = 0.0
        self.round_started = time.monotonic()

    def set_state(self, state: PeerState, publish: bool = False) -> None:
        self._set_state(state, publish)

    def shield(self) -> AbstractContextManager:
        return self._shield()

    def _set_state(self, state: PeerState, publish: bool = False) -> None:
        self.presence.set_state(state, self.epoch, self.inner_step, publish)
        self._emit(PeerEvent.state, dict(state=state.value))

    def emit(self, kind: PeerEvent, data: dict[str, Any]) -> None:
        self._emit(kind, data)

    def _emit(self, kind: PeerEvent, data: dict[str, Any]) -> None:
        try:
            self._listener(kind, data)
        except Exception:  # a broken listener must not break training
            logger.exception("swarm event listener failed")
