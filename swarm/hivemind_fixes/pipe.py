"""One control pipe, many threads: each message is written whole.

Works around: ``DecentralizedAverager`` sending every host call (``step``, ``load_state_from_peers``, and ours: bans,
downloads, second stages, proof checks) on one ``multiprocessing`` pipe with no lock (checked on hivemind 1.1.12,
``averaging/averager.py``), while this client makes those calls from several threads (the training loop, the swarm
reader, state sync, proof checks). ``Connection.send`` writes a message of more than 16 KiB as two writes, and any
message as several when the pipe is full, so two threads sending at once could interleave their bytes and leave the
averager process reading garbage.
"""

from __future__ import annotations

import threading
from typing import Any


class LockedSends:
    """A pipe whose ``send`` holds a lock; everything else is the pipe's own."""

    def __init__(self, pipe: Any) -> None:
        self._pipe, self._lock = pipe, threading.Lock()

    def send(self, obj: Any) -> None:
        with self._lock:
            self._pipe.send(obj)

    def __getattr__(self, name: str) -> Any:
        if name == "_pipe":  # not set yet (an unpickled copy): not the pipe's
            raise AttributeError(name)
        return getattr(self._pipe, name)
