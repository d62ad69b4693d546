"""Checked reducers: commitments to every part, and a groupmate that recomputes each reducer's average.

In a butterfly all-reduce each peer reduces one slice of the model for everyone, so a
lying reducer could hand the whole group a wrong average for its slice, which the
checksum check cannot see (everyone holds the same wrong bits). Here, every round:

1. every sender records the exact bytes it sent each reducer; a reducer's own slice goes
   through the run's codec too, so its contribution is bytes like everyone else's;
2. each reducer signs a **receipt** with its identity key: the digest of every sender's
   parts as it received them, their weights, and the digest of the average it sent back
   (each a digest of the parts' own digests, so that one part can be checked alone);
3. for every reducer one other groupmate, chosen from the group id, is its **auditor**:
   it fetches the receipt with the per-part digests under it and the senders' parts (all
   of them, or a sample: ``averaging.audit_parts`` parts it draws after the receipt is
   signed, and as many whose average stands out against what it sent them,
   ``suspect_parts``), checks the parts against the digests and the output digest against what it
   received, recomputes the robust mean and compares it with the average everyone got
   (``judge``);
4. a failed audit is sent to the whole group; each groupmate then audits that reducer
   itself (the accuser's sample included) and, if it agrees, drops the slice from this round (it is read as zeros, as
   when a reducer vanishes), bans the reducer and publishes a signed accusation (the
   reducer's own signed receipt inside). A false accusation fails every groupmate's own
   audit, and bans its author instead.

Recomputation is compared within the codec's rounding, not bitwise: two machines with
other core counts or vector units may sum in another order, and a value on a rounding
boundary can then land one level apart. A reducer that moves more than a thousandth of
its values, or any value by more than twice the codec's own error, fails.

This module is pure: the averager process (``averaging.AuditedAverager``) moves the
bytes.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import math
import random
from collections.abc import Iterable, Sequence

import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.proto import runtime_pb2

from swarm.defence.receipts import Receipt, digest_of, digest_parts, part_digest, statement_hash, statement_vouches
from swarm.defence.robust import RefusedPart, check_part, keep_choices, robust_mean
from swarm.manifest import Aggregation

logger = logging.getLogger(__name__)
MAX_MOVED_FRACTION = 1e-3  # an honest reducer differs from a recomputation only on rounding boundaries


class Verdict(enum.StrEnum):
    """What an audit of one reducer found."""

    passed = "passed"
    wrong_average = "wrong average"  # the average sent is not the robust mean of the parts it signed for
    equivocated = "equivocated"  # its signed receipt names another average than the one it sent
    unanswered = "did not answer its audit"  # no valid receipt in time: it may have vanished; cannot be checked
    withheld = "withheld its own parts"  # it signed a receipt (it is alive) but did not serve its own part as signed
    inconclusive = "inconclusive"  # a sender's bytes did not match the receipt: sender or reducer lies
    forged = "forged a sender's digest or weight"  # its signed receipt lists what no sender signed: it proves the lie
    omitted = "omitted a sender that sent everything"  # counted short, by a sender that had more of its average back
    # fewer senders than a majority of the group in a part of its average: one liar could make that average its own
    too_few = "averaged too few senders to be checked"
    # a sender's parts that the sender did not serve as it signed (gone, stalling, or other bytes) and the reducer did
    # not show as they came to it either (``held``): its slice cannot be checked. Dropped, nobody struck: a sender
    # that stalls is the likelier cause than a reducer that lies, and a strike would let one frame an honest reducer
    unshown = "did not show a sender's parts it averaged"


GUILTY = frozenset({Verdict.wrong_average, Verdict.equivocated, Verdict.forged})
# a reducer alive enough to sign a receipt that then hides its own parts from its auditor cannot be checked: its
# slice is dropped (groupmates told so check it themselves), and it gets a strike, as for an unanswered audit; a
# reducer that hides from one auditor only (a groupmate's check passes) is not proof the auditor lied
UNCHECKABLE = frozenset({Verdict.withheld})
# the reducer or the sender lies (the sender's word that its stream to the reducer came back whole is not proof):
# the slice is dropped, as a vanished reducer's, and nobody is struck
DROP_ONLY = frozenset({Verdict.omitted, Verdict.too_few, Verdict.unshown})
FALSE_ACCUSATION = "false accusation"  # an auditor accused a reducer that every check of ours found honest
MALFORMED = "sent malformed parts"  # non-finite, wrong-size or undecodable parts, refused by us as a reducer


def sample_parts(count: int, size: int, also: Iterable[int] = ()) -> list[int]:
    """The parts of a slice of ``count`` an auditor checks: all if ``size`` is 0 or not below ``count``, else
    ``size`` drawn at random here (after the reducer signed: it cannot know them), plus ``also`` (an accuser's
    sample, so a re-check sees what the accuser saw), sorted."""
    if size == 0 or size >= count:
        return list(range(count))
    drawn = set(random.SystemRandom().sample(range(count), size))
    return sorted(drawn | {i for i in also if isinstance(i, int) and 0 <= i < count})


def suspect_parts(outputs: Sequence[runtime_pb2.Tensor], ours: Sequence[runtime_pb2.Tensor], size: int) -> list[int]:
    """The ``size`` parts of a reducer's slice whose average is largest against what we sent it for them, from
    what we hold (no request). A lie large enough to matter makes its part stand out here, so an audit of a
    sample checks these beside the ones drawn at random: a liar that escapes the sample can only lie within
    the spread of honest parts' ratios (a part that will not decode, or decodes to NaN, stands out most)."""

    def ratio(out: runtime_pb2.Tensor, own: runtime_pb2.Tensor) -> float:
        try:
            average, sent = float(_decode(out).norm()), float(_decode(own).norm())
        except Exception:
            logger.debug("a part of the average does not decode", exc_info=True)
            return math.inf
        return average / max(sent, 1e-30) if math.isfinite(average) else math.inf

    ratios = [ratio(out, own) for out, own in zip(outputs, ours)]
    return sorted(sorted(range(len(ratios)), key=lambda i: -ratios[i])[:size])


def auditor_of(members: Sequence[str], group_id: bytes, reducer: str) -> str | None:
    """The groupmate that audits ``reducer``: never itself, spread over the group by the group id."""
    if len(members) < 2 or reducer not in members:
        return None
    shift = 1 + int.from_bytes(hashlib.sha256(group_id).digest()[:4], "little") % (len(members) - 1)
    return members[(members.index(reducer) + shift) % len(members)]


def _decode(part: runtime_pb2.Tensor) -> torch.Tensor:
    return deserialize_torch_tensor(part).reshape(-1).to(torch.float32)


def recompute(
    parts_by_sender: Sequence[Sequence[runtime_pb2.Tensor]],
    weights: Sequence[float],
    numels: Sequence[int],
    aggregation: Aggregation,
) -> list[torch.Tensor] | None:
    """The reducer's result, part by part, from the senders' parts (None if an honest reducer would have
    refused one of them: then the receipt should not have listed it). A sender whose stream broke holds fewer
    parts (its first few): it is in the results of those alone, as in the reducer's; a part nobody sent is zeros."""
    results = []
    for j, numel in enumerate(numels):
        present = [(parts[j], w) for parts, w in zip(parts_by_sender, weights) if j < len(parts)]
        rows = _decoded_rows(present, numel)
        if rows is None:
            return None
        results.append(robust_mean(rows, [w for _, w in present], aggregation) if present else torch.zeros(numel))
    return results


def _decoded_rows(present: Sequence[tuple[runtime_pb2.Tensor, float]], numel: int) -> torch.Tensor | None:
    """Each sender's part decoded and checked into a row of one tensor (``robust_mean``'s work space: no second
    copy of the parts), or None if an honest reducer would have refused one of them."""
    rows = torch.empty(len(present), numel)
    try:
        for row, (part, weight) in zip(rows, present):
            row.copy_(check_part(_decode(part), numel, weight))
    except (RefusedPart, RuntimeError, ValueError):
        return None
    return rows


def close_enough(
    sent: torch.Tensor, exact: torch.Tensor, requantized: torch.Tensor, max_fraction: float = MAX_MOVED_FRACTION
) -> bool:
    """Whether ``sent`` (the average everyone decoded) is ``exact`` (a recomputation) as the codec rounds it:
    ``requantized`` is ``exact`` through the codec here. Few values (``max_fraction``) may differ, by at most twice
    the codec's own largest error."""
    if sent.shape != exact.shape:
        return False
    differ = sent != requantized
    if not bool(differ.any()):
        return True
    if float(differ.float().mean()) > max_fraction:
        return False
    own_error = float((requantized - exact).abs().max())
    scale = float(exact.abs().max())
    return float((sent - exact).abs().max()) <= 2 * own_error + 1e-6 * scale


def served_as_signed(
    receipt: Receipt, sender: str, parts: Sequence[runtime_pb2.Tensor] | None, indices: Sequence[int], count: int,
    listed: Sequence[bytes] | None,
) -> bool:  # fmt: skip
    """Whether ``parts`` are ``sender``'s parts ``indices`` (of ``count``) as the reducer signed for them: all of
    them against the receipt's digest, or a sample against the per-part digests ``listed`` under it."""
    digest = receipt.inputs[receipt.senders.index(sender)]
    if parts is None or len(parts) != len(indices):
        return False
    if len(indices) == count:
        return digest_parts(parts) == digest
    if not _listed_as_signed(receipt, sender, listed, count):
        return False
    return all(part_digest(part) == listed[i] for part, i in zip(parts, indices))


def _listed_as_signed(receipt: Receipt, sender: str, listed: Sequence[bytes] | None, count: int) -> bool:
    """Whether ``listed`` are ``count`` per-part digests whose digest the receipt signs for ``sender``."""
    digest = receipt.inputs[receipt.senders.index(sender)]
    valid = isinstance(listed, list | tuple) and len(listed) == count
    # each a whole SHA-256 digest: ``digest_of`` hashes them end to end, so others could be cut and joined again
    return valid and all(isinstance(d, bytes) and len(d) == 32 for d in listed) and digest_of(listed) == digest


def too_few(counts: Sequence[int], indices: Iterable[int]) -> bool:
    """Whether a part among ``indices`` was averaged from no more than half the senders (``counts``: the parts of
    each in the average). Its reducer drops its own slice then, as its auditor does (``Verdict.too_few``)."""
    return any(sum(k > i for k in counts) <= len(counts) // 2 for i in indices)


def coherent(receipt: Receipt, parts: int) -> bool:
    """Whether a receipt's counts fit its slice of ``parts`` and its digests: a digest for every sender it counted
    a part of (and a statement hash, the reducer's own excepted), none for one it counted none of."""
    counts = receipt.counted(parts)
    for sender, count, digest, vouched in zip(receipt.senders, counts, receipt.inputs, receipt.vouched):
        if count > parts or bool(count) != bool(digest):
            return False
        if count and sender != receipt.reducer and not vouched:
            return False
    return len(counts) == len(receipt.senders)


def vouching(receipt: Receipt, max_weight: float | None = math.inf) -> Verdict | None:
    """Whether every sender but the reducer itself signed the digest the receipt lists for it, and declared a weight
    that the round's cap ``max_weight`` makes the one listed (``statements``); None when they all did. A sender
    counted for no part (digest b"") has no statement in it: none is asked of it. ``withheld``: the statements
    served beside the receipt are not those it signed for; ``forged``: one it signed for does not vouch for what it
    lists (``max_weight`` None: only a weight above the declared one counts, which anyone can check)."""
    if len(receipt.statements) != len(receipt.senders):
        return Verdict.withheld
    for index, (sender, digest) in enumerate(zip(receipt.senders, receipt.inputs)):
        if sender == receipt.reducer or not digest:
            continue
        statement = receipt.statements[index]
        if not statement or statement_hash(statement) != receipt.vouched[index]:
            return Verdict.withheld  # none under a digest, or not the one it signed for: it cannot be checked
        if not statement_vouches(receipt, index, statement, max_weight):
            return Verdict.forged
    return None


def judge(
    receipt: Receipt,
    received_output: Sequence[runtime_pb2.Tensor],
    served: dict[str, Sequence[runtime_pb2.Tensor]],
    numels: Sequence[int],
    aggregation: Aggregation,
    encode,
    indices: Sequence[int] | None = None,
    listed: dict[str, Sequence[bytes]] | None = None,
    max_weight: float = math.inf,
    returned: dict[str, int] | None = None,
    held: dict[str, Sequence[runtime_pb2.Tensor] | None] | None = None,
) -> Verdict:
    """Audit one reducer: ``received_output`` is its average as this peer received it (every part), ``numels``
    each part's size, ``encode`` the run's codec for an average. ``served`` is each sender's parts for it as
    fetched (this peer's own included): all of them, or the parts ``indices`` only, a sample checked against the
    per-part digests the reducer ``listed`` for each sender under its receipt. ``returned``: how many parts of its
    average came back to a sender, on the auditor's own evidence (its own, as first received): a reducer returns a
    part's average only once it counted the sender's part, so it counted at least that many. A sender whose stream
    broke is checked in the parts the receipt counts of it (``Receipt.counts``), under its signed statement of them:
    ``served`` holds those of its parts that are checked. A part averaged from no more than half the group's senders
    is ``too_few``: with one liar among them it could be anything, and nobody's lie is shown. ``held``: the parts of
    a sender that did not serve them as signed (gone, or other bytes) as the reducer served them, asked of it (None:
    it served none): under the sender's signed statement they are as good as the sender's own; where the reducer did
    not show them either, its slice is ``unshown`` (dropped). Only a sender whose parts nobody serves and were not
    asked of the reducer leaves the audit ``inconclusive``."""
    if digest_parts(received_output) != receipt.output:
        return Verdict.equivocated
    if len(received_output) != len(numels):
        return Verdict.wrong_average  # another count of parts than it was sent
    if any(not w <= max_weight for w in receipt.weights):
        return Verdict.wrong_average  # it counted a sender for more samples than a round holds
    if not coherent(receipt, len(numels)):
        return Verdict.withheld  # it signed counts that its digests or statements do not fit: uncheckable
    unvouched = vouching(receipt, max_weight)
    if unvouched is not None:
        return unvouched  # a digest or weight no sender signed (forged), or statements it hides (withheld)
    counts = receipt.counted(len(numels))
    if any(k < (returned or {}).get(s, 0) for s, k in zip(receipt.senders, counts)):
        return Verdict.withheld  # it counts fewer parts of ours than it returned us averages of: its slice is dropped
    indices = sorted(range(len(numels)) if indices is None else indices)
    if too_few(counts, indices):
        return Verdict.too_few  # its word alone (with a minority): nobody's lie shown, the slice is not taken
    # each sender's parts among those checked: its first ``count`` (a sender whose stream broke sent only those)
    wanted = {s: [i for i in indices if i < k] for s, k in zip(receipt.senders, counts)}
    if len(indices) < len(numels) and not all(
        _listed_as_signed(receipt, sender, (listed or {}).get(sender), k)
        for sender, k in zip(receipt.senders, counts)
        if k
    ):
        return Verdict.withheld  # the reducer signed its receipt but lists other digests under it: uncheckable
    served, held = dict(served), held or {}
    for sender, count in zip(receipt.senders, counts):
        mine = (listed or {}).get(sender)
        if not wanted[sender] or served_as_signed(receipt, sender, served.get(sender), wanted[sender], count, mine):
            continue
        if sender in held and served_as_signed(receipt, sender, held[sender], wanted[sender], count, mine):
            served[sender] = held[sender]  # the sender's parts as it signed them, from its reducer
            continue
        parts = served.get(sender)
        logger.debug(
            "%s's parts for %s: %s",
            sender,
            receipt.reducer,
            "missing" if parts is None else f"other bytes ({len(parts)} parts, {[len(x.buffer) for x in parts]})",
        )
        if sender == receipt.reducer:
            return Verdict.withheld
        return Verdict.unshown if sender in held else Verdict.inconclusive
    served = {s: list(served.get(s, []))[: len(wanted[s])] for s in receipt.senders}
    exact = recompute([served[s] for s in receipt.senders], receipt.weights, [numels[i] for i in indices], aggregation)
    if exact is None:
        return Verdict.wrong_average
    for pos, (i, value) in enumerate(zip(indices, exact)):
        try:
            sent = _decode(received_output[i])
        except Exception:
            return Verdict.wrong_average
        if close_enough(sent, value, _decode(encode(value))):
            continue
        one = [[parts[pos]] if pos < len(parts) else [] for parts in (served[s] for s in receipt.senders)]
        if not matches_either_way(sent, one, receipt.weights, numels[i], aggregation, encode, close_enough):
            return Verdict.wrong_average
    return Verdict.passed


def matches_either_way(sent, parts_by_sender, weights, numel, aggregation, encode, matches) -> bool:
    """Whether ``sent`` ``matches`` a recomputation of one part from ``parts_by_sender`` (each one part, or none) in
    which the parts whose cosines lie on the edge of 0 (``robust.keep_choices``) are kept or left out some other way
    than here: another machine's Gram matrix may put them on the other side. True too where too many parts are on
    that edge to try every way: nothing is shown then, and nobody is judged on it."""
    present = [(parts[0], w) for parts, w in zip(parts_by_sender, weights) if parts]
    rows = _decoded_rows(present, numel)
    if rows is None:
        return False
    if aggregation != Aggregation.centered_clip or len(rows) <= 2:
        return False  # no such choice is made
    choices = keep_choices(rows)
    if choices is None:
        return True
    for index, keep in enumerate(choices):  # each on the parts decoded anew: ``robust_mean`` works in its rows
        if index:
            rows = None  # the last try's rows go before the next decode
            rows = _decoded_rows(present, numel)
        exact = robust_mean(rows, [w for _, w in present], aggregation, keep=keep)
        if matches(sent, exact, _decode(encode(exact))):
            return True
    return False
