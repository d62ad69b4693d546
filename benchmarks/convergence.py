"""Does DiLoCo train as well as data-parallel, at equal tokens? Simulated in one process, on CPU.

Every run sees exactly the same training sequences: M workers each read their own
disjoint shard of the built-in corpus (as real peers do), and

- ``ddp`` takes one step on the concatenation of the M workers' batches (the DDP
  equivalent: M times the batch, one gradient average per step);
- ``diloco-*`` lets each worker take H AdamW steps on its own batches, then applies
  the swarm's own outer step (``swarm.state.outer.OuterState``) to the averaged
  pseudo-gradient; each ``--variants`` entry sets H, the wire (FP16 round-trips every
  pseudo-gradient and their average through hivemind's Float16Compression; fp4 and
  sparse use the swarm's codecs with error feedback and re-encode the average, as a
  reducer does), blocking or overlapped rounds (delayed or eager, landing D inner
  steps into the next round) and the outer optimizer's settings;
- ``single`` is one worker stepping through all the same batches one at a time
  (M times as many steps at the original batch).

The held-out loss is scored on the corpus' held-out shard at the same token counts
for every run. Run: ``python -m benchmarks.convergence``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import (
    Stopwatch,
    add_common_args,
    finish,
    finite,
    print_table,
    pyplot,
    save_figure,
)
from benchmarks.diloco_sim import Variant, run_diloco
from benchmarks.simulation import Curve, Setup, butterfly_bytes, prepare, run_sequential
from client.model import build_model, count_parameters

NAME = "convergence"
DEFAULT_VARIANTS = [
    "h=10",
    "h=50",
    "h=50,wire=fp16",
    "h=10,mode=delayed,delay=5",
    "h=10,mode=eager,delay=5",
    "h=10,wire=fp4,mode=eager,delay=5",
    "h=10,wire=sparse,mode=eager,delay=5",
    "h=10,lr=1.0,momentum=0",
]


def second_half_ratio(curve: Curve, ref: Curve) -> float | None:
    """Mean of ``curve``'s held-out loss over ``ref``'s at the same token counts, over the second half's points."""
    theirs = dict(zip(ref.tokens, ref.eval_loss))
    last = max(curve.tokens, default=0)
    pairs = [(v, theirs[t]) for t, v in zip(curve.tokens, curve.eval_loss) if t >= last / 2 and t in theirs]
    return sum(v / r for v, r in pairs) / len(pairs) if pairs and all(r > 0 for _, r in pairs) else None


def summarize(curves: list[Curve], setup: Setup, numel: int) -> dict:
    by_name = {c.name: c for c in curves}
    ddp = by_name.get("ddp")
    ratios: dict[str, dict] = {}
    for c in curves:
        if c.kind == "diloco" and ddp is not None:
            ratios[f"{c.name}/ddp"] = dict(
                eval_loss_ratio=c.final / ddp.final, perplexity_ratio=math.exp(c.final - ddp.final)
            )
    for c in curves:  # every other variant against blocking fp32 DiLoCo with the same H: with the preset's outer
        if c.kind != "diloco":  # settings, and (when it ran with others) with its own outer settings
            continue
        h = c.settings.get("inner_steps")
        refs = [f"diloco-h{h}-fp32"]
        outer = c.settings.get("outer_lr"), c.settings.get("outer_momentum")
        if outer != (None, None):
            refs.append(f"diloco-h{h}-fp32-outer{outer[0]}m{outer[1]}")
        for ref in (by_name.get(name) for name in refs):
            if ref is not None and ref is not c:
                ratios[f"{c.name}/{ref.name}"] = dict(
                    eval_loss_ratio=c.final / ref.final,
                    perplexity_ratio=math.exp(c.final - ref.final),
                    # the per-point ratio averaged over the run's second half: one end point moves by a few percent
                    # between runs that differ by a rounding (blocking fp4 against fp32: 0.996-1.045 point by point)
                    eval_loss_ratio_second_half=second_half_ratio(c, ref),
                )
    communication = {}
    for c in curves:
        per_value = c.settings.get("bytes_per_param", 4.0)
        per_round = butterfly_bytes(numel, setup.workers, per_value)
        communication[c.name] = dict(
            rounds=c.communication_rounds, bytes_sent_per_worker=c.communication_rounds * per_round
        )
    if ddp is not None:
        for name, comm in communication.items():
            if comm["bytes_sent_per_worker"] and name != "ddp":
                comm["ddp_bytes_over_this"] = (
                    communication["ddp"]["bytes_sent_per_worker"] / comm["bytes_sent_per_worker"]
                )
    return dict(ratios=ratios, communication=communication)


def plot(curves: list[Curve], out: Path, title: str) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for c in curves:
        style = "--" if c.kind != "diloco" else "-"
        ax.plot([t / 1e6 for t in c.tokens[1:]], c.eval_loss[1:], style, marker=".", label=f"{c.name} ({c.final:.3f})")
    ax.set_xlabel("training tokens (millions, all workers together)")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, out, NAME)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.convergence", description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--workers", type=int, default=4, help="M: DiLoCo workers, and the DDP batch multiple")
    p.add_argument("--steps", type=int, default=250, help="optimizer steps of each DiLoCo worker and of DDP")
    p.add_argument("--batch", type=int, default=4, help="sequences per worker step (the tiny preset has 8)")
    p.add_argument(
        "--variants",
        nargs="+",
        default=DEFAULT_VARIANTS,
        help="DiLoCo runs, each h=H[,wire=fp32|fp16|fp4|sparse][,mode=blocking|delayed|eager|merge][,delay=D]"
        "[,mix=ALPHA][,agg=robust][,lr=OUTER_LR][,momentum=M][,standin=own|share|blend|fit][,standinfrom=raw|sent][,moments=keep|forget]",
    )
    p.add_argument("--eval-sequences", type=int, default=64, help="held-out sequences scored at each point")
    p.add_argument("--eval-every", type=int, default=50, help="DDP-equivalent steps between held-out scores")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0, help="another initial model and other worker shards (0: the default)")
    p.add_argument("--no-references", dest="references", action="store_false", help="skip the ddp and single runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.workers, args.steps = 2, 6
        args.variants = ["h=2", "h=3", "h=3,wire=fp16", "h=3,wire=fp4,mode=delayed,delay=1", "h=3,mode=eager,delay=1"]
        args.variants.append("h=3,wire=fp4,mode=eager,delay=1,standin=share")  # the client's stand-in, from raw
        args.variants.append("h=3,wire=fp4,mode=eager,delay=1,standin=share,moments=forget")
        args.eval_sequences, args.eval_every, args.batch = 8, 3, 2
        args.threads = args.threads or 1  # CI runs it beside other tests: two threads there waited on each other
    args.variants = [Variant.parse(v) for v in args.variants]
    for v in args.variants:
        if args.steps % v.inner_steps or args.steps % args.eval_every:
            p.error(f"--steps {args.steps} must be a multiple of H={v.inner_steps} and of --eval-every")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = Stopwatch()
    setup = prepare(args.preset, args.workers, args.steps, args.batch, args.eval_sequences, args.eval_every, args.seed)
    numel = count_parameters(build_model(setup.manifest(args.steps)))
    m = setup.workers
    print(
        f"convergence: {args.preset} preset ({numel / 1e6:.2f}M parameters), M={m} workers x {setup.steps} steps x "
        f"{setup.batch} sequences; {setup.steps * setup.tokens_per_ddp_step:,} tokens per run; shards {setup.shards}"
    )
    plan: list[tuple[str, Callable[[], Curve]]] = []
    if args.references:
        ddp_batch = lambda t: torch.cat([b[t] for b in setup.batches])  # noqa: E731
        plan.append(("ddp", lambda: run_sequential(setup, "ddp", "ddp", ddp_batch, setup.steps)))
    for variant in args.variants:
        plan.append((variant.name, lambda v=variant: run_diloco(setup, v)))
    if args.references:
        single_batch = lambda t: setup.batches[t % m][t // m]  # noqa: E731
        plan.append(("single", lambda: run_sequential(setup, "single", "single", single_batch, m * setup.steps)))
    curves: list[Curve] = []
    for _, run in plan:
        t0 = time.monotonic()
        curve = run()
        curve.seconds = round(time.monotonic() - t0, 1)
        curves.append(curve)
    summary = summarize(curves, setup, numel)
    fields = dict(
        sizes=dict(
            preset=args.preset,
            parameters=numel,
            workers=m,
            steps_per_worker=setup.steps,
            sequences_per_worker_step=setup.batch,
            seq_len=setup.batches[0][0].shape[1],
            tokens_per_run=setup.steps * setup.tokens_per_ddp_step,
            ddp_batch_sequences=m * setup.batch,
            eval_sequences=sum(len(x) for x in setup.eval_set),
            eval_every_ddp_steps=setup.eval_every,
            worker_shards=setup.shards,
            seed=setup.seed,
            inner_lr=setup.manifest(setup.steps).inner.lr,
            warmup_steps=setup.manifest(setup.steps).inner.warmup_steps,
        ),
        runs=[
            dict(
                name=c.name,
                kind=c.kind,
                final_eval_loss=finite(c.final),
                final_perplexity=finite(math.exp(c.final)),
                tokens=c.tokens,
                eval_loss=[finite(v) for v in c.eval_loss],
                optimizer_steps=c.optimizer_steps,
                communication_rounds=c.communication_rounds,
                seconds=c.seconds,
                settings=c.settings,
            )
            for c in curves
        ],
        **summary,
    )
    print_table(
        "held-out loss at equal tokens",
        ["run", "final loss", "perplexity", "optimizer steps", "comm. rounds", "seconds"],
        [(c.name, c.final, math.exp(c.final), c.optimizer_steps, c.communication_rounds, c.seconds) for c in curves],
    )
    print_table(
        "ratios (goal: DiLoCo/DDP <= 1.00; paper 150M: 15.02/15.30 = 0.98 in perplexity)",
        ["ratio", "eval loss", "perplexity"],
        [(k, v["eval_loss_ratio"], v["perplexity_ratio"]) for k, v in summary["ratios"].items()],
    )
    title = f"{args.preset}: M={m}, {setup.steps * setup.tokens_per_ddp_step / 1e6:.2f}M tokens per run"
    finish(
        NAME,
        args.out,
        fields,
        smoke=args.smoke,
        clock=clock,
        plot=lambda out: plot(curves, out, title),
        head=("benchmark", "command", "smoke", "machine"),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
