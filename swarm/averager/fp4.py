"""FP4 E3M0 as Streaming DiLoCo sends it: the numerics (``swarm.averager.codecs`` puts it on the wire).

Each block of 1024 values gets a power-of-two scale ``top`` (one signed byte, its exponent) at or above the
block's largest magnitude; each value becomes 4 bits: a sign and one of seven magnitudes ``top * 2**-6 .. top``, or
zero: 0.501 bytes per value. The codes then go through raw deflate (zlib level 1, about 13 ms per million values):
they are far from uniform (a block's top levels and its zeros are rare), so a pseudo-gradient takes about 0.44
bytes per value. A part deflate cannot shrink is sent as it is; its size tells which. A decoder never inflates
more than an honest part's size, and refuses scales no encoder sends.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import numpy as np
import torch

FP4_BLOCK = 1024
FP4_LEVELS = 6  # magnitudes top * 2**-6 .. top
FP4_DEFLATE_LEVEL = 1  # level 6 saves under 1% more here, at up to several times the time on some inputs
ZERO_EXPONENT = -128  # a block of zeros


MIN_EXPONENT = -120  # a block whose largest magnitude is below 0.75 * 2**-120 is sent as zeros (kept in the residual)

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
