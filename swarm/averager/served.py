"""A stream served to another peer, in its slot of the serving limits, ended when the requester stops taking it.

hivemind writes each message a handler yields, then waits for the connection to drain before it asks for the next
(``P2P._handle_stream``). A requester that stops reading leaves the handler waiting there, holding its slot of the
serving limits (``ServingLimits``: a state file's, an audit's, a proof's), for as long as its connection lives: a
few keys that ask and never read would take every slot. So each message gets ``STALL`` seconds to be taken; past
that the slot is given back and the task that writes the stream is cancelled, which closes the stream. A reader as
slow as a half-megabyte part a minute keeps its stream (an honest link of 1 Mbit/s takes one in 4 s), so the
serving that strangers reach (state files, updates, the swarm's average) also limits each network's share of its
slots (``ServingLimits.per_network``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TypeVar

from swarm.averager.serving_limits import ServingLimits
from swarm.hivemind_fixes.remote_addrs import network_of, remote_addr

logger = logging.getLogger(__name__)

STALL = 60.0  # seconds one message of a stream may wait for the requester to take it

T = TypeVar("T")


class Slot:
    """One requester's stream in ``limits``: ``taken`` when the limits allowed it; given back once, however the
    stream ends (``release`` in the handler's ``finally``, or a stall)."""

    def __init__(self, limits: ServingLimits, requester: str, network: str | None = None, known: bool = False):
        self._limits, self.requester, self.network = limits, requester, network
        self.taken = limits.acquire(requester, network, known)
        self._timer: asyncio.TimerHandle | None = None

    def release(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.taken:
            self.taken = False
            self._limits.release(self.requester, self.network)

    async def stream(self, messages: AsyncIterator[T]) -> AsyncIterator[T]:
        """``messages``, each given ``STALL`` seconds to be taken before the stream is ended."""
        task, loop = asyncio.current_task(), asyncio.get_running_loop()
        async for message in messages:
            self._timer = loop.call_later(STALL, self._cut, task)
            try:
                yield message
            finally:
                self._timer.cancel()

    def _cut(self, task: asyncio.Task | None) -> None:
        logger.debug("a stream to %s waited %.0f s for its reader: ended", self.requester, STALL)
        self.release()
        if task is not None:
            task.cancel()


async def served(
    limits: ServingLimits, requester: str, messages: AsyncIterator[T], what: str, known: bool = False
) -> AsyncIterator[T]:
    """``messages`` (not started yet) streamed to ``requester`` in a ``Slot`` of ``limits``, which is given back
    however the stream ends; nothing at all where its limits are full (``what`` names the stream in the log). A
    handler closes it with ``aclosing``: a generator left by an exception is otherwise closed only once collected,
    and its slot held until then. The stream's network is read from its address (``remote_addrs``); a ``known``
    requester may take the limits' reserved slots."""
    slot = Slot(limits, requester, network_of(remote_addr()), known)
    if not slot.taken:
        logger.debug("%s for %s refused: over its serving limits", what, requester)
        return
    try:
        async with aclosing(messages):  # what it holds open (a file) is closed now, not when it is collected
            async for message in slot.stream(messages):
                yield message
    finally:
        slot.release()
