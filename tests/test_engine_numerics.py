"""The swarm's outer rounds against a plain single-process DiLoCo.

Three peers run as separate processes on 127.0.0.1 and must form one group every
round (min_group_size=3) after exactly H inner steps (no early joining), so the swarm computes
exactly what the reference does.
"""

from __future__ import annotations

import time

import pytest
import torch
from diloco_helpers import inner_step, make_batch, make_model, make_optimizer, tiny_manifest

from swarm import RunManifest, seeded_init
from swarm.averager.codecs import apply_error_feedback
from swarm.averager.fp4 import fp4_decode, fp4_encode
from swarm.averager.sparse import sparse_decode, sparse_encode_average
from swarm.manifest import StandIn
from swarm.round.landing import DAMP_FROM_STEPS
from swarm.state.outer import OuterState

ROUNDS = 3
RANKS = (0, 1, 2)


def reference_diloco(manifest: RunManifest, ranks, rounds: int) -> list[torch.Tensor]:
    """DiLoCo as in the paper: H AdamW steps per worker, mean pseudo-gradient, outer SGD with Nesterov.
    (Overlapped rounds and lossy codecs: ``reference_overlapped`` below.)"""
    torch.set_num_threads(1)
    with seeded_init(manifest):
        global_model = make_model(manifest)
    outer_params = [torch.nn.Parameter(p.detach().clone()) for p in global_model.parameters()]
    outer_opt = torch.optim.SGD(
        outer_params, lr=manifest.outer.lr, momentum=manifest.outer.momentum, nesterov=manifest.outer.nesterov
    )
    workers = []
    for _ in ranks:
        with seeded_init(manifest):
            model = make_model(manifest)
        workers.append((model, make_optimizer(model, manifest)))
    for epoch in range(rounds):
        deltas = []
        for rank, (model, optimizer) in zip(ranks, workers):
            with torch.no_grad():
                for p, g in zip(model.parameters(), outer_params):
                    p.copy_(g)
            for step in range(manifest.inner_steps):
                inner_step(model, optimizer, make_batch(rank, epoch, step))
            deltas.append([g.detach() - p.detach() for g, p in zip(outer_params, model.parameters())])
        for i, param in enumerate(outer_params):
            param.grad = torch.stack([d[i] for d in deltas]).mean(0)
        outer_opt.step()
        outer_opt.zero_grad()
    return [p.detach() for p in outer_params]


SETTLE = 1  # overlapped rounds: the average is applied after this many inner steps of the next round


def reference_overlapped(manifest: RunManifest, ranks, rounds: int, settle: int = SETTLE) -> list[torch.Tensor]:
    """The same algorithm in one process, as the swarm runs it with ``--settle-at-step settle``: at each
    round's end every worker's pseudo-gradient (with error feedback for a lossy codec) is averaged, the
    reducer's average goes through the codec, each worker restarts at once from the global model moved by
    its own pseudo-gradient's step (its stand-in, in bf16) and keeps training; ``settle`` steps later the outer
    step lands on the global model, moves each worker's model by the same amount and takes its stand-in
    back (eager updates)."""
    torch.set_num_threads(1)
    codec = manifest.averaging.compression
    with seeded_init(manifest):
        global_params = [p.detach().clone() for p in make_model(manifest).parameters()]
    outer = OuterState(global_params, manifest.outer)
    workers, residuals = [], []
    for _ in ranks:
        with seeded_init(manifest):
            model = make_model(manifest)
        workers.append((model, make_optimizer(model, manifest)))
        residuals.append([torch.zeros_like(p) for p in global_params])
    pending = last_average = None
    kind = manifest.averaging.stand_in
    kept = manifest.averaging.in_flight_steps_kept if settle >= DAMP_FROM_STEPS else 1.0  # damped from 2 late

    stand_ins: list[list[torch.Tensor]] = []

    def land() -> None:
        for (model, _), stand_in in zip(workers, stand_ins):
            with torch.no_grad():
                shifted = [p.detach() for p in model.parameters()]
                before = [g.clone() for g in outer.params]
                outer_copy = OuterState(before, manifest.outer, epoch=outer.epoch)  # the same step, for the shift
                outer_copy.momentum = [m.clone() for m in outer.momentum]
                outer_copy.step(pending, shift=shifted)
                for p, s, new in zip(shifted, stand_in, outer_copy.params):
                    p.sub_(s.float())  # the new global model plus the steps taken since
                    if kept != 1.0:  # plus only that share of them
                        p.sub_(new).mul_(kept).add_(new)
        outer.step(pending)
        return pending

    while outer.epoch < rounds:
        for step in range(manifest.inner_steps):
            if step == settle and pending is not None:
                last_average = land()
                pending = None
                if outer.epoch >= rounds:
                    break
            for rank, (model, optimizer) in zip(ranks, workers):
                inner_step(model, optimizer, make_batch(rank, outer.epoch, step))
        else:
            sent, stand_ins = [], []
            for (model, _), residual in zip(workers, residuals):
                delta = outer.pseudo_gradient(list(model.parameters()))
                # share: the step of our 1/N of the average; blend: plus the last average's for the others'; from
                # the pseudo-gradient before the codec rounds it
                plan = {}
                if last_average is not None and kind == StandIn.share:
                    plan = dict(grad_scale=1 / len(ranks))
                elif last_average is not None and kind == StandIn.blend:
                    plan = dict(blend_into=outer.stand_in(last_average), weight=1 / len(ranks))
                stand_ins.append(outer.stand_in(delta, **plan))
                if codec in ("fp4", "sparse"):
                    apply_error_feedback(delta, residual, codec)
                sent.append(delta)
                outer.write_to(list(model.parameters()))
                with torch.no_grad():
                    for p, s in zip(model.parameters(), stand_ins[-1]):
                        p.add_(s.float())
            mean = [torch.stack([d[i] for d in sent]).mean(0) for i in range(len(global_params))]
            pending = [through_codec(m, codec) for m in mean]
    return [p.clone() for p in outer.params]


def through_codec(average: torch.Tensor, codec: str) -> torch.Tensor:
    """What every groupmate decodes of a reducer's average."""
    flat = average.reshape(-1)
    if codec == "fp4":
        return fp4_decode(fp4_encode(flat), flat.numel()).view(average.shape)
    if codec == "sparse":
        return sparse_decode(sparse_encode_average(flat), flat.numel()).view(average.shape)
    return average


def run_swarm(make_swarm, manifest: RunManifest, extra_args: tuple[str, ...] = (), attempts: int = 2) -> list[dict]:
    """The three peers' final states, from a run in which every round was averaged by all three (what the
    reference computes). Twice in about 30 runs here, in the first round, a groupmate's averager never heard that the
    group had formed (its matchmaking did not return, its parts never left, the other two dropped its third);
    it then took the round's average from them, as a peer that missed a round does. And about once in 15 CI runs
    such a peer was left behind instead: the other two finished, and it went on matching alone (every match
    bounded, but 3 rounds of them outlast the wait below). Once in CI and once in local CI, all three stalled, with no
    cause in their logs (two failed matchmakings in the last minute); each peer's story (its last events, every
    thread's frames, the machine's load) is now printed. None of these is what these tests check, so the run is made
    again, once: after checking that peers which finished agree, or after killing the ones left behind."""
    for attempt in range(attempts):
        swarm = make_swarm(manifest)
        finals = run_swarm_once(swarm, (*extra_args, "--start-with", str(len(RANKS))))
        if isinstance(finals, str):
            print(f"attempt {attempt}: {finals}")
            continue
        reports = [f["reports"] for f in finals]
        if all(r["averaged"] and r["group_size"] == 3 for peer in reports for r in peer):
            return finals
        assert len({f["checksum"] for f in finals}) == 1, reports  # whatever happened, the peers agree
        print(f"attempt {attempt}: not every round was averaged by all three: {reports}")
    raise AssertionError(f"in {attempts} runs, not every round was averaged by all three: {finals}")


def run_swarm_once(swarm, extra_args: tuple[str, ...], timeout: float = 240) -> list[dict] | str:
    """The peers' final states; or, when a peer is still running at the timeout while another has finished, why
    not (that peer was left behind: see run_swarm)."""
    swarm.start(0, ROUNDS, extra_args=extra_args)
    for rank in RANKS[1:]:
        swarm.start(rank, ROUNDS, wait_ready=False, extra_args=extra_args)
    deadline = time.monotonic() + timeout
    stuck = [rank for rank in RANKS if swarm.wait_exit_or_none(rank, max(deadline - time.monotonic(), 1)) is None]
    if len(stuck) == len(RANKS):  # local CI and CI each saw this once in many runs, with no cause in the log: each
        story = "\n".join(f"peer {r}:\n{swarm.log(r)[-1500:]}\n{swarm.diagnose(r)}" for r in RANKS)  # peer's tale
        for rank in RANKS:
            swarm.kill(rank)
        return f"no peer finished in {timeout:.0f} s:\n{story}"
    if stuck:
        finished = {rank: swarm.reports(rank) for rank in RANKS if rank not in stuck}
        for rank in stuck:
            swarm.kill(rank)
        return f"peers {stuck} were left behind by {finished}; log of {stuck[0]}:\n{swarm.log(stuck[0])[-3000:]}"
    for rank in RANKS:
        assert swarm.procs[rank].returncode == 0, swarm.log(rank)
        reports = swarm.reports(rank)
        assert [r["epoch"] for r in reports] == [1, 2, 3], (rank, reports, swarm.log(rank)[-6000:])
    return [dict(swarm.final(rank), reports=swarm.reports(rank)) for rank in RANKS]


def check_traffic(finals: list[dict], num_values: int, bytes_per_value: int) -> None:
    """Every byte sent in a closed group is received by someone (up to averages still in flight), and a
    butterfly all-reduce moves about 2 x bytes_per_value x (k-1)/k per value from each peer (parts out,
    averages back)."""
    k = len(finals)
    for epoch in range(ROUNDS):
        sent = [f["reports"][epoch]["bytes_sent"] for f in finals]
        received = [f["reports"][epoch]["bytes_received"] for f in finals]
        # a reducer's count is read once its own results are in; a last average it is still streaming to a
        # slower groupmate is then counted by the receiver only, so received may exceed sent by that much. And a
        # stream cut on a loaded machine is fetched again whole by the audit's repair (counted as audit bytes,
        # not here): CI once saw one 32x32 tensor's fp16 average (2048 bytes) missing, most likely that way
        assert abs(sum(received) - sum(sent)) <= 0.02 * sum(sent), (sent, received)
        theory = 2 * bytes_per_value * num_values * (k - 1) / k
        assert all(0.8 * theory < s < 1.2 * theory for s in sent), (sent, theory)


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def test_three_peers_match_reference_diloco_without_compression(make_swarm):
    manifest = tiny_manifest(compression="none", min_group_size=3, join_rounds_early=False, aggregation="mean")
    finals = run_swarm(make_swarm, manifest)
    reference = reference_diloco(manifest, RANKS, ROUNDS)
    with seeded_init(manifest):
        initial = [p.detach() for p in make_model(manifest).parameters()]
    assert max_abs_diff(reference, initial) > 1e-2  # training moved the weights: the comparison means something
    for final in finals:
        assert final["epoch"] == ROUNDS
        assert max_abs_diff(final["params"], reference) < 1e-6
    assert len({f["checksum"] for f in finals}) == 1
    check_traffic(finals, sum(t.numel() for t in initial), bytes_per_value=4)


def test_fp16_averaging_stays_close_to_reference_and_peers_agree_bitwise(make_swarm):
    """FP16 rounds each averaged pseudo-gradient to 11 significant bits (relative error <= 2^-11).

    With outer lr 0.7 and Nesterov (factor <= 1 + momentum) that moves a weight by at most
    0.7 * 1.9 * |pseudo-gradient| * 2^-11 per round, about 1e-5 for these sizes; three rounds
    and the inner steps that follow can grow it, so 2e-4 is allowed: still 50x smaller than the
    training's own movement, checked below. All peers must agree exactly.
    """
    manifest = tiny_manifest(compression="fp16", min_group_size=3, join_rounds_early=False, aggregation="mean")
    finals = run_swarm(make_swarm, manifest)
    reference = reference_diloco(manifest, RANKS, ROUNDS)
    with seeded_init(manifest):
        initial = [p.detach() for p in make_model(manifest).parameters()]
    movement = max_abs_diff(reference, initial)
    error = max_abs_diff(finals[0]["params"], reference)
    assert error < 2e-4 and error < movement / 50, (error, movement)
    assert error > 0  # fp16 really was on the wire
    check_traffic(finals, sum(t.numel() for t in initial), bytes_per_value=2)
    assert len({f["checksum"] for f in finals}) == 1
    for final in finals[1:]:
        assert all(torch.equal(a, b) for a, b in zip(final["params"], finals[0]["params"]))


@pytest.mark.parametrize(
    "compression, stand_in, kept, settle",
    [
        ("none", "own", 1.0, SETTLE),
        ("fp4", "own", 1.0, SETTLE),
        ("sparse", "own", 1.0, SETTLE),
        ("fp4", "share", 1.0, SETTLE),
        ("fp4", "blend", 1.0, SETTLE),
        ("fp4", "share", 0.5, 2),  # damped: landing 2 steps late (1 step late keeps every step)
    ],
)
def test_overlapped_rounds_and_codecs_match_the_reference_and_peers_agree_bitwise(
    make_swarm, compression, stand_in, kept, settle
):
    """Overlapped rounds (the outer step lands while the next round trains) with each codec and stand-in, and with the
    steps taken from the stand-in damped when the average lands, against the same algorithm in one process. The reducer
    sums in fp32 in the order parts arrive, so a value on a rounding boundary of the codec can land one level apart from
    the reference; all but a few values must match closely, and groupmates must agree exactly."""
    manifest = tiny_manifest(
        compression=compression,
        min_group_size=3,
        join_rounds_early=False,
        overlap=True,
        aggregation="mean",
        stand_in=stand_in,
        in_flight_steps_kept=kept,
    )
    finals = run_swarm(make_swarm, manifest, extra_args=("--settle-at-step", str(settle)))
    reference = reference_overlapped(manifest, RANKS, ROUNDS, settle)
    with seeded_init(manifest):
        initial = [p.detach() for p in make_model(manifest).parameters()]
    movement = max_abs_diff(reference, initial)
    assert movement > 1e-2
    close = sum(int(((a - b).abs() <= 1e-5 + 1e-3 * b.abs()).sum()) for a, b in zip(finals[0]["params"], reference))
    total = sum(t.numel() for t in initial)
    assert close >= total - 5, (compression, total - close)
    assert len({f["checksum"] for f in finals}) == 1
    for final in finals[1:]:
        assert all(torch.equal(a, b) for a, b in zip(final["params"], finals[0]["params"]))
    if compression != "none":  # what went on the wire: an fp4 value is half a byte, a sparse one less
        # (this model's tensors are mostly smaller than a 4096-value chunk, of which 64 are always sent:
        # the sparse codec's 0.04 bytes per value needs real sizes; benchmarks/wan.py measures it; fp4's
        # deflated codes are about 0.44 per value on real sizes, a little more on these small parts)
        per_value = {"fp4": (0.35, 0.55), "sparse": (0.01, 0.4)}[compression]
        for epoch in range(ROUNDS):
            sent = [f["reports"][epoch]["bytes_sent"] for f in finals]
            theory = 2 * total * (len(finals) - 1) / len(finals)
            assert all(per_value[0] < s / theory < per_value[1] for s in sent), (compression, sent, theory)


def test_centered_clip_keeps_groupmates_bitwise_equal_and_moves_the_model_as_diloco_does(make_swarm):
    """The run's default reducer (robust: with three senders, the coordinate-wise median of the norm-clipped
    parts) with the fp4 codec and overlapped rounds: groupmates agree exactly, and the model moves the way
    plain DiLoCo moves it (these peers' data are unrelated random tokens, so their pseudo-gradients barely
    agree and the median is far from the mean; on real text the loss cost is measured in
    benchmarks/byzantine.py)."""
    manifest = tiny_manifest(compression="fp4", min_group_size=3, join_rounds_early=False, overlap=True)
    finals = run_swarm(make_swarm, manifest, extra_args=("--settle-at-step", str(SETTLE)))
    reference = reference_overlapped(manifest, RANKS, ROUNDS)
    with seeded_init(manifest):
        initial = [p.detach() for p in make_model(manifest).parameters()]
    ours = torch.cat([(a - b).reshape(-1) for a, b in zip(finals[0]["params"], initial)])
    theirs = torch.cat([(a - b).reshape(-1) for a, b in zip(reference, initial)])
    cosine = float(torch.nn.functional.cosine_similarity(ours, theirs, dim=0))
    assert cosine > 0.5 and 0.5 < float(ours.norm() / theirs.norm()) < 2.0, (cosine, ours.norm(), theirs.norm())
    assert len({f["checksum"] for f in finals}) == 1
    for final in finals[1:]:
        assert all(torch.equal(a, b) for a, b in zip(final["params"], finals[0]["params"]))
