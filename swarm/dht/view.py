"""The swarm as every peer and observer sees it, derived from progress records.

Nothing here talks to the network: it is pure functions over records, so the
same rules (who is alive, which epoch is current, which checksum is the
consensus) are applied identically by every peer, the dashboard and the tests.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from swarm.dht.records import PeerEntry, PeerState, ProgressRecord


class ResyncReason(enum.Enum):
    """Why a round was replaced by the swarm's state (``resync_needed``)."""

    behind = "behind the swarm"
    ran_ahead = "ran ahead of the swarm on local rounds"
    disagreed = "disagreed with the majority's checksum"


GONE_STATES = frozenset({PeerState.left.value, PeerState.leaving.value})  # said goodbye
_ACTIVE = {PeerState.training.value, PeerState.matchmaking.value, PeerState.averaging.value}
_UNVOTING = frozenset({PeerState.starting.value, PeerState.downloading_state.value})  # no state of their own yet


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
    """The upper median of live peers' epochs (of two halves, the later); None for an empty swarm.

    A median rather than the maximum, so that one peer announcing a wild epoch cannot send everyone else
    re-syncing; and rather than the most common epoch, so that extra keys cannot buy it cheaply: while honest
    peers straddle two epochs in a round's transition, keys announcing a third were the plurality with a third of
    all keys, and move the median only with half (``benchmarks/sybil_votes.py``).
    """
    epochs = sorted(p.epoch for p in peers if p.state != PeerState.starting.value)
    if not epochs:
        return None
    return epochs[len(epochs) // 2]


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


def _votes(peers: Sequence[ProgressRecord], epoch: int) -> dict[str, list[str]]:
    votes: dict[str, list[str]] = {}
    for p in peers:
        checksum = p.checksum_at(epoch)
        if checksum is not None:
            votes.setdefault(checksum, []).append(p.peer_id)
    return votes


def _winner(epoch: int, votes: dict[str, list[str]], among: Collection[str]) -> Consensus | None:
    if not among:
        return None
    winner = min(among, key=lambda c: (-len(votes[c]), min(votes[c])))
    return Consensus(epoch, winner, tuple(sorted(votes[winner])), sum(map(len, votes.values())))


def consensus(peers: Sequence[ProgressRecord], epoch: int) -> Consensus | None:
    """The checksum held by most peers at ``epoch`` (what the dashboard shows; a running peer takes a
    ``running_consensus``, a joiner only a ``trusted_consensus``).

    Ties go to the checksum held by the lowest peer id, so every peer that sees
    the same records picks the same winner, and two diverged peers converge on one
    of their states instead of swapping.
    """
    votes = _votes(peers, epoch)
    return _winner(epoch, votes, votes)


def electorate(peers: Sequence[ProgressRecord], epoch: int) -> list[ProgressRecord]:
    """The keys whose votes count for ``epoch``, a checksum needing half of them: those that voted for it, and those
    one epoch behind it (still in its round: they count against its first finishers' checksum), past starting and
    downloading. A key at the epoch or later that holds no checksum of it is no honest peer (a peer publishes its
    checksum as it reaches an epoch) and has no say, nor have stragglers further behind. ``global_epoch`` counts
    them all, so the finishers of a round, agreeing, are half of them once their epoch is the global one."""
    return [
        p
        for p in peers
        if p.state not in _UNVOTING and (p.epoch == epoch - 1 or p.epoch >= epoch and p.checksum_at(epoch) is not None)
    ]


def trusted_consensus(peers: Sequence[ProgressRecord], epoch: int) -> Consensus | None:
    """The checksum of ``epoch`` a joiner may take as the swarm's: the most common of those held by at least half
    of the electorate, so that a minority of keys, however they vote and whatever they serve, never makes one.
    None while no checksum has half (a round's groups ended apart, or its first finishers are still few). Ties as
    in ``consensus``."""
    voters = electorate(peers, epoch)
    votes = _votes(voters, epoch)
    return _winner(epoch, votes, [c for c, holders in votes.items() if 2 * len(holders) >= len(voters)])


def running_consensus(peers: Sequence[ProgressRecord], epoch: int, vouched: Collection[str]) -> Consensus | None:
    """The checksum of ``epoch`` a peer already training takes as the swarm's, so that groups whose round ended apart
    converge: the ``trusted_consensus`` while one checksum has half of the electorate; else the most common of the
    checksums that a key in ``vouched`` holds (the peer itself and the keys it averaged with in its recent rounds:
    its own evidence that they train, ``swarm.state.trust.Groupmates``). Keys nobody met in a group can add votes to
    a state a vouched key holds, never make one of their own the swarm's. Ties as in ``consensus``."""
    agreed = trusted_consensus(peers, epoch)
    if agreed is not None:
        return agreed
    votes = _votes(peers, epoch)
    return _winner(epoch, votes, [c for c, holders in votes.items() if not set(holders).isdisjoint(vouched)])


def build_view(entries: Sequence[PeerEntry], now: float, inner_steps: int, samples_per_step: int) -> SwarmView:
    peers = alive(entries, now)
    epoch = global_epoch(peers)
    return SwarmView(
        tuple(sorted(peers, key=lambda p: p.peer_id)),
        epoch,
        eta_next_round(peers, epoch, inner_steps, samples_per_step),
    )


# ---- the rules a peer applies to the view, as pure functions ---------------------------------------


@dataclass(frozen=True)
class Resync:
    """Why a peer must take the swarm's state instead of its own."""

    reason: ResyncReason
    epoch: int  # the peer's
    global_epoch: int | None

    def __str__(self) -> str:
        if self.reason == ResyncReason.disagreed:
            return f"{self.reason.value} at epoch {self.epoch}"
        return f"{self.reason.value} (epoch {self.epoch}, the swarm is at {self.global_epoch})"


def resync_needed(
    view: SwarmView, me: str, epoch: int, checksum: str | None, last_round_local: bool, vouched: Collection[str] = ()
) -> Resync | None:
    """The swarm is ahead of ``epoch``; or our last round was local and took us past the global epoch while
    others sit there; or another checksum is the ``running_consensus`` of ``epoch`` (more than one voting): half of
    the keys hold it, or it is the most common of those that we or a key in ``vouched`` hold."""
    if view.global_epoch is not None and view.global_epoch > epoch:
        return Resync(ResyncReason.behind, epoch, view.global_epoch)
    if last_round_local and view.global_epoch is not None and view.global_epoch < epoch:
        if any(p.peer_id != me and p.epoch == view.global_epoch for p in view.peers):
            return Resync(ResyncReason.ran_ahead, epoch, view.global_epoch)
    agreed = running_consensus(view.peers, epoch, {me, *vouched})
    if agreed is not None and checksum is not None and not agreed.agrees(checksum) and agreed.voters > 1:
        return Resync(ResyncReason.disagreed, epoch, view.global_epoch)
    return None


def swarm_moved_on(view: SwarmView, epoch: int) -> bool:
    """The swarm finished the round of ``epoch`` without us: looking for a group is pointless."""
    return view.global_epoch is not None and view.global_epoch > epoch


def left_behind(view: SwarmView, epoch: int, ended_behind_at: int | None) -> bool:
    """End our round now, between two steps: the swarm already finished it without us (we are slower than the
    rest), and the re-sync at its end would throw the steps left away. Once per epoch of the swarm
    (``ended_behind_at``, the one a round was last ended at): if that re-sync failed, for want of a donor, the
    next try is at step H, not at every step."""
    return swarm_moved_on(view, epoch) and view.global_epoch != ended_behind_at


def mates_coming(view: SwarmView, me: str, epoch: int) -> bool:
    """Other live peers are still working towards the end of ``epoch``: worth waiting for."""
    return any(p.peer_id != me and p.epoch == epoch and p.state in _ACTIVE for p in view.peers)


def round_started_without(view: SwarmView, me: str, epoch: int, min_group_size: int) -> bool:
    """Enough of our epoch-mates are already matchmaking (or merging their groups' averages) to form a group
    without us (a group in all-reduce is closed), and they are most of them: join now with the steps we have."""
    mates = [p for p in view.peers if p.peer_id != me and p.epoch == epoch]
    # merging: their groups' averages are done and wait for ours (two-stage rounds), as a matchmaking peer does
    busy = [p for p in mates if p.state in (PeerState.matchmaking.value, PeerState.merging.value)]
    return len(busy) >= max(1, min_group_size - 1) and 2 * len(busy) > len(mates)


def nobody_to_group_with(view: SwarmView, me: str, epoch: int) -> bool:
    """Two-stage rounds: some epoch-mates are merging their groups' averages and none is still training or looking
    for a group, so a peer looking for one will find nobody: it joins their second stage alone instead of waiting
    out its matchmaking timeout (which held five-peer rounds in groups of two for 20 s each)."""
    mates = [p for p in view.peers if p.peer_id != me and p.epoch == epoch]
    waiting = {PeerState.training.value, PeerState.matchmaking.value}
    return any(p.state == PeerState.merging.value for p in mates) and not any(p.state in waiting for p in mates)


def still_merging(view: SwarmView, epoch: int, me: str) -> list[str]:
    """Peers still merging the round of ``epoch`` (two-stage rounds): they may yet fetch its swarm's average."""
    return [
        p.peer_id for p in view.peers if p.peer_id != me and p.epoch == epoch and p.state == PeerState.merging.value
    ]


def mates_finishing(view: SwarmView, me: str, epoch: int) -> tuple[str, ...]:
    """The peers still matchmaking or averaging the round that took us to ``epoch``: when ours ended without
    them (a local round), they may yet end it together, and theirs is then the swarm's state."""
    busy = {PeerState.matchmaking.value, PeerState.averaging.value}
    return tuple(p.peer_id for p in view.peers if p.peer_id != me and p.epoch == epoch - 1 and p.state in busy)


def groupmates_published(view: SwarmView, group: Sequence[str], me: str, epoch: int) -> bool:
    """Every groupmate still in the swarm has published its checksum for ``epoch`` (or moved past it); one that
    has left (its record gone, or saying it is leaving) is not waited for: it will publish nothing more. A view
    with no records at all is a DHT read that failed (ours is there otherwise), not a swarm everyone left."""
    mates = set(group) - {me}
    published = {p.peer_id for p in view.peers if p.checksum_at(epoch) is not None or p.epoch > epoch}
    present = {p.peer_id for p in view.peers}
    return not mates or (bool(present) and mates & present <= published)


def seconds_to_round(
    view: SwarmView, me: str, epoch: int, inner_steps: int, samples_per_step: int, now: float
) -> float:
    """When the first of our epoch-mates will reach the end of its round and start matchmaking, from the speed
    and step in their records (corrected for the records' age); inf when no mate is training."""
    soonest = float("inf")
    for p in view.peers:
        if p.peer_id == me or p.epoch != epoch or p.state not in _ACTIVE:
            continue
        if p.state != PeerState.training.value:
            return 0.0
        if p.samples_per_second > 0:
            left = (inner_steps - p.inner_step) * samples_per_step / p.samples_per_second - max(0.0, now - p.time)
            soonest = min(soonest, max(0.0, left))
    return soonest


def round_due(
    view: SwarmView,
    me: str,
    epoch: int,
    min_group_size: int,
    inner_steps: int,
    samples_per_step: int,
    my_step_seconds: float,
    now: float,
    my_steps_left: int = 2,
) -> bool:
    """A round closes on the swarm's progress, not on each peer's step count: a peer ends its round, with the
    steps it has, when its epoch-mates have started matchmaking without it, or when the first of them will
    reach the end of its round before this peer could finish one more step: waiting for them in matchmaking
    costs at most that step, while a step that ends after the group formed costs the whole round. On its own
    last step a peer finishes it unless the mates will be there within half of it (records are up to a
    refresh old, so the estimate runs early; equal peers should not all stop a step short). Pseudo-gradients
    are weighted by samples, so a slow peer's smaller contribution counts for what it is (dynamic local
    updates, as in Async DiLoCo)."""
    if round_started_without(view, me, epoch, min_group_size):
        return True
    eta = seconds_to_round(view, me, epoch, inner_steps, samples_per_step, now)
    return eta < (my_step_seconds if my_steps_left >= 2 else 0.5 * my_step_seconds)
