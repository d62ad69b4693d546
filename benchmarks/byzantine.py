"""One lying peer among honest ones: how far does it move the swarm, with and without the defences?

Each scenario is a fresh run of real ``swarm-client`` peers on 127.0.0.1 (``tiny``
preset, every round needs the whole group: ``averaging.min_group_size`` = peers).
One peer is ``benchmarks.attacker`` (the stock client that lies about its
pseudo-gradient or its weight) or, in the honest runs, the stock client. Each peer
trains ``--rounds`` rounds and scores its model on the held-out shard at the start
and the end; peer N has the same identity, hence the same data, in every scenario. The figure
is the honest peers' mean held-out loss at the end,
divided by that of the honest run with today's plain mean, measured in the same
invocation; every peer also scores it after every round (``--eval-every 1``), and the
"worst round" is the largest such ratio over the rounds:

- ``honest / mean``: the baseline (hivemind's plain weighted mean);
- ``honest / centered-clip``: the cost of the defences without an attacker;
- ``ATTACK / mean``: what the attack does to an undefended swarm;
- ``ATTACK / centered-clip``: what it does against the defences;
- ``reducer / centered-clip``: the liar sends honest parts but returns a wrong average
  as a reducer (``averaging.min_group_size`` is peers - 1 there, so that the honest peers
  go on together once they have banned it); the figures are the rounds until every
  honest peer banned it, and the loss;
- ``hide / centered-clip``: the same lying reducer, which also serves no auditor the parts
  of its own slice (it signs its receipt, so it is alive), hoping the slice goes unchecked;
- ``collude / centered-clip``: the same lying reducer with a second key (``--peers 4``: the peer before the liar,
  ``mute``, not scored) that serves no auditor the parts it sent, and the liar shows no auditor the parts it holds of
  a sender; ``mute / centered-clip``: that second key alone, in an honest group (a sender gone for good);
- ``baddonor / centered-clip``: the liar averages honestly but serves joiners a poisoned state that passes every
  check of its own; honest peers join late (after rounds ``LATE_JOINS``) and must load the honest swarm's state;
  its baseline is ``honest / centered-clip+late``, the same late joiners without a liar;
- ``undying / centered-clip``: the liar leaves, after two rounds, a record voting two epochs ahead, set to live a
  year; ``sybil / centered-clip``: the liar's record and those of extra keys (``--peers 4``: two keys of five)
  vote two epochs ahead with a made-up checksum; ``outvote / centered-clip``: the liar's record and those of two
  extra keys (``--peers 3``: three keys of five) vote a made-up checksum of the swarm's own epoch, the majority's;
  the figures are the honest peers' re-syncs, their doubted claims and their loss;
- ``absent / mean``: the liar's seat left empty (one peer fewer, ``min_group_size`` =
  peers - 1): the best any defence can do, which is to leave the liar out entirely; the
  honest peers then train on less data than in the honest run. Every scenario's loss is
  also given over this one (``ratio_to_absent``);
- ``.../...+unchecked``: the same without checked reducers
  (``averaging.checked_reducers=false``): with ``honest/centered-clip`` it gives what the
  audits cost per round, in seconds and in bytes downloaded;
- ``.../...+sampledN``: audits of a random sample of N parts of each slice
  (``averaging.audit_parts=N``, 2 if N is left out) instead of every part.

A loss that is not finite (the swarm diverged) is recorded as null and shown as
"diverged". Run: ``python -m benchmarks.byzantine``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.attacker import ATTACKS
from benchmarks.byzantine_logs import _epoch, _joiner, _joiners, _lines, _mean, _peer_id, _read, _records, _rounds
from benchmarks.common import (
    Stopwatch,
    add_common_args,
    finish,
    finite,
    print_table,
    pyplot,
    save_figure,
    tied_to_us,
)
from benchmarks.pss import TreeSampler

NAME = "byzantine"
# a liar banned in its first round (or no liar): the honest peers must go on without it, so rounds need one fewer
BANNED_OR_ABSENT = (
    *("reducer", "few", "hide", "nonfinite", "oversized", "absent"),
    *("forge", "omit", "withhold", "partial", "accuse", "split", "dropper", "dropaudit", "spoil", "collude"),
    *("undying", "sybil"),  # gone after two rounds; or its record says it is two epochs ahead: no group waits for it
    # its lie is in its keys' votes; with them the peers' estimate of the swarm's size splits first-stage matchmaking
    # into two keys (groups of 3: five keys), and a key holding one or two of three could never reach a whole group
    "outvote",
)
# attacks with a second key of the liar's: it runs this attack, as the peer before the liar, and is not scored
ACCOMPLICES = {"collude": "mute"}
# liars that re-sync (their own lie refused, they step apart from the honest peers), so that their --max-epochs ended
# two rounds early and the honest peers, needing a group of every peer, waited out the timeout (``fakemerge``)
STAYS = ("fakemerge",)
LATE_JOINS = (2, 4, 6)  # ``baddonor``: an honest peer joins once the swarm reaches each of these epochs
# seconds the liar is given to finish after the honest peers have, then it is stopped: only the honest peers are
# scored, and what is read of the liar (its id, the rounds it averaged in) is written as it goes; a banned liar
# alone would otherwise wait out matchmaking for every round left
LIAR_GRACE = 5.0
REPO = Path(__file__).resolve().parent.parent
MATCHMAKING_TIME = 10.0
SAMPLED_PARTS = 2  # "+sampled": parts of each slice an audit checks
# a scenario whose liar never sat in a full group tested nothing: it is run again, at most this many times in all
ATTEMPTS = 3
_JOIN = re.compile(r"swarm-client join --initial-peers (?P<maddrs>.+) --run (?P<run>[0-9a-f]{16})")
DEFAULT_SCENARIOS = [
    "honest/mean",
    "honest/centered-clip",
    "scale/mean",
    *(f"{attack}/centered-clip" for attack in ATTACKS),
    "reducer/centered-clip+unchecked",  # what a lying reducer does without the audits
    "honest/centered-clip+unchecked",  # the audits' cost, against honest/centered-clip
    "absent/mean",  # the liar left out entirely: the floor for any defence
    "honest/mean#2",  # the baseline again: how far apart two honest runs land (the noise floor)
    "sign/centered-clip#2",  # an attack again: attacked runs spread wider than honest ones
]


def spawn(
    index: int, workdir: Path, head: list[str], attack: str | None, verbose: bool = False
) -> tuple[subprocess.Popen, Path]:
    """Peer ``index`` keeps one identity across scenarios (``ROOT/identity-N.key``): its peer id picks its
    data shards, so every scenario trains on the same sequences and only the aggregation and the lie differ."""
    log = workdir / f"peer{index}.log"
    head = [*head, "--identity", str(workdir.parent / f"identity-{index}.key")]
    prefix = ["-m", "benchmarks.attacker", attack, "--"] if attack else ["-m", "client.cli"]
    command = [sys.executable, *prefix, *head, "--host-ip", "127.0.0.1", "--host-port", "0", "--device", "cpu"]
    command += ["--workdir", str(workdir / f"peer{index}"), "--name", f"{'liar' if attack else 'honest'}-{index}"]
    command += ["--no-dashboard", "--log-json", str(workdir / f"peer{index}.jsonl")]
    command += ["--result-file", str(workdir / f"peer{index}.result.json")]
    command += ["--verbose"] if verbose else []  # INFO lines into peerN.log; debug lines: peerN/logs/swarm-client.log
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    with log.open("w") as handle:
        proc = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=REPO, **tied_to_us())
    return proc, log


def _target_group(args: argparse.Namespace) -> int:
    """The largest group the run forms: ``averaging.target_group_size`` if set, else every peer."""
    sizes = [int(v) for k, _, v in (s.partition("=") for s in args.sets) if k == "averaging.target_group_size"]
    return sizes[-1] if sizes else args.peers


def run_scenario(scenario: str, args: argparse.Namespace, root: Path, attempt: int = 1) -> dict:
    attack, aggregation = scenario.split("#")[0].split("/")
    aggregation, _, variant = aggregation.partition("+")
    attack = None if attack == "honest" else attack
    absent = attack == "absent"
    workdir = root / scenario.replace("/", "-").replace("#", "-").replace("+", "-")
    workdir = workdir.with_name(f"{workdir.name}-attempt{attempt}") if attempt > 1 else workdir
    workdir.mkdir(parents=True)
    late_joins = LATE_JOINS if attack == "baddonor" or variant == "late" else ()
    audit_parts = int(variant.removeprefix("sampled") or SAMPLED_PARTS) if variant.startswith("sampled") else 0
    sets = [
        f"averaging.aggregation={aggregation}",
        f"averaging.checked_reducers={'false' if variant == 'unchecked' else 'true'}",
        f"averaging.audit_parts={audit_parts}",
        # (and its second key, which may follow it once it is banned: the honest peers go on by themselves)
        f"averaging.min_group_size={args.peers - (attack in BANNED_OR_ABSENT) - (attack in ACCOMPLICES)}",
        "averaging.join_rounds_early=false",  # every round is H steps of every peer: runs differ only by the lie
        # a round closes as soon as every peer is in, and a leader waits longer for a late one: on a loaded machine
        # a liar that started seconds after the honest joiner missed its only chance to meet them (CI, 5 s)
        f"averaging.target_group_size={args.peers + (len(LATE_JOINS) if late_joins else 0)}",
        f"averaging.matchmaking_time={MATCHMAKING_TIME}",
        f"inner_steps={args.inner_steps}",
        f"init_seed={args.seed}",
        *args.sets,
    ]
    tail = ["--max-epochs", str(args.rounds), "--eval-sequences", str(args.eval_sequences), "--eval-every", "1"]
    started = time.monotonic()
    honest_count = args.peers - (1 if attack else 0) - (1 if attack in ACCOMPLICES else 0)  # the first ones
    late: list[tuple[subprocess.Popen, Path]] = []  # honest peers that join mid-run (``baddonor``)
    head = ["start", "--preset", "tiny", *(a for s in sets for a in ("--set", s)), *tail]
    procs = [spawn(0, workdir, head, None, args.verbose_peers)]
    try:
        deadline = time.monotonic() + 180
        while not (match := _JOIN.search(procs[0][1].read_text() if procs[0][1].exists() else "")):
            if time.monotonic() > deadline or procs[0][0].poll() is not None:
                raise SystemExit(f"the first peer did not start:\n{procs[0][1].read_text()[-3000:]}")
            time.sleep(0.3)
        join = ["join", "--initial-peers", *match["maddrs"].split(), "--run", match["run"], *tail]
        for i in range(1, args.peers - (1 if absent else 0)):
            role = attack if i == args.peers - 1 else ACCOMPLICES.get(attack) if i == honest_count else None
            argv = join
            if role in STAYS:  # its --max-epochs counts the rounds it re-synced: it stays until the honest are done
                argv = [
                    *join[: join.index("--max-epochs") + 1],
                    str(2 * args.rounds),
                    *join[join.index("--max-epochs") + 2 :],
                ]
            procs.append(spawn(i, workdir, argv, role, args.verbose_peers))
        # each honest peer's whole process tree: an attack on memory shows here (the liar's is not scored)
        samplers = [TreeSampler(p.pid, lambda: "run", interval=0.5).start() for p, _ in procs[:honest_count]]
        deadline = time.monotonic() + args.timeout
        for j, at in enumerate(late_joins):
            while _epoch(workdir / "peer0.jsonl") < at and time.monotonic() < deadline and procs[0][0].poll() is None:
                time.sleep(0.5)
            late_join = [
                *join[: join.index("--max-epochs") + 1],
                str(max(1, args.rounds - at)),
                *join[join.index("--max-epochs") + 2 :],
            ]
            late.append(spawn(args.peers + j, workdir, late_join, None, args.verbose_peers))
        for index, (proc, _) in enumerate(procs):
            if attack and not absent and index == len(procs) - 1:  # once the honest peers are done, the liar (which
                deadline = min(deadline, time.monotonic() + LIAR_GRACE)  # may be banned and alone) gets a grace
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        for proc, _ in late:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
    finally:
        for sampler in locals().get("samplers", []):
            sampler.stop()
        for proc, _ in procs + late:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in procs + late:
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()
    honest = []
    liar = _peer_id(procs[-1][1]) if attack and not absent else None
    # the round the liar first averaged in (with anyone): it lies from that round on
    liar_rounds = [r["epoch"] - 1 for r in _rounds(workdir / f"peer{args.peers - 1}.jsonl") if r["averaged"]]
    liar_averaged = bool(liar_rounds)  # with an honest peer: every other peer is one
    # or, where the liar never closed a round of its own (dropped, it waits out the merge of the swarm's average
    # past its grace), the first round an honest peer averaged in a group of every peer (the liar's included)
    liar_rounds = liar_rounds or [
        r["epoch"] - 1
        for i in range(honest_count)
        for r in _rounds(workdir / f"peer{i}.jsonl")
        if r["averaged"] and r["group_size"] == args.peers
    ]
    first_lie = min(liar_rounds) if liar and liar_rounds else None
    for i in range(honest_count):
        result = workdir / f"peer{i}.result.json"
        data = json.loads(result.read_text()) if result.exists() else {}
        rounds = _rounds(workdir / f"peer{i}.jsonl")
        averaged = [r for r in rounds if r["averaged"]]
        bans = [b for path in (workdir / f"peer{i}").glob("runs/*/checkpoints/bans.json") for b in _read(path)]
        liar_ban = next((b for b in bans if b["peer_id"] == liar), None)
        honest.append(
            dict(
                peer=i,
                exit=procs[i][0].returncode,
                peak_pss_mib=round(samplers[i].overall.total / 2**20, 1) if i < len(samplers) else None,
                epoch=data.get("epoch"),
                checksum=data.get("checksum"),  # of the state it left with: equal across the honest peers, normally
                averaged_rounds=data.get("averaged_rounds"),
                eval_loss_start=finite(data.get("eval_loss_start")),
                eval_loss_end=finite(data.get("eval_loss_end")),
                eval_losses={int(e): finite(v) for e, v in data.get("eval_losses", [])},  # after each round
                banned=[dict(peer_id=b["peer_id"], reason=b["reason"], epoch=b["epoch"]) for b in bans],
                # counted from the first round the liar averaged in (the ban's epoch is the round's starting one)
                rounds_to_ban_liar=liar_ban["epoch"] - first_lie + 1 if liar_ban and first_lie is not None else None,
                # per averaged round: its group's size, and the share of the vector dropped (a caught reducer's)
                group_sizes=[r["group_size"] for r in averaged],
                dropped_fractions=[round(r.get("dropped_fraction", 0.0), 4) for r in averaged],
                audit_seconds_mean=_mean([r["seconds"].get("audit", 0.0) for r in averaged]),
                audit_bytes_mean=_mean([r.get("audit_bytes", 0) for r in averaged]),
                allreduce_bytes_received_mean=_mean([r["bytes_received"] for r in averaged]),
                round_wall_seconds_mean=_mean([r["wall_seconds"] for r in rounds[1:]]),
                resyncs=sum(1 for r in rounds if r.get("resynced")),
                # claims of an epoch ahead that nobody served, whose keys it left out of its view (swarm.state.doubts)
                claims_doubted=sum(1 for r in _records(workdir / f"peer{i}.jsonl") if r.get("kind") == "doubted"),
                # slices that came in part and could not be fetched again whole (so were dropped), and why
                repair_failures=[dict(epoch=r["epoch"], **f) for r in averaged for f in r.get("repair_failures", [])],
            )
        )
    ends = [h["eval_loss_end"] for h in honest]
    epochs = sorted(set().union(*(h["eval_losses"] for h in honest)))
    # a peer that did not reach a round (it resynced past it) is left out of that round's mean; None is a divergence
    by_round = [[h["eval_losses"][e] for h in honest if e in h["eval_losses"]] for e in epochs]
    to_ban = [h["rounds_to_ban_liar"] for h in honest]
    banned_by = sum(1 for h in honest if liar and any(b["peer_id"] == liar for b in h["banned"]))
    return dict(
        scenario=scenario,
        attack=attack,
        aggregation=aggregation,
        checked_reducers=variant != "unchecked",
        audit_parts=audit_parts,  # 0: every part
        liar=liar,
        accomplice=_peer_id(procs[honest_count][1]) if attack in ACCOMPLICES else None,  # the liar's second key
        # whether an honest peer ever averaged in a group of every peer, the liar in it; where groups are smaller
        # than the run (``--set averaging.target_group_size``), whether the liar averaged at all (every other peer
        # is honest): before, such a run was retried for a group it could never form. None: no liar; None too for
        # ``sybil``, ``outvote``, ``fresh`` and ``fakemerge`` (their lie is in their keys' records, not in a group;
        # a round that took ``fakemerge``'s made-up average is "adopted", not averaged, by the honest peers)
        liar_met=any(n == args.peers for h in honest for n in h["group_sizes"])
        or (liar_averaged and _target_group(args) < args.peers)
        if liar and attack not in ("sybil", "outvote", "fresh", "fakemerge")
        else None,
        attempt=attempt,
        # what the liar says it did (``benchmarks.attacker`` prints "ATTACK: ..." where the lie is not in a value)
        liar_said=[line for line in _lines(procs[-1][1]) if line.startswith(f"{attack}:")] if liar else [],
        honest_peers=honest,
        honest_loss_end=statistics.fmean(ends) if ends and None not in ends else None,
        # the honest peers' mean held-out loss after each round (epoch 1..rounds); None where one diverged or lacked it
        honest_loss_by_round={e: statistics.fmean(v) if None not in v else None for e, v in zip(epochs, by_round)},
        rounds_to_ban_liar=max(to_ban) if liar and None not in to_ban else None,  # until every honest peer banned it
        liar_banned_by=f"{banned_by}/{len(honest)}" if liar else None,
        audit_seconds_mean=_mean([h["audit_seconds_mean"] for h in honest]),
        honest_peak_pss_mib=max((h["peak_pss_mib"] or 0 for h in honest), default=None),
        honest_resyncs=sum(h["resyncs"] for h in honest),
        honest_claims_doubted=sum(h["claims_doubted"] for h in honest),
        joiners=[_joiner(args.peers + j, workdir, p.returncode, liar, len(honest)) for j, (p, _) in enumerate(late)],
        audit_bytes_mean=_mean([h["audit_bytes_mean"] for h in honest]),
        round_wall_seconds_mean=_mean([h["round_wall_seconds_mean"] for h in honest]),
        seconds=round(time.monotonic() - started, 1),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.byzantine", description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--peers", type=int, default=3, help="peers per run, one of them the liar")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--inner-steps", type=int, default=20, help="H")
    p.add_argument("--eval-sequences", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scenarios", default=",".join(DEFAULT_SCENARIOS), help="ATTACK/AGGREGATION, comma-separated")
    p.add_argument("--set", dest="sets", action="append", default=[], help="extra manifest overrides")
    p.add_argument("--timeout", type=float, default=900.0, help="per scenario")
    p.add_argument("--verbose-peers", action="store_true", help="the peers log at debug level (peerN.log)")
    p.add_argument("--invocations", type=int, default=1, help="every scenario again with new identities (data)")
    p.add_argument(
        "--identities",
        type=Path,
        default=None,
        help="an earlier run's directory (its identity-N.key files): the same peers, hence the same data, again; "
        "to compare a change to the defences on an invocation that went badly",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds, args.inner_steps, args.eval_sequences = 2, 3, 4  # caught within 2 rounds: the goal
        # the lying reducer against audits of a sample of each slice's parts, which fetch the parts' digests and
        # then some parts; audits of every part run in the others (each honest reducer is audited too)
        args.scenarios = ",".join(
            ["honest/mean", "reducer/centered-clip+sampled"]
            + [f"{a}/centered-clip" for a in ("hide", "nonfinite", "cut", "dropper")]
        )
    clock = Stopwatch()
    scenarios = args.scenarios.split(",")
    if scenarios[0] != "honest/mean":
        scenarios.insert(0, "honest/mean")  # the baseline, measured in the same run
    # each invocation has new identities, hence new data per peer: the spread between them is the noise
    invocations = [run_invocation(scenarios, args, n) for n in range(args.invocations)]
    root, results = invocations[0]
    summary = summarize([r for _, r in invocations]) if args.invocations > 1 else None
    print_table(
        f"{args.peers} peers (one liar), {args.rounds} rounds of H={args.inner_steps}: honest held-out loss at the end",
        ["scenario", "honest loss", "ratio to honest/mean", "worst round", "to absent", "banned by", "rounds to ban"]
        + ["audit s/round", "audit MB/round", "peak PSS MiB", "re-syncs", "joiners honest/met liar", "s"],
        [
            (
                r["scenario"],
                r["honest_loss_end"] or "diverged",
                r["ratio_to_honest_mean"] or "-",
                round(r["worst_round_ratio"], 4) if r["worst_round_ratio"] else "diverged",
                round(r["ratio_to_absent"], 4) if r["ratio_to_absent"] else "-",
                r["liar_banned_by"] or "-",
                r["rounds_to_ban_liar"] or "-",
                r["audit_seconds_mean"] if r["audit_seconds_mean"] is not None else "-",
                round(r["audit_bytes_mean"] / 1e6, 3) if r["audit_bytes_mean"] is not None else "-",
                r["honest_peak_pss_mib"],
                r["honest_resyncs"],
                _joiners(r["joiners"]),
                r["seconds"],
            )
            for r in results
        ],
    )
    if summary:
        print_table(
            f"over {args.invocations} invocations (new identities, hence data, each): mean [min, max]",
            ["scenario", "ratio to honest/mean", "worst round", "to absent", "to honest+late"],
            [
                (
                    s["scenario"],
                    *(_spread(s[k]) for k in ("ratio_to_honest_mean", "worst_round_ratio", "ratio_to_absent")),
                    _spread(s["ratio_to_late"]),
                )
                for s in summary
            ],
        )
    fields = dict(
        sizes=dict(peers=args.peers, rounds=args.rounds, inner_steps=args.inner_steps, sets=args.sets),
        baseline="honest/mean",
        scenarios=results,
        invocations=[dict(workdir=str(w), scenarios=r) for w, r in invocations[1:]],
        summary=summary,
        workdir=str(root),
    )
    finish(NAME, args.out, fields, smoke=args.smoke, clock=clock, plot=lambda out: plot(results, out))
    return 0


def run_invocation(scenarios: list[str], args: argparse.Namespace, number: int) -> tuple[Path, list[dict]]:
    """Every scenario once, with this invocation's identities; each ratio against its own baseline."""
    root = Path(tempfile.mkdtemp(prefix="swarm-byzantine-"))
    if args.identities is not None and number == 0:
        for key in sorted(args.identities.glob("identity-*.key")):
            shutil.copy2(key, root / key.name)
    results = []
    for scenario in scenarios:
        print(f"running {scenario} (invocation {number + 1}/{args.invocations}) ...", flush=True)
        for attempt in range(1, ATTEMPTS + 1):
            result = run_scenario(scenario, args, root, attempt)
            if result["liar_met"] is not False or attempt == ATTEMPTS:
                break
            print(f"  the liar never sat in a full group: {scenario} again (attempt {attempt + 1})", flush=True)
        results.append(result)
        for folder in root.glob("*/peer*/runs"):  # checkpoints and state; the debug logs (peer*/logs) are kept for
            shutil.rmtree(folder, ignore_errors=True)  # what a round's report cannot say (a failed repair's error)
        print(f"  honest held-out loss at the end: {results[-1]['honest_loss_end']}", flush=True)
    baseline = results[0]["honest_loss_end"]
    floor = next((r["honest_loss_end"] for r in results if r["attack"] == "absent"), None)
    # late joiners change the groups and the data: a scenario with them is also given over the honest run with them
    late = next((r["honest_loss_end"] for r in results if r["attack"] is None and r["joiners"]), None)
    for r in results:
        r["ratio_to_honest_mean"] = r["honest_loss_end"] / baseline if r["honest_loss_end"] and baseline else None
        r["ratio_by_round"] = round_ratios(r["honest_loss_by_round"], results[0]["honest_loss_by_round"])
        # the round where the attack did most harm (None if it diverged in any): the end alone can be a lucky one
        ratios = list(r["ratio_by_round"].values())
        r["worst_round_ratio"] = max(ratios) if ratios and None not in ratios else None
        # against the honest peers alone (the liar's seat empty): what a perfect defence would give
        r["ratio_to_absent"] = r["honest_loss_end"] / floor if r["honest_loss_end"] and floor else None
        r["ratio_to_late"] = r["honest_loss_end"] / late if r["joiners"] and r["honest_loss_end"] and late else None
    return root, results


def round_ratios(losses: dict[int, float | None], baseline: dict[int, float | None]) -> dict[int, float | None]:
    """Per round, the honest peers' held-out loss over the baseline's at the same round."""
    return {e: v / baseline[e] if v and baseline.get(e) else None for e, v in losses.items() if e in baseline}


def summarize(invocations: list[list[dict]]) -> list[dict]:
    """Per scenario, each invocation's ratios (None where it diverged or had no baseline)."""
    return [
        dict(
            scenario=runs[0]["scenario"],
            ratio_to_honest_mean=[r["ratio_to_honest_mean"] for r in runs],
            ratio_to_absent=[r["ratio_to_absent"] for r in runs],
            ratio_to_late=[r.get("ratio_to_late") for r in runs],  # with late joiners only
            worst_round_ratio=[r["worst_round_ratio"] for r in runs],
        )
        for runs in zip(*invocations)
    ]


def _spread(values: list) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    return f"{statistics.fmean(known):.4g} [{min(known):.4g}, {max(known):.4g}]" + (
        f" ({len(values) - len(known)} diverged)" if len(known) < len(values) else ""
    )


def plot(results: list[dict], out: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r["scenario"] for r in results]
    ratios = [min(r["ratio_to_honest_mean"] or 3.0, 3.0) for r in results]  # diverged or huge: drawn at 3
    colors = [
        "tab:gray" if r["attack"] is None else "tab:red" if r["aggregation"] == "mean" else "tab:blue" for r in results
    ]
    bars = ax.bar(range(len(names)), ratios, color=colors)
    ax.bar_label(
        bars,
        labels=[f"{r['ratio_to_honest_mean']:.4g}" if r["ratio_to_honest_mean"] else "diverged" for r in results],
        fontsize=7,
    )
    ax.axhline(1.02, color="gray", linestyle="--", label="goal: within 2% of an honest run")
    ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("honest loss / honest run's (cap 3)")
    ax.set_ylim(0.8, 3.2)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, out, NAME)


if __name__ == "__main__":
    sys.exit(main())
