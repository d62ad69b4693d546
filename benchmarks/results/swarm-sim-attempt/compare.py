"""swarm-sim with and without ``attempt_timeout`` (the split key given up after two matchmaking windows), one seed.

    python benchmarks/results/swarm-sim-attempt/compare.py after|before PEERS HOURS SEED

``before`` replaces the rule with the whole ``matchmaking_timeout`` in the simulator, so both variants run the same
code otherwise. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from benchmarks import swarm_sim  # noqa: E402

KEPT = ("contribution_share", "peer_rounds", "rounds_per_hour", "outcomes", "groups_per_round", "joins_failed")


def main(variant: str, peers: int, hours: float, seed: int) -> None:
    if variant == "before":
        swarm_sim.attempt_timeout = lambda bucket, window, timeout: timeout
    manifest, params = swarm_sim.manifest_of("150m", [])
    started = time.time()
    setup = swarm_sim.Setup(peers=peers, hours=hours, manifest=manifest, params=params, seed=seed)
    result = swarm_sim.simulate(setup)
    kept = {k: result[k] for k in (*KEPT, "live_at_end")}
    print(json.dumps(dict(variant=variant, peers=peers, seed=seed, wall=round(time.time() - started), **kept)))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
