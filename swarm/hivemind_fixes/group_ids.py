"""A first-stage group's id binds what its leader told each member: who is in it, in what order, with what data.

Works around: ``Matchmaking.follower_assemble_group`` (checked on hivemind 1.1.12, ``averaging/matchmaking.py``)
taking the group's members, their order and their gathered data (each one's bandwidth and mode, which cut the
tensors into each reducer's slice, and our own round data) from the leader unchecked, under a random group id of
the leader's. A leader could give two followers different bandwidths or orders under one id: each then cut its
parts for the other where the other did not expect them, refused the other's parts as the wrong size, and banned
an honest groupmate for them (two honest peers banning each other, every round that leader led).

Here the leader's id is a random salt and the SHA-256 of the salt, the members in order and their gathered data;
a follower checks it before it takes the group, and a group whose id does not bind what it was told is not
taken (the follower looks for another leader, as after a leader that disbanded). Two members that hold one id
then hold one layout: parts of the wrong size are their sender's own lie. Groups whose members were told
different things have different ids, and their streams to each other are refused as another group's.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
from collections.abc import Sequence

from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer

logger = logging.getLogger(__name__)

SALT = 12  # random bytes before the digest: a group id is 32 bytes
_follower_assemble = Matchmaking.follower_assemble_group
_installed = False


def bound_group_id(salt: bytes, members: Sequence[bytes], gathered: Sequence[bytes]) -> bytes:
    """The id of a group of ``members`` (peer ids as bytes, in the all-reduce's order) with their ``gathered``."""
    layout = MSGPackSerializer.dumps([list(members), list(gathered)])
    return salt + hashlib.sha256(b"swarm-group/1" + salt + layout).digest()[:20]


def binds(group_id: bytes, members: Sequence[bytes], gathered: Sequence[bytes]) -> bool:
    """Whether ``group_id`` is the id of exactly these members, in this order, with this gathered data."""
    return (
        isinstance(group_id, bytes)
        and len(group_id) == SALT + 20
        and len(members) == len(gathered)
        and all(isinstance(x, bytes) for x in (*members, *gathered))
        and bound_group_id(group_id[:SALT], members, gathered) == group_id
    )


async def _leader_assemble_group(self: Matchmaking) -> GroupInfo:
    """hivemind's, but the id binds the group (``bound_group_id``)."""
    assert self.lock_looking_for_group.locked() and self.lock_request_join_group.locked() and not self.client_mode
    assert not self.assembled_group.done()
    ordered_peer_ids = [*self.current_followers, self.peer_id]
    random.shuffle(ordered_peer_ids)
    gathered = tuple(
        self.step_control.data_for_gather if peer_id == self.peer_id else self.current_followers[peer_id].gather
        for peer_id in ordered_peer_ids
    )
    group_id = bound_group_id(os.urandom(SALT), [p.to_bytes() for p in ordered_peer_ids], gathered)
    logger.debug(f"{self.peer_id} - assembled group of {len(ordered_peer_ids)} peers")
    group_info = GroupInfo(group_id, tuple(ordered_peer_ids), gathered)
    await self.group_key_manager.update_key_on_group_assembled(group_info)
    self.assembled_group.set_result(group_info)
    return group_info


async def _follower_assemble_group(self: Matchmaking, leader: PeerID, msg) -> GroupInfo | None:
    """hivemind's, for a group whose id binds what the leader sent; None (no group: look on) for any other."""
    if not binds(msg.group_id, list(msg.ordered_peer_ids), list(msg.gathered)):
        logger.debug("%s's group id does not bind the members and data it sent us: not taken", leader)
        return None
    return await _follower_assemble(self, leader, msg)


def bind_group_ids() -> None:
    """From now on, in this process and those it forks (the averager's), groups are formed with bound ids."""
    global _installed
    if not _installed:
        Matchmaking.leader_assemble_group = _leader_assemble_group
        Matchmaking.follower_assemble_group = _follower_assemble_group
        _installed = True
