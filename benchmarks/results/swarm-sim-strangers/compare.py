"""swarm-sim with the merge's wait before and after it holds strangers as one, one seed.

    python benchmarks/results/swarm-sim-strangers/compare.py after|before|held PEERS HOURS SEED

- ``after``: the client's rule (``swarm.round.no_shows``): once a merge waited out its patience for a key that
  never averaged with us, for 2, 4, 8 ... of our rounds a delegate waits for no such key still training, and for one
  in a group ``STRANGER_GRACE`` seconds at most (``NoShows.merge_decision``);
- ``before``: only the keys that missed are held, each on its own (``merge_decision`` is ``delegate_decision``);
- ``held``: the client's rule with strangers held from start to end, the most an attacker can make of it (a key
  made anew whenever a hold ends, at every peer): no merge waits for a key that never averaged with it.

Both run the same code otherwise. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from benchmarks import swarm_sim  # noqa: E402
from swarm.dht.groups import delegate_decision  # noqa: E402
from swarm.round.no_shows import NoShows  # noqa: E402

KEPT = ("contribution_share", "peer_rounds", "rounds_per_hour", "outcomes", "groups_per_round", "joins_failed")
MORE = ("live_at_end", "distinct_checksums_at_end", "peers_apart_max", "agreement_mean", "agreement_below_09",
        "agreement_at_end", "no_shows_noted")  # fmt: skip


def main(variant: str, peers: int, hours: float, seed: int) -> None:
    if variant not in ("after", "before", "held"):
        raise SystemExit(f"unknown variant {variant}")
    holds = []
    if variant == "before":
        NoShows.merge_decision = lambda self, *args: delegate_decision(*args)
    elif variant == "held":
        NoShows.holds_strangers = lambda self: True
    else:
        missed = NoShows.note_merge

        def counted(self, keys, epoch):
            was = self.holds_strangers()
            fresh = missed(self, keys, epoch)
            if not was and self.holds_strangers():
                holds.append(self.strangers.until - epoch)
            return fresh

        NoShows.note_merge = counted
    manifest, params = swarm_sim.manifest_of("150m", [])
    started = time.time()
    setup = swarm_sim.Setup(peers=peers, hours=hours, manifest=manifest, params=params, seed=seed)
    result = swarm_sim.simulate(setup)
    kept = {k: result.get(k) for k in (*KEPT, *MORE)}
    print(json.dumps(dict(variant=variant, peers=peers, hours=hours, seed=seed, wall=round(time.time() - started),
                          strangers_held=len(holds), held_rounds=sum(holds), **kept)))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
