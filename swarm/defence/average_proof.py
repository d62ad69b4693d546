"""A wrong average shown to anyone: one part of a reducer's slice, the parts it averaged it from, and the digests that
bind all of them to the reducer's signed receipt.

A reducer's receipt signs, for each sender, the digest of the per-part digests of the parts it counted of it, the
weight it counted, and the digest of the per-part digests of its average (``swarm.defence.receipts``). So the per-part
digests under those, and one part index ``j`` of every sender and of the average, are bound to the reducer's own
signature: anyone who holds the receipt can check each of them by hashing, recompute part ``j`` of the average with the
run's rule (``audit.recompute``), and compare it with what the reducer signed, within the codec's rounding
(``audit.close_enough``). Where they differ, the reducer signed an average that is not the robust mean of the parts it
signed for: a lie that rests on its signature alone, not on the accuser's word.

That is too large for an accusation in a DHT record (a part is up to half a MiB a sender), so the accuser keeps it and
serves it on request (``swarm.averager.proof_serving``); the accusation carries the receipt, and a reader fetches the
rest and checks it here before it bans. Only a recomputation that differs is a proof: a part that an honest reducer
would have refused, a part averaged from too few senders, or a weight above the round's cap are an auditor's own
evidence (``audit.judge``), which needs the group's context a reader does not have.

Pure functions of bytes; ``from_wire`` and ``proves_wrong_average`` never raise on another machine's bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from swarm.defence.audit import _decode, close_enough, matches_either_way, recompute, too_few
from swarm.defence.receipts import Receipt, digest_of, part_digest
from swarm.defence.statements import MAX_PARTS
from swarm.defence.unpack import bounded_loads
from swarm.manifest import Aggregation

PROOF_VERSION = 1
DIGEST_BYTES = 32  # ``part_digest``: SHA-256
# a proof must move at least this many values off the codec's grid, where the moved fraction alone is what fails
# (``close_enough``): in a part of a few hundred values one value on a rounding boundary, which another machine may
# land one level apart, is already more than that fraction, and an accuser could pick such a part
MIN_MOVED = 8
MAX_METADATA_BYTES = 4 << 20  # per-part digests: 32 bytes a part a sender (1000 parts, 64 senders: 2 MiB)


@dataclass(frozen=True)
class AverageProof:
    """Part ``index`` of a reducer's slice, as its receipt binds it."""

    index: int
    outputs: tuple[bytes, ...]  # the per-part digests of its average (their ``digest_of`` is the receipt's output)
    listed: tuple[tuple[bytes, ...], ...]  # a sender's per-part digests of the parts counted of it, in receipt order
    parts: tuple[runtime_pb2.Tensor | None, ...]  # each sender's part ``index``; None for one not counted in it
    output: runtime_pb2.Tensor  # the average's part ``index``

    def to_wire(self) -> tuple[bytes, list[runtime_pb2.Tensor]]:
        """The metadata and the parts as they are served: the average's part, then each counted sender's."""
        fields = [PROOF_VERSION, self.index, list(self.outputs), [list(d) for d in self.listed]]
        metadata = MSGPackSerializer.dumps(fields)
        return metadata, [self.output, *(p for p in self.parts if p is not None)]


def from_wire(receipt: Receipt, metadata: bytes, tensors: Sequence[runtime_pb2.Tensor]) -> AverageProof | None:
    """The proof an accuser served for ``receipt`` (its metadata and parts, in ``to_wire``'s order), or None when it is
    not one: types and counts only, the digests are ``proves_wrong_average``'s."""
    try:
        if not isinstance(metadata, bytes) or len(metadata) > MAX_METADATA_BYTES:
            return None
        version, index, outputs, listed = bounded_loads(metadata)
        if version != PROOF_VERSION or not _digests(outputs) or not 0 < len(outputs) <= MAX_PARTS:
            return None
        if not _index(index, len(outputs)) or not isinstance(listed, list) or len(listed) != len(receipt.senders):
            return None
        if not all(_digests(d) for d in listed):
            return None
        counted = [k > index for k in receipt.counted(len(outputs))]
        if len(tensors) != 1 + sum(counted):
            return None
        rest = iter(tensors[1:])
        parts = tuple(next(rest) if c else None for c in counted)
        return AverageProof(index, tuple(outputs), tuple(tuple(d) for d in listed), parts, tensors[0])
    except Exception:  # another machine's bytes
        return None


def _index(value: object, count: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < count


def _digests(values: object) -> bool:
    """Whether ``values`` are SHA-256 digests, each exactly ``DIGEST_BYTES``: ``digest_of`` hashes them end to end, so
    digests of other lengths could be cut and joined again into the same signed digest with other parts under
    each index (a part of the average moved to another index, against an honest reducer's true receipt)."""
    return isinstance(values, list | tuple) and all(isinstance(v, bytes) and len(v) == DIGEST_BYTES for v in values)


def bound_to(receipt: Receipt, proof: AverageProof) -> bool:
    """Whether every digest and part of ``proof`` is the one the reducer signed for in ``receipt``."""
    n, j = len(proof.outputs), proof.index
    counts = receipt.counted(n)
    if not _digests(proof.outputs) or not all(_digests(d) for d in proof.listed):
        return False
    if not _index(j, n) or digest_of(proof.outputs) != receipt.output or part_digest(proof.output) != proof.outputs[j]:
        return False
    if not len(proof.listed) == len(proof.parts) == len(counts) or any(k > n for k in counts):
        return False
    for k, digest, listed, part in zip(counts, receipt.inputs, proof.listed, proof.parts):
        if (k > j) != (part is not None):
            return False
        if k > j and (len(listed) != k or digest_of(listed) != digest or part_digest(part) != listed[j]):
            return False
    return True


def proves_wrong_average(
    receipt: Receipt,
    proof: AverageProof,
    aggregation: Aggregation,
    encode: Callable[[torch.Tensor], runtime_pb2.Tensor],
    fits: Callable[[list[runtime_pb2.Tensor]], int | None],
) -> bool:
    """Whether ``proof`` shows that ``receipt``'s reducer signed an average whose part ``proof.index`` is not the
    robust mean of the parts it signed for, with the weights it signed (``encode``: the run's codec for an average;
    ``fits``: the number of values of each of these parts, if they all declare one within this run's bounds, checked
    before anything is decoded: ``swarm.averager.bounds``)."""
    try:
        if not bound_to(receipt, proof) or too_few(receipt.counted(len(proof.outputs)), [proof.index]):
            return False
        numel = fits([proof.output, *(p for p in proof.parts if p is not None)])
        if numel is None:
            return False
        present = [[p] if p is not None else [] for p in proof.parts]
        exact = recompute(present, receipt.weights, [numel], aggregation)
        if exact is None:  # a part an honest reducer refuses: its auditor's evidence, not a proof to others
            return False
        sent = _decode(proof.output)
        if not beyond_rounding(sent, exact[0], _decode(encode(exact[0]))):
            return False
        near = lambda s, e, r: not beyond_rounding(s, e, r)  # noqa: E731
        return not matches_either_way(sent, present, receipt.weights, numel, aggregation, encode, near)
    except (RuntimeError, ValueError, TypeError):
        return False


def beyond_rounding(sent: torch.Tensor, exact: torch.Tensor, requantized: torch.Tensor) -> bool:
    """Whether ``sent`` is not ``exact`` as the codec rounds it (``requantized``), in a way rounding on another machine
    cannot explain: ``close_enough`` fails, and not only because fewer than ``MIN_MOVED`` values landed elsewhere."""
    if close_enough(sent, exact, requantized):
        return False
    if sent.shape != exact.shape:
        return True
    return int((sent != requantized).sum()) >= MIN_MOVED or not close_enough(sent, exact, requantized, max_fraction=1.0)


def find_proof(
    receipt: Receipt,
    outputs: Sequence[runtime_pb2.Tensor],
    sources: Sequence[Mapping[str, Sequence[runtime_pb2.Tensor] | None]],
    wanted: Mapping[str, Sequence[int]],
    listed: Mapping[str, Sequence[bytes]],
    shows: Callable[[AverageProof], bool],
) -> AverageProof | None:
    """After an audit found a wrong average: the smallest part it checked that ``shows`` (``proves_wrong_average`` with
    the run's rule) to be one, from the reducer's ``outputs`` as received, each sender's parts ``wanted`` of it (in
    order) as one of ``sources`` holds them (as the sender served them, or as the reducer did), and the per-part
    digests ``listed`` under the receipt (or those of a sender's parts, where every one of them was fetched)."""
    counts = receipt.counted(len(outputs))
    digests = [_signed_digests(receipt, i, k, sources, wanted, listed) for i, k in enumerate(counts)]
    outs = tuple(part_digest(p) for p in outputs)
    checked = set().union(*(wanted.get(s, ()) for s in receipt.senders))
    for j in sorted(checked, key=lambda j: (_numel(outputs[j]), j)):  # the smallest first: a reader's memory
        parts = []
        for sender, k, signed in zip(receipt.senders, counts, digests):
            mine = list(wanted.get(sender, ()))
            found = [got[mine.index(j)] for got in (src.get(sender) for src in sources)
                     if got and j in mine and mine.index(j) < len(got)]  # fmt: skip
            part = next((p for p in found if j < len(signed) and part_digest(p) == signed[j]), None)
            parts.append(part if k > j else None)
        proof = AverageProof(j, outs, tuple(digests), tuple(parts), outputs[j])
        if all(p is not None for p, k in zip(parts, counts) if k > j) and shows(proof):
            return proof
    return None


def _numel(part: runtime_pb2.Tensor) -> int:
    return int(part.size[0]) if len(part.size) == 1 else 1 << 62


def _signed_digests(receipt: Receipt, index: int, k: int, sources, wanted, listed) -> tuple[bytes, ...]:
    """The per-part digests of the ``k`` parts counted of a sender whose ``digest_of`` the receipt signs: those
    ``listed``, or those of its parts as one of ``sources`` holds every one of them; () if none is."""
    sender = receipt.senders[index]
    candidates = [tuple(listed.get(sender) or ())]
    for src in sources:
        got = src.get(sender)
        if got and len(got) == k == len(wanted.get(sender, ())):
            candidates.append(tuple(part_digest(p) for p in got))
    return next((c for c in candidates if _digests(c) and digest_of(c) == receipt.inputs[index]), ())
