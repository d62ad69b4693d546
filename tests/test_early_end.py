"""``swarm.round.early_end``: when a peer joining rounds early ends its round before step H, with a fake peer."""

import time
from types import SimpleNamespace

from diloco_helpers import tiny_manifest
from test_swarm_view import A, B, C, record

from swarm.dht.progress import PeerEntry
from swarm.dht.view import build_view
from swarm.round.early_end import CHECK_EVERY, EarlyEnd


def fake_peer(view, epoch=3, inner_step=2, flight=None, join_rounds_early=True):
    manifest = tiny_manifest(inner_steps=10, join_rounds_early=join_rounds_early)
    return SimpleNamespace(
        manifest=manifest,
        peer_id=A,
        epoch=epoch,
        inner_step=inner_step,
        compute_seconds=0.2 * inner_step,
        flight=flight,
        recent_view=lambda: view,
    )


def view_of(*records):
    return build_view([PeerEntry(r, time.time() + 60) for r in records], time.time(), 10, 8)


def test_a_peer_the_swarm_left_behind_ends_its_round_once_per_swarm_epoch():
    view = view_of(record(A, 3, inner_step=2), record(B, 4), record(C, 4))  # the others finished epoch 3
    end = EarlyEnd(fake_peer(view))
    assert end.due(now=100.0)
    assert not end.due(now=100.5)  # looked less than a second ago
    assert not end.due(now=100.0 + 2 * CHECK_EVERY)  # its re-sync failed: the next try is at step H
    ahead = view_of(record(A, 3, inner_step=2), record(B, 5), record(C, 5))
    end.peer.recent_view = lambda: ahead
    assert end.due(now=100.0 + 4 * CHECK_EVERY)  # the swarm moved on again


def test_no_early_end_in_flight_before_the_first_step_without_records_or_when_not_joining_early():
    behind = view_of(record(A, 3, inner_step=2), record(B, 4), record(C, 4))
    assert not EarlyEnd(fake_peer(behind, flight=object())).due(now=100.0)  # our part is in the air already
    assert not EarlyEnd(fake_peer(behind, inner_step=0)).due(now=100.0)
    assert not EarlyEnd(fake_peer(None)).due(now=100.0)
    assert not EarlyEnd(fake_peer(behind, join_rounds_early=False)).due(now=100.0)


def test_a_peer_whose_mates_are_all_matchmaking_without_it_ends_its_round_to_join_them():
    from swarm import PeerState

    busy = view_of(record(A, 3, inner_step=2), record(B, 3, PeerState.matchmaking), record(C, 3, PeerState.matchmaking))
    assert EarlyEnd(fake_peer(busy)).due(now=100.0)
    training = view_of(record(A, 3, inner_step=2), record(B, 3, inner_step=2), record(C, 3, inner_step=2))
    assert not EarlyEnd(fake_peer(training)).due(now=100.0)
