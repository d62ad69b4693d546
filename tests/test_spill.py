"""The parts kept for auditors live in an unlinked temporary file: read back bit for bit, per reducer, in order."""

from __future__ import annotations

import os

import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.proto import runtime_pb2

from swarm.averager.spill import SpilledParts


def part(seed: int, n: int = 1000) -> runtime_pb2.Tensor:
    torch.manual_seed(seed)
    return serialize_torch_tensor(torch.randn(n), runtime_pb2.CompressionType.FLOAT16)


def test_parts_come_back_bit_for_bit_per_reducer_in_the_order_they_were_sent():
    spill = SpilledParts()
    sent = {0: [part(1), part(2), part(3)], 2: [part(4), part(5, n=17)]}
    for i in range(3):  # interleaved, as streams to several reducers are
        for reducer, parts in sent.items():
            if i < len(parts):
                spill.append(reducer, parts[i])
    for reducer, parts in sent.items():
        got = spill.get(reducer)
        assert [p.SerializeToString() for p in got] == [p.SerializeToString() for p in parts]
    assert spill.get(1) is None  # never sent anything
    spill.start(1)
    assert spill.get(1) == []  # a stream begun, nothing sent yet


def test_the_bytes_are_in_a_file_with_no_name_and_it_is_closed_with_the_round():
    spill = SpilledParts()
    assert spill._file is None  # nothing sent: no file
    big = part(7, n=200_000)
    spill.append(0, big)
    fd = spill._file.fileno()
    assert os.fstat(fd).st_size == len(big.SerializeToString())
    assert os.fstat(fd).st_nlink == 0  # unlinked: nothing is left on disk if the process is killed
    spill.close()
    assert spill._file is None and spill.get(0) is None


def test_selected_parts_are_read_back_and_a_round_nobody_audits_writes_nothing():
    spill = SpilledParts()
    parts = [part(i) for i in range(4)]
    for p in parts:
        spill.append(3, p)
    assert spill.count(3) == 4 and spill.count(0) is None
    assert [p.SerializeToString() for p in spill.get(3, [2, 0])] == [parts[2].SerializeToString(),
                                                                     parts[0].SerializeToString()]  # fmt: skip
    off = SpilledParts(keep=False)  # audits off (``averaging.checked_reducers = false``)
    off.append(3, parts[0])
    assert off._file is None and off.get(3) == [] and off.count(3) == 0


def test_parts_are_served_one_at_a_time_and_a_closed_file_ends_the_stream():
    """A served audit stream holds one part read back, not a slice (``SpilledParts.each``); if its round's file is
    closed while it is served, the stream ends rather than fails."""
    from hivemind.proto import runtime_pb2

    from swarm.averager.spill import SpilledParts

    spill = SpilledParts()
    parts = [runtime_pb2.Tensor(buffer=bytes([i]) * 1000) for i in range(5)]
    for part in parts:
        spill.append(0, part)
    each = spill.each(0)
    assert next(each).buffer == parts[0].buffer  # read one, the rest still on disk
    assert [p.buffer for p in spill.each(0, [4, 1])] == [parts[4].buffer, parts[1].buffer]
    assert next(each).buffer == parts[1].buffer  # readers do not disturb each other's place
    later = spill.each(0)
    spill.append(0, runtime_pb2.Tensor(buffer=b"sent after the request"))
    assert len(list(later)) == 5  # what was sent when it was asked for
    stale = spill.each(0)
    spill.close()
    assert list(each) == [] and spill.each(1) is None
    spill.append(0, runtime_pb2.Tensor(buffer=b"x" * 4000))  # a round's file closed, then one more part: a new file
    assert list(stale) == []  # the old offsets are never read from the new file
