"""What does the dashboard cost the training loop? Inner-step throughput with and without it, in one run.

One real ``Trainer`` (tiny preset, CPU, a one-node DHT) trains without stopping
while a controller thread cycles through three phases of equal length:

- ``bare``: nothing beside the loop but the peer's own progress reporter;
- ``plain``: plus the swarm watcher (a DHT read per second, the health file), as
  with ``--no-dashboard`` or without a terminal;
- ``dashboard``: plus rich's Live dashboard, redrawn twice a second to a terminal
  console (written to /dev/null, so the terminal's own speed is left out).

Phases alternate (bare, plain, dashboard, bare, ...) so drift in the machine's load
hits all three alike. Throughput is inner steps finished per wall second in each
phase, and samples per second of step compute time. Run: ``python -m benchmarks.dashboard``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

import psutil
from rich.console import Console

from benchmarks.common import (
    Stopwatch,
    add_common_args,
    finish,
    print_table,
    pyplot,
    save_figure,
    scratch_dir,
)
from client.dashboard import DashboardSource, LiveDashboard
from client.hardware import detect
from client.monitoring import TrainingTick, gpu_memory, own_state
from client.preflight import parse_device
from client.presets import build_manifest
from client.swarm_watch import SwarmWatch
from client.telemetry import Telemetry
from client.trainer import Trainer, TrainerSettings
from swarm import NetworkConfig, start_dht
from swarm.dht.peers import read_peers

NAME = "dashboard"
PHASES = ("bare", "plain", "dashboard")
WARMUP_STEPS = 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--phase-seconds", type=float, default=6.0, help="length of each phase")
    parser.add_argument("--cycles", type=int, default=12, help="bare/plain/dashboard cycles")
    args = parser.parse_args()
    if args.smoke:
        args.phase_seconds, args.cycles = 4.0, 1
    with scratch_dir(None, "swarm-bench-dashboard-") as work:
        measure(args, work)


def measure(args: argparse.Namespace, work: Path) -> None:
    clock = Stopwatch()
    manifest = build_manifest("tiny", None, ["inner_steps=1000000"])  # no outer round during the measurement
    dht = start_dht(NetworkConfig(host_ip="127.0.0.1", host_port=0))
    steps_log = work / "steps.jsonl"
    telemetry = Telemetry(steps_log)
    hardware = detect(parse_device("cpu"))
    trainer = Trainer(
        manifest, dht, hardware, TrainerSettings(workdir=work), log=lambda line: None, telemetry=telemetry
    )
    phases: list[dict] = []
    controller = threading.Thread(
        target=_cycle, args=(trainer, dht, hardware, work, args.phase_seconds, args.cycles, phases), daemon=True
    )
    controller.start()
    try:
        trainer.run()
    finally:
        telemetry.close()
        dht.shutdown()
    controller.join(timeout=30)

    steps = [json.loads(line) for line in steps_log.read_text().splitlines()]
    steps = [s for s in steps if s["type"] == "step"]
    summary = _summarize(phases, steps, manifest.samples_per_step)
    fields = dict(
        sizes=dict(
            preset="tiny",
            parameters=trainer.parameters,
            samples_per_step=manifest.samples_per_step,
            seq_len=manifest.seq_len,
            micro_batch=trainer.micro_batch,
            phase_seconds=args.phase_seconds,
            cycles=args.cycles,
        ),
        phases=phases,
        summary=summary,
    )
    rows = [
        (name, summary[name]["steps_per_second"], summary[name]["samples_per_compute_second"], summary[name]["steps"])
        for name in PHASES
    ]
    print_table(
        "inner-step throughput by phase (medians over cycles)", ["phase", "steps/s", "samples/s", "steps"], rows
    )
    ratios = {k: summary[f"ratio_dashboard_to_{k}"] for k in ("plain", "bare")}
    shown = {k: f"{v:.3f}" if v is not None else "n/a (no steps)" for k, v in ratios.items()}
    print(f"dashboard / plain: {shown['plain']}   dashboard / bare: {shown['bare']}   (goal: >= 0.99)")
    for thread in ("watcher", "renderer"):
        share = summary[f"{thread}_cpu_share_of_one_core"]
        if share is not None:
            print(f"{thread} thread CPU: {1000 * share:.1f} ms per second ({100 * share:.2f}% of one core)")
    paired = {k: summary[f"paired_ratio_dashboard_to_{k}_median"] for k in ("plain", "bare")}
    print(
        "paired within cycles (median): "
        + "   ".join(f"dashboard / {k}: {v:.3f}" if v is not None else f"/ {k}: n/a" for k, v in paired.items())
        + f"   (spread of one phase across cycles: {summary['phase_spread_steps_per_second']:.2f} steps/s)"
    )
    finish(NAME, args.out, fields, clock=clock, head=("benchmark", "command", "machine"), plots=False)
    _plot(args.out, phases)  # after the record, which lists no plots


def _cycle(trainer, dht, hardware, work: Path, seconds: float, cycles: int, phases: list[dict]) -> None:
    """The controller: wait for the loop to warm up, run the phases, then ask the loop to stop."""
    while trainer.telemetry.steps < WARMUP_STEPS:
        time.sleep(0.1)
    run_id = trainer.manifest.run_id
    console = Console(file=open(os.devnull, "w"), force_terminal=True, width=160, height=60)  # noqa: SIM115
    try:
        for cycle in range(cycles):
            for name in PHASES:
                watch = live = None
                if name != "bare":
                    tick = TrainingTick(trainer, work, False, None)
                    watch = SwarmWatch(
                        lambda: read_peers(dht, run_id),
                        trainer.manifest,
                        trainer.telemetry,
                        self_id=dht.peer_id.to_base58(),
                        on_tick=tick,
                    ).start()
                if name == "dashboard":
                    source = DashboardSource(
                        manifest=trainer.manifest,
                        parameters=lambda: trainer.parameters,
                        telemetry=trainer.telemetry,
                        watch=watch,
                        own=lambda: own_state(trainer, False),
                        gpu_memory=gpu_memory(hardware),
                    )
                    live = LiveDashboard(source, console=console).__enter__()
                start = time.time()
                time.sleep(seconds)
                end = time.time()
                cpu = _thread_cpu_seconds(
                    watcher=watch._thread if watch is not None else None,
                    renderer=live.live._refresh_thread if live is not None else None,
                )
                if live is not None:
                    live.__exit__(None, None, None)
                if watch is not None:
                    watch.stop()
                phases.append(dict(cycle=cycle, phase=name, start=start, end=end, thread_cpu_seconds=cpu))
    finally:
        trainer.stop.requested = True


def _thread_cpu_seconds(**threads: threading.Thread | None) -> dict[str, float]:
    """CPU seconds each helper thread used so far (they start with their phase): a cost the noisy
    throughput figures cannot resolve, read from the kernel's per-thread accounting."""
    times = {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}
    return {name: times.get(t.native_id, 0.0) for name, t in threads.items() if t is not None}


def _summarize(phases: list[dict], steps: list[dict], samples_per_step: int) -> dict:
    per_phase: dict[str, list[dict]] = {name: [] for name in PHASES}
    for phase in phases:
        inside = [s for s in steps if phase["start"] <= s["time"] < phase["end"]]
        compute = sum(s["step_seconds"] for s in inside)
        phase["steps"] = len(inside)
        phase["steps_per_second"] = len(inside) / (phase["end"] - phase["start"])
        phase["samples_per_compute_second"] = len(inside) * samples_per_step / compute if compute else 0.0
        per_phase[phase["phase"]].append(phase)
    summary: dict = {}
    for name, items in per_phase.items():
        summary[name] = dict(
            steps=sum(p["steps"] for p in items),
            steps_per_second=statistics.median(p["steps_per_second"] for p in items),
            samples_per_compute_second=statistics.median(p["samples_per_compute_second"] for p in items),
        )
    rate = {name: summary[name]["steps_per_second"] for name in PHASES}
    cycles = sorted({p["cycle"] for p in phases})
    for base in ("plain", "bare"):
        summary[f"ratio_dashboard_to_{base}"] = rate["dashboard"] / rate[base] if rate[base] else None
        # paired within each cycle, so slow drift of the shared machine cancels out
        pairs = []
        for cycle in cycles:
            by = {p["phase"]: p["steps_per_second"] for p in phases if p["cycle"] == cycle}
            if by.get(base):
                pairs.append(by["dashboard"] / by[base])
        summary[f"paired_ratios_dashboard_to_{base}"] = pairs
        summary[f"paired_ratio_dashboard_to_{base}_median"] = statistics.median(pairs) if pairs else None
    for thread in ("watcher", "renderer"):
        used = [p["thread_cpu_seconds"].get(thread) for p in phases if thread in p.get("thread_cpu_seconds", {})]
        wall = [p["end"] - p["start"] for p in phases if thread in p.get("thread_cpu_seconds", {})]
        summary[f"{thread}_cpu_share_of_one_core"] = sum(used) / sum(wall) if wall else None
    summary["phase_spread_steps_per_second"] = max(
        statistics.pstdev(p["steps_per_second"] for p in items) for items in per_phase.values()
    )
    return summary


def _plot(out: Path, phases: list[dict]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = dict(bare="tab:gray", plain="tab:blue", dashboard="tab:orange")
    for name in PHASES:
        items = [p for p in phases if p["phase"] == name]
        ax.plot(
            [p["cycle"] for p in items], [p["steps_per_second"] for p in items], "o-", label=name, color=colors[name]
        )
    ax.set_xlabel("cycle")
    ax.set_ylabel("inner steps per second")
    ax.set_title("Training throughput with and without the dashboard (tiny, CPU)")
    ax.legend()
    save_figure(fig, out, NAME)


if __name__ == "__main__":
    main()
