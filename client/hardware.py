"""What this machine has, and how training should use it.

Detection takes the ``torch.cuda`` module as an argument so tests can hand in a
fake one with the properties of a real GPU; everything else is read from torch
and psutil.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psutil
import torch

from client.preflight import DeviceKind, DeviceRequest
from swarm import SwarmError


@dataclass(frozen=True)
class Hardware:
    device: str  # a torch device string: "cuda:0", "mps", "cpu"
    kind: DeviceKind  # CUDA, MPS or CPU (never AUTO)
    name: str
    memory_bytes: int  # accelerator memory, or available host memory for the CPU
    compute_capability: tuple[int, int] | None
    bf16: bool
    host_memory_bytes: int
    cpu_cores: int

    @property
    def label(self) -> str:
        gib = self.memory_bytes / 2**30
        if self.kind is DeviceKind.CPU:
            return f"CPU x{self.cpu_cores} ({gib:.0f} GiB free)"
        return f"{self.name} ({gib:.0f} GiB)"


@dataclass(frozen=True)
class Precision:
    """Autocast dtype for the inner steps; fp16 also needs a GradScaler."""

    autocast_dtype: torch.dtype | None
    use_scaler: bool

    @property
    def label(self) -> str:
        return {None: "fp32", torch.float16: "fp16+scaler", torch.bfloat16: "bf16"}[self.autocast_dtype]


def detect(request: DeviceRequest, cuda: Any = torch.cuda, mps_available: bool | None = None) -> Hardware:
    """The hardware that will train for a ``--device`` (parsed by ``client.preflight.parse_device`` before torch
    was imported): here, whether this machine has it."""
    device = request.kind.value + ("" if request.index is None else f":{request.index}")
    host = psutil.virtual_memory()
    cores = psutil.cpu_count(logical=False) or psutil.cpu_count() or 1
    if mps_available is None:
        mps_available = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    kind, index = request.kind, request.index or 0
    if kind is DeviceKind.AUTO:
        kind = DeviceKind.CUDA if cuda.is_available() else DeviceKind.MPS if mps_available else DeviceKind.CPU
    if kind is DeviceKind.CUDA:
        if not cuda.is_available():
            raise SwarmError(
                f"--device {device}: no CUDA GPU is visible to PyTorch. Check `nvidia-smi`, that this torch build "
                "has CUDA (torch.version.cuda), and that Docker runs with --gpus all; or use --device cpu."
            )
        count = cuda.device_count()
        if not 0 <= index < count:
            raise SwarmError(f"--device {device}: this machine has {count} CUDA device(s), numbered 0 to {count - 1}.")
        props = cuda.get_device_properties(index)
        capability = (props.major, props.minor)
        return Hardware(
            f"cuda:{index}",
            DeviceKind.CUDA,
            props.name,
            int(props.total_memory),
            capability,
            capability >= (8, 0),
            host.total,
            cores,
        )
    if kind is DeviceKind.MPS:
        if not mps_available:
            raise SwarmError("--device mps: Apple's Metal backend is not available here; use --device cpu.")
        return Hardware("mps", DeviceKind.MPS, "Apple MPS", host.total, None, False, host.total, cores)
    return Hardware("cpu", DeviceKind.CPU, "CPU", int(host.available), None, False, host.total, cores)


def choose_precision(hardware: Hardware, prefer_bf16: bool) -> Precision:
    """fp16 with a scaler on CUDA, bf16 where asked for and supported, fp32 elsewhere."""
    if hardware.kind is DeviceKind.CUDA:
        if prefer_bf16 and hardware.bf16:
            return Precision(torch.bfloat16, use_scaler=False)
        return Precision(torch.float16, use_scaler=True)
    return Precision(None, use_scaler=False)
