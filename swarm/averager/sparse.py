"""SparseLoCo-like top-k with two power-of-two magnitudes: the numerics (``swarm.averager.codecs`` puts it on the
wire).

In each chunk of 4096 values the k largest magnitudes (64 by default) are sent, each as a 16-bit index and 2 bits:
a sign and one of two power-of-two magnitudes the chunk names in a 2-byte header. The rest are not sent: 0.036
bytes per value at k = 64. A reducer's average has the union of the senders' indices, sent with FP4 values
(``swarm.averager.fp4``): about n times the size of one message for n senders.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from swarm.averager.fp4 import _block_exponents, _check_fp4_scales, _fp4_codes, _fp4_from_codes, _rows

SPARSE_CHUNK = 4096
SPARSE_K = 64
_SENDER, _AVERAGE = 2, 3  # the sparse buffer's first byte


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
    if np.any(
        counts > (SPARSE_K if kind == _SENDER else SPARSE_CHUNK)
    ) or body.size != 2 * nchunks + 2 * total + math.ceil(total * bits / 8):
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
