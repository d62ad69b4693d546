"""A requester gets a bounded share of this peer's serving (``swarm.averager.serving_limits``)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2

from swarm.averager.audit_serving import AUDIT_LIMITS, AuditServing
from swarm.averager.serving_limits import ServingLimits


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_one_requester_cannot_hold_more_streams_or_start_more_a_minute_than_its_share():
    clock = Clock()
    limits = ServingLimits(per_peer=2, total=3, per_minute=5, clock=clock)
    assert limits.acquire("a") and limits.acquire("a") and not limits.acquire("a")  # two at once, not three
    assert limits.acquire("b") and not limits.acquire("c")  # the peer's total: three at once
    limits.release("a")
    assert limits.acquire("c")  # a slot freed
    limits.release("a")
    for _ in range(3):  # "a" started two; three more, one at a time
        clock.now += 1
        assert limits.acquire("a")
        limits.release("a")
    assert "a" not in limits.open and not limits.acquire("a")  # five started within the minute: refused
    clock.now += 61
    assert limits.acquire("a")  # a minute on: served again


def test_requesters_that_went_quiet_are_forgotten():
    clock = Clock()
    limits = ServingLimits(per_peer=1, total=2, per_minute=5, clock=clock)
    for i in range(100):
        assert limits.acquire(f"peer{i}")
        limits.release(f"peer{i}")
        clock.now += 1
    assert len(limits.started) <= 4 * limits.total + 61 and not limits.open


class HeldAudits(AuditServing):
    """The audit RPC's limits, with what it serves replaced by one message and a wait (a stream held open)."""

    def __init__(self, clock: Clock):
        self._audit_serving = ServingLimits(**AUDIT_LIMITS, clock=clock)
        self.release = asyncio.Event()

    async def _serve_audit(self, request, context):
        yield averaging_pb2.DownloadData()
        await self.release.wait()


def test_a_groupmate_cannot_hold_or_start_more_audit_requests_than_its_share():
    """A groupmate of a live round may ask for our parts (a slice's bytes) again and again; past its share of
    streams at once, or of requests a minute, it is answered nothing at once."""

    async def scenario():
        clock = Clock()
        audits = HeldAudits(clock)
        asker, other = SimpleNamespace(remote_id=PeerID(b"\x01" * 34)), SimpleNamespace(remote_id=PeerID(b"\x02" * 34))
        held = [audits.rpc_audit_fetch(averaging_pb2.DownloadData(), asker) for _ in range(AUDIT_LIMITS["per_peer"])]
        assert [await anext(stream, None) for stream in held] == [averaging_pb2.DownloadData()] * len(held)
        assert await anext(audits.rpc_audit_fetch(averaging_pb2.DownloadData(), asker), None) is None  # refused
        assert await anext(audits.rpc_audit_fetch(averaging_pb2.DownloadData(), other), None) is not None
        await held[0].aclose()  # a stream ends: its slot is free again
        again = audits.rpc_audit_fetch(averaging_pb2.DownloadData(), asker)
        assert await anext(again, None) is not None
        await again.aclose()
        for stream in held[1:]:
            await stream.aclose()
        started = AUDIT_LIMITS["per_peer"] + 1
        for _ in range(AUDIT_LIMITS["per_minute"] - started):  # one at a time, up to its share of the minute
            stream = audits.rpc_audit_fetch(averaging_pb2.DownloadData(), asker)
            assert await anext(stream, None) is not None
            await stream.aclose()
        assert await anext(audits.rpc_audit_fetch(averaging_pb2.DownloadData(), asker), None) is None
        clock.now += 61
        assert await anext(audits.rpc_audit_fetch(averaging_pb2.DownloadData(), asker), None) is not None
        audits.release.set()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_request_is_decoded_only_within_what_an_honest_verdict_can_hold(monkeypatch):
    """A stranger's request fields are msgpack: 4 MiB of empty arrays decoded to 289 MiB. Past
    ``max_request_bytes`` they are refused undecoded; an auditor's verdict in a second stage of 256 delegates (a
    receipt and 256 signed outputs, each larger than an honest one) is decoded, in a run of groups of 64."""
    from hivemind.utils.serializer import MSGPackSerializer

    import swarm.averager.transfer as transfer
    from swarm.averager.bounds import max_request_bytes

    decoded, loads = [], transfer.bounded_loads
    monkeypatch.setattr(transfer, "bounded_loads", lambda blob, *a: decoded.append(len(blob)) or loads(blob, *a))
    host = SimpleNamespace(_is_banned=lambda peer: False, _secret=None, matchmaking_kwargs=dict(target_group_size=64))
    context = SimpleNamespace(remote_id=PeerID(b"\x01" * 34))
    from swarm.averager.bounds import SECOND_STAGE
    from swarm.dht.records import MAX_GROUPS

    assert SECOND_STAGE == MAX_GROUPS  # a second stage's delegates, whatever the run's group size
    verdict = dict(group_id=b"g" * 32, reducer="r", verdict="passed", receipt=b"r" * (4096 + 256 * MAX_GROUPS),
                   outputs={f"peer{i}": b"o" * 1024 for i in range(MAX_GROUPS)})  # fmt: skip
    request = averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(verdict))
    assert transfer.FileTransfer._admitted(host, request, context) == verdict
    bomb = b"\xdd" + (4 << 20).to_bytes(4, "big") + b"\x90" * (4 << 20)  # 4M empty arrays: 289 MiB, decoded
    assert len(bomb) > max_request_bytes(64)
    assert transfer.FileTransfer._admitted(host, averaging_pb2.DownloadData(metadata=bomb), context) is None
    assert decoded == [len(request.metadata)]  # the bomb was never decoded


def test_streams_naming_groups_we_do_not_run_wait_within_their_share(monkeypatch):
    """A second stage's stream may name a group a moment before we register it, so it waits for it (``GROUP_WAIT``);
    a stranger naming made-up groups in a loop waits within ``GROUP_WAITS``' share, and one that never sends its
    first message is let go after ``GROUP_WAIT``."""
    import swarm.averager.fixed_group as fixed_group

    monkeypatch.setattr(fixed_group, "GROUP_WAIT", 0.5)
    host = fixed_group.FixedGroups()
    host._running_groups = {}
    stranger = SimpleNamespace(remote_id=PeerID(b"\x01" * 34))

    async def first_reply(stream) -> tuple[object, float]:
        started = asyncio.get_running_loop().time()
        reply = await anext(host.rpc_aggregate_part(stream, stranger), None)
        return reply, asyncio.get_running_loop().time() - started

    async def made_up_group():
        yield averaging_pb2.AveragingData(group_id=b"made up")

    async def silent():
        await asyncio.sleep(3600)
        yield averaging_pb2.AveragingData()

    async def scenario():
        per_peer = fixed_group.GROUP_WAITS["per_peer"]
        replies = await asyncio.gather(*(first_reply(made_up_group()) for _ in range(per_peer + 1)))
        codes = [reply.code for reply, _ in replies]
        assert codes == [averaging_pb2.BAD_GROUP_ID] * (per_peer + 1)
        waited = sorted(seconds for _, seconds in replies)
        assert waited[0] < 0.25 and all(s >= 0.45 for s in waited[1:])  # one over its share: answered at once
        assert not host._group_waits.open  # every wait's slot given back
        reply, seconds = await first_reply(silent())
        assert reply is None and seconds < 2  # a first message that never comes is not waited for past GROUP_WAIT

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_crowd_of_made_up_groups_does_not_turn_an_honest_stream_away(monkeypatch):
    """Keys are free: 40 keys keep two made-up waits each. A delegate's stream that starts a moment before we
    register its group still waits for it (more slowly past ``FAST_WAITS``) and finds it, not "bad group"."""
    import swarm.averager.fixed_group as fixed_group

    monkeypatch.setattr(fixed_group, "GROUP_WAIT", 3.0)
    host = fixed_group.FixedGroups()
    host._running_groups = {}

    async def scenario():
        crowd = [asyncio.create_task(host._wait_for_group(b"made up %d" % i, f"key{i // 2}")) for i in range(2 * 40)]
        await asyncio.sleep(0.1)
        assert sum(host._group_waits.open.values()) == 80 > fixed_group.FAST_WAITS
        honest = asyncio.create_task(host._wait_for_group(b"ours", "delegate"))
        await asyncio.sleep(0.3)
        host._running_groups[b"ours"] = object()  # we register the group
        await asyncio.wait_for(honest, 1.0)  # it found it, well before GROUP_WAIT
        assert not any(task.done() for task in crowd)
        await asyncio.gather(*crowd)
        assert not host._group_waits.open

    asyncio.run(asyncio.wait_for(scenario(), 30))
