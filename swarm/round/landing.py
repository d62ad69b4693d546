"""How an overlapped round's average lands on a model that kept training: the stand-in step taken back, the
group's step applied (``OuterState.step(shift=...)``), and the inner steps taken in flight kept, or damped."""

from __future__ import annotations

from collections.abc import Sequence

import torch

DAMP_FROM_STEPS = 2  # an average landing fewer inner steps late keeps them all (see ``share_kept``)


def share_kept(kept: float, steps_late: int) -> float:
    """The share of the inner steps taken since the round took off that stays when its average lands
    ``steps_late`` steps into the next round: ``kept`` (``averaging.in_flight_steps_kept``) from
    ``DAMP_FROM_STEPS`` late, all of them before. In the simulator (``tiny``, fp4, H = 10, five seeds each),
    damping by half cost 1.0% of held-out loss at 1 step late and gained 2.9% at 2 and 10.9% at 5
    (``benchmarks/results/convergence-merge``)."""
    return kept if steps_late >= DAMP_FROM_STEPS else 1.0


def add_steps(params: Sequence[torch.Tensor], steps: Sequence[torch.Tensor], sign: float) -> None:
    """``p += sign * step`` for each parameter (a stand-in's step taken, or taken back exactly)."""
    with torch.no_grad():
        for p, step in zip(params, steps):
            p.add_(step.to(p.device, p.dtype), alpha=sign)


def damp_steps(params: Sequence[torch.Tensor], global_params: Sequence[torch.Tensor], kept: float) -> None:
    """``p <- global + kept * (p - global)``: the model is the global one plus the inner steps taken since the round
    took off; of those, keep ``kept``."""
    with torch.no_grad():
        for p, g in zip(params, global_params):
            g = g.to(p.device, p.dtype)
            p.sub_(g).mul_(kept).add_(g)


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)
