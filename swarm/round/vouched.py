"""Which swarm's average a peer takes: the one its delegate registered, or another group's only where a key it
averaged with holds it.

A swarm's average is a record's claim: a digest, the groups it holds (``included``) and their samples. A peer
checks the bytes it fetches against the digest, never what made them. The heaviest registered average
(``swarm.dht.groups.result_of``) is what a delegate takes at once when its group missed the merge, and a member
in its merge's last part. So before this rule, one stranger's key that registered, at the swarm's epoch, a record
of a made-up group with ``merged`` set and a weight of 2**40 was taken by every honest delegate before its own
second stage: it served a file of that digest and the whole swarm stepped with it, or served nothing and every
merge waited for it until its deadline.

Now another group's average is taken only where one of its holders (the delegates that registered it) is a key
this peer averaged with in its last rounds, none caught lying (``swarm.state.trust.Groupmates``, which also holds a
delegate's second-stage partners), or is in its group or second stage this round: extra keys add holders to an
average, never make one a peer takes (as for states: ``swarm.dht.view.running_consensus``). A group left out with
no such holder steps with its own average, as it does when no average comes, and is re-synced like a group whose
round ended apart. Our own delegate's registration is taken as before, except that an average of our group alone
(the round's only group) must be our group's own average, whose digest we hold.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from swarm.dht.groups import Merged, own_result, results_of
from swarm.dht.records import GroupRecord


def vouched(result: Merged, trusted: Collection[str]) -> bool:
    """Whether a key we trust holds ``result``."""
    return any(holder in trusted for holder in result.holders)


def others_result(records: Sequence[GroupRecord], epoch: int, trusted: Collection[str]) -> Merged | None:
    """``result_of`` among the swarm's averages of ``epoch`` that a ``trusted`` key holds: the one whose groups
    hold the most samples (then the lowest digest), or None."""
    found = [m for m in results_of(records, epoch).values() if vouched(m, trusted)]
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
