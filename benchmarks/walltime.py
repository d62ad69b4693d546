"""Held-out loss at equal wall time: the convergence runs' curves, read at the tokens each mode gets through in the
same hours on a given link.

``benchmarks.convergence`` compares modes at equal tokens; ``benchmarks.wan`` measures what share of the wall time
each mode spends computing (its utilization) on each link. A volunteer's swarm runs for hours, not tokens: in the
time an overlapped run takes T tokens, a blocking run with utilization u_b (against u_o) takes T * u_b / u_o. This
reads both curves there (linear between the curve's points) and gives the ratio of the overlapped run's loss to the
blocking run's, per seed and link, and the mean over seeds. A wan run whose rounds report how late they landed
(``steps_late``, since 2026-11-27) also gives that lag, in inner steps, to say which of the convergence runs' delays a
link is nearest.

``python -m benchmarks.walltime --seeds FOLDER --wan WAN_JSON --overlapped NAME [NAME ...]`` (the folder as
``benchmarks.seeds`` reads it; each NAME an overlapped run in it, compared with blocking FP32 of its seed).
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
from pathlib import Path

from benchmarks.common import print_table
from benchmarks.seeds import load_runs, reference_name

NAME = "walltime"


def loss_at(curve: dict[int, float], tokens: float) -> float:
    """The curve's held-out loss at ``tokens``, linear between its two nearest points (inside its range only)."""
    points = sorted(curve)
    if not points or tokens < points[0] or tokens > points[-1]:
        raise ValueError(f"{tokens:.0f} tokens is outside the curve's {points[:1]}..{points[-1:]}")
    i = bisect.bisect_left(points, tokens)
    if points[i] == tokens:
        return curve[points[i]]
    (t0, t1) = points[i - 1], points[i]
    return curve[t0] + (curve[t1] - curve[t0]) * (tokens - t0) / (t1 - t0)


def equal_time_ratio(overlapped: dict[int, float], blocking: dict[int, float], u_overlapped: float, u_blocking: float):
    """The overlapped run's loss over the blocking run's after the same wall time: the faster mode is read at the
    last point both curves have, the other at its share of those tokens. Returns (ratio, overlapped tokens,
    blocking tokens)."""
    if u_overlapped <= 0 or u_blocking <= 0:
        raise ValueError("utilizations must be positive")
    end = min(max(overlapped), max(blocking))
    t_over = end * min(1.0, u_overlapped / u_blocking)
    t_block = end * min(1.0, u_blocking / u_overlapped)
    return loss_at(overlapped, t_over) / loss_at(blocking, t_block), t_over, t_block


def link_figures(wan: dict, overlapped_mode: str, blocking_mode: str) -> list[dict]:
    """Per link of a wan run: both modes' utilization, and how many inner steps late the overlapped average landed,
    as the rounds reported it (None in older runs: estimated from their seconds it came out twice too high)."""
    blocking = {f["rate_mbit"]: f for f in wan["figures"][blocking_mode]}
    out = []
    for f in wan["figures"][overlapped_mode]:
        b = blocking.get(f["rate_mbit"])
        if b is None:
            continue
        out.append(dict(rate_mbit=f["rate_mbit"], u_overlapped=f["utilization"], u_blocking=b["utilization"],
                        steps_late=f.get("steps_late")))  # fmt: skip
    return out


def summarize(seeds: dict[int, dict[str, dict[int, float]]], names: list[str], links: list[dict]) -> dict[str, list]:
    """overlapped run -> per link: the equal-time ratio at each seed that has the run and its blocking FP32, and
    their mean."""
    out: dict[str, list] = {}
    for name in names:
        rows = []
        for link in links:
            per_seed = {}
            for seed, runs in sorted(seeds.items()):
                if name in runs and reference_name(name) in runs:
                    ratio, t_over, t_block = equal_time_ratio(
                        runs[name], runs[reference_name(name)], link["u_overlapped"], link["u_blocking"]
                    )
                    per_seed[seed] = dict(ratio=ratio, overlapped_tokens=t_over, blocking_tokens=t_block)
            if per_seed:
                mean = statistics.fmean(r["ratio"] for r in per_seed.values())
                rows.append(dict(link, per_seed=per_seed, mean_ratio=mean))
        out[name] = rows
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.walltime", description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=Path, required=True, help="holds s{seed}-*.json, benchmarks.convergence results")
    p.add_argument("--wan", type=Path, required=True, help="a benchmarks.wan result with both modes")
    p.add_argument("--overlapped", nargs="+", required=True, help="overlapped convergence runs, by name")
    p.add_argument("--overlapped-mode", default="fp4-overlap", help="the wan run's overlapped mode")
    p.add_argument("--blocking-mode", default="fp16", help="the wan run's blocking mode")
    p.add_argument("--out", type=Path, help="where walltime.json goes (default: the seeds folder)")
    args = p.parse_args(argv)
    links = link_figures(json.loads(args.wan.read_text()), args.overlapped_mode, args.blocking_mode)
    summary = summarize(load_runs(args.seeds), args.overlapped, links)
    if not any(summary.values()):
        print(f"none of {args.overlapped} has a blocking FP32 run of its seed in {args.seeds}", file=sys.stderr)
        return 1
    table = [
        (name, "unlimited" if r["rate_mbit"] is None else f"{r['rate_mbit']:g} Mbit/s", r["u_overlapped"],
         r["u_blocking"], r["steps_late"], len(r["per_seed"]), r["mean_ratio"])
        for name, rows in summary.items() for r in rows
    ]  # fmt: skip
    columns = ["overlapped run", "link", "u overlapped", "u blocking", "lands steps late", "seeds", "loss ratio"]
    print_table("held-out loss at equal wall time, overlapped / blocking", columns, table)
    record = dict(benchmark=NAME, wan=str(args.wan), overlapped_mode=args.overlapped_mode,
                  blocking_mode=args.blocking_mode, runs=summary)  # fmt: skip
    out = (args.out or args.seeds) / f"{NAME}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
