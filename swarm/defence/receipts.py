"""A reducer's signed receipt of one all-reduce: what each sender sent it (the digest of the parts it counted, how
many, the weight, and the hash of the sender's own signed statement of them), the digest of the average it returned,
and the run's nonce. Pure functions of bytes: ``swarm.defence.audit`` judges a reducer by its receipt, and
``swarm.defence.proofs`` shows a receipt's lie to anyone."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from hivemind.proto import runtime_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.serializer import MSGPackSerializer

from swarm.defence.statements import MAX_PARTS, counts_as, open_statement
from swarm.dht.identity import peer_id_of_owner

# 5: the parts counted of each sender; 4: with its all-reduce's nonce; 3: each sender's signed statement; 2: digests
# of parts' digests
RECEIPT_VERSION = 5
MAX_DIGEST = 64  # bytes of a digest, a group id or a nonce a receipt may carry (SHA-256: 32; group ids: 20)


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


@dataclass(frozen=True)
class Receipt:
    """What a reducer received and returned in one group's all-reduce."""

    group_id: bytes
    reducer: str  # base58 peer id
    senders: tuple[str, ...]  # base58, in sender order
    weights: tuple[float, ...]
    inputs: tuple[bytes, ...]  # digest of each sender's parts it counted (``counts``); b"" for none
    output: bytes  # digest of the average it sent everyone
    vouched: tuple[bytes, ...] = ()  # SHA-256 of each sender's signed statement (``statements``); b"" for none
    # drawn by the reducer for this one all-reduce and signed in every ``statements.Output`` of it too: two digests
    # of an average prove an equivocation only under one nonce, so a leader that hands an honest reducer a group id
    # it averaged in before cannot pair the two runs' signatures (``proofs``)
    nonce: bytes = b""
    # how many parts of each sender its average holds: all of its slice's for one that finished, the first few for
    # one whose stream broke (its statement of those is the one listed). Every signed receipt lists one a sender
    counts: tuple[int, ...] = ()
    # the statements themselves, served beside the receipt (so that it stays small enough for an accusation) and
    # checked against ``vouched``; not part of what the reducer signs
    statements: tuple[bytes, ...] = field(default=(), compare=False)

    def payload(self) -> bytes:
        fields = [RECEIPT_VERSION, self.group_id, self.reducer, list(self.senders), list(self.weights)]
        fields += [list(self.inputs), self.output, list(self.vouched), self.nonce, list(self.counts)]
        return MSGPackSerializer.dumps(fields)

    def counted(self, parts: int) -> tuple[int, ...]:
        """``counts`` (a receipt that lists none is refused unread: ``open_receipt``; built in process without them,
        all ``parts`` of each sender with a digest)."""
        return self.counts or tuple(parts if digest else 0 for digest in self.inputs)

    def dropped(self, parts: int) -> set[str]:
        """The senders it counted fewer than all ``parts`` of: their streams broke, or it says so."""
        return {s for s, k in zip(self.senders, self.counted(parts)) if k < parts}

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
        version, group_id, reducer, senders, weights, inputs, output, vouched, nonce, counts = fields
        if version != RECEIPT_VERSION or not isinstance(reducer, str) or not _digests([group_id, output, nonce]):
            return None
        if not (isinstance(senders, list) and all(isinstance(x, str) for x in senders)):
            return None
        if not (isinstance(weights, list) and all(isinstance(w, float | int) for w in weights)):
            return None
        if not (isinstance(inputs, list) and isinstance(vouched, list) and _digests(inputs) and _digests(vouched)):
            return None
        if not (isinstance(counts, list) and all(_count(k) for k in counts) and len(counts) == len(senders)):
            return None
        if peer_id_of_owner(b"[owner:" + public_key + b"]") != reducer:
            return None
        if not RSAPublicKey.from_bytes(public_key).verify(payload, signature):
            return None
        receipt = Receipt(
            group_id,
            reducer,
            tuple(senders),
            tuple(map(float, weights)),
            tuple(inputs),
            output,
            tuple(vouched),
            nonce,
            tuple(counts),
        )
        if not len(receipt.senders) == len(receipt.weights) == len(receipt.inputs) == len(receipt.vouched):
            return None
        return receipt
    except Exception:  # another machine's bytes: anything can be wrong with them
        return None


def _digests(values: list) -> bool:
    return all(isinstance(v, bytes) and len(v) <= MAX_DIGEST for v in values)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_PARTS


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
    if opened.digest != receipt.inputs[index] or (receipt.counts and opened.count != receipt.counts[index]):
        return False
    weight = receipt.weights[index]
    return weight <= opened.weight if max_weight is None else counts_as(opened, max_weight) == weight


def lists_every_sender(receipt: Receipt, senders: Sequence[str]) -> bool:
    """Whether a receipt names exactly the group's senders, each once: a reducer that leaves one out (or lists only
    itself) would otherwise have its recomputation made from the parts it chose, and pass."""
    return len(receipt.senders) == len(set(receipt.senders)) and set(receipt.senders) == set(senders)
