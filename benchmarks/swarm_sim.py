"""Many peers, one model, in simulated time: N peers' two-stage rounds, decided by the client's own rules.

A discrete-event model of a swarm: every peer trains at its own speed, writes its progress record every 2 s, reads one
bucket of records a second, and makes every decision a real peer makes from what it read by calling the client's
functions (not copies of them): ``swarm.dht.view`` (the view, when to end a round early, when to give a round up,
whether to re-sync), ``swarm.dht.groups`` (delegates, ``delegate_decision``, which swarm's average to go on from),
``swarm.dht.peers`` (``SwarmReader``/``RecordCache``: which bucket to read, the level, the estimate of N),
``swarm.dht.records`` (buckets, write levels), ``swarm.averager.process`` (matchmaking keys). The DHT's
``read_bucket`` and clock are replaced by the simulation's while it runs (``patched_dht``).

What is modelled, and how simply:

- **Peers**: a step time drawn log-uniformly over a ``--spread`` (4x) range, a symmetric link drawn log-uniformly
  between 10 and 1000 Mbit/s; the initial peers arrive over the first minutes, then 10% of N leave (killed: their
  record expires) and as many join per hour (Poisson). A joiner reads the records, downloads the state held by most
  (8 B/param) from a donor among its holders, then trains; a download not done within ``averaging.transfer_timeout``
  is retried with the next donor, ``DOWNLOAD_ATTEMPTS`` times, then the joiner gives up, as the client does.
- **Rounds**: overlapped or blocking as the manifest says. The first stage's matchmaking is hivemind's, simply: peers in
  the same key (``epoch_group_bits`` + ``matchmaking_bucket`` from their own estimate of N) that look within a window of
  ``matchmaking_time`` (opened by the first one and renewed while it is alone) form a group of up to
  ``target_group_size``, in arrival order. A group's butterfly all-reduce moves 2(g-1)/g |A| in and out of every member
  and lasts that over the slowest member's link (plus ``--allreduce-overhead``); the delegates' stage the same among K
  delegates, who all must start the same fixed group within ``GROUP_WAIT``; a member fetches the swarm's average (|A|)
  from its parent in the group's tree, then further ancestors and the holders (``fetch_sources``), the source's
  upload shared fairly among its concurrent fetches.
  |A| = one fp4 pseudo-gradient, 0.44 B/param. A member that dies fails its group's all-reduce (``chunk_timeout``).
- **Decisions** are made on a 1 s tick (matchmaking's give-up checks), at step ends at most once per ``CHECK_EVERY``
  (ending a round early), and every ``READ_EVERY`` (or every step, while training goes on) in the second stage.

Left out: CPU time of encoding and audits (checked reducers double the all-reduce traffic), asymmetric links, latency
and loss, DHT store/lookup latency (a record is readable the moment it is written), a graceful leave, the
deferral of a slow re-sync to the next round, the consistency check's wait for groupmates' checksums (its reads are
counted), and byzantine peers. ``python -m benchmarks.swarm_sim``; results in ``benchmarks/results/swarm-sim``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import heapq
import math
import random
import statistics
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

from benchmarks.common import Stopwatch, add_common_args, finish, print_table, pyplot, save_figure
from swarm.averager.fixed_group import GROUP_WAIT
from swarm.averager.process import attempt_timeout, epoch_group_bits, matchmaking_bucket
from swarm.dht import peers as dht_peers
from swarm.dht.groups import (
    GROUP_TTL,
    Decision,
    Merged,
    Plan,
    Stage2,
    all_left,
    delegate_decision,
    delegate_of,
    fetch_candidates,
    fetch_sources,
    group_record,
    group_tag,
    groups_at,
    reads_wide,
    result_of,
    stage2_plan,
)
from swarm.dht.peers import SwarmReader
from swarm.dht.presence import PUBLISH_INTERVAL, RECORD_TTL
from swarm.dht.records import (
    CHECKSUM_HISTORY,
    EpochChecksum,
    GroupRecord,
    PeerEntry,
    PeerState,
    ProgressRecord,
    bucket_of,
    group_bucket_key,
    write_levels,
)
from swarm.dht.view import (
    SwarmView,
    build_view,
    global_epoch,
    left_behind,
    mates_coming,
    nobody_to_group_with,
    resync_needed,
    round_due,
    running_consensus,
    swarm_moved_on,
    trusted_consensus,
)
from swarm.manifest import RunManifest
from swarm.round.early_end import CHECK_EVERY
from swarm.round.merge import FETCH_EVERY, LEFT_LOOK_MAX, READ_EVERY, STAGE2_TRIES, STAND_IN_EVERY
from swarm.round.no_shows import NoShows, given_up_on, no_shows, working_towards
from swarm.round.vouched import others_result, ours_result
from swarm.state.replay import REPLAY_DONORS
from swarm.state.sync import DOWNLOAD_ATTEMPTS, MAJORITY_WAIT
from swarm.state.trust import Groupmates, servable
from swarm.state.trust import wanted as trust_wanted

NAME = "swarm_sim"
FP4_BYTES = 0.44  # bytes per parameter of one fp4 pseudo-gradient on the wire (benchmarks/results/grouping)
STATE_BYTES = 8  # bytes per parameter of the training state a joiner downloads (parameters and outer momentum)
SEED_MODEL = hashlib.sha256(b"the manifest's seed").hexdigest()
TICK = 1.0  # seconds between a peer's background reads of one bucket (PeerFeed) and its matchmaking checks
VIEW_WAIT = 3.0  # a joiner waits this long for other peers' records (swarm.state.sync)


def digest(*parts: Any) -> str:
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()


# ---- the setup -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """One simulated run."""

    peers: int
    hours: float  # simulated
    manifest: RunManifest
    params: int
    step_seconds: float = 2.0  # the fastest peer's inner step
    spread: float = 4.0  # the slowest peer's step is this many times the fastest's
    mbit: tuple[float, float] = (10.0, 1000.0)  # links, drawn log-uniformly
    arrival_seconds: float = 300.0  # the initial peers arrive over this long
    churn_per_hour: float = 0.1  # of N: as many leave (killed) as join per hour
    churn_every_rounds: int = 0  # instead: one killed and one joining every this many epochs (benchmarks.scale)
    startup_seconds: float = 0.0  # from a joiner's start to its first record
    # the initial peers resume from the run's launch checkpoint (epoch 0), which they hold already: they download
    # nothing while it is the swarm's state; false: they start fresh, and all but the first download the state
    launch_checkpoint: bool = True
    allreduce_overhead: float = 1.0  # seconds an all-reduce takes beyond its bytes over the slowest link
    seed: int = 0
    label: str = ""
    # an experiment, not the client: matchmaking keys drawn anew each epoch (the hash of the epoch and the id), so a
    # peer's groupmates reach past its own key (``benchmarks/results/swarm-sim-vouched``)
    drawn_keys: bool = False

    @property
    def update_bytes(self) -> float:
        return FP4_BYTES * self.params


@dataclass
class Signal:
    """Fired once with a value; processes that wait on it resume with that value."""

    fired: bool = False
    value: Any = None
    waiters: list = field(default_factory=list)


@dataclass(frozen=True)
class Wait:
    signal: Signal
    timeout: float | None = None


@dataclass(frozen=True)
class Transfer:
    """``nbytes`` from ``source`` (a peer id) to the waiting peer, given up after ``timeout``: resumes with whether it
    arrived."""

    source: str
    nbytes: float
    timeout: float
    kind: str


# ---- peers -----------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Group:
    """A first-stage group's all-reduce. A member that dies in it does not fail it: hivemind bans a silent sender
    after ``sender_timeout`` and drops a silent reducer's slice (``register_failed_reducer``: read back as zeros),
    and the others end it with what they have."""

    members: list[SimPeer]
    gid: bytes
    epoch: int
    formed: float
    done: Signal = field(default_factory=Signal)
    end: float = 0.0
    token: int = 0
    lost: set[str] = field(default_factory=set)  # members that died in it


@dataclass(eq=False)
class Fixed:
    """A second stage's fixed group (``swarm.averager.fixed_group``): every delegate that starts it with the same
    registered groups, on the same try, runs the same all-reduce. A member that has not started it within
    ``GROUP_WAIT`` of the first answers the others' parts with BAD_GROUP_ID: its slice is dropped (zeros), its
    group's average is missing, and the rest end it once its sender slot times out; every holder still registers
    all the groups it was started with as ``included``."""

    members: tuple[str, ...]
    tags: tuple[str, ...]
    joined: set[str] = field(default_factory=set)
    done: Signal = field(default_factory=Signal)
    present: tuple[str, ...] | None = None  # the members that run it, once it closed
    end: float = 0.0
    token: int = 0


@dataclass(eq=False)
class MergeState:
    """swarm.round.merge_state.MergeState, the fields the simulation needs."""

    epoch: int
    tag: str
    delegate: str
    members: tuple[str, ...]
    size: int
    weight: float
    digest: str | None
    deadline: float
    registered_at: float | None = None
    stage2: tuple[Fixed, Signal] | None = None  # the group, and what we wait on
    stage2_tries: int = 0
    merge_at: float | None = None
    roster: tuple[str, ...] = ()
    absent: frozenset[str] = frozenset()
    read_at: float = -math.inf
    fetched_at: float = -math.inf
    seen_at: float | None = None
    looked_at: float = -math.inf
    left_looks: int = 0
    records: list[GroupRecord] = field(default_factory=list)
    partners: frozenset[str] = frozenset()  # the delegates a second stage ran whole with


@dataclass(eq=False)
class Flight:
    epoch: int
    samples: int
    begun: float
    wait_until: float
    blocking: bool
    landed: Signal = field(default_factory=Signal)
    matched: Signal | None = None
    group: Group | None = None  # the first stage's, while its all-reduce runs
    merge: MergeState | None = None
    bytes_in: float = 0.0
    bytes_out: float = 0.0
    matchmaking_seconds: float | None = None
    retries: int = 0  # attempts after one that found no group (``OuterRound._matchmaking_bucket``)
    awaited: frozenset[str] | None = None  # ``swarm.round.no_shows``
    awaited_at: float = 0.0
    reported_bytes: float = 0.0  # what the RoundReport counts: both stages' all-reduce payload, sent + received


@dataclass(eq=False)
class SimPeer:
    index: int
    pid: str
    step_seconds: float
    rate: float  # bytes/s, each way
    reader: SwarmReader
    joined: float
    alive: bool = True
    gone: float | None = None
    state: str = PeerState.starting.value
    epoch: int = 0
    model: str | None = None
    checksums: dict[int, str] = field(default_factory=dict)
    history: dict[int, str] = field(default_factory=dict)  # every checksum it held (the benchmark's view)
    applied: dict[int, str] = field(default_factory=dict)  # the update it applied at each epoch (served for replay)
    inner_step: int = 0
    flight: Flight | None = None
    last_round_local: bool = False
    next_check: float = 0.0
    ended_behind_at: int | None = None
    unchecked: tuple[int, tuple[str, ...]] | None = None
    feed_reads: int = 0
    written: int = 0
    group_writes: int = 0
    sent: Counter = field(default_factory=Counter)
    received: Counter = field(default_factory=Counter)
    publish_token: int = 0
    training_from: float | None = None  # when it first trained
    resumed: bool = False  # it starts with a checkpoint of its own
    no_shows: NoShows | None = None  # ``OuterRound.no_shows``: keys it waited for that did not come
    groupmates: Groupmates = field(default_factory=Groupmates)  # ``StateSync.groupmates``

    def vouched(self) -> frozenset[str]:
        """``StateSync.vouched``."""
        return frozenset({self.pid, *self.groupmates.keys()})


@dataclass(eq=False)
class Proc:
    gen: Generator
    owner: SimPeer | None
    wait_id: int = 0


@dataclass(eq=False)
class Flow:
    proc: Proc
    wait_id: int
    dst: SimPeer
    remaining: float
    deadline: float
    kind: str


# ---- the simulation --------------------------------------------------------------------------------------------


class Simulation:
    def __init__(self, setup: Setup):
        self.setup, self.m = setup, setup.manifest
        self.avg = setup.manifest.averaging
        self.merge_limit = self.avg.merge_limit(setup.params)  # ``Merger._limit``
        self.allreduce_limit = self.avg.allreduce_limit(setup.params)  # the averager's bound on a group
        self.update_timeout = self.avg.update_timeout(setup.params)  # a fetch or a replay of one update
        self.state_timeout = self.avg.transfer_timeout(STATE_BYTES * setup.params)  # ``StateSync``
        self.rng = random.Random(setup.seed)
        self.now = 0.0
        self._queue: list = []
        self._seq = 0
        self.peers: dict[str, SimPeer] = {}
        self.order: list[SimPeer] = []
        self.buckets: dict[tuple[int, int], dict[str, PeerEntry]] = {}
        self.groups_key: dict[str, tuple[GroupRecord, float]] = {}  # one record per delegate, as the DHT holds it
        self.group_buckets: dict[str, dict[str, tuple[GroupRecord, float]]] = {}  # the same, by bucket key
        self.archive: dict[tuple[int, str], GroupRecord] = {}  # every (epoch, delegate)'s last record, for scoring
        self.lobbies: dict[str, dict] = {}
        self.fixed: dict[tuple, Fixed] = {}
        self.flows: dict[str, list[Flow]] = {}  # by source
        self._flow_token: dict[str, int] = {}
        self._flow_updated: dict[str, float] = {}
        self.rounds: list[dict] = []
        self.no_shows_noted = 0  # keys noted as no-shows, by all peers
        self.unvouched = 0  # merge reads where another group's swarm's average was there but no key we trust held it
        self.epochs: list[tuple[float, int | None]] = []  # (time, the live peers' global epoch)
        self.apart: list[tuple[float, int]] = []  # (time, training peers reading 2+ levels below the median)
        # (time, share of the training peers at the global epoch that hold its most common checksum): below 1 while
        # groups whose round ended apart have not converged; staying below 1 is a swarm split into lineages
        self.agreement: list[tuple[float, float]] = []
        self.joins: list[dict] = []
        self.invalid_records = 0
        self.contents: dict[str, tuple[frozenset[str], float]] = {}  # a merged digest: the groups whose averages it
        # really holds, and the share of its values dropped (reducers that never ran it)
        self.next_index = 0
        self._churned_at = 0

    # ---- the event loop ------------------------------------------------------------------------------------

    def call_at(self, t: float, fn: Callable, *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (t, self._seq, fn, args))

    def spawn(self, gen: Generator, owner: SimPeer | None) -> Proc:
        proc = Proc(gen, owner)
        self._resume(proc, 0, None)
        return proc

    def _resume(self, proc: Proc, wait_id: int, value: Any) -> None:
        if proc.wait_id != wait_id:
            return  # woken already (a timeout and a signal both came)
        proc.wait_id += 1
        if proc.owner is not None and not proc.owner.alive:
            proc.gen.close()
            return
        try:
            command = proc.gen.send(value)
        except StopIteration:
            return
        wid = proc.wait_id
        if isinstance(command, (int, float)):
            self.call_at(self.now + command, self._resume, proc, wid, None)
        elif isinstance(command, Wait):
            if command.signal.fired:
                self.call_at(self.now, self._resume, proc, wid, command.signal.value)
            else:
                command.signal.waiters.append((proc, wid))
                if command.timeout is not None:
                    self.call_at(self.now + command.timeout, self._resume, proc, wid, None)
        elif isinstance(command, Transfer):
            self._start_flow(proc, wid, command)
        else:
            raise TypeError(f"a process yielded {command!r}")

    def fire(self, signal: Signal, value: Any = True) -> None:
        if signal.fired:
            return
        signal.fired, signal.value = True, value
        for proc, wid in signal.waiters:
            self.call_at(self.now, self._resume, proc, wid, value)
        signal.waiters.clear()

    def run(self) -> None:
        end = self.setup.hours * 3600
        for i in range(self.setup.peers):
            self.call_at(self.setup.arrival_seconds * i / max(1, self.setup.peers - 1) if i else 0.0, self.arrive)
        self.call_at(60.0, self._sample_epoch)
        if self.setup.churn_per_hour > 0 and not self.setup.churn_every_rounds:
            self._schedule_churn("leave")
            self._schedule_churn("join")
        while self._queue and self._queue[0][0] <= end:
            t, _, fn, args = heapq.heappop(self._queue)
            self.now = t
            fn(*args)
        self.now = end

    def _schedule_churn(self, what: str) -> None:
        rate = self.setup.churn_per_hour * self.setup.peers / 3600
        start = max(self.now, self.setup.arrival_seconds)
        self.call_at(start + self.rng.expovariate(rate), self._churn, what)

    def _churn(self, what: str) -> None:
        if what == "join":
            self.arrive()
        else:
            live = [p for p in self.order if p.alive and p.index != 0]
            if live:
                self.kill(self.rng.choice(live))
        self._schedule_churn(what)

    def _sample_epoch(self) -> None:
        training = [p for p in self.order if p.alive and p.training_from is not None]
        self.epochs.append((self.now, global_epoch([self.snapshot(p) for p in training])))
        if training:
            median = statistics.median(p.reader.cache.level for p in training)
            self.apart.append((self.now, sum(p.reader.cache.level <= median - 2 for p in training)))
            at = self.epochs[-1][1]
            held = Counter(p.checksums.get(at) for p in training if p.epoch == at and p.checksums.get(at))
            if held:
                self.agreement.append((self.now, held.most_common(1)[0][1] / sum(held.values())))
        every = self.setup.churn_every_rounds
        if every and self.epochs[-1][1] is not None and self.epochs[-1][1] >= self._churned_at + every:
            self._churned_at = self.epochs[-1][1]
            victims = [p for p in self.order if p.alive and p.index != 0]
            if victims:  # peer 0 stays, as in benchmarks.scale: it is the joiners' way in
                self.kill(self.rng.choice(victims))
                self.call_at(self.now, self.arrive)
        self.call_at(self.now + (10.0 if every else 60.0), self._sample_epoch)

    # ---- the DHT -------------------------------------------------------------------------------------------

    def read_bucket(self, level: int, bucket: int) -> list[PeerEntry]:
        held = self.buckets.get((level, bucket))
        if not held:
            return []
        now = self.now
        for pid in [pid for pid, e in held.items() if e.expiration < now]:
            del held[pid]
        return list(held.values())

    def snapshot(self, p: SimPeer) -> ProgressRecord:
        checksums = [EpochChecksum.construct(epoch=e, checksum=c) for e, c in sorted(p.checksums.items())]
        return ProgressRecord.construct(
            peer_id=p.pid, name=p.pid[-6:], device="sim", epoch=p.epoch, inner_step=p.inner_step,
            samples_per_second=self.m.samples_per_step / p.step_seconds, tokens_processed=0, state=p.state,
            last_loss=None, client_mode=False, relayed=False, micro_batch=0, download_progress=0.0,
            checksums=checksums, accusations=[], time=self.now,
        )  # fmt: skip

    def publish(self, p: SimPeer) -> None:
        """``Presence._publish``: the record to the buckets of the levels next to the one this peer reads."""
        entry = PeerEntry(self.snapshot(p), self.now + RECORD_TTL)
        levels = write_levels(p.reader.cache.level)
        for level in levels:
            self.buckets.setdefault((level, bucket_of(p.pid, level)), {})[p.pid] = entry
        p.written += len(levels)
        p.publish_token += 1
        self.call_at(self.now + PUBLISH_INTERVAL, self._refresh, p, p.publish_token)

    def _refresh(self, p: SimPeer, token: int) -> None:
        if p.alive and token == p.publish_token:
            self.publish(p)

    def set_state(self, p: SimPeer, state: PeerState) -> None:
        p.state = state.value
        self.publish(p)  # set_state(..., publish=True) wakes the refresh thread

    def _feed(self, p: SimPeer) -> None:
        """``PeerFeed``: one bucket a second, in the background."""
        if not p.alive:
            return
        cache = p.reader.cache
        level, bucket = cache.next_read()
        cache.add(level, self.read_bucket(level, bucket))
        p.feed_reads += 1
        self.call_at(self.now + TICK, self._feed, p)

    def recent_view(self, p: SimPeer) -> SwarmView | None:
        if not p.feed_reads:
            return None
        return build_view(p.reader.cache.live(self.now), self.now, self.m.inner_steps, self.m.samples_per_step)

    def view(self, p: SimPeer, including: tuple[str, ...] = ()) -> SwarmView:
        """A blocking read (``SwarmReader.view``): the next bucket and the named peers' buckets."""
        return p.reader.view(including)

    def read_groups(self, p: SimPeer) -> list[GroupRecord]:
        return self._live_records(p, self.groups_key)

    def read_merge(self, p: SimPeer, m: MergeState) -> list[GroupRecord]:
        """``Merger._read``: the groups key, or our group's bucket (``reads_wide``)."""
        waited = None if m.seen_at is None else self.now - m.seen_at
        patience = self.avg.merge_timeout / 4
        if reads_wide(m.members, m.tag, m.delegate, p.pid, m.deadline - self.now, patience, waited):
            return self.read_groups(p)
        return self._live_records(p, self.group_buckets.setdefault(group_bucket_key("sim", m.tag), {}))

    def _live_records(self, p: SimPeer, key: dict[str, tuple[GroupRecord, float]]) -> list[GroupRecord]:
        now = self.now
        for delegate in [d for d, (_, expires) in key.items() if expires < now]:
            del key[delegate]
        records = [r for r, _ in key.values()]
        p.reader.other_records += len(records)
        return records

    def register(self, p: SimPeer, m: MergeState, **merge: Any) -> None:
        try:
            record = group_record(m.epoch, m.tag, p.pid, m.size, m.weight, m.digest, False, m.roster, **merge)
        except ValueError:  # the record's schema refuses it (say, more than 256 groups included)
            self.invalid_records += 1
            return
        self.groups_key[p.pid] = (record, self.now + GROUP_TTL)
        self.group_buckets.setdefault(group_bucket_key("sim", m.tag), {})[p.pid] = (record, self.now + GROUP_TTL)
        self.archive[(m.epoch, p.pid)] = record
        p.group_writes += 1
        m.registered_at = m.registered_at or self.now

    # ---- transfers: a source's upload shared fairly among its flows, each capped by the receiver's link ---------

    def _start_flow(self, proc: Proc, wid: int, t: Transfer) -> None:
        source = self.peers.get(t.source)
        if source is None or not source.alive:
            self.call_at(self.now + self.avg.chunk_timeout, self._resume, proc, wid, False)
            return
        self._advance(t.source)
        flow = Flow(proc, wid, proc.owner, t.nbytes, self.now + t.timeout, t.kind)
        self.flows.setdefault(t.source, []).append(flow)
        self._reschedule(t.source)

    def _rates(self, source: str) -> list[float]:
        flows = self.flows.get(source, [])
        share = self.peers[source].rate / max(1, len(flows))
        return [min(share, f.dst.rate) for f in flows]

    def _advance(self, source: str) -> None:
        last = self._flow_updated.get(source, self.now)
        self._flow_updated[source] = self.now
        dt = self.now - last
        if dt <= 0:
            return
        src = self.peers[source]
        for flow, rate in zip(self.flows.get(source, []), self._rates(source)):
            moved = min(flow.remaining, rate * dt)
            flow.remaining -= moved
            src.sent[flow.kind] += moved
            flow.dst.received[flow.kind] += moved
            if flow.dst.flight is not None and flow.kind == "fetch":
                flow.dst.flight.bytes_in += moved
            if src.flight is not None and flow.kind == "fetch":
                src.flight.bytes_out += moved

    def _reschedule(self, source: str) -> None:
        self._flow_token[source] = token = self._flow_token.get(source, 0) + 1
        flows = self.flows.get(source, [])
        if not flows:
            return
        nxt = min(min(f.deadline, self.now + f.remaining / max(r, 1e-9)) for f, r in zip(flows, self._rates(source)))
        self.call_at(max(nxt, self.now), self._flow_event, source, token)

    def _flow_event(self, source: str, token: int) -> None:
        if self._flow_token.get(source) != token:
            return
        self._advance(source)
        keep = []
        for flow in self.flows.get(source, []):
            if not flow.dst.alive:
                continue
            if flow.remaining <= 1e-6 * self.setup.update_bytes:
                self.call_at(self.now, self._resume, flow.proc, flow.wait_id, True)
            elif self.now >= flow.deadline - 1e-9:
                self.call_at(self.now, self._resume, flow.proc, flow.wait_id, False)
            else:
                keep.append(flow)
        self.flows[source] = keep
        self._reschedule(source)

    # ---- arrival, leaving ------------------------------------------------------------------------------------

    def arrive(self) -> None:
        i = self.next_index
        self.next_index += 1
        s = self.setup
        rng = random.Random(f"{s.seed}/{i}")
        pid = "Qm" + digest(s.seed, "peer", i)[:44]
        lo, hi = s.mbit
        p = SimPeer(
            index=i,
            pid=pid,
            step_seconds=s.step_seconds * s.spread ** rng.random(),
            rate=math.exp(rng.uniform(math.log(lo), math.log(hi))) * 1e6 / 8,
            reader=SwarmReader(self, "sim", self.m.inner_steps, self.m.samples_per_step, me=pid),
            joined=self.now,
        )
        p.no_shows = NoShows(lambda p=p: p.epoch)
        if s.launch_checkpoint and i < s.peers:
            p.model, p.resumed = SEED_MODEL, True
        self.peers[pid] = p
        self.order.append(p)
        self.call_at(self.now + (s.startup_seconds if i else 0.0), self._start, p)

    def _start(self, p: SimPeer) -> None:
        if not p.alive:
            return
        self.publish(p)
        self.call_at(self.now + self.rng.random() * TICK, self._feed, p)
        self.spawn(self.life(p), p)

    def kill(self, p: SimPeer) -> None:
        """SIGKILL: nothing more from it; its record expires with its TTL."""
        p.alive, p.gone = False, self.now
        for lobby in self.lobbies.values():
            if p in lobby["waiting"]:
                lobby["waiting"].remove(p)
        if p.flight is not None and p.flight.group is not None:
            group = p.flight.group
            group.lost.add(p.pid)
            group.end, group.token = max(group.end, self.now + 2 * self.avg.chunk_timeout), group.token + 1
            self.call_at(group.end, self._group_done, group, group.token)
        for fixed in self.fixed.values():
            if fixed.present is not None and p.pid in fixed.present and not fixed.done.fired:
                fixed.present = tuple(d for d in fixed.present if d != p.pid)
                fixed.end, fixed.token = max(fixed.end, self.now + 2 * self.avg.chunk_timeout), fixed.token + 1
                self.call_at(fixed.end, self._fixed_done, fixed, fixed.token)
        if self.flows.get(p.pid):
            for flow in self.flows[p.pid]:
                self.call_at(self.now + self.avg.chunk_timeout, self._resume, flow.proc, flow.wait_id, False)
            self.flows[p.pid] = []
            self._flow_token[p.pid] = self._flow_token.get(p.pid, 0) + 1
        for source, flows in self.flows.items():
            if any(f.dst is p for f in flows):
                self._advance(source)
                self.flows[source] = [f for f in flows if f.dst is not p]
                self._reschedule(source)

    # ---- a peer's training thread -----------------------------------------------------------------------------

    def life(self, p: SimPeer) -> Generator:
        joined = yield from self.catch_up(p)
        if not joined:
            p.alive, p.gone = False, self.now  # StateDownloadError: the client exits
            return
        p.training_from = self.now
        self.set_state(p, PeerState.training)
        while True:
            yield p.step_seconds
            p.inner_step += 1
            if p.inner_step >= self.m.inner_steps or self.early_end_due(p):
                yield from self.run_outer_round(p)

    def early_end_due(self, p: SimPeer) -> bool:
        """``EarlyEnd.due``, on the records read in the background."""
        if not self.avg.join_rounds_early or self.now < p.next_check or p.inner_step == 0 or p.flight is not None:
            return False
        p.next_check = self.now + CHECK_EVERY
        view = p.no_shows.waiting_view(self.recent_view(p))
        if view is None:
            return False
        if left_behind(view, p.epoch, p.ended_behind_at):
            p.ended_behind_at = view.global_epoch
            return True
        return round_due(view, p.pid, p.epoch, self.avg.min_group_size, self.m.inner_steps, self.m.samples_per_step,
                         p.step_seconds, self.now, my_steps_left=self.m.inner_steps - p.inner_step)  # fmt: skip

    def run_outer_round(self, p: SimPeer) -> Generator:
        if p.flight is not None:  # overlapped: the last round is still in the air; training waits for it
            p.flight.blocking = True
            yield Wait(p.flight.landed)
        yield from self.begin(p)

    def begin(self, p: SimPeer) -> Generator:
        """``OuterRound.begin``: the late consistency check, then the pseudo-gradient goes to matchmaking."""
        if p.unchecked is not None and p.unchecked[0] == p.epoch:  # await_checksums: one read of the mates' buckets
            self.view(p, tuple(m for m in p.unchecked[1] if m != p.pid))
        p.unchecked = None
        why = resync_needed(
            self.view(p), p.pid, p.epoch, p.checksums.get(p.epoch), p.last_round_local, p.groupmates.keys()
        )
        samples = p.inner_step * self.m.samples_per_step
        if why is not None:
            self.note_round(p, None, "resynced", samples, reason=why.reason.name)
            yield from self.resync(p)
            p.inner_step = 0
            return
        overlapped = self.avg.overlap
        flight = Flight(p.epoch, samples, self.now, self.now + self.avg.wait_for_peers, blocking=not overlapped)
        p.flight = flight
        self.set_state(p, PeerState.matchmaking)
        p.inner_step = 0  # overlapped: the next round's steps start now; blocking: after the landing
        self.spawn(self.fly(p, flight), p)
        if not overlapped:
            yield Wait(flight.landed)

    # ---- state: joining, re-syncing, replaying ----------------------------------------------------------------

    def catch_up(self, p: SimPeer) -> Generator:
        """``StateSync.catch_up``: start from the seed if nobody holds a state yet, else download the one most
        peers hold. False: no donor served it (the client gives up)."""
        waited = 0.0
        view = self.view(p)
        while waited < VIEW_WAIT and not any(q.peer_id != p.pid for q in view.peers):
            yield 0.5
            waited += 0.5
            view = self.view(p)
        others = [q for q in view.peers if q.peer_id != p.pid and q.latest_checksum is not None]
        agreed = trust_wanted(view)
        kept = p.resumed and agreed is not None and agreed.epoch == p.epoch and agreed.agrees(p.model)
        join = dict(peer=p.index, at=self.now, rate_mbit=p.rate * 8 / 1e6, downloaded=bool(others) and not kept)
        self.joins.append(join)
        if not others or kept:  # the first peer of the run, or a checkpoint that agrees with the swarm
            self.load(p, p.epoch, p.model or SEED_MODEL)
            join.update(ok=True, seconds=0.0)
            return True
        self.set_state(p, PeerState.downloading_state)
        ok = yield from self.download_consensus_state(p, joining=True)
        join.update(ok=ok, seconds=self.now - join["at"])
        return ok

    def load(self, p: SimPeer, epoch: int, model: str) -> None:
        p.epoch, p.model = epoch, model
        p.applied.clear()
        self.announce(p)

    def announce(self, p: SimPeer) -> None:
        p.checksums[p.epoch] = p.model
        p.history[p.epoch] = p.model
        for old in sorted(p.checksums)[:-CHECKSUM_HISTORY]:
            del p.checksums[old]

    def resync(self, p: SimPeer) -> Generator:
        """``StateSync.resync``: replay the missed rounds, or download the whole state; training waits."""
        self.set_state(p, PeerState.resyncing)
        yield from self.download_consensus_state(p)
        p.last_round_local = False
        p.inner_step = 0
        self.set_state(p, PeerState.training)

    def download_consensus_state(self, p: SimPeer, joining: bool = False) -> Generator:
        if p.model is not None:
            replayed = yield from self.missed_rounds(p, self.avg.replay_rounds)
            if replayed:
                return True
        for attempt in range(DOWNLOAD_ATTEMPTS):
            view = self.view(p)
            if view.global_epoch is None:
                return False
            if joining:  # ``StateSync._until_half_agree``
                for _ in range(MAJORITY_WAIT):
                    if view.global_epoch is None or servable(view, trust_wanted(view), p.pid):
                        break
                    yield 1.0
                    view = self.view(p)
                if view.global_epoch is None:
                    return False
            agreed = trust_wanted(view) if joining else running_consensus(view.peers, view.global_epoch, p.vouched())
            if agreed is None:
                yield 1.0
                continue
            donors = [q.peer_id for q in view.peers if q.peer_id in agreed.holders and q.peer_id != p.pid]
            if not donors:
                return agreed.agrees(p.model) and p.epoch == agreed.epoch
            self.rng.shuffle(donors)
            donors.sort(key=lambda d: self.peers[d].epoch != agreed.epoch)  # ``StateSync._donors``
            for donor in donors:
                ok = yield Transfer(donor, STATE_BYTES * self.setup.params, self.state_timeout, "state")
                held = self.peers[donor]
                if not ok or not held.alive:
                    continue
                now_view = self.view(p)  # ``refusal``
                if joining:
                    check = trusted_consensus(now_view.peers, held.epoch)
                else:
                    check = running_consensus(now_view.peers, held.epoch, p.vouched())
                check = check or (agreed if held.epoch == agreed.epoch else None)
                if held.epoch >= agreed.epoch and check is not None and check.agrees(held.model):
                    self.load(p, held.epoch, held.model)
                    return True
            yield min(5.0, 1.0 * (attempt + 1))
        return False

    def missed_rounds(self, p: SimPeer, limit: int) -> Generator:
        """``Replay.missed_rounds``: the missed rounds' averages from their holders, each checked."""
        view = self.view(p)
        start, target = p.epoch, view.global_epoch
        if target is None or not 0 < target - start <= limit:
            return False
        ours = running_consensus(view.peers, start, p.vouched())
        if ours is None or not ours.agrees(p.model):
            return False
        for epoch in range(start, target):
            agreed = running_consensus(view.peers, epoch + 1, p.vouched())
            if agreed is None:
                return False
            donors = [q.peer_id for q in view.peers if q.peer_id in agreed.holders and q.peer_id != p.pid]
            self.rng.shuffle(donors)
            applied = False
            for donor in donors[:REPLAY_DONORS]:
                held = self.peers[donor]
                update = held.applied.get(epoch)
                if update is None:
                    continue
                ok = yield Transfer(donor, self.setup.update_bytes, self.update_timeout, "replay")
                if not ok:
                    continue
                p.model, p.epoch = digest(p.model, update), epoch + 1
                p.applied[epoch] = update
                if p.model != agreed.checksum:
                    return False  # broken: only the full download is left
                applied = True
                break
            if not applied:
                return False
        self.announce(p)
        return True

    # ---- a round in the air -------------------------------------------------------------------------------------

    def fly(self, p: SimPeer, f: Flight) -> Generator:
        """``OuterRound.poll``: the first stage (retried while epoch-mates come), then the second."""
        while True:
            outcome = yield from self.matchmake(p, f)
            if f.awaited is None and (seen := p.no_shows.waiting_view(self.recent_view(p))) is not None:
                f.awaited, f.awaited_at = working_towards(seen, p.pid, f.epoch), self.now
            if outcome == "moved on":  # _given_up: overlapped, adopt the round by a one-round replay
                adopted = False
                if self.avg.overlap:
                    adopted = yield from self.missed_rounds(p, 1)
                if adopted:
                    self.land(p, f, "adopted", None, moved=False)
                else:
                    self.note_round(p, f, "resynced", f.samples, reason="moved on")
                    yield from self.resync(p)
                    p.flight = None
                    self.fire(f.landed)
                return
            if outcome == "join merge":
                m = self.merge_alone(p, f)
                break
            if isinstance(outcome, Group):
                m = self.after_group(p, f, outcome)
                break
            # no group (timeout, a vanished groupmate): others' groups to join, or mates still coming
            if self.avg.merge_groups and groups_at(self.read_groups(p), f.epoch):
                m = self.merge_alone(p, f)
                break
            if self.now < f.wait_until and mates_coming(p.no_shows.waiting_view(self.view(p)), p.pid, f.epoch):
                f.retries += 1
                continue
            self.land(p, f, "local", None)
            return
        yield from self.merge(p, f, m)

    def matchmake(self, p: SimPeer, f: Flight) -> Generator:
        """One attempt: join the key's lobby; every tick, ``_why_give_up``; a group's all-reduce."""
        bucket = ""
        if self.avg.merge_groups:
            drawn = f"{f.epoch}/{p.pid}" if self.setup.drawn_keys else p.pid
            bucket = matchmaking_bucket(drawn, p.reader.peers_estimate, self.avg.target_group_size, f.retries)
        key = epoch_group_bits(f.epoch, bucket=bucket)
        f.matched = Signal()
        started = self.now
        self.join_lobby(key, p)
        while True:
            group = yield Wait(f.matched, TICK)
            if group is not None:
                break
            if self.now - started >= attempt_timeout(bucket, self.avg.matchmaking_time, self.avg.matchmaking_timeout):
                self.leave_lobby(key, p)
                return "no group"
            view = p.no_shows.waiting_view(self.view(p) if f.blocking else self.recent_view(p))
            if view is None:
                continue
            if swarm_moved_on(view, f.epoch):
                self.leave_lobby(key, p)
                return "moved on"
            if self.avg.merge_groups and nobody_to_group_with(view, p.pid, f.epoch):
                self.leave_lobby(key, p)
                return "join merge"
        f.matchmaking_seconds = self.now - f.begun
        f.group = group
        self.set_state(p, PeerState.averaging)
        ok = yield Wait(group.done)
        f.group = None
        if not ok:
            return "group failed"
        g = len(group.members)
        moved = 2 * (g - 1) / g * self.setup.update_bytes
        p.sent["stage1"] += moved
        p.received["stage1"] += moved
        f.bytes_in += moved
        f.bytes_out += moved
        f.reported_bytes += 2 * moved
        return group

    def join_lobby(self, key: str, p: SimPeer) -> None:
        lobby = self.lobbies.setdefault(key, dict(waiting=[], token=0))
        if not lobby["waiting"]:
            lobby["token"] += 1
            self.call_at(self.now + self.avg.matchmaking_time, self._window, key, lobby["token"])
        lobby["waiting"].append(p)
        if len(lobby["waiting"]) >= self.avg.target_group_size:
            self.form(key, lobby)

    def leave_lobby(self, key: str, p: SimPeer) -> None:
        lobby = self.lobbies.get(key)
        if lobby is not None and p in lobby["waiting"]:
            lobby["waiting"].remove(p)

    def _window(self, key: str, token: int) -> None:
        lobby = self.lobbies.get(key)
        if lobby is None or lobby["token"] != token:
            return
        lobby["waiting"] = [q for q in lobby["waiting"] if q.alive]
        if len(lobby["waiting"]) >= self.avg.min_group_size:
            self.form(key, lobby)
        elif lobby["waiting"]:  # a leader alone declares itself again for another window
            self.call_at(self.now + self.avg.matchmaking_time, self._window, key, token)
        else:
            del self.lobbies[key]

    def form(self, key: str, lobby: dict) -> None:
        lobby["waiting"] = [q for q in lobby["waiting"] if q.alive and q.flight is not None]
        members = lobby["waiting"][: self.avg.target_group_size]
        lobby["waiting"] = lobby["waiting"][len(members) :]
        lobby["token"] += 1
        if lobby["waiting"]:
            self.call_at(self.now + self.avg.matchmaking_time, self._window, key, lobby["token"])
        group = Group(members, self.rng.randbytes(20), members[0].flight.epoch, self.now)
        seconds = self.allreduce_seconds(members)
        if seconds > self.allreduce_limit:  # the averager gives the all-reduce up
            self.call_at(self.now + self.allreduce_limit, self.fire, group.done, False)
        else:
            group.end = self.now + seconds
            self.call_at(group.end, self._group_done, group, group.token)
        for q in members:
            self.fire(q.flight.matched, group)

    def allreduce_seconds(self, members: list[SimPeer]) -> float:
        """A butterfly all-reduce: every member sends and receives 2(g-1)/g |A|, the slowest link sets the pace."""
        g = len(members)
        return self.setup.allreduce_overhead + 2 * (g - 1) / g * self.setup.update_bytes / min(q.rate for q in members)

    def _group_done(self, group: Group, token: int) -> None:
        if token == group.token:
            self.fire(group.done, True)

    # ---- the second stage (swarm.round.merge.Merger) ------------------------------------------------------------

    def after_group(self, p: SimPeer, f: Flight, group: Group) -> MergeState:
        members = tuple(q.pid for q in group.members)  # as gathered: those that died in it too
        weight = float(sum(f.samples if q is p else q.flight.samples if q.flight else 0 for q in group.members))
        m = MergeState(
            epoch=f.epoch, tag=group_tag(group.gid), delegate=delegate_of(members, group.gid), members=members,
            size=len(members), weight=max(1.0, weight),
            digest=digest("group", group_tag(group.gid), *sorted(group.lost)),
            deadline=self.now + self.merge_limit,
        )  # fmt: skip
        self._start_merge(p, f, m)
        return m

    def merge_alone(self, p: SimPeer, f: Flight) -> MergeState:
        m = MergeState(
            epoch=f.epoch, tag=group_tag(f"{p.pid}/{f.epoch}".encode()), delegate=p.pid, members=(p.pid,), size=1,
            weight=float(max(1, f.samples)), digest=None, deadline=self.now + self.merge_limit,
        )  # fmt: skip
        self._start_merge(p, f, m)
        return m

    def _start_merge(self, p: SimPeer, f: Flight, m: MergeState) -> None:
        f.merge = m
        self.set_state(p, PeerState.merging)
        if m.delegate == p.pid:
            self.register(p, m)

    def merge(self, p: SimPeer, f: Flight, m: MergeState) -> Generator:
        """``Merger.poll`` until the round is over, then the landing."""
        patience = self.avg.merge_timeout / 2
        while True:
            if m.stage2 is not None:
                fixed, outcome = m.stage2
                ran = yield Wait(outcome)
                m.stage2 = None
                if ran is not None and p.alive:  # its bytes moved, complete or not
                    k = len(fixed.present)
                    moved = 2 * (k - 1) / k * self.setup.update_bytes
                    p.sent["stage2"] += moved
                    p.received["stage2"] += moved
                    f.bytes_in += moved
                    f.bytes_out += moved
                    f.reported_bytes += 2 * moved
                    # ``Merger._poll_stage2``: a second stage that ran without some of its delegates (their slices
                    # zeros, their groups' work missing) is not registered; the delegate tries again or takes another's
                    m.absent |= frozenset(fixed.members) - frozenset(fixed.present) - {p.pid}
                    if len(fixed.present) == len(fixed.members):
                        m.partners = frozenset(fixed.present) - {p.pid}
                        held = frozenset(fixed.tags)
                        merged = digest("merged", m.epoch, *sorted(held), "of", *sorted(fixed.tags))
                        self.contents[merged] = (held, 0.0)
                        self.register(p, m, merged=merged, included=sorted(fixed.tags))
                    m.read_at = -math.inf
            now = self.now
            if now - m.read_at >= READ_EVERY:
                m.read_at, m.records = now, self.read_merge(p, m)
            result = ours_result(m.records, m.epoch, m.tag, m.digest)
            if result is None and (m.delegate == p.pid or now > m.deadline - self.avg.merge_timeout / 4):
                result = others_result(m.records, m.epoch, (p.groupmates.keys() | m.partners) - {p.pid, *m.members})
                self.unvouched += result is None and result_of(m.records, m.epoch) is not None  # (once per read)
            if result is not None:
                done = yield from self.take(p, f, m, result)
                if done:
                    return
                yield READ_EVERY
                continue
            deciding = m.delegate == p.pid and m.stage2 is None and m.stage2_tries < STAGE2_TRIES
            if deciding:  # ``Merger._roster_step``: a roster that holds our group is followed at once
                plan = stage2_plan(m.records, m.epoch, m.tag, p.pid, -1.0)
                if plan.action == Stage2.follow:
                    self.start_stage2(p, m, plan)
                    continue
            if deciding:
                view = p.no_shows.waiting_view(self.view(p, m.members) if f.blocking else self.recent_view(p))
                waited = now - m.registered_at if m.registered_at is not None else 0.0
                decision = Decision.wait if view is None else delegate_decision(
                    view, m.records, m.epoch, m.members, m.tag, waited, patience, self.allreduce_limit
                )  # fmt: skip
                if decision != Decision.wait and waited >= patience:  # ``Merger._note_no_shows``
                    missed = given_up_on(view, m.records, p.pid, m.epoch, m.members, m.tag)
                    self.no_shows_noted += len(p.no_shows.note(missed, m.epoch, "never came to the merge"))
                if decision == Decision.alone and m.digest is not None:
                    self.contents[m.digest] = (frozenset([m.tag]), 0.0)
                    self.register(p, m, merged=m.digest, included=[m.tag])
                    m.read_at = -math.inf
                    continue
                if decision == Decision.merge:
                    m.merge_at = now if m.merge_at is None else m.merge_at
                    plan = stage2_plan(m.records, m.epoch, m.tag, p.pid, now - m.merge_at)
                    if plan.action == Stage2.write:
                        m.roster = tuple(g.group for g in plan.roster)
                        self.register(p, m)
                        self.start_stage2(p, m, plan)
                        continue
            if self.now > m.deadline:
                why = "stage2_failed" if m.stage2_tries else "no_result" if m.delegate != p.pid else "undecided"
                self.land(p, f, "group" if m.digest is not None else "local", m.digest, why=why)
                return
            training = self.avg.overlap and not f.blocking
            yield max(READ_EVERY, p.step_seconds) if training else READ_EVERY

    def start_stage2(self, p: SimPeer, m: MergeState, plan: Plan) -> None:
        """``Merger._start_stage2``: the fixed group of the roster's delegates, this try's."""
        registered = tuple(g for g in plan.roster if g.delegate not in m.absent)
        members = tuple(g.delegate for g in registered)
        key = (m.epoch, plan.writer, m.stage2_tries, members)
        m.stage2_tries += 1
        others = {g.delegate for g in groups_at(m.records, m.epoch)} - m.absent - {p.pid}
        if len(members) < 2:  # ``Merger._start_stage2``: nobody left to merge with: our group's is the swarm's
            if m.digest is not None and not others:
                self.contents[m.digest] = (frozenset([m.tag]), 0.0)
                self.register(p, m, merged=m.digest, included=[m.tag])
                m.read_at = -math.inf
            return
        fixed = self.fixed.get(key)
        if fixed is None:
            fixed = self.fixed[key] = Fixed(members, tuple(g.group for g in registered))
            self.call_at(self.now + GROUP_WAIT, self._close, fixed)
        if fixed.present is not None:  # it runs without us, or ran: our parts find no group, ours no partners
            late = Signal()
            self.call_at(self.now + self.avg.chunk_timeout, self.fire, late, None)
            m.stage2 = (fixed, late)
            return
        fixed.joined.add(p.pid)
        m.stage2 = (fixed, fixed.done)
        if fixed.joined == set(members):
            self._close(fixed)

    def _close(self, fixed: Fixed) -> None:
        """Every member started it, or ``GROUP_WAIT`` passed: it runs among those that did."""
        if fixed.present is not None:
            return
        fixed.present = tuple(d for d in fixed.members if d in fixed.joined and self.peers[d].alive)
        if not fixed.present:
            self.fire(fixed.done, None)
            return
        peers = [self.peers[d] for d in fixed.present]
        seconds = self.allreduce_seconds(peers) if len(peers) > 1 else self.setup.allreduce_overhead
        if len(fixed.present) < len(fixed.members):  # the absent ones' sender slots time out first
            seconds = max(seconds, self.avg.chunk_timeout)
        if seconds > self.allreduce_limit + 10:  # hard_timeout
            self.call_at(self.now + self.allreduce_limit + 10, self.fire, fixed.done, None)
            return
        fixed.end = self.now + seconds
        self.call_at(fixed.end, self._fixed_done, fixed, fixed.token)

    def _fixed_done(self, fixed: Fixed, token: int) -> None:
        if token == fixed.token:
            self.fire(fixed.done, True)

    def take(self, p: SimPeer, f: Flight, m: MergeState, result: Merged) -> Generator:
        """``Merger._take``: our delegate's swarm's average (or another's), as held or fetched from its holders."""
        held = result.digest == m.digest or (m.delegate == p.pid and self.holds(p, m, result))
        m.seen_at = self.now if m.seen_at is None else m.seen_at
        if not held and self.now - m.fetched_at < FETCH_EVERY:
            return False
        if not held:
            m.fetched_at = self.now
            sources = fetch_sources(m.members, m.tag, m.delegate, p.pid, result.holders, self.now - m.seen_at)
            for holder in sources:
                source = self.peers.get(holder)
                if holder not in result.holders and (source is None or source.applied.get(m.epoch) != result.digest):
                    continue  # a groupmate that does not hold it yet answers at once with nothing
                ok = yield Transfer(holder, self.setup.update_bytes, self.update_timeout, "fetch")
                if ok:
                    held = True
                    break
            if held and m.delegate == p.pid:
                self.register(p, m, merged=result.digest, included=sorted(result.included))
        if held:
            self.land(p, f, "merged", result.digest, tag=m.tag, groups=max(1, len(result.included)))
            return True
        if self.now > m.deadline or self.holders_left(p, m, result):
            why = "unfetched" if self.now > m.deadline else "left"
            self.land(p, f, "group" if m.digest is not None else "local", m.digest, why=why)
            return True
        return False

    def holders_left(self, p: SimPeer, m: MergeState, result: Merged) -> bool:
        """``Merger._holders_left``: every peer we could fetch it from gone, in two looks in a row."""
        args = (m.members, m.tag, m.delegate, p.pid, result.holders)
        sources, asked = fetch_candidates(*args), fetch_sources(*args, self.now - m.seen_at)
        if self.now - m.looked_at < STAND_IN_EVERY or len(sources) > LEFT_LOOK_MAX or set(asked) != set(sources):
            return False
        m.looked_at = self.now
        m.left_looks = m.left_looks + 1 if all_left(self.view(p, tuple(sources)), sources) else 0
        return m.left_looks >= 2

    def holds(self, p: SimPeer, m: MergeState, result: Merged) -> bool:
        return any(r.delegate == p.pid and r.merged == result.digest for r in groups_at(m.records, m.epoch))

    # ---- landing ---------------------------------------------------------------------------------------------

    def land(self, p: SimPeer, f: Flight, kind: str, update: str | None, tag: str | None = None, groups: int = 1,
             moved: bool = True, why: str | None = None) -> None:  # fmt: skip
        """``OuterRound.finish``: the outer step with the update, the new checksum announced, training again.
        ``why``: what a merge that ran out of time was doing (``figures``' ``merge_fallbacks``)."""
        if not p.alive:
            return
        if moved:
            update = update if kind != "local" else digest("local", p.pid, f.epoch)
            p.model = digest(p.model, update)
            p.applied[f.epoch] = update
            for old in sorted(p.applied)[: -max(1, self.avg.replay_rounds)]:
                del p.applied[old]
            p.epoch = f.epoch + 1
        self.announce(p)
        p.last_round_local = kind == "local"
        if kind in ("merged", "group"):
            p.unchecked = (p.epoch, f.merge.members if f.merge else (p.pid,))
            if f.merge is not None:  # ``OuterRound._note_groupmates``
                p.groupmates.note(sorted({*f.merge.members, *f.merge.partners}), p.pid)
        tag = tag if tag is not None else (f.merge.tag if f.merge is not None else None)
        self.note_no_shows(p, f)
        merge = f.merge
        merge_seconds = self.now - (merge.deadline - self.merge_limit) if merge is not None else None
        seen = merge.seen_at - (merge.deadline - self.merge_limit) if merge and merge.seen_at else None
        self.note_round(p, f, kind, f.samples, tag=tag, groups=groups, update=update if kind == "merged" else None,
                        why=why, merge_seconds=merge_seconds, seen_seconds=seen)  # fmt: skip
        p.flight = None
        self.set_state(p, PeerState.training)
        self.fire(f.landed)

    def note_no_shows(self, p: SimPeer, f: Flight) -> None:
        """``OuterRound._note_no_shows``."""
        view = self.recent_view(p)
        if f.awaited and view is not None:
            group = f.merge.members if f.merge is not None else (p.pid,)
            missed = no_shows(f.awaited, view, p.pid, f.epoch, group, f.awaited_at)
            self.no_shows_noted += len(p.no_shows.note(missed, f.epoch, "still working towards it after it ended"))

    def note_round(self, p: SimPeer, f: Flight | None, kind: str, samples: int, **extra: Any) -> None:
        self.rounds.append(dict(
            peer=p.index, epoch=f.epoch if f is not None else p.epoch, kind=kind, samples=samples, end=self.now,
            begun=f.begun if f is not None else self.now,
            bytes_in=f.bytes_in if f is not None else 0.0, bytes_out=f.bytes_out if f is not None else 0.0,
            reported_bytes=f.reported_bytes if f is not None else 0.0,
            matchmaking=f.matchmaking_seconds if f is not None else None, **extra,
        ))  # fmt: skip


# ---- figures ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def patched_dht(sim: Simulation) -> Iterator[None]:
    """``SwarmReader`` reads the simulation's buckets, on the simulation's clock."""
    with (
        mock.patch.object(dht_peers, "read_bucket", lambda dht, run_id, level, bucket: sim.read_bucket(level, bucket)),
        mock.patch.object(dht_peers, "get_dht_time", lambda: sim.now),
    ):
        yield


def simulate(setup: Setup) -> dict[str, Any]:
    sim = Simulation(setup)
    random.seed(setup.seed)  # find_level's probes draw from the module's generator
    with patched_dht(sim):
        sim.run()
    return figures(sim)


def figures(sim: Simulation) -> dict[str, Any]:
    s, end, unit = sim.setup, sim.now, sim.setup.update_bytes
    by_epoch: dict[int, list[GroupRecord]] = {}
    for (epoch, _), record in sim.archive.items():
        by_epoch.setdefault(epoch, []).append(record)
    rounds = sim.rounds
    # the round's swarm average: the one most of its peers stepped with (result_of over every record of the epoch
    # can pick another: a late delegate's, that lists more groups than it holds)
    applied: dict[int, Counter] = {}
    for r in rounds:
        if r.get("update") is not None:
            applied.setdefault(r["epoch"], Counter())[r["update"]] += 1
    winners = {epoch: votes.most_common(1)[0][0] for epoch, votes in applied.items()}
    listed = {}  # what each merged digest's records list as included
    for records in by_epoch.values():
        for record in records:
            if record.merged is not None:
                listed.setdefault(record.merged, set()).update(record.included)
    for r in rounds:
        won = winners.get(r["epoch"])
        held = sim.contents.get(won, (frozenset(listed.get(won, ())), 0.0))[0] if won is not None else frozenset()
        r["counted"] = r.get("tag") is not None and r["tag"] in held  # its work is in the swarm's average
        # what RoundReport.counted says: false only for a swarm's average that does not list our group
        r["reported_counted"] = not (r["kind"] == "merged" and r.get("tag") not in listed.get(r.get("update"), ()))
    dropped = [sim.contents.get(w, ((), 0.0))[1] for w in winners.values()]
    conflicts = 0  # epochs where result_of, over every record, picks another average than the one most applied
    for epoch, records in by_epoch.items():
        picked = result_of(records, epoch)
        conflicts += picked is not None and epoch in winners and picked.digest != winners[epoch]
    flights = [r for r in rounds if r["kind"] in ("merged", "group", "local", "adopted")]
    per_peer: dict[int, list[dict]] = {}
    for r in flights:
        per_peer.setdefault(r["peer"], []).append(r)
    mean_in = {i: statistics.mean(r["bytes_in"] for r in rs) / unit for i, rs in per_peer.items()}
    mean_out = {i: statistics.mean(r["bytes_out"] for r in rs) / unit for i, rs in per_peer.items()}

    def seconds_alive(p: SimPeer) -> float:
        return max(1e-9, (p.gone if p.gone is not None else end) - p.joined)

    present = [p for p in sim.order if seconds_alive(p) >= 60]
    read = [(p.reader.cache.records_read + p.reader.other_records) / seconds_alive(p) for p in present]
    group_read = [p.reader.other_records / seconds_alive(p) for p in present]
    bucket_reads = [p.reader.cache.reads / seconds_alive(p) for p in present]
    written = [p.written / seconds_alive(p) for p in present]
    live = [p for p in sim.order if p.alive and p.history]
    common = min((max(p.history) for p in live), default=0)
    at_end = {p.history.get(common) for p in live if common in p.history}
    settled = [(t, e) for t, e in sim.epochs if t >= s.arrival_seconds + 60 and e is not None]
    agreed = [a for t, a in sim.agreement if t >= s.arrival_seconds]
    rate = None
    if len(settled) >= 2 and settled[-1][0] > settled[0][0]:
        rate = (settled[-1][1] - settled[0][1]) / ((settled[-1][0] - settled[0][0]) / 3600)
    registered = [len(records) for records in by_epoch.values()]
    included = [len(sim.contents.get(w, (listed.get(w, ()), 0.0))[0]) for w in winners.values()]
    landings: dict[int, list[float]] = {}
    for r in flights:
        landings.setdefault(r["peer"], []).append(r["end"])
    gaps = [b - a for ends in landings.values() for a, b in zip(ends, ends[1:])]
    joins = [j for j in sim.joins if j["downloaded"]]
    kinds = Counter(r["kind"] for r in rounds)
    merges = sorted(r["merge_seconds"] for r in rounds if r["kind"] == "merged" and r.get("merge_seconds") is not None)
    seen = sorted(r["seen_seconds"] for r in rounds if r.get("seen_seconds") is not None)
    late = [r for r in rounds if r["begun"] >= end / 2]
    return dict(
        label=s.label,
        peers=s.peers,
        hours=s.hours,
        params=s.params,
        inner_steps=sim.m.inner_steps,
        target_group_size=sim.avg.target_group_size,
        peers_ever=len(sim.order),
        live_at_end=sum(p.alive for p in sim.order),
        peer_rounds=len(rounds),
        contribution_share=_share(sum(r["counted"] for r in rounds), len(rounds)),
        contribution_share_second_half=_share(sum(r["counted"] for r in late), len(late)),
        # the share of the samples trained (each round's) that reached the swarm's model
        sample_share=_share(sum(r["samples"] for r in rounds if r["counted"]), sum(r["samples"] for r in rounds)),
        reported_counted_share=_share(sum(r["reported_counted"] for r in rounds), len(rounds)),
        outcomes=dict(sorted(kinds.items())),
        # what a merge that ran out of ``merge_limit`` was doing: no swarm's average registered for a member
        # (no_result), its delegate never deciding or its second stage failing, or the average not fetched in time
        merge_fallbacks=dict(sorted(Counter(r["why"] for r in rounds if r.get("why")).items())),
        # seconds from a group's end to stepping with the swarm's average (merged rounds): median, p90, max
        merge_seconds=[_round(statistics.median(merges), 1), _p90(merges), _round(merges[-1], 1)] if merges else None,
        seen_seconds_p90=_p90(seen) if seen else None,
        no_shows_noted=sim.no_shows_noted,  # keys noted as missing a round they were waited for (all peers)
        unvouched_reads=sim.unvouched,  # merge reads that left another group's average untaken: no trusted holder
        rounds_per_hour=_round(rate, 2),
        final_epoch=sim.epochs[-1][1] if sim.epochs else None,
        groups_per_round=_round(statistics.mean(registered), 2) if registered else None,
        merged_groups_per_round=_round(statistics.mean(included), 2) if included else None,
        # benchmarks.scale's figure: per peer-round, the groups its swarm's average lists (1 when it took none)
        merged_groups_mean=_round(statistics.mean(r.get("groups", 1) for r in rounds), 2) if rounds else None,
        flight_seconds_median=_round(statistics.median(r["end"] - r["begun"] for r in flights), 1) if flights else None,
        dropped_share_mean=_round(statistics.mean(dropped), 4) if dropped else None,
        rounds_with_dropped_slices=sum(d > 0 for d in dropped),
        epochs_result_of_disagrees=conflicts,
        merged_digests_per_epoch_max=max(
            (len({r.merged for r in records if r.merged}) for records in by_epoch.values()), default=0
        ),
        received_per_round_A=_round(statistics.mean(mean_in.values()), 3) if mean_in else None,
        received_per_round_A_worst_peer=_round(max(mean_in.values()), 3) if mean_in else None,
        sent_per_round_A=_round(statistics.mean(mean_out.values()), 3) if mean_out else None,
        sent_per_round_A_worst_peer=_round(max(mean_out.values()), 3) if mean_out else None,
        sent_per_round_A_worst_round=_round(max(r["bytes_out"] for r in flights) / unit, 2) if flights else None,
        update_mb=round(unit / 1e6, 3),
        bytes_per_peer_round=round(statistics.mean(r["reported_bytes"] for r in flights)) if flights else None,
        records_read_per_second=_round(statistics.mean(read), 2) if read else None,
        records_read_per_second_max=_round(max(read), 2) if read else None,
        group_records_read_per_second=_round(statistics.mean(group_read), 2) if group_read else None,
        group_records_read_per_second_max=_round(max(group_read), 2) if group_read else None,
        progress_records_read_per_second=_round(statistics.mean(a - b for a, b in zip(read, group_read)), 2)
        if read
        else None,
        bucket_reads_per_second=_round(statistics.mean(bucket_reads), 2) if bucket_reads else None,
        records_written_per_second=_round(statistics.mean(written), 2) if written else None,
        records_written_per_second_max=_round(max(written), 2) if written else None,
        distinct_checksums_at_end=len(at_end),
        peers_apart_max=max((a for t, a in sim.apart if t >= s.arrival_seconds), default=0),
        peers_apart_at_end=sim.apart[-1][1] if sim.apart else 0,
        agreement_mean=_round(statistics.mean(agreed), 3) if agreed else None,
        agreement_below_09=_round(sum(a < 0.9 for a in agreed) / len(agreed), 3) if agreed else None,
        agreement_at_end=_round(agreed[-1], 3) if agreed else None,
        common_epoch_at_end=common,
        round_seconds_median=_round(statistics.median(gaps), 1) if gaps else None,
        matchmaking_seconds_median=_round(
            statistics.median(r["matchmaking"] for r in flights if r["matchmaking"] is not None), 1
        )
        if any(r["matchmaking"] is not None for r in flights)
        else None,
        joins_downloading=len(joins),
        joins_failed=sum(not j.get("ok", False) for j in joins if "ok" in j),
        join_seconds_median=_round(statistics.median(j["seconds"] for j in joins if j.get("ok")), 1)
        if any(j.get("ok") for j in joins)
        else None,
        invalid_group_records=sim.invalid_records,
    )


def _share(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def _p90(ordered: list[float]) -> float:
    return round(ordered[int(0.9 * (len(ordered) - 1))], 1)


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


# ---- the benchmark ---------------------------------------------------------------------------------------------


def manifest_of(preset: str, overrides: list[str]) -> tuple[RunManifest, int]:
    from client.model import manifest_parameters
    from client.presets import build_manifest

    manifest = build_manifest(preset, None, overrides)
    return manifest, manifest_parameters(manifest)


def plot(rows: list[dict], small: list[dict], out: Path) -> Path | None:
    plt = pyplot()
    if plt is None or not rows:
        return None
    n = [row["peers"] for row in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].plot(n, [row["contribution_share"] or 0 for row in rows], "o-", label="large runs")
    if small:
        axes[0].plot([r["peers"] for r in small], [r["contribution_share"] or 0 for r in small], "s--", label="small")
    axes[0].set(title="contribution share", xlabel="peers", xscale="log", ylim=(0, 1.05))
    axes[0].legend()
    axes[1].plot(n, [row["records_read_per_second"] or 0 for row in rows], "o-", label="read")
    axes[1].plot(n, [row["records_written_per_second"] or 0 for row in rows], "o-", label="written")
    axes[1].set(title="DHT records per peer per second", xlabel="peers", xscale="log")
    axes[1].legend()
    axes[2].plot(n, [row["received_per_round_A"] or 0 for row in rows], "o-", label="received, mean")
    axes[2].plot(n, [row["sent_per_round_A_worst_round"] or 0 for row in rows], "o-", label="sent, worst peer-round")
    axes[2].set(title="|A| per peer per round", xlabel="peers", xscale="log", yscale="log")
    axes[2].legend()
    return save_figure(fig, out, NAME)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.swarm_sim", description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--peers", type=int, nargs="+", default=[10, 100, 1000])
    p.add_argument("--hours", type=float, nargs="+", default=[4.0, 4.0, 1.5], help="simulated, one per --peers")
    p.add_argument("--preset", default="150m")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="manifest overrides, key=value")
    p.add_argument("--step-seconds", type=float, default=2.0, help="the fastest peer's inner step")
    p.add_argument("--spread", type=float, default=4.0)
    p.add_argument("--arrival-minutes", type=float, default=5.0)
    p.add_argument("--churn", type=float, default=0.1, help="share of N leaving (and joining) per hour")
    p.add_argument("--fresh-launch", action="store_true", help="the initial peers hold no checkpoint of the run")
    p.add_argument("--small", type=int, nargs="*", default=[4, 8, 12], help="N for the comparison with real runs")
    p.add_argument("--small-group", type=int, default=3)
    p.add_argument("--small-steps", type=int, default=10, help="inner_steps of the small runs (benchmarks.scale)")
    p.add_argument("--small-rounds", type=int, default=8, help="the small runs last until this epoch, about")
    p.add_argument("--small-step-per-peer", type=float, default=0.08,
                   help="a tiny step's seconds per peer sharing the 2-core host (0.24 s at 3 peers)")  # fmt: skip
    p.add_argument("--seeds", type=int, default=3, help="seeds of the small runs")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.smoke:
        args.peers, args.hours, args.preset, args.small, args.seeds = [10, 100], [0.25, 0.25], "tiny", [4], 1
        args.step_seconds, args.arrival_minutes = 0.25, 0.5
    if len(args.hours) == 1:
        args.hours = args.hours * len(args.peers)
    clock = Stopwatch()
    manifest, params = manifest_of(args.preset, args.overrides)
    rows = []
    for n, hours in zip(args.peers, args.hours):
        setup = Setup(
            peers=n, hours=hours, manifest=manifest, params=params, step_seconds=args.step_seconds,
            spread=args.spread, arrival_seconds=60 * args.arrival_minutes, churn_per_hour=args.churn,
            launch_checkpoint=not args.fresh_launch, seed=args.seed, label=f"{args.preset} N={n}",
        )  # fmt: skip
        watch = Stopwatch()
        rows.append(simulate(setup) | dict(wall_seconds=watch.seconds))
        print(rows[-1], flush=True)
    small_manifest, small_params = manifest_of(
        "tiny", [f"averaging.target_group_size={args.small_group}", f"inner_steps={args.small_steps}"]
    )
    small = []
    for n in args.small:
        step = args.small_step_per_peer * n
        runs = []
        for seed in range(args.seeds):
            hours = args.small_rounds * (args.small_steps * step + 15) / 3600 + 60 / 3600
            setup = Setup(
                peers=n, hours=hours, manifest=small_manifest, params=small_params, step_seconds=step, spread=1.0,
                mbit=(1000.0, 1000.0), arrival_seconds=10.0, churn_per_hour=0.0, churn_every_rounds=3,
                startup_seconds=15.0, allreduce_overhead=1.0, launch_checkpoint=False, seed=args.seed + seed,
                label=f"tiny N={n}",
            )  # fmt: skip
            runs.append(simulate(setup))
        small.append(mean_of(runs) | dict(seeds=args.seeds, step_seconds=round(step, 3)))
        print(small[-1], flush=True)
    columns = [
        *("peers", "contribution_share", "rounds_per_hour", "groups_per_round", "merged_groups_per_round"),
        *("received_per_round_A", "received_per_round_A_worst_peer", "sent_per_round_A_worst_round"),
        *("records_read_per_second", "records_written_per_second", "distinct_checksums_at_end", "peers_apart_max"),
        "joins_failed",
    ]
    print_table(f"swarm_sim ({args.preset})", columns, [[row[c] for c in columns] for row in rows])
    small_columns = [
        *("peers", "contribution_share", "reported_counted_share", "distinct_checksums_at_end"),
        *("round_seconds_median", "matchmaking_seconds_median", "merged_groups_per_round", "bytes_per_peer_round"),
        *("records_read_per_second", "records_written_per_second"),
    ]
    print_table("swarm_sim, small runs (tiny)", small_columns, [[row[c] for c in small_columns] for row in small])
    fields = dict(
        settings=dict(
            preset=args.preset,
            overrides=args.overrides,
            step_seconds=args.step_seconds,
            spread=args.spread,
            arrival_minutes=args.arrival_minutes,
            churn=args.churn,
            mbit=[10, 1000],
            seed=args.seed,
            fresh_launch=args.fresh_launch,
            small=dict(
                group=args.small_group,
                inner_steps=args.small_steps,
                rounds=args.small_rounds,
                step_per_peer=args.small_step_per_peer,
                seeds=args.seeds,
                churn_every_rounds=3,
            ),
        ),  # fmt: skip
        figures=rows,
        small=small,
    )
    finish(NAME, args.out, fields, smoke=args.smoke, clock=clock, plot=lambda out: plot(rows, small, out))
    return 0


def mean_of(runs: list[dict]) -> dict:
    """The runs' figures averaged (numbers), or the first run's (the rest)."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        values = [r[key] for r in runs]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and all(v is not None for v in values):
            out[key] = round(statistics.mean(values), 4)
    out["outcomes"] = dict(sum((Counter(r["outcomes"]) for r in runs), Counter()))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
