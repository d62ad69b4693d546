"""The averager process: pseudo-gradient rounds, and the outer state sent to and fetched from other peers.

A ``PseudoGradientAverager`` is a hivemind ``DecentralizedAverager`` (its own
process) over shared pseudo-gradient buffers. Its all-reduce is
``allreduce.ExactAllReduceRunner``: groupmates end bitwise equal, and the buffers
change only when the whole all-reduce succeeded.

State transfer goes through files rather than memory: a donor streams its newest
state file (``state_file``) as raw bytes, and a joiner writes what it receives to
a file of its own, which the host then checks like any checkpoint before loading
it. Neither side holds the state in RAM, and a donor serves a file that is
complete and unchanging even while its training moves on.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing as mp
import os
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.control import AveragingStage
from hivemind.averaging.group_info import GroupInfo
from hivemind.compression import CompressionBase, Float16Compression, NoCompression, ScaledFloat16Compression
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import aiter_with_timeout, as_aiter, azip

from swarm.allreduce import ExactAllReduceRunner, decode_into

COMPRESSIONS: dict[str, Callable[[], CompressionBase]] = {
    "none": NoCompression,
    "fp16": Float16Compression,
    "scaled-fp16": ScaledFloat16Compression,
}
SERVE_CHUNK = 1 << 19  # hivemind's part size; p2pd caps a message at 4 MiB
STALE_FILE_WAIT = 30.0  # a donor asked right after a round waits this long for that round's file


@dataclass(frozen=True)
class AllReduceOutcome:
    """What one successful all-reduce did; returned by ``PseudoGradientAverager.average``."""

    group: tuple[str, ...]  # base58 peer ids, this peer included
    gathered: dict[str, Any]  # each groupmate's ``gather`` payload
    dropped_fraction: float  # share of values whose reducer vanished (set to zero)
    excluded_senders: int  # groupmates whose contribution was left out of some parts
    bytes_sent: int = 0  # tensor payload this peer sent (parts to reducers, averages back to senders)
    bytes_received: int = 0  # tensor payload this peer received


class RoundAborted(RuntimeError):
    """Averaging was given up on purpose: ``leaving`` says whether the peer is on its way out."""

    def __init__(self, reason: str, leaving: bool = False):
        super().__init__(reason)
        self.reason, self.leaving = reason, leaving


class DownloadStopped(RuntimeError):
    """A state download was given up because the peer is leaving."""


class PseudoGradientAverager(DecentralizedAverager):
    """A DecentralizedAverager over pseudo-gradient buffers that also serves and fetches state files."""

    def __init__(self, averaged_tensors: Sequence[torch.Tensor], dht, **kwargs: Any):
        self._round_stats: dict[bytes, tuple[float, int, int, int]] = {}
        self._download_progress = mp.Value(ctypes.c_double, 0.0)
        self._served_path = mp.Array(ctypes.c_char, 4096)
        self._served_epoch = mp.Value(ctypes.c_int64, -1)
        self._host_epoch = mp.Value(ctypes.c_int64, -1)
        super().__init__(averaged_tensors, dht, **kwargs)

    # ---- averaging (runs in the averager process) ------------------------------------------------

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
        held = [parts async for _, parts in azip(as_aiter(*tensors), runner)]

        def commit() -> None:  # only after the whole all-reduce succeeded
            for tensor, parts in zip(tensors, held):
                decode_into(tensor, parts)

        await asyncio.get_event_loop().run_in_executor(None, commit)
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

    # ---- averaging (the host's side) -------------------------------------------------------------

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
        leaving: Callable[[], bool] = lambda: False,
        abort_poll: float = 1.0,
    ) -> AllReduceOutcome:
        """One averaging round over the buffers; raises on failure, never waits past ``hard_timeout``.

        ``abort_if`` is polled while looking for a group and returns a reason to give
        up (the swarm already moved on), or None to keep waiting; ``leaving`` is polled
        throughout, all-reduce included, since a peer told to stop must not wait for one.
        """
        self.set_group_bits(group_bits, wait=False).result(timeout=30)
        control = self.step(weight=weight, gather=gather, timeout=timeout, allow_retries=True, wait=False)
        deadline = time.monotonic() + hard_timeout
        last_stage, next_poll = None, time.monotonic() + abort_poll
        while not control.done():
            if control.stage != last_stage:
                last_stage = control.stage
                on_stage(last_stage.name)
            if leaving():
                control.cancel()
                raise RoundAborted("the peer is leaving", leaving=True)
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
        return AllReduceOutcome(**control.result())

    # ---- serving state (the averager process answers; the host says which file) -----------------

    def serve_state_file(self, path: Path, epoch: int) -> None:
        """From now on, send this (complete, checked) file to peers that ask for the state."""
        encoded = os.fsencode(str(path))
        with self._served_path.get_lock():
            self._served_path.value = encoded
            self._served_epoch.value = epoch

    def note_epoch(self, epoch: int) -> None:
        """The host's outer state moved to ``epoch``; a served file of an older epoch is stale until replaced."""
        self._host_epoch.value = epoch

    def get_current_state(self) -> tuple:
        raise RuntimeError("the state is served from files (rpc_download_state)")

    async def _current_file(self) -> tuple[Path, int] | None:
        """The file to serve; waits a little for a round's file that is still being written."""
        deadline = time.monotonic() + STALE_FILE_WAIT
        while True:
            with self._served_path.get_lock():
                raw, epoch = self._served_path.value, self._served_epoch.value
            if raw and epoch >= self._host_epoch.value:
                return Path(os.fsdecode(raw)), epoch
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.2)

    async def rpc_download_state(
        self, _request: averaging_pb2.DownloadRequest, _context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:  # hivemind registers handlers by typing's hints
        if not self.allow_state_sharing:
            return
        current = await self._current_file()
        if current is None:
            return
        path, epoch = current
        loop = asyncio.get_event_loop()
        try:
            handle = open(path, "rb")  # noqa: SIM115 (closed below; the file may be pruned meanwhile, this keeps it)
        except OSError:
            return
        try:
            size = os.fstat(handle.fileno()).st_size
            metadata = self.serializer.dumps(dict(epoch=epoch, nbytes=size))
            while chunk := await loop.run_in_executor(None, handle.read, SERVE_CHUNK):
                yield averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(buffer=chunk), metadata=metadata)
                metadata = b""
        finally:
            handle.close()

    # ---- downloading state (the host asks; the averager process writes the file) -----------------

    @property
    def download_progress(self) -> float:
        return float(self._download_progress.value)

    def download_state(
        self,
        peer_id: str,
        destination: Path,
        *,
        max_bytes: int,
        chunk_timeout: float,
        timeout: float,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> dict:
        """Fetch one peer's state file into ``destination``; returns its metadata. Raises on failure, timeout
        or ``should_stop`` (``DownloadStopped``); the caller checks the file before using it."""
        self._download_progress.value = 0.0
        future = MPFuture()
        self._outer_pipe.send(
            (
                "_download_state_from",
                [],
                dict(
                    peer_id=peer_id,
                    destination=str(destination),
                    max_bytes=max_bytes,
                    chunk_timeout=chunk_timeout,
                    future=future,
                ),
            )
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                return future.result(timeout=0.5)
            except TimeoutError:
                if should_stop():
                    future.cancel()
                    raise DownloadStopped("the peer is leaving") from None
                if time.monotonic() > deadline:
                    future.cancel()
                    raise TimeoutError(f"state download from {peer_id} did not finish in {timeout:.0f} s") from None

    async def _download_state_from(
        self, peer_id: str, destination: str, max_bytes: int, chunk_timeout: float, future: MPFuture
    ) -> None:
        try:
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer_id), namespace=self.prefix)
            stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
            loop = asyncio.get_event_loop()
            metadata, received = None, 0
            with open(destination, "wb") as out:
                async for message in aiter_with_timeout(stream, timeout=chunk_timeout):
                    if future.done():  # the host gave up
                        return
                    if metadata is None:
                        metadata = self.serializer.loads(message.metadata) if message.metadata else None
                        nbytes = metadata.get("nbytes") if isinstance(metadata, dict) else None
                        if not isinstance(nbytes, int) or not 0 < nbytes <= max_bytes:
                            raise RuntimeError(f"peer {peer_id} announced a state of {nbytes!r} bytes")
                    chunk = message.tensor_part.buffer
                    received += len(chunk)
                    if received > metadata["nbytes"]:
                        raise RuntimeError(f"peer {peer_id} sent more than the {metadata['nbytes']} bytes it announced")
                    await loop.run_in_executor(None, out.write, chunk)
                    self._download_progress.value = received / metadata["nbytes"]
                await loop.run_in_executor(None, out.flush)
                await loop.run_in_executor(None, os.fsync, out.fileno())
            if metadata is None:
                raise RuntimeError(f"peer {peer_id} refused to share its state")
            if received != metadata["nbytes"]:
                raise RuntimeError(f"peer {peer_id} sent {received} of {metadata['nbytes']} bytes")
            if not future.done():
                future.set_result(metadata)
        except BaseException as e:
            Path(destination).unlink(missing_ok=True)
            if not future.done():
                future.set_exception(RuntimeError(f"state download from {peer_id} failed: {e!r}"))
            if not isinstance(e, Exception):
                raise


def epoch_group_bits(epoch: int, bits: int = 16) -> str:
    """Matchmaking key bits for an epoch, so peers of different epochs never average together."""
    return format(epoch % (1 << bits), f"0{bits}b")
