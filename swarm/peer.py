"""A DiLoCo peer: the object a training loop calls after every inner step.

The loop owns the model, the data and the inner AdamW optimizer; the peer owns everything that involves other
machines: joining, catching up, the outer round every H inner steps, keeping the global model consistent with the
swarm, its state files, and leaving. Every network wait in here is bounded, so a volunteer who vanishes at any
moment costs the others at most the timeouts of the manifest.

The peer composes the engine's parts and none of them holds it: ``connect`` builds the
DHT side (the averager process, this peer's record, its bans, the swarm reader), ``start``
the state side (the outer state, checkpoints, the state download, the outer round), each
given a ``PeerContext`` with just what it uses. One round, from here: ``report_step``
counts a step; at the H-th, ``run_outer_round`` lands the round still in flight (if any)
and ``OuterRound.begin``s the next; ``OuterRound.poll`` advances it between steps, and
``OuterRound.finish`` applies it in named phases (``swarm.round.pipeline``).

Memory, per parameter: the global copy and its momentum (8 bytes), the shared pseudo-gradient buffer (4), and while
a round runs the averaged values as they came off the wire (2 in FP16). ``connect`` forks the averager process
before the model exists, so that process shares none of the model's pages.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import hivemind
import torch

from swarm.averager.process import PseudoGradientAverager, start_averager
from swarm.defence.bans import BanList, Guard
from swarm.dht.access import check_access
from swarm.dht.network import NetworkConfig, start_dht
from swarm.dht.peers import SwarmReader
from swarm.dht.presence import PUBLISH_INTERVAL, RECORD_TTL, Presence
from swarm.dht.records import PeerState, run_validator
from swarm.dht.view import SwarmView
from swarm.errors import LeaveRequested
from swarm.events import Banned, Left, PeerEvent, PeerStats, RoundOutcome, RoundReport, StateChanged
from swarm.hivemind_fixes.helpers import check_alive
from swarm.hivemind_fixes.orphans import install_orphan_reaper
from swarm.manifest import RunManifest
from swarm.round.early_end import EarlyEnd
from swarm.round.flight import Flight
from swarm.round.pipeline import OuterRound
from swarm.round.steps import RoundSteps
from swarm.state.checkpoints import Checkpoints
from swarm.state.context import PeerContext
from swarm.state.doubts import Doubts
from swarm.state.outer import OuterState
from swarm.state.sync import Resynced, StateSync

logger = logging.getLogger(__name__)

LEAVE_SECONDS = 10.0  # the most leave() spends telling others and stopping its processes
# an overlapped round's outcomes that leave the steps taken meanwhile in place (a re-sync replaces them)
_LANDED = (RoundOutcome.averaged, RoundOutcome.local, RoundOutcome.skipped, RoundOutcome.adopted)

Listener = Callable[[PeerEvent], None]


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
        self._shield, self._state_extra = shield, state_extra
        self.name, self.device = name, device
        self._listener = listener or (lambda event: None)
        self._progress_interval, self._progress_ttl = progress_interval, progress_ttl
        self.stats = PeerStats()
        self._steps = RoundSteps()
        self._speed = 0.0  # samples per second, smoothed
        self._shapes: list[tuple[int, ...]] = []  # of the parameters, as connected
        self._connected = self._started = self._stopped = self._stop_requested = False
        # set up by connect: the averager process, this peer's record, its bans, everyone's records
        self.averager: PseudoGradientAverager | None = None
        self._presence: Presence | None = None
        self._guard: Guard | None = None
        self._doubts = Doubts(lambda: self.epoch)  # keys that vouched for a state nobody served (swarm.state.doubts)
        self._reader: SwarmReader | None = None
        self._early_end: EarlyEnd | None = None
        # set up by start: the global model, its files, the state download and the outer round
        self._outer: OuterState | None = None
        self._checkpoints: Checkpoints | None = None
        self._sync: StateSync | None = None
        self._rounds: OuterRound | None = None
        self._flight: Flight | None = None  # a round averaging in the background (overlapped)
        self._landing = False  # a round's average being applied (its record still says matchmaking or averaging)
        self._in_round = False  # inside run_outer_round: matchmaking, all-reduce, outer step or consistency check
        self._reports: deque[RoundReport] = deque()
        self.abandoned_round = False  # a stop signal arrived in the middle of a round

    # ---- what the program running the peer may read --------------------------------------------

    @property
    def dht(self) -> hivemind.DHT:
        assert self._dht is not None, "the peer is not connected"
        return self._dht

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def outer(self) -> OuterState | None:
        """The global model (parameters, momentum, epoch, checksum) once started; None before."""
        return self._outer

    @property
    def epoch(self) -> int:
        return self._outer.epoch if self._outer is not None else 0

    @property
    def inner_step(self) -> int:
        """Inner steps taken in the round under way."""
        return self._steps.inner_step

    @property
    def flight(self) -> Flight | None:  # the overlapped round in the air while the loop trains (take-off, landing)
        return self._flight

    @property
    def round_in_background(self) -> bool:
        """An overlapped round is in the air, or landing between two steps, while the loop trains: its record says
        matchmaking or averaging (for the others' matchmaking), though this peer is not waiting for it."""
        return (self._flight is not None or self._landing) and not self._in_round

    @property
    def download_progress(self) -> float:
        return self.averager.download_progress if self.averager is not None else 0.0

    def checkpoint_written(self, timeout: float = 0.0) -> bool:  # no state file left to write (waits up to timeout)
        return self._checkpoints is None or self._checkpoints.store.wait_idle(timeout)

    @property
    def latest_checkpoint(self) -> Path | None:
        latest = self._checkpoints.store.latest if self._checkpoints is not None else None
        return latest.path if latest is not None else None

    def set_micro_batch(self, size: int) -> None:
        """Say in this peer's record how many samples a forward pass takes here."""
        self._presence.update(micro_batch=size)

    def view(self) -> SwarmView:
        """The swarm as the rules see it: banned and doubted peers are not in it (no donor, vote or mate of ours)."""
        return self._reader.view()

    # ---- lifecycle -----------------------------------------------------------------------------

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
        check_access(self.run_id, self.manifest.access, getattr(self.dht, "run_secret", None))
        self.dht.add_validators([run_validator(self.run_id)])
        self._shapes = [tuple(shape) for shape in shapes]
        self.averager = start_averager(self.dht, self._shapes, self.manifest, self.state_dir)
        m, keep = self.manifest, (lambda e: self._doubts.filter(self._guard.filter(e)))
        args = (self.dht, self.run_id, m.inner_steps, m.samples_per_step)
        self._reader = SwarmReader(*args, keep=keep, banned=lambda p: p in self._guard.bans, me=self.peer_id)
        # only now the record's thread: a fork while another thread is inside a DHT call can leave the child
        # with a half-written pipe message or a lock held by a thread it does not have
        self._presence = Presence.of_peer(
            self.dht,
            m,
            name=self.name,
            device=self.device,
            interval=self._progress_interval,
            ttl=self._progress_ttl,
            download_progress=lambda: self.download_progress,
            level=lambda: self._reader.cache.level,
        )
        self._guard = Guard(
            BanList(self.state_dir / "bans.json"),
            self.peer_id,
            publish=lambda accusations: self._presence.update(accusations=accusations, publish_now=True),
            refuse=self.averager.set_bans,
            announce=lambda ban: self._emit(Banned(ban)),
            check=self.averager.check_average_proof,  # a wrong average, shown by its accuser
        )
        self._early_end = EarlyEnd(m, self.peer_id, lambda: self._rounds.waiting_view())  # joining rounds early
        self._connected = True

    def start(self, model: torch.nn.Module, resume: Path | None = None) -> None:
        """Catch up with the swarm before the first inner step.

        ``resume`` is a state file from an earlier run of this peer (``swarm.state.store.find_latest``):
        it is kept if the swarm is empty or agrees with it, and replaced by a download otherwise.
        """
        params = [p for p in model.parameters()]
        shapes = [tuple(p.shape) for p in params]
        if not self._connected:
            self.connect(shapes)
        if shapes != self._shapes:
            raise ValueError("the model's parameters do not have the shapes the peer was connected with")
        outer = OuterState(params, self.manifest.outer)
        if self.manifest.averaging.compression.error_feedback:
            outer.keep_residual()
        stopping = lambda: self._stop_requested  # noqa: E731
        ctx = PeerContext(self.manifest, self.peer_id, outer, params, self.averager, self._reader,
                          self._emit, self._set_state, self._shield, stopping)  # fmt: skip
        self._outer = outer
        client_mode = bool(self.dht.client_mode)
        self._checkpoints = Checkpoints(ctx, self.state_dir, self._presence, self._state_extra, client_mode)
        self._sync = StateSync(ctx, self._checkpoints, begin_round=self._steps.begin, doubts=self._doubts)
        self._rounds = OuterRound(ctx, self._sync, self._checkpoints, self._steps, self.stats, self._guard.on_findings)
        self._started = True
        resumed = self._sync.load_file(resume) if resume is not None else False
        self._sync.catch_up(resumed=resumed, expect_others=bool(self.dht.initial_peers))
        self._checkpoints.announce(self.inner_step)  # catching up left the state in a file: ours, or the download
        self._set_state(PeerState.training, publish=True)
        self._steps.started = time.monotonic()

    def leave(self, timeout: float = LEAVE_SECONDS) -> bool:
        """Mark this peer as gone, wait (up to ``timeout``) for the newest state file to be on disk, stop the
        averager and the DHT, and leave no p2pd behind. Returns whether the newest state file was written."""
        if self._stopped:
            return True
        self._stopped = True
        deadline = time.monotonic() + timeout
        remaining = lambda: max(0.5, deadline - time.monotonic())  # noqa: E731
        if self._flight is not None:  # an overlapped round still averaging: nothing of it was applied
            self.abandoned_round, self._flight = True, None
        elif self._rounds is not None and not self._stop_requested:  # unhurried: groupmates may need us still
            self._rounds.checks.serve_last_round(until=deadline - 5.0)
        if self._presence is not None:
            self._presence.say_leaving(timeout=min(2.0, remaining()))
        if self.averager is not None:
            try:
                self.averager.allow_state_sharing = False
            except Exception:
                logger.debug("could not turn state sharing off", exc_info=True)
            self.averager.shutdown()
        store = self._checkpoints.store if self._checkpoints is not None else None
        if store is not None:
            store.discard_downloads()
        saved = store.close(timeout=remaining()) if store is not None else True
        if self._presence is not None:
            self._presence.stop(timeout=min(2.0, remaining()))
        if self._owns_dht and self._dht is not None:
            self._dht.shutdown()
        if self._owns_state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)
        self._emit(Left(checkpoint_written=saved))
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
        self._steps.count(samples, compute_seconds)
        self.stats.tokens_processed += samples * self.manifest.seq_len
        if compute_seconds is not None and compute_seconds > 0:
            rate = samples / compute_seconds
            self._speed = rate if self._speed == 0 else 0.8 * self._speed + 0.2 * rate
        fields: dict[str, Any] = dict(
            inner_step=self.inner_step,
            tokens_processed=self.stats.tokens_processed,
            samples_per_second=float(self._speed),
        )
        if loss is not None and loss == loss:  # not NaN
            fields["last_loss"] = float(loss)
        self._presence.update(**fields)
        if self._flight is not None and self._rounds.poll(self._flight):  # an overlapped round's average arrived
            self._finish_flight()
        in_flight = self._flight is not None
        if self.inner_step >= self.manifest.inner_steps or self._early_end.due(now, self.epoch, self._steps, in_flight):
            self.run_outer_round()
        return self._reports.popleft() if self._reports else None

    def run_outer_round(self) -> None:
        """End the current round: wait for the previous one if it is still averaging (overlapped), then
        begin this one; a blocking round is also waited for and finished here. Reports are queued for
        ``report_step`` to return, one per call."""
        self._in_round = True
        epoch = self.epoch
        try:
            check_alive({"DHT": self._dht, "averager": self.averager})  # else a dead one fails the round 30 s later
            if self._flight is not None:
                t0 = time.monotonic()
                self._rounds.wait(self._flight)
                self._finish_flight(waited=time.monotonic() - t0)
            started = self._rounds.begin()
            if isinstance(started, RoundReport):  # replaced by a re-sync
                self._queue(started)
                return
            self._flight = started
            if not self._rounds.overlapped:
                self._rounds.wait(self._flight)
                self._finish_flight()
        except LeaveRequested:  # a stop signal cut the round short
            self.abandoned_round = self._flight is not None or self.epoch == epoch  # nothing of it was applied
            raise
        finally:
            self._in_round = False

    def settle(self) -> None:
        """Wait for an overlapped round still averaging and apply it now (tests and tools that need the
        outer step at a known point; its report comes out of the next ``report_step``)."""
        if self._flight is not None:
            self._rounds.wait(self._flight)
            self._finish_flight()

    def check_last_round(self) -> RoundReport | None:
        """Before a peer that ends its run leaves: compare the last round's state with its group's, or (a round
        that found no group) with that of the peers still finishing it, waiting up to
        ``averaging.consistency_timeout`` for their checksums, and re-sync if the majority holds another, so a
        finished run ends on the swarm's model. The round's report, or None when there was nothing unchecked
        (a blocking round that averaged was checked as it finished)."""
        return self._rounds.checks.check_unchecked()

    def resync_now(self, reason: str) -> bool:
        """Replace our state with the swarm's (e.g. after repeated NaN losses); False if nobody could serve it."""
        return self._rounds.resync(reason) == Resynced.taken

    def _finish_flight(self, waited: float = 0.0) -> None:
        self._landing = True  # before the flight goes: a reader of the two never sees neither
        flight, self._flight = self._flight, None
        try:
            report = self._rounds.finish(flight)
        finally:
            self._landing = False
        report.seconds["waited"] = waited  # training stood still for the previous round (overlapped)
        if self._rounds.overlapped and report.outcome in _LANDED:  # steps since it took off (a re-sync: none)
            report.steps_late = self.inner_step
        self._queue(report)

    def _queue(self, report: RoundReport) -> None:
        """For ``report_step`` to return, with this peer's DHT traffic so far."""
        report.records_read, report.records_written = self._reader.records_read, self._presence.records_written
        self._reports.append(report)

    # ---- what the parts tell the program -------------------------------------------------------

    def _set_state(self, state: PeerState, publish: bool = False) -> None:
        self._presence.set_state(state, self.epoch, self.inner_step, publish)
        self._emit(StateChanged(state))

    def _emit(self, event: PeerEvent) -> None:
        try:
            self._listener(event)
        except Exception:  # a broken listener must not break training
            logger.exception("swarm event listener failed")
