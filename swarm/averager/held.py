"""What an all-reduce hands back: each reducer's averaged parts as they came off the wire, or ``Dropped`` for a part
whose reducer failed (read as zeros), checked before any of them is written into a tensor.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import torch
from hivemind.averaging.allreduce import AllreduceException
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import deserialize_torch_tensor
from hivemind.proto import runtime_pb2

from swarm.averager.bounds import OutOfBounds, admit, declared_numel
from swarm.defence.receipts import part_digest


@dataclass(frozen=True)
class Dropped:
    """A part whose reducer failed: it is read back as ``numel`` zeros."""

    numel: int


HeldPart = runtime_pb2.Tensor | Dropped


class HeldOutputContainer(TensorPartContainer):
    """Keeps averaged parts serialized, and hands them out per tensor as lists rather than as new tensors."""

    def register_failed_reducer(self, peer_index: int) -> None:
        for part_index in range(self._outputs_registered_by_peer[peer_index], self.num_parts_by_peer[peer_index]):
            numel = self._input_parts_by_peer[peer_index][part_index][0].numel()
            self.register_processed_part(peer_index, part_index, Dropped(numel))
            self.failed_size += numel

    async def iterate_output_tensors(self) -> AsyncIterator[list[HeldPart]]:
        assert not self._outputs_consumed, "output tensors are already iterated and no longer available."
        self._outputs_consumed = True
        peer_index = num_parts_processed = 0
        for tensor_index in range(len(self.local_tensors)):
            parts: list[HeldPart] = []
            while len(parts) < self.num_parts_by_tensor[tensor_index]:
                if num_parts_processed >= self.num_parts_by_peer[peer_index]:
                    num_parts_processed = 0
                    peer_index += 1
                    continue
                if not self._output_parts_by_peer[peer_index]:
                    self._output_part_available[peer_index].clear()
                    await self._output_part_available[peer_index].wait()
                    if self.finished.is_set():
                        raise AllreduceException("All-reduce was terminated during iteration")
                parts.append(self._output_parts_by_peer[peer_index].popleft())
                num_parts_processed += 1
            yield parts


def _decoded(part: HeldPart) -> torch.Tensor | None:
    """The values of one held part (None: a dropped part, read as zeros)."""
    if isinstance(part, Dropped):
        return None
    try:
        return deserialize_torch_tensor(part).reshape(-1)
    except Exception as e:  # a reducer's bytes are another machine's: anything can be wrong with them
        raise AllreduceException(f"a reducer returned a part that does not decode: {e!r}") from None


def check_parts(tensor: torch.Tensor, parts: Sequence[HeldPart], compression: int) -> None:
    """Raise unless every part is admitted (``swarm.averager.bounds``: within what is left of ``tensor``, in the
    run's ``compression``), decodes, and together they are exactly ``tensor``'s size: checked before anything is
    written, so a broken reducer never leaves a tensor half averaged."""
    total = 0
    for part in parts:
        left = tensor.numel() - total
        try:
            numel = part.numel if isinstance(part, Dropped) else declared_numel(part)
            if not 0 <= numel <= left:
                raise OutOfBounds(f"a part of {numel} values where {left} are left of the tensor")
            if not isinstance(part, Dropped):
                admit(part, numel, compression)
        except OutOfBounds as e:
            raise AllreduceException(f"a reducer returned a part out of bounds: {e}") from None
        values = _decoded(part)
        total += part.numel if values is None else values.numel()
    if total != tensor.numel():
        raise AllreduceException(f"reducers returned {total} values for a tensor of {tensor.numel()}")


def decode_into(tensor: torch.Tensor, parts: Sequence[HeldPart]) -> None:
    """Write held parts, in order, into ``tensor`` (after ``check_parts``)."""
    flat = tensor.view(-1)
    offset = 0
    for part in parts:
        values = _decoded(part)
        if values is None:
            flat[offset : offset + part.numel].zero_()
            offset += part.numel
        else:
            flat[offset : offset + values.numel()].copy_(values)
            offset += values.numel()


def likeness(tensor: torch.Tensor, parts: Sequence[HeldPart]) -> tuple[float, float, float]:
    """The dot product of held parts' values (after ``check_parts``) with ``tensor``'s, and the two squared norms,
    a part at a time: one decoded part is all it makes, as ``decode_into`` (float32 sums, enough for a cosine's
    sign and a length ratio)."""
    flat, offset, dot, held, ours = tensor.view(-1), 0, 0.0, 0.0, 0.0
    for part in parts:
        values = _decoded(part)
        n = part.numel if values is None else values.numel()
        mine = flat[offset : offset + n]
        if values is not None:
            values = values.to(mine.dtype)
            dot, held = dot + float(torch.dot(values, mine)), held + float(torch.dot(values, values))
        ours, offset = ours + float(torch.dot(mine, mine)), offset + n
    return dot, held, ours


def held_digest(held: Sequence[Sequence[HeldPart]]) -> str:
    """A digest of an average's parts as held (a dropped part by its size): the same for every groupmate that
    received the same bytes."""
    digest = hashlib.sha256()
    for parts in held:
        for part in parts:
            digest.update(b"dropped:%d" % part.numel if isinstance(part, Dropped) else part_digest(part))
        digest.update(b"|")
    return digest.hexdigest()
