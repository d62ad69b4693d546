"""A stream message whose header declares more than any honest one is refused before it is read
(``swarm.hivemind_fixes.messages``), on both sides of a real stream between two libp2p daemons."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2

from swarm.hivemind_fixes.messages import MAX_MESSAGE, bound_messages

CHUNK = 1 << 20


async def _pair() -> tuple[P2P, P2P]:
    server = await P2P.create()
    client = await P2P.create(initial_peers=await server.get_visible_maddrs())
    return server, client


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), seconds) == b""
    except (TimeoutError, ConnectionError):
        return False


def test_a_request_declaring_a_terabyte_ends_its_stream_and_an_honest_one_is_served():
    bound_messages()

    async def scenario():
        server, client = await _pair()
        seen: list[int] = []

        async def handler(requests, context):
            async for request in requests:
                seen.append(request.ByteSize())
                yield averaging_pb2.DownloadData(metadata=b"ok")

        try:
            await server.add_protobuf_handler(
                "echo", handler, averaging_pb2.DownloadData, stream_input=True, stream_output=True
            )
            # an honest message of 4 MiB (a proof's digests at their most) is read and answered
            honest = averaging_pb2.DownloadData(metadata=b"x" * (4 << 20))
            replies = await client.iterate_protobuf_handler(server.peer_id, "echo", honest, averaging_pb2.DownloadData)
            assert [r.metadata async for r in replies] == [b"ok"] and seen == [honest.ByteSize()]

            # a stranger's header declares 2**40 bytes, then it sends what it can
            _, reader, writer = await client.call_binary_stream_handler(server.peer_id, "echo")
            writer.write(P2P.MESSAGE_MARKER + (1 << 40).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
            sent = 0
            closed = False
            while sent < 8 * MAX_MESSAGE and not closed:
                try:
                    writer.write(b"\0" * CHUNK)
                    await asyncio.wait_for(writer.drain(), 10)
                except (ConnectionError, TimeoutError):
                    closed = True
                    break
                sent += CHUNK
                closed = await _closed_within(reader, 0.05)
            closed = closed or await _closed_within(reader, 10)
            writer.close()
            assert closed, f"the server still read after {sent >> 20} MiB of a message declaring 2**40 bytes"
            assert seen == [honest.ByteSize()]  # nothing of it reached the handler
        finally:
            await asyncio.gather(client.shutdown(), server.shutdown())

    asyncio.run(asyncio.wait_for(scenario(), 120))


def test_a_reply_declaring_a_terabyte_ends_the_readers_stream():
    bound_messages()

    async def scenario():
        server, client = await _pair()

        async def liar(stream_info, reader, writer):  # answers any request with a header past every bound
            writer.write(P2P.MESSAGE_MARKER + (1 << 40).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
            for _ in range(4 * MAX_MESSAGE // CHUNK):
                writer.write(b"\0" * CHUNK)
                await writer.drain()
            await asyncio.sleep(60)  # and holds the stream open

        try:
            await server.add_binary_stream_handler("liar", liar)
            request = averaging_pb2.DownloadData(metadata=b"state, please")
            replies = await client.iterate_protobuf_handler(server.peer_id, "liar", request, averaging_pb2.DownloadData)
            got = await asyncio.wait_for(_all(replies), 30)
            assert got == []  # the stream ended: nothing of the reply was taken as a message
        finally:
            await asyncio.gather(client.shutdown(), server.shutdown())

    asyncio.run(asyncio.wait_for(scenario(), 120))


async def _all(replies) -> list:
    return [reply async for reply in replies]


def test_a_peers_dht_and_the_processes_it_forks_read_bounded_messages():
    """What the test above checks is what a peer runs: ``start_dht`` installs it before the DHT process (and,
    later, the averager's) is forked. In a fresh interpreter, where nothing installed it before."""
    check = (
        "from hivemind.p2p import P2P\n"
        "from swarm.dht.network import NetworkConfig, start_dht\n"
        "from swarm.hivemind_fixes.messages import receive_bounded\n"
        "assert P2P.receive_raw_data is not receive_bounded\n"
        "dht = start_dht(NetworkConfig(host_ip='127.0.0.1', host_port=0))\n"
        "try:\n"
        "    assert P2P.receive_raw_data is receive_bounded\n"
        "    assert dht.run_coroutine(_child) is True\n"
        "finally:\n"
        "    dht.shutdown()\n"
    )
    child = (
        "async def _child(dht, node):\n"  # runs in the DHT's own (forked) process
        "    from hivemind.p2p import P2P\n"
        "    from swarm.hivemind_fixes.messages import receive_bounded\n"
        "    return P2P.receive_raw_data is receive_bounded\n"
    )
    done = subprocess.run([sys.executable, "-c", child + check], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_an_averager_process_installs_its_fixes_whatever_started_its_dht():
    """``PseudoGradientAverager._run_internal`` installs them as the averager process starts (an embedder's plain
    ``hivemind.DHT`` never went through ``start_dht``). In a fresh interpreter, where nothing installed them."""
    check = (
        "from hivemind.averaging.matchmaking import Matchmaking\n"
        "from hivemind.p2p import P2P\n"
        "from swarm.hivemind_fixes import group_ids, messages\n"
        "from swarm.hivemind_fixes.averaging import fix_averager_process\n"
        "assert P2P.receive_raw_data is not messages.receive_bounded\n"
        "fix_averager_process()\n"
        "assert P2P.receive_raw_data is messages.receive_bounded\n"
        "assert Matchmaking.follower_assemble_group is group_ids._follower_assemble_group\n"
        "import inspect, swarm.averager.process as process\n"
        "assert 'fix_averager_process()' in inspect.getsource(process.PseudoGradientAverager._run_internal)\n"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
