"""The volunteer's training loop, top to bottom.

Build the model from the manifest, pick a micro-batch, resume or catch up, then
run inner AdamW steps (under a gradient scaler on CUDA) and hand each one to the
swarm peer, which runs the outer round every H steps. A checkpoint is written
after every round and on the way out.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hivemind
import torch

from client import checkpoint
from client.data import DataPosition, SequenceStream, eval_batches, load_tokenizer
from client.hardware import Hardware, Precision, choose_precision
from client.microbatch import cached_or_search, cpu_estimate, gpu_trial, is_out_of_memory, search
from client.model import build_model, count_parameters, model_config
from client.telemetry import Telemetry
from swarm import Peer, RoundReport, RunManifest, SwarmError
from swarm.peer import LEAVING, NON_FINITE

NAN_STREAK_TO_RESYNC = 3
LOG_EVERY_SECONDS = 10.0


@dataclass
class TrainerSettings:
    workdir: Path
    name: str = ""
    micro_batch: int | None = None  # None: automatic
    max_epochs: int | None = None  # leave after this many outer rounds
    eval_sequences: int = 0  # >0: report held-out loss at start and end
    log_every: float = LOG_EVERY_SECONDS


@dataclass
class TrainerResult:
    rounds: int = 0
    epoch: int = 0
    eval_loss_start: float | None = None
    eval_loss_end: float | None = None
    skipped_scaler_steps: int = 0
    nan_steps: int = 0
    checkpoint: Path | None = None
    checksum: str = ""
    reports: list[RoundReport] = field(default_factory=list)


def lr_at(manifest: RunManifest, step: int) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio of the peak."""
    spec = manifest.inner
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    progress = min(1.0, (step - spec.warmup_steps) / max(1, spec.total_steps - spec.warmup_steps))
    return spec.lr * (spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class StopRequest:
    """First SIGTERM/SIGINT: finish the step, checkpoint, leave. Second: exit at once.

    SIGUSR1 asks for a gentler exit: finish this outer round (so this peer's work
    is averaged in), then checkpoint and leave; ``docker kill --signal=SIGUSR1``.
    """

    def __init__(self, on_first: Callable[[str], None], on_after_round: Callable[[], None] = lambda: None):
        self.requested = False
        self.after_round = False
        self._on_first, self._on_after_round = on_first, on_after_round

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGUSR1, self._handle_after_round)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.requested:
            raise SystemExit(130)
        self.requested = True
        self._on_first(signal.Signals(signum).name)

    def _handle_after_round(self, _signum: int, _frame: Any) -> None:
        if not self.after_round:
            self.after_round = True
            self._on_after_round()


class Trainer:
    def __init__(
        self,
        manifest: RunManifest,
        dht: hivemind.DHT,
        hardware: Hardware,
        settings: TrainerSettings,
        log: Callable[[str], None] = print,
        telemetry: Telemetry | None = None,
    ):
        """``log`` prints the per-window step lines; events go to ``telemetry`` (dashboard, --log-json, echo)."""
        self.manifest, self.dht, self.hardware, self.settings, self.log = manifest, dht, hardware, settings, log
        self.telemetry = telemetry or Telemetry(echo=log)
        self.precision: Precision = choose_precision(hardware, manifest.mixed_precision == "bf16")
        self.result = TrainerResult()
        self.peer: Peer | None = None
        self.parameters = 0
        self.stop = StopRequest(self._on_stop_signal, self._on_leave_after_round)

    def note(self, kind: str, message: str) -> None:
        """An event: into the dashboard's event log, --log-json, and the plain log lines."""
        self.telemetry.event(kind, message)

    def _on_stop_signal(self, name: str) -> None:
        self.note(
            "log", f"{name} received: finishing this step, writing a checkpoint and leaving (again to quit at once)."
        )
        if self.peer is not None:
            self.peer.request_stop()  # also abandons a round that is looking for a group

    def _on_leave_after_round(self) -> None:
        self.note("log", "SIGUSR1 received: finishing this outer round, then writing a checkpoint and leaving.")

    # ---- setup ---------------------------------------------------------------------------------

    def _prepare(self) -> None:
        m, s = self.manifest, self.settings
        self.tokenizer = load_tokenizer(m.tokenizer)
        config = model_config(m)
        if self.tokenizer.vocab_size > config.vocab_size:
            raise SwarmError(
                f"The tokenizer has {self.tokenizer.vocab_size} tokens but the model's vocab_size is "
                f"{config.vocab_size}; fix the manifest."
            )
        self.model = build_model(m).to(self.hardware.device)
        self.parameters = count_parameters(self.model)
        self.micro_batch = s.micro_batch or self._auto_micro_batch(config)
        self.telemetry.micro_batch = self.micro_batch
        self.ckpt_dir = checkpoint.checkpoint_dir(s.workdir, m.run_id)
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        (self.ckpt_dir.parent / "manifest.json").write_text(m.canonical_json())
        self.loaded = checkpoint.load_latest(self.ckpt_dir, m.run_id, warn=lambda text: self.note("log", text))

    def _auto_micro_batch(self, config) -> int:
        key = f"{self.hardware.name}|{self.manifest.run_id}|{self.manifest.seq_len}"
        limit = self.manifest.samples_per_step

        def compute() -> int:
            if self.hardware.kind == "cuda":
                trial = gpu_trial(self.model, self.hardware, self.precision, self.manifest.seq_len, config.vocab_size)
                found = search(trial, limit)
                if found == 0:
                    raise SwarmError(
                        "This GPU runs out of memory even with one sample per micro-batch. Use a "
                        "bigger GPU, a smaller model, or a shorter seq_len."
                    )
                return found
            return cpu_estimate(self.hardware, config, self.manifest.seq_len, limit)

        return cached_or_search(self.settings.workdir / "microbatch.json", key, compute)

    # ---- the loop ------------------------------------------------------------------------------

    def run(self) -> TrainerResult:
        m = self.manifest
        self._prepare()
        state = self.loaded.state if self.loaded else None
        if self.loaded:
            self.note("log", f"Resuming from {self.loaded.path.name} (epoch {state['epoch']}).")
        self.peer = Peer(
            m, self.model, dht=self.dht, name=self.settings.name, device=self.hardware.label, listener=self._on_event
        )
        self.peer.start(resume=(state["epoch"], state["outer"]) if state else None)
        self.peer.reporter.update(micro_batch=self.micro_batch)
        self.stop.install()

        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=m.inner.lr,
            betas=m.inner.betas,
            eps=m.inner.eps,
            weight_decay=m.inner.weight_decay,
        )
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.precision.use_scaler)
        position = None
        if state:
            self.optimizer.load_state_dict(state["inner_optimizer"])
            self.scaler.load_state_dict(state["scaler"])
            position = DataPosition(**state["data"])
        self.stream = SequenceStream(
            m.dataset, self.tokenizer, m.seq_len, peer_seed=self.peer.peer_id, position=position
        )
        self.note(
            "log",
            f"Peer {self.peer.peer_id} on {self.hardware.label}, {self.precision.label}, "
            f"{self.parameters / 1e6:.1f}M parameters, micro-batch {self.micro_batch}, epoch {self.peer.epoch}.",
        )
        if self.settings.eval_sequences:
            self.eval_set = eval_batches(m.dataset, self.tokenizer, m.seq_len, self.settings.eval_sequences)
            self.result.eval_loss_start = self.evaluate()
            self.note("log", f"held-out loss at start: {self.result.eval_loss_start:.4f}")
        try:
            self._loop()
        finally:
            self._leave()
        return self.result

    def _loop(self) -> None:
        m, peer = self.manifest, self.peer
        nan_streak, last_log, window = 0, time.monotonic(), []
        while not self.stop.requested:
            if self.settings.max_epochs is not None and self.result.rounds >= self.settings.max_epochs:
                break
            lr = lr_at(m, peer.epoch * m.inner_steps + peer.inner_step)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            batch = self.stream.next_batch(m.samples_per_step)
            t0 = time.monotonic()
            loss = self._inner_step(batch)
            elapsed = time.monotonic() - t0
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
            if report is not None:
                self._after_round(report)
                if self.stop.after_round and report.fallback_reason != LEAVING:
                    break

    def _inner_step(self, batch: torch.Tensor) -> float:
        """One optimizer step over ``samples_per_step`` samples, accumulated over micro-batches."""
        total = batch.shape[0]
        while True:
            try:
                loss_sum = torch.zeros((), device=self.hardware.device)
                for chunk in batch.split(self.micro_batch):
                    x = chunk.to(self.hardware.device, non_blocking=True)
                    with torch.autocast(
                        self.hardware.kind if self.hardware.kind != "mps" else "cpu",
                        dtype=self.precision.autocast_dtype or torch.float32,
                        enabled=self.precision.autocast_dtype is not None,
                    ):
                        loss = self.model(input_ids=x, labels=x).loss * (chunk.shape[0] / total)
                    self.scaler.scale(loss).backward()
                    loss_sum += loss.detach().float()
                value = float(loss_sum)
                if not math.isfinite(value):
                    self.optimizer.zero_grad(set_to_none=True)
                    return value
                self.scaler.unscale_(self.optimizer)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.manifest.inner.grad_clip)
                scale = self.scaler.get_scale() if self.precision.use_scaler else 1.0
                self.scaler.step(self.optimizer)
                self.scaler.update()
                if self.precision.use_scaler and self.scaler.get_scale() < scale:
                    self.result.skipped_scaler_steps += 1
                    self.telemetry.skipped_scaler_steps = self.result.skipped_scaler_steps
                self.optimizer.zero_grad(set_to_none=True)
                return value
            except Exception as e:
                if not is_out_of_memory(e):
                    raise
                self.optimizer.zero_grad(set_to_none=True)
                if self.hardware.kind == "cuda":
                    torch.cuda.empty_cache()
                if self.micro_batch == 1:
                    raise SwarmError(
                        "Out of memory even with a micro-batch of 1. Free the GPU (other processes?) "
                        "or use a machine with more memory."
                    ) from None
                self.micro_batch = max(1, self.micro_batch // 2)
                self.telemetry.micro_batch = self.micro_batch
                self.peer.reporter.update(micro_batch=self.micro_batch)
                self.note("log", f"Out of memory: micro-batch halved to {self.micro_batch}; the step is retried.")

    def evaluate(self) -> float:
        self.model.eval()
        losses = []
        with torch.no_grad():
            for x in self.eval_set:
                x = x.to(self.hardware.device)
                losses.append(float(self.model(input_ids=x, labels=x).loss))
        self.model.train()
        return sum(losses) / len(losses)

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
        if report.fallback_reason == LEAVING:
            self.note("log", "round abandoned: this peer is leaving")
            return
        if report.fallback_reason == NON_FINITE:
            self.optimizer.state.clear()  # its moments hold the non-finite values that caused it
        self.result.rounds += 1
        self.result.epoch = report.epoch
        self.result.reports.append(report)
        self.telemetry.round(report)
        s = report.seconds
        how = f"averaged with {report.group_size} peers" if report.averaged else f"local ({report.fallback_reason})"
        self.note(
            "round" if report.averaged else "fallback",
            f"round -> epoch {report.epoch}: {how}{', re-synced' if report.resynced else ''}; "
            f"compute {s.get('compute', 0):.1f}s matchmaking {s.get('matchmaking', 0):.1f}s "
            f"all-reduce {s.get('allreduce', 0):.1f}s outer {s.get('outer', 0):.2f}s "
            f"sent {report.bytes_sent / 1e6:.2f}MB received {report.bytes_received / 1e6:.2f}MB "
            f"checksum {report.checksum[:10]}",
        )
        self._save_checkpoint()

    def _save_checkpoint(self) -> None:
        outer = self.peer.outer
        with outer.lock:
            state = dict(
                run_id=self.manifest.run_id,
                epoch=outer.epoch,
                checksum=outer.checksum(),
                outer=[t.clone() for t in outer.tensors()],
                model={k: v.detach().cpu() for k, v in self.model.state_dict().items()},
                inner_optimizer=self.optimizer.state_dict(),
                scaler=self.scaler.state_dict(),
                data=dict(order_index=self.stream.position.order_index, sequences=self.stream.position.sequences),
                saved_at=time.time(),
            )
        self.result.checkpoint = checkpoint.save(self.ckpt_dir, outer.epoch, self.peer.inner_step, state)

    def _leave(self) -> None:
        if self.peer is None or self.peer.outer is None:
            return
        try:
            if self.settings.eval_sequences:
                self.result.eval_loss_end = self.evaluate()
                self.note("log", f"held-out loss at end: {self.result.eval_loss_end:.4f}")
            self._save_checkpoint()
            self.note("log", f"Checkpoint written: {self.result.checkpoint}")
        finally:
            self.result.epoch = self.peer.epoch
            self.result.checksum = self.peer.outer.checksum()
            self.peer.leave()

    def _on_event(self, kind: str, data: dict[str, Any]) -> None:
        """The peer's events (on the training thread, or the peer's own while it catches up)."""
        if kind == "state":
            self.telemetry.set_state(data["state"])
        elif kind == "left":
            self.telemetry.set_state("left")
        elif kind == "resync":
            self.note("resync", f"re-syncing: {data['reason']}")
        elif kind == "download_started":
            self.telemetry.download_donor = data["donor"]
            self.note("download", f"downloading the training state from peer {data['donor'][-8:]}")
        elif kind == "download_deferred":
            self.note(
                "download",
                f"waiting ~{data['eta']:.0f} s for the swarm's round to end before downloading: at the last "
                f"download's speed it takes ~{data['expected']:.0f} s, more than is left of this round",
            )
        elif kind == "state_loaded":
            self.note("state_loaded", f"state of epoch {data['epoch']} loaded from {data['donor'][-8:]}")
        elif kind == "download_failed":
            self.note("download_failed", f"state download from {data['donor'][-8:]} failed: {data['reason']}")
        elif kind == "initialized":
            self.note("initialized", f"starting at epoch {data['epoch']}: {data['reason']}")
