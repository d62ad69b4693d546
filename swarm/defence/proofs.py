"""Proofs that a reducer lied, which any peer can check from the reducer's own signatures.

A peer bans on its own evidence (``swarm.defence.bans``); an accusation that carries one of these proofs is applied
by every peer that reads it, since it rests on the accused's signature and not on the accuser's word:

- **forged**: the reducer's signed receipt and one sender's signed statement under it that does not give the
  digest or weight the receipt lists for that sender (``forgery_proof``);
- **equivocated**: two digests of one all-reduce's average of its slice, both signed by the reducer, that differ
  (``equivocation_proof``): each is its receipt's ``output`` or the ``statements.Output`` it sent a groupmate with
  the last part of its average, under the group id and the nonce the reducer drew for that run. An honest reducer
  returns one average, the same bytes to every groupmate, and signs that digest in its receipt; and a leader that
  hands it a group id it averaged in before gets another nonce, so the two runs' signatures never pair.

A wrong average (a digest signed once, over values that are not the robust mean of the parts) is not among them:
proving it takes the parts themselves, one of each sender's at least, which do not fit an accusation.

Pure functions of bytes; every check of another machine's bytes returns None rather than raise.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from hivemind.utils.serializer import MSGPackSerializer

from swarm.defence.receipts import Receipt, open_receipt, statement_hash, statement_vouches
from swarm.defence.statements import open_output, read_output

PROOF_VERSION = 1
EQUIVOCATION_TAG = "equivocated"
MAX_PROOF_BYTES = 16384  # what an accusation in a progress record carries (``records.Accusation.receipt``)


def forgery_proof(blob: bytes, receipt: Receipt) -> bytes | None:
    """For an accusation: the reducer's signed receipt and one statement under it that does not vouch for what the
    receipt lists, which any peer can check (``proves_forgery``); None if there is no such statement."""
    for index, (sender, digest) in enumerate(zip(receipt.senders, receipt.inputs)):
        if sender == receipt.reducer or not digest or index >= len(receipt.statements):
            continue
        statement = receipt.statements[index]
        if (
            statement
            and statement_hash(statement) == receipt.vouched[index]
            and not statement_vouches(receipt, index, statement, None)
        ):
            return MSGPackSerializer.dumps([PROOF_VERSION, blob, index, statement])
    return None


def proves_forgery(proof: bytes) -> str | None:
    """The reducer a ``forgery_proof`` proves a forger (its receipt, signed with its key, lists a digest or a weight
    that the sender's statement it signed for does not give), else None; never raises."""
    try:
        version, blob, index, statement = MSGPackSerializer.loads(proof)
        receipt = open_receipt(blob) if version == PROOF_VERSION and isinstance(blob, bytes) else None
        if receipt is None or not isinstance(index, int) or not 0 <= index < len(receipt.senders):
            return None
        if receipt.senders[index] == receipt.reducer or not receipt.inputs[index] or not isinstance(statement, bytes):
            return None
        if not statement:  # no statement under a digest: the receipt cannot be checked as it stands, but proves nothing
            return None
        if statement_hash(statement) != receipt.vouched[index] or statement_vouches(receipt, index, statement, None):
            return None
        return receipt.reducer
    except Exception:  # another machine's bytes
        return None


Said = tuple[str, bytes, bytes, bytes]  # (reducer, group id, nonce, digest of the average)


def signed_output(blob: object) -> Said | None:
    """``(reducer, group_id, nonce, digest)`` of the average that ``blob`` says, under the reducer's signature, it
    returned in one all-reduce: a reducer's ``statements.Output``, or its receipt; None for anything else."""
    output = open_output(blob)
    if output is not None:
        return output.reducer, output.group_id, output.nonce, output.digest
    receipt = open_receipt(blob) if isinstance(blob, bytes) else None
    return None if receipt is None else (receipt.reducer, receipt.group_id, receipt.nonce, receipt.output)


def _read(blob: bytes) -> Said | None:
    """What ``blob`` says, an ``Output``'s signature not checked yet (a receipt's is: there are few of them)."""
    output = read_output(blob)
    return signed_output(blob) if output is None else (output.reducer, output.group_id, output.nonce, output.digest)


def equivocation_proof(blobs: Iterable[bytes]) -> bytes | None:
    """For an accusation: the smallest two of ``blobs`` (signed outputs and receipts, ``signed_output``) in which one
    reducer signed two digests for one all-reduce's average, as a proof any peer can check (``proves_equivocation``);
    None when they all agree, or no such pair fits ``MAX_PROOF_BYTES``."""
    found = equivocations(blobs)
    return next(iter(found.values()), None)


def equivocations(
    blobs: Iterable[bytes], group_id: bytes | None = None, members: Collection[str] | None = None
) -> dict[str, bytes]:
    """Every reducer (of ``members``, if given) that signed two digests for one all-reduce's average (in group
    ``group_id``, if given) among ``blobs``, with the smallest proof of it that fits ``MAX_PROOF_BYTES``. Blobs are
    read first and only those of an all-reduce said to have two averages are verified: an honest round costs no
    signature check."""
    runs: dict[tuple[str, bytes, bytes], dict[bytes, list[bytes]]] = {}  # (reducer, group, nonce) -> digest -> blobs
    for blob in sorted({b for b in blobs if isinstance(b, bytes)}, key=len):
        said = _read(blob)
        if said is None or (group_id is not None and said[1] != group_id):
            continue
        if members is not None and said[0] not in members:
            continue
        runs.setdefault(said[:3], {}).setdefault(said[3], []).append(blob)
    found = {}
    for (reducer, *_), digests in runs.items():
        if len(digests) < 2:
            continue
        # the smallest blob of each digest whose signature holds
        signed = [next((b for b in kept if signed_output(b) is not None), None) for kept in digests.values()]
        smallest = sorted((b for b in signed if b is not None), key=len)[:2]
        if len(smallest) == 2:
            proof = MSGPackSerializer.dumps([PROOF_VERSION, EQUIVOCATION_TAG, *smallest])
            if len(proof) <= MAX_PROOF_BYTES:
                found[reducer] = proof
    return found


def proves_equivocation(proof: object, group_id: bytes | None = None) -> str | None:
    """The reducer an ``equivocation_proof`` proves signed two averages of one all-reduce (in ``group_id``, if
    given), else None; never raises."""
    try:
        if not isinstance(proof, bytes) or len(proof) > MAX_PROOF_BYTES:
            return None
        version, tag, a, b = MSGPackSerializer.loads(proof)
        if version != PROOF_VERSION or tag != EQUIVOCATION_TAG:
            return None
        said_a, said_b = signed_output(a), signed_output(b)
        if said_a is None or said_b is None or said_a[:3] != said_b[:3] or said_a[3] == said_b[3]:
            return None
        if group_id is not None and said_a[1] != group_id:
            return None
        return said_a[0]
    except Exception:  # another machine's bytes
        return None
