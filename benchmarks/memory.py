"""Memory per parameter: peak PSS of two real peers' process trees, phase by phase, against older code.

Two ``swarm-client`` peers run a model of over 100M parameters on the CPU, on
127.0.0.1. The first starts the run and takes a round alone (its first
checkpoint); the second joins, downloads the state from the first (which serves
it), and they average ``--rounds`` rounds together; then both get SIGTERM at
once. A sampler reads the PSS of each peer's whole tree (trainer, DHT,
averager, p2pd) every 0.2 s and files it under what the peer was doing then,
read from its ``status.json`` (``serving state`` while the other downloads from
it, ``leaving`` after SIGTERM).

The same scenario runs first on the code of ``--baseline`` (a git ref, checked
out into a temporary worktree) and then on this checkout, so the ratio is
measured in one run on one machine. Also reported: the budget (36 bytes per
parameter plus 1.5 GiB), checkpoint sizes on disk, the training time lost after
each round (the gap between a round's end and the next inner step, which held
the synchronous checkpoint before), and seconds from SIGTERM to exit.

Run: ``python -m benchmarks.memory`` (about 15 minutes here).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
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
from benchmarks.peers import read_records
from benchmarks.pss import TreeSampler

NAME = "memory"
REPO = Path(__file__).resolve().parent.parent
GIB = 2**30
BUDGET_PER_PARAM, BUDGET_FIXED = 36, 1.5 * GIB
MODEL_GRADS_ADAM = 16  # fp32 weights, gradients and AdamW's two moments, per parameter

BASELINE_REF = "3f3be2b"  # main before the memory work of the real-sizes issue
_JOIN = re.compile(r"swarm-client join --initial-peers (?P<maddrs>.+) --run (?P<run>[0-9a-f]{16})")


def manifest_sets(args: argparse.Namespace) -> list[str]:
    """The 150m preset's shape with fewer layers, the byte tokenizer and the built-in corpus (no hub here);
    the tiny preset as it is for --smoke."""
    sets = []
    if args.preset != "tiny":
        sets += ["tokenizer.kind=bytes", "dataset.source=builtin", "dataset.num_shards=32"]
        sets += [f"model.num_hidden_layers={args.layers}"]
    sets += [
        f"seq_len={args.seq_len}",
        f"samples_per_step={args.samples}",
        f"inner_steps={args.inner_steps}",
        "inner.warmup_steps=10",
        "averaging.matchmaking_time=2.0",
        "averaging.matchmaking_timeout=10.0",
        "averaging.consistency_timeout=5.0",
    ]
    return [a for s in sets for a in ("--set", s)]


def count_params(args: argparse.Namespace) -> int:
    from client.model import manifest_parameters
    from client.presets import build_manifest

    sets = manifest_sets(args)[1::2]
    return manifest_parameters(build_manifest(args.preset, None, sets))


class Peer:
    """One `swarm-client` process of one code version, with its sampler."""

    def __init__(self, code: Path, workdir: Path, name: str, argv: list[str], device: str = "cpu"):
        self.workdir, self.name = workdir / name, name
        self.log, self.jsonl = workdir / f"{name}.log", workdir / f"{name}.jsonl"
        self.serving = self.leaving = False
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH", "")]))
        command = [sys.executable, "-m", "client.cli", *argv]
        command += ["--host-ip", "127.0.0.1", "--host-port", "0", "--device", device, "--name", name]
        command += ["--workdir", str(self.workdir), "--no-dashboard", "--log-json", str(self.jsonl)]
        with self.log.open("w") as handle:
            self.proc = subprocess.Popen(
                command, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=code, **tied_to_us()
            )
        self.started = time.time()
        self.sampler = TreeSampler(self.proc.pid, self.phase).start()

    def state(self) -> str:
        """The status file's state, or the stage of a round averaging in the background while the peer trains:
        the averager's buffers are what that phase measures."""
        try:
            status = json.loads((self.workdir / "status.json").read_text())
            return status.get("round") or status["state"]
        except (OSError, ValueError, KeyError):
            return "starting"

    def phase(self) -> str:
        if self.leaving:
            return "leaving"
        if self.serving:
            return "serving state"
        return self.state()

    def records(self, kind: str) -> list[dict]:
        return read_records(self.jsonl, kind)

    def text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def wait_for(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited ({self.proc.returncode}) waiting for {what}:\n{self.text()[-3000:]}"
                )
            time.sleep(0.3)
        raise RuntimeError(f"{self.name}: no {what} after {timeout:.0f} s:\n{self.text()[-3000:]}")

    def stop(self) -> None:
        self.sampler.stop()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def after_round_pauses(peer: Peer) -> list[float]:
    """Seconds from each round's end to the start of the next inner step: training time the round's
    bookkeeping (checkpoint included) cost after the all-reduce."""
    rounds = [r["time"] for r in peer.records("round")]
    steps = [(s["time"] - s["step_seconds"], s["time"]) for s in peer.records("step")]
    pauses = []
    for end in rounds:
        start = next((s for s, _ in steps if s >= end), None)
        if start is not None:
            pauses.append(round(start - end, 3))
    return pauses


def is_checkpoint(name: str) -> bool:
    """One checkpoint file: a state file now, checkpoint-EPOCH-STEP.pt in the code before."""
    return name.endswith(".safetensors") or name.startswith("checkpoint-")


def checkpoint_files(peer: Peer) -> list[dict]:
    found = []
    for path in sorted((peer.workdir / "runs").glob("*/checkpoints/*")):
        if path.is_file() and not path.name.startswith("."):
            found.append(dict(name=path.name, bytes=path.stat().st_size))
    return found


def run_scenario(code: Path, label: str, args: argparse.Namespace, root: Path) -> dict:
    """The first peer starts and rounds alone, the second joins and downloads, both average, both leave."""
    workdir = root / label
    workdir.mkdir(parents=True)
    print(f"[{label}] code {code}", flush=True)
    sets = manifest_sets(args)
    if code == REPO or args.baseline_sets:  # --set may name fields the baseline's code does not have
        sets += [a for s in args.sets for a in ("--set", s)]
    a = Peer(
        code,
        workdir,
        "a",
        ["start", "--preset", args.preset, *sets, "--micro-batch", str(args.micro_batch), *args.peer_args],
        args.device,
    )
    peers = [a]
    try:
        match = a.wait_for(lambda: _JOIN.search(a.text()), args.timeout, "join line")
        a.wait_for(lambda: a.records("round"), args.timeout, "first round")
        print(f"[{label}] a finished its first round; b joins", flush=True)
        join = ["join", "--initial-peers", *match["maddrs"].split(), "--run", match["run"]]
        b = Peer(code, workdir, "b", [*join, "--micro-batch", str(args.micro_batch), *args.peer_args], args.device)
        peers.append(b)

        def b_downloaded() -> bool:
            a.serving = b.state() in ("downloading state", "starting") and b.proc.poll() is None
            return any(r["type"] == "step" for r in b.records("step"))

        b.wait_for(b_downloaded, args.timeout, "first inner step")
        a.serving = False
        together = lambda: sum(r["averaged"] and r["group_size"] > 1 for r in b.records("round")) >= args.rounds  # noqa: E731
        b.wait_for(together, args.timeout * args.rounds, f"{args.rounds} averaged rounds")
        print(f"[{label}] {args.rounds} rounds averaged; SIGTERM to both", flush=True)
        sent = time.monotonic()
        for p in peers:
            p.leaving = True
            p.proc.send_signal(signal.SIGTERM)
            p.sampler.sample()
        leave = {}
        for p in peers:
            try:
                code_ = p.proc.wait(timeout=args.leave_timeout)
                leave[p.name] = dict(seconds=round(time.monotonic() - sent, 2), exit_code=code_)
            except subprocess.TimeoutExpired:
                leave[p.name] = dict(seconds=None, exit_code=None)
        time.sleep(0.5)
    finally:
        for p in peers:
            p.stop()
    return dict(
        label=label,
        code=str(code),
        peers={
            p.name: dict(
                peak_pss=p.sampler.overall.total,
                peak_by_role=p.sampler.overall.by_role,
                peak_phase=next((k for k, v in p.sampler.peaks.items() if v.at == p.sampler.overall.at), None),
                phases={k: dict(pss=v.total, by_role=v.by_role) for k, v in sorted(p.sampler.peaks.items())},
                samples=p.sampler.samples,
                after_round_pauses=after_round_pauses(p),
                checkpoints=checkpoint_files(p),
                # state files written in the background (the code before wrote them on the training thread)
                checkpoint_writes=[
                    dict(epoch=r["epoch"], bytes=r["bytes"], seconds=r["seconds"]) for r in p.records("checkpoint")
                ],
                leave=leave.get(p.name),
                rounds=len(p.records("round")),
                # where each averaged round's time went (all-reduce, audit, ...): the reducer's work is in them
                averaged_round_seconds=[r["seconds"] for r in p.records("round") if r["averaged"]],
                # what its audits of the other reducers' slices downloaded (averaging.audit_parts: all, or a sample)
                averaged_round_audit_bytes=[r.get("audit_bytes", 0) for r in p.records("round") if r["averaged"]],
            )
            for p in peers
        },
    )


def baseline_tree(ref: str, root: Path) -> Path:
    """The code of ``ref`` in a temporary directory (git archive: no worktree bookkeeping left behind)."""
    target = root / f"code-{ref}"
    target.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", ref, "swarm", "client"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target


def per_param(run: dict, params: int) -> dict:
    return {name: round(peer["peak_pss"] / params, 2) for name, peer in run["peers"].items()}


def report(record: dict) -> None:
    params = record["sizes"]["parameters"]
    rows = []
    for run in record["runs"]:
        for name, peer in run["peers"].items():
            for phase, figures in peer["phases"].items():
                rows.append((run["label"], name, phase, figures["pss"] / GIB, figures["pss"] / params))
    print_table("peak PSS of each peer's process tree, by phase", ["code", "peer", "phase", "GiB", "B/param"], rows)
    rows = []
    for run in record["runs"]:
        for name, peer in run["peers"].items():
            roles = peer["peak_by_role"]
            pauses = peer["after_round_pauses"]
            leave = peer["leave"] or {}
            rows.append(
                (
                    run["label"],
                    name,
                    peer["peak_pss"] / GIB,
                    peer["peak_pss"] / params,
                    " ".join(f"{k}={v / GIB:.2f}" for k, v in sorted(roles.items())),
                    max(pauses) if pauses else "-",
                    max((c["bytes"] for c in peer["checkpoints"] if is_checkpoint(c["name"])), default=0) / GIB,
                    sum(c["bytes"] for c in peer["checkpoints"]) / GIB,
                    leave.get("seconds"),
                )
            )
    print_table(
        "peaks, after-round pauses, checkpoints and leaving",
        ["code", "peer", "peak GiB", "B/param", "at the peak (GiB)", "max pause s", "ckpt GiB", "disk GiB", "leave s"],
        rows,
    )
    for run in record["runs"]:
        for name, peer in run["peers"].items():
            for seconds in peer.get("averaged_round_seconds", []):
                phases = " ".join(f"{k} {v:.1f}" for k, v in seconds.items())
                print(f"{run['label']} {name}: an averaged round's seconds: {phases}")
    for run in record["runs"]:
        for name, peer in run["peers"].items():
            writes = [w for w in peer.get("checkpoint_writes", []) if w["seconds"] > 0]
            if writes:
                rate = sum(w["bytes"] for w in writes) / sum(w["seconds"] for w in writes) / 1e6
                print(
                    f"{run['label']} {name}: {len(writes)} state files written in the background, "
                    f"{writes[-1]['bytes'] / 1e6:.0f} MB each, {rate:.0f} MB/s"
                )
    print(json.dumps(record["ratios"], indent=1))


def plot(record: dict, out: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    params = record["sizes"]["parameters"]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    phases = sorted({ph for run in record["runs"] for p in run["peers"].values() for ph in p["phases"]})
    width = 0.8 / (2 * len(record["runs"]))
    for i, run in enumerate(record["runs"]):
        for j, (name, peer) in enumerate(sorted(run["peers"].items())):
            values = [peer["phases"].get(ph, {}).get("pss", 0) / params for ph in phases]
            offset = (2 * i + j) * width
            ax.bar([k + offset for k in range(len(phases))], values, width, label=f"{run['label']} peer {name}")
    budget = BUDGET_PER_PARAM + BUDGET_FIXED / params
    ax.axhline(budget, color="red", linestyle="--", label=f"budget {budget:.1f} B/param")
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(phases))], phases, rotation=20)
    ax.set_ylabel("peak PSS, bytes per parameter")
    ax.set_title(f"Peak PSS of a peer's process tree, {params / 1e6:.0f}M parameters, CPU")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save_figure(fig, out, NAME)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--baseline", default=BASELINE_REF, help="git ref of the code to compare with ('' to skip)")
    p.add_argument("--preset", default="150m", help="the model's shape (150m: with --layers layers)")
    p.add_argument("--layers", type=int, default=4, help="transformer layers of the 150m shape (4: 115M parameters)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--samples", type=int, default=2, help="samples per inner step")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--inner-steps", type=int, default=3, help="H")
    p.add_argument("--rounds", type=int, default=2, help="rounds the two peers average together")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for each stage")
    p.add_argument("--leave-timeout", type=float, default=90.0)
    p.add_argument("--workdir", type=Path, default=None, help="keep the peers' files here (default: temporary)")
    p.add_argument("--device", default="cpu", help="where the peers train: cpu, or cuda (host memory is measured)")
    p.add_argument("--set", dest="sets", action="append", default=[], help="manifest overrides for the current code")
    p.add_argument("--baseline-sets", action="store_true", help="apply --set to the baseline's run too")
    p.add_argument(
        "--peer-arg", dest="peer_args", action="append", default=[], help="a client flag for every peer of both runs"
    )
    args = p.parse_args(argv)
    # the tiny model, no baseline: checks the benchmark end to end, not the budget. Three rounds, not one: the
    # joiner's whole life was then about a second, and the status file it is labelled by is rewritten once a
    # second, so a CI run saw it only "starting" and "leaving"
    if args.smoke:
        args.preset, args.rounds, args.baseline = "tiny", 3, ""
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    clock = Stopwatch()
    params = count_params(args)
    print(f"model: {params / 1e6:.1f}M parameters", flush=True)
    runs = []
    with scratch_dir(args.workdir, "swarm-memory-") as root:
        if args.baseline:
            runs.append(run_scenario(baseline_tree(args.baseline, root), f"baseline {args.baseline}", args, root))
        runs.append(run_scenario(REPO, "current", args, root))
    budget = BUDGET_PER_PARAM * params + BUDGET_FIXED
    current = runs[-1]
    ratios = dict(
        bytes_per_param={run["label"]: per_param(run, params) for run in runs},
        budget_bytes=int(budget),
        within_budget={name: peer["peak_pss"] <= budget for name, peer in current["peers"].items()},
    )
    if args.device == "cpu":  # what a GPU peer's host would hold: the model, its gradients and AdamW's moments
        ratios["without_model_grads_adam_per_param"] = {  # (16 B/param) move to the device
            name: round((peer["peak_pss"] - MODEL_GRADS_ADAM * params) / params, 2)
            for name, peer in current["peers"].items()
        }
    if len(runs) == 2:
        ratios["current_over_baseline"] = {
            name: round(peer["peak_pss"] / runs[0]["peers"][name]["peak_pss"], 3)
            for name, peer in current["peers"].items()
        }
    fields = dict(
        sizes=dict(
            parameters=params,
            device=args.device,
            layers=args.layers,
            seq_len=args.seq_len,
            samples_per_step=args.samples,
            micro_batch=args.micro_batch,
            inner_steps=args.inner_steps,
            rounds_together=args.rounds,
        ),
        runs=runs,
        ratios=ratios,
    )
    report(fields)
    finish(NAME, args.out, fields, smoke=args.smoke, clock=clock, plot=lambda out: plot(fields, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
