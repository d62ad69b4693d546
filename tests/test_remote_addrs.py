"""A donor's serving slots per network: the address of each incoming stream is kept for its handler
(``swarm.hivemind_fixes.remote_addrs``), and the requesters of one network hold at most a share of the slots
(``ServingLimits.per_network``), so one machine's keys reading slowly cannot take them all."""

from __future__ import annotations

import asyncio

from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2
from hivemind.utils.multiaddr import Multiaddr

from swarm.averager.served import served
from swarm.averager.serving_limits import ServingLimits
from swarm.hivemind_fixes.remote_addrs import keep_remote_addrs, network_of, remote_addr

RELAY = "QmRQUhoLEFw4JQwqNydPqy75jRpXkxdFCS7sQe4gph5ho8"


def test_a_network_is_an_ipv4_24_an_ipv6_48_or_the_relay_a_stream_came_through():
    assert network_of(Multiaddr("/ip4/127.0.0.1/tcp/4001")) == "ip4:127.0.0.1/32"  # loopback, LAN: one host
    assert network_of(Multiaddr("/ip4/192.168.1.7/tcp/1")) != network_of(Multiaddr("/ip4/192.168.1.8/tcp/1"))
    assert network_of(Multiaddr("/ip6/fe80::1/tcp/1")) == "ip6:fe80::1/128"
    assert network_of(Multiaddr(f"/ip4/8.8.8.77/tcp/1/p2p/{RELAY}")) == "ip4:8.8.8.0/24"
    assert network_of(Multiaddr("/ip4/8.8.8.1/udp/1")) == "ip4:8.8.8.0/24"
    assert network_of(Multiaddr("/ip4/8.8.9.1/tcp/1")) == "ip4:8.8.9.0/24"
    assert network_of(Multiaddr("/ip6/2a00:1450:4001:82a::1/tcp/1")) == "ip6:2a00:1450:4001::/48"
    assert network_of(Multiaddr("/ip6/2a00:1450:4001:ffff::9/tcp/1")) == "ip6:2a00:1450:4001::/48"
    assert network_of(Multiaddr(f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY}/p2p-circuit")) == f"relay:{RELAY}"
    assert network_of(Multiaddr("/dns4/example.com/tcp/1")) is None and network_of(None) is None


def test_one_network_holds_at_most_its_share_of_the_slots():
    limits = ServingLimits(per_peer=2, total=8, per_minute=60, per_network=3)
    here, there = "ip4:203.0.113.0/24", "ip4:198.51.100.0/24"
    assert [limits.acquire(f"key{i}", here) for i in range(5)] == [True, True, True, False, False]
    assert limits.acquire("other", there) and limits.acquire("other", there)  # another network: its own share
    assert limits.acquire("unknown") and limits.acquire("unknown")  # no address known: only the other limits
    assert limits.acquire("another", there) and not limits.acquire("last", "ip4:192.0.2.0/24")  # the total is full
    limits.release("key0", here)
    assert limits.acquire("key9", here) and not limits.acquire("key10", here)  # a slot given back is free again
    for i in (1, 2, 9):
        limits.release(f"key{i}", here)
    assert limits.networks == {there: 3} and "key1" not in limits.open
    refused = ServingLimits(per_peer=2, total=8, per_minute=60, per_network=1)
    refused.acquire("first", here)
    assert not any(refused.acquire(f"new{i}", here) for i in range(100)) and set(refused.started) == {"first"}
    unlimited = ServingLimits(per_peer=1, total=8, per_minute=60)  # the default: no share per network
    assert all(unlimited.acquire(f"key{i}", here) for i in range(8))


def test_strangers_cannot_take_the_slots_kept_for_groupmates():
    limits = ServingLimits(per_peer=2, total=8, per_minute=60, per_network=3, reserved=2)
    networks = [f"ip4:198.51.{i}.0/24" for i in range(4)]
    taken = [limits.acquire(f"stranger{i}", networks[i % 4]) for i in range(10)]  # strangers of four networks
    assert sum(taken) == 6 and not limits.acquire("stranger-more", "ip4:192.0.2.0/24")
    # a groupmate fetching the round's average: a kept slot, whatever its network's share
    assert limits.acquire("mate", networks[0], known=True) and limits.acquire("mate", networks[0], known=True)
    assert not limits.acquire("mate2", networks[1], known=True)  # the total is full
    assert limits.networks[networks[0]] == 2  # a groupmate's stream counts in no network's share
    limits.release("mate")
    assert not limits.acquire("stranger-more", networks[3]) and limits.acquire("mate2", known=True)


def test_the_keys_of_our_last_rounds_groups_are_groupmates_to_the_transfer():
    from collections import OrderedDict
    from types import SimpleNamespace

    from swarm.averager.audit_serving import KEEP_ROUNDS, AuditServing
    from swarm.averager.process import PseudoGradientAverager
    from swarm.averager.transfer import FileTransfer

    serving = AuditServing()
    serving._audit_rounds = OrderedDict()
    closing = SimpleNamespace(close=lambda: None)
    runner = lambda gid: SimpleNamespace(group_id=gid, sent_parts=closing, received_parts=closing)  # noqa: E731
    assert not serving._recent_groupmate("a")
    for i in range(KEEP_ROUNDS + 1):
        serving._open_audit(runner(bytes([i])), [f"m{i}", "me"])
    assert not serving._recent_groupmate("m0")  # a round no auditor asks about any more
    assert all(serving._recent_groupmate(f"m{i}") for i in range(1, KEEP_ROUNDS + 1))
    assert not FileTransfer._recent_groupmate("m1")  # a transfer alone knows nobody
    assert PseudoGradientAverager._recent_groupmate is AuditServing._recent_groupmate  # the averager's knows


def test_a_stream_from_a_network_past_its_share_is_refused_by_the_real_handler():
    """Three real daemons on 127.0.0.1 (one host): with a share of one, the first requester's stream, which it
    does not read, holds the slot; the second requester, another key, is served nothing until it is given back."""
    keep_remote_addrs()

    async def scenario():
        server = await P2P.create()
        maddrs = await server.get_visible_maddrs()
        first, second = await P2P.create(initial_peers=maddrs), await P2P.create(initial_peers=maddrs)
        limits = ServingLimits(per_peer=2, total=8, per_minute=60, per_network=1, reserved=2)
        seen: list[str | None] = []
        mates: set[str] = set()

        async def messages():
            for _ in range(64):
                yield averaging_pb2.DownloadData(metadata=b"x" * 65536)

        async def handler(request, context):
            seen.append(network_of(remote_addr()))
            requester = context.remote_id.to_base58()
            async for message in served(limits, requester, messages(), "a test stream", requester in mates):
                yield message

        try:
            await server.add_protobuf_handler("serve", handler, averaging_pb2.DownloadRequest, stream_output=True)
            request = averaging_pb2.DownloadRequest()
            reply = averaging_pb2.DownloadData
            held = await first.iterate_protobuf_handler(server.peer_id, "serve", request, reply)
            await held.__anext__()  # its stream is open, and read no further
            refused = await second.iterate_protobuf_handler(server.peer_id, "serve", request, reply)
            assert [m async for m in refused] == []
            assert seen == ["ip4:127.0.0.1/32"] * 2 and limits.networks == {"ip4:127.0.0.1/32": 1}
            mates.add(second.peer_id.to_base58())  # the same key, as a groupmate: a kept slot
            kept = await second.iterate_protobuf_handler(server.peer_id, "serve", request, reply)
            assert len([m async for m in kept]) == 64
            mates.clear()
            await held.aclose()
            for _ in range(100):  # the server sees the stream closed and gives its slot back
                if not limits.networks:
                    break
                await asyncio.sleep(0.05)
            again = await second.iterate_protobuf_handler(server.peer_id, "serve", request, reply)
            assert len([m async for m in again]) == 64
        finally:
            for p2p in (first, second, server):
                await p2p.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), 60))
