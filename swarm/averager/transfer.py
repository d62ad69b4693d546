"""Files between peers: the outer state for joiners, and the last rounds' averaged updates for replay.

Both directions go through files, not memory. A donor streams its newest state file, complete and unchanging while
its training moves on; a joiner's averager process writes what it gets straight to a file, checked before use.

After each averaged round a peer also keeps the round's average exactly as it came off the wire (``update-EPOCH.bin``:
the reducers' serialized parts), the last ``keep_updates`` of them; after a local round, its own step, as a group of
one would have received it (``swarm.round.local_update``). A peer a few epochs behind fetches those few updates (half a
byte per parameter each with fp4) and applies them, instead of the whole state (eight bytes per parameter).

A mixin of ``PseudoGradientAverager``: the ``rpc_*`` handlers and ``_..._from`` coroutines run in its process.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import multiprocessing as mp
import os
import struct
import time
import typing
from collections.abc import Callable, Sequence
from contextlib import aclosing
from pathlib import Path

from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import aiter_with_timeout

from swarm.averager.bounds import max_request_bytes
from swarm.averager.held import Dropped, HeldPart
from swarm.averager.served import served
from swarm.averager.serving_limits import GROUPMATES_RESERVE, NETWORK_SHARE, RecentGroupmates, ServingLimits
from swarm.averager.trickle import RATE_WINDOW, RateFloor, TooSlow
from swarm.defence.unpack import bounded_loads
from swarm.dht.access import RunSecret

logger = logging.getLogger(__name__)

SERVE_CHUNK = 1 << 19  # hivemind's part size; p2pd caps a message at 4 MiB
STALE_FILE_WAIT = 30.0  # a donor asked right after a round waits this long for that round's file
UPDATE_FORMAT = "swarm-update-1"
MAX_UPDATE_HEADER = 16 << 20


class DownloadStopped(RuntimeError):
    """A download was given up because the peer is leaving."""


class _HostGaveUp(Exception):
    """The averager process learns that the host stopped waiting for a download: its file is removed."""


def update_path(directory: Path, epoch: int) -> Path:
    return Path(directory) / f"update-{epoch:07d}.bin"


def pending_path(directory: Path, epoch: int) -> Path:
    """A group's average before the round is final (two-stage rounds): never served."""
    return Path(directory) / f"pending-{epoch:07d}.bin"


def write_update(path: Path, run_id: str, epoch: int, held: Sequence[Sequence[HeldPart]]) -> None:
    """The average of round ``epoch`` as it came off the wire: per tensor, its parts in order."""
    blobs, layout = [], []
    for parts in held:
        entry = []
        for part in parts:
            if isinstance(part, Dropped):
                entry.append(dict(dropped=part.numel))
            else:
                blob = part.SerializeToString()
                entry.append(dict(nbytes=len(blob)))
                blobs.append(blob)
        layout.append(entry)
    header = json.dumps(dict(format=UPDATE_FORMAT, run_id=run_id, epoch=epoch, tensors=layout)).encode()
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")  # the host (local rounds) and its averager both write
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for blob in blobs:
            f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_update(path: Path, run_id: str, epoch: int, num_tensors: int) -> list[list[HeldPart]]:
    """Parse an update file (raises ``ValueError`` if it is not this run's average of round ``epoch``)."""
    data = Path(path).read_bytes()
    try:
        (length,) = struct.unpack("<Q", data[:8])
        if length > min(MAX_UPDATE_HEADER, len(data) - 8):
            raise ValueError("no header")
        header = json.loads(data[8 : 8 + length])
        if (header.get("format"), header.get("run_id"), header.get("epoch")) != (UPDATE_FORMAT, run_id, epoch):
            raise ValueError("another run's or another round's update")
        layout = header["tensors"]
        if len(layout) != num_tensors:
            raise ValueError("another model's update")
        offset, held = 8 + length, []
        for entry in layout:
            parts: list[HeldPart] = []
            for item in entry:
                if "dropped" in item:
                    parts.append(Dropped(int(item["dropped"])))
                    continue
                size = int(item["nbytes"])
                if size < 0 or offset + size > len(data):
                    raise ValueError("truncated")
                message = runtime_pb2.Tensor()
                message.ParseFromString(data[offset : offset + size])
                parts.append(message)
                offset += size
            held.append(parts)
        if offset != len(data):
            raise ValueError("extra bytes")
        return held
    except (KeyError, TypeError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"malformed update file: {e!r}") from None
    except Exception as e:  # protobuf's DecodeError and the like
        if isinstance(e, ValueError):
            raise
        raise ValueError(f"malformed update file: {e!r}") from None


class FileTransfer:
    """The averager's file traffic. Set up in the host (``_init_transfer``) before the process forks."""

    def _init_transfer(self, update_dir: Path | None, keep_updates: int, run_id: str, secret: RunSecret | None) -> None:
        self._secret = secret
        self._serving = ServingLimits(per_network=NETWORK_SHARE, reserved=GROUPMATES_RESERVE)  # ``serving_limits``
        self._groupmates = RecentGroupmates()  # noted by the averager process as each first stage starts
        self._download_progress = mp.Value(ctypes.c_double, 0.0)
        self._served_path = mp.Array(ctypes.c_char, 4096)
        self._served_epoch = mp.Value(ctypes.c_int64, -1)
        self._host_epoch = mp.Value(ctypes.c_int64, -1)
        self._update_dir, self._keep_updates, self._run_id = update_dir, keep_updates, run_id
        self._keeping_epoch = mp.Value(ctypes.c_int64, -1)  # a local round's update the host is writing

    # ---- serving (the averager process answers; the host says which state file) -----------------

    def serve_state_file(self, path: Path, epoch: int) -> None:
        """From now on, send this (complete, checked) file to peers that ask for the state."""
        encoded = os.fsencode(str(path))
        with self._served_path.get_lock():
            self._served_path.value = encoded
            self._served_epoch.value = epoch

    def note_epoch(self, epoch: int) -> None:
        """The host's outer state moved to ``epoch``; a served file of another epoch is stale until replaced."""
        self._host_epoch.value = epoch

    def get_current_state(self) -> tuple:
        raise RuntimeError("the state is served from files (rpc_download_state)")

    async def _current_file(self) -> tuple[Path, int] | None:
        """The file to serve; waits a little for a round's file that is still being written."""
        deadline = time.monotonic() + STALE_FILE_WAIT
        while True:
            with self._served_path.get_lock():
                raw, epoch = self._served_path.value, self._served_epoch.value
            if raw and epoch == self._host_epoch.value:
                return Path(os.fsdecode(raw)), epoch
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.2)

    async def _stream_file(self, path: Path, epoch: int) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
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

    def _admitted(self, request: averaging_pb2.DownloadData, context: P2PContext) -> dict | None:
        """The request's fields, if it may be served: in a closed run, only with a token for this requester
        (as libp2p authenticated it) and this donor, made with the run's transfer key."""
        if len(request.metadata) > max_request_bytes(self.matchmaking_kwargs.get("target_group_size") or 64):
            return None  # never decoded: a small message of nested msgpack decodes to a large object
        try:
            fields = bounded_loads(request.metadata) if request.metadata else {}
        except Exception:
            return None
        if not isinstance(fields, dict) or self._is_banned(context.remote_id):
            return None
        if self._secret is not None:
            token = fields.get("token")
            requester, donor = context.remote_id.to_bytes(), context.local_id.to_bytes()
            if not isinstance(token, bytes) or not self._secret.transfer_token_ok(token, requester, donor):
                return None
        return fields

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:  # hivemind registers handlers by typing's hints
        if not self.allow_state_sharing or self._admitted(request, context) is None:
            return
        requester = context.remote_id.to_base58()
        mate = requester in self._groupmates  # a groupmate may take the slots kept for them
        async with aclosing(served(self._serving, requester, self._current_stream(), "a state", mate)) as messages:
            async for message in messages:
                yield message

    async def _current_stream(self) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        current = await self._current_file()
        if current is not None:
            async with aclosing(self._stream_file(*current)) as messages:  # its file closed with the stream
                async for message in messages:
                    yield message

    async def rpc_download_update(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        """The average of one round, by its epoch (``request.metadata``: ``{"epoch": E}``)."""
        fields = self._admitted(request, context)
        if not self.allow_state_sharing or self._update_dir is None or fields is None:
            return
        epoch = fields.get("epoch")
        if not (isinstance(epoch, int) and epoch >= 0):
            return
        requester = context.remote_id.to_base58()
        mate = requester in self._groupmates
        async with aclosing(served(self._serving, requester, self._update_stream(epoch), "an update", mate)) as stream:
            async for message in stream:
                yield message

    async def _update_stream(self, epoch: int) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        path = update_path(self._update_dir, epoch)
        deadline = time.monotonic() + STALE_FILE_WAIT
        while self._keeping_epoch.value == epoch and not path.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)  # a local round's update, still being encoded by the host
        async with aclosing(self._stream_file(path, epoch)) as messages:
            async for message in messages:
                yield message

    # ---- keeping the rounds' averages (the averager process after a group's round; the host after a local one)

    def keep_update(self, epoch: int, held: Sequence[Sequence[HeldPart]]) -> None:
        """Write round ``epoch``'s update, and remove those more than ``keep_updates`` rounds older."""
        if self._update_dir is None or self._keep_updates <= 0:
            return
        write_update(update_path(self._update_dir, epoch), self._run_id, epoch, held)
        self._prune_updates(epoch)

    def keep_pending(self, epoch: int, held: Sequence[Sequence[HeldPart]]) -> None:
        """(averager process) A group's average of round ``epoch``, until the host makes it the epoch's update."""
        if self._update_dir is not None and self._keep_updates > 0:
            write_update(pending_path(self._update_dir, epoch), self._run_id, epoch, held)

    def finalize_update(self, epoch: int) -> bool:
        """(host) The average last kept for ``epoch`` is the one the swarm goes on from: serve it for replay."""
        if self._update_dir is None or self._keep_updates <= 0:
            return False
        return self.adopt_update(epoch, pending_path(self._update_dir, epoch))

    def adopt_update(self, epoch: int, path: Path) -> bool:
        """(host) A checked file of round ``epoch``'s update (ours, or downloaded) becomes the one we serve."""
        if self._update_dir is None or self._keep_updates <= 0:
            Path(path).unlink(missing_ok=True)
            return False
        try:
            os.replace(path, update_path(self._update_dir, epoch))
        except OSError:
            return False
        self._prune_updates(epoch)
        return True

    def _prune_updates(self, epoch: int) -> None:
        old = update_path(self._update_dir, epoch - self._keep_updates)
        for pattern in ("update-*.bin", "pending-*.bin"):
            for path in Path(self._update_dir).glob(pattern):
                if path.name.split("-", 1)[1] <= old.name.split("-", 1)[1]:
                    path.unlink(missing_ok=True)

    def begin_keeping(self, epoch: int) -> None:
        """The host is encoding its local round's update of ``epoch``: a replayer asking for it waits for it."""
        self._keeping_epoch.value = epoch

    def done_keeping(self, epoch: int) -> None:
        with self._keeping_epoch.get_lock():
            if self._keeping_epoch.value == epoch:
                self._keeping_epoch.value = -1

    # ---- downloading (the host asks; the averager process writes the file) -----------------------

    @property
    def download_progress(self) -> float:
        return float(self._download_progress.value)

    def download_state(self, peer_id: str, destination: Path, **kwargs) -> dict:
        """Fetch one peer's state file into ``destination``; returns its metadata. Raises on failure, timeout
        or ``should_stop`` (``DownloadStopped``); the caller checks the file before using it."""
        return self._download(peer_id, "rpc_download_state", None, destination, **kwargs)

    def download_update(self, peer_id: str, epoch: int, destination: Path, **kwargs) -> dict:
        """Fetch one peer's average of round ``epoch`` into ``destination``."""
        return self._download(peer_id, "rpc_download_update", dict(epoch=epoch), destination, **kwargs)

    def _download(
        self,
        peer_id: str,
        rpc: str,
        request: dict | None,
        destination: Path,
        *,
        max_bytes: int,
        chunk_timeout: float,
        timeout: float,
        min_rate: float = 0.0,
        rate_window: float = RATE_WINDOW,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> dict:
        """``min_rate``: bytes a second below which, over ``rate_window`` seconds, the donor is given up on
        (``swarm.averager.trickle``)."""
        self._download_progress.value = 0.0
        future = MPFuture()
        kwargs = dict(peer_id=peer_id, rpc=rpc, request=request, destination=str(destination))
        kwargs.update(max_bytes=max_bytes, chunk_timeout=chunk_timeout, future=future)
        kwargs.update(min_rate=min_rate, rate_window=rate_window)
        self._outer_pipe.send(("_download_from", [], kwargs))
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
                    raise TimeoutError(f"download from {peer_id} did not finish in {timeout:.0f} s") from None

    async def _download_from(
        self,
        peer_id: str,
        rpc: str,
        request: dict | None,
        destination: str,
        max_bytes: int,
        chunk_timeout: float,
        min_rate: float,
        rate_window: float,
        future: MPFuture,
    ) -> None:
        try:
            donor = PeerID.from_base58(peer_id)
            stub = self.get_stub(self._p2p, donor, namespace=self.prefix)
            fields = dict(request or {})
            if self._secret is not None:
                fields["token"] = self._secret.transfer_token(self._p2p.peer_id.to_bytes(), donor.to_bytes())
            stream = await getattr(stub, rpc)(averaging_pb2.DownloadData(metadata=self.serializer.dumps(fields)))
            loop = asyncio.get_event_loop()
            metadata, received = None, 0
            floor = RateFloor(min_rate, time.monotonic(), rate_window)
            with open(destination, "wb") as out:
                async for message in aiter_with_timeout(stream, timeout=chunk_timeout):
                    if future.done():  # the host gave up (and may have removed the file before it was opened)
                        raise _HostGaveUp
                    if metadata is None:
                        metadata = bounded_loads(message.metadata, 64) if message.metadata else None
                        nbytes = metadata.get("nbytes") if isinstance(metadata, dict) else None
                        if not isinstance(nbytes, int) or not 0 < nbytes <= max_bytes:
                            raise RuntimeError(f"peer {peer_id} announced a file of {nbytes!r} bytes")
                    chunk = message.tensor_part.buffer
                    received += len(chunk)
                    floor.note(received, time.monotonic())
                    if received > metadata["nbytes"]:
                        raise RuntimeError(f"peer {peer_id} sent more than the {metadata['nbytes']} bytes it announced")
                    await loop.run_in_executor(None, out.write, chunk)
                    self._download_progress.value = received / metadata["nbytes"]
                await loop.run_in_executor(None, out.flush)
                await loop.run_in_executor(None, os.fsync, out.fileno())
            if metadata is None:
                raise RuntimeError(f"peer {peer_id} has no such file to share")
            if received != metadata["nbytes"]:
                raise RuntimeError(f"peer {peer_id} sent {received} of {metadata['nbytes']} bytes")
            if not future.done():
                future.set_result(metadata)
        except BaseException as e:
            Path(destination).unlink(missing_ok=True)
            if not future.done() and isinstance(e, TooSlow):
                future.set_exception(TooSlow(f"download from {peer_id}: {e}"))
            elif not future.done():
                future.set_exception(RuntimeError(f"download from {peer_id} failed: {e!r}"))
            if not isinstance(e, Exception):
                raise
