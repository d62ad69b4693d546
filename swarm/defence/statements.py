"""A sender's signed statement of what it sent a reducer: the digest of its parts and its weight.

A reducer's receipt (``swarm.defence.audit``) lists each sender's digest and weight, but a receipt is the
reducer's own word: on its own, a reducer could list a weight or a digest that no sender sent, and its
recomputation would then be made from what it chose. So each sender signs, with its identity key, the
group, the reducer, the digest of the parts it sent that reducer so far, their count and the weight it declared,
and sends that statement with every part (in the ``peer_id`` field of each ``AveragingData``, which hivemind 1.1.12
reads nowhere on a part). The reducer counts no part without its statement, and puts in its receipt the latest
statement of the parts it counted: every part for a sender that finished, the first few for one whose stream broke
(so its parts in the average can be checked too). An auditor checks each one (``judge``). A receipt that lists a
digest or a weight no sender signed is a lie the receipt itself proves: anyone holding it can check it.

A reducer signs, the same way, the digest of the average it returned each sender (an ``Output``, with the last
part of that average): a reducer that returns one groupmate another average than another, or than its receipt
names, has signed two digests for one slice of one group, and the two signatures prove it to anyone
(``swarm.defence.proofs``).

Pure functions of bytes; statements are small (a digest, a float, a signature and a public key: under 1 KiB)
and one that is larger than ``MAX_STATEMENT_BYTES`` is refused unread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.serializer import MSGPackSerializer

from swarm.dht.identity import peer_id_of_owner

STATEMENT_VERSION = 2  # 2: the count of parts it covers, sent with every part
MAX_PARTS = 1 << 20  # parts a statement may count (a slice of 2**20 parts of one value each is far past any model)
OUTPUT_TAG = "output"  # a reducer's statement of its average: another shape of payload than a sender's
MAX_OUTPUT_FIELD = 64  # bytes of an output's group id, nonce or digest (20, 16 and 32 when honest)
MAX_STATEMENT_BYTES = 4096  # an RSA-2048 statement is about 700 bytes


@dataclass(frozen=True)
class Statement:
    """What one sender says it sent one reducer in one group's all-reduce."""

    group_id: bytes
    reducer: str  # base58 peer id
    digest: bytes  # ``audit.digest_of`` the per-part digests of the first ``count`` parts it sent, in order
    weight: float  # the weight it declared (the reducer counts at most the round's cap of it)
    count: int  # the parts it had sent when it signed this (its slice's every part, with the last one)

    def payload(self) -> bytes:
        fields = [STATEMENT_VERSION, self.group_id, self.reducer, self.digest, self.weight, self.count]
        return MSGPackSerializer.dumps(fields)

    def sign(self, key: RSAPrivateKey | None = None) -> bytes:
        key = RSAPrivateKey.process_wide() if key is None else key
        payload = self.payload()
        return MSGPackSerializer.dumps([payload, key.sign(payload), key.get_public_key().to_bytes()])


def open_statement(blob: bytes, sender: str) -> Statement | None:
    """The statement in ``blob`` if it is signed by ``sender``'s key (base58 peer id), else None: never raises."""
    try:
        if not isinstance(blob, bytes) or not 0 < len(blob) <= MAX_STATEMENT_BYTES:
            return None
        payload, signature, public_key = MSGPackSerializer.loads(blob)
        version, group_id, reducer, digest, weight, count = MSGPackSerializer.loads(payload)
        if not (isinstance(count, int) and not isinstance(count, bool) and 0 < count <= MAX_PARTS):
            return None
        if version != STATEMENT_VERSION or peer_id_of_owner(b"[owner:" + public_key + b"]") != sender:
            return None
        if not RSAPublicKey.from_bytes(public_key).verify(payload, signature):
            return None
        if not (isinstance(group_id, bytes) and isinstance(reducer, str) and isinstance(digest, bytes)):
            return None
        if not isinstance(weight, float | int) or not math.isfinite(weight):
            return None
        return Statement(group_id, reducer, digest, float(weight), count)
    except Exception:  # another machine's bytes: anything can be wrong with them
        return None


def vouches(blob: bytes, sender: str, group_id: bytes, reducer: str, digest: bytes, weight: float, count: int) -> bool:
    """Whether ``blob`` is ``sender``'s signed statement that it sent ``reducer`` ``count`` parts of ``digest`` in
    group ``group_id`` with weight ``weight`` (as declared, before any cap)."""
    statement = open_statement(blob, sender)
    return statement is not None and statement == Statement(group_id, reducer, digest, float(weight), count)


def counts_as(statement: Statement, max_weight: float) -> float:
    """The weight a reducer counts for a sender that declared ``statement.weight``: at most the round's cap."""
    return min(statement.weight, max_weight)


@dataclass(frozen=True)
class Output:
    """What one reducer says it returned one sender in one all-reduce (``nonce``, drawn for that run): the digest of
    its average of its slice, part by part."""

    group_id: bytes
    reducer: str  # base58 peer id: the signer
    nonce: bytes  # the run's, as in its receipt (``audit.Receipt.nonce``)
    digest: bytes  # ``audit.digest_of`` the per-part digests of the average, in order

    def payload(self) -> bytes:
        fields = [STATEMENT_VERSION, OUTPUT_TAG, self.group_id, self.reducer, self.nonce, self.digest]
        return MSGPackSerializer.dumps(fields)

    def sign(self, key: RSAPrivateKey | None = None) -> bytes:
        key = RSAPrivateKey.process_wide() if key is None else key
        payload = self.payload()
        return MSGPackSerializer.dumps([payload, key.sign(payload), key.get_public_key().to_bytes()])


def read_output(blob: object) -> Output | None:
    """What the ``Output`` in ``blob`` says, its signature not checked yet (``open_output`` checks it): cheap, for
    sorting many blobs before the few that matter are verified; never raises."""
    try:
        if not isinstance(blob, bytes) or not 0 < len(blob) <= MAX_STATEMENT_BYTES:
            return None
        payload, _, _ = MSGPackSerializer.loads(blob)
        version, tag, group_id, reducer, nonce, digest = MSGPackSerializer.loads(payload)
        if version != STATEMENT_VERSION or tag != OUTPUT_TAG or not isinstance(reducer, str):
            return None
        if not all(isinstance(v, bytes) and len(v) <= MAX_OUTPUT_FIELD for v in (group_id, nonce, digest)):
            return None
        return Output(group_id, reducer, nonce, digest)
    except Exception:  # another machine's bytes: anything can be wrong with them
        return None


def open_output(blob: object) -> Output | None:
    """The reducer's statement of its average in ``blob``, if it is signed by the reducer it names; never raises."""
    output = read_output(blob)
    if output is None:
        return None
    try:
        payload, signature, public_key = MSGPackSerializer.loads(blob)
        if peer_id_of_owner(b"[owner:" + public_key + b"]") != output.reducer:
            return None
        return output if RSAPublicKey.from_bytes(public_key).verify(payload, signature) else None
    except Exception:  # another machine's bytes
        return None
