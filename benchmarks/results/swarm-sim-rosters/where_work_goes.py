"""Where the work of a swarm-sim run goes: each group registration and roster logged, then the peer-rounds that were
not counted classified, and when their groups registered against the epoch's first roster.

    python benchmarks/results/swarm-sim-rosters/where_work_goes.py N HOURS SEED [manifest overrides]

prints one JSON line of swarm-sim's figures, then the breakdown (README.md in this folder).
"""

from __future__ import annotations

import json
import random
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from benchmarks import swarm_sim  # noqa: E402


def quantiles(values: list[float]) -> list[float] | None:
    """10th, 50th and 90th percentiles."""
    ordered = sorted(values)
    return [round(ordered[int(f * (len(ordered) - 1))], 1) for f in (0.1, 0.5, 0.9)] if ordered else None


def main(peers: int, hours: float, seed: int, overrides: list[str]) -> None:
    manifest, params = swarm_sim.manifest_of("150m", overrides)
    setup = swarm_sim.Setup(peers=peers, hours=hours, manifest=manifest, params=params, seed=seed)
    sim = swarm_sim.Simulation(setup)
    events = []
    register = swarm_sim.Simulation.register

    def logged(self, p, m, **merge):
        roster = bool(m.roster) and "merged" not in merge
        events.append(dict(t=self.now, epoch=m.epoch, tag=m.tag, roster=len(m.roster) if roster else 0,
                           merged=merge.get("merged"), included=tuple(merge.get("included", ()))))  # fmt: skip
        return register(self, p, m, **merge)

    swarm_sim.Simulation.register = logged
    random.seed(seed)
    with swarm_sim.patched_dht(sim):
        sim.run()
    figures = swarm_sim.figures(sim)
    keys = ("contribution_share", "outcomes", "merge_fallbacks", "groups_per_round", "merged_groups_per_round",
            "rounds_per_hour", "distinct_checksums_at_end", "group_records_read_per_second")  # fmt: skip
    print(json.dumps({k: figures[k] for k in keys}))

    first_registered, first_any, rosters, results = {}, {}, defaultdict(list), defaultdict(dict)
    for e in events:
        first_registered.setdefault((e["epoch"], e["tag"]), e["t"])
        first_any.setdefault(e["epoch"], e["t"])
        if e["roster"]:
            rosters[e["epoch"]].append((e["t"], e["roster"]))
        if e["merged"]:
            results[e["epoch"]].setdefault(e["merged"], (e["t"], len(e["included"])))
    in_a_result = defaultdict(set)
    for e in events:
        if e["merged"]:
            in_a_result[e["epoch"]].update(e["included"])
    applied = defaultdict(Counter)
    for r in sim.rounds:
        if r.get("update"):
            applied[r["epoch"]][r["update"]] += 1
    winners = {epoch: votes.most_common(1)[0][0] for epoch, votes in applied.items()}

    kinds, after_roster, own_stage2 = Counter(), [], 0
    for r in sim.rounds:
        if r["counted"]:
            kinds["counted"] += 1
            continue
        kinds["merged, not in the swarm's average" if r["kind"] == "merged" else r["kind"]] += 1
        registered = first_registered.get((r["epoch"], r.get("tag")))
        if r["kind"] == "merged" and registered is not None and rosters.get(r["epoch"]):
            after_roster.append(registered - min(t for t, _ in rosters[r["epoch"]]))
            own_stage2 += r.get("tag") in in_a_result[r["epoch"]]
    print("peer-rounds:", dict(kinds))
    print("uncounted merged rounds: their group registered after the epoch's first roster (s, p10/p50/p90):",
          quantiles(after_roster), f"before it: {sum(x < 0 for x in after_roster)} of {len(after_roster)};",
          f"in a second stage of their own: {own_stage2}")  # fmt: skip
    print("first roster after the epoch's first registration (s):",
          quantiles([min(t for t, _ in rs) - first_any[e] for e, rs in rosters.items()]))  # fmt: skip

    def registered_after_first(counted: bool) -> list[float]:
        return [
            first_registered[(r["epoch"], r["tag"])] - first_any[r["epoch"]]
            for r in sim.rounds
            if r["counted"] == counted and (counted or r["kind"] == "merged")
            and (r["epoch"], r.get("tag")) in first_registered
        ]  # fmt: skip

    print("registration after the epoch's first (s), uncounted merged:", quantiles(registered_after_first(False)),
          "counted:", quantiles(registered_after_first(True)))  # fmt: skip
    for epoch in sorted(rosters)[2:6]:
        t0 = first_any[epoch]
        print(f"epoch {epoch}: rosters (s, groups)", [(round(t - t0, 1), n) for t, n in rosters[epoch]][:8])
        ends = sorted((round(t - t0, 1), n, d == winners.get(epoch)) for d, (t, n) in results[epoch].items())
        print("   results (s, groups, the one applied):", ends[:8])


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
