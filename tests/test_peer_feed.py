"""PeerFeed: the training thread's copy of everyone's records, read in the background, never waited for."""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest
from diloco_helpers import tiny_manifest
from test_records import progress_value

from swarm import NetworkConfig, start_dht
from swarm.dht.peers import PeerFeed, read_peers
from swarm.dht.presence import Presence
from swarm.dht.records import run_validator


class FakeDHT:
    """Hands out futures the test answers itself, and counts the reads started."""

    def __init__(self):
        self.reads: list[Future] = []

    def get(self, key, latest, return_future):
        assert latest and return_future  # the feed never blocks on the DHT
        self.reads.append(Future())
        return self.reads[-1]


def answered(future: Future, value=None, error: Exception | None = None) -> None:
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def test_the_first_call_starts_a_read_and_returns_nothing_until_it_is_answered():
    dht = FakeDHT()
    feed = PeerFeed(dht, "0123456789abcdef", max_age=1000.0)
    assert feed.latest() is None and len(dht.reads) == 1
    assert feed.latest() is None and len(dht.reads) == 1  # one read at a time
    answered(dht.reads[0], None)  # the key holds nothing yet
    assert feed.latest() == [] and len(dht.reads) == 1  # a fresh copy: no new read before max_age


def test_a_copy_older_than_max_age_starts_the_next_read_and_a_failed_read_keeps_the_last_copy():
    dht = FakeDHT()
    feed = PeerFeed(dht, "0123456789abcdef", max_age=0.0)
    feed.latest()
    answered(dht.reads[0], None)
    assert feed.latest() == [] and len(dht.reads) == 2  # collected, and (max_age 0) the next one started
    answered(dht.reads[1], error=TimeoutError("no answer from the DHT process"))
    assert feed.latest() == [] and len(dht.reads) == 3  # the failure left the last copy in place


def test_a_read_not_answered_within_the_timeout_is_given_up_for_a_new_one():
    dht = FakeDHT()
    feed = PeerFeed(dht, "0123456789abcdef", max_age=0.0, timeout=0.05)
    feed.latest()
    deadline = time.monotonic() + 10
    while len(dht.reads) < 2 and time.monotonic() < deadline:
        assert feed.latest() is None
        time.sleep(0.01)
    assert len(dht.reads) == 2 and not dht.reads[0].done()


@pytest.fixture
def dht():
    node = start_dht(NetworkConfig(host_ip="127.0.0.1", host_port=0))
    yield node
    node.shutdown()


def poll(feed: PeerFeed, ready, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entries = feed.latest()
        if entries is not None and ready(entries):
            return entries
        time.sleep(0.05)
    raise AssertionError(f"the feed did not catch up in {timeout} s: {feed.latest()}")


def test_on_a_real_dht_the_feed_reads_what_read_peers_reads_and_follows_updates(dht):
    run_id = tiny_manifest().run_id
    dht.add_validators([run_validator(run_id)])
    peer_id = dht.peer_id.to_base58()
    reporter = Presence(dht, run_id, progress_value(peer_id, epoch=3))
    reporter.start()
    try:
        feed = PeerFeed(dht, run_id, max_age=0.2)
        entries = poll(feed, lambda e: len(e) == 1)
        assert (
            [(e.record.peer_id, e.record.epoch) for e in entries]
            == [(e.record.peer_id, e.record.epoch) for e in read_peers(dht, run_id)]
            == [(peer_id, 3)]
        )
        reporter.update(epoch=4, publish_now=True)
        entries = poll(feed, lambda e: len(e) == 1 and e[0].record.epoch == 4)
        assert entries[0].record.peer_id == peer_id
    finally:
        reporter.stop()
