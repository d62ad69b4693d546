"""The inner optimizer's memory of the steps taken while an overlapped round is in flight.

In an overlapped round the model goes on training from a stand-in (``swarm.round.pipeline``): the global model moved
by a guess of the group's step. When the average lands the stand-in's step is swapped for the group's and the inner
steps taken meanwhile are kept. Their gradients, though, were measured where the model turned out not to be, and
AdamW's first moment would carry them on through the rest of the round (beta1 = 0.9: about 60% of one step's
weight over the next nine). So when the round lands they are taken out of it:

    exp_avg <- beta1^D * exp_avg(when the round took off)

where D is the optimizer steps taken since, which is exactly the first moment less each such step's
``(1 - beta1) * beta1^k * g``. The steps themselves and the second moment are kept. The inner optimizer is each
peer's own, so this changes no shared state and no checksum.

Measured with ``benchmarks.convergence``'s ``moments=forget`` (H = 10, fp4, the average one step late, 1000 steps,
five seeds on a lent machine's CPU cores): overlapped fp4 went from 1.041 to 1.022 of blocking FP32 on average,
better in four seeds of five (``benchmarks/results/convergence-moments-seeds/README.md``).

The copy is kept in bf16 on the host, 2 bytes per parameter while a round is in flight: on a GPU peer it takes
no GPU memory, whose micro-batch was sized without it.
"""

from __future__ import annotations

import torch

STORE_DTYPE = torch.bfloat16


class FlightMoments:
    """Call ``after_step(peer.flight)`` after every inner step: a flight that appeared is the start of an
    overlapped round (the first moment is copied), one that went away has landed (the copy, decayed, comes back).
    Both may happen in one call (a round that landed at the boundary where the next one took off)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._flight: object | None = None
        # param -> (its step count, its exp_avg tensor, a copy of its values), when the round took off
        self._saved: dict[torch.Tensor, tuple[float, torch.Tensor, torch.Tensor]] = {}
        self.landed = 0  # rounds whose moments were corrected

    def after_step(self, flight: object | None) -> None:
        if flight is self._flight:
            return
        if self._flight is not None:
            self._land()
        self._flight = flight
        if flight is not None:
            self._save()

    def _save(self) -> None:
        self._saved = {
            p: (float(s["step"]), s["exp_avg"], s["exp_avg"].detach().to("cpu", STORE_DTYPE, copy=True))
            for p, s, _ in self._moments()
        }

    def _land(self) -> None:
        saved, self._saved = self._saved, {}
        corrected = False
        with torch.no_grad():
            for p, state, beta1 in self._moments():
                if p not in saved:
                    continue
                step0, tensor, values = saved[p]
                taken = float(state["step"]) - step0
                if taken <= 0 or state["exp_avg"] is not tensor:  # no step since, or the state was rebuilt since
                    continue  # (cleared after non-finite losses or a re-sync): nothing of the flight is in it
                tensor.copy_(values).mul_(beta1**taken)
                corrected = True
        self.landed += corrected

    def _moments(self):
        """(parameter, its AdamW state, its beta1) for every parameter that has a first moment."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state.get(p)
                if state and "exp_avg" in state and "step" in state:
                    yield p, state, group["betas"][0]
