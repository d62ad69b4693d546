"""Convergence ratios over several seeds: each variant's held-out loss over blocking FP32's of the same seed.

One ``benchmarks.convergence`` run per seed (or per seed and variant, run side by side) writes a
``convergence.json``; copied into one folder as ``s{seed}-{anything}.json``, this pairs every run with the
blocking FP32 run of its seed and H (``diloco-h{H}-fp32``), at the last point and averaged over the second half's
points, and averages each over the seeds. One seed's end point moves by a few percent between runs that differ by a
rounding, so a goal of 1% is only read off the mean of several. Run: ``python -m benchmarks.seeds FOLDER``
(writes ``FOLDER/seeds.json``).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from benchmarks.common import print_table

NAME = "seeds"
FILE = re.compile(r"s(\d+)-.*\.json")


def load_runs(folder: Path) -> dict[int, dict[str, dict[int, float]]]:
    """seed -> run name -> {tokens: held-out loss}, from every ``s{seed}-*.json`` in ``folder``."""
    seeds: dict[int, dict[str, dict[int, float]]] = {}
    for path in sorted(folder.glob("s*-*.json")):
        match = FILE.fullmatch(path.name)
        if match is None:
            continue
        for run in json.loads(path.read_text())["runs"]:
            seeds.setdefault(int(match[1]), {})[run["name"]] = dict(zip(run["tokens"], run["eval_loss"]))
    return seeds


def reference_name(name: str) -> str | None:
    """The blocking FP32 run a DiLoCo variant is compared with: the same H, and the same outer settings if the
    variant names its own (``-outer0.7m0.9``: outer lr 0.7, Nesterov momentum 0.9)."""
    match = re.match(r"diloco-h(\d+)-", name)
    outer = re.search(r"-outer[0-9.]+m[0-9.]+", name)
    return f"diloco-h{match[1]}-fp32{outer[0] if outer else ''}" if match else None


def ratios(curve: dict[int, float], ref: dict[int, float]) -> dict[str, float] | None:
    """At the last point both have, and the mean per-point ratio over the second half of the points."""
    common = sorted(set(curve) & set(ref))
    if not common or any(ref[t] <= 0 for t in common):
        return None
    last = common[-1]
    half = [t for t in common if t >= last / 2]
    return dict(tokens=last, end=curve[last] / ref[last], second_half=statistics.fmean(curve[t] / ref[t] for t in half))


def summarize(seeds: dict[int, dict[str, dict[int, float]]]) -> dict[str, dict]:
    """variant -> its ratio at each seed and the means over the seeds that have it and its reference."""
    out: dict[str, dict] = {}
    for seed, runs in sorted(seeds.items()):
        for name, curve in sorted(runs.items()):
            ref = runs.get(reference_name(name) or "")
            if ref is None or ref is curve:
                continue
            r = ratios(curve, ref)
            if r is not None:
                out.setdefault(name, dict(reference=reference_name(name), per_seed={}))["per_seed"][seed] = r
    for entry in out.values():
        per_seed = entry["per_seed"].values()
        entry["seeds"] = len(per_seed)
        entry["mean_end"] = statistics.fmean(r["end"] for r in per_seed)
        entry["mean_second_half"] = statistics.fmean(r["second_half"] for r in per_seed)
        entry["worst_end"] = max(r["end"] for r in per_seed)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.seeds", description=__doc__.split("\n")[0])
    p.add_argument("folder", type=Path, help="holds s{seed}-*.json, each a benchmarks.convergence result")
    args = p.parse_args(argv)
    summary = summarize(load_runs(args.folder))
    if not summary:
        print(f"no pair of a variant and its blocking FP32 run of the same seed in {args.folder}", file=sys.stderr)
        return 1
    rows = []
    for name, entry in summary.items():
        for seed, r in entry["per_seed"].items():
            rows.append((name, seed, r["end"], r["second_half"]))
        rows.append((name, f"mean of {entry['seeds']}", entry["mean_end"], entry["mean_second_half"]))
    print_table("held-out loss / blocking FP32 of the same seed", ["run", "seed", "at the end", "second half"], rows)
    (args.folder / f"{NAME}.json").write_text(json.dumps(dict(benchmark=NAME, variants=summary), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
