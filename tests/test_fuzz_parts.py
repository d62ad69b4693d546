"""Every parser of another machine's tensor bytes, fuzzed: a part at its reducer (``decode_part``), a reducer's
average at a groupmate (``admit`` then ``check_parts``), an update file (``read_update``), a state file's header
(``read_header``). Any input is either decoded within its bound or refused with the parser's own error, never an
uncaught exception; and the known oversized inputs raise a process's peak memory by less than 64 MB."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hivemind.averaging.allreduce import AllreduceException
from hivemind.compression import serialize_torch_tensor
from hivemind.proto import averaging_pb2, runtime_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.averager.allreduce import decode_part
from swarm.averager.bounds import OutOfBounds, admit, max_bytes
from swarm.averager.codecs import FP4, SPARSE
from swarm.averager.fp4 import fp4_quantize
from swarm.averager.held import Dropped, check_parts, decode_into
from swarm.averager.sparse import sparse_quantize
from swarm.averager.transfer import read_update, write_update
from swarm.defence.robust import RefusedPart
from swarm.state.file import FORMAT, StateFileError, read_header

CT = runtime_pb2.CompressionType
CODECS = [CT.NONE, CT.MEANSTD_16BIT, CT.FLOAT16, CT.QUANTILE_8BIT, CT.UNIFORM_8BIT]
NUMEL = 5000  # what the receiver expects of a part: a short one, so that the fuzzing is quick
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def honest(compression: int, numel: int = NUMEL, seed: int = 0) -> runtime_pb2.Tensor:
    values = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    if compression == CT.QUANTILE_8BIT:
        values = fp4_quantize(values)
    if compression == CT.UNIFORM_8BIT:
        values = sparse_quantize(values)
    return serialize_torch_tensor(values, compression)


@st.composite
def parts(draw) -> runtime_pb2.Tensor:
    """Honest parts with one thing changed, or anything at all."""
    compression = draw(st.sampled_from(CODECS))
    part = runtime_pb2.Tensor()
    part.CopyFrom(honest(compression, seed=draw(st.integers(0, 3))))
    for change in draw(st.lists(st.sampled_from(["size", "dtype", "compression", "buffer", "cut", "flip"]))):
        if change == "size":
            del part.size[:]
            part.size.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=4)))
        elif change == "dtype":
            part.dtype = draw(st.sampled_from(["float64", "float16", "complex128", "bfloat16", "object", "V9", "x"]))
        elif change == "compression":
            part.compression = draw(st.sampled_from(CODECS + [CT.BLOCKWISE_8BIT]))
        elif change == "buffer":
            part.buffer = draw(st.binary(max_size=4 * NUMEL + 64))
        elif change == "cut" and part.buffer:
            part.buffer = part.buffer[: draw(st.integers(0, len(part.buffer) - 1))]
        elif change == "flip" and part.buffer:
            data = bytearray(part.buffer)
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= draw(st.integers(1, 255))
            part.buffer = bytes(data)
    return part


@FUZZ
@given(parts())
def test_a_senders_part_is_decoded_to_the_expected_size_or_refused(part):
    for compression in {part.compression, CT.FLOAT16}:
        values, _, _ = decode_part(averaging_pb2.AveragingData(tensor_part=part, weight=1.0), NUMEL, compression)
        assert isinstance(values, RefusedPart) or values.numel() == NUMEL


@FUZZ
@given(st.lists(parts(), min_size=1, max_size=3), st.integers(0, 2 * NUMEL))
def test_an_average_is_written_whole_or_refused_before_anything_is_written(held, dropped):
    compression = held[0].compression
    tensor = torch.full((NUMEL * len(held),), 7.0)
    held = [*held, Dropped(dropped)] if dropped % 3 == 0 else held
    try:
        check_parts(tensor, held, compression)
    except AllreduceException:
        assert bool((tensor == 7.0).all())  # refused: untouched
        return
    decode_into(tensor, held)
    assert tensor.numel() == NUMEL * (len(held) - (dropped % 3 == 0))


@pytest.mark.parametrize("compression", CODECS)
def test_honest_parts_are_admitted_at_any_size_and_the_bound_is_tight_enough(compression):
    for numel in (1, 7, 1000, 4097, 1 << 20):
        part = honest(compression, numel)
        admit(part, numel, compression)
        assert len(part.buffer) <= max_bytes(compression, numel) <= 4 * numel + 8 + numel // 4 + 16
    average = SPARSE.compress_average(fp4_quantize(torch.randn(NUMEL)))  # a dense sparse average: the largest
    admit(average, NUMEL, CT.UNIFORM_8BIT)
    with pytest.raises(OutOfBounds):
        admit(honest(compression), NUMEL + 1, compression)


def update_file(tmp_path: Path, held) -> Path:
    path = tmp_path / "update"
    write_update(path, "ab" * 8, 3, held)
    return path


@FUZZ
@given(st.binary(max_size=512), st.integers(0, 400), st.integers(0, 255))
def test_an_update_file_from_another_machine_parses_or_is_refused_with_a_value_error(junk, at, xor):
    tmp = Path(__import__("tempfile").mkdtemp())
    path = update_file(tmp, [[honest(CT.FLOAT16, 100), Dropped(50)], [honest(CT.FLOAT16, 30)]])
    data = bytearray(path.read_bytes())
    data[at % len(data)] ^= xor
    for candidate in (bytes(data), junk, bytes(data[: at % len(data)]) + junk):
        path.write_bytes(candidate)
        try:
            held = read_update(path, "ab" * 8, 3, 2)
        except ValueError:
            continue
        tensors = [torch.zeros(150), torch.zeros(30)]
        try:
            for tensor, parts_ in zip(tensors, held):
                check_parts(tensor, parts_, CT.FLOAT16)
        except AllreduceException:
            continue


def state_file(tmp_path: Path, header: object, payload: bytes = b"") -> Path:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path = tmp_path / "state.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + payload)
    return path


def test_crafted_state_headers_are_refused_with_a_clear_error(tmp_path):
    meta = {"format": FORMAT, "run_id": "r", "epoch": 1, "checksum": "0" * 64, "momentum_crc32": "x"}
    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    crafted = [
        b"[" * 100_000 + b"]" * 100_000,  # nested past Python's recursion limit
        b'{"__metadata__": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        {"__metadata__": meta, "param.00000": {**entry, "shape": [1e400]}, "momentum.00000": entry},  # inf
        {"__metadata__": meta, "param.00000": {**entry, "shape": [2**62, 2**62]}, "momentum.00000": entry},
        {"__metadata__": meta, "param.00000": {**entry, "shape": [True, 2]}, "momentum.00000": entry},
        {"__metadata__": meta, "param.00000": {**entry, "shape": "ab"}, "momentum.00000": entry},
        {"__metadata__": [1, 2]},
        {"__metadata__": {**meta, "epoch": 1e400}, "param.00000": entry, "momentum.00000": entry},
        {"__metadata__": {**meta, "epoch": -1}, "param.00000": entry, "momentum.00000": entry},
    ]
    for header in crafted:
        with pytest.raises(StateFileError):
            read_header(state_file(tmp_path, header, b"\0" * 16))


JSON = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=30,
)


@FUZZ
@given(JSON)
def test_any_json_state_header_is_parsed_or_refused(header):
    tmp = Path(__import__("tempfile").mkdtemp())
    ours = {"format": FORMAT}
    for candidate in (header, {"__metadata__": header}, {"__metadata__": ours, "x": header}):
        try:
            read_header(state_file(tmp, candidate, b"\0" * 8))
        except StateFileError:
            pass


PEAK = """
import resource, sys, zlib, torch
from hivemind.compression import serialize_torch_tensor
from hivemind.proto import averaging_pb2, runtime_pb2
from swarm.averager.allreduce import decode_part
from swarm.averager.held import check_parts
from swarm.averager.fp4 import fp4_quantize
from swarm.averager.sparse import sparse_quantize
CT, NUMEL = runtime_pb2.CompressionType, 1 << 20
def part(compression, buffer, size, dtype="float32"):
    return runtime_pb2.Tensor(compression=compression, buffer=buffer, size=size, dtype=dtype)
honest = serialize_torch_tensor(sparse_quantize(torch.randn(NUMEL)), CT.UNIFORM_8BIT)
torch.zeros(NUMEL).add_(1)  # warm every path the honest decode takes
for compression in (CT.NONE, CT.FLOAT16, CT.QUANTILE_8BIT, CT.UNIFORM_8BIT):
    ok = serialize_torch_tensor(fp4_quantize(torch.randn(NUMEL)) if compression == CT.QUANTILE_8BIT else
                                sparse_quantize(torch.randn(NUMEL)) if compression == CT.UNIFORM_8BIT else
                                torch.randn(NUMEL), compression)
    decode_part(averaging_pb2.AveragingData(tensor_part=ok, weight=1.0), NUMEL, compression)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
zeros = deflate.compress(bytes(1 << 30)) + deflate.flush()  # fp4 of 1G bytes of zeros, deflated: about 1 MB
attacks = [
    part(CT.UNIFORM_8BIT, bytes([2]) + bytes(4 * 16384), [1 << 26]),  # 64 KB of empty chunks: 64M values
    part(CT.UNIFORM_8BIT, honest.buffer, [4096, 4096, 4096]),
    part(CT.QUANTILE_8BIT, zeros, [1 << 31]),
    part(CT.QUANTILE_8BIT, zeros, [NUMEL]),
    part(CT.FLOAT16, bytes(4 << 20), [NUMEL * 2], "complex256"),
    part(CT.FLOAT16, bytes(2 * NUMEL), [NUMEL], "complex256"),
    part(CT.NONE, bytes(4 << 20), [1 << 20], "float64"),
    part(CT.MEANSTD_16BIT, bytes(4 << 20), [2**32 - 1, 2**32 - 1]),
    part(CT.UNIFORM_8BIT, bytes([2]) + bytes(4 << 20), [NUMEL]),  # a sender's part of 4 MiB, counts of zero
]
refused = 0
for attack in attacks:
    values, _, _ = decode_part(averaging_pb2.AveragingData(tensor_part=attack, weight=1.0), NUMEL, attack.compression)
    refused += not isinstance(values, torch.Tensor)
    try:
        check_parts(torch.zeros(NUMEL), [attack], attack.compression)
    except Exception as e:
        assert type(e).__name__ == "AllreduceException", repr(e)
print(refused, len(attacks), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


def test_oversized_parts_raise_peak_memory_by_less_than_64_mb():
    out = subprocess.run([sys.executable, "-c", PEAK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    refused, attacks, peak_mib = out.stdout.split()
    assert refused == attacks, out.stdout  # each of them refused at its reducer
    assert float(peak_mib) < 64, f"peak memory rose by {float(peak_mib):.0f} MiB"


def test_fp4_and_sparse_decoders_refuse_more_entries_than_their_senders_send():
    numel = 4096
    values = sparse_quantize(torch.randn(numel))
    part = serialize_torch_tensor(values, CT.UNIFORM_8BIT)
    admit(part, numel, CT.UNIFORM_8BIT)
    # a sender's part naming every value of its chunk (an average may; a sender sends 64): refused
    dense = SPARSE.compress_average(fp4_quantize(torch.randn(numel)))
    forged = bytearray(dense.buffer)
    forged[0] = 2  # a sender's kind, with an average's entries
    with pytest.raises(ValueError):
        SPARSE.extract(runtime_pb2.Tensor(compression=CT.UNIFORM_8BIT, buffer=bytes(forged), size=[numel],
                                          dtype="float32"))  # fmt: skip
    assert math.isfinite(float(FP4.extract(honest(CT.QUANTILE_8BIT, numel)).sum()))


@pytest.mark.parametrize("compression", CODECS)
def test_an_honest_update_file_fits_its_download_bound_and_the_bound_is_near_the_codecs_size(tmp_path, compression):
    """``max_update_bytes`` bounds a round's update download by the run's codec (before: 4 bytes a parameter for
    every codec). An honest file of a model's tensors, cut into hivemind's parts (a dense sparse average: the
    largest), fits; for fp4 the bound is within 2% of half a byte a value."""
    from swarm.averager.bounds import max_update_bytes

    numels, part = [3, 4097, 300_000, 1 << 20], 1 << 17
    held = []
    for t, numel in enumerate(numels):
        cut = [min(part, numel - start) for start in range(0, numel, part)]
        parts = [honest(compression, n, seed=t) for n in cut]
        if compression == CT.UNIFORM_8BIT:
            parts = [SPARSE.compress_average(fp4_quantize(torch.randn(n))) for n in cut]
        held.append(parts)
    path = update_file(tmp_path, held)
    bound = max_update_bytes(compression, numels)
    assert path.stat().st_size <= bound
    if compression == CT.QUANTILE_8BIT:
        huge = [1 << 28]  # a large model's tensor: the header's MiB no longer counts
        assert max_update_bytes(compression, huge) <= 0.51 * huge[0]
    assert max_update_bytes(compression, numels) < 4 * sum(numels) + (1 << 20) + 64 * 40  # never looser than before
