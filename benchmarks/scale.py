"""Many peers on one machine: N real ``swarm-client`` peers in groups smaller than N, with churn.

For each N (``--peers``): the `tiny` preset, a target group size below N (``--group``), two-stage rounds (the
client's default), every ``--churn-every`` rounds of the swarm one random peer SIGKILLed and a new one joining.
The swarm runs until its epoch reaches ``--rounds``. Reported per N, from the peers' ``--log-json`` lines:

- the share of peer-rounds whose work reached the model the swarm went on from (``counted``: the peer's
  pseudo-gradient is in the round's swarm average and the peer ended the round on it);
- distinct checksums among the live peers at the last epoch they all reached (one model: 1), of those that finished
  a round (``live_without_rounds``: joiners still on their way in at the end);
- round time (a peer's wall time between rounds), matchmaking time, groups merged per round;
- bytes per peer per round (all-reduce payload sent + received, both stages and the fetch of the swarm's average);
- DHT records read and written per peer per second (their counters, over the swarm phase);
- peak PSS per peer (its whole process tree: trainer, DHT, averager, p2pd);
- throughput: the swarm's tokens per second against N times one peer training alone, and against N peers
  training alone side by side (each in a run of its own): on shared cores the second is what the swarm can
  reach; the first is what a machine per peer would give.

Peers listen on 127.0.0.1 (no network namespaces, no root). Run: ``python -m benchmarks.scale``.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

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
from benchmarks.peers import JoinInfo, read_records, wait_for_join_info
from benchmarks.pss import tree_pss

NAME = "scale"
SOLO_INNER_STEPS = 100_000  # the alone baselines train without a round
REPO = Path(__file__).resolve().parent.parent


@dataclass
class Peer:
    index: int
    proc: subprocess.Popen
    stdout: Path
    log_json: Path
    started: float
    pss_peak: int = 0
    killed: bool = False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rounds(self) -> list[dict]:
        return read_records(self.log_json, "round")

    def steps(self) -> list[dict]:
        return read_records(self.log_json, "step")


@dataclass
class Phase:
    peers: list[Peer] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)


def spawn(index: int, workdir: Path, overrides: list[str], join: JoinInfo | None, name: str) -> Peer:
    head = ["start", "--preset", "tiny", *(a for o in overrides for a in ("--set", o))]
    if join is not None:
        head = ["join", "--initial-peers", *join.maddrs, "--run", join.run_id]
    folder = workdir / f"peer{index}"
    folder.mkdir(parents=True, exist_ok=True)
    log_json, stdout = folder / "log.jsonl", folder / "stdout.log"
    command = [
        sys.executable, "-m", "client.cli", *head, "--host-ip", "127.0.0.1", "--host-port", "0", "--device", "cpu",
        "--workdir", str(folder), "--name", f"{name}-{index}", "--no-dashboard", "--log-json", str(log_json),
    ]  # fmt: skip
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # a lent machine's packages too
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=path)
    with stdout.open("w") as handle:
        proc = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=REPO, **tied_to_us())
    return Peer(index, proc, stdout, log_json, time.time())


def join_info(peer: Peer, timeout: float = 240) -> JoinInfo:
    return wait_for_join_info(peer, timeout)  # duck-typed: index, proc, stdout, alive()


def sample_memory(phase: Phase, every: float = 2.0) -> threading.Thread:
    """Each live peer's peak PSS (its whole process tree), in the background."""

    def run() -> None:
        while not phase.stop.wait(every):
            for peer in phase.peers:
                if peer.alive():
                    try:
                        peer.pss_peak = max(peer.pss_peak, sum(tree_pss(psutil.Process(peer.proc.pid)).values()))
                    except psutil.Error:
                        pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def stop(peers: list[Peer], timeout: float = 40) -> None:
    for peer in peers:
        if peer.alive():
            peer.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for peer in peers:
        try:
            peer.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            peer.proc.kill()


def tokens_per_second(peers: list[Peer], start: float, end: float) -> float:
    """Tokens the peers' inner steps processed between ``start`` and ``end`` (unix time), per second."""
    steps = [s for p in peers for s in p.steps() if start <= s["time"] <= end]
    tokens = sum(s["tokens_per_second"] * s["step_seconds"] for s in steps)
    return tokens / max(1e-6, end - start)


def solo(workdir: Path, count: int, seconds: float, overrides: list[str]) -> float:
    """``count`` peers training alone side by side, each in a run of its own: their tokens per second, summed.
    Rounds of H = ``SOLO_INNER_STEPS`` (none while measured): a peer alone in a run of H = 10 spent most of its time
    in rounds with nobody (3.9 s of compute in 32 s), which flattered the swarm against it."""
    solo_overrides = [o for o in overrides if not o.startswith("inner_steps=")] + [f"inner_steps={SOLO_INNER_STEPS}"]
    peers = [spawn(i, workdir, [*solo_overrides, f"name=solo-{i}"], None, "solo") for i in range(count)]
    try:
        for peer in peers:
            join_info(peer)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not all(p.steps() for p in peers):
            time.sleep(0.5)
        start = time.time()
        time.sleep(seconds)
        return tokens_per_second(peers, start, time.time())
    finally:
        stop(peers)


def swarm_phase(args: argparse.Namespace, n: int, workdir: Path, overrides: list[str]) -> tuple[Phase, float, float]:
    """N peers in one run, with churn, until the swarm's epoch reaches ``--rounds``; (phase, start, end)."""
    rng = random.Random(args.seed + n)
    phase = Phase()
    first = spawn(0, workdir, overrides, None, "scale")
    phase.peers.append(first)
    info = join_info(first)
    for index in range(1, n):
        phase.peers.append(spawn(index, workdir, [], info, "scale"))
    sample_memory(phase)
    deadline = time.monotonic() + args.timeout
    start = time.time()
    churned_at, next_index = 0, n
    while time.monotonic() < deadline:
        time.sleep(1.0)
        epochs = [max((r["epoch"] for r in p.rounds()), default=0) for p in phase.peers if p.alive() and not p.killed]
        epoch = statistics.median(epochs) if epochs else 0
        if epoch >= args.rounds:
            break
        if args.churn_every and epoch >= churned_at + args.churn_every:
            churned_at = epoch
            victims = [p for p in phase.peers if p.alive() and not p.killed and p.index != 0]
            if victims:  # peer 0 stays: it is the joiners' way in
                victim = rng.choice(victims)
                victim.killed = True
                victim.proc.send_signal(signal.SIGKILL)
                phase.peers.append(spawn(next_index, workdir, [], info, "scale"))
                next_index += 1
    end = time.time()
    phase.stop.set()
    stop([p for p in phase.peers if not p.killed])
    return phase, start, end


def went_on_from(rounds: list[dict]) -> dict[int, str]:
    """Per epoch, the state the swarm went on from: the checksum most peers' rounds ended on. A round counts when
    the peer's work is in the swarm's average (its report's ``counted``) and it ended on that state: a round whose
    swarm's average lost the vote (two second stages, say) and was re-synced away does not."""
    votes: dict[int, dict[str, int]] = {}
    for r in rounds:
        if r.get("checksum"):
            tally = votes.setdefault(r["epoch"], {})
            tally[r["checksum"]] = tally.get(r["checksum"], 0) + 1
    return {epoch: max(tally, key=lambda c: (tally[c], c)) for epoch, tally in votes.items()}


def figures(n: int, phase: Phase, start: float, end: float, solo_one: float, solo_side: float | None) -> dict:
    live = [p for p in phase.peers if not p.killed]
    every = [r for p in phase.peers for r in p.rounds()]
    rounds = [r for r in every if r.get("outcome") != "resynced"]  # rounds of work (a re-sync's report is not one)
    counted = [r for r in rounds if r.get("counted") and r.get("checksum") == went_on_from(rounds).get(r["epoch"])]
    # the live peers that finished a round (a joiner may still be downloading when the swarm reaches the end)
    last = {p.index: {r["epoch"]: r["checksum"] for r in p.rounds()} for p in live}
    last = {index: epochs for index, epochs in last.items() if epochs}
    common = min((max(epochs) for epochs in last.values()), default=0)
    at_end = {epochs.get(common) for epochs in last.values() if common in epochs}
    walls = [r["wall_seconds"] for r in rounds if r.get("wall_seconds")]
    traffic = [r["bytes_sent"] + r["bytes_received"] for r in rounds]
    rates = []
    for p in live:
        records = p.rounds()
        if len(records) >= 2:
            span = records[-1]["time"] - records[0]["time"]
            read = records[-1]["records_read"] - records[0]["records_read"]
            written = records[-1]["records_written"] - records[0]["records_written"]
            rates.append((read / max(span, 1e-6), written / max(span, 1e-6)))
    swarm_tps = tokens_per_second(phase.peers, start, end)
    return dict(
        peers=n,
        peer_rounds=len(rounds),
        counted_share=round(len(counted) / max(1, len(rounds)), 4),
        distinct_checksums_at_end=len(at_end),
        live_without_rounds=len(live) - len(last),
        final_epoch=common,
        round_seconds_median=round(statistics.median(walls), 2) if walls else None,
        matchmaking_seconds_median=round(statistics.median(r["seconds"].get("matchmaking", 0.0) for r in rounds), 2)
        if rounds
        else None,
        merged_groups_mean=round(statistics.mean(r.get("merged_groups", 1) for r in rounds), 2) if rounds else None,
        bytes_per_peer_round=round(statistics.mean(traffic)) if traffic else None,
        records_read_per_second=round(statistics.mean(r for r, _ in rates), 2) if rates else None,
        records_written_per_second=round(statistics.mean(w for _, w in rates), 2) if rates else None,
        peak_pss_mib_max=round(max((p.pss_peak for p in phase.peers), default=0) / 2**20),
        peak_pss_mib_median=round(statistics.median([p.pss_peak for p in phase.peers if p.pss_peak]) / 2**20)
        if any(p.pss_peak for p in phase.peers)
        else None,
        tokens_per_second=round(swarm_tps, 1),
        vs_n_alone=round(swarm_tps / max(1e-6, n * solo_one), 4),
        vs_n_side_by_side=round(swarm_tps / max(1e-6, solo_side), 4) if solo_side is not None else None,
        killed=sum(p.killed for p in phase.peers),
        resyncs=sum(1 for r in every if r.get("resynced")),
        outcomes={o: sum(r.get("outcome") == o for r in every) for o in {r.get("outcome") for r in every}},
    )


def plot(rows: list[dict], out: Path) -> Path | None:
    plt = pyplot()
    if plt is None or not rows:
        return None
    n = [row["peers"] for row in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].plot(n, [row["counted_share"] for row in rows], "o-")
    axes[0].set(title="share of peer-rounds counted", xlabel="peers", ylim=(0, 1.05))
    axes[1].plot(n, [row["records_read_per_second"] or 0 for row in rows], "o-", label="read")
    axes[1].plot(n, [row["records_written_per_second"] or 0 for row in rows], "o-", label="written")
    axes[1].set(title="DHT records per peer per second", xlabel="peers")
    axes[1].legend()
    axes[2].plot(n, [(row["bytes_per_peer_round"] or 0) / 1e6 for row in rows], "o-")
    axes[2].set(title="MB per peer per round", xlabel="peers")
    return save_figure(fig, out, NAME)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--peers", type=int, nargs="+", default=[4, 8, 12])
    p.add_argument("--group", type=int, default=3, help="averaging.target_group_size (below every N)")
    p.add_argument("--rounds", type=int, default=8, help="run until the swarm's epoch reaches this")
    p.add_argument("--churn-every", type=int, default=3, help="kill one peer and add one every this many rounds")
    p.add_argument("--solo-seconds", type=float, default=45.0, help="how long the alone baselines train")
    p.add_argument(
        "--side-by-side",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also N peers training alone side by side, each in a run of its own (a lent machine's short lease: off)",
    )
    p.add_argument("--timeout", type=float, default=1200.0, help="the most one N's swarm phase runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.peers, args.group, args.rounds, args.churn_every, args.solo_seconds = [3], 2, 3, 0, 10.0
    overrides = [f"averaging.target_group_size={args.group}", "inner_steps=10"]
    clock, rows = Stopwatch(), []
    with scratch_dir(args.workdir, "swarm-scale-") as workdir:
        solo_one = solo(workdir / "solo-1", 1, args.solo_seconds, overrides)
        print(f"one peer alone: {solo_one:,.0f} tokens/s", flush=True)
        for n in args.peers:
            solo_side = solo(workdir / f"solo-{n}", n, args.solo_seconds, overrides) if args.side_by_side else None
            if solo_side is not None:
                print(f"{n} peers alone side by side: {solo_side:,.0f} tokens/s", flush=True)
            phase, start, end = swarm_phase(args, n, workdir / f"swarm-{n}", overrides)
            rows.append(figures(n, phase, start, end, solo_one, solo_side))
            print(rows[-1], flush=True)
    columns = [
        *("peers", "counted_share", "distinct_checksums_at_end", "round_seconds_median", "bytes_per_peer_round"),
        *("records_read_per_second", "records_written_per_second", "peak_pss_mib_max"),
        *("vs_n_alone", "vs_n_side_by_side"),
    ]
    print_table("scale", columns, [[row[c] for c in columns] for row in rows])
    fields = dict(
        settings=dict(group=args.group, rounds=args.rounds, churn_every=args.churn_every, overrides=overrides),
        solo_one_tokens_per_second=round(solo_one, 1),
        figures=rows,
    )
    finish(NAME, args.out, fields, smoke=args.smoke, clock=clock, plot=lambda out: plot(rows, out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
