"""The averager process: pseudo-gradient rounds, started and watched from the training thread.

A ``PseudoGradientAverager`` is a hivemind ``DecentralizedAverager`` (its own
process) over shared pseudo-gradient buffers. Its all-reduce is
``allreduce.ExactAllReduceRunner``: groupmates end bitwise equal, and the buffers
change only when the whole all-reduce succeeded. ``start_averaging`` returns an
``Averaging`` handle the training thread polls between inner steps (an overlapped
round) or waits on (a blocking one). Files to and from other peers (state, the
rounds' averages) are ``transfer.FileTransfer``'s.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import signal
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.utils.asyncio import as_aiter, azip

from swarm.averager import heap
from swarm.averager.allreduce import WIRE_VERSION, ExactAllReduceRunner
from swarm.averager.auditing import Auditing
from swarm.averager.codecs import codec
from swarm.averager.fixed_group import FixedGroups, partial_merge
from swarm.averager.handle import AllReduceOutcome, Averaging
from swarm.averager.held import check_parts, decode_into, held_digest
from swarm.averager.refusals import Refusals
from swarm.averager.transfer import FileTransfer
from swarm.defence.audit import MALFORMED
from swarm.dht.access import RunSecret
from swarm.dht.records import run_prefix
from swarm.errors import HelperError
from swarm.hivemind_fixes.averaging import fix_averager_process
from swarm.hivemind_fixes.helpers import check_alive, start_and_wait
from swarm.hivemind_fixes.locks import free_stuck_locks
from swarm.hivemind_fixes.pipe import LockedSends
from swarm.manifest import Aggregation, AveragingSpec, RunManifest

logger = logging.getLogger(__name__)


def wire_schema_hash(plain: bytes, version: bytes = WIRE_VERSION) -> bytes:
    """The schema hash a leader compares join requests with: hivemind's (the tensors' shapes) and our wire version."""
    return hashlib.sha256(plain + version).digest()


# the swarm's averages a delegate serves its group's members (and each member its children in the group's tree), kept
# whatever replay_rounds says: with replay_rounds=0 nothing was kept, every member's fetch was told "no such file",
# and it waited out merge_limit (120 s for ``tiny``), then stepped with its group's own average, apart from the
# delegates. Two: a member may still fetch round E's while its delegate has finished E + 1
MERGED_KEPT = 2


def kept_updates(avg: AveragingSpec) -> int:
    """How many rounds' averages a peer keeps on disk to serve: for replay, and for two-stage rounds' fetches."""
    return max(avg.replay_rounds, MERGED_KEPT if avg.merge_groups else 0)


def averager_options(avg: AveragingSpec, numel: int) -> dict[str, Any]:
    """What the manifest's averaging section asks of ``PseudoGradientAverager`` (and hivemind's averager under it),
    for buffers of ``numel`` values."""
    return dict(
        keep_updates=kept_updates(avg),
        aggregation=avg.aggregation,
        audit=avg.checked_reducers,
        audit_timeout=avg.allreduce_seconds(numel) / 2,  # the other half re-checks accusations
        audit_parts=avg.audit_parts,
        target_group_size=avg.target_group_size,
        min_group_size=avg.min_group_size,
        min_matchmaking_time=avg.matchmaking_time,
        request_timeout=min(3.0, avg.matchmaking_time / 2),
        allreduce_timeout=avg.allreduce_limit(numel),  # the host's attempt_limit is built on the same bound
        next_chunk_timeout=avg.chunk_timeout,
        compression=codec(avg.compression),
        allow_state_sharing=False,  # until the peer has a state to offer (``Checkpoints.announce``)
        declare_state_period=10,
        shutdown_timeout=3,
    )


IDLE_GRACE = 10.0  # a step still running this long after its deadline means a stuck averager process


class PseudoGradientAverager(Auditing, Refusals, FileTransfer, FixedGroups, DecentralizedAverager):
    """A DecentralizedAverager over pseudo-gradient buffers that checks its reducers (``auditing.Auditing``),
    refuses banned peers (``refusals.Refusals``), and serves and fetches files (``transfer.FileTransfer``): state
    files, and the rounds' averages kept in ``update_dir`` for replay."""

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht,
        *,
        run_id: str,
        update_dir: Path | None = None,
        keep_updates: int = 0,
        aggregation: Aggregation = Aggregation.centered_clip,
        audit: bool = True,
        audit_timeout: float = 60.0,
        audit_parts: int = 0,
        max_weight: float = math.inf,
        secret: RunSecret | None = None,
        start: bool = False,
        **kwargs: Any,
    ):
        self._round_stats: dict[bytes, tuple] = {}
        self._last_step: Averaging | None = None  # the host's handle on the last step it started
        self.aggregation = aggregation
        # a sender's weight is capped at what a round (a second stage: a group) holds: more buys nothing, two included
        self._max_weights = (max_weight, max_weight * int(kwargs.get("target_group_size") or 64))
        self._fixed_group_ids: deque[bytes] = deque(maxlen=64)  # the last second stages' (``FixedGroups``)
        self._init_transfer(update_dir, keep_updates, run_id, secret)
        self._init_auditing(audit, audit_timeout, audit_parts)
        self._init_refusals()
        free_stuck_locks()  # one a dead helper kept would hang this averager at its first future
        super().__init__(averaged_tensors, dht, start=False, **kwargs)
        self._allreduce_limit, self._allreduce_timeout = self._allreduce_timeout, None  # ours: ``FixedGroups``
        self._outer_pipe = LockedSends(self._outer_pipe)  # the host calls it from several threads
        # a leader refuses joins with another schema hash: a peer of another all-reduce never groups with us, where
        # its receipts would read as unanswered audits and get it banned
        self.schema_hash = wire_schema_hash(self.schema_hash)
        if secret is not None:  # and outsiders' (``swarm.dht.access``)
            self.schema_hash = secret.schema_hash(self.schema_hash)
        if start:
            start_and_wait(self, "averager")

    # ---- averaging (runs in the averager process) ------------------------------------------------

    def _run_internal(self) -> None:
        rebuild_torch_thread_pool()
        heap.limit_retention()
        fix_averager_process()
        super()._run_internal()

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes | None = None, **kwargs: Any
    ) -> None:
        group_id = group_info.group_id if group_id is None else group_id
        members = [p.to_base58() for p in group_info.peer_ids]
        self._check_group(members, group_id)
        self._groupmates.note(() if group_id in self._fixed_group_ids else members)  # a first stage's fetch from us
        runner = ExactAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            aggregation=self.aggregation,
            max_weight=self._max_weights[group_id in self._fixed_group_ids],
            keep_parts=self._audit_enabled,  # for auditors only: with audits off, nothing is written to disk
            **kwargs,
        )
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise ValueError("auxiliary peers do not receive averaged tensors")
            return
        record = self._open_audit(runner, members) if self._audit_enabled else None
        try:
            held = [parts async for _, parts in azip(as_aiter(*tensors), runner)]
        except BaseException:
            self._forget_round(group_id, record)  # nothing to audit: the parts we sent and received go now
            raise
        findings, repair_failures, discarded, audit_started = [], [], 0, time.monotonic()
        if record is not None:  # before anything is written: a caught reducer's slice is dropped, for everyone
            held, discarded, findings, repair_failures = await self._audit_group(runner, record, held)
        audit_seconds = time.monotonic() - audit_started
        # a sender whose parts we refused as its reducer: seen by us on its own stream, so we ban it (for us alone)
        findings += [
            dict(peer=p.to_base58(), verdict=MALFORMED, banned=True, discarded=False, receipt=None)
            for p in runner.refused_senders
            if p != self.peer_id
        ]

        def commit() -> None:  # only after the whole all-reduce succeeded, and every part was checked
            for tensor, parts in zip(tensors, held):
                check_parts(tensor, parts, runner.tensor_part_container.compression.compression_type)
            for tensor, parts in zip(tensors, held):
                decode_into(tensor, parts)

        total = max(1, runner.tensor_part_container.total_size)
        dropped = (runner.tensor_part_container.failed_size + discarded) / total
        partial = group_id in self._fixed_group_ids and partial_merge(dropped, len(runner.banned_senders))
        if not partial:  # (a second stage that is no swarm's average keeps our group's: ``fixed_group.partial_merge``)
            runner.committing = True  # ``FixedGroups._within_limit`` lets it end
            await asyncio.get_event_loop().run_in_executor(None, commit)
        self._round_stats[group_id] = (
            dropped,
            tuple(sorted(p.to_base58() for p in runner.banned_senders)),
            runner.bytes_sent,
            runner.bytes_received,
            None if partial else held,  # nor is it kept as the epoch's update (``keep_pending``)
            tuple(findings),
            audit_seconds,
            record.fetched_bytes if record is not None else 0,
            tuple(repair_failures),
        )

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> dict:
        started = time.monotonic()
        aggregate = super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        gathered = await self._within_limit(group_info.group_id, aggregate)
        empty = (0.0, (), 0, 0, None, (), 0.0, 0, ())
        stats = self._round_stats.pop(group_info.group_id, empty)
        dropped, excluded, sent, received, held, findings, audit_seconds, audit_bytes, repair_failures = stats
        epoch = group_epoch(gathered.values())
        digest = held_digest(held) if held is not None else ""
        if held is not None and epoch is not None:
            try:  # the average as it came off the wire: the epoch's update once the host says it is final
                await asyncio.get_event_loop().run_in_executor(None, self.keep_pending, epoch, held)
            except OSError:
                logger.debug("could not keep the round's update", exc_info=True)
        del held  # the round's buffers are all gone now (the host reads the average from the shared buffers)
        heap.trim()
        return dict(
            group=tuple(p.to_base58() for p in group_info.peer_ids),
            gathered={peer.to_base58(): data for peer, data in gathered.items()},
            dropped_fraction=dropped,
            excluded_senders=len(excluded),
            absent=excluded,
            bytes_sent=sent,
            bytes_received=received,
            findings=findings,
            audit_seconds=audit_seconds,
            audit_bytes=audit_bytes,
            repair_failures=repair_failures,
            allreduce_started=started,
            allreduce_finished=time.monotonic(),
            group_id=group_info.group_id,
            digest=digest,
        )

    # ---- averaging (the host's side) -------------------------------------------------------------

    def start_averaging(
        self,
        *,
        weight: float,
        gather: Any,
        group_bits: str,
        timeout: float,
        hard_timeout: float,
        on_stage: Callable[[str], None] = lambda stage: None,
        abort_if: Callable[[], str | None] = lambda: None,
        leaving: Callable[[], bool] = lambda: False,
        abort_poll: float = 1.0,
    ) -> Averaging:
        """Start one averaging round over the buffers, in the averager process; poll or wait on the handle.

        ``abort_if`` is polled (every ``abort_poll`` s) while looking for a group and returns a reason to
        give up (the swarm already moved on), or None to keep waiting; ``leaving`` is polled throughout,
        all-reduce included, since a peer told to stop must not wait for one.
        """
        self.ensure_idle()  # a step still running would look for a group under the new key with its old data
        self.set_group_bits(group_bits, wait=False).result(timeout=30)
        control = self.step(weight=weight, gather=gather, timeout=timeout, allow_retries=True, wait=False)
        deadline = time.monotonic() + hard_timeout
        self._last_step = Averaging(control, deadline, hard_timeout, on_stage, abort_if, leaving, abort_poll)
        return self._last_step

    def start_fixed_averaging(
        self,
        *,
        group_id: bytes,
        members: Sequence[tuple[str, bool, Any]],
        weight: float,
        hard_timeout: float,
        leaving: Callable[[], bool] = lambda: False,
    ) -> Averaging:
        """``start_averaging`` among known ``members`` (``FixedGroups``): no matchmaking, the all-reduce at once."""
        self.ensure_idle()
        control = self.start_fixed_group(group_id, members, weight)
        deadline = time.monotonic() + hard_timeout
        self._last_step = Averaging(control, deadline, hard_timeout, lambda stage: None, lambda: None, leaving, 1.0)
        return self._last_step

    def ensure_idle(self) -> None:
        """Wait until the last step started here is over in the averager process; ``HelperError`` if it still
        runs ``IDLE_GRACE`` s after its own time was up.

        A step given up on (the swarm moved on, a timeout) is cancelled, but the averager process ends it only at its
        next look: an all-reduce it has begun runs to its end, and hivemind's own cancel could leave the step looking
        for a group until its deadline (``cancel_step``). Such a step takes part in a group anyway, on our buffers,
        and commits that group's average into them ("Can't set_result to a future that is CANCELLED" in its log).
        Seen in CI: a joiner's cancelled step of epoch 2 was still looking for a group when the joiner started its
        round of epoch 5; the new key let it in with its stale gather, the two honest groupmates each skipped the
        round, and the joiner's own step for epoch 5 found nobody. Until the step is over, the buffers are not ours
        to write and the group key is not ours to change. hivemind ends every step by its deadline (matchmaking,
        then its all-reduce), which our handle's ``deadline`` covers: past it, the process is stuck. A process that
        died meanwhile will never end it: that is said at once (``helpers.check_alive``)."""
        step = self._last_step
        if step is None:
            return
        until = step.deadline + IDLE_GRACE
        while not step.finished and time.monotonic() < until:
            check_alive({"averager": self})
            time.sleep(0.05)
        if step.finished:
            return
        raise HelperError(
            f"The averager process did not end an averaging step {IDLE_GRACE:.0f} s after its time was up; it may "
            f"be stuck or starved of CPU. The last round's checkpoint is kept: start the peer again."
        )

    def average(self, **kwargs: Any) -> AllReduceOutcome:
        """``start_averaging`` and wait: raises on failure, never waits past ``hard_timeout``."""
        return self.start_averaging(**kwargs).wait()


def start_averager(dht, shapes: Sequence[Sequence[int]], manifest: RunManifest, update_dir: Path):
    """The peer's averager process over zeroed pseudo-gradient buffers of these shapes, forked and ready.

    Start it before the model exists: a fork made while the model exists keeps a private copy of every page the
    training loop rewrites. A closed run's keys come from the DHT's (``swarm.dht.network.start_dht``)."""
    buffers = [torch.zeros(tuple(shape)) for shape in shapes]
    run_id, spec = manifest.run_id, manifest.averaging
    handler = signal.getsignal(signal.SIGINT)
    averager = PseudoGradientAverager(
        buffers,
        dht,
        run_id=run_id,
        update_dir=update_dir,
        secret=getattr(dht, "run_secret", None),
        start=True,
        prefix=run_prefix(run_id),
        client_mode=dht.client_mode,
        max_weight=float(manifest.inner_steps * manifest.samples_per_step),  # a round's samples, at most
        **averager_options(spec, sum(math.prod(shape) for shape in shapes)),
    )
    signal.signal(signal.SIGINT, handler)  # hivemind leaves SIGINT ignored in the process that starts it
    return averager


def rebuild_torch_thread_pool() -> None:
    """Call first thing in a forked child that will run torch ops on several threads at once.

    When the parent has called ``torch.set_num_threads`` (the engine tests do; so may a program that embeds
    swarm), a forked child rebuilds torch's thread pool on first use, and two threads doing that together can
    find no pool at all ("pool INTERNAL ASSERT FAILED ... Invalid thread pool!"). The averager process encodes
    and decodes parts on asyncio's executor threads; this failed about one first all-reduce in ten in the
    engine tests (the sender's part never left, and its groupmates dropped a third of the round). Rebuilt
    here, on one thread, before any part is touched (tests/test_averaging_fork.py)."""
    torch.set_num_threads(torch.get_num_threads())


def group_epoch(gathered: Iterable[Any]) -> int | None:
    """The epoch every member of a group gathered, or None: a group of mixed epochs is skipped by all its members
    (``OuterRound.poll``), so its average is no round's and is never kept for replay."""
    epochs = {data.get("epoch") if isinstance(data, dict) else None for data in gathered}
    epoch = epochs.pop() if len(epochs) == 1 else None
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None


def epoch_group_bits(epoch: int, bits: int = 16, bucket: str = "") -> str:
    """Matchmaking key bits for an epoch's first stage, so peers of different epochs never average together;
    ``bucket`` (``matchmaking_bucket``) splits a large swarm's matchmaking into keys of about a group each."""
    return format(epoch % (1 << bits), f"0{bits}b") + bucket


FINE_KEY_WINDOWS = 2  # matchmaking windows a peer looks in a key of about one group before it gives that key up


def attempt_timeout(bucket: str, matchmaking_time: float, matchmaking_timeout: float) -> float:
    """How long one first-stage attempt looks for a group. In a key of about one group's peers (a ``bucket``), a
    group forms within a window or two of ``matchmaking_time`` if the key holds peers enough; one the hash left
    with too few (five peers in four keys) is given up after that, for the others' second stage or a coarser key,
    not waited on for all of ``matchmaking_timeout``: every round of five peers in groups of two took 21 s, three of
    them alone in their keys (tests/test_engine_groups.py). The one key of a swarm that fits a group keeps it all."""
    if not bucket:
        return matchmaking_timeout
    return min(matchmaking_timeout, FINE_KEY_WINDOWS * matchmaking_time)


def matchmaking_bucket(peer_id: str, peers: float, group_size: int, retries: int = 0) -> str:
    """A peer's share of its epoch's first-stage matchmaking: one of about ``peers / group_size`` keys (a power of
    two, by a hash prefix of its id), so a search reads about a group's worth of entries whatever the swarm's size;
    the groups that form apart are merged in the second stage. Empty (one key) while the swarm fits one group.

    ``retries``: each attempt after one that found no group halves the key's bits, so the peers that failed in
    neighbouring keys meet in their common, coarser one. The estimate counts every key's record, and keys that are
    only records (which never matchmake) had split a swarm into keys that no group filled, every attempt alike."""
    buckets = max(1, peers / max(1, group_size))
    bits = min(16, math.ceil(math.log2(buckets))) if buckets > 1 else 0
    bits >>= min(retries, 5)
    if bits == 0:
        return ""
    value = int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big") >> (32 - bits)
    return format(value, f"0{bits}b")
