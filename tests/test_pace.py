"""The paced search for a leader: a peer waiting for groupmates reads the DHT a few times a second, not in a spin.

hivemind's own loop is run beside it on the same fake DHT, so the test shows the spin it replaces."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.averaging.matchmaking import PotentialLeaders
from hivemind.p2p import PeerID

from swarm.hivemind_fixes import pace

WAIT = 1.0  # seconds a follower waits for a leader that never comes


class CountingKeys:
    """A group key manager whose DHT knows no averager, counting the reads."""

    current_key = "run.0b"

    def __init__(self) -> None:
        self.reads = 0

    async def get_averagers(self, key: str, only_active: bool) -> list:
        self.reads += 1
        await asyncio.sleep(0)  # a real read yields to the event loop at least once
        return []


class NoDeadline:
    deadline = None


async def wait_alone(keys: CountingKeys) -> None:
    leaders = PotentialLeaders(PeerID(b"\x12\x20" + bytes(32)), min_matchmaking_time=5.0, target_group_size=None)
    async with leaders.begin_search(NoDeadline(), keys, declare=False):
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(leaders.pop_next_leader(), WAIT)


def reads_while_alone() -> int:
    keys = CountingKeys()
    asyncio.run(wait_alone(keys))
    return keys.reads


def test_a_follower_alone_reads_the_dht_a_few_times_a_second_not_in_a_spin(monkeypatch):
    # hivemind's loop is restored after the test: pace_matchmaking() patches its class for the whole process
    monkeypatch.setattr(PotentialLeaders, "_update_queue_periodically", PotentialLeaders._update_queue_periodically)
    spin = reads_while_alone()
    pace.pace_matchmaking()
    paced = reads_while_alone()
    assert spin > 50, spin  # hivemind's loop: as fast as the reads return
    assert 1 <= paced <= WAIT / pace.MIN_READ_INTERVAL + 2, paced
