"""The pseudo-gradient codecs: exact error feedback, deterministic bytes, sizes, refusal of malformed parts."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor

from swarm.averager import fp4
from swarm.averager.codecs import CODECS, apply_error_feedback
from swarm.averager.fp4 import FP4_BLOCK, fp4_decode, fp4_encode, fp4_quantize
from swarm.averager.sparse import (
    SPARSE_CHUNK,
    SPARSE_K,
    sparse_decode,
    sparse_encode,
    sparse_encode_average,
    sparse_quantize,
)


def samples(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = 3 * FP4_BLOCK + 77  # blocks and chunks that do not divide the size
    normal = torch.randn(n, generator=g) * 1e-3
    heavy = torch.randn(n, generator=g) ** 5 * 1e-2  # heavy tails: a few huge values per block
    sparse_ish = torch.where(torch.rand(n, generator=g) < 0.9, torch.zeros(n), torch.randn(n, generator=g))
    tiny = torch.randn(n, generator=g) * 1e-38  # subnormal territory
    mixed = torch.cat([torch.zeros(FP4_BLOCK), torch.randn(n, generator=g) * 30, torch.tensor([1e-30, -(2.0**-126)])])
    return [normal, heavy, sparse_ish, tiny, mixed, torch.zeros(5), torch.tensor([0.75, -1.5, 3.0, -6.0])]


@pytest.mark.parametrize("codec", ["fp4", "sparse"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_what_is_sent_plus_the_new_residual_is_the_input_plus_the_old_residual_exactly(codec, seed):
    for x in samples(seed):
        old = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 100)) * x.abs().max().clamp(min=1e-30)
        sent, residual = x.clone(), old.clone()
        apply_error_feedback([sent], [residual], codec)
        assert torch.equal(sent + residual, x + old), codec  # bitwise, in fp32
        assert torch.isfinite(sent).all() and torch.isfinite(residual).all()


def test_fp4_values_are_signed_powers_of_two_within_a_factor_of_two_and_bytes_are_exact():
    x = samples(0)[1]
    q = fp4_quantize(x)
    nonzero = q != 0
    mantissa, _ = torch.frexp(q[nonzero].abs())
    assert torch.all(mantissa == 0.5)  # powers of two
    assert torch.all(torch.sign(q[nonzero]) == torch.sign(x[nonzero]))
    assert torch.all(q[nonzero].abs() <= 2 * x[nonzero].abs())
    encoded = fp4_encode(q)
    assert len(encoded) <= math.ceil(x.numel() / FP4_BLOCK) + math.ceil(x.numel() / 2)  # deflated or as it is
    assert torch.equal(fp4_decode(encoded, x.numel()), q)  # values on the grid go through losslessly
    assert fp4_encode(q) == encoded  # deterministic
    assert torch.equal(fp4_decode(fp4_encode(x), x.numel()), q)  # encoding quantizes the same way
    # relative error of the kept values: rounding to the nearest power of two, within a block's 2**6 range
    big = x.abs() > x.abs().max() / 32
    assert torch.all((q[big] - x[big]).abs() <= x[big].abs() / 3 + 1e-12)


def raw_fp4_size(numel: int) -> int:
    return math.ceil(numel / FP4_BLOCK) + math.ceil(numel / 2)


def test_fp4_deflates_a_pseudo_gradient_under_half_a_byte_and_sends_what_it_cannot_shrink_as_it_is():
    g = torch.Generator().manual_seed(7)
    n = 64 * FP4_BLOCK
    sent, residual = torch.zeros(n), torch.zeros(n)
    for _ in range(3):  # a few rounds of error feedback, as a peer sends them
        sent = torch.randn(n, generator=g) * (1 + 3 * torch.rand(n, generator=g) ** 8)
        apply_error_feedback([sent], [residual], "fp4")
    encoded = fp4_encode(sent)
    assert len(encoded) / n < 0.47  # the codes are far from uniform: deflate takes 7% or more off 0.501
    assert torch.equal(fp4_decode(encoded, n), sent)
    # a part deflate cannot shrink (a few values: deflate's own framing outweighs them) goes as it is
    for few in (torch.tensor([1.0, -2.0, 0.0, -8.0]), torch.tensor([2.0**-20])):
        encoded = fp4_encode(few)
        assert len(encoded) == raw_fp4_size(few.numel())
        assert torch.equal(fp4_decode(encoded, few.numel()), few)


def test_a_hostile_fp4_part_cannot_inflate_past_an_honest_ones_size():
    n = 4 * FP4_BLOCK
    size = raw_fp4_size(n)
    bomb = zlib.compressobj(9, zlib.DEFLATED, -15)
    bomb = bomb.compress(bytes(100 * size)) + bomb.flush()  # inflates to 100 times the size, from a few bytes
    assert len(bomb) < size
    with pytest.raises(ValueError, match="inflates"):
        fp4_decode(bomb, n)
    honest = fp4_encode(fp4_quantize(torch.randn(n, generator=torch.Generator().manual_seed(8))))
    assert len(honest) < size
    for bad in (honest + b"\x00", honest[:-1], b"\xff" * (size - 1), b"\x00" * (size + 1)):
        with pytest.raises(ValueError):
            fp4_decode(bad, n)


def test_sparse_keeps_at_most_k_per_chunk_with_two_magnitudes_and_costs_under_a_tenth_of_a_byte():
    x = torch.randn(5 * SPARSE_CHUNK + 100, generator=torch.Generator().manual_seed(3))
    q = sparse_quantize(x)
    chunks = torch.nn.functional.pad(q, (0, (-q.numel()) % SPARSE_CHUNK)).view(-1, SPARSE_CHUNK)
    assert int((chunks != 0).sum(dim=1).max()) == SPARSE_K
    for row in chunks:
        assert len(set(row[row != 0].abs().tolist())) <= 2
    kept = q != 0
    assert torch.all(q[kept].abs() <= 2 * x[kept].abs()) and torch.all(torch.sign(q[kept]) == torch.sign(x[kept]))
    xs = torch.nn.functional.pad(x, (0, (-x.numel()) % SPARSE_CHUNK)).view(-1, SPARSE_CHUNK).abs()
    for row_x, row_q in zip(xs, chunks):  # in each chunk the kept ones are the largest
        assert row_x[row_q != 0].min() >= row_x[row_q == 0].max()
    encoded = sparse_encode(q)
    assert torch.equal(sparse_decode(encoded, x.numel()), q) and sparse_encode(q) == encoded
    count, chunks_n = int(kept.sum()), chunks.shape[0]
    assert len(encoded) == 1 + 2 * chunks_n + 2 * chunks_n + 2 * count + math.ceil(count / 4)  # header, counts, ...
    full = sparse_encode(sparse_quantize(x[: 5 * SPARSE_CHUNK]))
    assert len(full) / (5 * SPARSE_CHUNK) < 0.04  # 146 bytes per 4096 values
    with pytest.raises(ValueError, match="grid"):
        sparse_encode(x)  # a sender's values must already be quantized


def test_a_reducers_sparse_average_keeps_the_union_of_indices():
    g = torch.Generator().manual_seed(4)
    senders = [sparse_quantize(torch.randn(2 * SPARSE_CHUNK, generator=g)) for _ in range(3)]
    average = sum(senders) / 3
    encoded = sparse_encode_average(average)
    decoded = sparse_decode(encoded, average.numel())
    assert torch.equal(decoded != 0, average != 0)
    assert torch.equal(decoded, fp4_quantize_rows(average))
    assert len(encoded) < 3 * len(sparse_encode(senders[0])) * 1.3


def fp4_quantize_rows(values: torch.Tensor) -> torch.Tensor:
    """FP4 on sparse-chunk rows: what the average format keeps of the nonzeros."""
    rows = values.view(-1, SPARSE_CHUNK)
    t = fp4._block_exponents(rows)
    return fp4._fp4_from_codes(fp4._fp4_codes(rows, t), t.numpy()).view(-1)


@pytest.mark.parametrize("name", ["fp4", "sparse"])
def test_the_codecs_ride_in_hiveminds_wire_enum(name):
    codec = CODECS[name]
    part = (fp4_quantize if name == "fp4" else sparse_quantize)(torch.randn(3000) * 0.01).view(30, 100)
    message = serialize_torch_tensor(part, codec.compression_type)
    assert message.compression == codec.compression_type
    assert torch.equal(deserialize_torch_tensor(message), part)


def test_malformed_parts_are_refused():
    q = fp4_quantize(torch.randn(2000))
    good = fp4_encode(q)
    with pytest.raises(ValueError):
        fp4_decode(good[:-1], 2000)
    with pytest.raises(ValueError):
        fp4_decode(good, 2001)
    x = torch.randn(SPARSE_CHUNK)
    x[-1] = 100.0  # surely among the top k: a part cut short of it is named past its end
    sparse = sparse_encode(sparse_quantize(x))
    for bad in (b"", b"\x07" + sparse[1:], sparse[:-3], sparse + b"\x00"):
        with pytest.raises(ValueError):
            sparse_decode(bad, SPARSE_CHUNK)
    with pytest.raises(ValueError):
        sparse_decode(sparse, SPARSE_CHUNK - 100)  # names values past the end


def test_scales_no_encoder_sends_are_refused_rather_than_decoded_to_infinities_or_huge_values():
    # fp4, sent raw (a part as long as its raw size is not inflated): 2 block scales, then 4-bit codes
    numel = 2 * fp4.FP4_BLOCK

    def fp4_part(scales: list[int], code: int) -> bytes:
        return np.array(scales, dtype=np.int8).tobytes() + bytes([code | (code << 4)]) * (numel // 2)

    honest = fp4_decode(fp4_part([-3, 0], 7), numel)  # top level everywhere: +2**t
    assert torch.equal(honest, torch.tensor([2.0**-3] * fp4.FP4_BLOCK + [1.0] * fp4.FP4_BLOCK))
    assert torch.equal(fp4_decode(fp4_part([fp4.ZERO_EXPONENT] * 2, 0), numel), torch.zeros(numel))
    # a block marked zero that holds values decodes (unchecked) to -inf or huge magnitudes; a scale below the
    # smallest an encoder sends wraps around the same way
    for scales, code in (([fp4.ZERO_EXPONENT, 0], 7), ([fp4.ZERO_EXPONENT, 0], 1), ([-125, 0], 7)):
        with pytest.raises(ValueError):
            fp4_decode(fp4_part(scales, code), numel)
    assert fp4.MIN_EXPONENT - 1 > fp4.ZERO_EXPONENT  # the refused range is not empty
    # sparse: a reducer's average carries one fp4 scale per chunk after its first byte
    x = torch.randn(2 * SPARSE_CHUNK)
    average = bytearray(sparse_encode_average(fp4_quantize(sparse_quantize(x))))
    assert torch.isfinite(sparse_decode(bytes(average), x.numel())).all()
    for scale in (fp4.ZERO_EXPONENT, -125):
        bad = bytearray(average)
        bad[1] = scale & 0xFF
        with pytest.raises(ValueError):
            sparse_decode(bytes(bad), x.numel())
    # a sender's part: per chunk an exponent a and a gap j; the upper level 2**(a + j) past 2**127 is inf
    sender = bytearray(sparse_encode(sparse_quantize(x)))
    bad = bytearray(sender)
    bad[1], bad[2] = 120, 10
    with pytest.raises(ValueError):
        sparse_decode(bytes(bad), x.numel())


@pytest.mark.parametrize("exponent", [fp4.MIN_EXPONENT - 2, fp4.MIN_EXPONENT - 1, fp4.MIN_EXPONENT, -3, 120])
def test_quantized_fp4_values_encode_losslessly_at_every_scale(exponent):
    # the averager encodes what the host quantized, and the residual counts on it being sent whole; a row's largest
    # value rounds down to half its scale, which must not fall under the cut to zero (it once did near 2**-121)
    g = torch.Generator().manual_seed(exponent + 200)
    for mantissa in (1.0, 1.2, 1.49, 1.5, 1.99):
        x = torch.randn(3000, generator=g)
        x = x / x.abs().max() * mantissa * 2.0**exponent
        q = fp4_quantize(x)
        assert torch.equal(fp4_decode(fp4_encode(q), q.numel()).view(torch.int32), q.view(torch.int32))
        assert torch.equal(fp4_quantize(q), q)
