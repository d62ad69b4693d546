"""The inner steps of the round under way: how many, their samples and compute time, and since when."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class RoundSteps:
    inner_step: int = 0
    samples: int = 0
    compute_seconds: float = 0.0
    started: float = field(default_factory=time.monotonic)

    def count(self, samples: int, compute_seconds: float | None) -> None:
        """One more inner step."""
        self.inner_step += 1
        self.samples += samples
        if compute_seconds is not None:
            self.compute_seconds += compute_seconds

    def begin(self) -> None:
        """A new round: the model restarts from the global one (a round's start, or a re-sync)."""
        self.inner_step, self.samples, self.compute_seconds, self.started = 0, 0, 0.0, time.monotonic()

    @property
    def seconds_per_step(self) -> float:
        return self.compute_seconds / self.inner_step if self.inner_step else 0.0
