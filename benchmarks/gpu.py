"""The CUDA paths on a real GPU, measured: what the CPU-only CI can only fake.

In one process, on the preset's model shape (random token ids, no data needed):
- detection and the precision the client would choose;
- the micro-batch search (real forward/backward/AdamW trials until the card runs out of memory);
- inner steps (`client.step.InnerStep`) under fp32, fp16 with the GradScaler and bf16: tokens/s and
  peak GPU memory, as ratios against fp32 measured in the same run;
- the scaler's overflow path: a step whose scaled gradients overflow fp16 is skipped, weights untouched;
- the out-of-memory paths, with the card capped (`set_per_process_memory_fraction`) to a little above
  what one micro-batch needs: a step at 4x that micro-batch halves until it fits and still ends the
  step on the same samples; under a cap below one sample it ends in the client's one-line error.
Then two real `swarm-client` peers (start + join, separate processes, 127.0.0.1) train the preset's
shape with the byte tokenizer and the built-in corpus on the one GPU, micro-batch auto.

    python -m benchmarks.gpu                  # on a CUDA machine: 150m shape, writes results/gpu.json
    python -m benchmarks.gpu --smoke          # tiny, on the CPU: checks the benchmark runs end to end
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    Stopwatch,
    add_common_args,
    finish,
    print_table,
    pyplot,
    save_figure,
    scratch_dir,
    tied_to_us,
)
from client.hardware import Hardware, Precision, choose_precision, detect
from client.microbatch import gpu_trial, search
from client.model import build_model, count_parameters, model_config
from client.preflight import DeviceKind, parse_device
from client.presets import build_manifest
from client.step import InnerStep
from swarm import SwarmError

NAME = "gpu"
REPO = Path(__file__).resolve().parent.parent
_JOIN = re.compile(r"swarm-client join --initial-peers (?P<maddrs>.+) --run (?P<run>[0-9a-f]{16})")
PRECISIONS = {
    "fp32": Precision(None, use_scaler=False),
    "fp16+scaler": Precision(torch.float16, use_scaler=True),
    "bf16": Precision(torch.bfloat16, use_scaler=False),
}


def sync(hw: Hardware) -> None:
    if hw.kind is DeviceKind.CUDA:
        torch.cuda.synchronize(hw.device)


def new_step(model, hw: Hardware, precision: Precision, micro: int, init_scale: float = 2.0**16, **kw) -> InnerStep:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cuda", enabled=precision.use_scaler, init_scale=init_scale)
    return InnerStep(model, optimizer, scaler, hw, precision, grad_clip=1.0, micro_batch=micro, **kw)


def throughput(model, hw, precision, micro, batch, steps) -> dict[str, Any]:
    step = new_step(model, hw, precision, micro)
    step(batch)  # warm-up: kernels, allocator, optimizer state
    if hw.kind is DeviceKind.CUDA:
        torch.cuda.reset_peak_memory_stats(hw.device)
    sync(hw)
    t = time.perf_counter()
    losses = [step(batch).loss for _ in range(steps)]
    sync(hw)
    seconds = (time.perf_counter() - t) / steps
    peak = torch.cuda.max_memory_allocated(hw.device) if hw.kind is DeviceKind.CUDA else None
    del step
    return dict(
        micro_batch=micro,
        step_seconds=round(seconds, 4),
        tokens_per_second=round(batch.numel() / seconds, 1),
        losses=[round(v, 4) for v in losses],
        peak_gpu_bytes=peak,
    )


def scaler_overflow(model, hw, batch) -> dict[str, Any]:
    """fp16 with a scale so large that the scaled gradients overflow: the step must be skipped."""
    before = [p.detach().clone() for p in model.parameters()]
    step = new_step(model, hw, PRECISIONS["fp16+scaler"], batch.shape[0], init_scale=2.0**40)
    result = step(batch[:2])
    unchanged = all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    return dict(skipped=result.scaler_skipped, weights_unchanged=unchanged, scale_after=step.scaler.get_scale())


def out_of_memory(model, hw, batch, micro: int, peak: int) -> dict[str, Any]:
    """Cap the card a little above one fp16 step at ``micro``, then ask for 4x that micro-batch."""
    total = torch.cuda.get_device_properties(hw.device).total_memory
    halvings: list[int] = []
    out: dict[str, Any] = dict(cap_bytes=int(peak * 1.1))
    try:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(min(1.0, peak * 1.1 / total), hw.device)
        step = new_step(
            model, hw, PRECISIONS["fp16+scaler"], micro * 4, on_micro_batch=lambda m, why: halvings.append(m)
        )
        result = step(batch[: micro * 4])
        out.update(asked=micro * 4, halvings=halvings, ended_at=step.micro_batch, loss=round(result.loss, 4))
        del step
        torch.cuda.empty_cache()
        floor = torch.cuda.memory_allocated(hw.device)  # the model alone: no sample fits in 1 MiB more
        torch.cuda.set_per_process_memory_fraction((floor + 2**20) / total, hw.device)
        step = new_step(model, hw, PRECISIONS["fp16+scaler"], 1)
        try:
            step(batch[:1])
            out["one_sample_error"] = None
        except SwarmError as e:
            out["one_sample_error"] = str(e)
        search_result = search(
            gpu_trial(model, hw, PRECISIONS["fp16+scaler"], batch.shape[1], model.config.vocab_size), 8
        )
        out["search_under_tiny_cap"] = search_result
        del step
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, hw.device)
        torch.cuda.empty_cache()
    return out


def in_process(args: argparse.Namespace, hw: Hardware) -> dict[str, Any]:
    manifest = build_manifest(args.preset, None, [f"seq_len={args.seq_len}", *args.sets])
    config = model_config(manifest)
    model = build_model(manifest).to(hw.device)
    params = count_parameters(model)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, config.vocab_size, (args.samples, args.seq_len), generator=gen)
    chosen = choose_precision(hw, prefer_bf16=manifest.mixed_precision == "bf16")
    record: dict[str, Any] = dict(parameters=params, seq_len=args.seq_len, samples_per_step=args.samples)
    record["chosen_precision"] = chosen.label
    names = list(PRECISIONS) if hw.kind is DeviceKind.CUDA else ["fp32"]
    runs: dict[str, Any] = {}
    for name in names:
        precision = PRECISIONS[name]
        limit = manifest.samples_per_step if name == chosen.label else args.samples
        t = time.perf_counter()
        found = search(gpu_trial(model, hw, precision, args.seq_len, config.vocab_size), limit)
        search_seconds = time.perf_counter() - t
        micro = max(1, min(found, args.samples))
        runs[name] = dict(search_limit=limit, search_found=found, search_seconds=round(search_seconds, 2))
        runs[name].update(throughput(model, hw, precision, micro, batch, args.steps))
        print(f"{name}: {runs[name]}", flush=True)
    base = runs["fp32"]["tokens_per_second"]
    for run in runs.values():
        run["speed_vs_fp32"] = round(run["tokens_per_second"] / base, 3)
    record["precisions"] = runs
    if hw.kind is DeviceKind.CUDA:
        record["scaler_overflow"] = scaler_overflow(model, hw, batch)
        fp16 = runs["fp16+scaler"]
        micro = max(1, fp16["micro_batch"] // 4)
        one = throughput(model, hw, PRECISIONS["fp16+scaler"], micro, batch[: micro * 4], 1)
        record["out_of_memory"] = out_of_memory(model, hw, batch, micro, one["peak_gpu_bytes"])
    print_table(
        f"inner steps, {params / 1e6:.1f}M parameters, {args.samples}x{args.seq_len} tokens per step, {hw.label}",
        ["precision", "micro-batch found (limit)", "search s", "tokens/s", "vs fp32", "peak GiB"],
        [
            [
                name,
                f"{r['search_found']} ({r['search_limit']})",
                r["search_seconds"],
                r["tokens_per_second"],
                r["speed_vs_fp32"],
                "-" if r["peak_gpu_bytes"] is None else round(r["peak_gpu_bytes"] / 2**30, 2),
            ]
            for name, r in runs.items()
        ],
    )
    del model
    if hw.kind is DeviceKind.CUDA:
        torch.cuda.empty_cache()
    return record


def two_peers(args: argparse.Namespace, device: str, workdir: Path) -> dict[str, Any]:
    """Real start + join processes on one device; their result files and JSON logs."""
    sets = [f"seq_len={args.peer_seq_len}", f"samples_per_step={args.peer_samples}", f"inner_steps={args.inner_steps}"]
    sets += ["inner.warmup_steps=10", "averaging.matchmaking_time=2.0", "averaging.consistency_timeout=10.0"]
    if args.preset != "tiny":
        sets += ["tokenizer.kind=bytes", "dataset.source=builtin", "dataset.num_shards=32"]
    sets += args.sets
    common = ["--host-ip", "127.0.0.1", "--host-port", "0", "--device", device, "--no-dashboard"]
    common += ["--max-epochs", str(args.epochs), "--eval-sequences", "16"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    procs: list[subprocess.Popen] = []

    def spawn(i: int, head: list[str]) -> subprocess.Popen:
        d = workdir / f"peer{i}"
        d.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "client.cli", *head, *common, "--workdir", str(d), "--name", f"gpu-{i}"]
        cmd += ["--log-json", str(d / "log.jsonl"), "--result-file", str(d / "result.json")]
        log = (d / "stdout.log").open("w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, **tied_to_us())
        procs.append(proc)
        return proc

    first = spawn(0, ["start", "--preset", args.preset, *(a for s in sets for a in ("--set", s))])
    deadline = time.monotonic() + 180
    match = None
    while match is None and time.monotonic() < deadline and first.poll() is None:
        match = _JOIN.search((workdir / "peer0" / "stdout.log").read_text())
        time.sleep(0.2)
    if match is not None:
        spawn(1, ["join", "--initial-peers", *match["maddrs"].split(), "--run", match["run"]])
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=args.peer_timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(None)
    peers = []
    for i in range(2):
        d = workdir / f"peer{i}"
        lines = (
            [json.loads(x) for x in (d / "log.jsonl").read_text().splitlines()] if (d / "log.jsonl").exists() else []
        )
        steps = [x for x in lines if x.get("type") == "step"]
        rounds = [x for x in lines if x.get("type") == "round"]
        result = json.loads((d / "result.json").read_text()) if (d / "result.json").exists() else {}
        log = (d / "stdout.log").read_text() if (d / "stdout.log").exists() else ""
        peers.append(
            dict(
                exit_code=codes[i] if i < len(codes) else None,
                started_line=next((x for x in log.splitlines() if " micro-batch " in x and "Peer " in x), None),
                result=result,
                rounds=[
                    {k: r.get(k) for k in ("epoch", "averaged", "group_size", "checksum", "seconds")} for r in rounds
                ],
                median_tokens_per_second=sorted(s["tokens_per_second"] for s in steps)[len(steps) // 2]
                if steps
                else None,
                micro_batch=steps[-1]["micro_batch"] if steps else None,
                log_tail=log[-1500:],
            )
        )
    return dict(manifest_sets=sets, peers=peers)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--device", default="auto", help="auto, cuda or cpu (the smoke run uses cpu)")
    p.add_argument("--preset", default="150m", help="the model's shape: tiny, 150m or 1b")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--samples", type=int, default=64, help="samples per inner step in the throughput runs")
    p.add_argument("--steps", type=int, default=3, help="timed inner steps per precision")
    p.add_argument("--epochs", type=int, default=3, help="outer rounds of the two-peer run (0: skip it)")
    p.add_argument("--inner-steps", type=int, default=20)
    p.add_argument("--peer-seq-len", type=int, default=512)
    p.add_argument("--peer-samples", type=int, default=32)
    p.add_argument("--peer-timeout", type=float, default=240.0)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument(
        "--set", dest="sets", action="append", default=[], help="manifest overrides, e.g. model.num_hidden_layers=4"
    )
    p.add_argument("--skip-in-process", action="store_true", help="only the two-peer run")
    args = p.parse_args()
    if args.smoke:
        args.device, args.preset, args.seq_len, args.samples, args.steps = "cpu", "tiny", 64, 4, 1
        args.epochs, args.inner_steps, args.peer_seq_len, args.peer_samples = 1, 2, 64, 4
    clock = Stopwatch()
    hw = detect(parse_device(args.device))
    print(f"device: {hw.label}, compute capability {hw.compute_capability}, torch {torch.__version__}", flush=True)
    fields: dict[str, Any] = dict(device=hw.label)
    if hw.kind is DeviceKind.CUDA:
        fields["cuda"] = dict(torch_cuda=torch.version.cuda, capability=hw.compute_capability, bf16=hw.bf16)
    if not args.skip_in_process:
        fields["in_process"] = in_process(args, hw)
    if args.epochs:
        with scratch_dir(args.workdir, "swarm-gpu-") as workdir:
            fields["two_peers"] = two_peers(args, hw.device.split(":")[0], workdir)
        for i, peer in enumerate(fields["two_peers"]["peers"]):
            print(f"peer {i}: exit {peer['exit_code']}, {peer['started_line']}")
            print(f"  rounds {peer['rounds']}")
            print(f"  median tokens/s {peer['median_tokens_per_second']}, result {peer['result']}")
    finish(NAME, args.out, fields, smoke=args.smoke, clock=clock, plot=lambda out: plot(fields, out))


def plot(record: dict[str, Any], out: Path) -> Path | None:
    """Tokens/s of each precision's inner steps, and the micro-batch the search found."""
    plt = pyplot()
    runs = record.get("in_process", {}).get("precisions")
    if plt is None or not runs:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(runs)
    ax.bar(names, [runs[n]["tokens_per_second"] for n in names], color="tab:blue")
    for i, n in enumerate(names):
        ax.annotate(
            f"x{runs[n]['speed_vs_fp32']:.2f}, micro {runs[n]['micro_batch']}", (i, 0), ha="center", va="bottom"
        )
    ax.set_ylabel("tokens/s (inner steps)")
    ax.set_title(f"{record['in_process']['parameters'] / 1e6:.0f}M parameters on {record['device']}", fontsize=9)
    return save_figure(fig, out, NAME)


if __name__ == "__main__":
    main()
