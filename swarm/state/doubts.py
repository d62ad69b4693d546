"""States that nobody serves are not believed: the keys that said the swarm reached an epoch ahead of ours, or
that hold another checksum of our epoch as its majority, when none of them served that state, leave our view for a
while.

The global epoch is the upper median of live keys' epochs (``swarm.dht.view.global_epoch``), so half of the keys
move it. A stranger holding them (its own peer, and extra keys that are only DHT records) made every honest peer
"behind": its re-syncs found no donor serving the claimed epoch (the extra keys serve nothing, the stranger serves
its own), and every round's work was thrown away (``benchmarks/results/byzantine-sybil``). An epoch the swarm
really reached is served by the peers that reached it. So when a state download found nobody serving the epoch we
were told the swarm is at, the keys that claimed it (every live key at that epoch or later) are doubted: their
records leave this peer's view (no vote, mate or donor, as a ban does) until our own epoch has passed the one they
claimed by ``DOUBT_ROUNDS`` rounds, twice as long each time the same key is doubted again (``swarm.dht.ledger``).
Then they are believed again, and asked again. Only this peer's view changes: nothing is published and nobody is
accused (a claim that
was not served proves nothing to others: the one asking could be the one cut off).

Extra keys voting a made-up checksum of the current epoch are the same attack one step over: with more votes than
the honest peers (half of the keys while those agree, a fifth when a round split their checksums four ways:
``benchmarks/results/sybil-votes``) they made every honest peer "disagree with the majority", and its re-sync found
nobody serving that checksum. The holders of a consensus nobody serves are doubted the same way.

A joiner, which holds no state of the swarm yet, doubts only while someone else in its view (not it, not the
claimants) says otherwise: one that reaches nobody must not drop the whole swarm and start alone from the seed.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from swarm.dht.ledger import EpochLedger
from swarm.dht.records import PeerEntry, PeerState
from swarm.dht.view import SwarmView, consensus, running_consensus

DOUBT_ROUNDS = 3  # rounds of ours past the claimed epoch before its claimants are believed (and asked) again
MAX_DOUBT_ROUNDS = 96  # the doubling stops here: an honest peer that once could not serve is not shut out for good
MAX_DOUBTED = 1024  # keys remembered (a stranger can make keys: a bound)
STARTING = PeerState.starting.value  # a key that vouches for nothing yet


def unserved_claimants(
    view: SwarmView, me: str, epoch: int, mine: str | None, joining: bool, vouched: Collection[str] | None = None
) -> tuple[str, ...]:
    """Whom to doubt when no donor served the state the view says is the swarm's, which is not ours (``mine``, our
    checksum at our ``epoch``): every other live key at the view's global epoch or later when that is ahead of ours;
    at our own epoch, the holders of its consensus checksum (the ``running_consensus`` with ``vouched``, our recent
    groupmates, when given: the one a running peer was told to take). None when the view's state is ours, or behind
    ours (we ran ahead: those are the swarm), nor (``joining``) when nobody else (not us, not them) is in the
    view."""
    claimed = view.global_epoch
    if claimed is None or claimed < epoch:
        return ()
    if claimed > epoch:
        claim = tuple(p.peer_id for p in view.peers if p.peer_id != me and p.epoch >= claimed)
    else:
        agreed = consensus(view.peers, epoch) if vouched is None else running_consensus(view.peers, epoch, vouched)
        if agreed is None or agreed.agrees(mine):
            return ()
        claim = tuple(peer for peer in agreed.holders if peer != me)
    witnesses = [p for p in view.peers if p.peer_id != me and p.peer_id not in claim and p.state != STARTING]
    return () if joining and not witnesses else claim


class Doubts(EpochLedger):
    """The keys this peer does not believe for now; ``epoch()`` is ours (the doubts end as it passes theirs)."""

    def __init__(self, epoch: Callable[[], int]):
        super().__init__(epoch, DOUBT_ROUNDS, MAX_DOUBT_ROUNDS, MAX_DOUBTED)

    def doubted(self, peer: str) -> bool:
        return self.holds(peer)

    def filter(self, entries: Sequence[PeerEntry]) -> list[PeerEntry]:
        """The entries of keys not doubted now."""
        if not self:
            return list(entries)
        return [e for e in entries if not self.holds(e.record.peer_id)]
