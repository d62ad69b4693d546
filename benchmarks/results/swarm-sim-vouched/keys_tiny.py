"""Matchmaking keys fixed by the id (the client) or drawn anew each epoch, in the swarm-sim smoke's setting
(``tiny``, N = 100, a 0.25 s fastest step, 15 simulated minutes), both with ``running_consensus``, one seed.

    python benchmarks/results/swarm-sim-vouched/keys_tiny.py fixed|drawn SEED

Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from benchmarks import swarm_sim  # noqa: E402

KEPT = ("contribution_share", "peer_rounds", "rounds_per_hour", "groups_per_round", "bucket_reads_per_second")


def main(variant: str, seed: int) -> None:
    manifest, params = swarm_sim.manifest_of("tiny", [])
    setup = swarm_sim.Setup(
        peers=100, hours=0.25, manifest=manifest, params=params, step_seconds=0.25, arrival_seconds=30.0,
        seed=seed, drawn_keys=variant == "drawn",
    )  # fmt: skip
    result = swarm_sim.simulate(setup)
    kept = {k: result[k] for k in (*KEPT, "agreement_mean", "agreement_below_09")}
    print(json.dumps(dict(variant=variant, seed=seed, **kept)))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
