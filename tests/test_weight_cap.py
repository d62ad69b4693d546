"""A sender's weight is capped at what a round can hold, in a group of any size, two included.

Two real all-reduce runners over real libp2p daemons: an honest peer sends its pseudo-gradient ``h`` with the
samples of a whole round, a liar sends ``-4 h`` and claims 1000 times as many. CenteredClip's weight cap is the
group's (upper) median, which in a group of two is the liar's own claim, so without the round's cap the average is
the negated honest update. With it the liar weighs as much as the honest peer and the norm clip holds its part to
the honest one's size: it can cancel the honest update (in a pair nobody can tell which one lies), never turn it.
"""

from __future__ import annotations

import asyncio
import math

import torch

from swarm.averager.allreduce import ExactAllReduceRunner
from swarm.averager.held import check_parts, decode_into
from swarm.manifest import Aggregation
from tests.keyed_p2p import keyed_p2ps

ROUND = 32.0 * 10  # samples_per_step x inner_steps: the most samples a round holds
HANG_GUARD = 60.0


async def _average(tensors_by_peer: list[torch.Tensor], weights: list[float], max_weight: float) -> list:
    p2ps, keys = await keyed_p2ps(len(tensors_by_peer))
    peers = [p.peer_id for p in p2ps]
    runners = []
    for p2p, key, tensor, weight in zip(p2ps, keys, tensors_by_peer, weights):
        runner = ExactAllReduceRunner(
            p2p=p2p,
            servicer_type=ExactAllReduceRunner,
            prefix=None,
            group_id=b"weight-cap-test",
            tensors=[tensor.clone()],
            ordered_peer_ids=peers,
            peer_fractions=(1.0,) * len(peers),
            weight=weight,
            part_size_bytes=2048,
            aggregation=Aggregation.centered_clip,
            max_weight=max_weight,
            signing_key=key,
        )
        await runner.add_p2p_handlers(p2p)
        runners.append(runner)

    async def result(runner: ExactAllReduceRunner) -> torch.Tensor:
        held = [parts async for parts in runner]
        out = runner.tensor_part_container.local_tensors[0].clone()
        check_parts(out, held[0], runner.tensor_part_container.compression.compression_type)
        decode_into(out, held[0])
        return out

    try:
        return await asyncio.wait_for(asyncio.gather(*(result(r) for r in runners)), HANG_GUARD)
    finally:
        await asyncio.gather(*(p.shutdown() for p in p2ps))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a, b) / (a.norm() * b.norm()).clamp_min(1e-30))


def test_a_liar_claiming_1000x_the_samples_cannot_negate_its_partners_update_in_a_group_of_two():
    honest = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    tensors, weights = [honest, -4 * honest], [ROUND, 1000 * ROUND]
    # without the round's cap (as before): the liar's claim is the pair's median, and the average is -h
    uncapped = asyncio.run(_average(tensors, weights, math.inf))
    assert cosine(uncapped[0], honest) < -0.9 and torch.equal(uncapped[0], uncapped[1])
    # with it: both weigh a round; the liar's part is clipped to h's norm, so the average cancels, never turns
    capped = asyncio.run(_average(tensors, weights, ROUND))
    assert torch.equal(capped[0], capped[1])  # groupmates still agree bitwise
    assert float(capped[0].norm()) < 0.05 * float(honest.norm()), float(capped[0].norm())
    # an honest pair of unequal rounds (a slow peer's early end) keeps its weights under the cap
    slow = torch.randn(3000, generator=torch.Generator().manual_seed(1))
    fair = asyncio.run(_average([honest, slow], [ROUND, ROUND / 4], ROUND))
    assert cosine(fair[0], honest) > cosine(fair[0], slow)  # the full round counts for more
