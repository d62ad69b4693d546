"""A groupmate whose parts we refuse is dropped as a reducer too, without waiting for its slice.

Three real all-reduce runners over real libp2p daemons. The liar sends non-finite values, which
every reducer refuses, so its own reducer stalls on its own part and never answers: before the
fix, the honest peers waited out the reducer timeout for a slice they would drop anyway (20 s a
round in the byzantine benchmark's ``nonfinite`` scenario). No reducer timeout is set here, so
an honest runner that waits for the liar's slice never finishes, and the test's bound says so.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from swarm.averager.allreduce import ExactAllReduceRunner
from swarm.averager.held import Dropped, check_parts, decode_into
from swarm.defence.receipts import digest_of
from swarm.defence.robust import RefusedPart
from swarm.defence.statements import Statement, vouches
from swarm.manifest import Aggregation
from tests.keyed_p2p import keyed_p2ps

HANG_GUARD = 60.0  # seconds: a bound on the test, not a speed claim (the runners have no timeout of their own)


async def _run(tensors_by_peer: list[list[torch.Tensor]], liar_type=ExactAllReduceRunner) -> tuple[list, list]:
    p2ps, keys = await keyed_p2ps(len(tensors_by_peer))
    peers = [p.peer_id for p in p2ps]
    runners = []
    for i, (p2p, key, tensors) in enumerate(zip(p2ps, keys, tensors_by_peer)):
        runner_type = liar_type if i == len(p2ps) - 1 else ExactAllReduceRunner
        runner = runner_type(
            p2p=p2p,
            servicer_type=ExactAllReduceRunner,
            prefix=None,
            group_id=b"refusal-test",
            tensors=[t.clone() for t in tensors],
            ordered_peer_ids=peers,
            peer_fractions=(1.0,) * len(peers),
            part_size_bytes=2048,  # parts of 512 values: every peer reduces a slice of the 4000
            aggregation=Aggregation.mean,  # refusal comes before aggregation, whichever it is
            signing_key=key,
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


class Unsigned(ExactAllReduceRunner):
    """Sends its parts without its signed statement of what it sent."""

    async def _record_sent(self, peer_index, stream):
        async for message in super()._record_sent(peer_index, stream):
            message.peer_id = b""
            yield message


class ForgedStatement(ExactAllReduceRunner):
    """Signs a statement of other parts than it sent (a receipt listing them would then be another's lie)."""

    async def _record_sent(self, peer_index, stream):
        async for message in super()._record_sent(peer_index, stream):
            if message.peer_id:
                reducer = self.ordered_peer_ids[peer_index].to_base58()
                statement = Statement(self.group_id, reducer, b"\0" * 32, float(message.weight), 1)
                message.peer_id = statement.sign(self.signing_key)
            yield message


class TwoWeights(ExactAllReduceRunner):
    """Declares twice its weight for its first part to each reducer, and its own weight for the rest."""

    async def _record_sent(self, peer_index, stream):
        first = True
        async for message in super()._record_sent(peer_index, stream):
            if first:
                message.weight *= 2
                first = False
            yield message


class NaNWeightLater(ExactAllReduceRunner):
    """Declares its weight for its first part to each reducer, and NaN for the rest (kept for a receipt, a weight no
    audit could pass would frame its honest reducer)."""

    async def _record_sent(self, peer_index, stream):
        first = True
        async for message in super()._record_sent(peer_index, stream):
            if not first:
                message.weight = float("nan")
            first = False
            yield message


@pytest.mark.parametrize("liar_type", [Unsigned, ForgedStatement, TwoWeights, NaNWeightLater], ids=lambda t: t.__name__)
def test_a_sender_whose_statement_or_weight_does_not_say_what_it_sent_is_refused(liar_type):
    """Every reducer keeps, for its receipt, each sender's signed statement of the digest and weight it sent
    (``swarm.defence.statements``); a sender without one that says what it sent is refused, as one whose weight
    changes between parts (a receipt lists one weight a sender, so such a part would fail an honest reducer's
    audit)."""
    torch.manual_seed(1)
    tensors = [[torch.randn(3000), torch.randn(40, 25)] for _ in range(3)]
    held_by_peer, runners = asyncio.run(_run(tensors, liar_type))
    liar, honest = runners[-1], runners[:-1]
    results = []
    for runner, held in zip(honest, held_by_peer):
        assert runner.refused_senders == {liar.peer_id}, liar_type
        out = [t.clone() for t in runner.tensor_part_container.local_tensors]
        for tensor, parts in zip(out, held):
            check_parts(tensor, parts, runner.tensor_part_container.compression.compression_type)
            decode_into(tensor, parts)
        results.append(torch.cat([t.reshape(-1) for t in out]))
        me, counts, full = runner.peer_id.to_base58(), runner.counted_parts(), runner.tensor_part_reducer.num_parts
        for index, sender in enumerate(runner.sender_peer_ids):
            if sender == liar.peer_id:  # refused at the part that lied: its statement then counted none after it
                assert counts[index] < full and math.isfinite(runner.input_weights[index])
                assert len(runner.input_digests[index]) <= counts[index] + 1
                continue
            assert counts[index] == full  # every part of the honest senders, in the average
            if sender == runner.peer_id:
                continue
            digest = digest_of(runner.input_digests[index])
            statement = runner.statement_of(index, counts[index])
            assert vouches(statement, sender.to_base58(), b"refusal-test", me, digest, runner.weight, full)
    assert torch.equal(results[0], results[1])  # the honest pair still ends on the same bits


def test_a_second_stream_from_one_sender_is_refused_before_anything_of_it_is_kept():
    """hivemind lets a sender open two streams to a reducer; their parts interleaved would make the digests we keep
    run ahead of the parts counted (and a statement under our receipt go missing). The second is refused, and the
    sender with it."""

    async def run():
        p2ps, keys = await keyed_p2ps(2)
        try:
            peers = [p.peer_id for p in p2ps]
            runner = ExactAllReduceRunner(
                p2p=p2ps[0], servicer_type=ExactAllReduceRunner, prefix=None, group_id=b"refusal-test",
                tensors=[torch.zeros(100)], ordered_peer_ids=peers, peer_fractions=(1.0, 1.0),
                aggregation=Aggregation.mean, signing_key=keys[0],
            )  # fmt: skip
            index = runner.sender_peer_ids.index(peers[1])
            runner._streaming.add(index)  # its first stream is open

            async def nothing():
                return
                yield

            with pytest.raises(RefusedPart):
                async for _ in runner._accumulate_parts_streaming(nothing(), index):
                    pass
            return runner, peers[1], index
        finally:
            await asyncio.gather(*(p.shutdown() for p in p2ps))

    runner, sender, index = asyncio.run(run())
    assert runner.refused_senders == {sender} and runner.input_digests[index] == []
    assert runner.tensor_part_reducer.sender_failed_after[index] == 0
