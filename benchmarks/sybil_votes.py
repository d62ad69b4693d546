"""How many keys does a stranger need to move the swarm's votes? The client's own vote rules, against extra keys.

Keys are free: a stranger can run many peers, each with its own identity, each publishing a progress record that
votes. This drives the rules every peer applies to the records it reads (``swarm.dht.view.global_epoch``,
``swarm.dht.view.consensus``, ``trusted_consensus``, ``swarm.state.trust.wanted`` and ``refusal``) with ``N``
honest records and ``k`` of an attacker's, and finds the least ``k`` that moves each vote:

- ``epoch``: the global epoch made one that no honest peer holds (E + 2 while honest peers are at E and E + 1):
  every honest peer then reads itself "behind" and downloads, and the doubts take over (``swarm.state.doubts``);
- ``checksum``: a running honest peer takes the attacker's checksum of E as the swarm's: it "disagreed with the
  majority's checksum" and loads the attacker's state. ``plurality`` is the rule before (the most common checksum
  of E, whoever holds it); ``vouched`` is ``swarm.dht.view.running_consensus`` (half of the keys' checksum, else the
  most common one the peer or one of its recent groupmates holds) with four honest groupmates, one of each honest
  state; ``vouched, one met`` the same with one of the attacker's keys among its groupmates too (it averaged with
  the peer lately and passed its checks);
- ``donor``: a joiner accepts the attacker's state file of E (``trust.wanted`` and ``trust.refusal``).

Each for an honest swarm that agrees (one checksum, everyone at one epoch) and one that is split (``--split``
groups whose checksums of E differ, all from the same state of E - 1, and half of the peers already at E + 1),
which is when a plurality is cheapest to beat. The attacker's keys vote its checksum for E and are given the
lowest peer ids (ties go to the lowest id: a stranger can grind keys until it has them). For ``donor``,
``plurality`` is the rule before this one, in the same run: the most common checksum, held by two keys. Pure
rules: no network; it runs in seconds.

Run: ``python -m benchmarks.sybil_votes``.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import Stopwatch, add_common_args, finish, print_table
from swarm.dht.records import EpochChecksum, PeerState, ProgressRecord
from swarm.dht.view import SwarmView, consensus, global_epoch, resync_needed, running_consensus
from swarm.state.trust import refusal, wanted

NAME = "sybil_votes"
E = 10
BAD = "f" * 64
BEFORE = "e" * 64  # the honest swarm's checksum of E - 1


def _record(peer_id: str, epoch: int, checksums: dict[int, str]) -> ProgressRecord:
    return ProgressRecord(
        peer_id=peer_id, name="p", device="cpu", epoch=epoch, inner_step=0, samples_per_second=1.0,
        tokens_processed=0, state=PeerState.training.value, last_loss=None, client_mode=False, relayed=False,
        checksums=[EpochChecksum(epoch=e, checksum=c) for e, c in checksums.items()], time=time.time(),
    )  # fmt: skip


def honest_swarm(n: int, split: int, straddle: bool) -> list[ProgressRecord]:
    """``n`` honest peers: at E (or half of them already at E + 1), their checksums of E in ``split`` groups, all
    from the one checksum of E - 1."""
    peers = []
    for i in range(n):
        epoch = E + 1 if straddle and i % 2 else E
        checksums = {E - 1: BEFORE, E: f"{i % split:064x}"}
        if epoch == E + 1:
            checksums[E + 1] = f"{(i % split) + 100:064x}"
        peers.append(_record(f"Qmhonest{i:06d}", epoch, checksums))
    return peers


def attackers(k: int, epoch: int) -> list[ProgressRecord]:
    return [_record(f"Qm0attacker{i:06d}", epoch, {E - 1: BAD, epoch: BAD}) for i in range(k)]


def moved(attack: str, rule: str, honest: list[ProgressRecord], k: int) -> bool:
    if attack == "epoch":
        return global_epoch(honest + attackers(k, E + 2)) == E + 2
    peers = honest + attackers(k, E)
    view = SwarmView(tuple(peers), global_epoch(peers), None)
    if attack == "checksum":  # an honest peer of epoch E holding another checksum
        me = honest[0].peer_id
        if rule == "plurality":  # the rule before
            agreed = consensus(peers, E)
            return agreed.checksum == BAD and agreed.checksum != honest[0].checksum_at(E)
        vouched = {q.peer_id for q in honest[1:5]} | ({peers[-1].peer_id} if rule == "vouched, one met" else set())
        why = resync_needed(view, me, E, honest[0].checksum_at(E), False, vouched)
        agreed = running_consensus(peers, E, {me, *vouched})
        return why is not None and agreed.checksum == BAD and refusal(view, E, BAD, agreed, me, vouched=vouched) is None
    if rule == "plurality":  # the rule before: the most common checksum, two holders
        agreed = consensus(peers, E)
        return agreed is not None and agreed.checksum == BAD and len(agreed.holders) >= 2
    chosen = wanted(view)
    return chosen is not None and refusal(view, E, BAD, chosen, "joiner", joining=True) is None


def least_keys(attack: str, rule: str, honest: list[ProgressRecord]) -> int:
    k = 0
    while not moved(attack, rule, honest, k):
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
                rules = {
                    "epoch": ("median",),
                    "checksum": ("plurality", "vouched", "vouched, one met"),
                    "donor": ("plurality", "trusted"),
                }[attack]
                for rule in rules:
                    k = least_keys(attack, rule, honest)
                    rows.append(dict(honest=n, swarm=swarm, attack=attack, rule=rule, keys=k,
                                     fraction=round(k / (n + k), 3)))  # fmt: skip
    print_table(
        "least attacker keys that move each vote (fraction of all keys)",
        ["honest peers", "honest swarm", "attack", "rule", "attacker keys", "fraction of keys"],
        [(r["honest"], r["swarm"], r["attack"], r["rule"], r["keys"], r["fraction"]) for r in rows],
    )
    finish(NAME, args.out, dict(split=args.split, results=rows), smoke=args.smoke, clock=clock, plots=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
