"""Proofs of a wrong average (``swarm.defence.average_proof``), in the averager process: an auditor that caught a
reducer keeps the proof and serves it to any peer that reads its accusation; a peer that read one fetches it from the
accuser and checks it before it bans.

Both sides are bounded. The accuser keeps the proofs of its last ``KEPT_PROOFS`` accusations (those its record
shows), in at most ``KEPT_BYTES``, and serves each requester within ``PROOF_LIMITS``. A reader asks only for the
receipt an accusation carries (by its hash), reads at most the parts that receipt's senders and its average make,
each no larger than a part of this run may be, in ``PROOF_TIMEOUT``, and checks every part against the reducer's
signature before it decodes any.

A mixin of ``PseudoGradientAverager`` (its ``_p2p``, ``prefix``, ``serializer``, ``_secret``, ``_admitted``,
``aggregation`` and ``allreduce_kwargs``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import typing
from collections import OrderedDict
from contextlib import aclosing

from hivemind.compression import CompressionInfo
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.mpfuture import MPFuture

from swarm.averager.allreduce import encode_average
from swarm.averager.bounds import MAX_PART, OutOfBounds, admit, declared_numel, max_bytes
from swarm.averager.served import served
from swarm.averager.serving_limits import ServingLimits
from swarm.defence.average_proof import MAX_METADATA_BYTES, AverageProof, find_proof, from_wire, proves_wrong_average
from swarm.defence.receipts import Receipt, open_receipt

logger = logging.getLogger(__name__)

KEPT_PROOFS = 8  # as many as the accusations a progress record shows (``bans.MAX_ACCUSATIONS``)
KEPT_BYTES = 64 << 20
# a reader asks once per accusation (a few times if refused); few at once, so that each stream has a share of a home
# uplink (a proof is up to a part a sender: a few MiB), and readers past the limit are served on their next try
PROOF_LIMITS = dict(per_peer=1, total=8, per_minute=30)
MAX_PROOF_SENDERS = 64  # a receipt of a larger group is not fetched for (its proof would take too much memory)
PROOF_TIMEOUT = 60.0  # seconds a reader's fetch and check may take
CHUNK_TIMEOUT = 20.0  # seconds between two messages of a proof


class AverageProofs:
    """Keeping, serving and checking proofs of a wrong average."""

    def _init_proofs(self) -> None:
        self._proofs: OrderedDict[bytes, tuple[bytes, list[runtime_pb2.Tensor]]] = OrderedDict()
        self._proving: set[asyncio.Task] = set()
        self._proof_limits = ServingLimits(**PROOF_LIMITS)  # per requester, in the averager process that serves

    # ---- the accuser's side -----------------------------------------------------------------------------------

    def _prove_later(self, blob: bytes, receipt: Receipt, outputs: list, sources: list, wanted: dict, listed: dict):
        """After our audit found ``receipt``'s reducer's average wrong: keep the proof of it that others can check, if
        one of the parts we checked makes one, in a task of its own (the audit tells its verdict meanwhile)."""
        task = asyncio.create_task(self._prove(blob, receipt, outputs, sources, wanted, listed))
        self._proving.add(task)
        task.add_done_callback(self._proving.discard)

    async def _prove(self, blob: bytes, receipt: Receipt, outputs: list, sources: list, wanted: dict, listed: dict):
        shows = lambda proof: proves_wrong_average(receipt, proof, self.aggregation, self._encoder(), self._fits)  # noqa: E731
        find = lambda: find_proof(receipt, outputs, sources, wanted, listed, shows)  # noqa: E731
        try:
            proof = await asyncio.get_event_loop().run_in_executor(None, find)
        except Exception:  # the audit's verdict stands without it: the accusation is only shown
            logger.debug("could not make a proof of %s's wrong average", receipt.reducer, exc_info=True)
            return
        logger.debug("a proof of %s's wrong average: %s", receipt.reducer, None if proof is None else proof.index)
        if proof is not None:
            self._keep_proof(blob, proof)

    def _keep_proof(self, blob: bytes, proof: AverageProof) -> None:
        self._proofs[hashlib.sha256(blob).digest()] = proof.to_wire()
        size = lambda kept: len(kept[0]) + sum(p.ByteSize() for p in kept[1])  # noqa: E731
        while len(self._proofs) > KEPT_PROOFS or sum(map(size, self._proofs.values())) > KEPT_BYTES:
            self._proofs.popitem(last=False)

    async def rpc_audit_proof(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:  # hivemind registers handlers by typing's hints
        """The proof we keep for the receipt whose hash ``receipt`` names: nothing if we keep none, or past limits."""
        fields = self._admitted(request, context)
        key = fields.get("receipt") if fields else None
        kept = self._proofs.get(key) if isinstance(key, bytes) else None
        if kept is None:
            return
        async with aclosing(
            served(self._proof_limits, context.remote_id.to_base58(), _messages(*kept), "a proof")
        ) as messages:
            async for message in messages:
                yield message

    # ---- a reader's side --------------------------------------------------------------------------------------

    def check_average_proof(self, accuser: str, receipt: bytes, timeout: float = PROOF_TIMEOUT + 5) -> bool | None:
        """(From the host.) Whether ``accuser`` serves a proof that the reducer of ``receipt`` (its signed blob)
        returned a wrong average; False for a proof that does not hold, a stream that failed or ran out of time; None
        where it served nothing (over its limits, or without the proof for now: worth asking again later)."""
        future = MPFuture()
        self._outer_pipe.send(("_check_average_proof", [], dict(accuser=accuser, blob=receipt, future=future)))
        try:
            return future.result(timeout=timeout)
        except (TimeoutError, concurrent.futures.TimeoutError):
            future.cancel()
            return False

    async def _check_average_proof(self, accuser: str, blob: bytes, future: MPFuture) -> None:
        try:
            proven = await asyncio.wait_for(self._fetch_and_check(accuser, blob), PROOF_TIMEOUT)
        except Exception as e:  # the accuser's stream or bytes: anything can go wrong with them (a stream that stalls
            logger.debug("no proof of a wrong average from %s: %r", accuser, e, exc_info=True)  # is not asked again)
            proven = False
        if not future.done():
            future.set_result(proven)

    async def _fetch_and_check(self, accuser: str, blob: bytes) -> bool | None:
        receipt = open_receipt(blob)
        compression = self._compression_type()
        if receipt is None or compression is None or len(receipt.senders) > MAX_PROOF_SENDERS:
            return False
        part_limit = max_bytes(compression, self._max_values()) + 1024  # a part's message: its bytes and header
        limit = MAX_METADATA_BYTES + (len(receipt.senders) + 1) * part_limit
        target = PeerID.from_base58(accuser)
        fields = dict(receipt=hashlib.sha256(blob).digest())
        if self._secret is not None:
            fields["token"] = self._secret.transfer_token(self._p2p.peer_id.to_bytes(), target.to_bytes())
        stub = self.get_stub(self._p2p, target, namespace=self.prefix)
        stream = await stub.rpc_audit_proof(averaging_pb2.DownloadData(metadata=self.serializer.dumps(fields)))
        metadata, tensors, total = None, [], 0
        async for message in aiter_with_timeout(stream, timeout=CHUNK_TIMEOUT):
            size = message.ByteSize()
            total += size
            too_many = metadata is not None and (size > part_limit or len(tensors) >= len(receipt.senders) + 1)
            if total > limit or too_many:
                logger.debug("%s's proof is larger than its receipt allows", accuser)
                return False
            if metadata is None:
                metadata = message.metadata
            else:
                tensors.append(message.tensor_part)
        if metadata is None:
            return None  # it served nothing (over its limits, or gone for now): asked again later
        proof = from_wire(receipt, metadata, tensors)
        if proof is None:
            return False
        encode = self._encoder()
        check = lambda: proves_wrong_average(receipt, proof, self.aggregation, encode, self._fits)  # noqa: E731
        return await asyncio.get_event_loop().run_in_executor(None, check)

    # ---- this run's bounds ------------------------------------------------------------------------------------

    def _compression_type(self) -> int | None:
        codec = self.allreduce_kwargs.get("compression")
        return getattr(codec, "compression_type", None)

    def _encoder(self) -> typing.Callable:
        compression = self._compression_type()
        return lambda values: encode_average(values, compression)

    def _max_values(self) -> int:
        """The most values one part of this run holds: hivemind cuts a tensor into parts of ``part_size_bytes`` after
        compression (twice that, for slack), and no part is larger than the largest tensor."""
        codec, size = self.allreduce_kwargs["compression"], self.allreduce_kwargs["part_size_bytes"]
        largest = max(t.numel() for t in self._averaged_tensors)
        ratio = codec.estimate_compression_ratio(CompressionInfo.from_tensor(self._averaged_tensors[0]))
        return min(MAX_PART, largest, 2 * int(size / (4 * max(ratio, 1e-3))) + 1)

    def _fits(self, parts: list[runtime_pb2.Tensor]) -> int | None:
        """The values each of ``parts`` declares, if they all declare as many, within this run's bounds."""
        try:
            numel = declared_numel(parts[0])
            if numel > self._max_values():
                return None
            for part in parts:
                admit(part, numel, self._compression_type())
            return numel
        except OutOfBounds as e:
            logger.debug("a proof's parts refused: %s", e)
            return None


async def _messages(metadata: bytes, parts: list) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
    yield averaging_pb2.DownloadData(metadata=metadata)
    for part in parts:
        yield averaging_pb2.DownloadData(tensor_part=part)
