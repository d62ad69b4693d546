"""Pseudo-gradient codecs below FP16, with error feedback.

``fp4``: FP4 E3M0 as Streaming DiLoCo sends it. Each block of 1024 values gets a
power-of-two scale ``top`` (one signed byte, its exponent) at or above the block's
largest magnitude; each value becomes 4 bits: a sign and one of seven magnitudes
``top * 2**-6 .. top``, or zero: 0.501 bytes per value. The codes then go through raw
deflate (zlib level 1, about 13 ms per million values): they are far from uniform (a
block's top levels and its zeros are rare), so a pseudo-gradient takes about 0.44 bytes
per value. A part deflate cannot shrink is sent as it is; its size tells which.

``sparse``: SparseLoCo-like. In each chunk of 4096 values the k largest magnitudes
(64 by default) are sent, each as a 16-bit index and 2 bits: a sign and one of two
power-of-two magnitudes the chunk names in a 2-byte header. The rest are not sent.
0.036 bytes per value at k = 64. A reducer's average has the union of the senders'
indices, sent with FP4 values: about n times the size of one message for n senders.

Both are used with error feedback (``apply_error_feedback``): the peer adds what it
did not send last time (its residual, fp32) to the new pseudo-gradient, sends the
quantized sum, and keeps the difference. Every level is a power of two of the
value's own sign, at most twice its magnitude and a multiple of its last binary
digit, so ``sent + new residual == input + old residual`` holds exactly in fp32.
The host quantizes (and keeps the residual); the averager then encodes values that
are already on the grid, losslessly, so what goes on the wire is exactly what the
residual accounts for.

The codecs ride in hivemind's fixed ``CompressionType`` enum by taking over two
values no peer of ours uses (hivemind's 8-bit codecs fail on NumPy 2):
``QUANTILE_8BIT`` carries fp4, ``UNIFORM_8BIT`` carries sparse. Importing this
module registers them, so every process of a peer decodes them.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence

import numpy as np
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

from swarm.manifest import Compression

FP4_BLOCK = 1024
SPARSE_CHUNK = 4096
SPARSE_K = 64
FP4_LEVELS = 6  # magnitudes top * 2**-6 .. top
FP4_DEFLATE_LEVEL = 1  # level 6 saves under 1% more here, at up to several times the time on some inputs
ZERO_EXPONENT = -128  # a block of zeros
_SENDER, _AVERAGE = 2, 3  # the sparse buffer's first byte


# ---- FP4 E3M0 ---------------------------------------------------------------------------------


MIN_EXPONENT = -120  # a block whose largest magnitude is below 0.75 * 2**-120 is sent as zeros (kept in the residual)
SLICE = 1 << 20  # values quantized at a time: a multiple of both block sizes, and the size of an all-reduce part

# The codecs work on the float32 bits: a value is (-1)**s * 1.m * 2**(e - 127), so the nearest power of two is
# 2**(e - 127), or twice that when the mantissa's top bit is set (1.m >= 1.5). A few integer passes instead of
# frexp/ldexp keep error feedback at a few nanoseconds per value.


def _block_exponents(blocks: torch.Tensor) -> torch.Tensor:
    """Per row, the exponent ``t`` of the smallest power of two at or above the row's largest magnitude."""
    absmax = blocks.abs().amax(dim=1)
    bits = absmax.view(torch.int32)
    t = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    if bool((t > 127).any()):
        raise ValueError("a value of 2**127 or more cannot be a pseudo-gradient")
    # kept from 0.75 * 2**MIN_EXPONENT up: such a row's largest value quantizes to 2**MIN_EXPONENT or more, so its
    # quantized values are kept again when encoded (a cut at 2**(MIN_EXPONENT - 1) zeroed those that round down)
    keep = absmax >= 0.75 * 2.0**MIN_EXPONENT
    return torch.where(keep, t, torch.full_like(t, ZERO_EXPONENT))


def _rows(flat: torch.Tensor, width: int) -> torch.Tensor:
    pad = (-flat.numel()) % width
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, width)


def _fp4_codes(blocks: torch.Tensor, t: torch.Tensor) -> np.ndarray:
    """Each value's 4-bit code (uint8, [rows, n]): its level L in [-6, 0] as L + 7 and its sign as bit 3, or 0 for
    zero, in 16-bit numpy passes (several times faster than torch's int32 here)."""
    bits = blocks.numpy().view(np.int32)
    x = (bits >> 22).astype(np.int16) & 0x1FF  # biased exponent and the mantissa's top bit
    top = (t.numpy().astype(np.int16) + 127)[:, None]
    level = (x >> 1) + (x & 1) - top  # the nearest power of two, relative to the row's top
    keep = (level >= -FP4_LEVELS) & ((x >> 1) > 0) & (top != ZERO_EXPONENT + 127)
    codes = np.where(keep, level + 7, 0).astype(np.uint8)
    codes |= (keep & (bits < 0)).astype(np.uint8) << 3
    return codes


def _fp4_from_codes(codes: np.ndarray, t: np.ndarray) -> torch.Tensor:
    """Values of ``codes`` ([rows, n]) under row scales ``2**t``: a 16-entry table times the row's scale, exact
    (every product is a power of two between 2**-126 and 2**127)."""
    scale = np.ldexp(np.float32(1.0), t.astype(np.int32)).astype(np.float32)
    values = _FP4_TABLE[codes]
    values *= scale[:, None]
    return torch.from_numpy(values)


_codes = np.arange(16)
_FP4_TABLE = np.where((_codes & 7) > 0, np.ldexp(np.where(_codes & 8, -1.0, 1.0), (_codes & 7) - 7), 0.0)
_FP4_TABLE = _FP4_TABLE.astype(np.float32)  # code -> value at scale 1 (+0.0 for both zero codes)


def fp4_quantize(flat: torch.Tensor) -> torch.Tensor:
    """The values fp4 can send nearest to ``flat`` (float32, 1-D)."""
    blocks = _rows(flat, FP4_BLOCK)
    t = _block_exponents(blocks)
    return _fp4_from_codes(_fp4_codes(blocks, t), t.numpy()).view(-1)[: flat.numel()]


def fp4_raw(t: torch.Tensor, codes: np.ndarray, numel: int) -> bytes:
    """An fp4 part before deflate: one scale byte per block, then the first ``numel`` codes, two to a byte."""
    codes = codes.reshape(-1)[:numel]
    if codes.size % 2:
        codes = np.append(codes, np.uint8(0))
    return t.to(torch.int8).numpy().tobytes() + (codes[0::2] | (codes[1::2] << 4)).tobytes()


def fp4_encode(flat: torch.Tensor) -> bytes:
    blocks = _rows(flat, FP4_BLOCK)
    t = _block_exponents(blocks)
    raw = fp4_raw(t, _fp4_codes(blocks, t), flat.numel())
    # raw deflate (no header, no checksum), Huffman codes alone: 4-bit codes have few repeats worth matching, so
    # the matcher cost most of the time for nothing (measured: a third of the time, and 1% smaller)
    deflate = zlib.compressobj(FP4_DEFLATE_LEVEL, zlib.DEFLATED, -15, 8, zlib.Z_HUFFMAN_ONLY)
    squeezed = deflate.compress(raw) + deflate.flush()
    return squeezed if len(squeezed) < len(raw) else raw


def _fp4_inflate(buffer: bytes, size: int) -> bytes:
    """The raw bytes of an fp4 part of ``size`` bytes: ``buffer`` itself, or what it inflates to. Never more than
    ``size`` bytes are inflated, so a hostile part cannot make a peer allocate more than an honest one."""
    if len(buffer) == size:
        return buffer
    if len(buffer) > size:
        raise ValueError(f"an fp4 part of {size} bytes has {len(buffer)}")
    inflate = zlib.decompressobj(-15)
    try:
        raw = inflate.decompress(buffer, size)
    except zlib.error as e:
        raise ValueError(f"an fp4 part does not inflate: {e}") from None
    if len(raw) != size or not inflate.eof or inflate.unconsumed_tail or inflate.unused_data:
        raise ValueError(f"an fp4 part inflates to {len(raw)} bytes, not {size}")
    return raw


def fp4_decode(buffer: bytes, numel: int) -> torch.Tensor:
    nblocks = math.ceil(numel / FP4_BLOCK)
    raw = np.frombuffer(_fp4_inflate(bytes(buffer), nblocks + math.ceil(numel / 2)), dtype=np.uint8)
    t = raw[:nblocks].view(np.int8)
    packed = raw[nblocks:]
    codes = np.zeros((nblocks, FP4_BLOCK), dtype=np.uint8)  # the last row's tail stays zero
    pairs = np.empty((packed.size, 2), dtype=np.uint8)
    pairs[:, 0], pairs[:, 1] = packed & 0x0F, packed >> 4
    codes.reshape(-1)[:numel] = pairs.reshape(-1)[:numel]
    _check_fp4_scales(torch.from_numpy(t.astype(np.int32)), lambda rows: torch.from_numpy(codes[rows.numpy()] & 7))
    return _fp4_from_codes(codes, t).view(-1)[:numel].clone()


def _check_fp4_scales(t: torch.Tensor, codes_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Refuse scales no encoder sends (``t`` per row; ``codes_of(rows)``: those rows' level codes, 0 for zero): a
    row marked zero that holds values, or a scale below ``MIN_EXPONENT``, would decode to infinities, NaNs or huge
    finite values (the exponent's bits wrap around)."""
    if bool(((t < MIN_EXPONENT) & (t != ZERO_EXPONENT)).any()):
        raise ValueError(f"an fp4 part has a block scale below 2**{MIN_EXPONENT}, which no encoder sends")
    zero = t == ZERO_EXPONENT
    if bool(zero.any()) and bool((codes_of(zero) > 0).any()):
        raise ValueError("an fp4 part has values in a block marked zero")


# ---- sparse: top-k with two power-of-two magnitudes ----------------------------------------------


def _sparse_select(chunks: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mask of the sent entries, level a exponent, level b exponent, the decoded values), per chunk row."""
    magnitude = chunks.abs()
    k = min(k, chunks.shape[1])
    top, _ = magnitude.topk(k, dim=1)
    threshold = top[:, -1:]
    absmax = top[:, :1]
    # values 2**-20 below the chunk's largest are never worth a level (and keep the residual exact)
    floor = torch.ldexp(absmax, torch.full_like(absmax, -20.0))
    selected = (magnitude >= threshold) & (magnitude > 0) & (magnitude >= floor)
    selected &= torch.cumsum(selected.to(torch.int32), dim=1) <= k  # ties at the threshold: the first k
    smallest = torch.where(selected, magnitude, torch.full_like(magnitude, float("inf"))).amin(dim=1)
    _, e_small = torch.frexp(torch.where(torch.isfinite(smallest), smallest, torch.ones_like(smallest)))
    a = e_small - 1  # 2**a <= every selected magnitude
    median = torch.where(selected, magnitude, torch.zeros_like(magnitude)).sum(dim=1) / selected.sum(dim=1).clamp(min=1)
    _, e_mid = torch.frexp(torch.where(median > 0, median, torch.ones_like(median)))
    b = torch.maximum(e_mid - 1, a + 1)  # the upper level: about the selected values' mean
    lo = torch.ldexp(torch.ones_like(magnitude), a.unsqueeze(1).to(torch.float32))
    hi = torch.ldexp(torch.ones_like(magnitude), b.unsqueeze(1).to(torch.float32))
    use_hi = (hi <= 2 * magnitude) & ((hi - magnitude).abs() < (magnitude - lo).abs())
    value = torch.where(use_hi, hi, lo)
    value = torch.where(selected, torch.where(chunks < 0, -value, value), torch.zeros_like(value))
    return selected, a, b, value


def sparse_quantize(flat: torch.Tensor, k: int = SPARSE_K) -> torch.Tensor:
    chunks = _rows(flat, SPARSE_CHUNK)
    return _sparse_select(chunks, k)[3].view(-1)[: flat.numel()]


def sparse_encode(flat: torch.Tensor) -> bytes:
    """A sender's values, already on the sparse grid (``sparse_quantize``): their nonzeros, losslessly."""
    chunks = _rows(flat, SPARSE_CHUNK)
    nonzero = chunks != 0
    magnitude = chunks.abs()
    inf = torch.full_like(magnitude, float("inf"))
    lo = torch.where(nonzero, magnitude, inf).amin(dim=1)
    hi = torch.where(nonzero, magnitude, torch.zeros_like(magnitude)).amax(dim=1)
    _, e_lo = torch.frexp(torch.where(torch.isfinite(lo), lo, torch.ones_like(lo)))
    _, e_hi = torch.frexp(torch.where(hi > 0, hi, torch.ones_like(hi)))
    a, j = e_lo - 1, (e_hi - e_lo).clamp(min=0)
    level_a = torch.ldexp(torch.ones(1), a.unsqueeze(1).to(torch.float32))
    level_b = torch.ldexp(torch.ones(1), (a + j).unsqueeze(1).to(torch.float32))
    if not bool(((magnitude == level_a) | (magnitude == level_b) | ~nonzero).all()):
        raise ValueError("sparse_encode needs values already on the sparse grid (sparse_quantize)")
    counts = nonzero.sum(dim=1)
    rows, cols = nonzero.nonzero(as_tuple=True)
    upper = magnitude[rows, cols] > level_a[rows, 0]
    codes = ((chunks[rows, cols] < 0).to(torch.uint8) << 1) | upper.to(torch.uint8)
    header = np.stack([a.to(torch.int8).numpy().view(np.uint8), j.to(torch.uint8).numpy()], axis=1).reshape(-1)
    return (
        bytes([_SENDER])
        + header.tobytes()
        + counts.to(torch.int32).numpy().astype("<u2").tobytes()
        + cols.to(torch.int32).numpy().astype("<u2").tobytes()
        + _pack(codes.numpy(), 2)
    )


def sparse_encode_average(flat: torch.Tensor) -> bytes:
    """A reducer's average: every nonzero (the senders' union), each an FP4 value on its chunk's scale."""
    chunks = _rows(flat, SPARSE_CHUNK)
    nonzero = chunks != 0
    counts = nonzero.sum(dim=1)
    t = _block_exponents(chunks)
    rows, cols = nonzero.nonzero(as_tuple=True)
    codes = _fp4_codes(chunks, t)[rows.numpy(), cols.numpy()]
    return (
        bytes([_AVERAGE])
        + t.to(torch.int8).numpy().tobytes()
        + counts.to(torch.int32).numpy().astype("<u2").tobytes()
        + cols.to(torch.int32).numpy().astype("<u2").tobytes()
        + _pack(codes, 4)
    )


def sparse_decode(buffer: bytes, numel: int) -> torch.Tensor:
    raw = np.frombuffer(buffer, dtype=np.uint8)
    nchunks = math.ceil(numel / SPARSE_CHUNK)
    if raw.size < 1:
        raise ValueError("an empty sparse part")
    kind, body = raw[0], raw[1:]
    header_bytes = 2 * nchunks if kind == _SENDER else nchunks
    if kind not in (_SENDER, _AVERAGE) or body.size < header_bytes + 2 * nchunks:
        raise ValueError("a sparse part with a malformed header")
    header, body = body[:header_bytes], body[header_bytes:]
    counts = body[: 2 * nchunks].view("<u2").astype(np.int64)
    total = int(counts.sum())
    bits = 2 if kind == _SENDER else 4
    if np.any(counts > SPARSE_CHUNK) or body.size != 2 * nchunks + 2 * total + math.ceil(total * bits / 8):
        raise ValueError(f"a sparse part of {numel} values has {raw.size} bytes for {total} entries")
    cols = body[2 * nchunks : 2 * nchunks + 2 * total].view("<u2").astype(np.int64)
    codes = _unpack(body[2 * nchunks + 2 * total :], bits, total)
    rows = np.repeat(np.arange(nchunks), counts)
    if np.any(cols >= SPARSE_CHUNK) or np.any(rows * SPARSE_CHUNK + cols >= numel):
        raise ValueError("a sparse part names a value outside the part")
    out = torch.zeros(nchunks * SPARSE_CHUNK)
    rows_t, cols_t, codes_t = torch.from_numpy(rows), torch.from_numpy(cols), torch.from_numpy(codes.astype(np.int64))
    if kind == _SENDER:
        a = torch.from_numpy(header[0::2].view(np.int8).astype(np.float32))
        j = torch.from_numpy(header[1::2].astype(np.float32))
        exponent = a[rows_t] + j[rows_t] * (codes_t & 1)
        if bool((exponent > 127).any()):  # 2**128 is inf in float32: no encoder sends it
            raise ValueError("a sparse part names a magnitude of 2**128 or more")
        value = torch.ldexp(torch.ones_like(exponent), exponent)
        value = torch.where((codes_t & 2) > 0, -value, value)
    else:
        t = header.view(np.int8)[rows]
        _check_fp4_scales(torch.from_numpy(t.astype(np.int32)), lambda rows: codes_t[rows] & 7)
        value = _fp4_from_codes(codes.reshape(-1, 1), t).view(-1)
    out[rows_t * SPARSE_CHUNK + cols_t] = value.to(torch.float32)
    return out[:numel]


def _pack(codes: np.ndarray, bits: int) -> bytes:
    per = 8 // bits
    codes = codes.astype(np.uint8)
    if codes.size % per:
        codes = np.append(codes, np.zeros(per - codes.size % per, dtype=np.uint8))
    packed = np.zeros(codes.size // per, dtype=np.uint8)
    for i in range(per):
        packed |= codes[i::per] << (bits * i)
    return packed.tobytes()


def _unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    per = 8 // bits
    mask = (1 << bits) - 1
    out = np.empty(packed.size * per, dtype=np.uint8)
    for i in range(per):
        out[i::per] = (packed >> (bits * i)) & mask
    return out[:count]


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
