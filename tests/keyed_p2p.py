"""Real libp2p daemons whose identity keys the test holds, so that runners in one process sign as their own peer.

A peer's averager process signs with its identity key as the process-wide key (``swarm.dht.identity``); tests that
run several all-reduce runners in one process give each runner its own daemon's key instead (``signing_key``).
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from hivemind.p2p import P2P
from hivemind.utils.crypto import RSAPrivateKey

from swarm.dht.identity import identity_key
from swarm.hivemind_fixes.messages import bound_messages


async def keyed_p2ps(count: int) -> tuple[list[P2P], list[RSAPrivateKey]]:
    """``count`` daemons, the first one the others' initial peer, and each one's identity key; their streams read
    bounded messages, as a peer's do (``start_dht`` installs it)."""
    bound_messages()
    folder = Path(tempfile.mkdtemp(prefix="swarm-test-identities-"))
    paths = [folder / f"{i}.key" for i in range(count)]
    for path in paths:
        P2P.generate_identity(str(path))
    first = await P2P.create(identity_path=str(paths[0]))
    maddrs = await first.get_visible_maddrs()
    rest = await asyncio.gather(*(P2P.create(identity_path=str(p), initial_peers=maddrs) for p in paths[1:]))
    return [first, *rest], [identity_key(p) for p in paths]
