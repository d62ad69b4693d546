"""The parts a peer sent each reducer (and, as a reducer, those each sender sent it), kept for the auditors, on disk
rather than in memory.

A checked round (``swarm.defence.audit``) must be able to serve, for a few seconds after it, every
part this peer sent: a whole pseudo-gradient as it went on the wire (2 bytes per parameter
in FP16). Held as protobufs, that was the largest single copy in the averager process at a
round's peak. Here their bytes go to an unlinked temporary file as they are sent (written
with plain writes: page cache, not the process's memory, and nothing left on disk if the
process is killed), and only offsets stay in memory; an auditor's request reads one
reducer's parts back. The file is closed with the round's record.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

from hivemind.proto import runtime_pb2


class SpilledParts:
    """Serialized parts by a groupmate's index (the reducer they went to, or the sender they came from), appended in
    the order they were sent. One event loop uses it."""

    def __init__(self, keep: bool = True) -> None:
        self._keep = keep  # False: nothing is written (a round nobody audits), and every list read back is empty
        self._file = None  # opened on the first part: a runner that never sends anything touches no disk
        self._where: dict[int, list[tuple[int, int]]] = {}
        self._end = 0

    def append(self, reducer_index: int, part: runtime_pb2.Tensor) -> None:
        if not self._keep:
            self._where.setdefault(reducer_index, [])
            return
        data = part.SerializeToString()
        if self._file is None:
            self._file = tempfile.TemporaryFile(prefix="swarm-sent-")
        self._file.seek(self._end)
        self._file.write(data)
        self._where.setdefault(reducer_index, []).append((self._end, len(data)))
        self._end += len(data)

    def start(self, reducer_index: int) -> None:
        """Mark that parts go to this reducer (even if none is appended yet): ``get`` then returns a list."""
        self._where.setdefault(reducer_index, [])

    def get(self, reducer_index: int, indices: list[int] | None = None) -> list[runtime_pb2.Tensor] | None:
        """The parts sent to that reducer so far (or only those ``indices``, which must be in range), read back;
        None if we never sent it anything."""
        where = self._where.get(reducer_index)
        if where is None:
            return None
        return list(self._read(self._file, where if indices is None else [where[i] for i in indices]))

    def each(self, reducer_index: int, indices: list[int] | None = None) -> Iterator[runtime_pb2.Tensor] | None:
        """``get``'s parts, read back one at a time as they are taken (what a served stream holds is then one part,
        not a slice); it ends early if the file is closed meanwhile."""
        where = self._where.get(reducer_index)
        if where is None:
            return None
        return self._read(self._file, list(where) if indices is None else [where[i] for i in indices])  # sent by now

    def count(self, reducer_index: int) -> int | None:
        """How many parts were sent to that reducer (None: never any)."""
        where = self._where.get(reducer_index)
        return None if where is None else len(where)

    def _read(self, file, where: list[tuple[int, int]]) -> Iterator[runtime_pb2.Tensor]:
        for offset, size in where:
            if self._file is not file:  # closed with its round while a stream served it (another may be open now)
                return
            file.seek(offset)
            part = runtime_pb2.Tensor()
            part.ParseFromString(file.read(size))
            yield part

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._where.clear()

    def __del__(self) -> None:
        self.close()
