"""Patience is for peers that come: the keys a round waited for that never came are not waited for again a while.

A peer waits for its epoch-mates in four places, and each reads what their records say: a round that found no group
retries while mates are on their way (``swarm.dht.view.mates_coming``, up to ``averaging.wait_for_peers``); a peer
that found none joins the others' second stage once nobody is still training (``nobody_to_group_with``); a peer
ends its round early when a mate's record says it will arrive before our next step ends (``round_due``); and a
delegate holds the second stage while peers of the epoch are unaccounted for (``swarm.dht.groups.delegate_decision``,
up to half of ``averaging.merge_timeout``). A record costs nothing to write: two extra keys saying "training" at the
swarm's epoch held every merge of three honest peers for those 30 s (the ``outvote`` benchmark's rounds took 34 s,
honest ones 8; with no-shows 14-16.5 s: ``benchmarks/results/byzantine-no-shows``), and a key claiming to be one
step from the end would cut every honest round short.

So when a round ends, the keys that were still working towards it (training, matchmaking or averaging at its epoch,
outside our group) both when our first stage ended and in a record written after that missed it: they are no-shows.
So are the keys a delegate waited its whole patience for (``given_up_on``): a key that follows the swarm's epoch is
at the next one by the time the round ends.
The view those waits read leaves them out until our epoch has passed the round's by ``NO_SHOW_ROUNDS``, twice as
long each time a key misses again (``swarm.dht.ledger``). Nothing else changes: their votes count, they may join
any group, and they are asked for states; only nobody waits for them. An honest peer that missed a round so was
slower than the swarm's patience already: it joins the rounds it reaches (a peer ends its own round early when its
mates start without it), and is waited for again when its hold ends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace

from swarm.dht.groups import WORKING, groups_at
from swarm.dht.ledger import EpochLedger
from swarm.dht.records import GroupRecord, PeerState
from swarm.dht.view import SwarmView

logger = logging.getLogger(__name__)

NO_SHOW_ROUNDS = 2  # rounds of ours past the missed one before a no-show is waited for again
MAX_NO_SHOW_ROUNDS = 64  # the doubling stops here
MAX_NO_SHOWS = 1024  # keys remembered (a stranger can make keys: a bound)


def working_towards(view: SwarmView, me: str, epoch: int) -> frozenset[str]:
    """The other keys whose records say they are still working towards the end of ``epoch``."""
    return frozenset(p.peer_id for p in view.peers if p.peer_id != me and p.epoch == epoch and p.state in WORKING)


def no_shows(
    awaited: Collection[str], view: SwarmView, me: str, epoch: int, group: Collection[str], since: float
) -> tuple[str, ...]:
    """Of the keys ``awaited`` (working towards ``epoch`` when our first stage ended, at DHT time ``since``), those
    outside our ``group`` that a record written after ``since`` still shows working towards it: they missed it."""
    return tuple(
        sorted(
            p.peer_id
            for p in view.peers
            if p.peer_id in awaited
            and p.peer_id != me
            and p.peer_id not in group
            and p.epoch == epoch
            and p.state in WORKING
            and p.time > since
        )
    )


def given_up_on(
    view: SwarmView, records: Sequence[GroupRecord], me: str, epoch: int, group: Collection[str], tag: str
) -> tuple[str, ...]:
    """The keys a delegate waited its whole patience for (``swarm.dht.groups.unaccounted``): those still working
    towards ``epoch``, and, while more keys say they are merging than the other registered groups hold, the merging
    keys that speak for no registered group (a member of one may be among them: held for a round or two, it only
    goes unwaited-for; a key that says "merging" must not hold every merge for free)."""
    registered = [r for r in groups_at(records, epoch) if r.group != tag]
    others = [p for p in view.peers if p.epoch == epoch and p.peer_id != me and p.peer_id not in group]
    missed = {p.peer_id for p in others if p.state in WORKING}
    merging = {p.peer_id for p in others if p.state == PeerState.merging.value}
    if len(merging) > sum(r.size for r in registered):
        missed |= merging - {r.delegate for r in registered}
    return tuple(sorted(missed))


class NoShows(EpochLedger):
    """The keys nobody waits for now; ``epoch()`` is ours."""

    def __init__(self, epoch: Callable[[], int]):
        super().__init__(epoch, NO_SHOW_ROUNDS, MAX_NO_SHOW_ROUNDS, MAX_NO_SHOWS)

    def note(self, missed: Sequence[str], epoch: int, what: str) -> list[str]:
        """Hold the keys that missed the round of ``epoch`` (``what`` says how, for the log); a key held already
        (noted earlier in the same round) is not held longer for it. The keys newly held."""
        fresh = [peer for peer in missed if not self.holds(peer)]
        if fresh:
            rounds = self.add(fresh, epoch)
            logger.info("epoch %d: %d key(s) %s: not waited for in the next %d rounds (%s)", epoch, len(fresh), what,
                        rounds, ", ".join(p[-6:] for p in fresh))  # fmt: skip
        return fresh

    def waiting_view(self, view: SwarmView | None) -> SwarmView | None:
        """``view`` without the no-shows' records: what a wait for epoch-mates reads (its global epoch unchanged)."""
        if view is None or not self:
            return view
        return replace(view, peers=tuple(p for p in view.peers if not self.holds(p.peer_id)))
