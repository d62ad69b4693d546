"""A DHT node that dropped every neighbour (hivemind deletes one per unanswered request) finds them again
(``swarm.hivemind_fixes.neighbours``): the rule on ids, then two real DHT processes whose tables are emptied."""

from __future__ import annotations

import time

import hivemind
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from swarm.hivemind_fixes.neighbours import MIN_NEIGHBOURS, PERIOD, PINGS_PER_PASS, keep_neighbours, neighbours_to_ping


def ids(n: int) -> list[PeerID]:
    return [PeerID(bytes([i]) * 34) for i in range(1, n + 1)]


def test_a_full_table_pings_nobody_and_a_short_one_pings_what_it_lacks_once_connected_first():
    me, *peers = ids(12)
    assert neighbours_to_ping(peers[:MIN_NEIGHBOURS], peers, peers, me) == []
    assert neighbours_to_ping([], [], [], me) == []  # a first peer, alone
    # connected peers first (alive), then the initial ones, never itself, each once, a few at a time
    got = neighbours_to_ping([peers[0]], [peers[1], me, peers[0]], [peers[2], peers[1]], me)
    assert got == [peers[1], peers[2]]
    assert neighbours_to_ping([], peers, peers, me) == peers[:PINGS_PER_PASS]


async def _table_size(_dht, node) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


async def _forget_everyone(_dht, node) -> int:
    """What a stalled node's neighbours do to it: every request unanswered, every node deleted."""
    table = node.protocol.routing_table
    for uid in list(table.uid_to_peer_id):
        del table[uid]
    return len(table.uid_to_peer_id)


def test_two_nodes_that_dropped_each_other_find_each_other_again_and_share_values():
    keep_neighbours()  # before the DHT processes fork
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = hivemind.DHT(
        start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[str(m) for m in first.get_visible_maddrs()]
    )
    try:
        assert first.run_coroutine(_table_size) == 1 and second.run_coroutine(_table_size) == 1
        assert first.run_coroutine(_forget_everyone) == 0 and second.run_coroutine(_forget_everyone) == 0
        deadline = time.monotonic() + 4 * PERIOD
        while time.monotonic() < deadline and not (
            first.run_coroutine(_table_size) and second.run_coroutine(_table_size)
        ):
            time.sleep(0.2)
        assert first.run_coroutine(_table_size) == 1 and second.run_coroutine(_table_size) == 1
        # and what one stores, the other reads: without its neighbour a node stores on itself alone
        assert first.store("key", "value", get_dht_time() + 60)
        found = second.get("key", latest=True)
        assert found is not None and found.value == "value"
    finally:
        second.shutdown()
        first.shutdown()
