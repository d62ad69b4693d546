"""Whether a state file a donor served is the swarm's: pure rules, decided by the peer from the swarm's view.

The peer picks the epoch it wants and its checksum from the view before it downloads (``wanted``). The file's
header names an epoch and a checksum; the donor chose those, so neither is believed on its own:

- an epoch older than the one wanted is refused (a donor serving a stale state);
- an epoch later than the swarm has reached is refused (a donor publishing a "future" checksum for its own file);
- a later epoch the swarm has reached meanwhile (it moved on during the download) is checked like the wanted one;
- the checksum must be the consensus of that epoch in the view read after the download: for a joiner, the
  trusted consensus (``swarm.dht.view.trusted_consensus``: held by at least half of the keys that voted for the
  epoch or are one epoch behind it); keys are free, a majority of them is not, so an attacker needs half of all
  keys to make a joiner take its state. A running peer that re-syncs, so that groups whose round ended apart
  converge on one state, takes the ``running_consensus``: without a majority, the most common checksum that it or
  one of its recent groupmates (``Groupmates``) holds. Extra keys can add votes to a candidate, not make one: a
  state of theirs needs one of them to have averaged with that peer lately (its parts taken, it not caught);
- and held by at least ``MIN_HOLDERS`` peers other than us when that many have voted for the epoch. Two: one key
  is any donor's own vote for its own file, while a second holder means a peer that computed the same outer step
  on its own. A swarm with only one other voter has nobody to compare with, and its one holder is taken (the
  first joiner of a run of one peer).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable

from swarm.dht.records import CHECKSUM_HISTORY, MAX_GROUP
from swarm.dht.view import Consensus, SwarmView, running_consensus, trusted_consensus

MIN_HOLDERS = 2
GROUPMATE_ROUNDS = 16  # averaged rounds whose groupmates are remembered


class Groupmates:
    """The keys this peer averaged with (their parts taken into its average, none caught lying) in its last
    ``GROUPMATE_ROUNDS`` averaged rounds: its own evidence that they train, read by ``running_consensus``. A key
    cannot put itself here without joining one of this peer's groups and passing its checks."""

    def __init__(self) -> None:
        self._rounds: deque[frozenset[str]] = deque(maxlen=GROUPMATE_ROUNDS)

    def note(self, group: Iterable[str], me: str) -> None:
        mates = frozenset(p for p in list(group)[:MAX_GROUP] if p != me)
        if mates:
            self._rounds.append(mates)

    def forget(self, peers: Collection[str]) -> None:
        """Keys caught lying since (banned): no longer evidence of anything."""
        gone = set(peers)
        self._rounds = deque((mates - gone for mates in self._rounds), maxlen=GROUPMATE_ROUNDS)

    def keys(self) -> frozenset[str]:
        return frozenset().union(*self._rounds)


def wanted(view: SwarmView) -> Consensus | None:
    """The state a joiner fetches: the trusted consensus of the latest epoch that has one, from the view's global
    epoch down through the epochs the records still hold (while a round ends with its groups apart, the epoch
    before, which the whole swarm held)."""
    if view.global_epoch is None:
        return None
    for epoch in range(view.global_epoch, max(0, view.global_epoch - CHECKSUM_HISTORY + 1) - 1, -1):
        agreed = trusted_consensus(view.peers, epoch)
        if agreed is not None:
            return agreed
    return None


def servable(view: SwarmView, agreed: Consensus | None, me: str) -> bool:
    """Whether a joiner can fetch ``agreed`` (``wanted``) now: it is of the global epoch, or a holder other than us
    is still at its epoch (the others serve a later state, which half of the keys do not hold yet)."""
    if agreed is None:
        return False
    holders = set(agreed.holders) - {me}
    at_its_epoch = any(p.peer_id in holders and p.epoch == agreed.epoch for p in view.peers)
    return agreed.epoch == view.global_epoch or at_its_epoch


def refusal(
    view: SwarmView,
    epoch: int,
    checksum: str,
    wanted: Consensus,
    me: str,
    joining: bool = False,
    vouched: Collection[str] = (),
) -> str | None:
    """Why the state of ``epoch`` and ``checksum`` a donor served is not accepted, or None if it is; ``joining``:
    only a trusted consensus will do; otherwise the ``running_consensus`` with ``vouched`` (our recent groupmates)."""
    if epoch < wanted.epoch:
        return f"the donor served epoch {epoch}, older than the swarm's {wanted.epoch}"
    reached = max(wanted.epoch, view.global_epoch if view.global_epoch is not None else wanted.epoch)
    if epoch > reached:
        return f"the donor served epoch {epoch}, which the swarm has not reached ({reached})"
    if joining:
        agreed = trusted_consensus(view.peers, epoch)
    else:
        agreed = running_consensus(view.peers, epoch, {me, *vouched})
    agreed = agreed or (wanted if epoch == wanted.epoch else None)
    if agreed is None or not agreed.agrees(checksum):
        held = "half of the peers" if joining else "most peers"
        return f"the state is not the one {held} hold for epoch {epoch}"
    holders = [peer for peer in agreed.holders if peer != me]
    voters = [p for p in view.peers if p.peer_id != me and p.checksum_at(epoch) is not None]
    needed = min(MIN_HOLDERS, max(1, len(voters)))
    if len(holders) < needed:
        return f"the state of epoch {epoch} is held by {len(holders)} peer(s), {needed} needed"
    return None


def served_a_lie(donor: str, epoch: int, checksum: str, wanted: Consensus) -> bool:
    """Whether a verified file (its bytes match its header) proves that its donor served a state other than the one
    it voted for: the donor holds the wanted epoch's consensus, and the file is of that epoch with another checksum.
    An honest peer never holds two states of one epoch; an older or later epoch is no lie (the donor's round may
    have ended during the download)."""
    return donor in wanted.holders and epoch == wanted.epoch and not wanted.agrees(checksum)
