"""A round's groups, and the swarm's average made of their averages: the records of two-stage rounds, and their
rules as pure functions.

When a round forms several groups (more peers than a group holds, or peers that reach matchmaking apart), each
group's **delegate** (one member, the same for all of them: ``delegate_of``) registers the group under the run's
groups key: its tag, size, weight (samples) and the digest of its average. The delegates then average their
groups' averages, weighted by the groups' samples, in a second all-reduce (``swarm.round.merge``); each registers
the digest of that swarm's average (``merged``) and the groups it holds (``included``). Every peer steps with the
swarm's average, fetched from a delegate that holds it: one model per round, bitwise, however many groups formed.
Delegates wait for the epoch's other peers first (``unaccounted``), so a slower peer's work is in the round too.

The key holds one record per delegate (its latest group), so a read returns about as many records as a round has
groups: delegates read it whole (a roster names every group). Each record also goes to one of 2^``GROUP_BITS``
buckets by its group's tag, and a member waiting for its delegate reads only that bucket (``reads_wide``), a few
records at any swarm size. ``result_of`` picks, among the swarm's averages registered for an epoch, the one every
peer goes on from: the one holding the most samples (two second-stage groups may form; the smaller one's members
adopt the larger's).
"""

from __future__ import annotations

import enum
import hashlib
import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time

from swarm.dht import calls
from swarm.dht.identity import peer_id_of_owner
from swarm.dht.records import (
    GROUP_TTL,
    MAX_GROUP,
    GroupRecord,
    PeerState,
    group_bucket_key,
    groups_key,
    live_items,
    parse_record,
)
from swarm.dht.view import SwarmView

logger = logging.getLogger(__name__)

# a peer of the epoch whose pseudo-gradient is not in a group yet: training towards the round, or in its first stage
WORKING = frozenset({PeerState.training.value, PeerState.matchmaking.value, PeerState.averaging.value})


def group_tag(group_id: bytes) -> str:
    """A short name of a group, the same for all its members."""
    return hashlib.sha256(group_id).hexdigest()[:16]


def delegate_rank(tag: str, peer: str) -> bytes:
    """A member's place in the order in which members speak for a group whose delegate is gone."""
    return hashlib.sha256(f"{tag}/{peer}".encode()).digest()


def delegate_of(members: Sequence[str], group_id: bytes) -> str:
    """The member that speaks for the group in the second stage: every member picks the same one."""
    return min(members, key=lambda peer: hashlib.sha256(group_id + peer.encode()).digest())


@dataclass(frozen=True)
class Merged:
    """The swarm's average of one epoch, as its delegates registered it."""

    digest: str
    included: frozenset[str]  # group tags
    weight: float  # the samples of the groups it holds
    holders: tuple[str, ...]  # delegates that hold it (serve it as the epoch's update)
    peers: int = 0  # the peers whose work it holds


def groups_at(records: Sequence[GroupRecord], epoch: int) -> list[GroupRecord]:
    return [r for r in records if r.epoch == epoch]


def results_of(records: Sequence[GroupRecord], epoch: int) -> dict[str, Merged]:
    """The swarm's averages registered for ``epoch``, by digest (two second-stage groups give two)."""
    groups = groups_at(records, epoch)
    weights = {g.group: g.weight for g in groups}
    sizes = {g.group: g.size for g in groups}
    found: dict[str, Merged] = {}
    claims: dict[str, int] = {}
    for g in groups:
        if g.merged is None:
            continue
        held = found.get(g.merged)
        included = frozenset(g.included) | (held.included if held else frozenset())
        holders = (*(held.holders if held else ()), g.delegate)
        claims[g.merged] = max(claims.get(g.merged, 0), g.peers)
        found[g.merged] = Merged(g.merged, included, sum(weights.get(t, 0.0) for t in included), holders)
    for merged, m in found.items():
        found[merged] = replace(m, peers=peers_in(m.included, sizes, claims[merged]))
    return found


def peers_in(included: frozenset[str], sizes: dict[str, int], claimed: int) -> int:
    """The peers whose work a swarm's average holds: the sizes of its groups, where their records were read (a
    delegate reads them all); otherwise, for a member that read only its group's bucket, what its holders said,
    at least one a group and at most a full group each."""
    known = sum(sizes.get(tag, 1) for tag in included)
    if all(tag in sizes for tag in included):
        return max(1, known)
    return max(1, known, min(claimed, MAX_GROUP * len(included)))


def result_of(records: Sequence[GroupRecord], epoch: int) -> Merged | None:
    """The swarm's average of ``epoch`` every peer goes on from: among the merged digests registered for it, the one
    whose groups hold the most samples (then the lowest digest), or None while none is."""
    found = results_of(records, epoch)
    return min(found.values(), key=lambda m: (-m.weight, m.digest)) if found else None


def own_result(records: Sequence[GroupRecord], epoch: int, tag: str) -> Merged | None:
    """The swarm's average our group's delegate registered (it holds our group's work), or None while there is
    none: a member goes on from it rather than from another second-stage group's."""
    mine = next((g.merged for g in groups_at(records, epoch) if g.group == tag and g.merged is not None), None)
    return None if mine is None else results_of(records, epoch).get(mine)


def unaccounted(view: SwarmView, records: Sequence[GroupRecord], epoch: int, group: Sequence[str], tag: str) -> int:
    """How many peers of ``epoch`` (outside ``group``) the swarm's average would leave out if it were made now:
    those still training towards the round or averaging in a group, and those merging in a group that is not
    registered yet (more merging peers than the other registered groups hold). A delegate waits for them (they
    end their rounds early to join: ``swarm.dht.view.round_started_without``), within the merge's bound."""
    mates = set(group)
    others = [p for p in view.peers if p.epoch == epoch and p.peer_id not in mates]
    coming = sum(p.state in WORKING for p in others)
    merging = sum(p.state == PeerState.merging.value for p in others)
    registered = sum(r.size for r in groups_at(records, epoch) if r.group != tag)
    return coming + max(0, merging - registered)


def in_groups(view: SwarmView, records: Sequence[GroupRecord], epoch: int, group: Sequence[str], tag: str) -> int:
    """Of the ``unaccounted`` peers, those already in a group: averaging in its first stage, or merging in a group
    not registered yet. Their groups register within the first stage's bound (``allreduce_limit``) whatever their
    links, so a delegate waits for them longer than for peers still training."""
    mates = set(group)
    others = [p for p in view.peers if p.epoch == epoch and p.peer_id not in mates]
    averaging = sum(p.state == PeerState.averaging.value for p in others)
    merging = sum(p.state == PeerState.merging.value for p in others)
    registered = sum(r.size for r in groups_at(records, epoch) if r.group != tag)
    return averaging + max(0, merging - registered)


class Decision(enum.Enum):
    """What a delegate does next with its round's groups (``delegate_decision``)."""

    wait = "wait"  # peers of the epoch are not accounted for yet
    alone = "alone"  # ours is the round's only group: its average is the swarm's
    merge = "merge"  # the registered groups' delegates average their averages


SETTLE = 1.0  # seconds after a delegate registers before it decides (the others' records reach it)


def delegate_decision(
    view: SwarmView,
    records: Sequence[GroupRecord],
    epoch: int,
    group: Sequence[str],
    tag: str,
    waited: float,
    patience: float,
    group_patience: float = 0.0,
) -> Decision:
    """A delegate that registered its group ``waited`` seconds ago: wait while peers of the epoch are unaccounted for
    (at most ``patience``), and while some of them are in groups still averaging (at most ``group_patience``: a
    group with a slow link may take minutes, and a fast group that went on alone would leave its work out); then,
    if its group is the only one registered, its average is the swarm's; otherwise the registered groups merge."""
    registered = groups_at(records, epoch)
    if waited < SETTLE or not any(g.group == tag for g in registered):
        return Decision.wait
    if waited < patience and unaccounted(view, records, epoch, group, tag):
        return Decision.wait
    if waited < group_patience and in_groups(view, records, epoch, group, tag):
        return Decision.wait
    return Decision.merge if any(g.group != tag for g in registered) else Decision.alone


ROSTER_WAIT = 3.0  # seconds a delegate waits for the roster of each delegate ranked before it


class Stage2(enum.Enum):
    """What a delegate that merges does next (``stage2_plan``)."""

    wait = "wait"  # for the roster: its writer has not written it, or its groups' records are not all read yet
    write = "write"  # the roster: we are the first writer not gone
    follow = "follow"  # a roster holds our group: start the second stage with exactly its groups


@dataclass(frozen=True)
class Plan:
    action: Stage2
    roster: tuple[GroupRecord, ...] = ()  # the groups' records, in the roster's order
    writer: str = ""  # the delegate that wrote it


def writer_rank(epoch: int, delegate: str) -> bytes:
    """A delegate's place in the order in which delegates write an epoch's roster (a new order every epoch)."""
    return hashlib.sha256(f"{epoch}/roster/{delegate}".encode()).digest()


def stage2_plan(records: Sequence[GroupRecord], epoch: int, tag: str, me: str, waited: float) -> Plan:
    """The second stage's members, the same for every delegate however late it read the groups key: one delegate
    (the first in ``writer_rank`` order among the registered ones, or after ``ROSTER_WAIT`` per place the next, if
    it is gone) writes the **roster**, the groups registered when it decided to merge; every delegate whose group
    it holds starts the second stage with exactly those groups. Among two rosters (the first writer was slow, not
    gone) a delegate follows the first-ranked writer's that holds its group. Groups that no roster holds (two or
    more registered after it was written, or left out by a stranger's roster) write their own the same way; a
    single one goes on from the swarm's average (``result_of``). A stranger's roster naming groups whose delegate
    never joins only costs a try: the second try runs without the absent; one naming a group that is not
    registered is dropped ``ROSTER_WAIT`` after we decided to merge. ``waited``: seconds since we decided to merge
    (negative: not yet)."""
    registered = groups_at(records, epoch)
    by_tag = {g.group: g for g in registered}
    rosters = [g for g in registered if g.roster]
    ours = [r for r in rosters if tag in r.roster]
    complete = [r for r in ours if all(t in by_tag for t in r.roster)]
    if complete:
        chosen = min(complete, key=lambda r: writer_rank(epoch, r.delegate))
        return Plan(Stage2.follow, tuple(by_tag[t] for t in chosen.roster), chosen.delegate)
    if ours and waited < ROSTER_WAIT:  # a roster holds us: its groups' records are on their way
        return Plan(Stage2.wait)
    # the groups no roster of registered groups holds: registered after one was written, or left out by a
    # stranger's roster (or named in one with a group that does not exist)
    valid = [r for r in rosters if all(t in by_tag for t in r.roster)]
    free = [g for g in registered if not any(g.group in r.roster for r in valid)]
    order = sorted({g.delegate for g in free}, key=lambda d: writer_rank(epoch, d))
    if len(free) >= 2 and me in order and waited >= order.index(me) * ROSTER_WAIT:
        return Plan(Stage2.write, tuple(sorted(free, key=lambda g: g.delegate)), me)
    return Plan(Stage2.wait)  # a group left alone goes on from the swarm's average (``result_of``)


def delegate_disagrees(records: Sequence[GroupRecord], epoch: int, tag: str, delegate: str, digest: str | None) -> bool:
    """Whether our group's delegate registered another average of our group than the one we hold: it kept a slice
    our audits dropped (it lies, or it was the liar whose slice we dropped), so its swarm's average, made from its
    own, is not ours to take. A member then steps with its own group's average (and its groupmates, holding the same
    bytes, do the same)."""
    mine = next((g for g in groups_at(records, epoch) if g.group == tag and g.delegate == delegate), None)
    return digest is not None and mine is not None and mine.digest is not None and mine.digest != digest


def stands_in(
    view: SwarmView,
    records: Sequence[GroupRecord],
    epoch: int,
    members: Sequence[str],
    delegate: str,
    tag: str,
    me: str,
    distrusted: Collection[str] = (),
) -> bool:
    """Whether we speak for our group in the second stage in place of its delegate: only while the group is not
    registered and the delegate is gone (its record expired or says it left: it died in the all-reduce), has moved
    past the epoch (its all-reduce failed and it stepped alone), or is ``distrusted`` (our own evidence of this round
    condemns it: it sent us malformed parts, withheld its slice, lied in its receipt; or we banned it), never while
    it may still register. The first member in ``delegate_rank`` order that is not gone speaks, so members that see
    the same view, and hold the same evidence, pick the same one. A lying delegate held its honest groupmates' merge
    until it left or ``merge_limit`` ran out (60 s in the byzantine smoke's ``nonfinite`` scenario)."""
    if me == delegate or any(g.group == tag for g in groups_at(records, epoch)):
        return False
    live = {p.peer_id: p.epoch for p in view.peers}

    def gone(peer: str) -> bool:
        return peer != me and (peer not in live or live[peer] > epoch or peer in distrusted)

    if not gone(delegate):
        return False
    speakers = sorted((m for m in members if m != delegate and not gone(m)), key=lambda m: delegate_rank(tag, m))
    return bool(speakers) and speakers[0] == me


TREE_STEP = 20.0  # seconds a member waits on each ancestor in its group's tree before it may ask the next one up


def fetch_sources(
    members: Sequence[str], tag: str, delegate: str, me: str, holders: Sequence[str], waited: float
) -> list[str]:
    """Whom a member asks for the swarm's average, in order, ``waited`` seconds after it saw it registered. The
    group's members form a binary tree rooted at its delegate (the others in ``delegate_rank`` order): a member
    asks its parent first, which asks its own, so no peer serves more than two groupmates and a group of g gets
    the average in about log2(g) transfers, not g uploads from the delegate (a 10 Mbit/s delegate serving 34
    members of a 215M model took 40 minutes in swarm-sim). A delegate serving one member, the root of a binary
    tree of the rest, did worse in swarm-sim (N = 100, five seeds: contribution share 0.57-0.87, mean 0.70,
    against 0.65-0.91, mean 0.77). Every ``TREE_STEP`` the next ancestor up is asked too (one of them may be
    gone); after the delegate, the holders, in an order of their own for each member."""
    spread = sorted((h for h in holders if h != me), key=lambda h: delegate_rank(me, h))
    above = ancestors_of(members, tag, delegate, me)
    if above is None:
        return spread
    levels = tree_levels(waited)
    if levels <= len(above):
        return above[:levels]
    return [*above, *(h for h in spread if h not in above)]


def tree_levels(waited: float) -> int:
    """How many ancestors up a member asks, ``waited`` seconds after it saw the swarm's average: one more each
    ``TREE_STEP``."""
    return 1 + int(max(0.0, waited) // TREE_STEP)


def ancestors_of(members: Sequence[str], tag: str, delegate: str, me: str) -> list[str] | None:
    """Our parent in our group's tree (``fetch_sources``), its parent, and so on up to the delegate; None when we
    are not in the tree (its root, or not a member)."""
    tree = [delegate, *sorted((m for m in set(members) if m != delegate), key=lambda m: delegate_rank(tag, m))]
    if me not in tree[1:]:
        return None
    index, above = tree.index(me), []
    while index > 0:
        index = (index - 1) // 2
        above.append(tree[index])
    return above


def fetch_candidates(members: Sequence[str], tag: str, delegate: str, me: str, holders: Sequence[str]) -> list[str]:
    """Every peer a member may ever ask for the swarm's average: ``fetch_sources`` at its widest."""
    above = ancestors_of(members, tag, delegate, me) or []
    return [*above, *(h for h in holders if h != me and h not in above)]


def all_left(view: SwarmView, peers: Sequence[str]) -> bool:
    """Whether none of ``peers`` is in the view: each one's record expired or says it left."""
    live = {p.peer_id for p in view.peers}
    return not any(peer in live for peer in peers)


def reads_wide(
    members: Sequence[str], tag: str, delegate: str, me: str, left: float, patience: float, waited: float | None
) -> bool:
    """Whether a merging peer reads the whole groups key now, rather than its group's bucket (``group_bucket_key``,
    a few records whatever the swarm's size). A delegate does (a roster is made of every group). A member does in
    the last ``patience`` of its merge (``left`` seconds are left), where it may take another group's swarm's
    average (``result_of``), and once it asked its whole tree for the average it saw ``waited`` seconds ago (None:
    none seen yet) and the other holders come next (``fetch_sources``). Otherwise its delegate's records are all
    it needs: the swarm's average its group is in, or another average of its group (``delegate_disagrees``)."""
    if me == delegate or left <= patience:
        return True
    if waited is None:
        return False
    above = ancestors_of(members, tag, delegate, me)
    return above is None or tree_levels(waited) > len(above)


# ---- the DHT ----------------------------------------------------------------------------------------------------


def register(dht: hivemind.DHT, run_id: str, record: GroupRecord, timeout: float = calls.DHT_TIMEOUT) -> bool:
    """Our group's record (we are its delegate), under our own signed subkey: in the groups key, which delegates
    read whole, and in the group's bucket, which its members read (``reads_wide``). True once both took it."""
    subkey, expiration = RSASignatureValidator().local_public_key, get_dht_time() + GROUP_TTL
    value = record.dict()
    wide = calls.store(dht, groups_key(run_id), subkey, value, expiration, timeout)
    return calls.store(dht, group_bucket_key(run_id, record.group), subkey, value, expiration, timeout) and wide


def read_groups(dht: hivemind.DHT, run_id: str, timeout: float = calls.DHT_TIMEOUT) -> list[GroupRecord]:
    return parse_groups(calls.get(dht, groups_key(run_id), timeout))


def read_bucket(dht: hivemind.DHT, run_id: str, tag: str, timeout: float = calls.DHT_TIMEOUT) -> list[GroupRecord]:
    """The records in group ``tag``'s bucket: its delegate's (or the member speaking for it) and the few other
    groups' that share the bucket."""
    return parse_groups(calls.get(dht, group_bucket_key(run_id, tag), timeout))


def parse_groups(found: Any) -> list[GroupRecord]:
    """Well-formed, unexpired group records whose delegate is their signer; none set to outlive ``GROUP_TTL``
    (``records.fresh``)."""
    records = []
    for subkey, value, _ in live_items(found, get_dht_time(), GROUP_TTL):
        record = parse_record(GroupRecord, value)
        if record is not None and record.delegate == peer_id_of_owner(subkey):
            records.append(record)
    return records


def group_record(
    epoch: int,
    tag: str,
    me: str,
    size: int,
    weight: float,
    digest: str | None,
    client_mode: bool,
    roster: Sequence[str] = (),
    **merge: Any,
) -> GroupRecord:
    return GroupRecord(
        epoch=epoch, group=tag, delegate=me, size=size, weight=float(weight), digest=digest, client_mode=client_mode,
        roster=list(roster), time=time.time(), **merge,
    )  # fmt: skip
