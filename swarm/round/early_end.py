"""Whether a peer that joins rounds early ends its round before its H-th step.

At most once a second, on the records ``PeerFeed`` reads in the background: a peer the swarm left behind
(``swarm_view.left_behind``) ends at once to catch up, and one whose group is about to start without it
(``swarm_view.round_due``) ends so as to be in it. The rules are pure functions of the view; this keeps the
little state between calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hivemind.utils import get_dht_time

from swarm.dht.view import left_behind, round_due

if TYPE_CHECKING:
    from swarm.peer import Peer

CHECK_EVERY = 1.0  # seconds between two looks at the records


class EarlyEnd:
    def __init__(self, peer: Peer):
        self.peer = peer
        self._next_check = 0.0
        self._ended_behind_at: int | None = None  # the swarm's epoch a round was last ended early behind

    def due(self, now: float) -> bool:
        peer = self.peer
        avg, m = peer.manifest.averaging, peer.manifest
        if not avg.join_rounds_early or now < self._next_check or peer.inner_step == 0:
            return False  # not joining early: every round is H steps (the numerics tests compare with a reference)
        if peer.flight is not None:  # our part of this epoch's round is already in the air (overlapped)
            return False
        self._next_check = now + CHECK_EVERY
        view = peer.recent_view()
        if view is None:  # no copy of the records has arrived yet
            return False
        if left_behind(view, peer.epoch, self._ended_behind_at):
            self._ended_behind_at = view.global_epoch
            return True
        step_seconds = peer.compute_seconds / peer.inner_step
        return round_due(
            view,
            peer.peer_id,
            peer.epoch,
            avg.min_group_size,
            m.inner_steps,
            m.samples_per_step,
            step_seconds,
            get_dht_time(),
            my_steps_left=m.inner_steps - peer.inner_step,
        )
