"""Robust aggregation (swarm.defence.robust) as pure functions, and the reducer that uses them, in process."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.proto.runtime_pb2 import CompressionType

from swarm.averager.allreduce import decode_part
from swarm.defence.robust import (
    RefusedPart,
    RobustPartReducer,
    _against_the_grain_left_out,
    capped_weights,
    check_part,
    order_rows,
    robust_mean,
    sorted_rows,
)
from swarm.manifest import Aggregation

N = 4096


def honest(count: int, seed: int = 0, spread: float = 0.3) -> list[torch.Tensor]:
    """Correlated pseudo-gradients: a shared direction plus each peer's own noise."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(N, generator=g)
    return [common + spread * torch.randn(N, generator=g) for _ in range(count)]


def mean(parts, weights=None) -> torch.Tensor:
    weights = weights or [1.0] * len(parts)
    return sum(w * p for w, p in zip(weights, parts)) / sum(weights)


def relative_error(x: torch.Tensor, target: torch.Tensor) -> float:
    return float((x - target).norm() / target.norm())


def test_plain_mean_is_the_weighted_mean():
    parts = honest(3)
    out = robust_mean(parts, [1.0, 2.0, 3.0], Aggregation.mean)
    assert torch.allclose(out, mean(parts, [1.0, 2.0, 3.0]), atol=1e-6)


def test_honest_parts_close_together_come_out_near_their_mean():
    parts = honest(4, spread=0.3)
    out = robust_mean(parts, [1.0] * 4, Aggregation.centered_clip)
    assert relative_error(out, mean(parts)) < 0.05


def test_two_honest_parts_are_their_mean():
    parts = honest(2)
    out = robust_mean(parts, [1.0, 1.0], Aggregation.centered_clip)
    assert relative_error(out, mean(parts)) < 1e-3


@pytest.mark.parametrize(
    "lie",
    [
        lambda x: 1000 * x,  # scaled
        lambda x: -4 * x,  # sign-flipped
        lambda x: torch.randn(N, generator=torch.Generator().manual_seed(9)) * 10 * x.norm() / math.sqrt(N),
        lambda x: torch.full_like(x, 50.0),  # constant
    ],
    ids=["scaled", "sign-flipped", "random", "constant"],
)
@pytest.mark.parametrize("group", [3, 4])
def test_one_liar_moves_the_result_little(lie, group):
    parts = honest(group)
    honest_mean = mean(parts[:-1])
    attacked = parts[:-1] + [lie(parts[-1])]
    plain = robust_mean(attacked, [1.0] * group, Aggregation.mean)
    robust = robust_mean(attacked, [1.0] * group, Aggregation.centered_clip)
    assert relative_error(robust, honest_mean) < 0.5
    assert relative_error(robust, honest_mean) < relative_error(plain, honest_mean) / 2


def test_an_inflated_weight_is_capped_at_the_median():
    assert capped_weights([10.0, 12.0, 1e9]).tolist() == [10.0, 12.0, 12.0]
    assert capped_weights([10.0, 12.0, 11.0, 1e9]).tolist() == [10.0, 12.0, 11.0, 12.0]
    assert capped_weights([25.0, 145.0]).tolist() == [25.0, 145.0]  # a slow peer and a fast one: as they are
    parts = honest(3)
    attacked = parts[:2] + [-parts[2]]
    out = robust_mean(attacked, [10.0, 10.0, 1e9], Aggregation.centered_clip)
    assert float(torch.dot(out, mean(parts[:2]))) > 0  # still points the honest way


@pytest.mark.parametrize(
    "values, weight, why",
    [
        (torch.tensor([1.0, float("nan"), 0.0]), 1.0, "NaN"),
        (torch.tensor([1.0, float("inf"), 0.0]), 1.0, "NaN or infinite"),
        (torch.zeros(2), 1.0, "2 values"),
        (torch.zeros(3), -1.0, "weight"),
        (torch.zeros(3), float("inf"), "weight"),
    ],
)
def test_a_malformed_part_or_weight_is_refused(values, weight, why):
    with pytest.raises(RefusedPart, match=why):
        check_part(values, 3, weight)


def run_reducer(parts: list[torch.Tensor], order: list[int], refuse: int | None = None) -> torch.Tensor:
    """Three senders, one part each, arriving in ``order``; ``refuse``'s part is NaN and its stream fails."""

    async def main() -> torch.Tensor:
        reducer = RobustPartReducer([torch.Size([N])], len(parts), Aggregation.centered_clip)

        async def send(i: int) -> torch.Tensor | None:
            await asyncio.sleep(0.01 * order.index(i))
            values = torch.full((N,), float("nan")) if i == refuse else parts[i]
            try:
                return await reducer.accumulate_part(i, 0, values, weight=1.0)
            except RefusedPart:
                reducer.on_sender_failed(i)  # what the all-reduce runner does when a stream breaks
                return None

        results = await asyncio.wait_for(asyncio.gather(*(send(i) for i in range(len(parts)))), timeout=10)
        return next(r for r in results if r is not None)

    return asyncio.run(main())


def test_the_reducer_gives_the_same_bits_whatever_order_parts_arrive_in():
    parts = honest(3)
    first = run_reducer(parts, [0, 1, 2])
    assert torch.equal(first, run_reducer(parts, [2, 0, 1]))
    assert torch.equal(first, robust_mean(parts, [1.0] * 3, Aggregation.centered_clip))


def test_the_reducer_drops_a_refused_sender_and_finishes_without_it():
    parts = honest(3)
    out = run_reducer(parts, [0, 2, 1], refuse=2)
    assert torch.equal(out, robust_mean(parts[:2], [1.0, 1.0], Aggregation.centered_clip))


def test_a_sender_whose_stream_ends_while_it_waits_for_a_part_holds_nobody_up():
    """hivemind's p2p cancels a sender's handler task when its stream ends (the sender was killed), while the task
    awaits the part's one future: that cancel must not cancel the future, which the other senders and the reducer's
    own slice await. Before, the reducer's own slice never came back (a survivor waited out its hard timeout, 128 s)
    and the next sender's part failed on the cancelled future, so every groupmate dropped the whole slice."""
    parts = [honest(3, seed=s) for s in (1, 2)]  # two parts per sender

    async def main():
        reducer = RobustPartReducer([torch.Size([N])] * 2, 3, Aggregation.centered_clip)

        async def send(i: int) -> list[torch.Tensor]:
            out = []
            try:
                for k in range(2):
                    out.append(await reducer.accumulate_part(i, k, parts[k][i], weight=1.0))
                return out
            finally:
                if len(out) != 2:
                    reducer.on_sender_failed(i)  # what the runner's ban does, from the handler's finally

        own, victim = asyncio.create_task(send(0)), asyncio.create_task(send(2))
        await asyncio.sleep(0.01)  # both wait for the first part's last sender
        victim.cancel()  # its stream ended
        await asyncio.sleep(0.01)
        assert not own.done()  # still waiting for sender 1, not cancelled with the victim
        return await asyncio.wait_for(asyncio.gather(own, send(1)), timeout=10)

    (first0, second0), (first1, second1) = asyncio.run(main())
    assert torch.equal(first0, first1) and torch.equal(second0, second1)  # every sender gets the same bits
    # the victim's first part was in before it failed; its second never came and is not waited for
    assert torch.equal(first0, robust_mean(parts[0], [1.0] * 3, Aggregation.centered_clip))
    assert torch.equal(second0, robust_mean(parts[1][:2], [1.0] * 2, Aggregation.centered_clip))


def test_a_sender_that_goes_silent_without_failing_is_left_out_after_the_straggler_timeout():
    """A sender whose handler was abandoned (cancelled at its yield while sending an average back: nothing calls
    ``on_sender_failed`` until the generator is collected) sends no more parts: the others' parts go on without it
    once they waited ``straggler_timeout``, all with the same result, and its late finally changes nothing."""
    parts = [honest(3, seed=s) for s in (3, 4)]

    async def main():
        reducer = RobustPartReducer([torch.Size([N])] * 2, 3, Aggregation.centered_clip, straggler_timeout=0.2)

        async def send(i: int, count: int) -> list[torch.Tensor]:
            return [await reducer.accumulate_part(i, k, parts[k][i], weight=1.0) for k in range(count)]

        silent = asyncio.create_task(send(2, 1))  # its first part, then nothing: no error, no failure
        results = await asyncio.wait_for(asyncio.gather(send(0, 2), send(1, 2)), timeout=10)
        await silent
        reducer.on_sender_failed(2)  # its handler's finally, much later: once is enough
        assert reducer.num_current_senders == 2
        return results

    (first0, second0), (first1, second1) = asyncio.run(main())
    assert torch.equal(first0, first1) and torch.equal(second0, second1)
    assert torch.equal(first0, robust_mean(parts[0], [1.0] * 3, Aggregation.centered_clip))
    assert torch.equal(second0, robust_mean(parts[1][:2], [1.0] * 2, Aggregation.centered_clip))


@pytest.mark.parametrize("group", [3, 4, 5])
def test_one_liar_cannot_drag_any_coordinate_outside_what_the_honest_peers_sent(group):
    """Outside the honest values, or zero (norm clipping scales an honest part towards zero at most)."""
    parts = honest(group - 1, spread=1.0)
    liar = -100 * mean(parts)  # far away, and against the honest direction
    out = robust_mean([*parts, liar], [1.0] * group, Aggregation.centered_clip)
    stacked = torch.stack([*parts, torch.zeros(N)])  # norm clipping may scale an honest part towards zero
    assert bool(((out >= stacked.min(0).values - 1e-6) & (out <= stacked.max(0).values + 1e-6)).all())
    assert float(torch.dot(out, mean(parts))) > 0


def test_a_part_against_the_grain_is_left_out_and_the_honest_mean_remains():
    g = torch.Generator().manual_seed(3)
    common = torch.randn(4096, generator=g)
    honest = [common + 0.5 * torch.randn(4096, generator=g) for _ in range(2)]
    for liar in (-4 * honest[0], -0.1 * honest[1], -honest[0] * 1000):
        result = robust_mean([*honest, liar], [1.0, 1.0, 1.0], Aggregation.centered_clip)
        # the liar counts for nothing: the result points where the two honest parts' mean does
        assert torch.nn.functional.cosine_similarity(result, (honest[0] + honest[1]) / 2, dim=0) > 0.999
        # and the step is not shrunk (the coordinate-wise median with the liar in it is about half as long)
        assert result.norm() > 0.95 * ((honest[0] + honest[1]) / 2).norm()
        assert torch.stack([*honest, liar]).median(dim=0).values.norm() < 0.9 * result.norm()
    # a majority against the grain is not left out (two of three): the median decides as before
    two_liars = robust_mean([honest[0], -honest[0], -honest[1]], [1.0, 1.0, 1.0], Aggregation.centered_clip)
    assert torch.isfinite(two_liars).all()


@pytest.mark.parametrize("group", [3, 4])
def test_a_negated_part_is_left_out_even_when_the_honest_parts_agree_only_weakly(group):
    """Two peers' H-step updates on different data agree weakly (cosine ~0.1 here). The coordinate-wise median
    of three then follows the liar wherever the honest two differ in sign, so a liar sending -4x its own honest
    update had a positive cosine with that median and was kept (the result's cosine with the honest peers'
    own result was 0.73 with three, 0.81 with four); pairwise, it agrees with nobody and counts for nothing."""
    g = torch.Generator().manual_seed(5)
    common = torch.randn(N, generator=g)
    own = [common + 3.0 * torch.randn(N, generator=g) for _ in range(group)]  # pairwise cosine ~0.1
    without_liar = robust_mean(own[:-1], [1.0] * (group - 1), Aggregation.centered_clip)
    for liar in (-4 * own[-1], -0.1 * own[-1], -1000 * own[-1]):
        result = robust_mean([*own[:-1], liar], [1.0] * group, Aggregation.centered_clip)
        assert torch.nn.functional.cosine_similarity(result, without_liar, dim=0) > 0.999
        assert 0.98 < float(result.norm() / without_liar.norm()) < 1.02
    # weakly agreeing honest peers are all kept
    stacked = torch.stack(own)
    kept, _ = _against_the_grain_left_out(stacked, torch.full((group,), 1 / group))
    assert kept.shape[0] == group


def test_a_part_whose_bytes_do_not_decode_is_refused_not_raised():
    """A sender's bytes are decoded before anything else: garbage gives RefusedPart (its sender is then banned by
    the reducer that saw it), an honest fp16 part its values."""
    good = serialize_torch_tensor(torch.arange(6.0), CompressionType.FLOAT16)
    values, weight, _ = decode_part(averaging_pb2.AveragingData(tensor_part=good, weight=2.0), 6, good.compression)
    assert torch.equal(values, torch.arange(6.0)) and weight == 2.0
    bad = runtime_pb2.Tensor()
    bad.CopyFrom(good)
    bad.buffer = good.buffer[:-3]  # not a whole number of fp16 values
    refused, _, _ = decode_part(averaging_pb2.AveragingData(tensor_part=bad, weight=1.0), 6, good.compression)
    assert isinstance(refused, RefusedPart) and "could not be decoded" in str(refused)
    # a part of more values than its reducer expects is refused before it is decoded
    longer, _, _ = decode_part(averaging_pb2.AveragingData(tensor_part=good, weight=1.0), 5, good.compression)
    assert isinstance(longer, RefusedPart) and "6 values where 5 are expected" in str(longer)


def reference_robust_mean(parts: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """The module's steps written out directly, one pass over the data per CenteredClip iteration (as the
    client computed them until the iterations moved to the Gram matrix)."""
    w = capped_weights(weights)
    w = (w / w.sum()).float()
    stacked = torch.stack(parts)
    norms = stacked.norm(dim=1)
    stacked = stacked * torch.clamp(norms.median() / norms.clamp_min(1e-30), max=1.0)[:, None]
    if len(parts) > 2:
        unit = stacked / stacked.norm(dim=1, keepdim=True).clamp_min(1e-30)
        keep = ((unit @ unit.T).fill_diagonal_(0.0) > 0).any(dim=1)
        if len(parts) > int(keep.sum()) > len(parts) / 2:
            stacked, w = stacked[keep], w[keep] / w[keep].sum()
    center = stacked.median(dim=0).values if len(stacked) > 2 else (stacked * w[:, None]).sum(0)
    tau = (stacked - center).norm(dim=1).median()
    for _ in range(5):
        diff = stacked - center
        center = center + (diff * (w * torch.clamp(tau / diff.norm(dim=1).clamp_min(1e-30), max=1.0))[:, None]).sum(0)
    if len(stacked) <= 2:
        return center
    ordered = stacked.sort(dim=0).values
    return torch.minimum(torch.maximum(center, ordered[1]), ordered[-2])


@pytest.mark.parametrize("group", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("spread", [0.01, 0.3, 3.0])
def test_the_gram_matrix_iterations_give_what_one_pass_per_iteration_gives(group, spread):
    """Honest groups of every closeness, and each with a liar of each kind: the reducer's result is the
    reference's to float32 rounding (the distances now come from a float64 Gram matrix, not float32 norms)."""
    parts = honest(group, seed=group, spread=spread)
    weights = [float(10 + i) for i in range(group)]
    for liar in (None, -4.0, 1000.0, 0.0):
        attacked = parts if liar is None else [*parts[:-1], liar * parts[-1]]
        result = robust_mean(attacked, weights, Aggregation.centered_clip)
        expected = reference_robust_mean(attacked, weights)
        # (in a group of two a zero part clips both to norm 0: both are then exactly zero)
        assert float((result - expected).norm()) <= 1e-5 * float(expected.norm()), (liar, result, expected)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16, 17])
def test_sorted_rows_are_torch_sort_along_the_rows_exactly(rows):
    g = torch.Generator().manual_seed(rows)
    stacked = torch.randn(rows, 1000, generator=g).round(decimals=1)  # ties included
    assert torch.equal(torch.stack(sorted_rows(stacked)), stacked.sort(dim=0).values)


def test_identical_parts_come_out_as_they_went_in():
    part = honest(1)[0]
    assert torch.equal(robust_mean([part] * 4, [1.0] * 4, Aggregation.centered_clip), part)


def test_the_result_does_not_depend_on_how_many_threads_compute_it():
    """A groupmate recomputes a reducer's result to audit it, with its own thread count: bitwise the same here
    (across CPUs, only the float64 sums' last bits may differ; the values are combined elementwise)."""
    g = torch.Generator().manual_seed(3)
    common = torch.randn(1 << 18, generator=g)
    parts = [common + 0.5 * (i + 1) * torch.randn(1 << 18, generator=g) for i in range(4)]
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(robust_mean(parts, [100.0, 101.0, 102.0, 103.0], Aggregation.centered_clip))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])


# ---- the same values with less memory: the order statistics a block at a time, the parts' own rows as work space


def whole_sort_robust_mean(parts, weights, keep=None) -> torch.Tensor:
    """``robust_mean`` as it was before ``order_rows``: a copy of the parts sorted whole, and the parts kept copied
    out by a mask. Every value of the new one must be this one's (``torch.equal``: a zero's sign may differ where a
    block's end moves the tail of torch's vectorised minimum) (groupmates and auditors on another
    version of this code compare averages)."""
    from swarm.defence import robust

    w = capped_weights(weights)
    stacked = torch.stack(list(parts))
    w = (w / w.sum()).float()
    gram = robust._gram64(stacked)
    norms = gram.diagonal().clamp_min(0).sqrt()
    stacked.mul_(torch.clamp(robust.CLIP_FACTOR * norms.median() / norms.clamp_min(1e-30), max=1.0).float()[:, None])
    if len(parts) > 2:
        if keep is None:
            keep = (robust._cosines(gram) > 0).any(dim=1)
        kept = int(keep.sum())
        if kept != len(stacked) and 2 * kept > len(stacked):
            stacked, w = stacked[keep], w[keep] / w[keep].sum()
    if len(stacked) <= 2:
        return robust._centered_clip(stacked, w, robust._combination(torch.zeros_like(stacked[0]), stacked, w))
    ordered = sorted_rows(stacked)
    center = robust._centered_clip(stacked, w, ordered[(len(ordered) - 1) // 2])
    return center.clamp_(min=ordered[1], max=ordered[-2])


@pytest.mark.parametrize("group", [3, 4, 5, 8, 17])
@pytest.mark.parametrize("liar", [None, -4.0, 1000.0, 0.0])
def test_the_average_holds_the_values_a_whole_sort_made(group, liar):
    size = (1 << 18) + 1000 if group == 5 else 3000  # more than one block of ``order_rows`` in one case
    g = torch.Generator().manual_seed(group)
    common = torch.randn(size, generator=g)
    parts = [common + 0.5 * torch.randn(size, generator=g) for _ in range(group)]
    if liar is not None:
        parts[-1] = liar * parts[-1]
    weights = [float(10 + i) for i in range(group)]
    expected = whole_sort_robust_mean(parts, weights)
    assert torch.equal(robust_mean(parts, weights, Aggregation.centered_clip), expected)
    rows = torch.stack(parts)  # the parts' own rows as its work space: the same bits again
    assert torch.equal(robust_mean(rows, weights, Aggregation.centered_clip), expected)
    keep = torch.ones(group, dtype=torch.bool)
    keep[0] = False  # a check's other way of keeping them
    assert torch.equal(
        robust_mean(parts, weights, Aggregation.centered_clip, keep=keep), whole_sort_robust_mean(parts, weights, keep)
    )


@pytest.mark.parametrize("rows", [3, 5, 16, 17])
def test_order_rows_are_the_rows_of_a_whole_sort(rows):
    g = torch.Generator().manual_seed(rows)
    stacked = torch.randn(rows, 1000, generator=g).round(decimals=1)  # ties included
    ranks = (1, (rows - 1) // 2, rows - 2)
    whole = stacked.sort(dim=0).values
    for chunk in (7, 256, 1 << 18):
        assert [r.tolist() for r in order_rows(stacked, ranks, chunk)] == [whole[r].tolist() for r in ranks]
