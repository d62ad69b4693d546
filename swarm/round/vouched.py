"""Which swarm's average a peer takes: the one its delegate registered, or another group's only where a key it
averaged with holds it.

A swarm's average is a record's claim: a digest, the groups it holds (``included``) and their samples. A peer
checks the bytes it fetches against the digest, never what made them. The heaviest registered average
(``swarm.dht.groups.result_of``) is what a delegate takes at once when its group missed the merge, and a member
in its merge's last part. So before this rule, one stranger's key that registered, at the swarm's epoch, a record
of a made-up group with ``merged`` set and a weight of 2**40 was taken by every honest delegate before its own
second stage: it served a file of that digest and the whole swarm stepped with it, or served nothing and every
merge waited for it until its deadline.

Now another group's average is taken only where one of the delegates that made it (registered it with their own
group in it: ``makers``) is a key this peer averaged with in its last rounds, none caught lying
(``swarm.state.trust.Groupmates``, which also holds a delegate's second-stage partners), or a second-stage partner
of this round, never one of this round's group: extra keys add holders to an average, never make one a peer takes
(as for states: ``swarm.dht.view.running_consensus``). A group left out with no such maker steps with its own
average, as it does when no average comes, and is re-synced like a group whose round ended apart. Our group's own
record is read only from our delegate or a member speaking for the group (``impostors_dropped``), and an average
of our group alone (the round's only group) must be our group's own average, whose digest we hold. Whatever a
peer takes from others is then compared with its group's average before it is written (``unlike``).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Iterable, Sequence

from swarm.dht.groups import Merged, own_result, results_of
from swarm.dht.records import GroupRecord


def impostors_dropped(
    records: Sequence[GroupRecord], epoch: int, tag: str, members: Collection[str]
) -> list[GroupRecord]:
    """``records`` without those of ``epoch`` under our group's ``tag`` that a key outside our group registered: the
    tag is public once our delegate registers, and ``own_result`` took the first record under it with a swarm's
    average, whoever wrote it (only our delegate, or a member speaking for the group, registers our tag)."""
    mates = set(members)
    return [r for r in records if not (r.epoch == epoch and r.group == tag and r.delegate not in mates)]


def groupmates_elsewhere(roster: Sequence[GroupRecord], tag: str, members: Collection[str]) -> frozenset[str]:
    """The delegates of ``roster``'s groups that are members of our group and speak for another: an honest key is
    in one group of an epoch. A roster we write leaves them out (their absence cost a try of the second stage a
    round, seen with ``fakemerge``); one we follow is kept as written, as every follower runs the same group."""
    mates = set(members)
    return frozenset(g.delegate for g in roster if g.group != tag and g.delegate in mates)


def makers(records: Sequence[GroupRecord], epoch: int, digest: str) -> frozenset[str]:
    """The delegates that registered ``digest`` as an average their own group is in: those that made it. A delegate
    that took another group's average registers it too, without its own group; were it counted, one past groupmate
    of any honest delegate would reach every peer that trusts that delegate."""
    return frozenset(r.delegate for r in records if r.epoch == epoch and r.merged == digest and r.group in r.included)


def vouched(records: Sequence[GroupRecord], epoch: int, result: Merged, trusted: Collection[str]) -> bool:
    """Whether a key we trust made ``result`` (``makers``)."""
    return bool(makers(records, epoch, result.digest) & set(trusted))


def others_result(
    records: Sequence[GroupRecord], epoch: int, trusted: Collection[str], refused: Collection[str] = ()
) -> Merged | None:
    """``result_of`` among the swarm's averages of ``epoch`` that a ``trusted`` key holds, and whose bytes we did
    not find ``unlike`` our group's (``refused``): the one whose groups hold the most samples (then the lowest
    digest), or None."""
    found = [
        m
        for m in results_of(records, epoch).values()
        if m.digest not in refused and vouched(records, epoch, m, trusted)
    ]
    return min(found, key=lambda m: (-m.weight, m.digest)) if found else None


def lone_lie(records: Sequence[GroupRecord], epoch: int, tag: str, digest: str | None) -> bool:
    """Whether our delegate registered that our group alone made the swarm's average of ``epoch`` and named another
    digest than our group's own (``digest``): a lie (the round's only group registers its own average). A member
    then steps with its group's own average at once, as when its delegate registers another average of the group
    (``groups.delegate_disagrees``); before, it fetched the lie."""
    result = own_result(records, epoch, tag)
    return result is not None and result.included == frozenset({tag}) and result.digest != digest


def ours_result(records: Sequence[GroupRecord], epoch: int, tag: str, digest: str | None) -> Merged | None:
    """``own_result``, unless it is a ``lone_lie``."""
    return None if lone_lie(records, epoch, tag, digest) else own_result(records, epoch, tag)


MIN_COSINE = 0.0  # a swarm's average points no further from our group's than this
MAX_LENGTH = 4.0  # and is at most this many times as long


class Unlike(enum.Enum):
    """Why a fetched swarm's average cannot be one that holds our group's kind of work (``unlike``)."""

    not_finite = "not finite"
    points_away = "points away from our group's average"
    too_long = "is many times as long as our group's average"


def unlike(sums: Iterable[tuple[float, float, float]]) -> Unlike | None:
    """A swarm's average fetched from others, against the average our group made (or our own pseudo-gradient, for
    a group of one), from ``held.likeness`` of each tensor: why it is not a swarm's average of this round, or None.
    A swarm's average is a weighted mean of its groups' averages, which train one model from one state on the same
    kind of data. In blocking DiLoCo rounds of ``tiny`` (4 and 8 workers, 20 inner steps), its cosine with a single
    worker's pseudo-gradient was 0.35 at least (a group of two's: 0.59), and it was shorter than either (0.37-0.99
    times as long), any one tensor at most 1.56 times (1.42). So the whole must point no further than 90 degrees from
    ours, and each tensor and the whole be at most 4 times as long: that refuses a delegate's or a past groupmate's
    made-up average that turns the swarm back (-4 times our group's), or puts a large step into one tensor. A
    tensor's own direction is not checked: with 4 inner steps and fp4, an honest average pointed away from a group's
    in some small tensor (two members of five refused it, in ``tests/test_engine_groups.py``). It does not refuse an
    average within those bounds: a bound on what a liar our trust lets through (``vouched``), not a proof."""
    totals = [0.0, 0.0, 0.0]
    for tensor in sums:
        why = _unlike(*tensor, whole=False)
        if why is not None:
            return why
        totals = [a + b for a, b in zip(totals, tensor)]
    return _unlike(*totals, whole=True)


def _unlike(dot: float, held: float, ours: float, whole: bool) -> Unlike | None:
    if not all(math.isfinite(x) for x in (dot, held, ours)):
        return Unlike.not_finite
    if ours == 0.0:  # nothing to compare it with (no step of ours there): the digest is all we check
        return None
    if held == 0.0:  # a tensor in a slice the second stage dropped (zeros); but no step at all is no swarm's average
        return Unlike.points_away if whole else None
    if whole and dot / math.sqrt(held * ours) < MIN_COSINE:  # (a tensor's own cosine is noisy: length only)
        return Unlike.points_away
    if held > MAX_LENGTH**2 * ours:
        return Unlike.too_long
    return None
