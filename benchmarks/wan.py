"""Real peers on slow links: how busy does the compute stay, and where does a round's time go?

Four real ``swarm-client`` processes, each in its own network namespace behind a
``tc tbf``-shaped link (see benchmarks/netns.py). One swarm per mode (a wire
format, blocking or overlapped rounds: ``--modes``) runs through phases of link
rate: unlimited first, then each ``--rates`` value, with the limit changed live on
every link. A phase counts only rounds that started after its limit was set; the
first round of the run (start-up, state download) is left out.

Per peer it records compute utilization (the inner steps' seconds over the wall
seconds from its first measured round's start to its last's end); per round, the
split (compute, matchmaking, all-reduce, outer step, other), the all-reduce
payload against the butterfly theory and per parameter, the wire bytes on the
veth, and (blocking rounds) the all-reduce goodput as a share of the link rate. In an
overlapped round the all-reduce runs while the next round trains: its seconds are
not idle time, and ``waited`` is what the loop did wait for it.

Run (as root): ``python -m benchmarks.wan``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks.common import (
    Stopwatch,
    add_common_args,
    command_line,
    finish,
    print_table,
    pyplot,
    rate_label,
    save_figure,
    scratch_dir,
)
from benchmarks.netns import CounterSampler, Lab, require_root
from benchmarks.peers import PeerProcess, spawn_peer, stop_all, tail, wait_for_join_info
from client.model import build_model, count_parameters
from client.presets import build_manifest

NAME = "wan"
MODES = {  # name: (averaging.compression, averaging.overlap)
    "fp32": ("none", False),
    "fp16": ("fp16", False),
    "fp4": ("fp4", False),  # blocking fp4: a quarter of FP16's bytes, with no overlap's per-token cost
    "fp16-overlap": ("fp16", True),
    "fp4-overlap": ("fp4", True),
    "fp4-overlap-nice0": ("fp4", True),  # the training at the priority it started with: client.priority's baseline
    "sparse-overlap": ("sparse", True),
    "fp16-unchecked": ("fp16", False),  # without the audits of reducers: what checking them costs on each link
    "fp4-overlap-unchecked": ("fp4", True),
    "fp16-sampled": ("fp16", False),  # audits of a random sample of each slice's parts (averaging.audit_parts)
    "fp4-overlap-sampled": ("fp4", True),
}
CLI_FLAGS = {"fp4-overlap-nice0": ["--nice", "0"]}  # per mode, for every peer
SAMPLED_PARTS = 2  # of the 10-13 parts of each slice of tiny's, among 4 peers
SETTINGS = {mode: ["averaging.checked_reducers=false"] for mode in MODES if mode.endswith("-unchecked")}
SETTINGS |= {mode: [f"averaging.audit_parts={SAMPLED_PARTS}"] for mode in MODES if mode.endswith("-sampled")}
BYTES_PER_VALUE = {"none": 4, "fp16": 2, "fp4": 0.5 + 1 / 1024, "sparse": None}  # sparse: what the data says
PARTS = ("compute", "matchmaking", "allreduce", "landing", "outer", "consistency", "waited")


def butterfly_bytes(numel: int, group_size: int, bytes_per_value: int) -> float:
    """Payload one peer sends (and receives) in a butterfly all-reduce: scatter-reduce, then all-gather."""
    return 2 * bytes_per_value * numel * (group_size - 1) / group_size


def overrides(args: argparse.Namespace, mode: str) -> list[str]:
    compression, overlap = MODES[mode]
    return [
        f"inner_steps={args.inner_steps}",
        f"averaging.compression={compression}",
        f"averaging.overlap={'true' if overlap else 'false'}",
        f"averaging.target_group_size={args.peers}",
        f"averaging.matchmaking_time={args.matchmaking_time}",
        *SETTINGS.get(mode, []),
    ]


def round_start(record: dict) -> float:
    return record["time"] - record["wall_seconds"]


def wait_until(condition, timeout: float, peers: list[PeerProcess], what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- peer {p.index}\n{tail(p.stdout, 1500)}" for p in peers)
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}\n{logs}")
        dead = [p for p in peers if not p.alive()]
        if dead:
            raise RuntimeError(f"peer {dead[0].index} exited ({dead[0].proc.returncode}):\n{tail(dead[0].stdout)}")
        time.sleep(0.5)


def run_swarm(args: argparse.Namespace, lab: Lab, wire: str, workdir: Path) -> list[dict]:
    """One swarm through every rate phase; returns the phases with their rounds."""
    lab.set_rate(None)
    flags = CLI_FLAGS.get(wire, [])
    peers = [spawn_peer(lab, 0, workdir, overrides(args, wire), extra=flags, threads=args.threads)]
    try:
        join = wait_for_join_info(peers[0])
        peers += [
            spawn_peer(lab, i, workdir, join=join, extra=flags, threads=args.threads) for i in range(1, args.peers)
        ]
        wait_until(lambda: all(p.rounds() for p in peers), args.phase_timeout, peers, "every peer's first round")
        sampler = CounterSampler(lab)
        sampler.start()
        phases = []
        for rate in [None, *args.rates]:
            lab.set_rate(rate)
            start = time.time()
            print(f"  {wire}: links {rate_label(rate, ' Mbit/s')}", flush=True)

            def enough(start: float = start) -> bool:
                return all(len([r for r in p.rounds() if round_start(r) >= start]) >= args.rounds for p in peers)

            wait_until(enough, args.phase_timeout, peers, f"{args.rounds} rounds at {rate} Mbit/s")
            end = time.time()
            phases.append(dict(rate_mbit=rate, start=start, end=end))
        time.sleep(1.0)
        sampler.stop()
    finally:
        stop_all(peers)
    return [collect_phase(phase, peers, sampler, args.rounds) for phase in phases]


def collect_phase(phase: dict, peers: list[PeerProcess], sampler: CounterSampler, rounds: int) -> dict:
    """The phase's rounds per peer, each with its wire bytes read off the veth counters."""
    out = dict(phase, peers={})
    for p in peers:
        selected = [r for r in p.rounds() if phase["start"] <= round_start(r) and r["time"] <= phase["end"] + 0.5]
        rows = []
        for r in selected[:rounds]:
            wire = sampler.window(p.index, round_start(r), r["time"])
            rows.append(
                dict(
                    epoch=r["epoch"],
                    time=r["time"],  # wall clock when the round was reported (one clock for all peers of the lab)
                    averaged=r["averaged"],
                    counted=r.get("counted"),  # its work in the average the swarm went on from (two-stage rounds)
                    group_size=r["group_size"],
                    fallback_reason=r.get("fallback_reason"),
                    wall_seconds=r["wall_seconds"],
                    seconds={k: r["seconds"].get(k, 0.0) for k in PARTS},
                    audit_seconds=r["seconds"].get("audit", 0.0),  # within the all-reduce: checking the reducers
                    audit_bytes=r.get("audit_bytes", 0),  # parts those audits downloaded
                    bytes_sent=r.get("bytes_sent"),
                    bytes_received=r.get("bytes_received"),
                    wire_tx_bytes=wire[0] if wire else None,
                    wire_rx_bytes=wire[1] if wire else None,
                    steps_late=r.get("steps_late"),  # overlapped: inner steps taken while the round was in flight
                )
            )
        out["peers"][p.index] = rows
        # utilization from the steps themselves: in an overlapped swarm a round is reported when its average
        # lands, inside the next round, so one round's compute and wall time do not line up
        if selected:
            first, last = round_start(selected[0]), selected[: len(rows)][-1]["time"]
            steps = [s for s in p.records("step") if first <= s["time"] - s["step_seconds"] and s["time"] <= last]
            out.setdefault("windows", {})[p.index] = dict(
                seconds=last - first, compute=sum(s["step_seconds"] for s in steps), steps=len(steps)
            )
    return out


def phase_figures(phase: dict, wire: str, numel: int) -> dict:
    """Utilization, time split, bytes and goodput of one phase, per peer and overall."""
    rate = phase["rate_mbit"]
    per_peer, all_rows = {}, []
    for index, rows in phase["peers"].items():
        for r in rows:
            r["utilization"] = r["seconds"]["compute"] / r["wall_seconds"] if r["wall_seconds"] > 0 else None
            r["other_seconds"] = max(0.0, r["wall_seconds"] - sum(r["seconds"].values()))
            k = r["group_size"]
            per_value = BYTES_PER_VALUE[MODES[wire][0]]
            averaged = r["averaged"] and k > 1
            r["theory_bytes"] = butterfly_bytes(numel, k, per_value) if averaged and per_value else None
            # one encoded pseudo-gradient per parameter, both directions: payload / (2 (k-1)/k N)
            r["bytes_per_param"] = r["bytes_sent"] / butterfly_bytes(numel, k, 1) if averaged else None
            ar = r["seconds"]["allreduce"]
            # an overlapped round's all-reduce is timed between inner steps, too coarsely for a rate
            timed = not MODES[wire][1]
            mbit = r["bytes_sent"] * 8 / ar / 1e6 if timed and r["bytes_sent"] and ar > 0 else None
            r["allreduce_goodput_mbit"] = mbit
            r["goodput_share_of_link"] = mbit / rate if mbit is not None and rate else None
        window = phase.get("windows", {}).get(index)
        per_peer[index] = dict(
            rounds=len(rows),
            utilization=window["compute"] / window["seconds"] if window and window["seconds"] > 0 else None,
        )
        all_rows += rows

    def mean(key: str, source: str | None = None) -> float | None:
        values = [(r[source][key] if source else r[key]) for r in all_rows]
        values = [v for v in values if v is not None]
        return statistics.fmean(values) if values else None

    windows = list(phase.get("windows", {}).values())
    wall = sum(w["seconds"] for w in windows)
    averaged_sent = [r["bytes_sent"] for r in all_rows if r["theory_bytes"] is not None]
    return dict(
        rate_mbit=rate,
        rounds=len(all_rows),
        averaged_rounds=sum(r["averaged"] for r in all_rows),
        counted_rounds=sum(bool(r.get("counted")) for r in all_rows),
        # inner-step seconds over wall seconds, per peer from its first measured round's start to its last's end
        utilization=sum(w["compute"] for w in windows) / wall if wall else None,
        utilization_per_peer=per_peer,
        round_seconds=mean("wall_seconds"),
        seconds={k: mean(k, "seconds") for k in PARTS} | {"other": mean("other_seconds")},
        payload_sent_bytes=mean("bytes_sent"),
        # over the rounds theory_bytes counts (averaged in a group): a round that found no group sends little or
        # nothing, and pulled the mean of all rounds below the theory of the averaged ones (0.7999 in a smoke)
        payload_sent_bytes_averaged=statistics.fmean(averaged_sent) if averaged_sent else None,
        bytes_per_param=mean("bytes_per_param"),
        payload_received_bytes=mean("bytes_received"),
        theory_bytes=mean("theory_bytes"),
        wire_tx_bytes=mean("wire_tx_bytes"),
        wire_rx_bytes=mean("wire_rx_bytes"),
        allreduce_goodput_mbit=mean("allreduce_goodput_mbit"),
        goodput_share_of_link=mean("goodput_share_of_link"),
        steps_late=mean("steps_late"),
        audit_seconds=mean("audit_seconds"),
        audit_bytes=mean("audit_bytes"),
    )


def slowdowns(figures: dict[str, list[dict]]) -> dict:
    """Each limited phase's mean round time against the unlimited phase's.

    On a shared CPU the inner steps' speed drifts between phases, so the plain ratio
    mixes link and CPU effects; ``equal_compute_ratio`` holds compute at the
    unlimited phase's and compares only the rest of the round (matchmaking,
    all-reduce, outer step, consistency check, bookkeeping).
    """
    out = {}
    for wire, phases in figures.items():
        base = phases[0]
        base_rest = base["round_seconds"] - base["seconds"]["compute"]
        for ph in phases[1:]:
            rest = ph["round_seconds"] - ph["seconds"]["compute"]
            out[f"{wire}@{ph['rate_mbit']:g}mbit"] = dict(
                round_time_ratio=ph["round_seconds"] / base["round_seconds"],
                equal_compute_ratio=(base["seconds"]["compute"] + rest) / base["round_seconds"],
                non_compute_seconds=rest,
                non_compute_seconds_unlimited=base_rest,
                allreduce_seconds=ph["seconds"]["allreduce"],
                allreduce_seconds_unlimited=base["seconds"]["allreduce"],
            )
    return out


def plot(figures: dict[str, list[dict]], out: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    labels, stacks = [], {k: [] for k in (*PARTS, "other")}
    utilization = []
    for wire, phases in figures.items():
        for ph in phases:
            labels.append(f"{wire}\n{rate_label(ph['rate_mbit'], ' Mb/s')}")
            for k in stacks:
                stacks[k].append(ph["seconds"][k] or 0.0)
            utilization.append(ph["utilization"] or 0.0)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    bottom = [0.0] * len(labels)
    for k, values in stacks.items():
        ax1.bar(labels, values, bottom=bottom, label=k)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax1.set_ylabel("seconds per round (mean over peers and rounds)")
    ax1.set_title("where a round's time goes")
    ax1.legend(fontsize=8)
    bars = ax2.bar(labels, [u * 100 for u in utilization], color="tab:green")
    ax2.bar_label(bars, fmt="%.0f%%")
    ax2.axhspan(90, 95, color="tab:blue", alpha=0.15, label="OpenDiLoCo 90-95%")
    ax2.set_ylim(0, 100)
    ax2.set_ylabel("compute utilization (%)")
    ax2.set_title("share of wall time in inner steps")
    ax2.legend(fontsize=8, loc="lower right")
    return save_figure(fig, out, NAME)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.wan", description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--rates", type=float, nargs="+", default=[100.0, 10.0], help="link rates in Mbit/s")
    p.add_argument("--modes", dest="wires", nargs="+", choices=list(MODES), default=["fp16", "fp4-overlap"])
    p.add_argument("--inner-steps", type=int, default=10, help="H")
    p.add_argument("--rounds", type=int, default=2, help="measured rounds per peer and phase")
    p.add_argument("--matchmaking-time", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per peer")
    p.add_argument("--phase-timeout", type=float, default=240.0)
    p.add_argument("--workdir", type=Path, default=None, help="keep the peers' files here (default: temporary)")
    p.add_argument("--reanalyze", type=Path, default=None, help="recompute figures and plot from a result's raw rounds")
    args = p.parse_args(argv)
    if args.smoke:
        args.peers, args.rates, args.inner_steps, args.rounds = 2, [20.0], 3, 1
        args.matchmaking_time, args.phase_timeout = 1.0, 150.0
    return args


def report(record: dict) -> None:
    """Print the tables."""
    rows = []
    for wire, phases in record["figures"].items():
        for ph in phases:
            s = ph["seconds"]
            rows.append(
                (
                    wire,
                    rate_label(ph["rate_mbit"]),
                    ph["rounds"],
                    "-" if ph["utilization"] is None else f"{ph['utilization'] * 100:.1f}%",
                    ph["round_seconds"],
                    s["compute"],
                    s["matchmaking"],
                    s["allreduce"],
                    s["landing"],
                    s["outer"],
                    s["other"],
                    (ph["payload_sent_bytes"] or 0) / 1e6,
                    (ph["theory_bytes"] or 0) / 1e6,
                    (ph["wire_tx_bytes"] or 0) / 1e6,
                    "-" if ph["goodput_share_of_link"] is None else f"{ph['goodput_share_of_link'] * 100:.0f}%",
                )
            )
    print_table(
        "per round, mean over peers (seconds; MB = 1e6 bytes sent per peer)",
        [
            "wire",
            "Mbit/s",
            "rounds",
            "util.",
            "round",
            "compute",
            "match.",
            "all-red.",
            "landing",
            "outer",
            "other",
            "payload MB",
            "theory MB",
            "wire tx MB",
            "goodput/link",
        ],
        rows,
    )
    print_table(
        "outer round vs unlimited links",
        ["phase", "round time ratio", "at equal compute", "non-compute s", "all-reduce s"],
        [
            (k, v["round_time_ratio"], v["equal_compute_ratio"], v["non_compute_seconds"], v["allreduce_seconds"])
            for k, v in record["slowdown_vs_unlimited"].items()
        ],
    )


def reanalyze(path: Path, out: Path) -> int:
    """Figures, table and plot again from the raw rounds a run recorded (no peers are started)."""
    record = json.loads(path.read_text())
    numel = record["sizes"]["parameters"]
    for phases in record["rounds"].values():
        for ph in phases:
            ph["peers"] = {int(k): v for k, v in ph["peers"].items()}
    record["figures"] = {w: [phase_figures(ph, w, numel) for ph in phases] for w, phases in record["rounds"].items()}
    record["slowdown_vs_unlimited"] = slowdowns(record["figures"])
    record["reanalyzed_by"] = command_line()
    report(record)
    finish(NAME, out, record, head=(), plot=lambda out: plot(record["figures"], out))  # its keys where they were
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.reanalyze:
        return reanalyze(args.reanalyze, args.out)
    require_root()
    clock = Stopwatch()
    manifest = build_manifest("tiny", overrides=[f"inner_steps={args.inner_steps}"])
    numel = count_parameters(build_model(manifest))
    raw, figures = {}, {}
    with scratch_dir(args.workdir, "swarm-bench-wan-") as workdir, Lab() as lab:
        print(
            f"wan: {args.peers} peers, tiny preset ({numel / 1e6:.2f}M parameters), H={args.inner_steps}; files in "
            f"{workdir}"
        )
        for wire in args.wires:
            raw[wire] = run_swarm(args, lab, wire, workdir / wire)
            figures[wire] = [phase_figures(ph, wire, numel) for ph in raw[wire]]
    fields = dict(
        sizes=dict(
            peers=args.peers,
            parameters=numel,
            inner_steps=args.inner_steps,
            samples_per_step=manifest.samples_per_step,
            seq_len=manifest.seq_len,
            rates_mbit=args.rates,
            rounds_per_phase=args.rounds,
            threads_per_peer=args.threads,
            tbf="rate R, burst max(64 KiB, 20 ms at R), latency 100 ms, on both ends of every veth",
            theory_bytes_per_round={
                w: butterfly_bytes(numel, args.peers, BYTES_PER_VALUE[MODES[w][0]])
                for w in args.wires
                if BYTES_PER_VALUE[MODES[w][0]]
            },
        ),
        figures=figures,
        slowdown_vs_unlimited=slowdowns(figures),
        rounds=raw,
    )
    report(fields)
    finish(
        NAME,
        args.out,
        fields,
        smoke=args.smoke,
        clock=clock,
        plot=lambda out: plot(figures, out),
        head=("benchmark", "command", "smoke", "machine"),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
