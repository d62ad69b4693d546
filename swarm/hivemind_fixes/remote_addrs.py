"""Where a stream comes from: the multiaddr the daemon reports for each incoming stream, kept for its handler.

Works around: hivemind hands a stream handler only the requester's peer id (``P2PContext``, checked on hivemind
1.1.12, ``p2p/p2p_daemon.py``), though p2pd tells the client the connection's address with every stream
(``StreamInfo.addr``, read in ``ControlClient._handler``). Keys are free, so a limit per peer id alone lets one
machine with many keys take every serving slot (``swarm.averager.serving_limits``); a limit per network needs the
address. ``ControlClient._handler`` runs as a task of its own for each stream the daemon opens to us, and every
task the handler starts copies its context, so the address is set in a ``ContextVar`` there and read as
``remote_addr()`` anywhere in the handler.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from contextvars import ContextVar

from hivemind.p2p.p2p_daemon_bindings import control
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.p2p.p2p_daemon_bindings.utils import DispatchFailure, read_pbmsg_safe
from hivemind.proto import p2pd_pb2
from hivemind.utils.multiaddr import Multiaddr

logger = logging.getLogger(__name__)

_REMOTE: ContextVar[Multiaddr | None] = ContextVar("swarm_remote_addr", default=None)
IP4_PREFIX, IP6_PREFIX = 24, 48  # bits of an address that name its network: a host's neighbours, a site


def remote_addr() -> Multiaddr | None:
    """The multiaddr of the connection the stream being handled came on (None outside a handler, or unpatched)."""
    return _REMOTE.get()


def network_of(addr: Multiaddr | None) -> str | None:
    """The network a connection comes from: its IPv4 /24 or IPv6 /48, or, through a relay, the relay's peer id (the
    relay is all we see of the requester). A loopback, private or link-local address is its own host (peers in one
    LAN, or containers on one machine, are neighbours that no stranger outside reaches us from). None where the
    address names none."""
    if addr is None:
        return None
    parts = str(addr).split("/")
    if "p2p-circuit" in parts:
        before = parts[: parts.index("p2p-circuit")]
        return f"relay:{before[-1]}" if len(before) >= 2 and before[-2] == "p2p" else "relay"
    for name, value in zip(parts, parts[1:]):
        if name in ("ip4", "ip6"):
            try:
                host = ipaddress.ip_address(value)
                local = host.is_loopback or host.is_private or host.is_link_local
                prefix = host.max_prefixlen if local else IP4_PREFIX if name == "ip4" else IP6_PREFIX
                return f"{name}:{ipaddress.ip_network(f'{value}/{prefix}', strict=False)}"
            except ValueError:
                logger.debug("could not read the address %s", addr, exc_info=True)
                return None
    return None


async def _handler(self: control.ControlClient, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """``ControlClient._handler``, with the stream's address kept for its handler."""
    pb_stream_info = p2pd_pb2.StreamInfo()
    await read_pbmsg_safe(reader, pb_stream_info)
    stream_info = StreamInfo.from_protobuf(pb_stream_info)
    handler = self.handlers.get(stream_info.proto)
    if handler is None:  # the daemon rejects streams of protocols we did not register: should not happen
        writer.close()
        raise DispatchFailure(KeyError(stream_info.proto))
    _REMOTE.set(stream_info.addr)
    await handler(stream_info, reader, writer)


def keep_remote_addrs() -> None:
    """Install it (in this process; idempotent)."""
    control.ControlClient._handler = _handler
