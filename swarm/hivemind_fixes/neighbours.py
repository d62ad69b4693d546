"""A DHT node whose routing table lost its neighbours finds them again.

Works around: ``DHTProtocol.update_routing_table`` deleting a node from the routing table as soon as one request to
it goes unanswered within ``wait_timeout`` (3 s), while the table refills only when another node contacts this one:
``DHTNode`` never bootstraps again and, with ``refresh_timeout`` None (the default), never refreshes (checked on
hivemind 1.1.12, ``dht/protocol.py``, ``dht/node.py``). A refresh would not help either: it asks the table's own
nodes, and an empty table has none.

On a loaded machine one DHT process that stalled for a few seconds made two peers drop each other for good. Each then
stored and read its own node only: its reads saw its own record (about one record a read, against 3-6 with its
peers in view), matchmaking found nobody ("could not find a group" every round for 14 rounds), and the two trained
apart to different checksums, each its own swarm of one, so no consistency check could notice (three suite runs
here). A volunteer's laptop that sleeps for a minute is the same case.

So every ``PERIOD`` seconds, while the table holds fewer than ``MIN_NEIGHBOURS`` nodes, the node pings up to
``PINGS_PER_PASS`` of the peers that the table lacks among those it has a libp2p connection to and those it started
from (``neighbours_to_ping``). A ping that is answered adds the peer to this table, and this node to the peer's (a
server's ping names its sender). A large swarm's tables hold far more than ``MIN_NEIGHBOURS``, so there this costs a
look at the table every ``PERIOD`` seconds and nothing else.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Iterable

from hivemind.dht.node import DHTNode
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

logger = logging.getLogger(__name__)

PERIOD = 5.0  # seconds between two looks at the routing table
MIN_NEIGHBOURS = 5  # hivemind's num_replicas: a table with fewer cannot place a value on as many nodes as it should
PINGS_PER_PASS = 4  # each one bounded by the node's wait_timeout, all at once

_create = DHTNode.create.__func__
_installed = False


def neighbours_to_ping(
    in_table: Collection[PeerID], connected: Iterable[PeerID], initial: Iterable[PeerID], me: PeerID
) -> list[PeerID]:
    """The peers to ping now: none while the table holds ``MIN_NEIGHBOURS``; else those connected or started from
    that it lacks, at most ``PINGS_PER_PASS``, connected ones first (they are alive), each once."""
    if len(in_table) >= MIN_NEIGHBOURS:
        return []
    known = set(in_table) | {me}
    chosen: list[PeerID] = []
    for peer in (*connected, *initial):
        if peer not in known and peer not in chosen:
            chosen.append(peer)
    return chosen[:PINGS_PER_PASS]


def initial_peer_ids(initial_peers: Iterable[Multiaddr | str] | None) -> list[PeerID]:
    """The peer ids the node was started from (each multiaddr's ``/p2p/`` part)."""
    ids = []
    for maddr in initial_peers or ():
        try:
            ids.append(PeerID.from_base58(Multiaddr(str(maddr))["p2p"]))
        except Exception:  # hivemind's own bootstrap has refused such an address already
            logger.debug("no peer id in the initial peer %s", maddr, exc_info=True)
    return ids


async def keep_once(node: DHTNode, initial: list[PeerID]) -> int:
    """One look at the routing table, with its pings; how many peers answered."""
    table = node.protocol.routing_table
    in_table = set(table.uid_to_peer_id.values())
    if len(in_table) >= MIN_NEIGHBOURS:
        return 0
    connected = [info.peer_id for info in await node.protocol.p2p.list_peers()]
    peers = neighbours_to_ping(in_table, connected, initial, node.peer_id)
    if not peers:  # said too, so that a test's log shows this loop alive and what the table held (an isolated peer)
        logger.debug("the routing table held %d nodes, %d connected: nobody to ping", len(in_table), len(connected))
        return 0
    answers = await asyncio.gather(*(node.protocol.call_ping(peer) for peer in peers))
    found = sum(answer is not None for answer in answers)
    logger.debug("the routing table held %d nodes: pinged %d peers, %d answered", len(in_table), len(peers), found)
    return found


async def _keep(node: DHTNode, initial: list[PeerID]) -> None:
    while node.is_alive:
        await asyncio.sleep(PERIOD)
        try:
            await keep_once(node, initial)
        except Exception:  # the next pass tries again; a node shutting down ends the loop
            logger.debug("keeping the DHT's neighbours failed", exc_info=True)


async def _create_keeping(cls, *args, **kwargs) -> DHTNode:
    node = await _create(cls, *args, **kwargs)
    if not node.protocol.client_mode:  # a client-mode node is in nobody's table, and asks only
        node._swarm_keeper = asyncio.create_task(_keep(node, initial_peer_ids(kwargs.get("initial_peers"))))
    return node


def keep_neighbours() -> None:
    """From now on, in this process and those it forks (the DHT's), a DHT node pings peers its routing table lost.
    Called before the DHT process starts."""
    global _installed
    if not _installed:
        DHTNode.create = classmethod(_create_keeping)
        _installed = True
