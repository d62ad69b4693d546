"""Whether a state file a donor served is the swarm's: pure rules, decided by the peer from the swarm's view.

The peer picks the epoch it wants and its checksum from the view before it downloads (``wanted``). The file's
header names an epoch and a checksum; the donor chose those, so neither is believed on its own:

- an epoch older than the one wanted is refused (a donor serving a stale state);
- an epoch later than the swarm has reached is refused (a donor publishing a "future" checksum for its own file);
- a later epoch the swarm has reached meanwhile (it moved on during the download) is checked like the wanted one;
- the checksum must be the trusted consensus of that epoch in the view read after the download
  (``swarm.dht.view.trusted_consensus``): held by at least half of the live keys past starting, or, for a
  peer already training, by a key it averaged with in its last ``GROUPMATE_ROUNDS`` rounds (``Groupmates``).
  Keys are free; a majority of them is not: an attacker needs half of all keys to make a joiner take its state,
  and a running peer takes another state without a majority only from a plurality that holds one of its own
  recent groupmates (keys that sent it parts every round, as a trainer does);
- and held by at least ``MIN_HOLDERS`` peers other than us when that many have voted for the epoch. Two: one key
  is any donor's own vote for its own file, while a second holder means a peer that computed the same outer step
  on its own. A swarm with only one other voter has nobody to compare with, and its one holder is taken (the
  first joiner of a run of one peer).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable, Sequence

from swarm.dht.records import CHECKSUM_HISTORY, ProgressRecord
from swarm.dht.view import Consensus, SwarmView, trusted_consensus

MIN_HOLDERS = 2
GROUPMATE_ROUNDS = 16  # a peer vouches for the keys it averaged with in its last this many averaged rounds
MAX_GROUPMATES = 256  # a group is bounded by the manifest; this bounds what one round can add


class Groupmates:
    """The keys this peer averaged with (their parts taken into its average) in its last ``GROUPMATE_ROUNDS``
    averaged rounds, and the checksum each of those rounds ended on: its own evidence that they train with it,
    read by ``trusted_consensus``. A mate whose record holds another checksum for an epoch we ended in a group
    with it contradicts what we saw, and is no evidence while it does."""

    def __init__(self) -> None:
        self._rounds: deque[tuple[int, frozenset[str], str]] = deque(maxlen=GROUPMATE_ROUNDS)

    def note(self, group: Iterable[str], me: str, epoch: int, checksum: str) -> None:
        """``group`` ended a round with us on the state of ``epoch`` whose checksum is ``checksum``."""
        mates = frozenset(p for p in list(group)[:MAX_GROUPMATES] if p != me)
        if mates:
            self._rounds.append((epoch, mates, checksum))

    def keys(self, peers: Sequence[ProgressRecord] = ()) -> frozenset[str]:
        """Our recent groupmates, less those whose record in ``peers`` contradicts a round we shared."""
        mates = frozenset().union(*(m for _, m, _ in self._rounds))
        records = {p.peer_id: p for p in peers if p.peer_id in mates}
        contradicting = {
            mate
            for epoch, shared, checksum in self._rounds
            for mate in shared & records.keys()
            if records[mate].checksum_at(epoch) not in (None, checksum)
        }
        return mates - contradicting


def wanted(view: SwarmView, vouched: Collection[str], floor: int = 0) -> Consensus | None:
    """The state to fetch: the trusted consensus of the latest epoch that has one, from the view's global epoch
    down to ``floor`` through the epochs the records still hold (while a round ends, its first finishers are no
    majority yet, and the epoch before is the one the swarm holds)."""
    if view.global_epoch is None:
        return None
    for epoch in range(view.global_epoch, max(floor, view.global_epoch - CHECKSUM_HISTORY + 1) - 1, -1):
        agreed = trusted_consensus(view.peers, epoch, vouched)
        if agreed is not None:
            return agreed
    return None


def refusal(
    view: SwarmView, epoch: int, checksum: str, wanted: Consensus, me: str, vouched: Collection[str] = ()
) -> str | None:
    """Why the state of ``epoch`` and ``checksum`` a donor served is not accepted, or None if it is; ``vouched``:
    the keys whose plurality we take without a majority (none, for a joiner)."""
    if epoch < wanted.epoch:
        return f"the donor served epoch {epoch}, older than the swarm's {wanted.epoch}"
    reached = max(wanted.epoch, view.global_epoch if view.global_epoch is not None else wanted.epoch)
    if epoch > reached:
        return f"the donor served epoch {epoch}, which the swarm has not reached ({reached})"
    agreed = trusted_consensus(view.peers, epoch, vouched) or (wanted if epoch == wanted.epoch else None)
    if agreed is None or not agreed.agrees(checksum):
        return f"the state is not the one a majority of peers, or our groupmates, hold for epoch {epoch}"
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
