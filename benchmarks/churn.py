"""Joining and churn with real peers: how long until a newcomer helps, and what a SIGKILL costs the rest.

Real ``swarm-client`` processes, each in its own network namespace (benchmarks/netns.py).

Join: the run starts with one peer; newcomers then join one at a time, each with
every link shaped to one of ``--join-rates``. For each: time from launching
``swarm-client join`` to its state being loaded, to its first inner step and to
its first round averaged with the group, set against the outer state's size over
the link rate (the state download's lower bound).

Churn: every ``--every`` rounds one random peer is SIGKILLed and a new one joins.
Reported: rounds completed per peer, rounds that fell back to local averaging, the
longest stall of any survivor (the longest gap between two of its inner steps)
against the configured matchmaking + all-reduce (+ consistency) timeouts, and how
often peers held different parameters after a round (checksums) and whether each
such disagreement was repaired later.

Run (as root): ``python -m benchmarks.churn``.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from benchmarks.common import Stopwatch, add_common_args, command_line, machine_info, print_table, pyplot, write_json
from benchmarks.netns import Lab, require_root
from benchmarks.peers import JoinInfo, PeerProcess, spawn_peer, stop_all, tail, wait_for_join_info
from client.model import build_model, count_parameters
from client.presets import build_manifest

NAME = "churn"


class Swarm:
    """The live peers, how to reach them, and every peer that ever ran (for the records)."""

    def __init__(self, args: argparse.Namespace, lab: Lab, workdir: Path):
        self.args, self.lab, self.workdir = args, lab, workdir
        self.all: list[PeerProcess] = []
        self.maddrs: dict[int, list[str]] = {}
        self.run_id = ""
        self.killed: dict[int, float] = {}  # index -> unix time of SIGKILL

    @property
    def alive(self) -> list[PeerProcess]:
        return [p for p in self.all if p.alive() and p.index not in self.killed]

    def start(self) -> PeerProcess:
        peer = spawn_peer(self.lab, 0, self.workdir, self.args.overrides, threads=self.args.threads)
        self.all.append(peer)
        info = wait_for_join_info(peer)
        self.maddrs[0], self.run_id = info.maddrs, info.run_id
        return peer

    def join(self) -> PeerProcess:
        index = max(p.index for p in self.all) + 1
        known = [a for p in self.alive for a in self.maddrs.get(p.index, [])]
        peer = spawn_peer(self.lab, index, self.workdir, join=JoinInfo(known, self.run_id), threads=self.args.threads)
        self.all.append(peer)
        self.maddrs[index] = wait_for_join_info(peer).maddrs
        return peer

    def kill(self, peer: PeerProcess) -> None:
        self.killed[peer.index] = time.time()
        self.lab.kill_processes(peer.index)
        peer.kill()
        self.lab.remove_peer(peer.index)

    def max_epoch(self) -> int:
        return max((r["epoch"] for p in self.alive for r in p.rounds()), default=0)

    def check_alive(self) -> None:
        for p in self.all:
            if not p.alive() and p.index not in self.killed:
                raise RuntimeError(f"peer {p.index} exited ({p.proc.returncode}):\n{tail(p.stdout)}")


def wait(condition, timeout: float, swarm: Swarm, what: str) -> bool:
    """Wait for ``condition``; False (and a note) on timeout, so a slow join is a figure, not a crash."""
    deadline = time.monotonic() + timeout
    while not condition():
        swarm.check_alive()
        if time.monotonic() > deadline:
            print(f"  timed out after {timeout:.0f} s waiting for {what}", flush=True)
            return False
        time.sleep(0.3)
    return True


def first(records: list[dict], predicate=lambda r: True) -> dict | None:
    return next((r for r in records if predicate(r)), None)


def join_figures(peer: PeerProcess, rate: float | None, state_bytes: int) -> dict:
    """Launch -> state loaded -> first inner step -> first averaged round, for one newcomer."""
    records = peer.records()
    loaded = first(records, lambda r: r["type"] == "event" and r["kind"] == "state_loaded")
    step = first(records, lambda r: r["type"] == "step")
    averaged = first(records, lambda r: r["type"] == "round" and r["averaged"] and r["group_size"] > 1)
    failed = [r for r in records if r["type"] == "event" and r["kind"] == "download_failed"]

    def since(record: dict | None) -> float | None:
        return round(record["time"] - peer.started_at, 2) if record else None

    return dict(
        peer=peer.index,
        rate_mbit=rate,
        state_bytes=state_bytes,
        state_over_link_seconds=state_bytes * 8 / (rate * 1e6) if rate else None,
        to_state_loaded=since(loaded),
        to_first_step=since(step),
        to_first_averaged_round=since(averaged),
        download_failures=len(failed),
    )


def run_joins(swarm: Swarm, state_bytes: int) -> list[dict]:
    """Newcomers one at a time, each at its own link rate, each waited for until it averages."""
    args, out = swarm.args, []
    for rate in args.join_rates:
        swarm.lab.set_rate(rate)
        print(f"  join with links at {'unlimited' if rate is None else f'{rate:g} Mbit/s'}", flush=True)
        peer = swarm.join()
        wait(
            lambda peer=peer: any(r["averaged"] and r["group_size"] > 1 for r in peer.rounds()),
            args.join_timeout,
            swarm,
            f"peer {peer.index}'s first averaged round",
        )
        out.append(join_figures(peer, rate, state_bytes))
        print(f"    {out[-1]}", flush=True)
    return out


def run_churn(swarm: Swarm) -> list[dict]:
    """Every ``--every`` rounds, SIGKILL a random live peer and start a new one in its place."""
    args = swarm.args
    rng, kills = random.Random(args.seed), []
    swarm.lab.set_rate(args.churn_rate)
    for _ in range(args.kills):
        target = swarm.max_epoch() + args.every
        if not wait(lambda target=target: swarm.max_epoch() >= target, args.join_timeout, swarm, f"epoch {target}"):
            break
        victim = rng.choice(swarm.alive)
        epoch = swarm.max_epoch()
        swarm.kill(victim)
        newcomer = swarm.join()
        kills.append(dict(time=swarm.killed[victim.index], epoch=epoch, victim=victim.index, newcomer=newcomer.index))
        print(f"  epoch {epoch}: SIGKILL peer {victim.index}, peer {newcomer.index} joins", flush=True)
    target = swarm.max_epoch() + args.every
    wait(lambda: swarm.max_epoch() >= target, args.join_timeout, swarm, f"epoch {target}")
    return kills


def longest_stall(peer: PeerProcess, until: float) -> dict | None:
    """The longest gap between consecutive inner steps of a peer while it lived."""
    times = [r["time"] for r in peer.records("step") if r["time"] <= until]
    if len(times) < 2:
        return None
    gaps = [(b - a, a) for a, b in zip(times, times[1:])]
    gap, at = max(gaps)
    return dict(peer=peer.index, seconds=round(gap, 2), started=at)


def checksum_agreement(peers: list[PeerProcess]) -> dict:
    """For every epoch, did all peers that reached it hold the same parameters? Was each split healed later?"""
    by_epoch: dict[int, dict[int, str]] = defaultdict(dict)
    for p in peers:
        for r in p.rounds():
            by_epoch[r["epoch"]][p.index] = r["checksum"]
    epochs = sorted(by_epoch)
    agreed = {e: len(set(by_epoch[e].values())) == 1 for e in epochs if len(by_epoch[e]) > 1}
    splits = []
    for e, ok in agreed.items():
        if ok:
            continue
        counts = Counter(by_epoch[e].values())
        majority = counts.most_common(1)[0][0]
        dissenters = sorted(i for i, c in by_epoch[e].items() if c != majority)
        later = [x for x in agreed if x > e]
        healed_at = next((x for x in later if agreed[x] and set(dissenters) <= set(by_epoch[x])), None)
        healed_at = healed_at or next((x for x in later if agreed[x]), None)
        splits.append(dict(epoch=e, checksums=len(counts), dissenters=dissenters, agreed_again_at_epoch=healed_at))
    last = max(agreed) if agreed else None
    return dict(
        epochs_compared=len(agreed),
        disagreements=len(splits),
        repaired=sum(s["agreed_again_at_epoch"] is not None for s in splits),
        last_compared_epoch=last,
        last_epoch_agreed=agreed.get(last) if last is not None else None,
        splits=splits,
    )


def churn_figures(swarm: Swarm, kills: list[dict], end: float) -> dict:
    a = swarm.args.averaging
    per_peer, fallbacks, resyncs, failures = {}, Counter(), Counter(), 0
    for p in swarm.all:
        rounds = p.rounds()
        events = p.records("event")
        resyncs.update(e["message"].removeprefix("re-syncing: ") for e in events if e["kind"] == "resync")
        failures += sum(e["kind"] == "download_failed" for e in events)
        for r in rounds:
            if not r["averaged"]:
                fallbacks[r.get("fallback_reason") or "unknown"] += 1
        per_peer[p.index] = dict(
            rounds=len(rounds),
            averaged=sum(r["averaged"] for r in rounds),
            local=sum(not r["averaged"] for r in rounds),
            resynced=sum(bool(r.get("resynced")) for r in rounds),
            killed=p.index in swarm.killed,
        )
    survivors = [p for p in swarm.all if p.index not in swarm.killed]
    stalls = [s for p in survivors if (s := longest_stall(p, end))]
    worst = max(stalls, key=lambda s: s["seconds"]) if stalls else None
    budget = a.matchmaking_timeout + a.allreduce_timeout
    return dict(
        kills=kills,
        per_peer=per_peer,
        rounds_total=sum(v["rounds"] for v in per_peer.values()),
        local_rounds=sum(v["local"] for v in per_peer.values()),
        fallback_reasons=dict(fallbacks),
        resync_events=sum(resyncs.values()),
        resync_reasons=dict(resyncs),
        download_failures=failures,
        longest_stall=worst,
        stalls=stalls,
        timeouts=dict(
            matchmaking=a.matchmaking_timeout,
            allreduce=a.allreduce_timeout,
            consistency=a.consistency_timeout,
            chunk=a.chunk_timeout,
            matchmaking_plus_allreduce=budget,
        ),
        longest_stall_over_timeouts=(worst["seconds"] / budget) if worst else None,
        checksums=checksum_agreement(swarm.all),
    )


def plot(swarm: Swarm, kills: list[dict], joins: list[dict], out: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    t0 = min(p.started_at for p in swarm.all)
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(swarm.all) + 2))
    for row, p in enumerate(swarm.all):
        end = swarm.killed.get(p.index) or max([r["time"] for r in p.records()] or [p.started_at])
        ax.plot([p.started_at - t0, end - t0], [row, row], color="lightgray", lw=6, solid_capstyle="butt")
        steps = [r["time"] - t0 for r in p.records("step")]
        ax.plot(steps, [row] * len(steps), "|", color="tab:blue", ms=6)
        for r in p.rounds():
            ax.plot(
                r["time"] - t0, row, "o" if r["averaged"] else "x", color="tab:green" if r["averaged"] else "tab:red"
            )
        if p.index in swarm.killed:
            ax.plot(swarm.killed[p.index] - t0, row, "k*", ms=12)
    ax.set_yticks(range(len(swarm.all)), [f"peer {p.index}" for p in swarm.all])
    ax.set_xlabel("seconds since the first peer started")
    ax.set_title("inner steps (|), averaged rounds (o), local rounds (x), SIGKILL (*); grey: process alive")
    fig.tight_layout()
    path = out / f"{NAME}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.churn", description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--join-rates", type=float, nargs="+", default=[0.0, 50.0, 10.0], help="Mbit/s; 0 = unlimited")
    p.add_argument("--churn-rate", type=float, default=50.0, help="link rate during churn, Mbit/s; 0 = unlimited")
    p.add_argument("--kills", type=int, default=4, help="peers SIGKILLed (each replaced by a newcomer)")
    p.add_argument("--every", type=int, default=3, help="R: rounds between kills")
    p.add_argument("--inner-steps", type=int, default=10, help="H")
    p.add_argument("--set", dest="extra_overrides", action="append", default=[], help="extra manifest overrides")
    p.add_argument("--seed", type=int, default=0, help="chooses the victims")
    p.add_argument("--threads", type=int, default=1, help="torch threads per peer")
    p.add_argument("--join-timeout", type=float, default=120.0)
    p.add_argument("--workdir", type=Path, default=None, help="keep the peers' files here (default: temporary)")
    args = p.parse_args(argv)
    if args.smoke:
        args.join_rates, args.churn_rate, args.kills, args.every, args.inner_steps = [0.0], 20.0, 1, 1, 5
        args.join_timeout = 120.0
        args.extra_overrides = [
            "averaging.matchmaking_time=1.0",
            "averaging.matchmaking_timeout=6.0",
            "averaging.allreduce_timeout=8.0",
            "averaging.chunk_timeout=4.0",
            "averaging.consistency_timeout=2.0",
            *args.extra_overrides,
        ]
    args.join_rates = [r or None for r in args.join_rates]
    args.churn_rate = args.churn_rate or None
    args.overrides = [f"inner_steps={args.inner_steps}", *args.extra_overrides]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_root()
    clock = Stopwatch()
    manifest = build_manifest("tiny", overrides=args.overrides)
    args.averaging = manifest.averaging
    numel = count_parameters(build_model(manifest))
    state_bytes = 2 * 4 * numel  # fp32 parameters and Nesterov momentum
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="swarm-bench-churn-"))
    print(f"churn: tiny preset ({numel / 1e6:.2f}M parameters, state {state_bytes / 1e6:.1f} MB), files in {workdir}")
    with Lab() as lab:
        swarm = Swarm(args, lab, workdir)
        try:
            swarm.start()
            joins = run_joins(swarm, state_bytes)
            kills = run_churn(swarm)
            end = time.time()
        finally:
            stop_all(swarm.alive)
    churn = churn_figures(swarm, kills, end)
    record = dict(
        benchmark=NAME,
        command=command_line(),
        smoke=args.smoke,
        machine=machine_info(),
        sizes=dict(
            parameters=numel,
            state_bytes=state_bytes,
            inner_steps=args.inner_steps,
            samples_per_step=manifest.samples_per_step,
            join_rates_mbit=args.join_rates,
            churn_rate_mbit=args.churn_rate,
            kills=args.kills,
            every_rounds=args.every,
            overrides=args.overrides,
            averaging=manifest.averaging.model_dump(),
        ),
        joins=joins,
        churn=churn,
        wall_seconds=clock.seconds,
    )
    print_table(
        "join: seconds from `swarm-client join` (state = params + momentum, fp32)",
        ["peer", "link Mbit/s", "state/link s", "state loaded", "first step", "first averaged round", "dl failures"],
        [
            (
                j["peer"],
                "unlimited" if j["rate_mbit"] is None else j["rate_mbit"],
                j["state_over_link_seconds"] if j["state_over_link_seconds"] is not None else "-",
                j["to_state_loaded"],
                j["to_first_step"],
                j["to_first_averaged_round"],
                j["download_failures"],
            )
            for j in joins
        ],
    )
    print_table(
        "churn: rounds per peer",
        ["peer", "rounds", "averaged", "local", "resynced", "killed"],
        [(i, v["rounds"], v["averaged"], v["local"], v["resynced"], v["killed"]) for i, v in churn["per_peer"].items()],
    )
    stall, cs = churn["longest_stall"], churn["checksums"]
    print(
        f"longest stall of a survivor: {stall['seconds'] if stall else '-'} s "
        f"(matchmaking + all-reduce timeouts: {churn['timeouts']['matchmaking_plus_allreduce']} s); "
        f"local rounds {churn['local_rounds']} {churn['fallback_reasons']}; "
        f"checksum disagreements {cs['disagreements']} of {cs['epochs_compared']} epochs, repaired {cs['repaired']}; "
        f"re-syncs {churn['resync_reasons']}; "
        f"last epoch agreed: {cs['last_epoch_agreed']}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    png = plot(swarm, kills, joins, args.out)
    record["plots"] = [png.name] if png else []
    write_json(args.out, NAME, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
