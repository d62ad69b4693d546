"""The swarm as every peer and observer sees it, derived from progress records.

Nothing here talks to the network: it is pure functions over records, so the
same rules (who is alive, which epoch is current, which checksum is the
consensus) are applied identically by every peer, the dashboard and the tests.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from swarm.progress import PeerEntry
from swarm.records import PeerState, ProgressRecord

GONE_STATES = frozenset({PeerState.left.value, PeerState.leaving.value})  # said goodbye
_ACTIVE = {PeerState.training.value, PeerState.matchmaking.value, PeerState.averaging.value}


@dataclass(frozen=True)
class Consensus:
    """The checksum most peers hold for one epoch, and who holds it."""

    epoch: int
    checksum: str
    holders: tuple[str, ...]
    voters: int

    def agrees(self, checksum: str | None) -> bool:
        return checksum == self.checksum


@dataclass(frozen=True)
class SwarmView:
    peers: tuple[ProgressRecord, ...]  # alive, not leaving
    global_epoch: int | None
    eta_next_round: float | None  # seconds

    @property
    def num_alive(self) -> int:
        return len(self.peers)

    @property
    def samples_per_second(self) -> float:
        return sum(p.samples_per_second for p in self.peers)

    @property
    def tokens_processed(self) -> int:
        return sum(p.tokens_processed for p in self.peers)


def alive(entries: Sequence[PeerEntry], now: float) -> list[ProgressRecord]:
    """Peers whose record has not expired and who have not said they are leaving."""
    return [e.record for e in entries if e.expiration >= now and e.record.state not in GONE_STATES]


def global_epoch(peers: Sequence[ProgressRecord]) -> int | None:
    """The epoch most live peers are at (ties go to the later epoch); None for an empty swarm.

    A majority rather than the maximum, so that one peer announcing a wild epoch
    cannot send everyone else re-syncing.
    """
    epochs = Counter(p.epoch for p in peers if p.state != PeerState.starting.value)
    if not epochs:
        return None
    return max(epochs, key=lambda e: (epochs[e], e))


def eta_next_round(
    peers: Sequence[ProgressRecord], epoch: int | None, inner_steps: int, samples_per_step: int
) -> float | None:
    """Seconds until the slowest training peer of ``epoch`` reaches its averaging point."""
    remaining = []
    for p in peers:
        if p.epoch != epoch or p.state not in _ACTIVE:
            continue
        if p.state != PeerState.training.value:
            remaining.append(0.0)
        elif p.samples_per_second > 0:
            remaining.append((inner_steps - p.inner_step) * samples_per_step / p.samples_per_second)
    return max(remaining) if remaining else None


def consensus(peers: Sequence[ProgressRecord], epoch: int) -> Consensus | None:
    """The checksum held by most peers at ``epoch``.

    Ties go to the checksum held by the lowest peer id, so every peer that sees
    the same records picks the same winner, and two diverged peers converge on one
    of their states instead of swapping.
    """
    votes: dict[str, list[str]] = {}
    for p in peers:
        checksum = p.checksum_at(epoch)
        if checksum is not None:
            votes.setdefault(checksum, []).append(p.peer_id)
    if not votes:
        return None
    winner = min(votes, key=lambda c: (-len(votes[c]), min(votes[c])))
    return Consensus(epoch, winner, tuple(sorted(votes[winner])), sum(map(len, votes.values())))


def build_view(entries: Sequence[PeerEntry], now: float, inner_steps: int, samples_per_step: int) -> SwarmView:
    peers = alive(entries, now)
    epoch = global_epoch(peers)
    return SwarmView(
        tuple(sorted(peers, key=lambda p: p.peer_id)),
        epoch,
        eta_next_round(peers, epoch, inner_steps, samples_per_step),
    )
