"""An outsider to a closed run, as its own process: it knows a peer's address, the run id (which is printed
in the join line, so it may leak) and the preset, but not the secret. It tries every way in and prints one
JSON object saying what each attempt got.

    python tests/outsider.py MADDR RUN_ID [--token-secret-file FILE]

``--token-secret-file`` makes its state-download request carry a token made with that secret, so a test can
show that the refusal it sees without one is the token check and not something else.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hivemind  # noqa: E402
import torch  # noqa: E402
from hivemind.averaging.averager import compute_schema_hash  # noqa: E402
from hivemind.p2p import P2P, PeerID  # noqa: E402
from hivemind.proto import averaging_pb2  # noqa: E402
from hivemind.utils import get_dht_time  # noqa: E402
from hivemind.utils.serializer import MSGPackSerializer  # noqa: E402

from client.model import parameter_shapes  # noqa: E402
from client.presets import build_manifest  # noqa: E402
from swarm.averager.process import PseudoGradientAverager, epoch_group_bits, wire_schema_hash  # noqa: E402
from swarm.dht.access import RunSecret  # noqa: E402
from swarm.dht.records import run_prefix  # noqa: E402

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def read_the_dht(maddr: str) -> str:
    try:
        dht = hivemind.DHT(initial_peers=[maddr], host_maddrs=LOOPBACK, start=True, startup_timeout=8)
    except Exception as e:  # what an outsider sees: the bootstrap fails
        return f"refused: {type(e).__name__}"
    dht.shutdown()
    return "joined"


async def try_the_averager(maddr: str, run_id: str, token_secret: RunSecret | None, download_only: bool) -> dict:
    p2p = await P2P.create(initial_peers=[maddr], host_maddrs=LOOPBACK)
    peer = PeerID.from_base58(maddr.split("/p2p/")[1])
    stub = PseudoGradientAverager.get_stub(p2p, peer, namespace=run_prefix(run_id))
    out = {}
    if not download_only:
        out = await try_to_join(stub, run_id)
    out["download_bytes"] = await try_to_download(stub, p2p, peer, token_secret)
    await p2p.shutdown()
    return out


async def try_to_join(stub, run_id: str) -> dict:
    # the schema hash this peer would have in an open run of the same preset
    shapes = parameter_shapes(build_manifest("tiny", None, []))
    schema = wire_schema_hash(compute_schema_hash([torch.zeros(s) for s in shapes]))
    join_codes: list[str] = []
    loop = asyncio.get_event_loop()
    deadline = loop.time() + 90
    while loop.time() < deadline:  # the peer answers NOT_LOOKING_FOR_GROUP until its round's matchmaking
        request = averaging_pb2.JoinRequest(
            schema_hash=schema,
            expiration=get_dht_time() + 10,
            gather=b"",
            group_key=f"{run_prefix(run_id)}.0b{epoch_group_bits(0)}",
        )
        try:
            stream = await stub.rpc_join_group(request)
            message = await asyncio.wait_for(anext(aiter(stream)), 10)
            code = averaging_pb2.MessageCode.Name(message.code)
        except Exception as e:
            code = f"error: {type(e).__name__}"
        if not join_codes or join_codes[-1] != code:
            join_codes.append(code)
        if code != "NOT_LOOKING_FOR_GROUP":
            break
        await asyncio.sleep(0.3)

    async def one_part():
        yield averaging_pb2.AveragingData(group_id=secrets.token_bytes(20), weight=1.0)

    try:
        stream = await stub.rpc_aggregate_part(one_part())
        message = await asyncio.wait_for(anext(aiter(stream)), 5)
        aggregate = averaging_pb2.MessageCode.Name(message.code)
    except Exception as e:
        aggregate = f"error: {type(e).__name__}"
    return dict(join=join_codes, aggregate=aggregate)


async def try_to_download(stub, p2p, peer, token_secret: RunSecret | None) -> int | str:
    fields = {}
    if token_secret is not None:
        fields["token"] = token_secret.transfer_token(p2p.peer_id.to_bytes(), peer.to_bytes())
    received = 0
    try:
        request = averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(fields))
        stream = await stub.rpc_download_state(request)
        async for message in stream:
            received += len(message.tensor_part.buffer)
    except Exception as e:
        received = f"error: {type(e).__name__}"
    return received


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("maddr")
    parser.add_argument("run_id")
    parser.add_argument("--token-secret-file", type=Path, default=None)
    parser.add_argument("--download-only", action="store_true")
    args = parser.parse_args()
    token_secret = RunSecret.from_file(args.token_secret_file) if args.token_secret_file else None
    out = {} if args.download_only else dict(dht=read_the_dht(args.maddr))
    out.update(asyncio.run(try_the_averager(args.maddr, args.run_id, token_secret, args.download_only)))
    print(json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
