"""A stream message longer than any honest one is refused before it is read, as a stream that ended.

Works around: ``P2P.receive_raw_data`` (checked on hivemind 1.1.12, ``p2p/p2p_daemon.py``) reads a message's length
from its 8-byte header and then buffers that many bytes before anything can look at them. Every stream handler
(state and update downloads, all-reduce parts, audits, proofs, a second stage's parts) and every reader of a
stream's replies takes its messages this way, so a stranger that opens a stream and declares 2**40 bytes made this
process buffer all it sent, without a bound: the sizes checked later (``swarm.averager.bounds``) came too late.

The longest honest message is a proof's per-part digests (``average_proof.MAX_METADATA_BYTES``, 4 MiB) or a part
of hivemind's ``part_size_bytes`` (512 KiB, twice that with slack); state files go in chunks of 512 KiB. A
header past ``MAX_MESSAGE`` raises ``OversizedMessage``, an ``asyncio.IncompleteReadError``: both sides of a stream
already take that as the stream's end (a handler stops reading requests and closes it, a reader ends its replies),
so the refused stream is closed and what it carried so far is checked as a short stream. The unary calls go
through p2pd's own persistent connection, whose messages the daemon caps (4 MiB).
"""

from __future__ import annotations

import asyncio
import logging

from hivemind.p2p import P2P

logger = logging.getLogger(__name__)

MAX_MESSAGE = 8 << 20  # bytes of one stream message: twice the longest honest one

_installed = False


class OversizedMessage(asyncio.IncompleteReadError):
    """A stream message whose header declares more than ``MAX_MESSAGE`` bytes: refused, none of it read."""


async def receive_bounded(reader: asyncio.StreamReader) -> bytes:
    """``P2P.receive_raw_data``, refusing a declared length past ``MAX_MESSAGE`` before reading it."""
    header = await reader.readexactly(P2P.HEADER_LEN)
    length = int.from_bytes(header, P2P.BYTEORDER)
    if length > MAX_MESSAGE:
        logger.debug("a stream message declares %d bytes, past %d: the stream is ended", length, MAX_MESSAGE)
        raise OversizedMessage(b"", length)
    return await reader.readexactly(length)


def bound_messages() -> None:
    """From now on, in this process and those it forks (the DHT's, the averager's), stream messages are bounded.
    Called before the DHT process starts."""
    global _installed
    if not _installed:
        P2P.receive_raw_data = staticmethod(receive_bounded)
        _installed = True
