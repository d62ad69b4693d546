"""What one part's check costs in memory: a reader's check of an accusation's proof, and a reducer's robust mean.

A reader that checks a proof (``swarm.defence.average_proof.proves_wrong_average``) decodes every counted sender's
part of one index and recomputes it with the run's rule (``audit.recompute``, then ``audit.matches_either_way``
when the reducer's average is not it); a reducer makes the same robust mean for every part of its slice. The largest
part a run allows is 2^20 values (``swarm.averager.bounds``), here in fp4 from 3 and from 8 senders, the reducer's
average -4x the senders' mean, so the check goes the whole way. Each figure is the rise of the process's peak RSS
over what it held just before the call (the encoded parts for a check, the decoded ones for a reducer), in a fresh
process on one thread with the averager's allocator settings, for the current code and ``--baseline``'s, on the
same inputs. ``slack`` is how far the process's peak was above what it held before the call (a rise below it would
not show).

    python -m benchmarks.check_memory                   # writes results/check_memory.json
    python -m benchmarks.check_memory --smoke           # small parts, no baseline
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
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

NAME = "check_memory"
REPO = Path(__file__).resolve().parent.parent
BASELINE_REF = "fc32f39"  # before the order statistics a block at a time and the parts decoded into one tensor
VALUES = 1 << 20  # the largest part a run allows
SENDERS = [3, 8]
WHAT = ("check", "reduce")
MIB = 1 << 20


def make_inputs(path: Path, values: int, senders: int) -> None:
    """Each sender's part in fp4 (correlated: a shared direction and its own noise) and the reducer's lie."""
    import torch

    from swarm.averager.allreduce import encode_average
    from swarm.averager.codecs import CODECS

    codec = CODECS["fp4"].compression_type
    g = torch.Generator().manual_seed(senders)
    common, total, parts = torch.randn(values, generator=g), torch.zeros(values), []
    for _ in range(senders):
        part = common + 0.5 * torch.randn(values, generator=g)
        total += part
        parts.append(encode_average(part, codec).SerializeToString())
    sent = encode_average(-4 * total / senders, codec).SerializeToString()
    weights = [float(100 + 10 * i) for i in range(senders)]
    path.write_bytes(pickle.dumps(dict(values=values, parts=parts, sent=sent, weights=weights)))


def peak_rise(what: str, inputs: Path) -> dict[str, float]:
    """(In a worker) one ``what`` on the inputs: the peak RSS rise in MiB, the slack, the seconds, the verdict."""
    import resource
    import time

    import psutil
    import torch
    from hivemind.proto import runtime_pb2

    from swarm.averager import heap
    from swarm.averager.allreduce import encode_average
    from swarm.averager.codecs import CODECS
    from swarm.defence.audit import _decode, matches_either_way, recompute
    from swarm.defence.average_proof import beyond_rounding
    from swarm.defence.robust import robust_mean
    from swarm.manifest import Aggregation

    torch.set_num_threads(1)
    heap.limit_retention()  # as in the averager: every block of 1 MiB or more mapped on its own
    rule, codec = Aggregation.centered_clip, CODECS["fp4"].compression_type
    encode = lambda v: encode_average(v, codec)  # noqa: E731
    near = lambda s, e, r: not beyond_rounding(s, e, r)  # noqa: E731

    def check(parts, sent, weights, values) -> bool:  # as ``proves_wrong_average`` does, past its bounds checks
        present = [[p] for p in parts]
        exact = recompute(present, weights, [values], rule)[0]
        sent = _decode(sent)
        if not beyond_rounding(sent, exact, _decode(encode(exact))):
            return False
        return not matches_either_way(sent, present, weights, values, rule, encode, near)

    data = pickle.loads(inputs.read_bytes())
    parts = [runtime_pb2.Tensor.FromString(b) for b in data["parts"]]
    sent, weights, values = runtime_pb2.Tensor.FromString(data["sent"]), data["weights"], data["values"]
    small = [encode(torch.randn(4096)) for _ in parts]  # warm-up: lazy imports and thread pools, not the figure
    check(small, encode(-4 * _decode(small[0])), weights, 4096)
    robust_mean([_decode(p) for p in small], weights, rule)
    decoded = [_decode(p).reshape(-1) for p in parts] if what == "reduce" else None
    heap.trim()
    held = psutil.Process().memory_info().rss
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    started = time.perf_counter()
    if what == "check":
        verdict = check(parts, sent, weights, values)
    else:
        verdict = robust_mean(decoded, weights, rule) is not None
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(
        rise_mib=round((peak - held) / MIB, 1),
        slack_mib=round(max(0, peak_before - held) / MIB, 1),
        seconds=round(seconds, 3),
        verdict=bool(verdict),
    )


def measure(code: Path, label: str, inputs: dict[int, Path]) -> dict[str, Any]:
    figures = {}
    for senders, path in inputs.items():
        for what in WHAT:
            figures[f"{what}/{senders}"] = worker_json(code, REPO, "benchmarks.check_memory", [what, str(path)], label)
    return dict(label=label, figures=figures)


def plot(runs: list[dict[str, Any]], out: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    keys = list(runs[-1]["figures"])
    width = 0.8 / len(runs)
    for n, run in enumerate(runs):
        rises = [run["figures"][key]["rise_mib"] for key in keys]
        ax.bar([i + n * width for i in range(len(keys))], rises, width, label=run["label"])
    ax.axhline(64, color="grey", linestyle=":", label="64 MB goal")
    ax.set_xticks([i + width * (len(runs) - 1) / 2 for i in range(len(keys))], keys)
    ax.set_ylabel("peak RSS rise, MiB")
    ax.set_title("one part's check (what/senders)", fontsize=9)
    ax.legend(fontsize=7)
    return save_figure(fig, out, NAME)


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:
        print(json.dumps(peak_rise(sys.argv[2], Path(sys.argv[3]))))
        return 0
    p = argparse.ArgumentParser(prog="python -m benchmarks.check_memory", description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--baseline", default=BASELINE_REF, help="git ref of the code to compare with ('' to skip)")
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args(argv)
    values, senders = VALUES, SENDERS
    if args.smoke:
        values, senders, args.baseline = 1 << 14, [3], ""
    clock, runs = Stopwatch(), []
    with scratch_dir(args.workdir, "swarm-check-memory-") as root:
        inputs = {k: root / f"inputs-{k}.pickle" for k in senders}
        for k, path in inputs.items():
            make_inputs(path, values, k)
        if args.baseline:
            runs.append(measure(baseline_tree(args.baseline, root), f"baseline {args.baseline}", inputs))
        runs.append(measure(REPO, "current", inputs))
    rows = [
        [run["label"], key, f["rise_mib"], f["slack_mib"], f["seconds"], f["verdict"]]
        for run in runs
        for key, f in run["figures"].items()
    ]
    print_table(
        f"peak RSS rise of one part's check, {values:,} values in fp4",
        ["code", "what/senders", "rise MiB", "slack MiB", "seconds", "verdict"],
        rows,
    )
    ratios = None
    if len(runs) == 2:
        base, now = runs[0]["figures"], runs[1]["figures"]
        ratios = {key: round(now[key]["rise_mib"] / max(0.1, base[key]["rise_mib"]), 2) for key in now}
        print(f"current / baseline, peak RSS rise: {ratios}")
    decoded_mib = {str(k): round(k * values * 4 / MIB, 1) for k in senders}
    fields = dict(values=values, senders=senders, decoded_parts_mib=decoded_mib, runs=runs)
    fields["current_over_baseline"] = ratios
    finish(NAME, args.out, fields, smoke=args.smoke, clock=clock, plot=lambda out: plot(runs, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
