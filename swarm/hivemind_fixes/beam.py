"""DHT reads and writes that ask the nodes holding a value, not every node a beam of twenty can reach.

Works around: ``DHTNode.get_many_by_id`` and ``DHTNode.store_many`` searching with a beam of ``bucket_size`` (20)
nodes, while a value lives on its ``num_replicas`` (5) nearest nodes (checked on hivemind 1.1.12, ``dht/node.py``).

A read with ``latest=True`` (every read of this project, and hivemind's matchmaking) never settles for the first
copy it finds: it asks every node of its beam. In a swarm of up to 21 peers that is every other peer, for every
read, and every write first searches the same way for the nodes to store on. Measured with 12 `tiny` peers on one
machine: each DHT read or write cost about 11 find requests served by other peers (59,161 in 200 s for 2,815 reads
and 1,946 writes), and the DHT processes took most of the machine's two cores.

A value is stored on the ``num_replicas`` nodes nearest its key, and a search with a beam of that width ends on
those same nodes: it visits them and whichever it passes on the way, and merges what they hold (a key's subkeys
from every replica). So reads and writes that name no beam of their own search with ``num_replicas`` here. The
routing table's refresh keeps hivemind's wide beam (``find_nearest_nodes`` called directly): it is what fills the
table that the narrow searches start from.
"""

from __future__ import annotations

from hivemind.dht.node import DHTNode

_get_many_by_id = DHTNode.get_many_by_id
_store_many = DHTNode.store_many
_installed = False


async def _get_many_by_id_narrow(self: DHTNode, key_ids, sufficient_expiration_time=None, num_workers=None,
                                 beam_size=None, **kwargs):  # fmt: skip
    beam_size = self.num_replicas if beam_size is None else beam_size
    return await _get_many_by_id(self, key_ids, sufficient_expiration_time, num_workers, beam_size, **kwargs)


async def _store_many_narrow(self: DHTNode, *args, **kwargs):
    kwargs.setdefault("beam_size", self.num_replicas)
    return await _store_many(self, *args, **kwargs)


def narrow_searches() -> None:
    """From now on, in this process and those it forks (the DHT's), reads and writes search ``num_replicas`` wide.
    Called before the DHT process starts."""
    global _installed
    if not _installed:
        DHTNode.get_many_by_id = _get_many_by_id_narrow
        DHTNode.store_many = _store_many_narrow
        _installed = True
