"""An all-reduce that leaves every member of a group with identical bits, and copies nothing whole.

hivemind's all-reduce returns each peer ``average - own_part`` compressed, and each
peer adds that to its own tensor. With FP16 on the wire the rounding of that delta
differs per peer, so groupmates finish about 1e-5 apart and their global models
drift. Here each reducer sends the (compressed) average itself and keeps the same
rounding for its own part, so every groupmate receives the very same numbers and
their outer steps stay bitwise equal, which makes a plain hash a valid
consistency check.

The averaged parts are held as they came off the wire (2 bytes per value in
FP16) until the whole all-reduce has succeeded, and only then decoded into the
caller's buffers, so a failed or retried round leaves the peer's own
pseudo-gradient untouched (the local fallback) without a second full-size copy
of it anywhere. A part whose reducer vanished comes back as zero (that slice is
dropped this round) rather than as each peer's own values, so survivors still
agree; the dropped fraction is reported.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
from collections.abc import AsyncIterator
from typing import Any

import torch
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner
from hivemind.averaging.partition import BannedException
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, attach_event_on_finished
from hivemind.utils.crypto import RSAPrivateKey

from swarm.averager.bounds import OutOfBounds, admit
from swarm.averager.codecs import SPARSE
from swarm.averager.held import HeldOutputContainer
from swarm.averager.spill import SpilledParts
from swarm.defence.receipts import digest_of, part_digest
from swarm.defence.robust import RefusedPart, RobustPartReducer
from swarm.defence.statements import Output, Statement, open_output, vouches
from swarm.manifest import Aggregation

logger = logging.getLogger(__name__)
# what this all-reduce speaks: its parts' statements, reducers' outputs and receipts (``swarm.defence``). 2: receipts
# of version 4 and signed outputs; 3: a sender's statement with every part, and receipts of version 5; 4: a reducer
# serves its auditor the parts it holds of a sender (``AuditRequest.held``), or is uncheckable; 5: a group's id binds
# its layout (``hivemind_fixes.group_ids``, ``fixed_group.fixed_group_id``). Peers of another version never group
# with us: it is in the schema hash a leader checks (``process.wire_schema_hash``) and in a second stage's group id
WIRE_VERSION = b"swarm-allreduce/5"


def decode_part(
    message: averaging_pb2.AveragingData, numel: int, compression: int
) -> tuple[torch.Tensor | RefusedPart, float, runtime_pb2.Tensor]:
    """A sender's part as values, or RefusedPart if it declares other than the ``numel`` values in the run's
    ``compression`` we expect of it (checked before it is decoded), or if its bytes do not decode."""
    try:
        admit(message.tensor_part, numel, compression)
        return deserialize_torch_tensor(message.tensor_part), message.weight, message.tensor_part
    except (ValueError, RuntimeError, TypeError, KeyError) as e:
        logger.debug("a sender's part did not decode", exc_info=True)
        return RefusedPart(f"a sender's part could not be decoded: {e}"), message.weight, message.tensor_part


def encode_average(tensor: torch.Tensor, compression_type: int) -> runtime_pb2.Tensor:
    """A reducer's average for every groupmate: the same bytes for all of them."""
    if compression_type == SPARSE.compression_type:  # the only codec whose averages have their own encoding
        return SPARSE.compress_average(tensor)
    return serialize_torch_tensor(tensor, compression_type)


class _CountingStub:
    """Wraps a groupmate's stub so the averaged parts it streams back are counted as received bytes."""

    def __init__(self, stub: Any, runner: ExactAllReduceRunner):
        self._stub, self._runner = stub, runner

    async def rpc_aggregate_part(self, inputs: AsyncIterator[averaging_pb2.AveragingData]):
        stream = await self._stub.rpc_aggregate_part(inputs)
        return self._runner._count(stream, received=True)


class ExactAllReduceRunner(AllReduceRunner):
    """An AllReduceRunner whose outputs are the averaged values, identical for every groupmate, held serialized.

    Iterating it yields, per local tensor, the list of its parts (see ``decode_into``). It
    also counts the tensor payload it sends and receives (protobuf and libp2p framing
    excluded), which the dashboard and the benchmarks report per round.
    """

    def __init__(
        self,
        *args: Any,
        aggregation: Aggregation = Aggregation.centered_clip,
        max_weight: float = math.inf,
        signing_key: RSAPrivateKey | None = None,
        keep_parts: bool = True,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        # signs our statements of what we sent (``statements``): our libp2p identity key, which is the process-wide
        # key in a peer's averager process (``swarm.dht.identity``)
        self.signing_key = signing_key
        self.max_weight = max_weight  # a sender's weight above it counts as it (its receipt says so)
        self.tensor_part_container.__class__ = HeldOutputContainer
        plain = self.tensor_part_reducer  # hivemind's running sum, replaced before any part arrives
        self.tensor_part_reducer = RobustPartReducer(
            plain.part_shapes, plain.num_senders, aggregation, straggler_timeout=self.sender_timeout
        )
        plain.num_senders = 0  # so finalizing it unused does not log "Reducer: received 0.0% of input tensors"
        plain.finalize()
        self.bytes_sent = self.bytes_received = 0
        self.committing = False  # the average is being written into the buffers: no timeout cuts it (``fixed_group``)
        # checked reducers (swarm.defence.audit): the exact parts sent to each reducer, by its index in the group, and
        # as a reducer, the digest of each part each sender sent us, and each sender's weight
        self.sent_parts = SpilledParts(keep_parts)  # on disk until an auditor asks: a whole pseudo-gradient's bytes
        # as a reducer, each sender's parts as they came (by sender index; on disk too): an auditor fetches from us
        # the parts of a sender that is gone or will not serve them, checked against that sender's signed statement
        self.received_parts = SpilledParts(keep_parts)
        self.input_digests: list[list[bytes]] = [[] for _ in self.sender_peer_ids]
        self._input_hashes = [hashlib.sha256() for _ in self.sender_peer_ids]  # ``digest_of`` each one's so far
        self.input_weights = [0.0 for _ in self.sender_peer_ids]
        # each sender's last two signed statements (``statements``), by the count of parts they cover: the one of
        # the parts we counted is among them however its stream ended (``statement_of``)
        self._input_statements: list[dict[int, bytes]] = [{} for _ in self.sender_peer_ids]
        self.output_statements: dict[str, bytes] = {}  # reducer -> its signed ``Output``: the average it returned us
        self.nonce = os.urandom(16)  # in our receipt and every ``Output`` of this run (``audit.Receipt.nonce``)
        self._encoded: dict[int, asyncio.Future] = {}  # our slice's averaged parts, each encoded once
        self._declared: dict[int, float] = {}  # sender index -> the weight its first part declared
        self._streaming: set[int] = set()  # sender indices whose stream to us has opened (one each)
        # senders whose parts we refused as a reducer (non-finite, wrong size, undecodable, another codec): an honest
        # client never sends such a part, and we saw it on the sender's own authenticated stream
        self.refused_senders: set[PeerID] = set()
        # per groupmate, our task sending it our part of its slice and awaiting the slice's average: a groupmate whose
        # own parts we refused would only send back an average of garbage (or nothing, until the reducer timeout)
        self._awaiting_reducer: dict[PeerID, asyncio.Task] = {}

    def _received_from(self, sender_index: int, part: runtime_pb2.Tensor, weight: float) -> None:
        self.received_parts.append(sender_index, part)
        self.input_digests[sender_index].append(part_digest(part))
        self._input_hashes[sender_index].update(self.input_digests[sender_index][-1])
        self.input_weights[sender_index] = float(weight)

    def counted_parts(self) -> list[int]:
        """How many parts of each sender our slice's average holds: every part of one that finished; of one whose
        stream broke or that we dropped, those it had sent before (``RobustPartReducer``: hivemind's
        ``sender_failed_after``)."""
        reducer = self.tensor_part_reducer
        return [reducer.num_parts if math.isinf(k) else int(k) for k in reducer.sender_failed_after]

    def statement_of(self, sender_index: int, count: int) -> bytes:
        """The sender's signed statement of its first ``count`` parts, as we checked it (b"" for none)."""
        return self._input_statements[sender_index].get(count, b"")

    async def _record_sent(
        self, peer_index: int, stream: AsyncIterator[averaging_pb2.AveragingData]
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        self.sent_parts.start(peer_index)
        reducer = self.ordered_peer_ids[peer_index].to_base58()
        running, count = hashlib.sha256(), 0  # ``digest_of`` the parts sent so far
        async for message in stream:
            self.sent_parts.append(peer_index, message.tensor_part)
            running.update(part_digest(message.tensor_part))
            count += 1
            # our signed statement of what we sent so far, with every part: a reducer counts no part without one,
            # and one whose stream broke is left the statement of the parts it counted (``statements``)
            statement = Statement(self.group_id, reducer, running.copy().digest(), float(message.weight), count)
            message.peer_id = statement.sign(self.signing_key)
            yield message

    async def _count(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], *, received: bool
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in stream:
            size = len(message.tensor_part.buffer)
            if received:
                self.bytes_received += size
            else:
                self.bytes_sent += size
            yield message

    def _get_peer_stub(self, peer: PeerID) -> Any:
        return _CountingStub(super()._get_peer_stub(peer), self)

    def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        return self._count(self._record_sent(peer_index, super()._generate_input_for_peer(peer_index)), received=False)

    async def _communicate_with_peer(self, peer_id: PeerID) -> None:
        peer_index = self.ordered_peer_ids.index(peer_id)
        container = self.tensor_part_container
        if peer_id == self.peer_id:
            try:
                await self._reduce_own_slice(peer_index)
            except BaseException:  # as for a groupmate's slice: ours reads as dropped, not awaited to the hard timeout
                if not container.finished.is_set():  # (groupmates that do not get it drop it too: the same zeros)
                    container.register_failed_reducer(peer_index)
                raise
            return
        try:
            if peer_id in self.refused_senders:
                raise AllreduceException(f"we refused {peer_id}'s parts: its slice is dropped")
            self._awaiting_reducer[peer_id] = asyncio.current_task()
            done_sending = asyncio.Event()
            inputs = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            # opening the stream is bounded too (a groupmate whose daemon hangs): it counts as a silent reducer
            stream = await asyncio.wait_for(
                self._get_peer_stub(peer_id).rpc_aggregate_part(inputs), self.reducer_timeout
            )
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()
            part_index, returned = 0, []
            async for message in aiter_with_timeout(stream, self.reducer_timeout):
                if message.code != averaging_pb2.AVERAGED_PART:
                    raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(message.code)}")
                expected = container.num_parts_by_peer[peer_index]
                if part_index >= expected:
                    raise AllreduceException(f"{peer_id} sent more than the {expected} parts of its slice")
                numel = container._input_parts_by_peer[peer_index][part_index][0].numel()
                try:
                    admit(message.tensor_part, numel, container.compression.compression_type)
                except OutOfBounds as e:
                    raise AllreduceException(f"{peer_id} returned a part out of bounds: {e}") from None
                returned.append(part_digest(message.tensor_part))
                if part_index == expected - 1:  # its signed digest of all it returned us, before the last part counts
                    self._keep_output(peer_id, message.peer_id, returned)
                container.register_processed_part(peer_index, part_index, message.tensor_part)
                part_index += 1
            if part_index != container.num_parts_by_peer[peer_index]:
                raise AllreduceException(
                    f"peer {peer_id} sent {part_index} parts, but we expected {container.num_parts_by_peer[peer_index]}"
                )
        except BaseException:
            container.register_failed_reducer(peer_index)
            raise

    async def _reduce_own_slice(self, peer_index: int) -> None:
        """Our own part of the slice we reduce, added as every groupmate's is, and the slice's average kept."""
        container, loop = self.tensor_part_container, asyncio.get_event_loop()
        sender_index = self.sender_peer_ids.index(self.peer_id)
        ours = container.compression.compression_type
        self.sent_parts.start(peer_index)
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            # our own slice goes through the codec like everyone's, so what we add is bytes a groupmate can
            # check (lossless for fp4 and sparse, whose values are already on the grid)
            sent = await loop.run_in_executor(None, serialize_torch_tensor, tensor_part, ours)
            self.sent_parts.append(peer_index, sent)
            weight = min(self.weight, self.max_weight)  # as a groupmate's reducer would count it
            self._received_from(sender_index, sent, weight)
            values = await loop.run_in_executor(None, deserialize_torch_tensor, sent)
            averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, values, weight=weight)
            held = await self._returned(sender_index, part_index, averaged)
            container.register_processed_part(peer_index, part_index, held)

    async def _with_expected_numel(
        self, stream: AsyncIterator[averaging_pb2.AveragingData]
    ) -> AsyncIterator[tuple[averaging_pb2.AveragingData, int]]:
        """Each message of a sender's stream with the number of values its part must hold (-1 past the slice's
        last part: refused as it stands). One stream, read in order: no read runs beside another."""
        shapes = self.tensor_part_reducer.part_shapes
        index = 0
        async for message in stream:
            yield message, math.prod(shapes[index]) if index < len(shapes) else -1
            index += 1

    def _check_statement(self, sender_index: int, statement: bytes, declared: float) -> None:
        """Keep a sender's signed statement of the parts it sent us so far (this one included) for our receipt, or
        refuse the sender if it does not say what it sent (``swarm.defence.statements``): a receipt lists only what
        its senders signed, and a part is counted only with its statement."""
        sender, count = self.sender_peer_ids[sender_index].to_base58(), len(self.input_digests[sender_index])
        digest = self._input_hashes[sender_index].copy().digest()
        if not vouches(statement, sender, self.group_id, self.peer_id.to_base58(), digest, declared, count):
            raise RefusedPart("a sender's part came without its signed statement of what it sent")
        kept = self._input_statements[sender_index]
        kept[count] = statement
        kept.pop(count - 2, None)

    def _keep_output(self, reducer: PeerID, blob: bytes, returned: list[bytes]) -> None:
        """Keep a reducer's signed ``Output`` of the average it returned us (``proofs``: two such digests of one
        slice are an equivocation), or take its slice as cut short if it did not sign what we received."""
        output = open_output(blob)  # its nonce is the reducer's to draw
        if output is None or (output.group_id, output.reducer, output.digest) != (
            self.group_id,
            reducer.to_base58(),
            digest_of(returned),
        ):
            raise AllreduceException(f"{reducer} returned its average without its signed statement of it")
        self.output_statements[reducer.to_base58()] = blob

    async def _returned(self, sender_index: int, part_index: int, averaged: torch.Tensor) -> runtime_pb2.Tensor:
        """Part ``part_index`` of our slice's average as we return it to a sender, and keep it ourselves: encoded
        once, the very same bytes for every one (two encodings that differed would be two averages we signed)."""
        if part_index not in self._encoded:
            compression = self.tensor_part_container.compression.compression_type
            encode = asyncio.get_event_loop().run_in_executor(None, encode_average, averaged, compression)
            self._encoded[part_index] = asyncio.ensure_future(encode)
        return await asyncio.shield(self._encoded[part_index])

    def _refuse(self, sender: PeerID) -> None:
        """Drop a sender whose part we refused: its parts, and the slice it reduces, without waiting for it."""
        self.refused_senders.add(sender)
        awaiting = self._awaiting_reducer.get(sender)
        if awaiting is not None and not awaiting.done() and awaiting is not asyncio.current_task():
            awaiting.cancel()  # its slice is registered as failed (read back as no change) when the task ends

    async def _accumulate_parts_streaming(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        part_index, returned = 0, []
        ours = self.tensor_part_container.compression.compression_type
        if sender_index in self._streaming:  # one stream a sender: a second would interleave its parts' digests
            self._refuse(self.sender_peer_ids[sender_index])
            await self._ban_sender(self.sender_peer_ids[sender_index])
            raise RefusedPart("a sender opened a second stream to us")
        self._streaming.add(sender_index)
        try:
            async for tensor_part, weight, message, statement in amap_in_executor(
                lambda numbered: (*decode_part(*numbered, compression=ours), numbered[0].peer_id),
                self._with_expected_numel(self._count(stream, received=True)),
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                try:
                    if message.compression != ours:  # the run's codec for everyone, so everyone decodes the same
                        raise RefusedPart(f"a sender used compression {message.compression}, not the run's {ours}")
                    if isinstance(tensor_part, RefusedPart):
                        raise tensor_part
                    if not (isinstance(weight, float | int) and math.isfinite(weight) and weight >= 0):
                        raise RefusedPart(f"a sender's weight is {weight!r}")  # before it is kept for our receipt
                    if self._declared.setdefault(sender_index, weight) != weight:
                        # a receipt lists one weight a sender; one part counted with another would fail the audit
                        raise RefusedPart("a sender declared another weight for one of its parts")
                    declared, weight = weight, min(weight, self.max_weight)
                    self._received_from(sender_index, message, weight)
                    self._check_statement(sender_index, statement, declared)
                    averaged_part = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight
                    )
                    part_index += 1
                except BannedException:
                    break
                except RefusedPart:
                    self._refuse(self.sender_peer_ids[sender_index])
                    raise
                serialized = await self._returned(sender_index, part_index - 1, averaged_part)
                self.bytes_sent += len(serialized.buffer)
                message = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
                returned.append(part_digest(serialized))
                if part_index == self.tensor_part_reducer.num_parts:  # our signed digest of all we returned, with it
                    output = Output(self.group_id, self.peer_id.to_base58(), self.nonce, digest_of(returned))
                    message.peer_id = output.sign(self.signing_key)
                yield message
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])
