"""The global model and the outer Nesterov step.

DiLoCo keeps, next to the model being trained, a copy of the parameters as they
were at the start of the round (the "global" model). After H inner steps the
pseudo-gradient is ``global - local``; the averaged pseudo-gradient drives an
SGD step with Nesterov momentum on the global copy, which then becomes the
model's starting point for the next round. The copy is fp32 on the CPU so that
accelerator memory holds only the model being trained, and so that every peer,
whatever its device, performs bitwise the same outer step.

Memory: the copy and its momentum are 8 bytes per parameter and nothing here
makes another whole copy: the pseudo-gradient is written into a buffer the
caller owns (the averager's), the state is saved from and loaded into these
tensors directly, and the checksum is computed once per change.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from swarm.manifest import OuterOptimizerSpec
from swarm.state import file as state_file
from swarm.state.file import StateHeader


def checksum(tensors: Iterable[torch.Tensor]) -> str:
    """sha256 of the raw bytes of ``tensors`` in order."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().data)
    return digest.hexdigest()


STAND_IN_DTYPE = torch.bfloat16


class OuterState:
    """The global parameters (fp32, CPU), their momentum buffers and the epoch.

    ``lock`` guards every change; the background state writer holds it while it
    reads, so a change waits for a write in progress rather than tearing it.
    """

    def __init__(self, model_params: Sequence[torch.Tensor], spec: OuterOptimizerSpec, epoch: int = 0):
        self.lock = threading.RLock()
        self.params = [p.detach().to("cpu", torch.float32, copy=True).contiguous() for p in model_params]
        self.momentum = [torch.zeros_like(p) for p in self.params]
        self.spec = spec
        self.epoch = epoch
        self._checksum: str | None = None
        # error feedback: what a lossy codec did not send yet (fp32, this peer's own; never served to others)
        self.residual: list[torch.Tensor] | None = None
        self.residual_version = 0  # bumped whenever the residual changes

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def numels(self) -> list[int]:
        return [p.numel() for p in self.params]

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [tuple(p.shape) for p in self.params]

    @property
    def nbytes(self) -> int:
        """Size of params plus momentum: what a state file or a download holds, headers aside."""
        return 8 * self.numel

    def pseudo_gradient_into(self, out: Sequence[torch.Tensor], model_params: Sequence[torch.Tensor]) -> None:
        """Write ``global - local`` (fp32) into ``out``: the direction the outer step moves against."""
        with self.lock, torch.no_grad():
            for buf, g, p in zip(out, self.params, model_params):
                torch.sub(g, p.detach().to("cpu", torch.float32), out=buf)

    def pseudo_gradient(self, model_params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``global - local`` as new tensors (for tests and tools; the peer writes into its buffers)."""
        out = [torch.empty_like(g) for g in self.params]
        self.pseudo_gradient_into(out, model_params)
        return out

    def step(self, pseudo_gradient: Sequence[torch.Tensor], shift: Sequence[torch.Tensor] | None = None) -> None:
        """One SGD step with (Nesterov) momentum, identical to ``torch.optim.SGD``'s, then advance the epoch.

        ``shift`` (the model, in an overlapped round) gets the same change as the global parameters, so the
        inner steps it took since the round began are kept on top of the new global model.
        """
        lr, mu = self.spec.lr, self.spec.momentum
        with self.lock, torch.no_grad():
            for i, (param, buf, grad) in enumerate(zip(self.params, self.momentum, pseudo_gradient)):
                buf.mul_(mu).add_(grad)
                update = grad.add(buf, alpha=mu) if self.spec.nesterov else buf
                param.add_(update, alpha=-lr)
                if shift is not None:
                    target = shift[i]
                    target.add_(update.to(target.device, target.dtype), alpha=-lr)
            self.epoch += 1
            self._checksum = None

    def stand_in(
        self,
        pseudo_gradient: Sequence[torch.Tensor],
        dtype: torch.dtype = STAND_IN_DTYPE,
        blend_into: list[torch.Tensor] | None = None,
        weight: float = 1.0,
        grad_scale: float = 1.0,
    ) -> list[torch.Tensor]:
        """How far ``step(pseudo_gradient)`` would move each parameter, without moving anything: an overlapped
        round's stand-in for the group's step (eager updates, arXiv 2502.12996). Kept in ``dtype`` (bf16: 2
        bytes per parameter); it only ever moves the local model, and is taken back exactly.

        With ``blend_into`` (the stand-in of another pseudo-gradient, changed in place and returned) the result
        is ``weight`` times this step plus ``1 - weight`` times that one: the step of the blended gradient, as
        the momentum's share splits between the two. ``grad_scale``: the step of ``grad_scale`` times the
        pseudo-gradient (the momentum's share whole)."""
        lr, mu = self.spec.lr, self.spec.momentum
        out = []
        with self.lock, torch.no_grad():
            for i, (buf, grad) in enumerate(zip(self.momentum, pseudo_gradient)):
                grad = grad if grad_scale == 1.0 else grad.mul(grad_scale)
                future = buf.mul(mu).add_(grad)
                update = grad.add(future, alpha=mu) if self.spec.nesterov else future
                update.mul_(-lr * weight)
                if blend_into is None:
                    out.append(update.to(dtype))
                else:
                    out.append(blend_into[i].mul_(1.0 - weight).add_(update.to(dtype)))
        return out

    def write_to(self, model_params: Sequence[torch.Tensor]) -> None:
        with self.lock, torch.no_grad():
            for g, p in zip(self.params, model_params):
                p.copy_(g.to(p.device, p.dtype))

    def checksum(self) -> str:
        """The sha256 of the parameters and then the momentum: everything a peer loads from another's state, so the
        swarm's vote covers the momentum too (a donor cannot serve poisoned momentum under a CRC of its own).
        Computed once per change of the state."""
        cached = self._checksum
        if cached is not None:
            return cached
        with self.lock:
            if self._checksum is None:
                self._checksum = checksum(self.tensors())
            return self._checksum

    def keep_residual(self) -> None:
        """Start keeping an error-feedback residual (zero)."""
        with self.lock:
            self.residual = [torch.zeros_like(p) for p in self.params]
            self.residual_version += 1

    def reset_residual(self) -> None:
        """A state that came from elsewhere: what we had not sent belongs to a model we no longer hold."""
        with self.lock:
            if self.residual is not None:
                for r in self.residual:
                    r.zero_()
                self.residual_version += 1

    def tensors(self) -> list[torch.Tensor]:
        return [*self.params, *self.momentum]

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
            self._checksum = None

    def load_file(self, path: Path, header: StateHeader) -> None:
        """Load a state file already checked with ``state_file.check`` (shapes, checksum, CRC)."""
        if list(header.shapes) != self.shapes:
            raise ValueError(f"{path.name} holds tensors of other shapes than this model")
        with self.lock:
            state_file.load_into(path, header, self.tensors())
            self.epoch = header.epoch
            self._checksum = header.checksum
            self.reset_residual()
