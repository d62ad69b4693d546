"""Whether a state file a donor served is the swarm's: a pure rule, decided by the joiner from the swarm's view.

The joiner picks the epoch it wants (the global epoch) and its consensus from the view before it downloads. The
file's header names an epoch and a checksum; the donor chose those, so neither is believed on its own:

- an epoch older than the one wanted is refused (a donor serving a stale state);
- an epoch later than the swarm has reached is refused (a donor publishing a "future" checksum for its own file);
- a later epoch the swarm has reached meanwhile (it moved on during the download) is checked like the wanted one;
- the checksum must be the consensus of that epoch in the view read after the download, and held by at least
  ``MIN_HOLDERS`` peers other than us when that many have voted for the epoch. Two: one key is any donor's own
  vote for its own file, while a second holder means a peer that computed the same outer step on its own. A swarm
  with only one other voter has nobody to compare with, and its one holder is taken (the first joiner of a run of
  one peer). Keys are free, so this does not stop an attacker holding two keys: votes weighted by something keys
  cannot buy are the rest of that defence (``docs/security.md``).
"""

from __future__ import annotations

from swarm.dht.view import Consensus, SwarmView, consensus

MIN_HOLDERS = 2


def refusal(view: SwarmView, epoch: int, checksum: str, wanted: Consensus, me: str) -> str | None:
    """Why the state of ``epoch`` and ``checksum`` a donor served is not accepted, or None if it is."""
    if epoch < wanted.epoch:
        return f"the donor served epoch {epoch}, older than the swarm's {wanted.epoch}"
    reached = max(wanted.epoch, view.global_epoch if view.global_epoch is not None else wanted.epoch)
    if epoch > reached:
        return f"the donor served epoch {epoch}, which the swarm has not reached ({reached})"
    agreed = consensus(view.peers, epoch) or (wanted if epoch == wanted.epoch else None)
    if agreed is None or not agreed.agrees(checksum):
        return f"the state is not the one most peers hold for epoch {epoch}"
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
