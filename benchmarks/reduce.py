"""What a reducer's robust mean costs: milliseconds per all-reduce part, the current code against ``--baseline``.

Each sender's part of hivemind's default size (2^19 bytes of FP16: 262,144 values) is
combined by ``swarm.defence.robust.robust_mean``, on the averager's event loop, one part after the
other; an auditor recomputes another reducer's parts the same way. This times it for groups
of k senders (correlated pseudo-gradients: a shared direction plus each sender's own noise),
with the plain mean and with the client's default (capped weights, norm clipping,
CenteredClip, the inner range), on one torch thread and with the averager's allocator
settings (``swarm/averager/heap.py``: part-sized blocks are mapped and unmapped each time). Each code tree runs
in its own process, one after the other on the same machine, and the same inputs.

    python -m benchmarks.reduce                  # writes results/reduce.json, reduce.png
    python -m benchmarks.reduce --smoke          # small parts, few repeats, no baseline
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    Stopwatch,
    add_common_args,
    finish,
    print_table,
    pyplot,
    save_figure,
    scratch_dir,
    worker_json,
)
from benchmarks.memory import baseline_tree

NAME = "reduce"
REPO = Path(__file__).resolve().parent.parent
BASELINE_REF = "44fc129"  # main before CenteredClip ran on the Gram matrix
PART_VALUES = 2**19 // 2  # hivemind's part_size_bytes of FP16 values
GROUPS = [2, 3, 4, 8]
MODEL_PARAMETERS = 115_400_000  # the memory benchmark's model: what a round of it costs one peer


def time_parts(values: int, groups: list[int], repeats: int) -> dict[str, dict[str, float]]:
    """Median milliseconds of ``robust_mean`` per part, by aggregation and group size (run in a worker)."""
    import torch

    from swarm.averager import heap
    from swarm.defence.robust import robust_mean
    from swarm.manifest import Aggregation

    torch.set_num_threads(1)
    heap.limit_retention()  # as in the averager: every block of 1 MiB or more mapped on its own
    out: dict[str, dict[str, float]] = {}
    for aggregation in (Aggregation.mean, Aggregation.centered_clip):
        for k in groups:
            g = torch.Generator().manual_seed(k)
            common = torch.randn(values, generator=g)
            parts = [common + 0.5 * torch.randn(values, generator=g) for _ in range(k)]
            weights = [float(100 + 10 * i) for i in range(k)]
            robust_mean(parts, weights, aggregation)  # warm-up
            seconds = []
            for _ in range(repeats):
                start = time.perf_counter()
                robust_mean(parts, weights, aggregation)
                seconds.append(time.perf_counter() - start)
            out.setdefault(aggregation.name, {})[str(k)] = round(1e3 * statistics.median(seconds), 3)
    return out


def measure(code: Path, label: str, values: int, groups: list[int], repeats: int) -> dict[str, Any]:
    """``time_parts`` in a fresh process importing swarm from ``code``."""
    args = [str(values), str(repeats), *map(str, groups)]
    return dict(label=label, ms_per_part=worker_json(code, REPO, "benchmarks.reduce", args, label))


def per_round_seconds(ms: float, k: int, values: int) -> float:
    """One peer's reducing in one round of MODEL_PARAMETERS: its span, 1/k of the vector, in parts of ``values``."""
    return round(ms / 1e3 * MODEL_PARAMETERS / k / values, 2)


def plot(runs: list[dict[str, Any]], groups: list[int], out: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for run in runs:
        for aggregation, style in (("mean", ":"), ("centered_clip", "-")):
            figures = [run["ms_per_part"][aggregation][str(k)] for k in groups]
            ax.plot(groups, figures, style, marker="o", label=f"{run['label']}, {aggregation}")
    ax.set_xlabel("senders in the group")
    ax.set_ylabel("ms per part (262,144 values)")
    ax.set_yscale("log")
    ax.set_title("robust_mean per all-reduce part, one thread", fontsize=9)
    ax.legend(fontsize=7)
    return save_figure(fig, out, NAME)


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:
        values, repeats, *groups = map(int, sys.argv[2:])
        print(json.dumps(time_parts(values, groups, repeats)))
        return 0
    p = argparse.ArgumentParser(prog="python -m benchmarks.reduce", description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--baseline", default=BASELINE_REF, help="git ref of the code to compare with ('' to skip)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args(argv)
    values, groups = PART_VALUES, GROUPS
    if args.smoke:
        values, groups, args.repeats, args.baseline = 4096, [2, 3], 2, ""
    clock = Stopwatch()
    runs = []
    with scratch_dir(args.workdir, "swarm-reduce-") as root:
        if args.baseline:
            runs.append(
                measure(baseline_tree(args.baseline, root), f"baseline {args.baseline}", values, groups, args.repeats)
            )
        runs.append(measure(REPO, "current", values, groups, args.repeats))
    rows = []
    for run in runs:
        for aggregation, figures in run["ms_per_part"].items():
            for k in groups:
                ms = figures[str(k)]
                rows.append([run["label"], aggregation, k, ms, per_round_seconds(ms, k, values)])
    print_table(
        f"robust_mean per part of {values:,} values, median of {args.repeats}",
        ["code", "aggregation", "senders", "ms/part", f"s/round/peer at {MODEL_PARAMETERS / 1e6:.1f}M"],
        rows,
    )
    ratios = {}
    if len(runs) == 2:
        for aggregation, figures in runs[1]["ms_per_part"].items():
            base = runs[0]["ms_per_part"][aggregation]
            ratios[aggregation] = {str(k): round(base[str(k)] / figures[str(k)], 2) for k in groups}
        print(f"baseline / current, ms per part: {ratios}")
    fields = dict(
        part_values=values,
        groups=groups,
        model_parameters=MODEL_PARAMETERS,
        runs=runs,
        baseline_over_current=ratios or None,
    )
    finish(NAME, args.out, fields, smoke=args.smoke, clock=clock, plot=lambda out: plot(runs, groups, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
