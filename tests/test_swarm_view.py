import time

from swarm.dht.records import EpochChecksum, PeerEntry, PeerState, ProgressRecord
from swarm.dht.view import (
    ResyncReason,
    build_view,
    consensus,
    global_epoch,
    groupmates_published,
    left_behind,
    mates_coming,
    resync_needed,
    round_due,
    round_started_without,
    seconds_to_round,
    swarm_moved_on,
)

A, B, C = "a" * 64, "b" * 64, "c" * 64


def record(peer_id, epoch=0, state=PeerState.training, checksums=(), inner_step=0, sps=0.0):
    return ProgressRecord(
        peer_id=peer_id,
        name=peer_id,
        device="cpu",
        epoch=epoch,
        inner_step=inner_step,
        samples_per_second=sps,
        tokens_processed=0,
        state=state.value,
        last_loss=None,
        client_mode=False,
        relayed=False,
        checksums=[EpochChecksum(epoch=e, checksum=c) for e, c in checksums],
        time=time.time(),
    )


def test_consensus_is_the_majority_checksum():
    peers = [record("p1", checksums=[(3, A)]), record("p2", checksums=[(3, B)]), record("p3", checksums=[(3, B)])]
    agreed = consensus(peers, 3)
    assert agreed.checksum == B and agreed.holders == ("p2", "p3") and agreed.voters == 3
    assert consensus(peers, 4) is None


def test_consensus_ties_go_to_the_lowest_peer_id_whatever_the_order():
    peers = [record("zz", checksums=[(1, A)]), record("aa", checksums=[(1, B)])]
    assert consensus(peers, 1).checksum == B
    assert consensus(list(reversed(peers)), 1).checksum == B


def test_global_epoch_is_the_median_so_one_liar_cannot_move_it_nor_a_third_of_the_keys():
    peers = [record("p1", epoch=5), record("p2", epoch=5), record("liar", epoch=10**6)]
    assert global_epoch(peers) == 5
    assert global_epoch([record("p1", epoch=4), record("p2", epoch=5)]) == 5  # halves go forward
    assert global_epoch([]) is None
    # honest peers straddle a round's transition; a third of the keys announce an epoch nobody reached: the most
    # common epoch (ties forward) would be theirs, the median stays with the honest peers
    straddling = [record(f"h{i}", epoch=4 + i % 2) for i in range(6)]
    sybils = [record(f"s{i}", epoch=9) for i in range(3)]
    assert global_epoch(straddling + sybils) == 5
    assert global_epoch(straddling + [record(f"s{i}", epoch=9) for i in range(6)]) == 9  # half of the keys do


def test_expired_and_leaving_peers_are_not_alive():
    now = time.time()
    entries = [
        PeerEntry(record("alive", inner_step=2, sps=8.0), now + 10),
        PeerEntry(record("expired"), now - 1),
        PeerEntry(record("leaving", state=PeerState.leaving), now + 10),
    ]
    view = build_view(entries, now, inner_steps=10, samples_per_step=4)
    assert [p.peer_id for p in view.peers] == ["alive"]
    assert view.global_epoch == 0
    assert view.eta_next_round == (10 - 2) * 4 / 8.0


def view_of(*peers):
    now = time.time()
    return build_view([PeerEntry(p, now + 10) for p in peers], now, inner_steps=10, samples_per_step=4)


def test_resync_when_behind_ran_ahead_or_outvoted_and_not_otherwise():
    swarm_at_5 = [record("p1", epoch=5, checksums=[(5, A)]), record("p2", epoch=5, checksums=[(5, A)])]
    behind = resync_needed(view_of(*swarm_at_5, record("me", epoch=4)), "me", 4, C, last_round_local=False)
    assert behind.reason == ResyncReason.behind and str(behind) == "behind the swarm (epoch 4, the swarm is at 5)"

    ahead = view_of(*swarm_at_5, record("me", epoch=6, checksums=[(6, C)]))
    assert resync_needed(ahead, "me", 6, C, last_round_local=True).reason == ResyncReason.ran_ahead
    assert resync_needed(ahead, "me", 6, C, last_round_local=False) is None  # averaged its way there: fine

    outvoted = view_of(*swarm_at_5, record("me", epoch=5, checksums=[(5, B)]))
    disagreed = resync_needed(outvoted, "me", 5, B, last_round_local=False)
    assert disagreed.reason == ResyncReason.disagreed and "at epoch 5" in str(disagreed)
    assert resync_needed(outvoted, "me", 5, A, last_round_local=False) is None
    alone = view_of(record("me", epoch=5, checksums=[(5, B)]))
    assert resync_needed(alone, "me", 5, B, last_round_local=False) is None  # one voter: nothing to compare


def test_round_rules_moved_on_mates_coming_started_without_us_and_groupmates_published():
    view = view_of(
        record("me", epoch=3),
        record("m1", epoch=3, state=PeerState.matchmaking),
        record("m2", epoch=3, state=PeerState.matchmaking),
        record("t1", epoch=3, state=PeerState.training),
        record("old", epoch=2, state=PeerState.training),
    )
    assert not swarm_moved_on(view, 3) and swarm_moved_on(view_of(record("a", epoch=4)), 3)
    assert mates_coming(view, "me", 3) and not mates_coming(view, "me", 7)
    assert round_started_without(view, "me", 3, min_group_size=2)  # 2 of 3 mates matchmaking
    assert not round_started_without(view, "me", 3, min_group_size=4)  # 2 cannot form a group of 4 without us
    assert not round_started_without(view_of(record("me", epoch=3), record("t1", epoch=3)), "me", 3, 2)

    group = ("me", "g1", "g2")
    partly = view_of(record("g1", epoch=4, checksums=[(4, A)]), record("g2", epoch=4))
    assert not groupmates_published(partly, group, "me", 4)
    done = view_of(record("g1", epoch=4, checksums=[(4, A)]), record("g2", epoch=5))  # moved past it counts
    assert groupmates_published(done, group, "me", 4)
    gone = view_of(record("g1", epoch=4, checksums=[(4, A)]))  # g2 left: nothing more will come from it
    assert groupmates_published(gone, group, "me", 4)
    leaving = view_of(record("g1", epoch=4, checksums=[(4, A)]), record("g2", epoch=4, state=PeerState.leaving))
    assert groupmates_published(leaving, group, "me", 4)
    assert not groupmates_published(view_of(), group, "me", 4)  # no records at all: a failed read proves nothing
    assert groupmates_published(view_of(), ("me",), "me", 4)  # a round alone has nobody to wait for


def test_a_peer_left_behind_ends_its_round_once_per_epoch_of_the_swarm():
    swarm_at_5 = view_of(record("p1", epoch=5), record("p2", epoch=5), record("me", epoch=4))
    assert left_behind(swarm_at_5, 4, ended_behind_at=None)
    assert not left_behind(swarm_at_5, 4, ended_behind_at=5)  # ended at 5 already: its re-sync failed
    assert left_behind(swarm_at_5, 4, ended_behind_at=3)
    assert not left_behind(swarm_at_5, 5, ended_behind_at=None)  # with the swarm
    # a tie goes to the later epoch: in a swarm of two, the one behind is the one that re-syncs
    assert left_behind(view_of(record("p1", epoch=5), record("me", epoch=4)), 4, ended_behind_at=None)
    # one peer's wild epoch is not the swarm's
    wild = view_of(record("p1", epoch=4), record("p2", epoch=99), record("me", epoch=4))
    assert not left_behind(wild, 4, ended_behind_at=None)


def test_a_slow_peer_ends_its_round_when_the_swarm_is_about_to_start_one():
    now = time.time()
    fast = [record(f"f{i}", epoch=2, inner_step=19, sps=8.0) for i in range(2)]  # 1 step of 4 samples left: 0.5 s
    view = view_of(*fast, record("slow", epoch=2, inner_step=4, sps=2.0))
    eta = seconds_to_round(view, "slow", 2, inner_steps=20, samples_per_step=4, now=now)
    assert 0.4 < eta <= 0.5
    # the slow peer's step takes 2 s: it cannot finish another before the round starts, so it ends now
    assert round_due(view, "slow", 2, 2, 20, 4, my_step_seconds=2.0, now=now)
    # a peer as fast as the others does not stop a step short
    assert not round_due(view, "f0", 2, 2, 20, 4, my_step_seconds=0.5, now=now, my_steps_left=1)
    # a peer 3x slower, with steps left, stops as soon as one more step would end after the mates start
    three = view_of(*(record(f"f{i}", epoch=2, inner_step=18, sps=8.0) for i in range(2)))  # 1.0 s to go
    assert round_due(three, "slow", 2, 2, 20, 4, my_step_seconds=1.5, now=now, my_steps_left=10)
    assert not round_due(three, "slow", 2, 2, 20, 4, my_step_seconds=0.8, now=now, my_steps_left=10)
    # old records count: 5 s later the fast peers are surely there
    assert seconds_to_round(view, "slow", 2, 20, 4, now=now + 5) == 0.0
    # mates of other epochs, or none training, say nothing
    assert seconds_to_round(view_of(record("x", epoch=3, sps=8.0)), "slow", 2, 20, 4, now) == float("inf")
