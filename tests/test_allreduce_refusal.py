"""A groupmate whose parts we refuse is dropped as a reducer too, without waiting for its slice.

Three real all-reduce runners over real libp2p daemons. The liar sends non-finite values, which
every reducer refuses, so its own reducer stalls on its own part and never answers: before the
fix, the honest peers waited out the reducer timeout for a slice they would drop anyway (20 s a
round in the byzantine benchmark's ``nonfinite`` scenario). No reducer timeout is set here, so
an honest runner that waits for the liar's slice never finishes, and the test's bound says so.
"""

from __future__ import annotations

import asyncio

import torch
from hivemind.p2p import P2P

from swarm.averager.allreduce import Dropped, ExactAllReduceRunner, check_parts, decode_into
from swarm.manifest import Aggregation

HANG_GUARD = 60.0  # seconds: a bound on the test, not a speed claim (the runners have no timeout of their own)


async def _run(tensors_by_peer: list[list[torch.Tensor]]) -> tuple[list, list]:
    p2ps = [await P2P.create()]
    maddrs = await p2ps[0].get_visible_maddrs()
    p2ps += await asyncio.gather(*(P2P.create(initial_peers=maddrs) for _ in tensors_by_peer[1:]))
    peers = [p.peer_id for p in p2ps]
    runners = []
    for p2p, tensors in zip(p2ps, tensors_by_peer):
        runner = ExactAllReduceRunner(
            p2p=p2p,
            servicer_type=ExactAllReduceRunner,
            prefix=None,
            group_id=b"refusal-test",
            tensors=[t.clone() for t in tensors],
            ordered_peer_ids=peers,
            peer_fractions=(1.0,) * len(peers),
            part_size_bytes=2048,  # parts of 512 values: every peer reduces a slice of the 4000
            aggregation=Aggregation.mean,  # refusal comes before aggregation, whichever it is
        )
        await runner.add_p2p_handlers(p2p)
        runners.append(runner)

    async def held(runner: ExactAllReduceRunner) -> list:
        return [parts async for parts in runner]

    liar = asyncio.create_task(held(runners[-1]))
    try:
        honest = await asyncio.wait_for(asyncio.gather(*(held(r) for r in runners[:-1])), HANG_GUARD)
    finally:
        liar.cancel()
        await asyncio.gather(liar, return_exceptions=True)
        await asyncio.gather(*(p.shutdown() for p in p2ps))
    return honest, runners


def test_the_slice_of_a_sender_whose_parts_were_refused_is_dropped_at_once():
    torch.manual_seed(0)
    honest = [[torch.randn(3000), torch.randn(40, 25)] for _ in range(2)]
    lie = [torch.randn(3000), torch.randn(40, 25)]
    lie[0][::100] = float("inf")
    lie[1].view(-1)[::100] = float("nan")  # in every part: no part of the liar is averaged
    held_by_peer, runners = asyncio.run(_run([*honest, lie]))

    liar_id = runners[-1].peer_id
    liar_index = runners[-1].ordered_peer_ids.index(liar_id)
    mean = [(a + b) / 2 for a, b in zip(*honest)]
    results = []
    for runner, held in zip(runners, held_by_peer):
        assert runner.refused_senders == {liar_id}
        dropped = sum(p.numel for parts in held for p in parts if isinstance(p, Dropped))
        assert dropped == runner.tensor_part_container.failed_size > 0  # the liar's slice, and only it
        dropped_parts = sum(isinstance(p, Dropped) for parts in held for p in parts)
        assert dropped_parts == runner.tensor_part_container.num_parts_by_peer[liar_index]
        out = [t.clone() for t in runner.tensor_part_container.local_tensors]
        for tensor, parts in zip(out, held):
            check_parts(tensor, parts, runner.tensor_part_container.compression.compression_type)
            decode_into(tensor, parts)
        assert all(bool(t.isfinite().all()) for t in out)
        results.append(torch.cat([t.reshape(-1) for t in out]))
    # both honest peers write the same bits: zeros (no outer step) on the liar's slice, the honest mean elsewhere
    assert torch.equal(results[0], results[1])
    averaged = torch.cat([t.reshape(-1) for t in mean])
    kept = results[0] != 0
    assert torch.allclose(results[0][kept], averaged[kept], atol=1e-6)
    assert kept.float().mean() > 0.5
