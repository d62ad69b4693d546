"""What a peer waiting for groupmates costs its machine: CPU-seconds per second of its whole process tree.

A `tiny` peer starts a run alone (nobody ever joins) with a long matchmaking timeout, so after its
first H steps it sits in matchmaking, as a volunteer's peer does while slower peers finish their
steps. Once its status says so, the CPU time of the trainer, the DHT and averager processes and
p2pd is read over a window. The same is done with the code of ``--baseline`` (before hivemind's
search for a leader was paced, ``swarm/hivemind_fixes/pace.py``), one after the other on the same machine.

    python -m benchmarks.idle                 # writes results/idle.json, idle.png
    python -m benchmarks.idle --smoke         # a short window, no baseline
"""

from __future__ import annotations

import argparse
import json
import os
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
from benchmarks.memory import baseline_tree
from benchmarks.pss import tree_by_role

NAME = "idle"
REPO = Path(__file__).resolve().parent.parent
BASELINE_REF = "41d4000"  # main before swarm/hivemind_fixes/pace.py
SETS = [
    # blocking rounds: an overlapped peer trains the next round's steps while its round is in flight, and waits
    # only when those are done (its status said "matchmaking" meanwhile until 2026-11-28; it says "training" now,
    # and the round's stage in "round"). A blocking peer in matchmaking waits, and the search whose pacing this
    # measures is the same in both modes (a CI run caught the training: 0.70)
    "averaging.overlap=false",
    "inner_steps=3",
    "averaging.matchmaking_time=5.0",
    "averaging.matchmaking_timeout=600.0",
    "averaging.wait_for_peers=600.0",
]


def tree_cpu(root: psutil.Process) -> dict[str, float]:
    """CPU seconds (user + system) so far of ``root`` and its descendants, by role (``tree_by_role``)."""
    return tree_by_role(root, lambda proc: sum(proc.cpu_times()[:2]))


def state(workdir: Path) -> str:
    try:
        return json.loads((workdir / "status.json").read_text())["state"]
    except (OSError, ValueError, KeyError):
        return "starting"


def measure(code: Path, label: str, workdir: Path, window: float, timeout: float) -> dict[str, Any]:
    workdir.mkdir(parents=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code), env.get("PYTHONPATH", "")]))
    command = [
        sys.executable,
        "-m",
        "client.cli",
        "start",
        "--preset",
        "tiny",
        *(a for s in SETS for a in ("--set", s)),
    ]
    command += ["--host-ip", "127.0.0.1", "--host-port", "0", "--device", "cpu", "--no-dashboard"]
    command += ["--workdir", str(workdir / "peer")]
    print(f"[{label}] code {code}", flush=True)
    with (workdir / "peer.log").open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=code, **tied_to_us())
    try:
        deadline = time.monotonic() + timeout
        while state(workdir / "peer") != "matchmaking":
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(
                    f"[{label}] never reached matchmaking:\n{(workdir / 'peer.log').read_text()[-3000:]}"
                )
            time.sleep(0.2)
        time.sleep(1.0)  # past the search's start
        root = psutil.Process(proc.pid)
        before, t0 = tree_cpu(root), time.monotonic()
        time.sleep(window)
        after, seconds = tree_cpu(root), time.monotonic() - t0
        still = state(workdir / "peer")
    finally:
        proc.kill()
        proc.wait(timeout=30)
        for child in psutil.Process().children(recursive=True):  # its orphaned helpers reap themselves; be sure
            if child.name() == "p2pd":
                child.kill()
    by_role = {role: round((after[role] - before.get(role, 0.0)) / seconds, 4) for role in after}
    return dict(
        label=label,
        window_seconds=round(seconds, 2),
        state_at_end=still,
        cpu_seconds_per_second=round(sum(by_role.values()), 4),
        by_role=by_role,
    )


def plot(runs: list[dict], out: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    roles = sorted({r for run in runs for r in run["by_role"]})
    bottom = [0.0] * len(runs)
    for role in roles:
        values = [run["by_role"].get(role, 0.0) for run in runs]
        ax.bar([run["label"] for run in runs], values, bottom=bottom, label=role)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("CPU-seconds per second")
    ax.set_title("a tiny peer waiting in matchmaking: its process tree", fontsize=9)
    ax.legend(fontsize=8)
    return save_figure(fig, out, NAME)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.idle", description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--baseline", default=BASELINE_REF, help="git ref of the code to compare with ('' to skip)")
    p.add_argument("--window", type=float, default=20.0, help="seconds of waiting measured")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to reach matchmaking")
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.window, args.baseline = 3.0, ""
    clock = Stopwatch()
    runs = []
    with scratch_dir(args.workdir, "swarm-idle-") as root:
        if args.baseline:
            code = baseline_tree(args.baseline, root)
            runs.append(measure(code, f"baseline {args.baseline}", root / "baseline", args.window, args.timeout))
        runs.append(measure(REPO, "current", root / "current", args.window, args.timeout))
    ratio = None
    if len(runs) == 2 and runs[1]["cpu_seconds_per_second"] > 0:
        ratio = round(runs[0]["cpu_seconds_per_second"] / runs[1]["cpu_seconds_per_second"], 1)
    print_table(
        f"a tiny peer alone in matchmaking, {args.window:.0f} s window",
        ["code", "CPU-s/s", "by process", "state at end"],
        [[r["label"], r["cpu_seconds_per_second"], r["by_role"], r["state_at_end"]] for r in runs],
    )
    if ratio is not None:
        print(f"baseline / current: {ratio}x the CPU")
    fields = dict(sets=SETS, runs=runs, baseline_over_current=ratio)
    finish(NAME, args.out, fields, smoke=args.smoke, clock=clock, plot=lambda out: plot(runs, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
