"""Choosing the micro-batch: the largest that fits, with headroom, remembered per device.

On a GPU the answer comes from trial forward/backward/optimizer steps under an
out-of-memory catch; on a CPU from the memory that is free. Gradient
accumulation then keeps the samples per inner step exactly what the manifest
says, whatever the micro-batch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

from client.hardware import Hardware, Precision
from client.preflight import DeviceKind
from swarm import RunManifest, SwarmError

SAFETY = 0.9  # use 90% of the largest micro-batch that fit
# activations of one CPU micro-batch: a CPU's matrix kernels are already efficient at a few sequences, while
# memory spent here is memory the run's state (36 bytes per parameter on the CPU) cannot have
CPU_ACTIVATION_BUDGET = 1 << 30


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and ("out of memory" in str(error) or "can't allocate memory" in str(error))


def search(trial: Callable[[int], None], limit: int) -> int:
    """Largest ``m <= limit`` for which ``trial(m)`` does not run out of memory, times SAFETY (at least 1)."""
    fits, too_big = 0, limit + 1
    m = 1
    while m <= limit:  # grow by doubling until something fails
        try:
            trial(m)
            fits = m
            m *= 2
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            too_big = m
            break
    else:
        too_big = limit + 1
    lo, hi = fits, min(too_big, limit + 1)
    while hi - lo > 1:  # then bisect between the last fit and the first failure
        mid = (lo + hi) // 2
        try:
            trial(mid)
            lo = mid
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            hi = mid
    if lo == 0:
        return 0
    return lo if lo == limit and too_big > limit else max(1, math.floor(lo * SAFETY))


def gpu_trial(
    model: torch.nn.Module, hardware: Hardware, precision: Precision, seq_len: int, vocab_size: int
) -> Callable[[int], None]:
    """One real forward/backward/AdamW step at a given micro-batch; weights are restored afterwards."""

    def trial(micro: int) -> None:
        saved = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
        try:
            x = torch.randint(0, vocab_size, (micro, seq_len), device=hardware.device)
            with torch.autocast(
                hardware.kind.value,
                dtype=precision.autocast_dtype or torch.float32,
                enabled=precision.autocast_dtype is not None,
            ):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            optimizer.step()
        finally:
            optimizer.zero_grad(set_to_none=True)
            del optimizer
            with torch.no_grad():
                for p, s in zip(model.parameters(), saved):
                    p.copy_(s)
            del saved
            if hardware.kind is DeviceKind.CUDA:
                torch.cuda.empty_cache()

    return trial


def cpu_estimate(hardware: Hardware, config, seq_len: int, limit: int) -> int:
    """A generous activation estimate per sample against CPU_ACTIVATION_BUDGET (or a quarter of the free
    memory, if that is less)."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    per_sample = seq_len * (layers * hidden * 40 + config.vocab_size * 12) * 4
    budget = min(CPU_ACTIVATION_BUDGET, hardware.memory_bytes // 4)
    return max(1, min(limit, int(budget // max(1, per_sample))))


def cached_or_search(cache: Path, key: str, compute: Callable[[], int]) -> int:
    """The cached answer for ``key``, or ``compute()``'s, stored for next time."""
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known.get(key), int) and known[key] > 0:
        return known[key]
    value = compute()
    known[key] = value
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(known, indent=1, sort_keys=True))
    return value


def auto_micro_batch(
    model: torch.nn.Module, hardware: Hardware, precision: Precision, manifest: RunManifest, config, cache: Path
) -> int:
    """The micro-batch for this device and run: searched on a GPU, estimated on a CPU, remembered in ``cache``."""
    key = f"{hardware.name}|{manifest.run_id}|{manifest.seq_len}"
    limit = manifest.samples_per_step

    def compute() -> int:
        if hardware.kind is DeviceKind.CUDA:
            found = search(gpu_trial(model, hardware, precision, manifest.seq_len, config.vocab_size), limit)
            if found == 0:
                raise SwarmError(
                    "This GPU runs out of memory even with one sample per micro-batch. Use a "
                    "bigger GPU, a smaller model, or a shorter seq_len."
                )
            return found
        return cpu_estimate(hardware, config, manifest.seq_len, limit)

    return cached_or_search(cache, key, compute)
