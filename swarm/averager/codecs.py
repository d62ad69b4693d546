"""Pseudo-gradient codecs below FP16 on hivemind's wire, with error feedback; and the codec of every compression.

``fp4`` (``swarm.averager.fp4``) and ``sparse`` (``swarm.averager.sparse``) are used with error feedback
(``apply_error_feedback``): the peer adds what it did not send last time (its residual, fp32) to the new
pseudo-gradient, sends the quantized sum, and keeps the difference. Every level is a power of two of the value's
own sign, at most twice its magnitude and a multiple of its last binary digit, so ``sent + new residual == input +
old residual`` holds exactly in fp32. The host quantizes (and keeps the residual); the averager then encodes values
that are already on the grid, losslessly, so what goes on the wire is exactly what the residual accounts for.

The codecs ride in hivemind's fixed ``CompressionType`` enum by taking over two values no peer of ours uses
(hivemind's 8-bit codecs fail on NumPy 2): ``QUANTILE_8BIT`` carries fp4, ``UNIFORM_8BIT`` carries sparse. Importing
this module registers them, so every process of a peer decodes them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    ScaledFloat16Compression,
)
from hivemind.compression import serialization as _serialization
from hivemind.proto import runtime_pb2

from swarm.averager.fp4 import fp4_decode, fp4_encode, fp4_quantize
from swarm.averager.sparse import sparse_decode, sparse_encode, sparse_encode_average, sparse_quantize
from swarm.manifest import Compression

SLICE = 1 << 20  # values quantized at a time: a multiple of both block sizes, and the size of an all-reduce part


# ---- error feedback ----------------------------------------------------------------------------


def quantizer(compression: Compression) -> Callable[[torch.Tensor], torch.Tensor]:
    """The values ``compression`` sends nearest to a flat float32 tensor, for the codecs with error feedback."""
    match compression:
        case Compression.fp4:
            return fp4_quantize
        case Compression.sparse:
            return sparse_quantize
    raise ValueError(f"{compression} keeps no residual: it has no error feedback")


def apply_error_feedback(
    pseudo_gradients: Sequence[torch.Tensor], residuals: Sequence[torch.Tensor], compression: Compression
) -> None:
    """In place: ``y = pseudo + residual``; ``pseudo <- quantize(y)`` (what will be sent);
    ``residual <- y - quantize(y)`` (kept for next time). Exact in fp32. Slices of ``SLICE`` values line up
    with the averager's parts, so its blocks and chunks are the ones quantized here."""
    quantize = quantizer(Compression(compression))
    with torch.no_grad():
        for grad, residual in zip(pseudo_gradients, residuals):
            flat_g, flat_r = grad.view(-1), residual.view(-1)
            for start in range(0, flat_g.numel(), SLICE):
                g, r = flat_g[start : start + SLICE], flat_r[start : start + SLICE]
                r.add_(g)  # y
                sent = quantize(r)
                g.copy_(sent)
                r.sub_(sent)


# ---- hivemind's side ---------------------------------------------------------------------------


class Fp4Codec(CompressionBase):
    compression_type = runtime_pb2.CompressionType.QUANTILE_8BIT

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        flat = tensor.detach().reshape(-1).to(torch.float32)
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=fp4_encode(flat),
            size=tensor.shape,
            dtype="float32",
            requires_grad=False,
        )

    def extract(self, serialized: runtime_pb2.Tensor) -> torch.Tensor:
        shape = tuple(serialized.size)
        return fp4_decode(serialized.buffer, math.prod(shape)).view(shape)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 0.125  # hivemind cuts parts of 2**19 / (4 * this) = SLICE values: whole blocks, as quantized


class SparseCodec(CompressionBase):
    """Senders' parts are already on the sparse grid; ``compress_average`` encodes a reducer's average."""

    compression_type = runtime_pb2.CompressionType.UNIFORM_8BIT
    MAX_SENDERS = 8

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        return self._message(tensor, sparse_encode(tensor.detach().reshape(-1).to(torch.float32)))

    def compress_average(self, tensor: torch.Tensor) -> runtime_pb2.Tensor:
        return self._message(tensor, sparse_encode_average(tensor.detach().reshape(-1).to(torch.float32)))

    def _message(self, tensor: torch.Tensor, buffer: bytes) -> runtime_pb2.Tensor:
        return runtime_pb2.Tensor(
            compression=self.compression_type, buffer=buffer, size=tensor.shape, dtype="float32", requires_grad=False
        )

    def extract(self, serialized: runtime_pb2.Tensor) -> torch.Tensor:
        shape = tuple(serialized.size)
        return sparse_decode(serialized.buffer, math.prod(shape)).view(shape)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        # parts of SLICE values (whole chunks, as quantized): a group of MAX_SENDERS's average of one is under
        # SLICE / SPARSE_CHUNK * (2 + SPARSE_K * MAX_SENDERS * 2.5) bytes = 320 KiB, one p2pd message
        return 0.125


FP4, SPARSE = Fp4Codec(), SparseCodec()
CODECS = {Compression.fp4: FP4, Compression.sparse: SPARSE}  # ours (a StrEnum key: CODECS["fp4"] works too)
_serialization._BASE_COMPRESSION_TYPES["QUANTILE_8BIT"] = FP4
_serialization._BASE_COMPRESSION_TYPES["UNIFORM_8BIT"] = SPARSE


def codec(compression: Compression) -> CompressionBase:
    """The object that encodes and decodes ``compression`` on the wire (hivemind's, or one of ours)."""
    match Compression(compression):
        case Compression.none:
            return NoCompression()
        case Compression.fp16:
            return Float16Compression()
        case Compression.scaled_fp16:
            return ScaledFloat16Compression()
        case Compression.fp4:
            return FP4
        case Compression.sparse:
            return SPARSE
    raise ValueError(f"no codec for {compression!r}")
