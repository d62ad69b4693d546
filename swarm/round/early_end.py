"""Whether a peer that joins rounds early ends its round before its H-th step.

At most once a second, on the records ``PeerFeed`` reads in the background: a peer the swarm left behind
(``swarm.dht.view.left_behind``) ends at once to catch up, and one whose group is about to start without it
(``swarm.dht.view.round_due``) ends so as to be in it. The rules are pure functions of the view; this keeps the
little state between calls.
"""

from __future__ import annotations

from collections.abc import Callable

from hivemind.utils import get_dht_time

from swarm.dht.view import SwarmView, left_behind, round_due
from swarm.manifest import RunManifest
from swarm.round.steps import RoundSteps

CHECK_EVERY = 1.0  # seconds between two looks at the records


class EarlyEnd:
    """``recent_view``: the newest copy of the records read in the background, or None before the first."""

    def __init__(self, manifest: RunManifest, me: str, recent_view: Callable[[], SwarmView | None]):
        self.manifest, self.me, self._recent_view = manifest, me, recent_view
        self._next_check = 0.0
        self._ended_behind_at: int | None = None  # the swarm's epoch a round was last ended early behind

    def due(self, now: float, epoch: int, steps: RoundSteps, in_flight: bool) -> bool:
        """``in_flight``: our part of this epoch's round is already in the air (overlapped)."""
        m = self.manifest
        avg = m.averaging
        if not avg.join_rounds_early or now < self._next_check or steps.inner_step == 0:
            return False  # not joining early: every round is H steps (the numerics tests compare with a reference)
        if in_flight:
            return False
        self._next_check = now + CHECK_EVERY
        view = self._recent_view()
        if view is None:  # no copy of the records has arrived yet
            return False
        if left_behind(view, epoch, self._ended_behind_at):
            self._ended_behind_at = view.global_epoch
            return True
        return round_due(
            view,
            self.me,
            epoch,
            avg.min_group_size,
            m.inner_steps,
            m.samples_per_step,
            steps.seconds_per_step,
            get_dht_time(),
            my_steps_left=m.inner_steps - steps.inner_step,
        )
