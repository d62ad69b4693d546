"""The outer state on disk: one file per epoch, written and read without copying a tensor.

The layout is safetensors' (an 8-byte little-endian header length, a JSON header,
then the raw bytes), so any safetensors tool can open it: the global parameters
``param.NNNNN`` followed by their momentum ``momentum.NNNNN``, all float32. The
header's metadata says which run and epoch the state belongs to, the sha256 of the
parameters' and then the momentum's bytes (the checksum peers vote on) and a CRC32 of the momentum's, so
a damaged or forged file is refused before anything is loaded from it.

The same file is a checkpoint, what a donor streams to a joiner (as raw bytes),
and what the joiner receives: a downloaded state is checked exactly like a
checkpoint found on disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.errors import SwarmError

FORMAT = "swarm-outer-state-2"  # 2: the checksum covers the momentum too
logger = logging.getLogger(__name__)
MAX_HEADER_BYTES = 16 << 20
MAX_DIM = 1 << 40  # a tensor dimension past this is no model's: refused before any size is computed from it
_CRC_PLACEHOLDER = "crc32:" + "0" * 8
READ_CHUNK = 8 << 20


class StateFileError(SwarmError):
    """A state file that is damaged, belongs elsewhere, or does not match this model."""


@dataclass(frozen=True)
class StateHeader:
    run_id: str
    epoch: int
    checksum: str  # sha256 of the parameters' bytes, then the momentum's: what peers vote on
    momentum_crc32: str
    shapes: tuple[tuple[int, ...], ...]  # of the parameters; the momentum has the same
    data_start: int  # offset of the first tensor byte in the file
    params_bytes: int
    total_bytes: int  # the whole file

    @property
    def momentum_bytes(self) -> int:
        return self.total_bytes - self.data_start - self.params_bytes


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _raw(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous float32 CPU tensor, without a copy."""
    assert tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.is_contiguous()
    return memoryview(tensor.detach().numpy()).cast("B")


def _header_json(run_id: str, epoch: int, checksum: str, crc: str, shapes: Sequence[Sequence[int]]) -> bytes:
    header: dict = {}
    offset = 0
    for kind in ("param", "momentum"):
        for i, shape in enumerate(shapes):
            size = 4 * _numel(shape)
            header[f"{kind}.{i:05d}"] = dict(dtype="F32", shape=list(shape), data_offsets=[offset, offset + size])
            offset += size
    meta = dict(format=FORMAT, run_id=run_id, epoch=str(epoch), checksum=checksum, momentum_crc32=crc)
    header["__metadata__"] = meta
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes


def write(
    path: Path,
    *,
    run_id: str,
    epoch: int,
    checksum: str,
    params: Sequence[torch.Tensor],
    momentum: Sequence[torch.Tensor],
    durable: bool = True,
) -> int:
    """Write the state to ``path`` (no atomic rename here: the caller writes to a temporary name). Returns bytes.
    ``durable=False`` leaves the fsync to the caller (``make_durable``), who may hold a lock only while the bytes
    are copied out, not while the disk takes them."""
    header = _header_json(run_id, epoch, checksum, _CRC_PLACEHOLDER, [tuple(p.shape) for p in params])
    crc = 0
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for tensor in params:
            f.write(_raw(tensor))
        for tensor in momentum:
            raw = _raw(tensor)
            crc = zlib.crc32(raw, crc)
            f.write(raw)
        position = 8 + header.index(_CRC_PLACEHOLDER.encode())
        f.seek(position)
        f.write(f"crc32:{crc:08x}".encode())
        f.flush()
        if durable:
            os.fsync(f.fileno())
        return f.seek(0, os.SEEK_END)


def make_durable(path: Path) -> None:
    """fsync a file written with ``durable=False``: its bytes are on disk before it is renamed into place."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_header(path: Path, *, run_id: str | None = None, shapes: Sequence[Sequence[int]] | None = None) -> StateHeader:
    """Parse and check the header: the layout, and (when given) the run and the parameter shapes."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise StateFileError(f"{path.name} is too short to be a state file")
            (length,) = struct.unpack("<Q", prefix)
            if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
                raise StateFileError(f"{path.name} has no valid header")
            header = json.loads(f.read(length))
    except OSError as e:
        raise StateFileError(f"{path.name} cannot be read: {e.strerror}") from None
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: JSON nested past Python's stack
        raise StateFileError(f"{path.name} has a header that is not JSON") from None
    try:
        meta = header.pop("__metadata__")
        if meta.get("format") != FORMAT:
            raise StateFileError(f"{path.name} is not a swarm state file")
        n = len(header) // 2
        found = []
        offset = 0
        for kind in ("param", "momentum"):
            for i in range(n):
                entry = header[f"{kind}.{i:05d}"]
                shape = tuple(entry["shape"])
                if entry["dtype"] != "F32" or not all(type(d) is int and 0 <= d <= MAX_DIM for d in shape):
                    raise StateFileError(f"{path.name}: {kind}.{i:05d} is not a float32 tensor")
                if entry["data_offsets"] != [offset, offset + 4 * _numel(shape)]:
                    raise StateFileError(f"{path.name}: {kind}.{i:05d} is not where the layout puts it")
                offset += 4 * _numel(shape)
                if kind == "param":
                    found.append(shape)
                elif shape != found[i]:
                    raise StateFileError(f"{path.name}: momentum.{i:05d} does not match its parameter")
        result = StateHeader(
            run_id=str(meta["run_id"]),
            epoch=int(meta["epoch"]),
            checksum=str(meta["checksum"]),
            momentum_crc32=str(meta["momentum_crc32"]),
            shapes=tuple(found),
            data_start=8 + length,
            params_bytes=offset // 2,
            total_bytes=size,
        )
    except StateFileError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError, RecursionError):
        raise StateFileError(f"{path.name} has a malformed header") from None
    if len(header) != 2 * n or result.data_start + offset != size:
        raise StateFileError(f"{path.name} is truncated or has extra bytes ({size} bytes)")
    if result.epoch < 0:
        raise StateFileError(f"{path.name} claims a negative epoch")
    if run_id is not None and result.run_id != run_id:
        raise StateFileError(f"{path.name} belongs to run {result.run_id}, not {run_id}")
    if shapes is not None and [tuple(s) for s in shapes] != list(result.shapes):
        raise StateFileError(f"{path.name} holds tensors of other shapes than this run's model")
    return result


def _chunks(f, count: int) -> Iterator[bytes]:
    while count > 0:
        chunk = f.read(min(READ_CHUNK, count))
        if not chunk:
            raise StateFileError("the file ended early")
        count -= len(chunk)
        yield chunk


def verify(path: Path, header: StateHeader) -> None:
    """Recompute the sha256 of the parameters and the momentum (the checksum peers vote on) and the momentum's
    CRC32; raise if either differs from the header."""
    sha, crc = hashlib.sha256(), 0
    with open(path, "rb") as f:
        f.seek(header.data_start)
        for chunk in _chunks(f, header.params_bytes):
            sha.update(chunk)
        for chunk in _chunks(f, header.momentum_bytes):
            sha.update(chunk)
            crc = zlib.crc32(chunk, crc)
    if sha.hexdigest() != header.checksum:
        raise StateFileError(f"{path.name}: the parameters and momentum do not match their checksum")
    if f"crc32:{crc:08x}" != header.momentum_crc32:
        raise StateFileError(f"{path.name}: the momentum does not match its CRC32")


def load_into(path: Path, header: StateHeader, tensors: Sequence[torch.Tensor]) -> None:
    """Read params then momentum straight into ``tensors`` (float32, contiguous, CPU), in file order."""
    with open(path, "rb") as f:
        f.seek(header.data_start)
        for tensor in tensors:
            view = _raw(tensor)
            done = 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise StateFileError(f"{path.name} ended early")
                done += n


def check(path: Path, *, run_id: str, shapes: Sequence[Sequence[int]] | None = None) -> StateHeader:
    """``read_header`` then ``verify``: a state file fit to load."""
    header = read_header(path, run_id=run_id, shapes=shapes)
    verify(path, header)
    return header


# ---- the error-feedback residual: this peer's own, kept beside a state file, never served -------------

RESIDUAL_FORMAT = "swarm-residual-1"


def write_residual(
    path: Path, *, run_id: str, epoch: int, checksum: str, residual: Sequence[torch.Tensor], durable: bool = True
) -> int:
    """The residual that goes with the state of ``checksum`` (same layout; tensors ``residual.NNNNN``); ``durable``
    as for ``write``."""
    header: dict = {}
    offset = 0
    for i, tensor in enumerate(residual):
        size = 4 * tensor.numel()
        header[f"residual.{i:05d}"] = dict(dtype="F32", shape=list(tensor.shape), data_offsets=[offset, offset + size])
        offset += size
    crc = 0
    for tensor in residual:
        crc = zlib.crc32(_raw(tensor), crc)
    header["__metadata__"] = dict(
        format=RESIDUAL_FORMAT, run_id=run_id, epoch=str(epoch), checksum=checksum, crc32=f"{crc:08x}"
    )
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for tensor in residual:
            f.write(_raw(tensor))
        f.flush()
        if durable:
            os.fsync(f.fileno())
        return f.tell()


def load_residual(path: Path, *, run_id: str, checksum: str, residual: Sequence[torch.Tensor]) -> bool:
    """Read a residual saved with the state of ``checksum`` into ``residual``; False (and nothing changed)
    when there is none, it goes with another state, or it is damaged."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > MAX_HEADER_BYTES:
                return False
            header = json.loads(f.read(length))
            meta = header.pop("__metadata__")
            if (meta.get("format"), meta.get("run_id"), meta.get("checksum")) != (RESIDUAL_FORMAT, run_id, checksum):
                return False
            if [tuple(header[f"residual.{i:05d}"]["shape"]) for i in range(len(residual))] != [
                tuple(t.shape) for t in residual
            ] or len(header) != len(residual):
                return False
            data = f.read()
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ArithmeticError, RecursionError, struct.error):
        logger.debug("the residual file %s is unusable", path, exc_info=True)
        return False
    if len(data) != sum(4 * t.numel() for t in residual) or f"{zlib.crc32(data):08x}" != meta.get("crc32"):
        return False
    offset = 0
    for tensor in residual:
        n = 4 * tensor.numel()
        _raw(tensor)[:] = data[offset : offset + n]
        offset += n
    return True
