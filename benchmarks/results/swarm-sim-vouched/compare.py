"""swarm-sim with the rule before and after ``running_consensus``, one seed.

    python benchmarks/results/swarm-sim-vouched/compare.py after|before|drawn|drawn-before PEERS HOURS SEED

- ``after``: the client's rule: a running peer that disagrees takes half of the keys' checksum, else the most common
  one that it or a groupmate of its last 16 averaged rounds holds (``swarm.dht.view.running_consensus``);
- ``before``: the most common checksum of the epoch, whoever holds it (``consensus``);
- ``drawn``, ``drawn-before``: the same two with matchmaking keys drawn anew each epoch (``Setup.drawn_keys``, an
  experiment: the client's keys are fixed by the peer id).

Both run the same code otherwise. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from benchmarks import swarm_sim  # noqa: E402
from swarm.dht import view  # noqa: E402

KEPT = ("contribution_share", "peer_rounds", "rounds_per_hour", "outcomes", "groups_per_round", "joins_failed")


def plurality(peers, epoch, vouched):
    return view.consensus(peers, epoch)


def main(variant: str, peers: int, hours: float, seed: int) -> None:
    if variant not in ("after", "before", "drawn", "drawn-before"):
        raise SystemExit(f"unknown variant {variant}")
    if variant in ("before", "drawn-before"):
        view.running_consensus = swarm_sim.running_consensus = plurality  # resync_needed reads the module's name
    manifest, params = swarm_sim.manifest_of("150m", [])
    started = time.time()
    drawn = variant.startswith("drawn")
    setup = swarm_sim.Setup(peers=peers, hours=hours, manifest=manifest, params=params, seed=seed, drawn_keys=drawn)
    result = swarm_sim.simulate(setup)
    kept = {
        k: result[k]
        for k in (
            *KEPT,
            "live_at_end",
            "distinct_checksums_at_end",
            "peers_apart_max",
            "agreement_mean",
            "agreement_below_09",
            "agreement_at_end",
        )
    }
    print(json.dumps(dict(variant=variant, peers=peers, seed=seed, wall=round(time.time() - started), **kept)))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
