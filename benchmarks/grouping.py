"""Many peers, one model: four ways of combining averaging groups smaller than the swarm, simulated at equal tokens.

With N peers and a target group size G < N, hivemind forms several groups per round. Every round here the M
simulated workers (``benchmarks.simulation``: each its own shard of the built-in corpus, the client's inner step)
are split by a seeded random partition like matchmaking's (the workers shuffled, cut into runs of 1..G), then:

- ``consensus`` (today's client): each group averages its members' pseudo-gradients and steps; the state of the
  largest group (ties: the lowest index) wins the checksum vote and every other worker re-syncs to it (it replays
  that group's average, ``swarm.state.replay``, and drops its error-feedback residual): its group's work is lost;
- ``merge`` (two stages): the group averages (fp4-encoded by their reducers) are combined, weighted by group size,
  into one swarm average (fp4-encoded again by the stage-2 reducers); every worker steps with it: one model;
- ``mixing`` (Moshpit-like gossip): each group averages its members' outer states (parameters and momentum) and
  pseudo-gradients and steps; the workers keep diverged models, and the divergence is measured every round;
- ``gather``: every worker downloads every worker's fp4 update and computes the same mean: merge's numbers with
  one fp4 encoding (the senders') instead of three.

Wire: fp4 with error feedback (``swarm.averager.codecs``), as ``benchmarks.diloco_sim``; blocking rounds; the
preset's outer step (``swarm.state.outer.OuterState``). Besides the simulation, the bytes each peer receives per
round are worked out from each design for N = 10, 100, 1000 peers and G = 16, 64 (``peer_units``).
Run: ``python -m benchmarks.grouping``.
"""

from __future__ import annotations

import argparse
import enum
import itertools
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.common import Stopwatch, add_common_args, finish, finite, print_table, pyplot, save_figure
from benchmarks.convergence import second_half_ratio
from benchmarks.simulation import (
    Curve,
    Setup,
    Wire,
    average,
    bytes_per_param,
    evaluate,
    inner_step,
    make_optimizer,
    prepare,
    through_wire,
)
from client.model import build_model, count_parameters
from client.step import lr_at
from swarm.averager import codecs
from swarm.state.outer import OuterState

NAME = "grouping"
WIRE = Wire.fp4
FP4_BYTES_PER_PARAM = 0.44  # |A|: one fp4 pseudo-gradient, deflated, per parameter (tests/test_benchmarks.py)
FP16_MODEL_UNITS = 2.0 / FP4_BYTES_PER_PARAM  # a model's parameters on an FP16 wire, in |A|
AGREEMENT = 1e-3  # the relative spread under which mixing's peers are said to agree
AGREEMENT_CAP = 500  # gossip-only rounds tried after training before giving up on agreement


class Method(enum.StrEnum):
    consensus = "consensus"
    merge = "merge"
    mixing = "mixing"
    gather = "gather"


# ---- groups ------------------------------------------------------------------------------------------------------


def partition(workers: int, target: int, rng: random.Random) -> list[list[int]]:
    """One round's groups as matchmaking forms them: the workers in the order they reach matchmaking (shuffled),
    cut into runs of 1..``target`` (uniform; the last run takes what is left)."""
    order = list(range(workers))
    rng.shuffle(order)
    groups, start = [], 0
    while start < workers:
        size = rng.randint(1, target)
        groups.append(sorted(order[start : start + size]))
        start += size
    return groups


def partitions(workers: int, target: int, rounds: int, seed: int) -> list[list[list[int]]]:
    """Every round's groups for one seed: the same for every method, different for every seed."""
    rng = random.Random(f"grouping-{seed}")
    return [partition(workers, target, rng) for _ in range(rounds)]


# ---- bytes per peer, from the designs ---------------------------------------------------------------------------


def allreduce_units(size: int) -> float:
    """What a butterfly all-reduce in a group of ``size`` costs each member, in |A| (received; sent is the same):
    scatter-reduce plus all-gather, ``benchmarks.simulation.butterfly_bytes``."""
    return 2 * (size - 1) / size if size > 1 else 0.0


def full_groups(n: int, target: int) -> list[int]:
    """n peers in groups of ``target``, the last with the rest: the sizes."""
    return [min(target, n - start) for start in range(0, n, target)]


def peer_units(method: str, n: int, target: int, model_units: float = FP16_MODEL_UNITS) -> list[float]:
    """What each of ``n`` peers receives in one round, in |A| (one fp4 pseudo-gradient), the peers matched into
    full groups of ``target`` (the last the rest).

    - ``consensus``: its group's all-reduce; a peer outside the winning group then replays the winner's average
      (one |A| download, ``swarm.state.replay``) instead of keeping its own;
    - ``mixing``: its group's all-reduce of the pseudo-gradients (the issue's lower bound); ``mixing+models`` adds
      the all-reduce of the members' models (``model_units`` |A| each, FP16 by default), without which the
      group's members cannot start from one model (see ``run``);
    - ``merge``: stage 1 for everyone; one delegate per group then all-reduces the group averages with the other
      delegates, in groups of ``target`` again, recursively until one group remains (log_target(n) levels); every
      peer outside that last group downloads the final average once (|A|);
    - ``gather``: every other peer's update (n - 1 downloads)."""
    if method == "gather":
        return [float(n - 1)] * n
    sizes = full_groups(n, target)
    members = [list(range(s, s + size)) for s, size in zip(itertools.accumulate([0, *sizes]), sizes)]
    cost = [0.0] * n
    for group in members:
        for peer in group:
            cost[peer] = allreduce_units(len(group))
    if method == "consensus":
        winner = set(members[0])  # the largest group (a full one)
        return [c + (0.0 if peer in winner else 1.0) for peer, c in enumerate(cost)]
    if method == "mixing":
        return cost
    if method == "mixing+models":
        return [c * (1 + model_units) for c in cost]
    if method != "merge":
        raise ValueError(method)
    top = members[0]
    while len(members) > 1:
        delegates = [group[0] for group in members]
        members = [delegates[s : s + target] for s in range(0, len(delegates), target)]
        for group in members:
            for peer in group:
                cost[peer] += allreduce_units(len(group))
        top = members[0]
    top = set(top)
    return [c + (0.0 if peer in top else 1.0) for peer, c in enumerate(cost)]


def merge_levels(n: int, target: int) -> int:
    """All-reduces a merge's top delegate takes part in: ceil(log_target n), at least 1."""
    levels, k = 1, math.ceil(n / target)
    while k > 1:
        levels, k = levels + 1, math.ceil(k / target)
    return levels


BYTES_METHODS = ("consensus", "mixing", "mixing+models", "merge", "gather")


def bytes_table(peers: tuple[int, ...] = (10, 100, 1000), targets: tuple[int, ...] = (16, 64)) -> list[dict]:
    rows = []
    for target in targets:
        for n in peers:
            for method in BYTES_METHODS:
                units = peer_units(method, n, target)
                rows.append(
                    dict(
                        method=method,
                        peers=n,
                        target_group_size=target,
                        mean_units=statistics.fmean(units),
                        worst_units=max(units),
                        mean_bytes_per_param=statistics.fmean(units) * FP4_BYTES_PER_PARAM,
                        worst_bytes_per_param=max(units) * FP4_BYTES_PER_PARAM,
                    )
                )
    return rows


# ---- the simulation ----------------------------------------------------------------------------------------------


@dataclass
class Run:
    method: Method
    seed: int
    curve: Curve
    last: int  # evaluation points the final loss is the mean of
    counted: int = 0  # worker-rounds whose pseudo-gradient reached the model(s) the workers went on from
    worker_rounds: int = 0
    group_sizes: list[list[int]] = field(default_factory=list)
    wire_bytes: list[float] = field(default_factory=list)
    spread_max: list[float] = field(default_factory=list)  # mixing, per round: pairwise L2 / the mean model's norm
    spread_mean: list[float] = field(default_factory=list)
    mean_model_loss: list[float] = field(default_factory=list)  # mixing: the workers' mean model, held by none
    worker_final_losses: list[float] = field(default_factory=list)
    gossip_spread: list[float] = field(default_factory=list)  # mixing, after training: model averaging only

    @property
    def final(self) -> float:
        return statistics.fmean(self.curve.eval_loss[-self.last :])

    @property
    def share(self) -> float:
        return self.counted / self.worker_rounds

    @property
    def rounds_to_agreement(self) -> int | None:
        """Gossip-only rounds after the last training round until the spread fell under ``AGREEMENT``."""
        under = [i for i, s in enumerate(self.gossip_spread) if s < AGREEMENT]
        return under[0] + 1 if under else None

    def record(self) -> dict:
        c = self.curve
        return dict(
            method=str(self.method),
            seed=self.seed,
            final_eval_loss=finite(self.final),
            last_eval_loss=finite(c.final),
            tokens=c.tokens,
            eval_loss=[finite(v) for v in c.eval_loss],
            share_counted=self.share,
            group_sizes=self.group_sizes,
            bytes_per_param=statistics.fmean(self.wire_bytes),
            spread_max=self.spread_max,
            spread_mean=self.spread_mean,
            mean_model_loss=self.mean_model_loss,
            worker_final_losses=self.worker_final_losses,
            gossip_spread=self.gossip_spread,
            rounds_to_agreement=self.rounds_to_agreement,
            spread_ever_under_agreement_in_training=any(s < AGREEMENT for s in self.spread_max),
            seconds=c.seconds,
        )


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def spreads(vectors: torch.Tensor) -> tuple[float, float]:
    """The largest and the mean pairwise L2 distance between the rows, over the norm of their mean."""
    norm = float(vectors.mean(dim=0).norm())
    pairs = [float((vectors[i] - vectors[j]).norm()) for i, j in itertools.combinations(range(len(vectors)), 2)]
    if not pairs:
        return 0.0, 0.0
    return max(pairs) / norm, statistics.fmean(pairs) / norm


def weighted_mean(tensors: list[list[torch.Tensor]], weights: list[float]) -> list[torch.Tensor]:
    total = sum(weights)
    return [sum(w * t for w, t in zip(weights, parts)) / total for parts in zip(*tensors)]


def average_states(states: list[OuterState]) -> None:
    """Mixing: the first of ``states`` becomes their mean (parameters and momentum)."""
    lead = states[0]
    with torch.no_grad():
        for mine, *theirs in zip(lead.tensors(), *(s.tensors() for s in states[1:])):
            mine.copy_(torch.stack([mine, *theirs]).mean(dim=0))


def run(
    setup: Setup,
    method: Method,
    rounds: list[list[list[int]]],
    inner_steps: int,
    eval_every: int,
    last: int,
    gossip_seed: int,
    target: int,
) -> Run:
    """One method over ``rounds`` (each round's groups), H = ``inner_steps``, the workers' batches of ``setup``."""
    h, m = inner_steps, setup.workers
    manifest = setup.manifest(total_steps=setup.steps)
    models = [build_model(manifest) for _ in range(m)]
    optimizers = [make_optimizer(model, manifest) for model in models]
    params = [list(model.parameters()) for model in models]
    shared = OuterState(params[0], manifest.outer)
    outers = [OuterState(params[0], manifest.outer) for _ in range(m)] if method == Method.mixing else [shared] * m
    for w in range(m):
        outers[w].write_to(params[w])
    residuals = [[torch.zeros_like(p) for p in shared.params] for _ in range(m)]
    curve = Curve(f"{method}-s{setup.seed}", "grouping", optimizer_steps=setup.steps, communication_rounds=len(rounds))
    result = Run(method, setup.seed, curve, last)
    scorer = build_model(manifest)

    def score(done: int) -> None:
        tokens = done * h * setup.tokens_per_ddp_step
        if method != Method.mixing:
            curve.add(tokens, evaluate(models[0], setup.eval_set))
            return
        losses = [evaluate(model, setup.eval_set) for model in models]  # what each peer holds
        curve.add(tokens, statistics.fmean(losses))
        mean_state = weighted_mean([o.params for o in outers], [1.0] * m)
        with torch.no_grad():
            for p, v in zip(scorer.parameters(), mean_state):
                p.copy_(v)
        result.mean_model_loss.append(evaluate(scorer, setup.eval_set))
        result.worker_final_losses = losses

    score(0)
    for r, groups in enumerate(rounds):
        for k in range(h):
            step = r * h + k
            for w in range(m):
                lr = lr_at(manifest, step)
                inner_step(models[w], optimizers[w], setup.batches[w][step], lr, manifest.inner.grad_clip)
        deltas = []
        for w in range(m):
            delta = outers[w].pseudo_gradient(params[w])
            codecs.apply_error_feedback(delta, residuals[w], WIRE)  # what the worker sends: on fp4's grid
            deltas.append(delta)
        result.group_sizes.append([len(g) for g in groups])
        result.worker_rounds += m
        if method == Method.consensus:
            candidates = []
            for group in groups:
                averaged = average([deltas[w] for w in group], WIRE)
                state = OuterState(shared.params, shared.spec, epoch=shared.epoch)
                state.momentum = [b.clone() for b in shared.momentum]
                state.step(averaged)
                candidates.append(state)
            result.wire_bytes.append(bytes_per_param(deltas[groups[0][0]], averaged, WIRE))
            won = max(range(len(groups)), key=lambda i: (len(groups[i]), -i))
            shared.load(candidates[won].epoch, candidates[won].tensors())
            result.counted += len(groups[won])
            for w in set(range(m)) - set(groups[won]):  # re-synced by replaying the winner's average
                for res in residuals[w]:
                    res.zero_()
        elif method == Method.merge:
            stage1 = [average([deltas[w] for w in group], WIRE) for group in groups]  # each reducer encodes it
            combined = weighted_mean(stage1, [float(len(g)) for g in groups])
            combined = [through_wire(t, WIRE, average=True) for t in combined]  # stage 2's reducers encode it again
            result.wire_bytes.append(bytes_per_param(deltas[0], combined, WIRE))
            shared.step(combined)
            result.counted += m
        elif method == Method.gather:
            gathered = average(deltas, Wire.fp32)  # the senders' fp4 values, summed by each peer: not re-encoded
            result.wire_bytes.append(bytes_per_param(deltas[0], deltas[0], WIRE))
            shared.step(gathered)
            result.counted += m
        else:  # mixing: each group starts from its members' mean state, steps with their mean pseudo-gradient
            for group in groups:
                averaged = average([deltas[w] for w in group], WIRE)
                states = [outers[w] for w in group]
                average_states(states)
                states[0].step(averaged)
                for other in states[1:]:
                    other.load(states[0].epoch, states[0].tensors())
            result.wire_bytes.append(bytes_per_param(deltas[0], averaged, WIRE))
            result.counted += m  # every worker's work reached its group's model (and spreads from there)
            high, mean = spreads(torch.stack([flat(o.params) for o in outers]))
            result.spread_max.append(high)
            result.spread_mean.append(mean)
        for w in range(m):
            outers[w].write_to(params[w])
        if (r + 1) % eval_every == 0 or r + 1 == len(rounds):
            score(r + 1)
    if method == Method.mixing:  # after training: model averaging only, in fresh groups, until the peers agree
        vectors = torch.stack([flat(o.params) for o in outers])
        rng = random.Random(f"gossip-{gossip_seed}")
        for _ in range(AGREEMENT_CAP):
            for group in partition(m, target, rng):
                vectors[group] = vectors[group].mean(dim=0)
            result.gossip_spread.append(spreads(vectors)[0])
            if result.gossip_spread[-1] < AGREEMENT:
                break
    return result


# ---- the comparison ----------------------------------------------------------------------------------------------


def spread_of(values: list[float]) -> dict:
    return dict(min=min(values), median=statistics.median(values), max=max(values))


def summarize(runs: list[Run]) -> dict:
    by_seed = {(r.seed, r.method): r for r in runs}
    out = {}
    for method in Method:
        mine = [r for r in runs if r.method == method]
        if not mine:
            continue
        refs = [by_seed.get((r.seed, Method.merge)) for r in mine]
        entry = dict(
            seeds=[r.seed for r in mine],
            final_eval_loss=spread_of([r.final for r in mine]),
            share_counted=spread_of([r.share for r in mine]),
            bytes_per_param=spread_of([statistics.fmean(r.wire_bytes) for r in mine]),
        )
        if all(refs):
            entry["loss_ratio_to_merge"] = spread_of([r.final / ref.final for r, ref in zip(mine, refs)])
            halves = [second_half_ratio(r.curve, ref.curve) for r, ref in zip(mine, refs)]
            if all(h is not None for h in halves):
                entry["loss_ratio_to_merge_second_half"] = spread_of(halves)
        if method == Method.mixing:
            entry["spread_max_final"] = spread_of([r.spread_max[-1] for r in mine])
            entry["spread_mean_final"] = spread_of([r.spread_mean[-1] for r in mine])
            entry["spread_max_over_run"] = spread_of([max(r.spread_max) for r in mine])
            entry["spread_max_second_half"] = spread_of(
                [statistics.fmean(r.spread_max[len(r.spread_max) // 2 :]) for r in mine]
            )
            entry["spread_ever_under_agreement_in_training"] = any(min(r.spread_max) < AGREEMENT for r in mine)
            entry["rounds_to_agreement_after_training"] = [r.rounds_to_agreement for r in mine]
            entry["mean_model_final_eval_loss"] = spread_of([r.mean_model_loss[-1] for r in mine])
            entry["worst_worker_final_eval_loss"] = spread_of([max(r.worker_final_losses) for r in mine])
        out[str(method)] = entry
    return out


def plot(runs: list[Run], out: Path, title: str) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    colors = dict(consensus="tab:red", merge="tab:blue", mixing="tab:green", gather="tab:purple")
    seeds = sorted({r.seed for r in runs})
    for r in runs:
        c = r.curve
        first = r.seed == seeds[0]
        left.plot(
            [t / 1e6 for t in c.tokens[1:]],
            c.eval_loss[1:],
            "-" if first else ":",
            color=colors[r.method],
            marker="." if first else None,
            label=f"{r.method} (seed {r.seed}: {r.final:.3f})" if first else None,
        )
    left.set_xlabel("training tokens (millions, all workers together)")
    left.set_ylabel("held-out loss (nats/token; mixing: the mean over the peers' own models)")
    left.set_title(title)
    left.grid(alpha=0.3)
    left.legend()
    for r in runs:
        if r.method != Method.mixing:
            continue
        n = len(r.spread_max)
        right.semilogy(range(1, n + 1), r.spread_max, "-", color="tab:green", label=f"max, seed {r.seed}")
        right.semilogy(range(1, n + 1), r.spread_mean, ":", color="tab:green")
        after = range(n + 1, n + 1 + len(r.gossip_spread))
        right.semilogy(after, r.gossip_spread, "-", color="tab:olive", label=f"after training (gossip only), {r.seed}")
    right.axhline(AGREEMENT, color="grey", lw=0.8)
    right.set_xlabel("round")
    right.set_ylabel("pairwise L2 distance / model norm (max: solid, mean: dotted)")
    right.set_title("mixing: how far the peers' models are apart")
    right.grid(alpha=0.3)
    right.legend(fontsize=7)
    return save_figure(fig, out, NAME)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.grouping", description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--workers", type=int, default=8, help="M: simulated workers")
    p.add_argument("--group-size", type=int, default=3, help="G: the target group size (groups of 1..G form)")
    p.add_argument("--inner-steps", type=int, default=10, help="H: inner steps per round")
    p.add_argument("--rounds", type=int, default=15, help="R: rounds per run")
    p.add_argument("--batch", type=int, default=4, help="sequences per worker step")
    p.add_argument("--eval-sequences", type=int, default=64, help="held-out sequences scored at each point")
    p.add_argument("--eval-every", type=int, default=1, help="rounds between held-out scores")
    p.add_argument("--last", type=int, default=3, help="the final loss: the mean of this many last scores")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="partitions, initial models, shards")
    p.add_argument("--methods", nargs="+", default=[str(m) for m in Method], choices=[str(m) for m in Method])
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    args = p.parse_args(argv)
    if args.smoke:
        args.workers, args.group_size, args.inner_steps, args.rounds = 4, 2, 2, 3
        args.batch, args.eval_sequences, args.eval_every, args.last, args.seeds = 2, 8, 1, 2, [0, 1]
    args.methods = [Method(m) for m in args.methods]
    if Method.merge not in args.methods:
        p.error("merge is the reference the others are compared with: keep it in --methods")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = Stopwatch()
    steps = args.rounds * args.inner_steps
    runs: list[Run] = []
    sizes = {}
    for seed in args.seeds:
        setup = prepare(args.preset, args.workers, steps, args.batch, args.eval_sequences, args.inner_steps, seed)
        numel = count_parameters(build_model(setup.manifest(steps)))
        rounds = partitions(args.workers, args.group_size, args.rounds, seed)
        print(
            f"grouping: seed {seed}, {args.preset} ({numel / 1e6:.2f}M parameters), M={args.workers} workers, "
            f"G={args.group_size}, H={args.inner_steps}, R={args.rounds}; {steps * setup.tokens_per_ddp_step:,} "
            f"tokens per run; groups of round 1: {rounds[0]}",
            flush=True,
        )
        sizes = dict(
            preset=args.preset,
            parameters=numel,
            workers=args.workers,
            target_group_size=args.group_size,
            inner_steps=args.inner_steps,
            rounds=args.rounds,
            steps_per_worker=steps,
            sequences_per_worker_step=setup.batch,
            seq_len=setup.batches[0][0].shape[1],
            tokens_per_run=steps * setup.tokens_per_ddp_step,
            eval_sequences=sum(len(x) for x in setup.eval_set),
            eval_every_rounds=args.eval_every,
            final_is_mean_of_last=args.last,
            wire=str(WIRE),
            outer=setup.manifest(steps).outer.model_dump(),
            seeds=args.seeds,
        )
        for method in args.methods:
            t0 = time.monotonic()
            result = run(setup, method, rounds, args.inner_steps, args.eval_every, args.last, seed, args.group_size)
            result.curve.seconds = round(time.monotonic() - t0, 1)
            runs.append(result)
            extra = ""
            if method == Method.mixing:
                extra = f", spread at the end {result.spread_max[-1]:.2e}, agreement {result.rounds_to_agreement}"
            print(f"  {method}: final {result.final:.4f}, share {result.share:.3f}{extra}", flush=True)
    summary = summarize(runs)
    table = bytes_table()
    rows = []
    for method, entry in summary.items():
        ratio = entry.get("loss_ratio_to_merge", {})
        share = entry["share_counted"]
        rows.append(
            (
                method,
                f"{entry['final_eval_loss']['median']:.4f}",
                " / ".join(f"{ratio[k]:.4f}" for k in ("min", "median", "max")) if ratio else "",
                " / ".join(f"{share[k]:.3f}" for k in ("min", "median", "max")),
                f"{entry['spread_max_final']['median']:.2e}" if "spread_max_final" in entry else "0 (one model)",
            )
        )
    print_table(
        "held-out loss at equal tokens (min / median / max over seeds)",
        ["method", "final loss (median)", "/ merge", "share of work counted", "max spread at the end"],
        rows,
    )
    print_table(
        "received per peer per round, in |A| (one fp4 pseudo-gradient, ~0.44 B/param): mean / worst peer",
        ["method", "G", "N=10", "N=100", "N=1000"],
        [
            (
                method,
                target,
                *(
                    f"{row['mean_units']:.2f} / {row['worst_units']:.2f}"
                    for row in table
                    if row["method"] == method and row["target_group_size"] == target
                ),
            )
            for target in (16, 64)
            for method in BYTES_METHODS
        ],
    )
    fields = dict(
        sizes=sizes,
        summary=summary,
        bytes_per_peer=dict(unit="|A|: one fp4 pseudo-gradient", unit_bytes_per_param=FP4_BYTES_PER_PARAM, rows=table),
        runs=[r.record() for r in runs],
    )
    title = f"{args.preset}: M={args.workers}, G={args.group_size}, H={args.inner_steps}, R={args.rounds}, fp4"
    finish(NAME, args.out, fields, smoke=args.smoke, clock=clock, plot=lambda out: plot(runs, out, title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
