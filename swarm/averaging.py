"""Pseudo-gradient averaging that leaves every member of a group with identical bits.

hivemind's all-reduce returns each peer ``average - own_part`` compressed, and each
peer adds that to its own tensor. With FP16 on the wire the rounding of that delta
differs per peer, so groupmates finish about 1e-5 apart and their global models
drift. Here each reducer sends the (compressed) average itself and keeps the same
rounding for its own part, so every groupmate receives the very same numbers and
their outer steps stay bitwise equal, which makes a plain hash a valid
consistency check.

Two more changes make failures safe:
- results are written into the shared buffers only after the whole all-reduce
  succeeded, so a failed or retried round leaves this peer's own pseudo-gradient
  untouched (the local fallback);
- a part whose reducer vanished comes back as zero (that slice of the
  pseudo-gradient is dropped this round) rather than as each peer's own values,
  so survivors still agree. The dropped fraction is reported.

The same averager also serves and fetches the outer state for joiners and
re-syncing peers, from one chosen donor rather than hivemind's priority list.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing as mp
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.control import AveragingStage
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import BannedException
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    ScaledFloat16Compression,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, as_aiter, azip
from hivemind.utils.streaming import combine_from_streaming

COMPRESSIONS: dict[str, Callable[[], CompressionBase]] = {
    "none": NoCompression,
    "fp16": Float16Compression,
    "scaled-fp16": ScaledFloat16Compression,
}


@dataclass(frozen=True)
class AllReduceOutcome:
    """What one successful all-reduce did; returned by ``PseudoGradientAverager.step``."""

    group: tuple[str, ...]  # base58 peer ids, this peer included
    gathered: dict[str, Any]  # each groupmate's ``gather`` payload
    dropped_fraction: float  # share of values whose reducer vanished (set to zero)
    excluded_senders: int  # groupmates whose contribution was left out of some parts
    bytes_sent: int = 0  # tensor payload this peer sent (parts to reducers, averages back to senders)
    bytes_received: int = 0  # tensor payload this peer received


class RoundAborted(RuntimeError):
    """Matchmaking was given up on purpose: ``reason`` says why (the swarm moved on, the peer is leaving)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class _CountingStub:
    """Wraps a groupmate's stub so the averaged parts it streams back are counted as received bytes."""

    def __init__(self, stub: Any, runner: ExactAllReduceRunner):
        self._stub, self._runner = stub, runner

    async def rpc_aggregate_part(self, inputs: AsyncIterator[averaging_pb2.AveragingData]):
        stream = await self._stub.rpc_aggregate_part(inputs)
        return self._runner._count(stream, received=True)


class ExactAllReduceRunner(AllReduceRunner):
    """An AllReduceRunner whose outputs are the averaged values, identical for every groupmate.

    It also counts the tensor payload it sends and receives (protobuf and libp2p
    framing excluded), which the dashboard and the benchmarks report per round.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.bytes_sent = self.bytes_received = 0

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
        return self._count(super()._generate_input_for_peer(peer_index), received=False)

    def _round_trip(self, tensor: torch.Tensor) -> torch.Tensor:
        compression = self.tensor_part_container.compression
        return deserialize_torch_tensor(serialize_torch_tensor(tensor, compression.compression_type))

    async def _communicate_with_peer(self, peer_id: PeerID) -> None:
        if peer_id != self.peer_id:
            return await super()._communicate_with_peer(peer_id)
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        loop = asyncio.get_event_loop()
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            averaged_part = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, tensor_part, weight=self.weight
            )
            rounded = await loop.run_in_executor(None, self._round_trip, averaged_part)
            self.tensor_part_container.register_processed_part(peer_index, part_index, rounded)

    async def _accumulate_parts_streaming(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        part_index = 0
        try:
            loop = asyncio.get_event_loop()
            async for tensor_part, weight, part_compression in amap_in_executor(
                lambda msg: (deserialize_torch_tensor(msg.tensor_part), msg.weight, msg.tensor_part.compression),
                self._count(stream, received=True),
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                try:
                    averaged_part = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight
                    )
                    part_index += 1
                except BannedException:
                    break
                serialized = await loop.run_in_executor(None, serialize_torch_tensor, averaged_part, part_compression)
                self.bytes_sent += len(serialized.buffer)
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])


class PseudoGradientAverager(DecentralizedAverager):
    """A DecentralizedAverager over pseudo-gradient buffers that also shares the outer state."""

    def __init__(
        self, averaged_tensors: Sequence[torch.Tensor], dht, *, state_provider: Callable[[], tuple], **kwargs: Any
    ):
        self._state_provider = state_provider
        self._round_stats: dict[bytes, tuple[float, int, int, int]] = {}
        self._download_progress = mp.Value(ctypes.c_double, 0.0)
        super().__init__(averaged_tensors, dht, **kwargs)

    # ---- averaging -------------------------------------------------------------------------

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes | None = None, **kwargs: Any
    ) -> None:
        group_id = group_info.group_id if group_id is None else group_id
        runner = ExactAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise ValueError("auxiliary peers do not receive averaged tensors")
            return
        results = [result async for _, result in azip(as_aiter(*tensors), runner)]
        for tensor, result in zip(tensors, results):  # commit only after the whole all-reduce succeeded
            tensor.copy_(result.reshape(tensor.shape))
        total = max(1, runner.tensor_part_container.total_size)
        self._round_stats[group_id] = (
            runner.tensor_part_container.failed_size / total,
            len(runner.banned_senders),
            runner.bytes_sent,
            runner.bytes_received,
        )

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> dict:
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        dropped, excluded, sent, received = self._round_stats.pop(group_info.group_id, (0.0, 0, 0, 0))
        return dict(
            group=tuple(p.to_base58() for p in group_info.peer_ids),
            gathered={peer.to_base58(): data for peer, data in gathered.items()},
            dropped_fraction=dropped,
            excluded_senders=excluded,
            bytes_sent=sent,
            bytes_received=received,
        )

    def average(
        self,
        *,
        weight: float,
        gather: Any,
        group_bits: str,
        timeout: float,
        hard_timeout: float,
        on_stage: Callable[[str], None] = lambda stage: None,
        abort_if: Callable[[], str | None] = lambda: None,
        abort_poll: float = 1.0,
    ) -> AllReduceOutcome:
        """One averaging round over the buffers; raises on failure, never waits past ``hard_timeout``.

        ``abort_if`` is polled while looking for a group and returns a reason to give
        up (the swarm already moved on, the peer is leaving), or None to keep waiting.
        """
        self.set_group_bits(group_bits, wait=False).result(timeout=30)
        control = self.step(weight=weight, gather=gather, timeout=timeout, allow_retries=True, wait=False)
        deadline = time.monotonic() + hard_timeout
        last_stage, next_poll = None, time.monotonic() + abort_poll
        while not control.done():
            if control.stage != last_stage:
                last_stage = control.stage
                on_stage(last_stage.name)
            if time.monotonic() > deadline:
                control.cancel()
                raise TimeoutError(f"averaging did not finish in {hard_timeout:.0f} s")
            if last_stage == AveragingStage.LOOKING_FOR_GROUP and time.monotonic() > next_poll:
                next_poll = time.monotonic() + abort_poll
                reason = abort_if()
                if reason is not None:
                    control.cancel()
                    raise RoundAborted(reason)
            time.sleep(0.02)
        result = control.result()
        return AllReduceOutcome(**result)

    # ---- state sharing -----------------------------------------------------------------------

    def get_current_state(self) -> tuple:
        """Called in this (host) process when a peer downloads our state."""
        return self._state_provider()

    @property
    def download_progress(self) -> float:
        return float(self._download_progress.value)

    def download_state(self, peer_id: str, *, chunk_timeout: float, timeout: float) -> tuple[dict, list]:
        """Download the outer state from one chosen peer; raises on failure or timeout."""
        self._download_progress.value = 0.0
        future = MPFuture()
        self._outer_pipe.send(
            ("_download_state_from", [], dict(peer_id=peer_id, chunk_timeout=chunk_timeout, future=future))
        )
        try:
            return future.result(timeout=timeout)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(f"state download from {peer_id} did not finish in {timeout:.0f} s") from None

    async def _download_state_from(self, peer_id: str, chunk_timeout: float, future: MPFuture) -> None:
        try:
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer_id), namespace=self.prefix)
            stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
            metadata, parts, tensors, received = None, [], [], 0
            async for message in aiter_with_timeout(stream, timeout=chunk_timeout):
                if future.done():  # the host gave up
                    return
                if message.metadata:
                    metadata = self.serializer.loads(message.metadata)
                if message.tensor_part.dtype and parts:
                    tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                    parts = []
                parts.append(message.tensor_part)
                received += len(message.tensor_part.buffer)
                if isinstance(metadata, dict) and metadata.get("nbytes"):
                    self._download_progress.value = min(1.0, received / metadata["nbytes"])
            if parts:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
            if not isinstance(metadata, dict):
                raise RuntimeError(f"peer {peer_id} refused to share its state")
            future.set_result((metadata, tensors))
        except BaseException as e:
            if not future.done():
                future.set_exception(RuntimeError(f"state download from {peer_id} failed: {e!r}"))


def epoch_group_bits(epoch: int, bits: int = 16) -> str:
    """Matchmaking key bits for an epoch, so peers of different epochs never average together."""
    return format(epoch % (1 << bits), f"0{bits}b")


def state_tensor_infos(tensors: Sequence[torch.Tensor]) -> list[CompressionInfo]:
    return [CompressionInfo.from_tensor(t, key=i) for i, t in enumerate(tensors)]
