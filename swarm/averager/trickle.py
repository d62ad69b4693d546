"""A download that trickles is given up early: a donor that sends a chunk just inside ``chunk_timeout``, again and
again, would otherwise hold its receiver for the whole download's bound (``AveragingSpec.transfer_timeout``: a
``150m`` state at 10 Mbit/s, 23 minutes) before the next donor is asked.

The floor (``AveragingSpec.min_rate``, a tenth of the slowest link the bounds are sized for) is judged over a
sliding window: after the first ``RATE_WINDOW`` seconds, the bytes of the last ``RATE_WINDOW`` seconds must reach
it on average. A file that arrives within the window is never judged (a small state over any link), and a donor
that is slow for a while, not for a whole window, is not given up on. A donor above the floor is ended by the
download's bound as before: what a trickler can hold a receiver for is then what an honest 10 Mbit/s donor takes.
State downloads and replays use it; the fetch of a round's swarm's average does not (a delegate serving its
children and many other groups' delegates at once may fall below it honestly, and that fetch's bound is one
average at 10 Mbit/s, minutes, not a whole state)."""

from __future__ import annotations

from collections import deque

RATE_WINDOW = 60.0  # seconds over which a download's rate is judged


class TooSlow(RuntimeError):
    """The donor sent less than the floor over a whole window."""


class RateFloor:
    """Fed the bytes received so far at each chunk; raises ``TooSlow`` once a whole window fell below the floor."""

    def __init__(self, min_rate: float, started: float, window: float = RATE_WINDOW):
        self.min_rate, self.window = float(min_rate), float(window)
        self._marks: deque[tuple[float, int]] = deque([(started, 0)])

    def note(self, received: int, now: float) -> None:
        if self.min_rate <= 0:
            return
        marks = self._marks
        marks.append((now, received))
        while len(marks) > 1 and marks[1][0] <= now - self.window:
            marks.popleft()  # keep one mark at or before the window's start
        since, then = marks[0]
        if now - since >= self.window and (received - then) / (now - since) < self.min_rate:
            raise TooSlow(
                f"{(received - then) / (now - since) / 125_000:.2f} Mbit/s over the last {now - since:.0f} s, "
                f"below the floor of {self.min_rate / 125_000:.2f} Mbit/s"
            )
