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

Keys cost nothing, so a stranger can also make a new one every round: each new key is held only after it missed, so
it held every merge of the swarm for the whole patience. So the merge's wait also holds **strangers** as one: the
keys that are not our groupmates (``swarm.state.trust.Groupmates``: keys whose parts we took in our last 16 averaged
rounds, and a delegate's second-stage partners). Once a merge waited out its patience in vain for a stranger, until
our epoch passes the round's by ``NO_SHOW_ROUNDS`` (twice as long each time it happens again, up to
``MAX_NO_SHOW_ROUNDS``; the doubling starts over after ``MAX_NO_SHOW_ROUNDS`` rounds without one) a delegate waits
its patience only for groupmates: a stranger that says it is in a group (averaging, or merging past what the
registered groups hold) is waited for ``STRANGER_GRACE`` seconds after we registered, and one that says it is still
training or matchmaking not at all (``NoShows.merge_decision``). A key made anew every round is so waited for its
whole patience about log2(rounds) times per peer over a run, and briefly in the other rounds if it says "averaging";
a stranger that sets the hold off on purpose costs the honest swarm the work of the groups that register more than
``STRANGER_GRACE`` after the first, and of the peers that reach the round late, in the rounds it lasts
(``benchmarks/results/swarm-sim-strangers``). Nothing else changes: the first stage's waits read every key (most of
a big swarm's keys are strangers to us), and a stranger may join any group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

from swarm.dht.groups import ROSTER_WAIT, WORKING, Decision, delegate_decision, groups_at
from swarm.dht.ledger import EpochLedger
from swarm.dht.records import GroupRecord, PeerState
from swarm.dht.view import SwarmView

logger = logging.getLogger(__name__)

NO_SHOW_ROUNDS = 2  # rounds of ours past the missed one before a no-show is waited for again
MAX_NO_SHOW_ROUNDS = 64  # the doubling stops here
MAX_NO_SHOWS = 1024  # keys remembered (a stranger can make keys: a bound)
STRANGER_GRACE = 2 * ROSTER_WAIT  # seconds a held stranger in a group is waited for (``NoShows.merge_decision``)


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


@dataclass
class StrangersHold:
    """How long strangers are left out of the merge's wait: until our epoch reaches ``until``; ``times``: the merges
    that gave up on a stranger since the doubling last started over."""

    until: int = 0
    times: int = 0

    def missed(self, epoch: int) -> int:
        """A merge of ``epoch`` gave up on a stranger: hold them; how many of our rounds. The doubling starts over
        once ``MAX_NO_SHOW_ROUNDS`` rounds passed since the last hold ended without a merge waiting in vain."""
        if epoch >= self.until + MAX_NO_SHOW_ROUNDS:
            self.times = 0
        self.times += 1
        rounds = min(MAX_NO_SHOW_ROUNDS, NO_SHOW_ROUNDS << min(self.times - 1, 16))
        self.until = max(self.until, epoch + rounds)
        return rounds


class NoShows(EpochLedger):
    """The keys nobody waits for now; ``epoch()`` is ours, ``known()`` our groupmates (the rest are strangers)."""

    def __init__(self, epoch: Callable[[], int], known: Callable[[], Collection[str]]):
        super().__init__(epoch, NO_SHOW_ROUNDS, MAX_NO_SHOW_ROUNDS, MAX_NO_SHOWS)
        self._known = known
        self.strangers = StrangersHold()

    def holds_strangers(self) -> bool:
        return self._epoch() < self.strangers.until

    def note_merge(self, missed: Sequence[str], epoch: int) -> list[str]:
        """A merge of ``epoch`` waited out its patience for ``missed`` (``given_up_on``): hold each, and, if one is
        a stranger, the strangers. The keys newly held."""
        fresh = self.note(missed, epoch, "never came to the merge")
        known = frozenset(self._known())
        strangers = [p for p in missed if p not in known]
        if strangers and not self.holds_strangers():
            self.strangers.missed(epoch)
            logger.info("epoch %d: the merge waited in vain for %d key(s) that never averaged with us: until our "
                        "epoch %d, strangers are waited for briefly or not at all", epoch, len(strangers),
                        self.strangers.until)  # fmt: skip
        return fresh

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

    def merge_decision(
        self,
        view: SwarmView,
        records: Sequence[GroupRecord],
        epoch: int,
        group: Sequence[str],
        tag: str,
        waited: float,
        patience: float,
        group_patience: float,
    ) -> Decision:
        """``delegate_decision`` on ``view`` (``waiting_view``'s). While strangers are held, its patience is for our
        groupmates and our ``group``: a stranger in a group (averaging, or merging past what the registered groups
        hold) is waited for ``STRANGER_GRACE`` seconds after we registered at most, and one still training or
        matchmaking not at all."""
        if not self.holds_strangers():
            return delegate_decision(view, records, epoch, group, tag, waited, patience, group_patience)
        known = frozenset(self._known()) | frozenset(group)
        registered = sum(r.size for r in groups_at(records, epoch) if r.group != tag)
        merging = sorted(
            p.peer_id
            for p in view.peers
            if p.epoch == epoch and p.peer_id not in known and p.state == PeerState.merging.value
        )
        counted = known | frozenset(merging[:registered])  # the merging strangers the registered groups hold
        ours = _without(view, counted, WORKING | {PeerState.merging.value})
        decision = delegate_decision(ours, records, epoch, group, tag, waited, patience, group_patience)
        if decision != Decision.wait and waited < STRANGER_GRACE:
            grouped = _without(view, known, {PeerState.training.value, PeerState.matchmaking.value})
            briefly = delegate_decision(grouped, records, epoch, group, tag, waited, STRANGER_GRACE, STRANGER_GRACE)
            return Decision.wait if briefly == Decision.wait else decision
        return decision


def _without(view: SwarmView, kept: frozenset[str], states: Collection[str]) -> SwarmView:
    """``view`` without the records of keys outside ``kept`` whose state is one of ``states`` (votes unchanged)."""
    return replace(view, peers=tuple(p for p in view.peers if p.peer_id in kept or p.state not in states))
