"""How late overlapped rounds land, and one plain line when it is late enough to cost loss.

In an overlapped round the inner steps taken while the average is in flight start from a stand-in, not from the
group's new model. What that costs grows steeply with how many there are: under ``tiny``'s plain averaging, H = 10,
mean of five seeds, 0.5% of blocking FP32's held-out loss when the average lands 1 step late, 2.1% at 2 steps,
12.9% at 5 (``docs/benchmarks.md``, section 6). The lag is the round's matchmaking (waiting for the last
groupmate) and all-reduce, in inner steps; a run with longer rounds (a larger ``inner_steps``) makes the same lag
a smaller share of the round. Only the run's creator can change that, so the peer says it once and goes on.

A peer slower than the rest can also be left behind for good: the others end each round before it can take part,
and every one of its rounds ends in a re-sync that throws its steps away. It notices at its next step and re-syncs
at once (``swarm.round.early_end``), but its volunteer is told too, once, since only a faster device helps.
"""

from __future__ import annotations

import statistics
from collections import deque

from swarm.dht.view import ResyncReason
from swarm.events import RoundReport

WINDOW = 5  # rounds the median is taken over
COSTLY_SHARE = 0.25  # of a round: between the measured 2% (a fifth) and 13% (a half)


class LagWatch:
    """Feed it each round's ``steps_late`` (None for blocking rounds); ``advice`` returns the line once."""

    def __init__(self, inner_steps: int, steps_kept: float = 1.0):
        self.inner_steps = inner_steps
        self.steps_kept = steps_kept  # the run's averaging.in_flight_steps_kept
        self._late: deque[int] = deque(maxlen=WINDOW)
        self._said = False

    def add(self, steps_late: int | None) -> None:
        if steps_late is not None:
            self._late.append(steps_late)

    def advice(self) -> str | None:
        if self._said or len(self._late) < WINDOW:
            return None
        median = statistics.median(self._late)
        if median < COSTLY_SHARE * self.inner_steps:
            return None
        self._said = True
        undamped = self.steps_kept == 1.0
        damping = ", or with averaging.in_flight_steps_kept=0.5 (2% instead of 13% at half a round, in the simulator)"
        cost = "13% at half a round" if undamped else "2% at half a round with the steps taken meanwhile damped"
        return (
            f"Overlapped averages land a median {median:g} of {self.inner_steps} inner steps into the next round: "
            f"at a quarter of a round or more the overlap costs held-out loss ({cost}, in docs/benchmarks.md, "
            "section 6). A run started with a larger inner_steps would hide the same lag cheaper"
            f"{damping if undamped else ''}."
        )


BEHIND_ROUNDS = 3  # rounds in a row that ended behind the swarm: a slow device, not one late start or a stall


class BehindWatch:
    """Feed it each round's report; ``advice`` returns one line, once, when ``BEHIND_ROUNDS`` in a row were
    re-synced because the swarm had finished them without this peer."""

    def __init__(self):
        self._epochs: deque[int] = deque(maxlen=BEHIND_ROUNDS)  # the last rounds, all re-synced as behind
        self._said = False

    def add(self, report: RoundReport) -> None:
        if report.resync_reason == ResyncReason.behind:
            self._epochs.append(report.epoch)
        else:
            self._epochs.clear()

    def advice(self) -> str | None:
        if self._said or len(self._epochs) < BEHIND_ROUNDS:
            return None
        self._said = True
        return (
            f"The swarm finished this peer's last {len(self._epochs)} rounds without it (re-synced to epochs "
            f"{', '.join(map(str, self._epochs))}): the others end a round before this peer can take part, so its "
            "steps are thrown away. It needs a faster device, or fewer other loads on this one; a run with a larger "
            "inner_steps would also let it keep up."
        )
