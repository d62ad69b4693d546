"""``swarm.round.early_end``: when a peer joining rounds early ends its round before step H, on real views."""

import time

from diloco_helpers import tiny_manifest
from test_swarm_view import A, B, C, record

from swarm.dht.records import PeerEntry
from swarm.dht.view import build_view
from swarm.round.early_end import CHECK_EVERY, EarlyEnd
from swarm.round.steps import RoundSteps


class Views:
    """The background copy of the records, as a test sets it."""

    def __init__(self, view):
        self.view = view

    def __call__(self):
        return self.view


def early_end(views: Views, join_rounds_early=True) -> EarlyEnd:
    return EarlyEnd(tiny_manifest(inner_steps=10, join_rounds_early=join_rounds_early), A, views)


def steps(inner_step=2) -> RoundSteps:
    return RoundSteps(inner_step=inner_step, compute_seconds=0.2 * inner_step)


def view_of(*records):
    return build_view([PeerEntry(r, time.time() + 60) for r in records], time.time(), 10, 8)


def due(end: EarlyEnd, now: float, epoch=3, inner_step=2, in_flight=False) -> bool:
    return end.due(now, epoch, steps(inner_step), in_flight)


def test_a_peer_the_swarm_left_behind_ends_its_round_once_per_swarm_epoch():
    views = Views(view_of(record(A, 3, inner_step=2), record(B, 4), record(C, 4)))  # the others finished epoch 3
    end = early_end(views)
    assert due(end, now=100.0)
    assert not due(end, now=100.5)  # looked less than a second ago
    assert not due(end, now=100.0 + 2 * CHECK_EVERY)  # its re-sync failed: the next try is at step H
    views.view = view_of(record(A, 3, inner_step=2), record(B, 5), record(C, 5))
    assert due(end, now=100.0 + 4 * CHECK_EVERY)  # the swarm moved on again


def test_no_early_end_in_flight_before_the_first_step_without_records_or_when_not_joining_early():
    behind = Views(view_of(record(A, 3, inner_step=2), record(B, 4), record(C, 4)))
    assert not due(early_end(behind), now=100.0, in_flight=True)  # our part is in the air already
    assert not due(early_end(behind), now=100.0, inner_step=0)
    assert not due(early_end(Views(None)), now=100.0)
    assert not due(early_end(behind, join_rounds_early=False), now=100.0)
    assert due(early_end(behind), now=100.0)  # and the same peer otherwise would


def test_a_peer_whose_mates_are_all_matchmaking_without_it_ends_its_round_to_join_them():
    from swarm import PeerState

    busy = view_of(record(A, 3, inner_step=2), record(B, 3, PeerState.matchmaking), record(C, 3, PeerState.matchmaking))
    assert due(early_end(Views(busy)), now=100.0)
    training = view_of(record(A, 3, inner_step=2), record(B, 3, inner_step=2), record(C, 3, inner_step=2))
    assert not due(early_end(Views(training)), now=100.0)
