"""swarm-sim with the client's rule for another group's swarm's average (``swarm.round.vouched``) and without it.

    python benchmarks/results/swarm-sim-vouched-merge/compare.py after|before PEERS HOURS SEED

- ``after``: the client's rule: a peer takes another group's swarm's average only where a key it averaged with in
  its last rounds (or a second-stage partner of this round) holds it, and an average of its group alone only if it
  is its group's own;
- ``before``: the heaviest registered average, whoever holds it (``result_of``), and its delegate's, whatever.

Both run the same code otherwise. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from benchmarks import swarm_sim  # noqa: E402
from swarm.dht.groups import own_result, result_of  # noqa: E402

KEPT = ("contribution_share", "peer_rounds", "rounds_per_hour", "outcomes", "groups_per_round", "joins_failed")
MORE = ("live_at_end", "distinct_checksums_at_end", "peers_apart_max", "agreement_mean", "agreement_below_09",
        "agreement_at_end", "unvouched_reads", "merge_seconds")  # fmt: skip


def main(variant: str, peers: int, hours: float, seed: int) -> None:
    if variant not in ("after", "before"):
        raise SystemExit(f"unknown variant {variant}")
    if variant == "before":
        swarm_sim.others_result = lambda records, epoch, trusted: result_of(records, epoch)
        swarm_sim.ours_result = lambda records, epoch, tag, digest: own_result(records, epoch, tag)
    manifest, params = swarm_sim.manifest_of("150m", [])
    started = time.time()
    setup = swarm_sim.Setup(peers=peers, hours=hours, manifest=manifest, params=params, seed=seed)
    result = swarm_sim.simulate(setup)
    kept = {k: result.get(k) for k in (*KEPT, *MORE)}
    print(json.dumps(dict(variant=variant, peers=peers, hours=hours, seed=seed, wall=round(time.time() - started),
                          **kept)))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
