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
import time
from collections import Counter, defaultdict
from pathlib import Path

from benchmarks.common import (
    Stopwatch,
    add_common_args,
    finish,
    print_table,
    pyplot,
    save_figure,
    scratch_dir,
)
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


def longest_stall(peer: PeerProcess, start: float, until: float) -> dict | None:
    """The longest gap between consecutive inner steps of a peer that ends inside [start, until]."""
    times = [r["time"] for r in peer.records("step") if r["time"] <= until]
    gaps = [(b - a, a) for a, b in zip(times, times[1:]) if b >= start]
    if not gaps:
        return None
    gap, at = max(gaps)
    return dict(peer=peer.index, seconds=round(gap, 2), started=at)


def majority_checksums(peers: list[PeerProcess]) -> dict[int, tuple[str, int]]:
    """For each epoch, the checksum most peers reported after their round, and how many reported it."""
    by_epoch: dict[int, Counter] = defaultdict(Counter)
    for p in peers:
        for r in p.rounds():
            by_epoch[r["epoch"]][r["checksum"]] += 1
    return {e: c.most_common(1)[0] for e, c in by_epoch.items()}


def checksum_agreement(peers: list[PeerProcess]) -> dict:
    """How often peers held different parameters, and whether each difference was repaired.

    Two views: (1) a peer found its checksum differed from the majority's (a
    "disagreed with the majority's checksum" re-sync, after a round or at the next
    round's start): repaired if its next round record carries the checksum most
    peers hold at that epoch; (2) after the rounds, did all peers that reached an
    epoch report the same checksum? Re-syncs of peers that were merely behind (or
    ran ahead on local rounds) are counted apart.
    """
    majority = majority_checksums(peers)
    detected = []
    for p in peers:
        rounds = p.rounds()
        for e in p.records("event"):
            if e["kind"] != "resync" or not any(w in e["message"] for w in ("disagreed", "behind", "ran ahead")):
                continue
            after = next((r for r in rounds if r["time"] >= e["time"]), None)
            ok = after is not None and majority.get(after["epoch"], ("", 0))[0] == after["checksum"]
            reason = e["message"].removeprefix("re-syncing: ")
            detected.append(dict(peer=p.index, time=e["time"], reason=reason, repaired=ok))
    strict = [d for d in detected if "disagreed with the majority" in d["reason"]]
    by_epoch: dict[int, dict[int, str]] = defaultdict(dict)
    for p in peers:
        for r in p.rounds():
            by_epoch[r["epoch"]][p.index] = r["checksum"]
    shared = {e: v for e, v in by_epoch.items() if len(v) > 1}
    split_epochs = sorted(e for e, v in shared.items() if len(set(v.values())) > 1)
    last = max(shared) if shared else None
    return dict(
        # this peer's checksum differed from the majority's at its epoch (after a round or at the next start)
        disagreements_detected=len(strict),
        disagreements_repaired=sum(d["repaired"] for d in strict),
        # re-syncs of a peer that was at another epoch than the swarm (behind it, or ahead on local rounds)
        behind_or_ahead=len(detected) - len(strict),
        behind_or_ahead_repaired=sum(d["repaired"] for d in detected) - sum(d["repaired"] for d in strict),
        detected=detected,
        epochs_compared=len(shared),
        epochs_split_after_round=split_epochs,
        last_compared_epoch=last,
        last_epoch_agreed=(len(set(shared[last].values())) == 1) if last is not None else None,
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
    churn_start = min((k["time"] for k in kills), default=end)
    stalls = [s for p in survivors if (s := longest_stall(p, churn_start, end))]
    join_stalls = [s for p in swarm.all if (s := longest_stall(p, 0.0, churn_start))]
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
        longest_stall_before_churn=max(join_stalls, key=lambda s: s["seconds"]) if join_stalls else None,
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
    return save_figure(fig, out, NAME)


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
    with scratch_dir(args.workdir, "swarm-bench-churn-") as workdir:
        size = f"{numel / 1e6:.2f}M parameters, state {state_bytes / 1e6:.1f} MB"
        print(f"churn: tiny preset ({size}), files in {workdir}")
        with Lab() as lab:
            swarm = Swarm(args, lab, workdir)
            try:
                swarm.start()
                joins = run_joins(swarm, state_bytes)
                kills = run_churn(swarm)
                end = time.time()
            finally:
                stop_all(swarm.alive)
        churn = churn_figures(swarm, kills, end)  # reads the peers' logs: before their folder goes
    fields = dict(
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
        f"longest stall of a survivor during churn: {stall['seconds'] if stall else '-'} s "
        f"(matchmaking + all-reduce timeouts: {churn['timeouts']['matchmaking_plus_allreduce']} s); "
        f"local rounds {churn['local_rounds']} {churn['fallback_reasons']}; "
        f"checksum disagreements detected {cs['disagreements_detected']}, repaired {cs['disagreements_repaired']}; "
        f"behind or ahead {cs['behind_or_ahead']}, repaired {cs['behind_or_ahead_repaired']}; "
        f"epochs split after the round {cs['epochs_split_after_round']} of {cs['epochs_compared']}; "
        f"re-syncs {churn['resync_reasons']}; "
        f"last epoch agreed: {cs['last_epoch_agreed']}"
    )
    finish(
        NAME,
        args.out,
        fields,
        smoke=args.smoke,
        clock=clock,
        plot=lambda out: plot(swarm, kills, joins, out),
        head=("benchmark", "command", "smoke", "machine"),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
