"""Everyone's progress records, a few buckets at a time; and the swarm view they give.

Records are spread over bucket keys (``swarm.dht.records``: level L has 2^L buckets, a peer's bucket the first L bits
of a hash of its id), and a reader reads one bucket at a time, at the level whose buckets hold about
``BUCKET_SIZE`` records: each read costs the same whatever the swarm's size. ``RecordCache`` keeps the newest record
of every peer seen in the buckets read lately (each expires with its record), rotates through the level's buckets,
and moves one level up or down when the buckets it reads are too full or too empty. In a run of a few peers
(level 0) every read is the one key that holds them all; in a large one the view is a sample that covers a new
bucket every read, plus the buckets a caller names (its groupmates'). ``peers_estimate`` is how many peers the
run has, as counted from that sample: it sets the levels a peer writes its own record to
(``swarm.dht.presence``) and how many matchmaking buckets its round uses.

A record is kept only if it is well formed, unexpired but set to live no longer than its writer could give it
(``records.fresh``), and its ``peer_id`` is its signer's (``swarm.dht.identity``).
``SwarmReader`` builds the view the rules read (``swarm.dht.view``) after the caller's own filter (a peer drops the
peers it banned).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable
from typing import Any

import hivemind
from hivemind.utils import get_dht_time

from swarm.dht import calls
from swarm.dht.identity import peer_id_of_owner
from swarm.dht.records import (
    BUCKET_SIZE,
    MAX_LEVEL,
    RECORD_TTL,
    PeerEntry,
    ProgressRecord,
    bucket_of,
    live_items,
    parse_record,
    progress_key,
)
from swarm.dht.view import SwarmView, build_view

logger = logging.getLogger(__name__)

OCCUPANCY_DECAY = 0.7  # how much of the running count of records per bucket one more read leaves


PROBE_LEVELS = (2, 4, 6, MAX_LEVEL)  # where a reader that found nobody at level 0 looks next
REFIND_EVERY = 10.0  # seconds between two looks for the run's level while a reader sees only its own record
# every PROBE_EVERY-th read is of a random bucket PROBE_UP levels above ours: where the rest of a run that counts more
# peers than we do writes, when neither part reads the other's levels (write_levels: ours and its neighbours)
PROBE_EVERY, PROBE_UP = 10, 2


def read_bucket(dht: hivemind.DHT, run_id: str, level: int, bucket: int) -> list[PeerEntry]:
    """The records of one bucket, only those of peers whose bucket it is (``bucket_of``): a key that wrote its record
    into every bucket of a level would fill the buckets a probe finds (``RecordCache.add`` moves up to a level
    whose buckets hold 2 records) and count in every reader's estimate of the swarm's size."""
    entries = parse_peers(calls.get(dht, progress_key(run_id, level, bucket)))
    return [e for e in entries if bucket_of(e.record.peer_id, level) == bucket]


def find_level(dht: hivemind.DHT, run_id: str, me: str | None = None) -> tuple[int, list[PeerEntry]]:
    """The level the run's peers write to, and what a bucket there holds: level 0 for a run of a few peers; a large
    run's peers write only the levels next to theirs (``records.write_levels``: three in a row, so one of the even
    levels probed here holds them). (0, []) for a run nobody else writes to. Our own record (``me``), written at
    level 0 before we knew the run's level, does not count: a joiner that found only itself there stayed at level 0
    alone, saw nobody, and trained from the seed as the run's first peer (swarm-sim, N = 100)."""
    for level in (0, *PROBE_LEVELS):
        entries = read_bucket(dht, run_id, level, random.randrange(1 << level))
        if holds_others(entries, me):
            return level, entries
    return 0, []


def holds_others(entries: list[PeerEntry], me: str | None) -> bool:
    """Some record that is not our own (``me``; None: any record at all)."""
    return any(entry.record.peer_id != me for entry in entries)


def read_peers(dht: hivemind.DHT, run_id: str) -> list[PeerEntry]:
    """A census: every well-formed, unexpired progress record of a run, from every bucket of the level its peers
    write to (malformed and mismatched ones dropped). Its cost grows with the run: for ``status`` and tests; a peer
    reads a bucket at a time (``SwarmReader``)."""
    level, entries = find_level(dht, run_id)
    found = {e.record.peer_id: e for e in entries}
    for bucket in range(1 << level) if level else ():
        for entry in read_bucket(dht, run_id, level, bucket):
            found.setdefault(entry.record.peer_id, entry)
    return list(found.values())


def parse_peers(found: Any, ttl: float = RECORD_TTL) -> list[PeerEntry]:
    """``read_peers``'s rules, applied to what a DHT read of one of the run's progress keys returned (None: nothing):
    well formed, unexpired, not set to outlive ``ttl`` (``records.fresh``; a benchmark that writes longer-lived
    records says so), and signed by its ``peer_id``."""
    entries = []
    for subkey, value, expiration in live_items(found, get_dht_time(), ttl):
        record = parse_record(ProgressRecord, value)
        if record is not None and record.peer_id == peer_id_of_owner(subkey):  # not posing as another, or a second
            entries.append(PeerEntry(record, expiration))
    return entries


class RecordCache:
    """The newest record of each peer seen lately, the level read, and the next bucket to read."""

    def __init__(self) -> None:
        self.records: dict[str, PeerEntry] = {}
        self.level = 0
        self.reads = self.records_read = 0  # bucket reads and the records they returned: the peer's DHT traffic
        self._occupancy: float | None = None  # records per bucket read at this level, smoothed
        self._next = 0
        self._planned = 0  # reads handed out by next_read

    def next_bucket(self) -> int:
        bucket = self._next % (1 << self.level)
        self._next = bucket + 1
        return bucket

    def next_read(self) -> tuple[int, int]:
        """The level and bucket of the next read: this level's buckets in turn, and every ``PROBE_EVERY``-th read a
        random bucket ``PROBE_UP`` levels up. Peers that arrived while the run was small can settle at a low level
        and the rest at a high one, each part's buckets holding about ``BUCKET_SIZE`` of its own: then neither reads
        the levels the other writes to, and the view splits for good (swarm-sim, N = 100: 8-13 late arrivals formed
        their own groups every round, registered minutes after the others' roster and lost their work). In one run
        at one level, nobody writes two levels up, so the probe finds nothing and changes nothing."""
        self._planned += 1
        up = self.level + PROBE_UP
        if self._planned % PROBE_EVERY == 0 and up <= MAX_LEVEL:
            return up, random.randrange(1 << up)
        return self.level, self.next_bucket()

    def add(self, level: int, entries: list[PeerEntry]) -> None:
        """What one read of a bucket at ``level`` returned."""
        self.reads, self.records_read = self.reads + 1, self.records_read + len(entries)
        for entry in entries:
            held = self.records.get(entry.record.peer_id)
            if held is None or entry.record.time >= held.record.time:
                self.records[entry.record.peer_id] = entry
        if level >= self.level + PROBE_UP and 2 * len(entries) >= BUCKET_SIZE:
            if len(entries) * (1 << level) >= 2 * self.peers_estimate:  # most of the run reads up there: join it
                self.level, self._occupancy, self._next = level, float(len(entries)), 0
        elif level == self.level:
            count = len(entries)
            self._occupancy = (
                count if self._occupancy is None else OCCUPANCY_DECAY * self._occupancy + (1 - OCCUPANCY_DECAY) * count
            )
            if self._occupancy > 2 * BUCKET_SIZE and self.level < MAX_LEVEL:
                self._move(self.level + 1)
            elif self._occupancy < BUCKET_SIZE / 2 and self.level > 0:
                self._move(self.level - 1)

    def settle(self, level: int, entries: list[PeerEntry]) -> None:
        """Read at ``level`` from now on (a probe found the run there), starting with what it found."""
        if level != self.level:
            self.level, self._occupancy, self._next = level, None, 0
        self.add(level, entries)

    def _move(self, level: int) -> None:
        self._occupancy = None if self._occupancy is None else self._occupancy * 2 ** (self.level - level)
        self.level, self._next = level, 0

    def live(self, now: float) -> list[PeerEntry]:
        self.records = {peer: e for peer, e in self.records.items() if e.expiration >= now}
        return list(self.records.values())

    @property
    def peers_estimate(self) -> float:
        """How many peers the run has: records per bucket times buckets at this level (at least those seen)."""
        per_bucket = self._occupancy if self._occupancy is not None else len(self.records)
        return max(float(len(self.records)), per_bucket * (1 << self.level))


class PeerFeed:
    """The records read in the background, for the training thread's frequent checks: never waited for.

    ``latest()`` returns the live records of the cache (None before the first read has arrived) and, when the last
    read is older than ``max_age``, starts the next one (the cache's next bucket), which the DHT process answers
    into a future. A read not answered within ``timeout`` is given up and another one started. A blocking read
    costs the caller a round trip through the DHT process and its neighbours, and these checks run once a second
    and whenever matchmaking is polled.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        run_id: str,
        max_age: float = 1.0,
        timeout: float = calls.DHT_TIMEOUT,
        cache: RecordCache | None = None,
    ):
        self.dht, self.run_id, self.max_age, self.timeout = dht, run_id, max_age, timeout
        self.cache = cache if cache is not None else RecordCache()
        self._future: Any = None
        self._level = 0
        self._started = 0.0
        self._read_at = -float("inf")
        self._read_any = False

    def latest(self) -> list[PeerEntry] | None:
        now = time.monotonic()
        if self._future is not None:
            if self._future.done():
                self._collect(self._future)
                self._read_at, self._future, self._read_any = self._started, None, True
            elif now - self._started > self.timeout:  # the DHT process did not answer: try again
                logger.debug("a background read of %s's records took over %.0f s; again", self.run_id, self.timeout)
                self._future = None
        if self._future is None and now - self._read_at >= self.max_age:
            self._level, bucket = self.cache.next_read()
            key = progress_key(self.run_id, self._level, bucket)
            try:
                self._future = self.dht.get(key, latest=True, return_future=True)
                self._started = now
            except Exception:  # a DHT that is shutting down: no new copy, the last one stands
                logger.debug("could not start a read of %s", key, exc_info=True)
                self._read_at = now
        return self.cache.live(get_dht_time()) if self._read_any else None

    def _collect(self, future: Any) -> None:
        try:
            self.cache.add(self._level, parse_peers(future.result(timeout=0)))
        except Exception:
            logger.debug("a background read of %s's records failed", self.run_id, exc_info=True)


class SwarmReader:
    """One run's records and view, for a peer: ``view()`` reads a bucket now (and the buckets of the peers it is
    asked to include), ``recent_view()`` takes the cache the background feed keeps (None before its first read).
    ``keep`` drops records before the view is built (a peer's bans), ``banned`` says whether a peer is banned (its
    groups are no part of our second stage); ``entries()`` is every live record seen."""

    def __init__(
        self,
        dht: hivemind.DHT,
        run_id: str,
        inner_steps: int,
        samples_per_step: int,
        keep: Callable[[list[PeerEntry]], list[PeerEntry]] = lambda entries: entries,
        banned: Callable[[str], bool] = lambda peer: False,
        me: str | None = None,
    ):
        self.dht, self.run_id, self._keep, self.banned, self.me = dht, run_id, keep, banned, me
        self._found_at = -float("inf")  # when we last looked for the run's level (``find_level``)
        self._inner_steps, self._samples_per_step = inner_steps, samples_per_step
        self.cache = RecordCache()
        self.feed = PeerFeed(dht, run_id, cache=self.cache)
        self.other_records = 0  # records this peer read from other keys (the round's groups)

    @property
    def records_read(self) -> int:
        """Every record this peer's reads returned so far (its DHT traffic, for the benchmarks)."""
        return self.cache.records_read + self.other_records

    @property
    def peers_estimate(self) -> float:
        return self.cache.peers_estimate

    def entries(self, including: Iterable[str] = ()) -> list[PeerEntry]:
        """After reading the cache's next bucket, and the buckets of the peers ``including``, at this level (a cache
        that holds nobody but us looks for the run's level first, at most every ``REFIND_EVERY``: ``find_level``)."""
        now = get_dht_time()
        live = self.cache.live(now)
        if not holds_others(live, self.me) and now - self._found_at >= (REFIND_EVERY if live else 0.0):
            self._found_at = now
            level, found = find_level(self.dht, self.run_id, self.me)
            if found or not live:
                self.cache.settle(level, found)
        level, bucket = self.cache.next_read()
        if level != self.cache.level:  # a probe up: read on its own, before this level's buckets
            self.cache.add(level, read_bucket(self.dht, self.run_id, level, bucket))
            level, bucket = self.cache.level, self.cache.next_bucket()
        buckets = {bucket, *(bucket_of(peer, level) for peer in including)}
        for bucket in sorted(buckets):
            self.cache.add(level, read_bucket(self.dht, self.run_id, level, bucket))
        return self.cache.live(get_dht_time())

    def view(self, including: Iterable[str] = ()) -> SwarmView:
        return self._build(self.entries(including))

    def recent_view(self) -> SwarmView | None:
        entries = self.feed.latest()
        return None if entries is None else self._build(entries)

    def _build(self, entries: list[PeerEntry]) -> SwarmView:
        return build_view(self._keep(entries), get_dht_time(), self._inner_steps, self._samples_per_step)
