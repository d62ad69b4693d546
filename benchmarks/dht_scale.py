"""A light DHT at scale: what a record read, a record write and a matchmaking search cost as the swarm grows.

N DHT-only nodes on 127.0.0.1 (no model, no averager), each a hivemind ``DHTNode`` with its own ``p2pd`` and its
own RSA identity, run with the validators the client installs (``swarm.dht.records.global_validators()`` with the
signature validator given the node's own key, and ``run_validator(run_id)``). Several nodes share one Python
process (``--workers`` processes hold the swarm; one more holds the measured peer, alone, so its CPU time is its
own): a ``hivemind.DHT`` per node would be a forked process per node on top of its ``p2pd``. A process has one
process-wide RSA key, so each node is given a ``RSASignatureValidator(private_key=...)`` of its own and the same
key as its libp2p identity: its records' subkeys carry its own key and their ``peer_id`` is the signer's, as
``swarm.dht.peers.parse_peers`` demands. The nodes search and judge records as the client's DHT does
(``swarm.hivemind_fixes.beam`` and ``verdicts``), or, with ``--as-hivemind``, as hivemind does: the baseline.

Every peer writes a signed ``ProgressRecord`` (eight checksums: the size a training peer's record has), then the
measured peer (node 0, one of the N) does, each ``--reads`` times, with one other peer's record refreshed before
each read (as in a running swarm, where every record is refreshed every 2 s, so a read always finds news):

- ``full_read``: read the one key that holds all N records (``progress_key(run)``, today's ``read_peers``);
- ``bucket_read``: read one bucket key of the bounded design (level ``read_level(N)``, about ``BUCKET_SIZE``
  records), every bucket of the level in turn; the records returned must be exactly that bucket's;
- ``store_one``: store its record under the one key (today's ``Presence``);
- ``store_levels``: store it under its bucket of every level of ``write_levels(N)``, side by side (the bounded
  design's ``Presence``: ``calls.store_many``);
- ``store_near``: the same for the three levels around ``read_level(N)`` only (``near_levels``): a store's search
  gets the key's value from every holder it asks, so writing into a low level's big bucket costs a read of it;
- ``match_one``: N averagers declared under one matchmaking key (``{prefix}.0b{epoch bits}``, as hivemind's
  ``GroupKeyManager.declare_averager`` stores them), read as ``get_averagers`` reads them;
- ``match_split``: the same N declared under keys split by a hash bucket of the peer id (the bucket's bits
  appended to the group bits) so that a key holds about ``--group`` of them.

Counts and bytes come first (load-independent): the DHT RPCs the op made (the node's stubs are wrapped), the
protobuf bytes sent and received, how many repliers held the key, the records returned, the RSA signature checks
made. Then CPU time of the measured peer's process and wall latency, which on a shared 2-core machine are noisy.
Also: for each write round (every peer writing once) the store RPCs received by the busiest node (the
hot spot), and the memory the N nodes took.

Run: ``python -m benchmarks.dht_scale --out benchmarks/results/dht-scale`` (about 10 minutes here); ``--smoke``:
8 nodes, under a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import random
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.validation import CompositeValidator
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import crypto_pb2, dht_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from benchmarks.common import Stopwatch, add_common_args, finish, print_table, pyplot, save_figure, tied_to_us
from swarm.averager.process import epoch_group_bits
from swarm.dht.peers import parse_peers
from swarm.dht.records import (
    CHECKSUM_HISTORY,
    EpochChecksum,
    PeerState,
    ProgressRecord,
    global_validators,
    run_prefix,
    run_validator,
)
from swarm.hivemind_fixes.beam import narrow_searches
from swarm.hivemind_fixes.verdicts import remember_verdicts

try:  # the bounded design, as the client lays it out
    from swarm.dht.records import BUCKET_SIZE, bucket_of, progress_key, read_level

    LAYOUT = "swarm.dht.records"
except ImportError:  # a tree without it: the design as the issue states it
    LAYOUT = "benchmarks.dht_scale (swarm.dht.records has no bucket layout)"
    BUCKET_SIZE, _MAX_LEVEL = 4, 8

    def progress_key(run_id: str, level: int = 0, bucket: int = 0) -> str:
        return f"{run_prefix(run_id)}_progress" + (f"_L{level}_{bucket}" if level else "")

    def bucket_of(peer_id: str, level: int) -> int:
        return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big") >> (32 - level) if level else 0

    def read_level(peers: float) -> int:
        return 0 if peers <= BUCKET_SIZE else min(_MAX_LEVEL, math.ceil(math.log2(peers / BUCKET_SIZE)))


def write_levels(peers: float) -> range:
    """The first bounded design's writes (every level 0..L+1), measured here against ``near_levels``; the client
    writes only the levels next to its own since this benchmark showed what the low ones cost."""
    return range(0, read_level(2 * peers) + 1)


NAME = "dht_scale"
REPO = Path(__file__).resolve().parent.parent
SIZES = (10, 25, 50, 100)
SMOKE_SIZES = (8,)
GROUP = 16  # averagers per matchmaking key in the split design
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
TTL = 1800.0  # records and declarations outlive the measurement (the client: 15 s, refreshed every 2 s)
SETTLE = 0.5  # s after an op before its counters are read: background cache stores and refreshes land in them
EPOCH = 1234
MARK = "@@"  # a worker's replies on stdout start with this
AS_HIVEMIND = "SWARM_BENCH_DHT_AS_HIVEMIND"  # set for the workers of ``--as-hivemind``
OPS = ("full_read", "bucket_read", "store_one", "store_levels", "store_near", "match_one", "match_split")
READ_EVERY, WRITE_EVERY = 1.0, 2.0  # the client's schedule: PeerFeed.max_age, Presence's PUBLISH_INTERVAL


# ---- counting, inside a node's process -----------------------------------------------------------------------


@dataclass
class Tally:
    """What one node sent and received through its stubs since the last reset."""

    rpcs: Counter = field(default_factory=Counter)
    sent: int = 0
    received: int = 0
    holders: int = 0  # find replies that carried the key's value
    value_bytes: int = 0  # the serialized values in those replies

    def reset(self) -> None:
        self.rpcs, self.sent, self.received, self.holders, self.value_bytes = Counter(), 0, 0, 0, 0

    def snapshot(self) -> dict[str, int]:
        return dict(
            find_rpcs=self.rpcs["find"], store_rpcs=self.rpcs["store"], ping_rpcs=self.rpcs["ping"],
            bytes_sent=self.sent, bytes_received=self.received, holders=self.holders, value_bytes=self.value_bytes,
        )  # fmt: skip


class _CountingStub:
    """A stub whose ``rpc_*`` calls are counted with their protobuf sizes."""

    def __init__(self, stub: Any, tally: Tally):
        self._stub, self._tally = stub, tally

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._stub, name)
        if not name.startswith("rpc_"):
            return method
        tally = self._tally

        async def counted(request: Any, *args: Any, **kwargs: Any) -> Any:
            tally.rpcs[name[4:]] += 1
            tally.sent += request.ByteSize()
            response = await method(request, *args, **kwargs)
            tally.received += response.ByteSize()
            if name == "rpc_find":
                for result in response.results:
                    if result.type != dht_pb2.NOT_FOUND:
                        tally.holders += 1
                        tally.value_bytes += len(result.value)
            return response

        return counted


class CountingRSA(RSASignatureValidator):
    """The client's signature validator with this node's own key, counting the signatures it checks."""

    checks = 0

    def validate(self, record: Any) -> bool:
        if self._PUBLIC_KEY_RE.search(record.key) or (record.subkey and self._PUBLIC_KEY_RE.search(record.subkey)):
            self.checks += 1
        return super().validate(record)


def _inbound(protocol: DHTProtocol) -> Counter:
    if not hasattr(protocol, "bench_inbound"):
        protocol.bench_inbound = Counter()
    return protocol.bench_inbound


def count_inbound() -> None:
    """Count the find and store requests every node of this process receives (before the first node starts:
    hivemind collects a protocol's handlers once)."""
    if getattr(DHTProtocol, "bench_counted", False):
        return
    find, store = DHTProtocol.rpc_find, DHTProtocol.rpc_store

    async def rpc_find(self, request: dht_pb2.FindRequest, context: P2PContext) -> dht_pb2.FindResponse:
        _inbound(self)["find"] += 1
        return await find(self, request, context)

    async def rpc_store(self, request: dht_pb2.StoreRequest, context: P2PContext) -> dht_pb2.StoreResponse:
        inbound = _inbound(self)
        inbound["store"] += 1
        inbound["store_bytes"] += request.ByteSize()
        return await store(self, request, context)

    DHTProtocol.rpc_find, DHTProtocol.rpc_store = rpc_find, rpc_store
    DHTProtocol.bench_counted = True


# ---- a node and what it writes ---------------------------------------------------------------------------------


@dataclass
class Node:
    index: int
    dht: DHTNode
    rsa: CountingRSA
    tally: Tally
    peer_id: str
    maddrs: list[str]


async def start_node(index: int, run_id: str, folder: Path, initial_peers: list[str]) -> Node:
    """A DHT node with its own p2pd and its own RSA key: the libp2p identity and the records' signing key."""
    key = RSAPrivateKey()
    path = folder / f"node{index}.key"
    path.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes()).SerializeToString())
    rsa = CountingRSA(key)
    others = [v for v in global_validators() if not isinstance(v, RSASignatureValidator)]
    dht = await DHTNode.create(
        initial_peers=initial_peers or None, host_maddrs=[LOOPBACK], identity_path=str(path),
        check_if_identity_free=False, record_validator=CompositeValidator([rsa, *others, run_validator(run_id)]),
    )  # fmt: skip
    tally = Tally()
    unwrapped = dht.protocol.get_stub
    dht.protocol.get_stub = lambda peer: _CountingStub(unwrapped(peer), tally)
    maddrs = [str(m) for m in await dht.get_visible_maddrs()]
    return Node(index, dht, rsa, tally, dht.peer_id.to_base58(), maddrs)


def progress_value(node: Node) -> dict:
    """A training peer's record, as ``Presence`` stores it (``record.dict()``), with a full checksum history."""
    checksums = [
        EpochChecksum(epoch=e, checksum=hashlib.sha256(f"{node.peer_id}:{e}".encode()).hexdigest())
        for e in range(EPOCH - CHECKSUM_HISTORY + 1, EPOCH + 1)
    ]
    return ProgressRecord(
        peer_id=node.peer_id, name=f"bench-{node.index}", device="NVIDIA GeForce RTX 4090", epoch=EPOCH,
        inner_step=417, samples_per_second=11.5, tokens_processed=1_234_567_890, state=PeerState.training.value,
        last_loss=2.8125, client_mode=False, relayed=False, micro_batch=8, checksums=checksums, time=time.time(),
    ).dict()  # fmt: skip


async def write_records(node: Node, keys: list[str], ttl: float = TTL) -> bool:
    value, expiration = progress_value(node), get_dht_time() + ttl
    done = await asyncio.gather(*(node.dht.store(k, value, expiration, subkey=node.rsa.local_public_key) for k in keys))
    return all(done)


async def declare(node: Node, keys: list[str], ttl: float = TTL) -> bool:
    """As ``GroupKeyManager.declare_averager`` stores a declaration: subkey the peer id's bytes, value True."""
    expiration = get_dht_time() + ttl
    done = await asyncio.gather(
        *(node.dht.store(k, True, expiration, subkey=node.dht.peer_id.to_bytes()) for k in keys)
    )
    return all(done)


async def read(node: Node, key: str, kind: str) -> list[str]:
    """The peer ids a read of ``key`` gives: progress records as ``parse_peers`` keeps them, or active averagers
    as ``GroupKeyManager.get_averagers`` lists them."""
    found = await node.dht.get(key, latest=True)
    if kind == "records":
        return [e.record.peer_id for e in parse_peers(found, ttl=TTL)]  # its records outlive a client's
    if found is None or not isinstance(found.value, dict):
        return []
    return [PeerID(subkey).to_base58() for subkey, item in found.value.items() if item.value]


# ---- a worker process: some nodes, driven by JSON lines on stdin -----------------------------------------------


class WorkerState:
    def __init__(self) -> None:
        self.nodes: dict[int, Node] = {}
        self.folder = Path(tempfile.mkdtemp(prefix="dht-scale-"))

    async def handle(self, command: dict) -> Any:
        op = command["op"]
        if op == "start":
            return await self.start(command["indices"], command["run_id"], command["initial_peers"])
        if op in ("write", "declare"):
            act = write_records if op == "write" else declare
            limit = asyncio.Semaphore(8)

            async def one(index: int, keys: list[str]) -> bool:
                async with limit:
                    return await act(self.nodes[index], keys)

            items = [(int(i), keys) for i, keys in command["keys"].items()]
            done = await asyncio.gather(*(one(i, keys) for i, keys in items))
            return dict(failed=[i for (i, _), ok in zip(items, done) if not ok])
        if op == "measure":
            return await self.measure(self.nodes[command["index"]], command["kind"], command["keys"])
        if op == "inbound":
            counts = {n.peer_id: dict(_inbound(n.dht.protocol)) for n in self.nodes.values()}
            if command.get("reset"):
                for n in self.nodes.values():
                    _inbound(n.dht.protocol).clear()
            return counts
        if op == "known":
            return {n.index: len(n.dht.protocol.routing_table.uid_to_peer_id) for n in self.nodes.values()}
        raise ValueError(f"unknown op {op}")

    async def start(self, indices: list[int], run_id: str, initial_peers: list[str]) -> dict:
        """Six at a time; each also bootstraps from the last node this worker started (a chain on a star)."""
        last: list[str] = []
        for at in range(0, len(indices), 6):
            batch = indices[at : at + 6]
            started = await asyncio.gather(*(start_node(i, run_id, self.folder, initial_peers + last) for i in batch))
            for node in started:
                self.nodes[node.index] = node
            last = started[-1].maddrs[:1]
        return {i: dict(peer_id=self.nodes[i].peer_id, maddrs=self.nodes[i].maddrs) for i in indices}

    async def measure(self, node: Node, kind: str, keys: list[str]) -> dict:
        """One op of the measured node, with its counts; ``read_*`` read one key, ``store``/``declare`` write all
        ``keys`` side by side."""
        node.tally.reset()
        checks0, cpu0, start = node.rsa.checks, time.process_time(), time.perf_counter()
        if kind == "store":
            ok, ids = await write_records(node, keys), []
        elif kind == "declare":
            ok, ids = await declare(node, keys), []
        else:
            ids = await read(node, keys[0], kind.removeprefix("read_"))
            ok = True
        latency = time.perf_counter() - start
        await asyncio.sleep(SETTLE)
        return dict(
            ok=ok, ids=ids, latency_s=latency, cpu_s=time.process_time() - cpu0,
            signature_checks=node.rsa.checks - checks0, **node.tally.snapshot(),
        )  # fmt: skip

    async def stop(self) -> None:
        for node in self.nodes.values():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(node.dht.shutdown(), 10)
        shutil.rmtree(self.folder, ignore_errors=True)


def _reap_and_exit(*_: Any) -> None:
    """On SIGTERM (the benchmark died: ``tied_to_us``): take this worker's p2pd daemons along."""
    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    psutil.wait_procs(children, timeout=3)
    os._exit(1)


async def worker_main() -> None:
    signal.signal(signal.SIGTERM, _reap_and_exit)
    if not os.environ.get(AS_HIVEMIND):  # the client's DHT (``start_dht`` installs these in the DHT process)
        remember_verdicts()
        narrow_searches()
    count_inbound()
    state = WorkerState()
    loop = asyncio.get_running_loop()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            command = json.loads(line)
            if command["op"] == "stop":
                break
            try:
                reply = dict(ok=await state.handle(command))
            except Exception:
                reply = dict(error=traceback.format_exc())
            sys.stdout.write(MARK + json.dumps(reply) + "\n")
            sys.stdout.flush()
    finally:
        await state.stop()
        sys.stdout.write(MARK + json.dumps(dict(ok="stopped")) + "\n")
        sys.stdout.flush()


# ---- the benchmark's side ---------------------------------------------------------------------------------------


class Worker:
    def __init__(self, proc: asyncio.subprocess.Process, log: Path):
        self.proc, self.log = proc, log

    @classmethod
    async def spawn(cls, log: Path, as_hivemind: bool = False) -> Worker:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if as_hivemind:
            env[AS_HIVEMIND] = "1"
        with log.open("w") as handle:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "benchmarks.dht_scale", "--worker", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=handle, cwd=REPO, env=env, limit=2**26, **tied_to_us(),
            )  # fmt: skip
        return cls(proc, log)

    async def call(self, timeout: float = 600, **command: Any) -> Any:
        self.proc.stdin.write((json.dumps(command) + "\n").encode())
        await self.proc.stdin.drain()
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
            if not line:
                raise RuntimeError(f"a worker exited ({command['op']}):\n{self.log.read_text()[-3000:]}")
            if line.startswith(MARK.encode()):
                reply = json.loads(line[len(MARK) :])
                if "error" in reply:
                    raise RuntimeError(f"a worker failed at {command['op']}:\n{reply['error']}")
                return reply["ok"]

    async def stop(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(Exception):
                await self.call(op="stop", timeout=60)
        try:
            await asyncio.wait_for(self.proc.wait(), 30)
        except TimeoutError:
            self.proc.terminate()
            await self.proc.wait()


def memory_of_tree() -> dict[str, float]:
    """RSS of this benchmark's descendants: the workers (Python) and their p2pd daemons, in MiB."""
    python, daemons = [], []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            rss = child.memory_info().rss / 2**20
            (daemons if "p2pd" in child.name() else python).append(rss)
    return dict(
        python_processes=len(python), python_mib=round(sum(python), 1), p2pd_processes=len(daemons),
        p2pd_mib=round(sum(daemons), 1), p2pd_mib_each=round(statistics.mean(daemons), 1) if daemons else None,
    )  # fmt: skip


def near_levels(peers: int) -> range:
    """The levels a reader reads whose count of the swarm is off by up to a factor of two: the bounded design
    without the levels below them (whose buckets hold 2, 4, ... N records: writing into one costs as much as
    reading it, since the store's search gets the key's value from every holder it asks)."""
    return range(read_level(peers / 2), read_level(2 * peers) + 1)


def split_bits(peers: int, group: int) -> int:
    """Bucket bits appended to the matchmaking key so that a key holds at most about ``group`` averagers."""
    return max(0, math.ceil(math.log2(peers / group))) if peers > group else 0


def match_key(run_id: str, peer_id: str | None = None, bits: int = 0) -> str:
    """hivemind's group key (``{prefix}.0b{group bits}``), the peer's hash bucket appended when split."""
    suffix = format(bucket_of(peer_id, bits), f"0{bits}b") if bits else ""
    return f"{run_prefix(run_id)}.0b{epoch_group_bits(EPOCH)}{suffix}"


class Swarm:
    """One fresh swarm of N nodes: the workers, where each node lives, the peer ids."""

    def __init__(self, n: int, run_id: str, workers: list[Worker], reader: Worker):
        self.n, self.run_id, self.workers, self.reader = n, run_id, workers, reader
        self.home: dict[int, Worker] = {0: reader}
        self.peer_id: dict[int, str] = {}

    async def start(self) -> float:
        clock = time.monotonic()
        share = {w: list(range(1, self.n))[k :: len(self.workers)] for k, w in enumerate(self.workers)}
        first = await self.workers[0].call(op="start", run_id=self.run_id, indices=[1], initial_peers=[])
        boot = first["1"]["maddrs"][:1]
        started = await asyncio.gather(
            *(w.call(op="start", run_id=self.run_id, indices=[i for i in ids if i != 1], initial_peers=boot)
              for w, ids in share.items())
        )  # fmt: skip
        others = [m for group in started for info in group.values() for m in info["maddrs"][:1]]
        me = await self.reader.call(op="start", run_id=self.run_id, indices=[0], initial_peers=boot + others[-1:])
        for w, ids in share.items():
            self.home.update({i: w for i in ids})
        for group in (first, *started, me):
            self.peer_id.update({int(i): info["peer_id"] for i, info in group.items()})
        return time.monotonic() - clock

    @property
    def processes(self) -> list[Worker]:
        return [*self.workers, self.reader]

    async def each_writes(self, op: str, keys_of: dict[int, list[str]]) -> dict:
        """Every node writes its keys once (a write round); the store RPCs each node received meanwhile."""
        await asyncio.gather(*(w.call(op="inbound", reset=True) for w in self.processes))
        clock = time.monotonic()
        by_worker: dict[Worker, dict[int, list[str]]] = {}
        for i, keys in keys_of.items():
            by_worker.setdefault(self.home[i], {})[i] = keys
        done = await asyncio.gather(*(w.call(op=op, keys=keys) for w, keys in by_worker.items()))
        seconds = time.monotonic() - clock
        inbound = {}
        for counts in await asyncio.gather(*(w.call(op="inbound", reset=True) for w in self.processes)):
            inbound.update(counts)
        stores = sorted((c.get("store", 0) for c in inbound.values()), reverse=True)
        return dict(
            writes=sum(len(k) for k in keys_of.values()), failed=sum(len(d["failed"]) for d in done),
            seconds=round(seconds, 2), store_rpcs_total=sum(stores), store_rpcs_busiest_node=stores[0],
            store_rpcs_median_node=statistics.median(stores), store_rpcs_top5=stores[:5],
            store_bytes_busiest_node=max(c.get("store_bytes", 0) for c in inbound.values()),
        )  # fmt: skip

    async def refresh(self, op: str, index: int | None, keys: list[str]) -> None:
        if index is not None:
            await self.home[index].call(op=op, keys={str(index): keys})

    async def measure(self, kind: str, keys: list[str]) -> dict:
        return await self.reader.call(op="measure", index=0, kind=kind, keys=keys)


def summarize(samples: list[dict]) -> dict:
    """Counts: the median over the ops (min and max where they vary); times: median, p90, min, max."""
    out: dict[str, Any] = dict(ops=len(samples))
    for name in ("find_rpcs", "store_rpcs", "bytes_sent", "bytes_received", "holders", "value_bytes",
                 "signature_checks", "returned"):  # fmt: skip
        values = [s[name] for s in samples]
        out[name] = statistics.median(values)
        if min(values) != max(values):
            out[f"{name}_range"] = [min(values), max(values)]
    for name in ("latency_s", "cpu_s"):
        values = sorted(s[name] for s in samples)
        out[name] = dict(
            median=round(statistics.median(values), 4), p90=round(_p90(values), 4), min=round(values[0], 4),
            max=round(values[-1], 4),
        )  # fmt: skip
    out["all_ok"] = all(s["ok"] for s in samples)
    out["exact"] = sum(s.get("exact", True) for s in samples)
    return out


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) > 1 else values[0]


async def measure_size(n: int, args: argparse.Namespace, logs: Path) -> dict:
    """One fresh swarm of ``n`` nodes, populated, then the measured peer's ops."""
    clock = time.monotonic()
    run_id = secrets.token_hex(8)
    count = max(1, min(args.workers, n - 1))
    workers = [await Worker.spawn(logs / f"n{n}-worker{k}.log", args.as_hivemind) for k in range(count)]
    reader = await Worker.spawn(logs / f"n{n}-reader.log", args.as_hivemind)
    swarm = Swarm(n, run_id, workers, reader)
    rng = random.Random(n)
    try:
        startup = await swarm.start()
        await asyncio.sleep(2)
        memory = memory_of_tree()
        known = {}
        for counts in await asyncio.gather(*(w.call(op="known") for w in swarm.processes)):
            known.update(counts)
        ids = swarm.peer_id
        level, levels, bits = read_level(n), list(write_levels(n)), split_bits(n, args.group)
        level_keys = {i: [progress_key(run_id, lv, bucket_of(p, lv)) for lv in levels] for i, p in ids.items()}
        near = near_levels(n)
        near_keys = {i: [progress_key(run_id, lv, bucket_of(p, lv)) for lv in near] for i, p in ids.items()}
        one_key = progress_key(run_id)
        rounds = dict(
            one_key=await swarm.each_writes("write", {i: [one_key] for i in ids}),
            levels=await swarm.each_writes("write", level_keys),
            near=await swarm.each_writes("write", near_keys),
            match_one=await swarm.each_writes("declare", {i: [match_key(run_id)] for i in ids}),
            match_split=await swarm.each_writes("declare", {i: [match_key(run_id, p, bits)] for i, p in ids.items()}),
        )
        others = [i for i in ids if i != 0]
        samples: dict[str, list[dict]] = {op: [] for op in OPS}

        async def read_op(op: str, kind: str, key: str, expected: set[str], writer: str, refresher: int | None):
            await swarm.refresh(writer, refresher, [key])
            sample = await swarm.measure(kind, [key])
            got = sample.pop("ids")
            sample.update(returned=len(got), exact=set(got) == expected, missing=len(expected - set(got)))
            samples[op].append(sample)

        everyone = set(ids.values())
        for r in range(args.reads):
            await read_op("full_read", "read_records", one_key, everyone, "write", others[r % len(others)])
        buckets = 1 << level
        for r in range(max(args.reads, min(buckets, 32))):
            b = r % buckets
            members = {p for p in ids.values() if bucket_of(p, level) == b}
            writers = [i for i in others if ids[i] in members]
            refresher = writers[r // buckets % len(writers)] if writers else None
            await read_op("bucket_read", "read_records", progress_key(run_id, level, b), members, "write", refresher)
        for _ in range(args.reads):
            for op, keys in (("store_one", [one_key]), ("store_levels", level_keys[0]), ("store_near", near_keys[0])):
                sample = await swarm.measure("store", keys)
                sample.pop("ids")
                samples[op].append(dict(sample, returned=0))
        for r in range(args.reads):
            await read_op(
                "match_one", "read_averagers", match_key(run_id), everyone, "declare", others[r % len(others)]
            )
        split_keys = sorted({match_key(run_id, p, bits) for p in ids.values()})
        for r in range(args.reads):
            key = split_keys[r % len(split_keys)]
            members = {p for p in ids.values() if match_key(run_id, p, bits) == key}
            writers = [i for i in others if ids[i] in members]
            refresher = rng.choice(writers) if writers else None
            await read_op("match_split", "read_averagers", key, members, "declare", refresher)
        summary = {op: summarize(s) for op, s in samples.items()}
        memory["after_ops"] = memory_of_tree()
        return dict(
            n=n, run_id=run_id, workers=count, read_level=level, write_levels=levels, near_levels=list(near),
            buckets=buckets, match_split_bits=bits, match_keys=len(split_keys), startup_s=round(startup, 1),
            memory=memory, routing_known=dict(measured_peer=known.get("0"), median=statistics.median(known.values())),
            write_rounds=rounds, ops=summary, samples=samples, load_average=list(os.getloadavg()),
            seconds=round(time.monotonic() - clock, 1),
        )  # fmt: skip
    finally:
        await asyncio.gather(*(w.stop() for w in swarm.processes), return_exceptions=True)


def per_second(result: dict) -> dict:
    """One peer's DHT traffic per second on the client's schedule (a read every 1 s, a write every 2 s), for today's
    one key, the bounded design, and the bounded design writing only its ``near_levels`` (a census key written
    now and then is left out)."""
    ops, rounds = result["ops"], result["write_rounds"]
    levels = len(result["write_levels"])
    out: dict[str, Any] = dict(n=result["n"])
    designs = (
        ("one_key", "full_read", "store_one", "one_key", 1),
        ("buckets", "bucket_read", "store_levels", "levels", levels),
        ("buckets_near", "bucket_read", "store_near", "near", len(result["near_levels"])),
    )
    for design, read_op, write_op, write_round, keys in designs:
        r, w = ops[read_op], ops[write_op]

        def rate(name: str, r: dict = r, w: dict = w) -> float:
            return r[name] / READ_EVERY + w[name] / WRITE_EVERY

        out[design] = dict(
            peers_seen=r["returned"] / READ_EVERY,  # the records a read gives (distinct peers)
            record_copies_received=rate("signature_checks"),  # every copy, from every holder, verified
            rpcs=rate("find_rpcs") + rate("store_rpcs"),
            kib_received=round(rate("bytes_received") / 1024, 1),
            kib_sent=round(rate("bytes_sent") / 1024, 1),
            keys_written=keys / WRITE_EVERY,
            busiest_node_store_rpcs_received=rounds[write_round]["store_rpcs_busiest_node"] / WRITE_EVERY,
        )
    full = ops["full_read"]
    out["bytes_per_record_copy"] = round(full["value_bytes"] / max(1, full["signature_checks"]))
    return out


def table(results: list[dict]) -> None:
    rows = []
    for r in results:
        for op in OPS:
            s = r["ops"][op]
            lat, cpu = s["latency_s"], s["cpu_s"]
            rows.append([
                r["n"], op, s["returned"], s["holders"], s["find_rpcs"], s["store_rpcs"],
                round(s["bytes_received"] / 1024, 1), round(s["bytes_sent"] / 1024, 1), s["signature_checks"],
                round(cpu["median"] * 1000), f"{lat['median'] * 1000:.0f} ({lat['p90'] * 1000:.0f})",
                f"{s['exact']}/{s['ops']}",
            ])  # fmt: skip
    print_table(
        "one DHT op of one peer (medians over the ops; counts and bytes first, then CPU and wall time)",
        ["N", "op", "records", "holders", "find RPCs", "store RPCs", "KiB in", "KiB out", "sig checks",
         "CPU ms", "latency ms (p90)", "exact"],
        rows,
    )  # fmt: skip
    rows = []
    for r in results:
        w = r["write_rounds"]
        rows.append([
            r["n"], len(r["write_levels"]), w["one_key"]["store_rpcs_busiest_node"],
            w["levels"]["store_rpcs_busiest_node"], w["levels"]["store_rpcs_median_node"],
            w["near"]["store_rpcs_busiest_node"],
            w["match_one"]["store_rpcs_busiest_node"], w["match_split"]["store_rpcs_busiest_node"],
            r["memory"]["p2pd_mib_each"], round(r["memory"]["python_mib"]), r["startup_s"],
        ])  # fmt: skip
    print_table(
        "a write round (every peer writes once): store RPCs received by the busiest node; memory",
        ["N", "levels written", "one key", "levels", "levels (median node)", "near levels", "match one", "match split",
         "p2pd MiB each", "Python MiB (all)", "start s"],
        rows,
    )  # fmt: skip


def plot(results: list[dict], out: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    ns = [r["n"] for r in results]
    for op in OPS:
        left.plot(ns, [r["ops"][op]["bytes_received"] / 1024 for r in results], marker="o", label=op)
        lat = [r["ops"][op]["latency_s"] for r in results]
        median = [x["median"] * 1000 for x in lat]
        above = [x["p90"] * 1000 - m for x, m in zip(lat, median)]
        right.errorbar(ns, median, yerr=[[0] * len(lat), above], marker="o", capsize=3, label=op)
    left.set(xlabel="peers N", ylabel="KiB received per op (median)", title="bytes (load-independent)")
    right.set(xlabel="peers N", ylabel="ms (median, bar to p90)", title="latency (shared 2-core machine: noisy)")
    left.legend(fontsize=8)
    return save_figure(fig, out, NAME)


async def run(args: argparse.Namespace) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory(prefix="dht-scale-logs-") as logs:
        for n in args.sizes:
            print(f"N={n}: starting (load {os.getloadavg()[0]:.2f})", flush=True)
            result = await measure_size(n, args, Path(logs))
            print(f"N={n}: done in {result['seconds']} s", flush=True)
            results.append(result)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--sizes", type=lambda s: tuple(int(x) for x in s.split(",")), default=None)
    parser.add_argument("--reads", type=int, default=None, help="ops of each kind per size (default 10; smoke 3)")
    parser.add_argument("--workers", type=int, default=None, help="processes holding the swarm's nodes (default 2)")
    parser.add_argument("--group", type=int, default=None, help=f"averagers per split matchmaking key ({GROUP})")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--as-hivemind", action="store_true",
        help="nodes as hivemind runs them (searches 20 wide, every record judged anew): the baseline of the fixes",
    )  # fmt: skip
    args = parser.parse_args()
    if args.worker:
        asyncio.run(worker_main())
        return
    args.sizes = args.sizes or (SMOKE_SIZES if args.smoke else SIZES)
    args.reads = args.reads or (3 if args.smoke else 10)
    args.workers = args.workers or (1 if args.smoke else 2)
    args.group = args.group or (2 if args.smoke else GROUP)
    clock = Stopwatch()
    results = asyncio.run(run(args))
    table(results)
    rates = [per_second(r) for r in results]
    print(json.dumps(rates, indent=1))
    fields = dict(
        layout=LAYOUT, as_hivemind=args.as_hivemind, bucket_size=BUCKET_SIZE, group=args.group, reads=args.reads,
        sizes=list(args.sizes),
        schedule=dict(read_every_s=READ_EVERY, write_every_s=WRITE_EVERY), per_peer_per_second=rates,
        results=results,
    )  # fmt: skip
    finish(NAME, args.out, fields, smoke=args.smoke, clock=clock, plot=lambda out: plot(results, out))


if __name__ == "__main__":
    main()
