"""Peers of unequal speed: does a peer several times slower than the rest still average in every round?

Real ``swarm-client`` peers on 127.0.0.1. Once all of them train, one is put in a cgroup
(v1 ``cpu``) whose CFS quota gives its training process ``1 / --slowdown`` of the CPU
time a fast peer gets (its DHT, averager and p2pd are left alone: the network side of a
slow GPU is not slow). For ``--rounds`` rounds of the fast peers, it counts the rounds
each peer averaged in with others against the rounds the swarm completed while it was
there, and reports the speeds actually reached (inner steps per second).

Run (as root, for the cgroup): ``python -m benchmarks.slowpeer``.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

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
from benchmarks.peers import read_records as records

NAME = "slowpeer"
REPO = Path(__file__).resolve().parent.parent
CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")
_JOIN = re.compile(r"swarm-client join --initial-peers (?P<maddrs>.+) --run (?P<run>[0-9a-f]{16})")


class Throttle:
    """A cgroup v1 CPU quota for one process (its threads; not the processes it already forked)."""

    def __init__(self, share_of_a_core: float):
        self.path = CGROUP_ROOT / f"swarm-slowpeer-{os.getpid()}"
        self.share = share_of_a_core

    def __enter__(self) -> Throttle:
        if os.geteuid() != 0:
            raise SystemExit("This benchmark slows one peer with a cgroup CPU quota, which needs root.")
        if not (CGROUP_ROOT / "cpu.cfs_quota_us").exists():
            raise SystemExit(f"no cgroup v1 cpu controller at {CGROUP_ROOT}: this benchmark needs one (and root)")
        self.path.mkdir(exist_ok=True)
        period = int((self.path / "cpu.cfs_period_us").read_text())
        (self.path / "cpu.cfs_quota_us").write_text(str(max(1000, int(period * self.share))))
        return self

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def __exit__(self, *exc) -> None:
        try:
            for pid in (self.path / "cgroup.procs").read_text().split():  # back to the root group
                (CGROUP_ROOT / "cgroup.procs").write_text(pid)
            self.path.rmdir()
        except OSError:
            pass


def spawn(index: int, args: argparse.Namespace, workdir: Path, head: list[str]) -> tuple[subprocess.Popen, Path, Path]:
    log, jsonl = workdir / f"peer{index}.log", workdir / f"peer{index}.jsonl"
    command = [sys.executable, "-m", "client.cli", *head, "--host-ip", "127.0.0.1", "--host-port", "0"]
    command += ["--device", "cpu", "--workdir", str(workdir / f"peer{index}"), "--name", f"p{index}"]
    command += ["--no-dashboard", "--log-json", str(jsonl)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    with log.open("w") as handle:
        proc = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=REPO, **tied_to_us())
    return proc, log, jsonl


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.slowpeer", description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--slowdown", type=float, default=4.0, help="the slow peer's CPU share is a fast one's / this")
    p.add_argument("--rounds", type=int, default=12, help="rounds of the swarm to measure")
    p.add_argument("--inner-steps", type=int, default=20, help="H")
    p.add_argument("--set", dest="sets", action="append", default=[], help="extra manifest overrides")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--workdir", type=Path, default=None, help="keep the peers' folders and logs here")
    args = p.parse_args(argv)
    if args.smoke:
        # 4 rounds, not 2: in a 7 s window a peer on a loaded CI machine once ended no round at all
        args.rounds, args.inner_steps = 4, 5
        # an eighth of a fast peer's share, not a quarter: CI runs two tests at a time, and with another test's peers
        # on the cores a fast peer got so little that a quarter share no longer made a step much slower (1.2x)
        args.slowdown = max(args.slowdown, 8.0)
    with scratch_dir(args.workdir, "swarm-slowpeer-") as workdir:
        return measure(args, workdir)


def measure(args: argparse.Namespace, workdir: Path) -> int:
    clock = Stopwatch()
    sets = [f"inner_steps={args.inner_steps}", "averaging.matchmaking_time=2.0", *args.sets]
    cores = os.cpu_count() or 1
    fast_share = min(1.0, cores / args.peers)  # the fast peers share the cores
    slow = args.peers - 1
    print(f"{args.peers} peers, H={args.inner_steps}; peer {slow} gets {fast_share / args.slowdown:.3f} of a core")
    procs: list[tuple[subprocess.Popen, Path, Path]] = []
    with Throttle(fast_share / args.slowdown) as throttle:
        try:
            procs.append(
                spawn(0, args, workdir, ["start", "--preset", "tiny", *(a for s in sets for a in ("--set", s))])
            )
            deadline = time.monotonic() + 180
            while not (match := _JOIN.search(procs[0][1].read_text() if procs[0][1].exists() else "")):
                if time.monotonic() > deadline or procs[0][0].poll() is not None:
                    raise SystemExit(f"the first peer did not start:\n{procs[0][1].read_text()[-3000:]}")
                time.sleep(0.3)
            join = ["join", "--initial-peers", *match["maddrs"].split(), "--run", match["run"]]
            for i in range(1, args.peers):
                procs.append(spawn(i, args, workdir, join))
            deadline = time.monotonic() + 300
            while not all(records(j, "step") for _, _, j in procs):
                if time.monotonic() > deadline:
                    raise SystemExit("not every peer started training")
                time.sleep(0.5)
            throttle.add(procs[slow][0].pid)
            start = time.time()
            start_epoch = max((r["epoch"] for r in records(procs[0][2], "round")), default=0)
            print(f"throttled peer {slow} at epoch {start_epoch}", flush=True)
            deadline = time.monotonic() + args.timeout
            while max((r["epoch"] for r in records(procs[0][2], "round")), default=0) < start_epoch + args.rounds:
                if time.monotonic() > deadline:
                    print("timed out; reporting what there is", flush=True)
                    break
                for proc, log, _ in procs:
                    if proc.poll() is not None:
                        raise SystemExit(f"a peer exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
                time.sleep(1.0)
            end = time.time()
        finally:
            for proc, _, _ in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc, _, _ in procs:
                try:
                    proc.wait(timeout=40)
                except subprocess.TimeoutExpired:
                    proc.kill()
    per_peer = {}
    swarm_rounds = max(0, max((r["epoch"] for r in records(procs[0][2], "round") if r["time"] <= end), default=0))
    swarm_rounds -= start_epoch
    for i, (_, _, jsonl) in enumerate(procs):
        rounds = [r for r in records(jsonl, "round") if start <= r["time"] <= end + 1]
        steps = [r for r in records(jsonl, "step") if start <= r["time"] <= end]
        # the swarm's rounds this peer averaged in, each counted once: a round it finished just after peer 0's
        # last counted one, or a round it ran twice (after a re-sync), is not another swarm round
        averaged_epochs = {
            r["epoch"]
            for r in rounds
            if r["averaged"] and r["group_size"] > 1 and start_epoch < r["epoch"] <= start_epoch + swarm_rounds
        }
        per_peer[i] = dict(
            slow=i == slow,
            rounds=len(rounds),
            averaged=sum(bool(r["averaged"] and r["group_size"] > 1) for r in rounds),
            share_of_swarm_rounds=len(averaged_epochs) / swarm_rounds if swarm_rounds else None,
            fallbacks=sorted({r["fallback_reason"] for r in rounds if r["fallback_reason"]}),
            resynced=sum(bool(r.get("resynced")) for r in rounds),
            behind=sum(r.get("resync_reason") == "behind" for r in rounds),  # the swarm finished them without it
            steps_per_second=len(steps) / (end - start) if end > start else None,
            median_step_seconds=statistics.median(s["step_seconds"] for s in steps) if steps else None,
            samples_per_round=statistics.fmean(r["samples"] for r in rounds) if rounds else None,
        )
    fast = [v["steps_per_second"] for v in per_peer.values() if not v["slow"] and v["steps_per_second"]]
    speed_ratio = (
        statistics.fmean(fast) / per_peer[slow]["steps_per_second"]
        if fast and per_peer[slow]["steps_per_second"]
        else None
    )
    fast_shares = [v["share_of_swarm_rounds"] for v in per_peer.values() if not v["slow"]]
    fast_share_mean = statistics.fmean(fast_shares) if None not in fast_shares and fast_shares else None
    slow_share = per_peer[slow]["share_of_swarm_rounds"]
    fields = dict(
        sizes=dict(peers=args.peers, inner_steps=args.inner_steps, slowdown_quota=args.slowdown, sets=sets),
        swarm_rounds=swarm_rounds,
        measured_seconds=round(end - start, 1),
        speed_ratio_fast_over_slow=speed_ratio,
        slow_peer_share_of_rounds_averaged=slow_share,
        # the baseline in the same run: the fast peers' own share
        ratios=dict(
            slow_share_over_fast_share=slow_share / fast_share_mean
            if slow_share is not None and fast_share_mean
            else None
        ),
        per_peer=per_peer,
    )
    print_table(
        f"{swarm_rounds} swarm rounds; the slow peer ran {speed_ratio or 0:.1f}x slower; its share over the fast"
        f" peers' {fields['ratios']['slow_share_over_fast_share'] or 0:.2f}",
        ["peer", "slow", "rounds", "averaged", "share", "steps/s", "samples/round", "resynced"],
        [
            (
                i,
                v["slow"],
                v["rounds"],
                v["averaged"],
                v["share_of_swarm_rounds"],
                v["steps_per_second"],
                v["samples_per_round"],
                v["resynced"],
            )
            for i, v in per_peer.items()
        ],
    )
    finish(NAME, args.out, fields, smoke=args.smoke, clock=clock, plot=lambda out: plot(fields, out))
    return 0


def plot(record: dict, out: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    peers = record["per_peer"]
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [f"peer {i}{' (slow)' if v['slow'] else ''}" for i, v in peers.items()]
    bars = ax.bar(
        labels,
        [100 * (v["share_of_swarm_rounds"] or 0) for v in peers.values()],
        color=["tab:red" if v["slow"] else "tab:blue" for v in peers.values()],
    )
    ax.bar_label(bars, fmt="%.0f%%")
    ax.axhline(90, color="gray", linestyle="--", label="goal for the slow peer: 90%")
    ax.set_ylim(0, 110)
    ax.set_ylabel("rounds averaged in, % of the swarm's rounds")
    ax.set_title(f"a peer {record['speed_ratio_fast_over_slow'] or 0:.1f}x slower than the rest")
    ax.legend(fontsize=8)
    return save_figure(fig, out, NAME)


if __name__ == "__main__":
    sys.exit(main())
