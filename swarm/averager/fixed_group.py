"""An all-reduce among peers that are known in advance, without hivemind's matchmaking: a round's second stage.

The delegates of a round's groups are listed in the run's groups key (``swarm.dht.groups``), so each of them can
build the same ``GroupInfo``: the members sorted by id, a group id made of the epoch, the attempt and the members,
and each member's gathered data from its record. hivemind's matchmaking, asked to form one group of peers that
arrive seconds apart, formed pairs and left latecomers out (each pair a different swarm's average); here every
delegate that sees the same registered groups runs the same all-reduce, as hivemind runs a group it assembled.
A groupmate's stream may reach us before we have registered the group: it waits for it (``GROUP_WAIT``).

This is a mixin of ``PseudoGradientAverager``: ``start_fixed_group`` runs on the host, the rest in the averager
process.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import typing
from collections.abc import Sequence

from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.control import AveragingStage
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, as_aiter
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.serializer import MSGPackSerializer

from swarm.averager.allreduce import WIRE_VERSION
from swarm.averager.serving_limits import ServingLimits

logger = logging.getLogger(__name__)
T = typing.TypeVar("T")

GROUP_WAIT = 15.0  # seconds a groupmate's stream waits for us to register the group it names
# streams waiting for a group at once, per requester and in all, and waits a requester may start a minute: an honest
# delegate's stream waits once a try, when it starts a moment before us. Keys are free, so the total is not what
# keeps a stranger's made-up groups cheap (an honest stream refused for it would leave its group's second stage):
# past ``FAST_WAITS`` at once, a wait looks for its group every half second rather than every 50 ms
GROUP_WAITS = dict(per_peer=2, total=4096, per_minute=60)
FAST_WAITS = 64


def partial_merge(dropped_fraction: float, excluded_senders: int) -> bool:
    """Whether a second stage's all-reduce is no swarm's average: it dropped a slice (a caught or vanished delegate's)
    or left a delegate's group out. ``swarm.round.merge`` discards it (tries again without them, or goes on from the
    group's own average), so the averager neither writes it into the buffers nor keeps it as the epoch's update: the
    buffers keep the group's own average, as its members' do, and a second try averages those."""
    return dropped_fraction > 0 or excluded_senders > 0


def fixed_group_id(label: str, members: Sequence[typing.Any]) -> bytes:
    """The id every member computes for the same group: its label (run, epoch, attempt), its members as
    ``start_fixed_group`` takes them (each one's client mode and data too, which cut the slices and weigh the
    parts: delegates that read another of them from a record written twice hold another id, and refuse each
    other's streams as another group's rather than each other's parts as the wrong size), and the wire version
    (a delegate of another finds no group of that id here: absent from the try, left out of the next)."""
    entries = sorted(MSGPackSerializer.dumps(member) for member in members)
    return hashlib.sha256(label.encode() + b"/" + b"/".join(entries) + WIRE_VERSION).digest()[:20]


class FixedStep:
    """The host's handle on a fixed group's all-reduce, shaped like hivemind's ``StepControl`` for ``Averaging``."""

    def __init__(self, future: MPFuture):
        self._future = future

    @property
    def stage(self) -> AveragingStage:
        return AveragingStage.FINISHED if self._future.done() else AveragingStage.RUNNING_ALLREDUCE

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> typing.Any:
        return self._future.result()

    def cancel(self) -> bool:
        return self._future.cancel()


class FixedGroups:
    """A mixin of ``PseudoGradientAverager``: all-reduces among known members."""

    def start_fixed_group(
        self, group_id: bytes, members: Sequence[tuple[str, bool, typing.Any]], weight: float
    ) -> FixedStep:
        """(host) Average the buffers with ``members`` (each ``(peer id, client mode, gathered data)``, this peer's
        among them), weighted by ``weight``; the step ends within the all-reduce's limit (``_within_limit``)."""
        future = MPFuture()
        members = sorted(members, key=lambda m: m[0])
        kwargs = dict(group_id=group_id, members=members, weight=weight, future=future)
        self._outer_pipe.send(("_run_fixed_group", [], kwargs))
        return FixedStep(future)

    async def _run_fixed_group(self, group_id: bytes, members: list, weight: float, future: MPFuture) -> None:
        self._fixed_group_ids.append(group_id)  # a second stage: its senders' weights are groups' samples
        try:
            gathered = tuple(
                self.serializer.dumps(
                    [0.0 if client else 1.0, (AveragingMode.CLIENT if client else AveragingMode.NODE).value,
                     self.serializer.dumps(data)]
                )
                for _, client, data in members
            )  # fmt: skip
            group_info = GroupInfo(group_id, tuple(PeerID.from_base58(peer) for peer, _, _ in members), gathered)
            with self._register_allreduce_group(group_info):
                kwargs = dict(tensor_infos=self.tensor_infos, weight=weight, **self.allreduce_kwargs)
                outcome = await self._aggregate_with_group(group_info, **kwargs)
            if not future.done():
                future.set_result(outcome)
        except BaseException as e:
            if not future.done():
                future.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
            if not isinstance(e, Exception):
                raise

    async def _within_limit(self, group_id: bytes, aggregate: typing.Awaitable[T]) -> T:
        """``aggregate``, an all-reduce of either stage, given up ``_allreduce_limit`` s after it began unless it is
        writing the average into the buffers by then (its runner is ``committing``): that write is never cut. Under
        hivemind's ``wait_for`` it was: the write went on in its executor thread after the step had failed, so the
        buffers held an average (whole or in part) where the host counted on what was there before: a second
        stage's group average for the next try, or this peer's own update for a round gone local."""
        task = asyncio.ensure_future(aggregate)
        try:
            await asyncio.wait({task}, timeout=self._allreduce_limit)
        except asyncio.CancelledError:  # the averager shuts down
            task.add_done_callback(_told)  # a write under way ends on its own
            if not self._committing(group_id):
                task.cancel()
            raise
        if not task.done() and not self._committing(group_id):
            task.cancel()
            await asyncio.wait({task})
            if task.cancelled() or task.exception() is not None:  # (a cancel can be swallowed: then it wrote)
                _told(task)
                raise TimeoutError(f"the all-reduce did not end in {self._allreduce_limit:.0f} s")
        return await task

    def _committing(self, group_id: bytes) -> bool:
        running = self._running_groups.get(group_id)
        if running is None or not running.done() or running.cancelled() or running.exception() is not None:
            return False
        return bool(getattr(running.result(), "committing", False))

    async def rpc_aggregate_part(
        self, stream: typing.AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.AveragingData]:
        """A groupmate's part: as hivemind serves it, once the group it names is registered here (a fixed group's
        member may start a moment before us), or BAD_GROUP_ID after ``GROUP_WAIT``. Its first message is awaited
        ``GROUP_WAIT`` at most, and a stream waits for a group only within ``GROUP_WAITS``' share (a key naming made-up
        groups in a loop is answered at once)."""
        try:
            request = await asyncio.wait_for(anext(stream), GROUP_WAIT)
        except (TimeoutError, StopAsyncIteration):
            return
        if request.group_id not in self._running_groups:
            await self._wait_for_group(request.group_id, context.remote_id.to_base58())
        if request.group_id not in self._running_groups:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        async for message in super().rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    async def _wait_for_group(self, group_id: bytes, requester: str) -> None:
        if getattr(self, "_group_waits", None) is None:
            self._group_waits = ServingLimits(**GROUP_WAITS)
        if not self._group_waits.acquire(requester):
            return
        try:
            deadline = time.monotonic() + GROUP_WAIT
            pause = 0.05 if sum(self._group_waits.open.values()) <= FAST_WAITS else 0.5
            while group_id not in self._running_groups and time.monotonic() < deadline:
                await asyncio.sleep(pause)
        finally:
            self._group_waits.release(requester)


def _told(task: asyncio.Task) -> None:
    """A given-up all-reduce's end, retrieved (not "never retrieved") and logged."""
    if not task.cancelled() and task.exception() is not None:
        logger.debug("an all-reduce given up on failed", exc_info=task.exception())
