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
from dataclasses import dataclass, field, replace

import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.serializer import MSGPackSerializer

from swarm.defence.robust import RefusedPart, check_part, robust_mean
from swarm.defence.statements import counts_as, open_statement
from swarm.dht.identity import peer_id_of_owner
from swarm.manifest import Aggregation

logger = logging.getLogger(__name__)
RECEIPT_VERSION = 4  # 4: with its all-reduce's nonce; 3: each sender's signed statement; 2: digests of parts' digests
MAX_DIGEST = 64  # bytes of a digest, a group id or a nonce a receipt may carry (SHA-256: 32; group ids: 20)
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
    omitted = "omitted a sender that sent everything"  # a digest left empty whose sender says its stream came back


GUILTY = frozenset({Verdict.wrong_average, Verdict.equivocated, Verdict.forged})
# a reducer alive enough to sign a receipt that then hides its own parts from its auditor cannot be checked: its
# slice is dropped (groupmates told so check it themselves), and it gets a strike, as for an unanswered audit; a
# reducer that hides from one auditor only (a groupmate's check passes) is not proof the auditor lied
UNCHECKABLE = frozenset({Verdict.withheld})
# the reducer or the sender lies (the sender's word that its stream to the reducer came back whole is not proof):
# the slice is dropped, as a vanished reducer's, and nobody is struck
DROP_ONLY = frozenset({Verdict.omitted})
FALSE_ACCUSATION = "false accusation"  # an auditor accused a reducer that every check of ours found honest
MALFORMED = "sent malformed parts"  # non-finite, wrong-size or undecodable parts, refused by us as a reducer


def part_digest(part: runtime_pb2.Tensor) -> bytes:
    """SHA-256 of one serialized part: its codec, dtype, shape and bytes."""
    header = MSGPackSerializer.dumps([int(part.compression), part.dtype, list(part.size), len(part.buffer)])
    h = hashlib.sha256(len(header).to_bytes(4, "little") + header)
    h.update(part.buffer)
    return h.digest()


def digest_of(digests: Iterable[bytes]) -> bytes:
    """SHA-256 over per-part digests, in order: what a receipt signs for a list of parts."""
    h = hashlib.sha256()
    for digest in digests:
        h.update(digest)
    return h.digest()


def digest_parts(parts: Iterable[runtime_pb2.Tensor]) -> bytes:
    """The digest a receipt signs for these parts, in order (``digest_of`` their ``part_digest``s)."""
    return digest_of(part_digest(part) for part in parts)


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


@dataclass(frozen=True)
class Receipt:
    """What a reducer received and returned in one group's all-reduce."""

    group_id: bytes
    reducer: str  # base58 peer id
    senders: tuple[str, ...]  # base58, in sender order
    weights: tuple[float, ...]
    inputs: tuple[bytes, ...]  # digest of each sender's parts; b"" for a sender dropped before its last part
    output: bytes  # digest of the average it sent everyone
    vouched: tuple[bytes, ...] = ()  # SHA-256 of each sender's signed statement (``statements``); b"" for none
    # drawn by the reducer for this one all-reduce and signed in every ``statements.Output`` of it too: two digests
    # of an average prove an equivocation only under one nonce, so a leader that hands an honest reducer a group id
    # it averaged in before cannot pair the two runs' signatures (``proofs``)
    nonce: bytes = b""
    # the statements themselves, served beside the receipt (so that it stays small enough for an accusation) and
    # checked against ``vouched``; not part of what the reducer signs
    statements: tuple[bytes, ...] = field(default=(), compare=False)

    def payload(self) -> bytes:
        fields = [RECEIPT_VERSION, self.group_id, self.reducer, list(self.senders), list(self.weights)]
        return MSGPackSerializer.dumps(fields + [list(self.inputs), self.output, list(self.vouched), self.nonce])

    def sign(self, key: RSAPrivateKey | None = None) -> bytes:
        """The receipt, signed with this process's identity key (the peer's libp2p key, see ``identity``)."""
        key = RSAPrivateKey.process_wide() if key is None else key
        payload = self.payload()
        return MSGPackSerializer.dumps([payload, key.sign(payload), key.get_public_key().to_bytes()])


def open_receipt(blob: bytes) -> Receipt | None:
    """The receipt in a signed blob, if its signature holds and its key is its reducer's; else None. Every field is
    taken only as the type it must be, and digests no longer than ``MAX_DIGEST``: a signed integer where bytes
    belong is not made into that many zero bytes."""
    try:
        payload, signature, public_key = MSGPackSerializer.loads(blob)
        fields = MSGPackSerializer.loads(payload)
        version, group_id, reducer, senders, weights, inputs, output, vouched, nonce = fields
        if version != RECEIPT_VERSION or not isinstance(reducer, str) or not _digests([group_id, output, nonce]):
            return None
        if not (isinstance(senders, list) and all(isinstance(x, str) for x in senders)):
            return None
        if not (isinstance(weights, list) and all(isinstance(w, float | int) for w in weights)):
            return None
        if not (isinstance(inputs, list) and isinstance(vouched, list) and _digests(inputs) and _digests(vouched)):
            return None
        if peer_id_of_owner(b"[owner:" + public_key + b"]") != reducer:
            return None
        if not RSAPublicKey.from_bytes(public_key).verify(payload, signature):
            return None
        receipt = Receipt(
            group_id, reducer, tuple(senders), tuple(map(float, weights)), tuple(inputs), output, tuple(vouched), nonce
        )
        if not len(receipt.senders) == len(receipt.weights) == len(receipt.inputs) == len(receipt.vouched):
            return None
        return receipt
    except Exception:  # another machine's bytes: anything can be wrong with them
        return None


def _digests(values: list) -> bool:
    return all(isinstance(v, bytes) and len(v) <= MAX_DIGEST for v in values)


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
    refused one of them: then the receipt should not have listed it)."""
    results = []
    for j, numel in enumerate(numels):
        try:
            values = [check_part(_decode(parts[j]), numel, w) for parts, w in zip(parts_by_sender, weights)]
        except (RefusedPart, IndexError, RuntimeError, ValueError):
            return None
        results.append(robust_mean(values, weights, aggregation))
    return results


def close_enough(sent: torch.Tensor, exact: torch.Tensor, requantized: torch.Tensor) -> bool:
    """Whether ``sent`` (the average everyone decoded) is ``exact`` (a recomputation) as the codec rounds it:
    ``requantized`` is ``exact`` through the codec here. Few values may differ, by at most twice the codec's
    own largest error."""
    if sent.shape != exact.shape:
        return False
    differ = sent != requantized
    if not bool(differ.any()):
        return True
    if float(differ.float().mean()) > MAX_MOVED_FRACTION:
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
    valid = isinstance(listed, list | tuple) and len(listed) == count and all(isinstance(d, bytes) for d in listed)
    return valid and digest_of(listed) == digest


def statement_hash(statement: bytes) -> bytes:
    """What a receipt signs for a sender's statement (b"" for none)."""
    return hashlib.sha256(statement).digest() if statement else b""


def with_statements(receipt: Receipt, statements: object) -> Receipt:
    """``receipt`` with the statements its reducer served beside it, if they are a list of bytes, one a sender."""
    valid = isinstance(statements, list | tuple) and len(statements) == len(receipt.senders)
    if not valid or not all(isinstance(s, bytes) for s in statements):
        return receipt
    return replace(receipt, statements=tuple(statements))


def statement_vouches(receipt: Receipt, index: int, statement: bytes, max_weight: float) -> bool:
    opened = open_statement(statement, receipt.senders[index])
    if opened is None or (opened.group_id, opened.reducer) != (receipt.group_id, receipt.reducer):
        return False
    if opened.digest != receipt.inputs[index]:
        return False
    weight = receipt.weights[index]
    return weight <= opened.weight if max_weight is None else counts_as(opened, max_weight) == weight


def vouching(receipt: Receipt, max_weight: float | None = math.inf) -> Verdict | None:
    """Whether every sender but the reducer itself signed the digest the receipt lists for it, and declared a weight
    that the round's cap ``max_weight`` makes the one listed (``statements``); None when they all did. A sender
    dropped before its last part (digest b"") sent no statement: none is asked of it. ``withheld``: the statements
    served beside the receipt are not those it signed for; ``forged``: one it signed for does not vouch for what it
    lists (``max_weight`` None: only a weight above the declared one counts, which anyone can check)."""
    if len(receipt.statements) != len(receipt.senders):
        return Verdict.withheld
    for index, (sender, digest) in enumerate(zip(receipt.senders, receipt.inputs)):
        if sender == receipt.reducer or not digest:
            continue
        statement = receipt.statements[index]
        if statement_hash(statement) != receipt.vouched[index]:
            return Verdict.withheld
        if not statement_vouches(receipt, index, statement, max_weight):
            return Verdict.forged
    return None


def lists_every_sender(receipt: Receipt, senders: Sequence[str]) -> bool:
    """Whether a receipt names exactly the group's senders, each once: a reducer that leaves one out (or lists only
    itself) would otherwise have its recomputation made from the parts it chose, and pass."""
    return len(receipt.senders) == len(set(receipt.senders)) and set(receipt.senders) == set(senders)


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
    completed: Iterable[str] = (),
) -> Verdict:
    """Audit one reducer: ``received_output`` is its average as this peer received it (every part), ``numels``
    each part's size, ``encode`` the run's codec for an average. ``served`` is each sender's parts for it as
    fetched (this peer's own included): all of them, or the parts ``indices`` only, a sample checked against the
    per-part digests the reducer ``listed`` for each sender under its receipt. ``completed`` are senders known, on
    the auditor's own evidence, to have sent the reducer every part (its own stream to the reducer came back
    whole: a reducer returns a part's average only once it holds the part)."""
    if digest_parts(received_output) != receipt.output:
        return Verdict.equivocated
    if len(received_output) != len(numels):
        return Verdict.wrong_average  # another count of parts than it was sent
    if any(not w <= max_weight for w in receipt.weights):
        return Verdict.wrong_average  # it counted a sender for more samples than a round holds
    unvouched = vouching(receipt, max_weight)
    if unvouched is not None:
        return unvouched  # a digest or weight no sender signed (forged), or statements it hides (withheld)
    empty = {sender for sender, digest in zip(receipt.senders, receipt.inputs) if not digest}
    if empty & set(completed):
        return Verdict.withheld  # it says a sender dropped that we know sent it everything: its slice is dropped
    if empty:
        return Verdict.inconclusive  # a sender dropped mid-way: not checked (rare; the reducer saw it too)
    indices = range(len(numels)) if indices is None else indices
    if len(indices) < len(numels) and not all(
        _listed_as_signed(receipt, sender, (listed or {}).get(sender), len(numels)) for sender in receipt.senders
    ):
        return Verdict.withheld  # the reducer signed its receipt but lists other digests under it: uncheckable
    for sender in receipt.senders:
        parts = served.get(sender)
        if not served_as_signed(receipt, sender, parts, indices, len(numels), (listed or {}).get(sender)):
            logger.debug(
                "%s's parts for %s: %s",
                sender,
                receipt.reducer,
                "missing" if parts is None else f"other bytes ({len(parts)} parts, {[len(x.buffer) for x in parts]})",
            )
            return Verdict.withheld if sender == receipt.reducer else Verdict.inconclusive
    exact = recompute([served[s] for s in receipt.senders], receipt.weights, [numels[i] for i in indices], aggregation)
    if exact is None:
        return Verdict.wrong_average
    for i, value in zip(indices, exact):
        try:
            sent = _decode(received_output[i])
        except Exception:
            return Verdict.wrong_average
        if not close_enough(sent, value, _decode(encode(value))):
            return Verdict.wrong_average
    return Verdict.passed
