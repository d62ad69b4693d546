"""What the fp4 codec costs: milliseconds per million values, the current code against ``--baseline``.

At 100M+ parameters on a small CPU, fp4's encoding is what a round waits for
(``benchmarks/results/memory-fp4-blocking/README.md``: a 115M blocking round's all-reduce took 70.5 s with fp4
against 29.3 s with FP16 on two cores). A round runs each
step on every value it sends or receives: the host quantizes its pseudo-gradient (error feedback), each part is
encoded for its reducer, the reducer decodes its groupmates' parts and encodes the average, and every groupmate
decodes it; auditors decode and re-encode again. This times each step on all-reduce parts of ``SLICE`` values,
through hivemind's serialization as the averager calls it, with FP16's serialization beside it, on one torch
thread. The input is pseudo-gradient-like: normal values with a scale that varies from block to block (the spread
of magnitudes across a model's tensors). Each code tree runs in its own process, one after the other, on the
same inputs; a ratio is baseline / current.

    python -m benchmarks.codec                   # writes results/codec.json
    python -m benchmarks.codec --smoke           # small parts, few repeats, no baseline
"""

from __future__ import annotations

import argparse
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

NAME = "codec"
REPO = Path(__file__).resolve().parent.parent
BASELINE_REF = "368ee96"  # main before the numpy codes, the table decode and Huffman-only deflate
PARTS = 8  # parts of SLICE values per repeat
STEPS = ("quantize", "encode", "decode", "fp16 encode", "fp16 decode")


def time_steps(values: int, parts: int, repeats: int) -> dict[str, Any]:
    """Median milliseconds per million values of each step, and fp4's bytes per value (run in a worker)."""
    import torch
    from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
    from hivemind.proto import runtime_pb2

    from swarm.averager.codecs import CODECS, fp4_quantize

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    inputs = []
    for _ in range(parts):
        scale = torch.exp(2 * torch.randn(values // 1024, 1, generator=g)) * 1e-3
        inputs.append((torch.randn(values // 1024, 1024, generator=g) * scale).view(-1))
    fp4, fp16 = CODECS["fp4"].compression_type, runtime_pb2.CompressionType.FLOAT16
    quantized = [fp4_quantize(x) for x in inputs]
    sent = [serialize_torch_tensor(q, fp4) for q in quantized]
    sent16 = [serialize_torch_tensor(x, fp16) for x in inputs]
    steps = {
        "quantize": lambda i: fp4_quantize(inputs[i]),
        "encode": lambda i: serialize_torch_tensor(quantized[i], fp4),
        "decode": lambda i: deserialize_torch_tensor(sent[i]),
        "fp16 encode": lambda i: serialize_torch_tensor(inputs[i], fp16),
        "fp16 decode": lambda i: deserialize_torch_tensor(sent16[i]),
    }
    for i in range(parts):  # what the averager relies on: decoding gives back exactly what was quantized
        assert torch.equal(deserialize_torch_tensor(sent[i]), quantized[i])
    ms: dict[str, float] = {}
    for name, step in steps.items():
        step(0)  # warm-up
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            for i in range(parts):
                step(i)
            seconds.append(time.perf_counter() - start)
        ms[name] = round(1e3 * statistics.median(seconds) / (parts * values / 1e6), 2)
    size = sum(len(m.buffer) for m in sent)
    return dict(ms_per_million=ms, fp4_bytes_per_value=round(size / (parts * values), 4))


def plot(runs: list[dict[str, Any]], out: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        xs = [j + i * width for j in range(len(STEPS))]
        ax.bar(xs, [run["ms_per_million"][step] for step in STEPS], width, label=run["label"])
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(STEPS))], STEPS, fontsize=8)
    ax.set_ylabel("ms per million values")
    ax.set_title("fp4 codec steps (FP16's beside them), one thread", fontsize=9)
    ax.legend(fontsize=7)
    return save_figure(fig, out, NAME)


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:
        import json

        print(json.dumps(time_steps(*map(int, sys.argv[2:]))))
        return 0
    p = argparse.ArgumentParser(prog="python -m benchmarks.codec", description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--baseline", default=BASELINE_REF, help="git ref of the code to compare with ('' to skip)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args(argv)
    from swarm.averager.codecs import SLICE

    values, parts = SLICE, PARTS
    if args.smoke:
        values, parts, args.repeats, args.baseline = 8 * 1024, 2, 2, ""
    clock = Stopwatch()
    runs = []
    worker_args = [str(values), str(parts), str(args.repeats)]
    with scratch_dir(args.workdir, "swarm-codec-") as root:
        trees = ([(baseline_tree(args.baseline, root), f"baseline {args.baseline}")] if args.baseline else []) + [
            (REPO, "current")
        ]
        for code, label in trees:
            runs.append(dict(label=label, **worker_json(code, REPO, "benchmarks.codec", worker_args, label)))
    rows = [[run["label"], step, run["ms_per_million"][step]] for run in runs for step in STEPS]
    print_table(
        f"ms per million values, {parts} parts of {values:,}, median of {args.repeats}, one thread",
        ["code", "step", "ms / million values"],
        rows,
    )
    for run in runs:
        print(f"{run['label']}: fp4 {run['fp4_bytes_per_value']} bytes per value")
    ratios = None
    if len(runs) == 2:
        base, now = runs[0]["ms_per_million"], runs[1]["ms_per_million"]
        ratios = {step: round(base[step] / now[step], 2) for step in STEPS}
        print(f"baseline / current, ms per million values: {ratios}")
    fields = dict(part_values=values, parts=parts, runs=runs, baseline_over_current=ratios)
    finish(NAME, args.out, fields, smoke=args.smoke, clock=clock, plot=lambda out: plot(runs, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
