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
import enum
import logging
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hivemind
import torch
from hivemind.utils import get_dht_time

from swarm.averaging import COMPRESSIONS, PseudoGradientAverager, RoundAborted, epoch_group_bits
from swarm.errors import LeaveRequested
from swarm.manifest import RunManifest
from swarm.network import NetworkConfig, start_dht
from swarm.orphans import install_orphan_reaper
from swarm.outer import OuterState
from swarm.progress import PUBLISH_INTERVAL, RECORD_TTL, PeerEntry, ProgressReporter, read_peers
from swarm.records import PeerState, run_prefix, run_validator
from swarm.registry import MANIFEST_TTL, publish_manifest
from swarm.state_store import SavedState, StateStore
from swarm.state_sync import StateSync
from swarm.swarm_view import SwarmView, build_view

logger = logging.getLogger(__name__)

LEAVE_SECONDS = 10.0  # the most leave() spends telling others and stopping its processes


class RoundOutcome(enum.Enum):
    averaged = "averaged"  # the group's average was applied
    local = "local"  # no usable group: our own pseudo-gradient was applied
    resynced = "resynced"  # the round was replaced by the swarm's state (behind, disagreed, non-finite)
    non_finite = "non-finite"  # our pseudo-gradient was not finite: the loop should reset its inner optimizer
    abandoned = "abandoned"  # the peer is leaving: nothing was applied


@dataclass
class RoundReport:
    """What one outer round did, for logs, the dashboard and tests."""

    epoch: int  # the epoch reached by this round
    averaged: bool  # False: the local pseudo-gradient was used
    group_size: int
    outcome: RoundOutcome = RoundOutcome.local
    fallback_reason: str | None = None  # for people: why the round was not averaged
    dropped_fraction: float = 0.0
    resynced: bool = False
    checksum: str = ""
    samples: int = 0
    seconds: dict[str, float] = field(default_factory=dict)  # compute, matchmaking, allreduce, outer, consistency
    bytes_sent: int = 0  # all-reduce tensor payload, framing excluded, as of when our own results were complete
    bytes_received: int = 0


@dataclass
class PeerStats:
    rounds: int = 0
    averaged_rounds: int = 0
    local_rounds: int = 0
    resyncs: int = 0
    tokens_processed: int = 0


Listener = Callable[[str, dict[str, Any]], None]


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
        self.state_dir = Path(state_dir) if state_dir else Path(tempfile.mkdtemp(prefix=f"swarm-{self.run_id}-"))
        self._state_extra, self._shield = state_extra, shield
        self.name, self.device = name, device
        self._listener = listener or (lambda kind, data: None)
        self._progress_interval, self._progress_ttl = progress_interval, progress_ttl
        self.params: list[torch.Tensor] = []
        self.stats = PeerStats()
        self.inner_step = 0
        self._round_samples = 0
        self._round_started = time.monotonic()
        self._compute_seconds = 0.0
        self._speed = 0.0  # samples per second, smoothed
        self.outer: OuterState | None = None
        self.averager: PseudoGradientAverager | None = None
        self.reporter: ProgressReporter | None = None
        self.store: StateStore | None = None
        self.sync = StateSync(self)
        self._buffers: list[torch.Tensor] = []
        self._connected = self._started = self._stopped = self._stop_requested = False
        self._next_round_check = 0.0
        self._manifest_published_at = 0.0
        self.last_round_local = False
        self.in_round = False  # inside run_outer_round: matchmaking, all-reduce, outer step or consistency check
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
        """
        assert not self._connected, "already connected"
        install_orphan_reaper()
        if self._dht is None:
            assert self._network is not None
            self._dht = start_dht(self._network)
        self.dht.add_validators([run_validator(self.run_id)])
        self._publish_manifest()
        avg = self.manifest.averaging
        self._buffers = [torch.zeros(tuple(shape)) for shape in shapes]
        handler = signal.getsignal(signal.SIGINT)
        self.averager = PseudoGradientAverager(
            self._buffers,
            self.dht,
            start=True,
            prefix=run_prefix(self.run_id),
            target_group_size=avg.target_group_size,
            min_group_size=avg.min_group_size,
            min_matchmaking_time=avg.matchmaking_time,
            request_timeout=min(3.0, avg.matchmaking_time / 2),
            allreduce_timeout=avg.allreduce_timeout,
            next_chunk_timeout=avg.chunk_timeout,
            compression=COMPRESSIONS[avg.compression](),
            allow_state_sharing=False,
            client_mode=self.dht.client_mode,
            declare_state_period=10,
            shutdown_timeout=3,
        )
        signal.signal(signal.SIGINT, handler)  # hivemind leaves SIGINT ignored in the process that starts it
        self.reporter = ProgressReporter(
            self.dht,
            self.run_id,
            self._initial_record(),
            interval=self._progress_interval,
            ttl=self._progress_ttl,
            on_tick=self._on_reporter_tick,
        )
        self.reporter.start()
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
        self.store = StateStore(
            self.state_dir, self.run_id, on_saved=self._on_state_saved, on_failed=self._on_save_failed
        )
        self._started = True
        resumed = False
        if resume is not None:
            resumed = self.sync.load_file(resume)
        self.sync.catch_up(resumed=resumed)
        self.announce_state()  # catching up left the state in a file: ours, or the download
        self._set_state(PeerState.training, publish=True)
        self._round_started = time.monotonic()

    def leave(self, timeout: float = LEAVE_SECONDS) -> bool:
        """Mark this peer as gone, wait (up to ``timeout``) for the newest state file to be on disk, stop the
        averager and the DHT, and leave no p2pd behind. Returns whether the newest state file was written."""
        if self._stopped:
            return True
        self._stopped = True
        deadline = time.monotonic() + timeout
        remaining = lambda: max(0.5, deadline - time.monotonic())  # noqa: E731
        if self.reporter is not None:
            self.reporter.update(state=PeerState.leaving.value)
            self.reporter.publish_now(timeout=min(2.0, remaining()))
        if self.averager is not None:
            try:
                self.averager.allow_state_sharing = False
            except Exception:
                logger.debug("could not turn state sharing off", exc_info=True)
            self.averager.shutdown()
        saved = self.store.close(timeout=remaining()) if self.store is not None else True
        if self.reporter is not None:
            self.reporter.stop(PeerState.left, timeout=min(2.0, remaining()))
        if self._owns_dht and self._dht is not None:
            self._dht.shutdown()
        self._emit("left", dict(checkpoint_written=saved))
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
        self._round_samples += samples
        self.stats.tokens_processed += samples * self.manifest.seq_len
        if compute_seconds is not None:
            self._compute_seconds += compute_seconds
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
        self.reporter.update(**fields)
        if self.inner_step >= self.manifest.inner_steps or self._round_started_without_us(now):
            return self.run_outer_round()
        return None

    def _round_started_without_us(self, now: float) -> bool:
        """True when enough of our epoch-mates are already matchmaking to form a group without us."""
        avg = self.manifest.averaging
        if not avg.join_rounds_early or now < self._next_round_check:
            return False
        self._next_round_check = now + 1.0
        mates = [p for p in self.view().peers if p.peer_id != self.peer_id and p.epoch == self.epoch]
        busy = [p for p in mates if p.state == PeerState.matchmaking.value]  # a group in all-reduce is closed
        return len(busy) >= max(1, avg.min_group_size - 1) and 2 * len(busy) > len(mates)

    def _fill_pseudo_gradient(self) -> bool:
        """Write ``global - local`` into the averaging buffers; False if it is not finite."""
        with self.averager.get_tensors() as buffers:
            self.outer.pseudo_gradient_into(buffers, self.params)
            return _all_finite(buffers)

    def run_outer_round(self) -> RoundReport:
        """Average pseudo-gradients with whoever is ready, take the outer step, and check consistency."""
        self.in_round = True
        epoch = self.epoch
        try:
            return self._run_outer_round()
        except LeaveRequested:  # a stop signal cut the round short
            self.abandoned_round = self.epoch == epoch  # before its outer step: nothing of it was applied
            raise
        finally:
            self.in_round = False

    def _run_outer_round(self) -> RoundReport:
        assert self.outer is not None and self.averager is not None
        avg = self.manifest.averaging
        seconds: dict[str, float] = {"compute": self._compute_seconds or (time.monotonic() - self._round_started)}
        start_epoch = self.outer.epoch

        # a late re-check of the previous epoch, now that every peer had time to publish it
        why = self.sync.resync_reason(start_epoch)
        if why is not None:
            return self._resync_round(seconds, why)

        t_fill = time.monotonic()
        if not self._fill_pseudo_gradient():  # never send NaN/inf to others: take the swarm's state instead
            return self._resync_round(seconds, "non-finite pseudo-gradient", RoundOutcome.non_finite)
        seconds["pseudo_gradient"] = time.monotonic() - t_fill

        t0 = time.monotonic()
        stage_times: dict[str, float] = {}
        fallback: str | None = None
        group: tuple[str, ...] = (self.peer_id,)
        dropped = 0.0
        traffic = (0, 0)
        touched = False  # the buffers may hold something other than our own pseudo-gradient

        def on_stage(stage: str) -> None:
            stage_times.setdefault(stage, time.monotonic())
            if stage == "RUNNING_ALLREDUCE":
                self._set_state(PeerState.averaging, publish=True)

        self._set_state(PeerState.matchmaking, publish=True)
        wait_until = time.monotonic() + avg.wait_for_peers
        while True:
            fallback = None
            stage_times.clear()
            if touched:
                self._fill_pseudo_gradient()
                touched = False
            try:
                outcome = self.averager.average(
                    weight=float(max(1, self._round_samples)),
                    gather=dict(epoch=start_epoch, samples=self._round_samples),
                    group_bits=epoch_group_bits(start_epoch),
                    timeout=avg.matchmaking_timeout,
                    hard_timeout=avg.matchmaking_timeout + avg.allreduce_timeout + 10,
                    on_stage=on_stage,
                    abort_if=lambda: self._abort_reason(start_epoch),
                    leaving=lambda: self._stop_requested,
                )
                touched = True
                epochs = {data.get("epoch") for data in outcome.gathered.values() if isinstance(data, dict)}
                if epochs != {start_epoch}:
                    fallback = f"groupmates were at epochs {sorted(map(str, epochs))}"
                else:
                    group, dropped = outcome.group, outcome.dropped_fraction
                traffic = (outcome.bytes_sent, outcome.bytes_received)
            except RoundAborted as e:
                if e.leaving:  # keep the last agreed state: it is what a restart resumes from
                    self._set_state(PeerState.leaving, publish=True)
                    return RoundReport(
                        epoch=start_epoch,
                        averaged=False,
                        group_size=1,
                        outcome=RoundOutcome.abandoned,
                        fallback_reason="the peer is leaving",
                        checksum=self.outer.checksum(),
                        seconds=seconds,
                    )
                # our pseudo-gradient is for a round that is over: take the swarm's state
                return self._resync_round(seconds, "the swarm finished this round without us")
            except Exception as e:  # no group, a vanished groupmate, a timeout
                logger.debug("averaging attempt failed", exc_info=True)
                touched = True  # a failed all-reduce leaves the buffers alone, but a broken reducer might not
                fallback = _short_reason(e)
                # epoch-mates still on their way to step H: wait for them rather than step alone and run
                # ahead of the swarm
                if time.monotonic() < wait_until and self._mates_coming(start_epoch) and not self._stop_requested:
                    continue
            break
        t1 = time.monotonic()
        t_allreduce = stage_times.get("RUNNING_ALLREDUCE", t1)
        seconds["matchmaking"] = t_allreduce - t0
        seconds["allreduce"] = t1 - t_allreduce

        if fallback is None and not self._buffers_finite():
            fallback, group = "groupmates sent non-finite values", (self.peer_id,)
        with self._shield():  # a stop signal waits for the outer state to be whole again
            if fallback is not None and touched:
                self._fill_pseudo_gradient()  # the local update: our own pseudo-gradient
            with self.averager.get_tensors() as buffers:
                self.outer.step(buffers)
            self.outer.write_to(self.params)
            self.outer.checksum()
            self.save_state()
        seconds["outer"] = time.monotonic() - t1

        self.stats.rounds += 1
        self.last_round_local = fallback is not None
        if fallback is None:
            self.stats.averaged_rounds += 1
        else:
            self.stats.local_rounds += 1
        report = RoundReport(
            epoch=self.outer.epoch,
            averaged=fallback is None,
            group_size=len(group),
            outcome=RoundOutcome.averaged if fallback is None else RoundOutcome.local,
            fallback_reason=fallback,
            dropped_fraction=dropped,
            checksum=self.outer.checksum(),
            samples=self._round_samples,
            seconds=seconds,
            bytes_sent=traffic[0],
            bytes_received=traffic[1],
        )
        self.begin_round()
        self.announce_state()
        self._set_state(PeerState.training, publish=True)
        self._emit("round", dict(report=report))

        t2 = time.monotonic()
        self._await_groupmates(group, self.outer.epoch, avg.consistency_timeout)
        why = self.sync.resync_reason(self.outer.epoch)
        if why is not None:
            report.resynced = self.sync.resync(f"after the round: {why}")
            report.checksum = self.outer.checksum()
            report.epoch = self.outer.epoch
        seconds["consistency"] = time.monotonic() - t2
        return report

    def _buffers_finite(self) -> bool:
        with self.averager.get_tensors() as buffers:
            return _all_finite(buffers)

    def resync_now(self, reason: str) -> bool:
        """Replace our state with the swarm's (e.g. after repeated NaN losses); False if nobody could serve it."""
        return self.sync.resync(reason)

    @property
    def download_progress(self) -> float:
        return self.averager.download_progress if self.averager is not None else 0.0

    def view(self) -> SwarmView:
        entries = read_peers(self.dht, self.run_id)
        return build_view(entries, get_dht_time(), self.manifest.inner_steps, self.manifest.samples_per_step)

    def entries(self) -> list[PeerEntry]:
        """Every live record of the run, including peers that are leaving: for dashboards."""
        return read_peers(self.dht, self.run_id)

    # ---- the swarm's rules, as they apply to this peer -------------------------------------------

    def _abort_reason(self, epoch: int) -> str | None:
        view = self.view()
        return "moved on" if view.global_epoch is not None and view.global_epoch > epoch else None

    def _mates_coming(self, epoch: int) -> bool:
        """True while other live peers are still working towards the end of ``epoch``."""
        active = (PeerState.training.value, PeerState.matchmaking.value, PeerState.averaging.value)
        view = self.view()
        return any(p.peer_id != self.peer_id and p.epoch == epoch and p.state in active for p in view.peers)

    def _await_groupmates(self, group: Sequence[str], epoch: int, timeout: float) -> None:
        """Give groupmates a moment to publish their checksum for ``epoch`` before comparing."""
        others = set(group) - {self.peer_id}
        deadline = time.monotonic() + timeout
        while others and time.monotonic() < deadline:
            published = {p.peer_id for p in self.view().peers if p.checksum_at(epoch) is not None or p.epoch > epoch}
            if others <= published:
                return
            time.sleep(0.2)

    def _resync_round(
        self, seconds: dict[str, float], why: str, outcome: RoundOutcome = RoundOutcome.resynced
    ) -> RoundReport:
        t0 = time.monotonic()
        resynced = self.sync.resync(why)
        seconds.update(matchmaking=0.0, allreduce=0.0, outer=0.0, resync=time.monotonic() - t0)
        self.begin_round()
        return RoundReport(
            epoch=self.epoch,
            averaged=False,
            group_size=1,
            outcome=outcome,
            fallback_reason=why,
            resynced=resynced,
            checksum=self.outer.checksum(),
            seconds=seconds,
        )

    # ---- bookkeeping ---------------------------------------------------------------------------

    def begin_round(self) -> None:
        self.inner_step = 0
        self._round_samples = 0
        self._compute_seconds = 0.0
        self._round_started = time.monotonic()

    def save_state(self) -> None:
        """Write the current outer state to a new state file, in the background."""
        self.averager.note_epoch(self.outer.epoch)
        self.store.save_async(self.outer, self.state_extra())

    def state_extra(self) -> dict[str, Any]:
        """The loop's own extras for the state file being made (its data position, say); never sent to others."""
        try:
            return dict(self._state_extra())
        except Exception:
            logger.debug("state_extra failed", exc_info=True)
            return {}

    def announce_state(self) -> None:
        """Publish our checksum for the current epoch and offer our state (its file) to others."""
        self.reporter.add_checksum(self.outer.epoch, self.outer.checksum())
        self.reporter.update(epoch=self.outer.epoch, inner_step=self.inner_step, publish_now=True)
        if not self.client_mode:
            self.averager.allow_state_sharing = True

    def _on_state_saved(self, saved: SavedState) -> None:
        """On the state writer's thread: serve the new file, and tell the loop (checkpoint bytes and time)."""
        self.averager.serve_state_file(saved.path, saved.epoch)
        self._emit(
            "state_saved", dict(path=str(saved.path), epoch=saved.epoch, bytes=saved.bytes, seconds=saved.seconds)
        )

    def _on_save_failed(self, reason: str) -> None:
        self._emit("state_save_failed", dict(reason=reason))

    def set_state(self, state: PeerState, publish: bool = False) -> None:
        self._set_state(state, publish)

    def shield(self) -> AbstractContextManager:
        return self._shield()

    def _set_state(self, state: PeerState, publish: bool = False) -> None:
        self.reporter.update(state=state.value, epoch=self.epoch, inner_step=self.inner_step, publish_now=publish)
        self._emit("state", dict(state=state.value))

    def _initial_record(self) -> dict[str, Any]:
        return dict(
            peer_id=self.peer_id,
            name=self.name or self.peer_id[-6:],
            device=self.device,
            epoch=0,
            inner_step=0,
            samples_per_second=0.0,
            tokens_processed=0,
            state=PeerState.starting.value,
            last_loss=None,
            client_mode=self.client_mode,
            relayed=self._relayed(),
            checksums=[],
        )

    def _relayed(self) -> bool:
        """True when others can reach us only through a relay (a /p2p-circuit/ address)."""
        try:
            return any("/p2p-circuit" in str(a) for a in self.dht.get_visible_maddrs())
        except Exception:
            logger.debug("could not read our visible addresses", exc_info=True)
            return False

    def _publish_manifest(self) -> None:
        publish_manifest(self.dht, self.manifest)
        self._manifest_published_at = time.monotonic()

    def _on_reporter_tick(self) -> None:
        """Runs on the reporter's thread, so the manifest stays alive even while a round blocks training,
        and others see how far a state download has got."""
        if time.monotonic() - self._manifest_published_at > MANIFEST_TTL / 3:
            self._publish_manifest()
        self.reporter.update(download_progress=min(1.0, max(0.0, self.download_progress)))

    def emit(self, kind: str, data: dict[str, Any]) -> None:
        self._emit(kind, data)

    def _emit(self, kind: str, data: dict[str, Any]) -> None:
        try:
            self._listener(kind, data)
        except Exception:  # a broken listener must not break training
            logger.exception("swarm event listener failed")


def _all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _short_reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text[:200]
