"""A donor's serving slots per network: the address of each incoming stream is kept for its handler
(``swarm.hivemind_fixes.remote_addrs``), and the requesters of one network hold at most a share of the slots
(``ServingLimits.per_network``), so one machine's keys reading slowly cannot take them all."""

from __future__ import annotations

import asyncio

from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2
from hivemind.utils.multiaddr import Multiaddr
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.averager.served import served
from swarm.averager.serving_limits import GROUPS_KEPT, RecentGroupmates, ServingLimits
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


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(["", "ip4", "ip6", "p2p", "p2p-circuit", "tcp", "1.2.3.4", "::1", "fe80::1", "x"]),
             max_size=8)
    | st.lists(st.text(max_size=20), max_size=8)
)  # fmt: skip
def test_any_address_names_a_network_or_none_and_never_raises(parts):
    class Text:  # what ``str`` of a daemon's multiaddr may be, whatever the connection was
        def __str__(self) -> str:
            return "/".join(parts)

    network = network_of(Text())
    assert network is None or network.startswith(("ip4:", "ip6:", "relay"))


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
    limits = ServingLimits(per_peer=2, total=8, per_minute=60, per_network=2, reserved=2)
    networks = [f"ip4:198.51.{i}.0/24" for i in range(4)]
    taken = [limits.acquire(f"stranger{i}", networks[i % 4]) for i in range(10)]  # strangers of four networks
    assert sum(taken) == 6 and not limits.acquire("stranger-more", "ip4:192.0.2.0/24")
    # groupmates fetching the round's average: the kept slots, within their networks' shares
    assert not limits.acquire("mate", networks[0], known=True)  # its network holds its share (2) already
    assert limits.acquire("mate", networks[3], known=True) and limits.acquire("mate2", known=True)
    assert not limits.acquire("mate3", known=True)  # the total is full
    assert limits.networks[networks[3]] == 2
    limits.release("mate", networks[3])
    assert not limits.acquire("stranger-more", "ip4:192.0.2.0/24") and limits.acquire("mate3", known=True)


def test_the_members_of_our_last_first_stages_are_groupmates_to_the_transfer():
    mates = RecentGroupmates()
    assert "a" not in mates
    mates.note(())  # a second stage: its delegates are not our tree's
    for i in range(GROUPS_KEPT + 1):
        mates.note([f"m{i}", "me"])
    assert "m0" not in mates and all(f"m{i}" in mates for i in range(1, GROUPS_KEPT + 1))


def test_a_stream_past_its_networks_share_or_the_strangers_slots_is_refused_by_the_real_handler():
    """Three real daemons on 127.0.0.1 (one host). With a share of one, the first requester's stream, which it does
    not read, holds the host's slot: the second requester, another key, is served nothing until it is given back.
    With one of two slots kept for groupmates, the first's unread stream holds the strangers' slot: the second is
    served nothing as a stranger, and whole as a groupmate."""
    keep_remote_addrs()

    async def scenario():
        server = await P2P.create()
        maddrs = await server.get_visible_maddrs()
        first, second = await P2P.create(initial_peers=maddrs), await P2P.create(initial_peers=maddrs)
        shared = ServingLimits(per_peer=2, total=8, per_minute=60, per_network=1)
        kept = ServingLimits(per_peer=2, total=2, per_minute=60, per_network=2, reserved=1)
        limits, seen, mates = [shared], [], set()

        async def messages():
            for _ in range(64):
                yield averaging_pb2.DownloadData(metadata=b"x" * 65536)

        async def handler(request, context):
            seen.append(network_of(remote_addr()))
            requester = context.remote_id.to_base58()
            async for message in served(limits[0], requester, messages(), "a test stream", requester in mates):
                yield message

        async def fetch(p2p: P2P) -> int:
            replies = await p2p.iterate_protobuf_handler(server.peer_id, "serve", request, reply)
            return len([m async for m in replies])

        async def freed(which: ServingLimits) -> None:
            for _ in range(100):  # the server sees the stream closed and gives its slot back
                if not which.open:
                    return
                await asyncio.sleep(0.05)

        request, reply = averaging_pb2.DownloadRequest(), averaging_pb2.DownloadData
        try:
            await server.add_protobuf_handler("serve", handler, averaging_pb2.DownloadRequest, stream_output=True)
            held = await first.iterate_protobuf_handler(server.peer_id, "serve", request, reply)
            await held.__anext__()  # its stream is open, and read no further
            assert await fetch(second) == 0
            assert seen == ["ip4:127.0.0.1/32"] * 2 and shared.networks == {"ip4:127.0.0.1/32": 1}
            await held.aclose()
            await freed(shared)
            assert await fetch(second) == 64

            limits[0] = kept
            held = await first.iterate_protobuf_handler(server.peer_id, "serve", request, reply)
            await held.__anext__()
            assert await fetch(second) == 0  # the strangers' slot is taken
            mates.add(second.peer_id.to_base58())
            assert await fetch(second) == 64  # a groupmate: the kept slot
            await held.aclose()
            await freed(kept)
            assert kept.open == {} and kept.networks == {}
        finally:
            for p2p in (first, second, server):
                await p2p.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), 60))
