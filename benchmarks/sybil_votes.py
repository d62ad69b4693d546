"""How many keys does a stranger need to move the swarm's votes? The client's own vote rules, against extra keys.

Keys are free: a stranger can run many peers, each with its own identity, each publishing a progress record that
votes. This drives the rules every peer applies to the records it reads (``swarm.dht.view.global_epoch``,
``swarm.dht.view.consensus`` and ``swarm.state.trust.refusal``) with ``N`` honest records and ``k`` of an
attacker's, and finds the least ``k`` that moves each vote:

- ``epoch``: the global epoch made one that no honest peer holds (E + 2 while honest peers are at E and E + 1):
  every honest peer then reads itself "behind" and re-syncs from a donor that holds it (only the attacker);
- ``checksum``: the consensus checksum of an epoch made the attacker's: every honest peer that holds another
  "disagreed with the majority's checksum" and re-syncs;
- ``donor``: a joiner accepts the attacker's state file (its checksum passes ``trust.refusal``).

Each for an honest swarm that agrees (one checksum, everyone at one epoch) and one that is split (``--split``
groups whose checksums differ, or peers straddling two epochs in a round's transition), which is when a
plurality is cheapest to beat. The attacker's keys are given the lowest peer ids (ties go to the lowest id: a
stranger can grind keys until it has them). Pure rules: no network; it runs in seconds.

Run: ``python -m benchmarks.sybil_votes``.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import Stopwatch, add_common_args, finish, print_table
from swarm.dht.records import EpochChecksum, PeerState, ProgressRecord
from swarm.dht.view import SwarmView, consensus, global_epoch
from swarm.state.trust import refusal

NAME = "sybil_votes"
E = 10
BAD = "f" * 64


def _record(peer_id: str, epoch: int, checksum: str | None) -> ProgressRecord:
    return ProgressRecord(
        peer_id=peer_id, name="p", device="cpu", epoch=epoch, inner_step=0, samples_per_second=1.0,
        tokens_processed=0, state=PeerState.training.value, last_loss=None, client_mode=False, relayed=False,
        checksums=[EpochChecksum(epoch=epoch, checksum=checksum)] if checksum else [], time=time.time(),
    )  # fmt: skip


def honest_swarm(n: int, split: int, straddle: bool) -> list[ProgressRecord]:
    """``n`` honest peers: at E (or half of them already at E + 1), their checksums of E in ``split`` groups."""
    peers = []
    for i in range(n):
        epoch = E + 1 if straddle and i % 2 else E
        checksum = f"{i % split:064x}" if epoch == E else f"{(i % split) + 100:064x}"
        peers.append(_record(f"Qmhonest{i:06d}", epoch, checksum))
    return peers


def attackers(k: int, epoch: int) -> list[ProgressRecord]:
    return [_record(f"Qm0attacker{i:06d}", epoch, BAD) for i in range(k)]


def moved(attack: str, honest: list[ProgressRecord], k: int) -> bool:
    if attack == "epoch":
        return global_epoch(honest + attackers(k, E + 2)) == E + 2
    if attack == "checksum":
        agreed = consensus(honest + attackers(k, E), E)
        return agreed is not None and agreed.checksum == BAD
    view_peers = honest + attackers(k, E)
    view = SwarmView(tuple(view_peers), global_epoch(view_peers), None)
    wanted = consensus(view.peers, E)
    return wanted is not None and refusal(view, E, BAD, wanted, "joiner") is None


def least_keys(attack: str, honest: list[ProgressRecord]) -> int:
    k = 0
    while not moved(attack, honest, k):
        k += 1
    return k


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sybil_votes", description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--peers", default="10,30,100", help="honest swarm sizes, comma-separated")
    p.add_argument("--split", type=int, default=4, help="groups whose checksums differ, in the split swarm")
    args = p.parse_args(argv)
    clock = Stopwatch()
    sizes = [10] if args.smoke else [int(n) for n in args.peers.split(",")]
    rows = []
    for n in sizes:
        for swarm, split, straddle in (("agrees", 1, False), ("split", args.split, True)):
            honest = honest_swarm(n, split, straddle)
            for attack in ("epoch", "checksum", "donor"):
                k = least_keys(attack, honest)
                rows.append(dict(honest=n, swarm=swarm, attack=attack, keys=k, fraction=round(k / (n + k), 3)))
    print_table(
        "least attacker keys that move each vote (fraction of all keys)",
        ["honest peers", "honest swarm", "attack", "attacker keys", "fraction of keys"],
        [(r["honest"], r["swarm"], r["attack"], r["keys"], r["fraction"]) for r in rows],
    )
    finish(NAME, args.out, dict(split=args.split, results=rows), smoke=args.smoke, clock=clock, plots=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
