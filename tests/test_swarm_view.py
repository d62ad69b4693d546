import time

from swarm.progress import PeerEntry
from swarm.records import EpochChecksum, PeerState, ProgressRecord
from swarm.swarm_view import build_view, consensus, global_epoch

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


def test_global_epoch_is_the_majority_so_one_liar_cannot_move_it():
    peers = [record("p1", epoch=5), record("p2", epoch=5), record("liar", epoch=10**6)]
    assert global_epoch(peers) == 5
    assert global_epoch([record("p1", epoch=4), record("p2", epoch=5)]) == 5  # ties go forward
    assert global_epoch([]) is None


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
