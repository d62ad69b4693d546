"""One inner step: ``samples_per_step`` samples in micro-batches, under autocast and a gradient scaler.

Gradient accumulation keeps the samples per step what the run says, whatever the
micro-batch; an out-of-memory error halves the micro-batch and retries the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from client.hardware import Hardware, Precision
from client.microbatch import is_out_of_memory
from client.preflight import DeviceKind
from swarm import RunManifest, SwarmError
from swarm.state.outer import OuterState


@dataclass
class StepResult:
    loss: float  # mean over the step's samples; not finite: the step was skipped
    scaler_skipped: bool  # the gradient scaler found inf/NaN gradients and lowered its scale


class InnerStep:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        hardware: Hardware,
        precision: Precision,
        grad_clip: float,
        micro_batch: int,
        on_micro_batch: Callable[[int, str], None] = lambda size, why: None,
    ):
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.hardware, self.precision, self.grad_clip = hardware, precision, grad_clip
        self.micro_batch = micro_batch
        self._on_micro_batch = on_micro_batch

    def __call__(self, batch: torch.Tensor) -> StepResult:
        while True:
            try:
                return self._step(batch)
            except Exception as e:
                if not is_out_of_memory(e):
                    raise
                self.optimizer.zero_grad(set_to_none=True)
                if self.hardware.kind is DeviceKind.CUDA:
                    torch.cuda.empty_cache()
                if self.micro_batch == 1:
                    raise SwarmError(
                        "Out of memory even with a micro-batch of 1. Free the GPU (other processes?) "
                        "or use a machine with more memory."
                    ) from None
                self.micro_batch = max(1, self.micro_batch // 2)
                self._on_micro_batch(self.micro_batch, "out of memory")

    def _step(self, batch: torch.Tensor) -> StepResult:
        total = batch.shape[0]
        loss_sum = torch.zeros((), device=self.hardware.device)
        for chunk in batch.split(self.micro_batch):
            x = chunk.to(self.hardware.device, non_blocking=True)
            with torch.autocast(
                "cpu" if self.hardware.kind is DeviceKind.MPS else self.hardware.kind.value,
                dtype=self.precision.autocast_dtype or torch.float32,
                enabled=self.precision.autocast_dtype is not None,
            ):
                loss = self.model(input_ids=x, labels=x).loss * (chunk.shape[0] / total)
            self.scaler.scale(loss).backward()
            loss_sum += loss.detach().float()
        value = float(loss_sum)
        if not math.isfinite(value):
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(value, False)
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        scale = self.scaler.get_scale() if self.precision.use_scaler else 1.0
        self.scaler.step(self.optimizer)
        self.scaler.update()
        skipped = self.precision.use_scaler and self.scaler.get_scale() < scale
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(value, skipped)


def evaluate(model: torch.nn.Module, batches: list[torch.Tensor], device: str) -> float:
    model.eval()
    losses = []
    with torch.no_grad():
        for x in batches:
            x = x.to(device)
            losses.append(float(model(input_ids=x, labels=x).loss))
    model.train()
    return sum(losses) / len(losses)


def evaluate_outer(model: torch.nn.Module, outer: OuterState | None, batches: list[torch.Tensor], device: str) -> float:
    """The held-out loss of the outer state (the round's global model, what the checksum and the checkpoint
    hold). After a blocking round the model is that state (``outer`` None: the model is scored as it is).
    After an overlapped one it also holds the inner steps taken while the average was in flight, which the
    figure leaves out, so that groupmates report one loss; the model's parameters come back exactly.

    A model in fp32 on the CPU reads the outer tensors in place for the figure (nothing is copied: they change
    only on this, the training thread, and the forward pass only reads them). Any other model (a GPU's, or
    bf16) gets them written in, and its own parameters wait on the host meanwhile: one copy of the model."""
    if outer is None:
        return evaluate(model, batches, device)
    params = list(model.parameters())
    if all(p.dtype == g.dtype and p.device == g.device and p.shape == g.shape for p, g in zip(params, outer.params)):
        own = [p.data for p in params]
        try:
            for p, g in zip(params, outer.params):
                p.data = g
            return evaluate(model, batches, device)
        finally:
            for p, d in zip(params, own):
                p.data = d
    with torch.no_grad():
        kept = [p.detach().to("cpu", copy=True) for p in params]
        try:
            outer.write_to(params)
            return evaluate(model, batches, device)
        finally:
            for p, k in zip(params, kept):
                p.copy_(k)


def lr_at(manifest: RunManifest, step: int) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio of the peak."""
    spec = manifest.inner
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    progress = min(1.0, (step - spec.warmup_steps) / max(1, spec.total_steps - spec.warmup_steps))
    return spec.lr * (spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
