"""The global model and the outer Nesterov step.

DiLoCo keeps, next to the model being trained, a copy of the parameters as they
were at the start of the round (the "global" model). After H inner steps the
pseudo-gradient is ``global - local``; the averaged pseudo-gradient drives an
SGD step with Nesterov momentum on the global copy, which then becomes the
model's starting point for the next round. The copy is fp32 on the CPU so that
accelerator memory holds only the model being trained, and so that every peer,
whatever its device, performs bitwise the same outer step.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Sequence

import torch

from swarm.manifest import OuterOptimizerSpec


def checksum(tensors: Iterable[torch.Tensor]) -> str:
    """sha256 of the raw bytes of ``tensors`` in order."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().data)
    return digest.hexdigest()


class OuterState:
    """The global parameters (fp32, CPU), their momentum buffers and the epoch."""

    def __init__(self, model_params: Sequence[torch.Tensor], spec: OuterOptimizerSpec, epoch: int = 0):
        self.lock = threading.RLock()
        self.params = [p.detach().to("cpu", torch.float32, copy=True) for p in model_params]
        self.momentum = [torch.zeros_like(p) for p in self.params]
        self.spec = spec
        self.epoch = epoch

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def pseudo_gradient(self, model_params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``global - local`` in fp32: the direction the outer step moves against."""
        with self.lock, torch.no_grad():
            return [g - p.detach().to("cpu", torch.float32) for g, p in zip(self.params, model_params)]

    def step(self, pseudo_gradient: Sequence[torch.Tensor]) -> None:
        """One SGD step with (Nesterov) momentum, identical to ``torch.optim.SGD``'s, then advance the epoch."""
        lr, mu = self.spec.lr, self.spec.momentum
        with self.lock, torch.no_grad():
            for param, buf, grad in zip(self.params, self.momentum, pseudo_gradient):
                buf.mul_(mu).add_(grad)
                update = grad.add(buf, alpha=mu) if self.spec.nesterov else buf
                param.add_(update, alpha=-lr)
            self.epoch += 1

    def write_to(self, model_params: Sequence[torch.Tensor]) -> None:
        with self.lock, torch.no_grad():
            for g, p in zip(self.params, model_params):
                p.copy_(g.to(p.device, p.dtype))

    def checksum(self) -> str:
        with self.lock:
            return checksum(self.params)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.params, *self.momentum]

    def snapshot(self) -> tuple[int, str, list[torch.Tensor]]:
        """A consistent copy of (epoch, checksum, params + momentum) for a peer downloading it."""
        with self.lock:
            return self.epoch, self.checksum(), [t.clone() for t in self.tensors()]

    def load(self, epoch: int, tensors: Sequence[torch.Tensor]) -> None:
        n = len(self.params)
        if len(tensors) != 2 * n:
            raise ValueError(f"expected {2 * n} state tensors, got {len(tensors)}")
        for mine, theirs in zip(self.tensors(), tensors):
            if mine.shape != theirs.shape:
                raise ValueError(f"state tensor shape {tuple(theirs.shape)} != {tuple(mine.shape)}")
        with self.lock, torch.no_grad():
            for mine, theirs in zip(self.tensors(), tensors):
                mine.copy_(theirs.to(torch.float32))
            self.epoch = epoch
