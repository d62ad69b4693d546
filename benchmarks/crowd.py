"""A crowd of peers on one machine: where its CPU goes, and what the trainers get of it.

N `tiny` peers in one run on 127.0.0.1 (groups of at most 3, H = 10, as ``benchmarks.scale``), each four processes
(trainer, DHT, averager, ``p2pd``). Once the last has joined and ``--warmup`` seconds passed, the CPU-seconds each
kind of process used are read over ``--window`` seconds, with the rounds the peers finished in it (their median
matchmaking time) and the tokens their inner steps trained. The same is done with the code of ``--baseline`` (the
DHT as hivemind runs it: every record judged on every copy and read, the run's 512-key schema, searches 20 wide),
one after the other on the same machine; the figures are the two side by side and their ratios.

    python -m benchmarks.crowd                 # 12 peers: writes results/crowd.json, crowd.png
    python -m benchmarks.crowd --smoke         # 2 peers, short windows, no baseline
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

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
from benchmarks.idle import tree_cpu
from benchmarks.memory import baseline_tree
from benchmarks.peers import read_records, wait_for_join_info

NAME = "crowd"
REPO = Path(__file__).resolve().parent.parent
BASELINE_REF = "58b03a3"  # main before swarm/hivemind_fixes/verdicts.py and beam.py, and the one-key schemas
SETS = ["averaging.target_group_size=3", "inner_steps=10"]
ROLES = ("trainer", "dht", "averager", "p2pd")


class Crowd:
    """N peers of one run, started from the code in ``code``."""

    def __init__(self, code: Path, workdir: Path, n: int):
        self.code, self.workdir, self.procs, self.logs = code, workdir, [], []
        first = self._spawn(0, ["start", "--preset", "tiny", *(a for s in SETS for a in ("--set", s))])
        join = wait_for_join_info(first, timeout=240)
        for index in range(1, n):
            self._spawn(index, ["join", "--initial-peers", *join.maddrs, "--run", join.run_id])

    def _spawn(self, index: int, head: list[str]) -> Any:
        folder = self.workdir / f"peer{index}"
        folder.mkdir(parents=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.code), env.get("PYTHONPATH", "")]))
        command = [sys.executable, "-m", "client.cli", *head, "--host-ip", "127.0.0.1", "--host-port", "0"]
        command += ["--device", "cpu", "--workdir", str(folder), "--name", f"crowd-{index}", "--no-dashboard"]
        command += ["--log-json", str(folder / "log.jsonl")]
        with (folder / "stdout.log").open("w") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=self.code,
                                    **tied_to_us())  # fmt: skip
        self.procs.append(proc)
        self.logs.append(folder / "log.jsonl")
        return _Handle(index, proc, folder / "stdout.log")

    def cpu(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for proc in self.procs:
            try:
                for role, seconds in tree_cpu(psutil.Process(proc.pid)).items():
                    total[role] = total.get(role, 0.0) + seconds
            except psutil.Error:
                continue
        return total

    def records(self, kind: str, start: float, end: float) -> list[dict]:
        return [r for log in self.logs for r in read_records(log, kind) if start <= r["time"] <= end]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()


class _Handle:
    """What ``wait_for_join_info`` reads of a peer."""

    def __init__(self, index: int, proc: subprocess.Popen, stdout: Path):
        self.index, self.proc, self.stdout = index, proc, stdout

    def alive(self) -> bool:
        return self.proc.poll() is None


def measure(code: Path, label: str, workdir: Path, n: int, warmup: float, window: float) -> dict[str, Any]:
    print(f"[{label}] {n} peers, code {code}", flush=True)
    crowd = Crowd(code, workdir, n)
    try:
        time.sleep(warmup)
        before, start = crowd.cpu(), time.time()
        time.sleep(window)
        after, end = crowd.cpu(), time.time()
        rounds, steps = crowd.records("round", start, end), crowd.records("step", start, end)
        alive = sum(proc.poll() is None for proc in crowd.procs)
    finally:
        crowd.stop()
    seconds = end - start
    cores = {role: round((after.get(role, 0.0) - before.get(role, 0.0)) / seconds, 3) for role in after}
    matchmaking = [r["seconds"].get("matchmaking", 0.0) for r in rounds]
    return dict(
        label=label,
        peers=n,
        peers_alive_at_end=alive,
        window_seconds=round(seconds, 1),
        cores_by_role=cores,
        cores=round(sum(cores.values()), 3),
        rounds_finished=len(rounds),
        matchmaking_seconds_median=round(statistics.median(matchmaking), 2) if matchmaking else None,
        tokens_per_second=round(sum(s["tokens_per_second"] * s["step_seconds"] for s in steps) / seconds, 1),
    )


def plot(runs: list[dict], out: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bottom = [0.0] * len(runs)
    for role in ROLES:
        values = [run["cores_by_role"].get(role, 0.0) for run in runs]
        ax.bar([run["label"] for run in runs], values, bottom=bottom, label=role)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("cores")
    ax.set_title(f"{runs[0]['peers']} tiny peers on one machine: where the CPU goes", fontsize=9)
    ax.legend(fontsize=8)
    return save_figure(fig, out, NAME)


def ratios(baseline: dict, current: dict) -> dict[str, float | None]:
    """Current over baseline, for the figures that moved."""

    def over(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    return dict(
        dht_cores=over(current["cores_by_role"].get("dht"), baseline["cores_by_role"].get("dht")),
        trainer_cores=over(current["cores_by_role"].get("trainer"), baseline["cores_by_role"].get("trainer")),
        tokens_per_second=over(current["tokens_per_second"], baseline["tokens_per_second"]),
        rounds_finished=over(current["rounds_finished"], baseline["rounds_finished"]),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.crowd", description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--peers", type=int, default=12)
    p.add_argument("--baseline", default=BASELINE_REF, help="git ref of the code to compare with ('' to skip)")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds after the last peer joined")
    p.add_argument("--window", type=float, default=90.0, help="seconds measured")
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.peers, args.warmup, args.window, args.baseline = 2, 5.0, 10.0, ""
    clock = Stopwatch()
    runs = []
    with scratch_dir(args.workdir, "swarm-crowd-") as root:
        if args.baseline:
            code = baseline_tree(args.baseline, root)
            runs.append(measure(code, f"baseline {args.baseline}", root / "baseline", args.peers, args.warmup,
                                args.window))  # fmt: skip
        runs.append(measure(REPO, "current", root / "current", args.peers, args.warmup, args.window))
    print_table(
        f"{args.peers} tiny peers on one machine, {args.window:.0f} s window",
        ["code", "cores: trainers", "DHTs", "averagers", "p2pd", "rounds", "matchmaking s", "tokens/s"],
        [
            [r["label"], *(r["cores_by_role"].get(role, 0.0) for role in ROLES)]
            + [r["rounds_finished"], r["matchmaking_seconds_median"], r["tokens_per_second"]]
            for r in runs
        ],
    )
    moved = ratios(*runs) if len(runs) == 2 else None
    if moved:
        print(f"current / baseline: {moved}")
    fields = dict(sets=SETS, runs=runs, current_over_baseline=moved)
    finish(NAME, args.out, fields, smoke=args.smoke, clock=clock, plot=lambda out: plot(runs, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
