"""What a tensor part from another machine may declare, checked before a byte of it is decoded.

A part on hivemind's wire names its own codec, dtype and shape, and the decoders allocate what the shape asks for:
a 49 KB sparse part declaring 64M values decodes to 256 MB, and a float16 part declaring a 16-byte dtype asks for
eight times its bytes. So every part that arrives (a sender's part at its reducer, a reducer's average at its
groupmates, an update file's parts at a joiner or a merging peer, the parts an auditor fetches) is admitted here
first: one dimension, exactly the number of values the receiver expects for that part (the manifest's shapes, as
hivemind cut them), the float32 dtype every codec of ours decodes to, a known codec, and no more bytes than that
codec sends for that many values. What passes decodes into at most the part's own size (the decoders bound their
work by the admitted count: ``swarm.averager.fp4``, ``swarm.averager.sparse``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from hivemind.proto import runtime_pb2

from swarm.averager.fp4 import FP4_BLOCK
from swarm.averager.sparse import SPARSE_CHUNK

logger = logging.getLogger(__name__)
CT = runtime_pb2.CompressionType
MAX_PART = 1 << 24  # values in one part: hivemind cuts parts of about 2**20 (a whole tensor at most for tiny ones)
DTYPE = "float32"
SECOND_STAGE = 256  # delegates in a second stage at most (``swarm.dht.records.MAX_GROUPS``)


class OutOfBounds(ValueError):
    """A part that declares more than its receiver expects, or other than the run's codec can send."""


def max_bytes(compression: int, numel: int) -> int:
    """The most bytes an honest part of ``numel`` values carries under ``compression`` (an average's, the larger)."""
    nchunks = math.ceil(numel / SPARSE_CHUNK)
    match compression:
        case CT.NONE:
            return 4 * numel
        case CT.FLOAT16:
            return 2 * numel
        case CT.MEANSTD_16BIT:
            return 2 * numel + 8  # one mean and one std for a flat part
        case CT.QUANTILE_8BIT:  # fp4: a scale byte per block and two codes a byte, or less once deflated
            return math.ceil(numel / FP4_BLOCK) + math.ceil(numel / 2)
        case CT.UNIFORM_8BIT:  # sparse: kind, per-chunk header and counts, then 2-byte columns and 2- or 4-bit codes
            # (an average holds every sender's entries, up to all of them; a sender's, ``SPARSE_K`` a chunk, is
            # held to that by ``sparse_decode``)
            return 1 + 4 * nchunks + 2 * numel + math.ceil(numel / 2)
    raise OutOfBounds(f"a part in compression {compression}, which this client never sends")


def declared_numel(part: runtime_pb2.Tensor) -> int:
    """The number of values a part declares (one dimension, as every part of ours has), before it is trusted."""
    if len(part.size) != 1:
        raise OutOfBounds(f"a part of {len(part.size)} dimensions, not one")
    numel = int(part.size[0])
    if not 0 <= numel <= MAX_PART:
        raise OutOfBounds(f"a part declaring {numel} values")
    return numel


def admit(part: runtime_pb2.Tensor, numel: int, compression: int) -> None:
    """Raise ``OutOfBounds`` unless ``part`` is ``numel`` float32 values in ``compression`` within its bytes' bound."""
    if part.compression != compression:
        raise OutOfBounds(f"a part in compression {part.compression}, not the run's {compression}")
    declared = declared_numel(part)
    if declared != numel:
        raise OutOfBounds(f"a part declaring {declared} values where {numel} are expected")
    if part.dtype != DTYPE:
        raise OutOfBounds(f"a part of dtype {part.dtype[:32]!r}, not {DTYPE}")
    limit = max_bytes(compression, numel)
    if len(part.buffer) > limit:
        raise OutOfBounds(f"a part of {numel} values in {len(part.buffer)} bytes (at most {limit})")


def admitted(parts: list[runtime_pb2.Tensor], numels: list[int], compression: int) -> bool:
    """Whether ``parts`` are one part of each of ``numels`` values, each admitted (an audit's or a repair's fetch)."""
    if len(parts) != len(numels):
        return False
    try:
        for part, numel in zip(parts, numels):
            admit(part, numel, compression)
    except OutOfBounds as e:
        logger.debug("parts refused: %s", e)
        return False
    return True


def max_request_bytes(group_size: int) -> int:
    """The most bytes of a request's fields (``DownloadData.metadata``: a state, update, audit, proof or verdict
    request) that are decoded at all. The largest honest one is an auditor's verdict: a receipt and the signed
    output of each groupmate, under 4.3 KB a member, in the larger of the run's groups and a second stage's (up to
    ``SECOND_STAGE`` delegates): 1.2 MiB. What it decodes to is bounded too (``swarm.defence.unpack``)."""
    return 64 * 1024 + 4096 + max(group_size, SECOND_STAGE) * (4096 + 256)


def max_update_bytes(compression: int, numels: Sequence[int]) -> int:
    """The most bytes of an honest update file (``transfer.write_update``: a round's average, part by part) of
    tensors of ``numels`` values in the run's ``compression``: each tensor's values at the codec's most
    (``max_bytes``), a part's framing for every 2**16 of them (hivemind's parts hold more), and a MiB for the
    header and the parts cut at slices' ends. For fp4 about 0.5 bytes a value; before, every download allowed 4,
    and the whole file is read, then copied part by part, before a part is checked."""
    return sum(max_bytes(compression, n) + 64 * (n // 65536 + 2) for n in numels) + (1 << 20)
