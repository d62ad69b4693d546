"""The volunteer's training loop, top to bottom.

Join the swarm (the averager's process is forked before the model exists, so it
shares none of the model's memory), build the model, pick a micro-batch, resume or
catch up, then run inner AdamW steps (under a gradient scaler on CUDA) and hand each
one to the swarm peer, which runs the outer round every H steps and writes each new
outer state to disk in the background. A stop signal cuts short whatever is running
(``client.signals``); leaving keeps the last round's checkpoint and ends within the
deadline.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hivemind
import torch

from client import checkpoint
from client.data import DataPosition, Prefetcher, SequenceStream, eval_batches, load_tokenizer
from client.hardware import Hardware, Precision, choose_precision
from client.lag import BehindWatch, LagWatch
from client.microbatch import auto_micro_batch
from client.model import build_model, count_parameters, model_config, parameter_shapes
from client.moments import FlightMoments
from client.peer_events import describe
from client.priority import lower_priority
from client.round_line import round_line
from client.signals import GOODBYES, STOP, Stopper, leave_timeout
from client.sources import DataSource, data_source
from client.step import InnerStep, evaluate, evaluate_outer, lr_at
from client.telemetry import Telemetry
from swarm import LeaveRequested, Peer, PeerState, RoundOutcome, RoundReport, RunManifest, SwarmError
from swarm.events import DownloadStarted, Left, PeerEvent, StateChanged, StateSaved

NAN_STREAK_TO_RESYNC = 3
LOG_EVERY_SECONDS = 10.0
ASSUMED_DISK_BYTES_PER_SECOND = 100e6  # until the first state file tells us how fast this disk is
UNHURRIED_LEAVE = 300.0  # leaving without a signal (--max-epochs, SIGUSR1): the newest checkpoint may take this long


@dataclass
class TrainerSettings:
    workdir: Path
    data: DataSource | None = None  # with this peer's --data-path (client.sources.data_source); None: the manifest's
    name: str = ""
    micro_batch: int | None = None  # None: automatic
    max_epochs: int | None = None  # leave after this many outer rounds
    eval_sequences: int = 0  # >0: report held-out loss at start and end
    eval_every: int = 0  # >0 (with eval_sequences): also after every this many rounds
    nice: int = 0  # >0: the training's CPU priority once the helpers are forked (client.priority)
    log_every: float = LOG_EVERY_SECONDS


@dataclass
class TrainerResult:
    rounds: int = 0
    epoch: int = 0
    eval_loss_start: float | None = None
    eval_loss_end: float | None = None
    eval_losses: list[tuple[int, float]] = field(default_factory=list)  # (epoch, held-out loss) every eval_every
    skipped_scaler_steps: int = 0
    nan_steps: int = 0
    checkpoint: Path | None = None
    checksum: str = ""
    reports: list[RoundReport] = field(default_factory=list)
    first_moment_corrections: int = 0  # overlapped rounds whose landing took the stand-in steps out of exp_avg


class Trainer:
    def __init__(
        self,
        manifest: RunManifest,
        dht: hivemind.DHT,
        hardware: Hardware,
        settings: TrainerSettings,
        log: Callable[[str], None] = print,
        telemetry: Telemetry | None = None,
        stopper: Stopper = STOP,
        on_connected: Callable[[], object] = lambda: None,
        on_ready: Callable[[], object] = lambda: None,
    ):
        """``log`` prints the per-window step lines; events go to ``telemetry`` (dashboard, --log-json, echo).
        ``on_connected`` runs once the averager process is forked: the place to start threads that use the DHT.
        ``on_ready`` runs once the peer has caught up and published its state: others may join through it now."""
        self.manifest, self.dht, self.hardware, self.settings, self.log = manifest, dht, hardware, settings, log
        self.telemetry = telemetry or Telemetry(echo=log)
        self.lag = LagWatch(manifest.inner_steps, manifest.averaging.in_flight_steps_kept)  # one line if costly
        self.behind = BehindWatch()  # one line if the swarm keeps finishing our rounds without us
        self.precision: Precision = choose_precision(hardware, manifest.mixed_precision == "bf16")
        self.result = TrainerResult()
        self.peer: Peer | None = None
        self.parameters = 0
        self.stop, self._on_connected, self._on_ready = stopper, on_connected, on_ready
        self.batches: Prefetcher | None = None
        self.eval_set: list[torch.Tensor] | None = None  # the held-out sequences, once read
        self.ckpt_dir = checkpoint.checkpoint_dir(settings.workdir, manifest.run_id)
        self._resumed_extra: dict[str, Any] = {}
        self._disk_rate = ASSUMED_DISK_BYTES_PER_SECOND
        stopper.on_stop(self._on_stop_signal)
        stopper.on_leave_after_round(self._on_leave_after_round)
        stopper.checkpoint_done = lambda: self.peer is None or self.peer.checkpoint_written()

    def note(self, kind: str, message: str) -> None:
        """An event: into the dashboard's event log, --log-json, and the plain log lines."""
        self.telemetry.event(kind, message)

    def _on_stop_signal(self, name: str) -> None:
        self.note("log", f"{name} received: leaving now; the last round's checkpoint is kept (again to quit at once).")
        if self.peer is not None:
            self.peer.request_stop()

    def _on_leave_after_round(self) -> None:
        self.note("log", "SIGUSR1 received: finishing this outer round, then leaving.")

    # ---- setup ---------------------------------------------------------------------------------

    def _prepare(self) -> None:
        m, s = self.manifest, self.settings
        self.tokenizer, self.data = load_tokenizer(m.tokenizer), s.data or data_source(m.dataset)
        config = model_config(m)
        if self.tokenizer.vocab_size > config.vocab_size:
            raise SwarmError(
                f"The tokenizer has {self.tokenizer.vocab_size} tokens but the model's vocab_size is "
                f"{config.vocab_size}; fix the manifest."
            )
        self.model = build_model(m).to(self.hardware.device)
        self.parameters = count_parameters(self.model)
        self.micro_batch = s.micro_batch or auto_micro_batch(
            self.model, self.hardware, self.precision, m, config, s.workdir / "microbatch.json"
        )
        self.telemetry.micro_batch = self.micro_batch
        (self.ckpt_dir.parent / "manifest.json").write_text(m.canonical_json())

    def _state_extra(self) -> dict[str, Any]:
        """What this peer keeps beside each state file: where it is in the data, and its gradient scaler."""
        if self.batches is None:
            return dict(self._resumed_extra)
        position = self.batches.position
        return dict(
            data=dict(order_index=position.order_index, sequences=position.sequences), scaler=self.scaler.state_dict()
        )

    # ---- the loop ------------------------------------------------------------------------------

    def run(self) -> TrainerResult:
        m = self.manifest
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        self.peer = Peer(
            m,
            dht=self.dht,
            state_dir=self.ckpt_dir,
            state_extra=self._state_extra,
            shield=self.stop.shielded,
            name=self.settings.name,
            device=self.hardware.label,
            listener=self._on_event,
        )
        if self.stop.requested:
            self.peer.request_stop()
        try:
            self.peer.connect(parameter_shapes(m))  # before the model exists: the averager forks small
            lower_priority(self.settings.nice)  # after the helpers forked: they keep theirs
            self._on_connected()
            self._prepare()
            found = checkpoint.find(self.ckpt_dir, m.run_id, parameter_shapes(m), warn=lambda t: self.note("log", t))
            if found:
                self._resumed_extra = found.extra
                self.note("log", f"Resuming from {found.path.name} (epoch {found.header.epoch}).")
            self.peer.start(self.model, resume=found.path if found else None)
            self.peer.set_micro_batch(self.micro_batch)
            if self.settings.eval_sequences:  # read before the prefetch thread starts reading the training shards
                self.eval_set = eval_batches(self.data, self.tokenizer, m.seq_len, self.settings.eval_sequences)
            self._build_optimizer()
            self.note(
                "log",
                f"Peer {self.peer.peer_id} on {self.hardware.label}, {self.precision.label}, "
                f"{self.parameters / 1e6:.1f}M parameters, micro-batch {self.micro_batch}, epoch {self.peer.epoch}.",
            )
            self._on_ready()  # caught up and published (peer.start): others may join through this peer now
            if self.eval_set is not None:
                self.result.eval_loss_start = evaluate(self.model, self.eval_set, self.hardware.device)
                self.note("log", f"held-out loss at start: {self.result.eval_loss_start:.4f}")
            self._loop()
            self._check_last_round()
        except LeaveRequested:  # a stop signal: leave below
            if self.peer.abandoned_round:
                self.note("log", "round abandoned: this peer is leaving")
            elif self.peer.flight is not None:  # overlapped: the signal came in a step, its round still averaging
                self.note("log", "the round averaging in the background is dropped: this peer is leaving")
        finally:
            with self.stop.shielded():
                self._leave()
        return self.result

    def _build_optimizer(self) -> None:
        m = self.manifest
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=m.inner.lr,
            betas=m.inner.betas,
            eps=m.inner.eps,
            weight_decay=m.inner.weight_decay,
        )
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.precision.use_scaler)
        # overlapped rounds: the steps taken from the stand-in leave the first moment when the round lands
        self.moments = FlightMoments(self.optimizer) if m.averaging.overlap else None
        extra = dict(self._resumed_extra)
        inner = checkpoint.load_inner(self.ckpt_dir, self.peer.outer.checksum(), warn=lambda t: self.note("log", t))
        if inner is not None:
            self.optimizer.load_state_dict(inner.optimizer)
            extra.update(scaler=inner.scaler, data=inner.data)
            self.note("log", "Inner optimizer state restored.")
        if extra.get("scaler"):
            self.scaler.load_state_dict(extra["scaler"])
        position = DataPosition(**extra["data"]) if isinstance(extra.get("data"), dict) else None
        stream = SequenceStream(self.data, self.tokenizer, m.seq_len, peer_seed=self.peer.peer_id, position=position)
        self.batches = Prefetcher(stream, m.samples_per_step)
        self.inner_step = InnerStep(
            self.model,
            self.optimizer,
            self.scaler,
            self.hardware,
            self.precision,
            m.inner.grad_clip,
            self.micro_batch,
            self._on_micro_batch,
        )

    def _on_micro_batch(self, size: int, why: str) -> None:
        self.micro_batch = self.telemetry.micro_batch = size
        self.peer.set_micro_batch(size)
        self.note("log", f"Out of memory: micro-batch halved to {size}; the step is retried.")

    def _loop(self) -> None:
        m, peer = self.manifest, self.peer
        nan_streak, last_log, window = 0, time.monotonic(), []
        while True:
            self.stop.check()
            if self.settings.max_epochs is not None and self.result.rounds >= self.settings.max_epochs:
                break
            lr = lr_at(m, peer.epoch * m.inner_steps + peer.inner_step)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            batch = self.batches.next_batch()
            t0 = time.monotonic()
            step = self.inner_step(batch)
            elapsed = time.monotonic() - t0
            if step.scaler_skipped:
                self.result.skipped_scaler_steps += 1
                self.telemetry.skipped_scaler_steps = self.result.skipped_scaler_steps
            loss = step.loss
            if not math.isfinite(loss):
                self.result.nan_steps += 1
                self.telemetry.nan_steps = self.result.nan_steps
                nan_streak += 1
                self.note(
                    "log", f"non-finite loss ({loss}) at epoch {peer.epoch} step {peer.inner_step}: step skipped."
                )
                if nan_streak >= NAN_STREAK_TO_RESYNC:
                    self.note(
                        "resync", f"{nan_streak} non-finite losses in a row: re-syncing the model from the swarm."
                    )
                    peer.resync_now("repeated non-finite losses")
                    self.optimizer.state.clear()  # its moments may hold the non-finite values too
                    nan_streak = 0
                continue
            nan_streak = 0
            self.telemetry.step(
                loss=loss,
                seconds=elapsed,
                lr=lr,
                tokens=m.tokens_per_step,
                epoch=peer.epoch,
                inner_step=peer.inner_step + 1,
            )
            window.append((loss, elapsed))
            if time.monotonic() - last_log > self.settings.log_every:
                self._log_steps(window, peer.inner_step + 1)
                window, last_log = [], time.monotonic()
            report = peer.report_step(m.samples_per_step, loss, compute_seconds=elapsed)
            if self.moments is not None:
                self.moments.after_step(peer.flight)
                self.result.first_moment_corrections = self.moments.landed
            if report is not None:
                self._after_round(report)
                if self.stop.after_round and report.outcome != RoundOutcome.abandoned:
                    break

    # ---- bookkeeping ---------------------------------------------------------------------------

    def _log_steps(self, window: list[tuple[float, float]], step: int) -> None:
        loss = sum(w[0] for w in window) / len(window)
        compute = sum(w[1] for w in window)
        tokens_per_s = len(window) * self.manifest.tokens_per_step / max(compute, 1e-9)
        util = self.telemetry.utilization()
        self.log(
            f"epoch {self.peer.epoch} step {step}/{self.manifest.inner_steps} "
            f"loss {loss:.4f} {tokens_per_s:,.0f} tok/s lr {self.optimizer.param_groups[0]['lr']:.2e}"
            + (f" utilization {100 * util:.0f}%" if util is not None else "")
        )

    def _after_round(self, report: RoundReport) -> None:
        if report.outcome == RoundOutcome.abandoned:
            self.note("log", "round abandoned: this peer is leaving")
            return
        if report.outcome == RoundOutcome.non_finite:
            self.optimizer.state.clear()  # its moments hold the non-finite values that caused it
        self.result.rounds += 1
        self.result.epoch = report.epoch
        self.result.reports.append(report)
        self.telemetry.round(report)
        self.lag.add(report.steps_late if report.averaged else None)  # a local round's lag is its matchmaking timeout
        self.note(*round_line(report, self.manifest.inner_steps))
        self.behind.add(report)
        for advice in (self.lag.advice(), self.behind.advice()):
            if advice is not None:
                self.note("log", advice)
        every = self.settings.eval_every
        if every and self.eval_set is not None and self.result.rounds % every == 0:
            loss = self._held_out()
            self.result.eval_losses.append((report.epoch, loss))
            self.telemetry.evaluation(report.epoch, loss)
            self.note("log", f"held-out loss at epoch {report.epoch}: {loss:.4f}")

    def _held_out(self) -> float:  # the outer state's loss: peers with one checksum report one figure
        outer = self.peer.outer if self.manifest.averaging.overlap else None  # blocking: the model is that state
        return evaluate_outer(self.model, outer, self.eval_set, self.hardware.device)

    def _check_last_round(self) -> None:
        """A run that ends (``--max-epochs``) after an overlapped round, or a round that found no group: its
        state is compared with its group's (or the swarm's) before the peer leaves, as the next round would."""
        report = self.peer.check_last_round()
        if report is not None and report.resynced:
            self.note("resync", f"The last round's state was not its group's: re-synced (epoch {report.epoch}).")

    def _leave(self) -> None:
        """Within the stop deadline: the newest state file (the last round's checkpoint), then the inner optimizer's
        state if there is time, then the peer leaves."""
        peer = self.peer
        if peer is None:
            return
        # after a stop signal everything fits the deadline (GOODBYES kept from the save); otherwise take the time
        started = self.stop.signalled_at or time.monotonic()
        limit = self.stop.deadline - GOODBYES if self.stop.requested else UNHURRIED_LEAVE
        budget = lambda: limit - (time.monotonic() - started)  # noqa: E731
        try:
            if peer.outer is not None and self.batches is not None:
                if self.eval_set is not None and not self.stop.requested:
                    latest = self.result.eval_losses[-1] if self.result.eval_losses else None
                    self.result.eval_loss_end = (  # the last round's figure, if it was just taken
                        latest[1] if latest and latest[0] == peer.epoch else self._held_out()
                    )
                    self.note("log", f"held-out loss at end: {self.result.eval_loss_end:.4f}")
                peer.checkpoint_written(timeout=max(0.0, budget()))  # side by side on a slow disk, neither was done
                self._save_inner(budget())
        finally:
            if peer.outer is not None:
                self.result.epoch = peer.epoch
                self.result.checksum = peer.outer.checksum()
            written = peer.leave(timeout=leave_timeout(budget())) if peer.connected else True
            latest = peer.latest_checkpoint
            if latest is not None:
                self.result.checkpoint = latest
                late = f"The newest checkpoint was not finished in time; the last complete one is {latest}"
                self.note("log", f"Checkpoint written: {latest}" if written else late)

    def _save_inner(self, seconds_left: float) -> None:
        """The inner AdamW state (2 tensors per parameter), when this disk can write it in the time left."""
        extra = self._state_extra()["data"]
        state = checkpoint.InnerState(self.optimizer.state_dict(), self.scaler.state_dict(), extra)
        expected = 2 * 4 * self.parameters / self._disk_rate
        hurry = seconds_left if self.stop.requested else None
        line = checkpoint.save_inner_in_time(self.ckpt_dir, self.peer.outer.checksum(), state, expected, hurry)
        if line is not None:
            self.note("log", line)

    def _on_event(self, event: PeerEvent) -> None:
        """The peer's events (on the training thread, the state writer's, or the peer's own while it catches up)."""
        match event:
            case StateChanged(state=state):
                self.telemetry.set_state(state.value)
            case Left():
                self.telemetry.set_state(PeerState.left)
            case DownloadStarted(donor=donor):
                self.telemetry.download_donor = donor
            case StateSaved(epoch=epoch, bytes=size, seconds=seconds):
                if seconds > 0:
                    self._disk_rate = size / seconds
                self.telemetry.checkpoint(epoch, size, seconds)
        if (line := describe(event)) is not None:
            self.note(*line)
