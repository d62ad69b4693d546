"""A DHT request whose sender left before the DHT process read it is dropped, not fatal and not a stall.

Works around: ``DHT.run`` reading its request pipe with ``_inner_pipe.recv()`` and catching only ``OSError``,
``ConnectionError`` and ``RuntimeError`` (checked on hivemind 1.1.12, ``dht/dht.py``).

Each request carries its reply future, and the future carries its process's reply pipe, which ``multiprocessing``
passes as a file descriptor through the sender's resource sharer: the DHT process connects to the sender to fetch
it while unpickling. A sender that has exited by then (the averager process, which reads the DHT several times a
second, shut down at a peer's leave) makes that unpickling fail:
- with ``ConnectionRefusedError`` when it is gone: hivemind logs a traceback at ERROR and sleeps ``wait_timeout``
  (3 s) before the next request, per such request (measured: 50 orphaned reads held every other request 150 s);
- with ``EOFError`` when it is exiting at that moment (its listener still queued the connection): hivemind does not
  catch it, the DHT process dies, and the peer is deaf. A suite run saw this at a SIGTERM: every goodbye then
  waited out its timeout and the leave ran past the stop deadline.

The request pipe is wrapped in the DHT process so that a request which cannot be read is dropped with a debug
line and the next is read at once; nobody waits for its reply, since its sender is gone. A closed pipe (the peer
itself gone) still raises as before.
"""

from __future__ import annotations

import logging
from multiprocessing.reduction import ForkingPickler
from typing import Any

import hivemind

logger = logging.getLogger(__name__)

NO_REQUEST = "_swarm_no_request"  # the DHT method run in a dropped request's place: does nothing

_installed = False
_run = hivemind.DHT.run


class TolerantPipe:
    """The DHT process's end of its request pipe, whose ``recv`` drops the requests it cannot unpickle."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe
        self.dropped = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)

    def recv(self) -> Any:
        while True:
            payload = self._pipe.recv_bytes()  # EOFError or OSError here: the pipe itself is closed
            try:
                return ForkingPickler.loads(payload)
            except (EOFError, OSError) as e:
                self.dropped += 1
                logger.debug("dropped a DHT request whose sender left before it was read (%r)", e, exc_info=True)
                if not self._pipe.poll():
                    return NO_REQUEST, [], {}


async def _no_request(self: hivemind.DHT) -> None:
    return None


def _tolerant_run(self: hivemind.DHT) -> None:
    self._inner_pipe = TolerantPipe(self._inner_pipe)
    _run(self)


def tolerate_departed_senders() -> None:
    """From now on, DHT processes started from this process drop a request whose sender left. Called before the
    DHT process starts."""
    global _installed
    if not _installed:
        setattr(hivemind.DHT, NO_REQUEST, _no_request)
        hivemind.DHT.run = _tolerant_run
        _installed = True
