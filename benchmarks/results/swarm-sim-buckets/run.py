"""One swarm-sim run with the groups key's reads per peer broken down: the mean peer, the worst, and delegates
against members (a peer counts as a delegate if it delegated any group).

    python benchmarks/results/swarm-sim-buckets/run.py N HOURS SEED VARIANT

prints one JSON line (README.md in this folder). Runs at any commit that has ``benchmarks.swarm_sim``.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

from benchmarks import swarm_sim  # noqa: E402


def main(peers: int, hours: float, seed: int, variant: str) -> None:
    manifest, params = swarm_sim.manifest_of("150m", [])
    setup = swarm_sim.Setup(peers=peers, hours=hours, manifest=manifest, params=params, seed=seed)
    sim = swarm_sim.Simulation(setup)
    random.seed(seed)
    with swarm_sim.patched_dht(sim):
        sim.run()
    figures = swarm_sim.figures(sim)
    end = sim.now
    delegates = {pid for (_, pid) in sim.archive}

    def rate(p) -> float:
        alive = max(1e-9, (p.gone if p.gone is not None else end) - p.joined)
        return p.reader.other_records / alive

    present = [p for p in sim.order if ((p.gone if p.gone is not None else end) - p.joined) >= 60]
    members = [rate(p) for p in present if p.pid not in delegates]
    leads = [rate(p) for p in present if p.pid in delegates]
    every = [rate(p) for p in present]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    keys = ("contribution_share", "peer_rounds", "outcomes", "merge_fallbacks", "groups_per_round", "rounds_per_hour",
            "distinct_checksums_at_end", "records_read_per_second", "records_written_per_second")  # fmt: skip
    row = dict(peers=peers, hours=hours, seed=seed, variant=variant, commit=commit)
    row.update({k: figures.get(k) for k in keys})
    row.update(
        group_records_read_per_second=round(statistics.mean(every), 3),
        group_records_read_per_second_max=round(max(every), 2),
        group_records_read_per_second_members=round(statistics.mean(members), 3) if members else None,
        group_records_read_per_second_delegates=round(statistics.mean(leads), 3) if leads else None,
        delegates=len(leads),
        members=len(members),
    )
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
