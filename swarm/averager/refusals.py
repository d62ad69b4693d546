"""The averager process refuses banned peers: in matchmaking, as groupmates, and as requesters.

Banned peers are ours (``swarm.averager.auditing`` bans a reducer it caught) and the host's (``swarm.defence.bans``,
sent over with ``set_bans``). They are refused as followers and as leaders in matchmaking, as
groupmates, and as requesters of state, updates and audit data (``swarm.averager.transfer``).

This is a mixin of ``PseudoGradientAverager``; ``set_bans`` is called from the host.
"""

from __future__ import annotations

import typing

from hivemind.averaging.allreduce import AllreduceException
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2


class Refusals:
    """The peers this averager refuses, and where it refuses them."""

    def _init_refusals(self) -> None:
        self._banned: set[str] = set()

    def set_bans(self, peers: typing.Iterable[str]) -> None:
        """(host) Refuse exactly these peers from now on: every ban the host holds, the ones the averager caught
        itself included (they reach the host with the round's findings); a ban the host lifted is lifted here."""
        self._outer_pipe.send(("_set_bans", [], dict(peers=sorted(peers))))

    async def _set_bans(self, peers: list[str]) -> None:
        self._banned = set(peers)

    def _is_banned(self, peer: PeerID) -> bool:
        return peer.to_base58() in self._banned

    @property
    def _matchmaking(self):
        try:
            return self.__dict__["_swarm_matchmaking"]
        except KeyError:
            raise AttributeError("_matchmaking") from None

    @_matchmaking.setter
    def _matchmaking(self, matchmaking) -> None:  # hivemind sets it in the averager process: never follow a banned
        request = matchmaking._request_join_group  # leader, whatever the DHT lists

        async def unless_banned(leader: PeerID):
            return None if self._is_banned(leader) else await request(leader)

        matchmaking._request_join_group = unless_banned
        self.__dict__["_swarm_matchmaking"] = matchmaking

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:
        if self._is_banned(context.remote_id):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    def _check_group(self, members: list[str], group_id: bytes) -> None:
        banned = [m for m in members if m in self._banned]
        reused = group_id in getattr(self, "_audit_rounds", {})  # a leader handing us a group id we averaged in: its
        # records would replace the round our groupmates may still audit
        if banned or reused:  # a leader that has not heard of the ban yet: this group is not ours
            why = f"holds a banned peer ({banned[0][-8:]})" if banned else "has the id of a group we averaged in"
            error = AllreduceException(f"the group {why}")
            running = self._running_groups.get(group_id)
            if running is not None and not running.done():
                running.set_exception(error)  # groupmates' streams to us end now, not at their timeout
            raise error
