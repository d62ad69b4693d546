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
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.utils.asyncio import as_aiter, azip
from hivemind.utils.mpfuture import MPFuture

from swarm.averager import heap
from swarm.averager.allreduce import ExactAllReduceRunner, check_parts, decode_into
from swarm.averager.auditing import Auditing
from swarm.averager.codecs import codec
from swarm.averager.refusals import Refusals
from swarm.averager.transfer import FileTransfer
from swarm.defence.audit import MALFORMED
from swarm.dht.access import RunSecret
from swarm.errors import HelperError
from swarm.hivemind_fixes.helpers import check_alive, start_and_wait
from swarm.hivemind_fixes.locks import free_stuck_locks
from swarm.hivemind_fixes.pace import pace_matchmaking
from swarm.manifest import Aggregation, AveragingSpec

logger = logging.getLogger(__name__)


def averager_options(avg: AveragingSpec) -> dict[str, Any]:
    """What the manifest's averaging section asks of ``PseudoGradientAverager`` (and hivemind's averager under it)."""
    return dict(
        keep_updates=avg.replay_rounds,
        aggregation=avg.aggregation,
        audit=avg.checked_reducers,
        audit_timeout=avg.allreduce_timeout / 2,  # the other half re-checks accusations
        audit_parts=avg.audit_parts,
        target_group_size=avg.target_group_size,
        min_group_size=avg.min_group_size,
        min_matchmaking_time=avg.matchmaking_time,
        request_timeout=min(3.0, avg.matchmaking_time / 2),
        allreduce_timeout=avg.allreduce_limit,  # the host's attempt_limit is built on the same bound
        next_chunk_timeout=avg.chunk_timeout,
        compression=codec(avg.compression),
        allow_state_sharing=False,  # until the peer has a state to offer (``Checkpoints.announce``)
        declare_state_period=10,
        shutdown_timeout=3,
    )


IDLE_GRACE = 10.0  # a step still running this long after its deadline means a stuck averager process


@dataclass(frozen=True)
class AllReduceOutcome:
    """What one successful all-reduce did; returned by ``PseudoGradientAverager.average``."""

    group: tuple[str, ...]  # base58 peer ids, this peer included
    gathered: dict[str, Any]  # each groupmate's ``gather`` payload
    dropped_fraction: float  # share of values whose reducer vanished (set to zero)
    excluded_senders: int  # groupmates whose contribution was left out of some parts
    bytes_sent: int = 0  # tensor payload this peer sent (parts to reducers, averages back to senders)
    bytes_received: int = 0  # tensor payload this peer received
    # checked reducers: what this peer's audits (and its checks of others' accusations) found; each a dict of
    # peer, verdict (audit.Verdict's value, or auditing.FALSE_ACCUSATION), banned, discarded, receipt (signed)
    findings: tuple[dict, ...] = ()
    audit_seconds: float = 0.0  # after the all-reduce, until every audit and re-check was done
    audit_bytes: int = 0  # parts this peer downloaded for its audits
    # checked reducers: slices that came in part and could not be fetched again whole (so were dropped); each a dict
    # of peer and failure (auditing.RepairFailure's value)
    repair_failures: tuple[dict, ...] = ()
    # when (``time.monotonic``, one clock for every process of the machine) the averager process began the
    # all-reduce with its group, and when it was done (the average in the buffers, audited, and kept for replay):
    # what an overlapped round's host, which looks once per inner step, cannot time itself
    allreduce_started: float | None = None
    allreduce_finished: float | None = None


class RoundAborted(RuntimeError):
    """Averaging was given up on purpose: ``leaving`` says whether the peer is on its way out."""

    def __init__(self, reason: str, leaving: bool = False):
        super().__init__(reason)
        self.reason, self.leaving = reason, leaving


def cancel_step(control) -> None:
    """Cancel a hivemind step so that the averager process cannot miss it.

    hivemind's ``StepControl.cancel`` first wakes the averager's watch (its cancel future, over a pipe) and only
    then marks the step cancelled (in shared memory). An averager that wakes in between, as when the training
    process is descheduled on a loaded machine, reads a step that is not cancelled, stops watching and goes on
    with it: it keeps looking for a group (or retries its matchmaking), joins one under whatever group key is set
    later, with the old round's gather, and fails at the end on "Can't set_result to a future that is CANCELLED".
    Marked first, the step is seen cancelled by the time the averager wakes."""
    if isinstance(control, StepControl):  # not the tests' fakes of one
        MPFuture.cancel(control)  # the step's own state: a write to shared memory, seen by the averager at once
    control.cancel()  # then hivemind's: cancels the trigger and wakes the averager


class Averaging:
    """One averaging round under way in the averager process, watched from the training thread."""

    def __init__(self, control, deadline: float, hard_timeout: float, on_stage, abort_if, leaving, abort_poll: float):
        self._control, self._deadline, self._hard_timeout = control, deadline, hard_timeout
        self._on_stage, self._abort_if, self._leaving, self._abort_poll = on_stage, abort_if, leaving, abort_poll
        self._stage = None
        self._next_poll = time.monotonic() + abort_poll

    @property
    def deadline(self) -> float:
        return self._deadline

    def poll(self) -> bool:
        """True once the round is over (``result`` then returns or raises); raises ``RoundAborted`` or
        ``TimeoutError`` when it was given up."""
        control = self._control
        if control.stage != self._stage:
            self._stage = control.stage
            self._on_stage(self._stage.name)
        if control.done():
            return True
        if self._leaving():
            cancel_step(control)
            raise RoundAborted("the peer is leaving", leaving=True)
        if time.monotonic() > self._deadline:
            cancel_step(control)
            raise TimeoutError(f"averaging did not finish in {self._hard_timeout:.0f} s")
        if self._stage == AveragingStage.LOOKING_FOR_GROUP and time.monotonic() > self._next_poll:
            self._next_poll = time.monotonic() + self._abort_poll
            reason = self._abort_if()
            # the check reads the DHT, and meanwhile the averager may have found a group, even finished its
            # all-reduce with us (the groupmates' new epoch is what the check saw): that round is ours to keep
            if reason is not None and control.stage == AveragingStage.LOOKING_FOR_GROUP and not control.done():
                cancel_step(control)
                raise RoundAborted(reason)
        return False

    @property
    def finished(self) -> bool:
        """Whether the averager process has let go of the step (done is not enough: a cancelled step is done
        on our side at once, while hivemind may still run it)."""
        return self._control.stage == AveragingStage.FINISHED

    def wait(self) -> AllReduceOutcome:
        while not self.poll():
            time.sleep(0.02)
        return self.result()

    def result(self) -> AllReduceOutcome:
        return AllReduceOutcome(**self._control.result())


class PseudoGradientAverager(Auditing, Refusals, FileTransfer, DecentralizedAverager):
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
        secret: RunSecret | None = None,
        start: bool = False,
        **kwargs: Any,
    ):
        self._round_stats: dict[bytes, tuple] = {}
        self._last_step: Averaging | None = None  # the host's handle on the last step it started
        self.aggregation = aggregation
        self._init_transfer(update_dir, keep_updates, run_id, secret)
        self._init_auditing(audit, audit_timeout, audit_parts)
        self._init_refusals()
        free_stuck_locks()  # one a dead helper kept would hang this averager at its first future
        super().__init__(averaged_tensors, dht, start=False, **kwargs)
        if secret is not None:  # a leader refuses join requests with another schema hash: outsiders' included
            self.schema_hash = secret.schema_hash(self.schema_hash)
        if start:
            start_and_wait(self, "averager")

    # ---- averaging (runs in the averager process) ------------------------------------------------

    def _run_internal(self) -> None:
        rebuild_torch_thread_pool()
        heap.limit_retention()
        pace_matchmaking()
        super()._run_internal()

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes | None = None, **kwargs: Any
    ) -> None:
        group_id = group_info.group_id if group_id is None else group_id
        members = [p.to_base58() for p in group_info.peer_ids]
        self._check_group(members, group_id)
        runner = ExactAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            aggregation=self.aggregation,
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
            self._audit_rounds.pop(group_id, None)  # nothing to audit: let the parts we sent go now
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
                check_parts(tensor, parts)
            for tensor, parts in zip(tensors, held):
                decode_into(tensor, parts)

        await asyncio.get_event_loop().run_in_executor(None, commit)
        total = max(1, runner.tensor_part_container.total_size)
        self._round_stats[group_id] = (
            (runner.tensor_part_container.failed_size + discarded) / total,
            len(runner.banned_senders),
            runner.bytes_sent,
            runner.bytes_received,
            held,
            tuple(findings),
            audit_seconds,
            record.fetched_bytes if record is not None else 0,
            tuple(repair_failures),
        )

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> dict:
        started = time.monotonic()
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        empty = (0.0, 0, 0, 0, None, (), 0.0, 0, ())
        stats = self._round_stats.pop(group_info.group_id, empty)
        dropped, excluded, sent, received, held, findings, audit_seconds, audit_bytes, repair_failures = stats
        epoch = group_epoch(gathered.values())
        if held is not None and epoch is not None:
            try:  # the average as it came off the wire, for peers that replay the round later
                await asyncio.get_event_loop().run_in_executor(None, self.keep_update, epoch, held)
            except OSError:
                logger.debug("could not keep the round's update", exc_info=True)
        del held  # the round's buffers are all gone now (the host reads the average from the shared buffers)
        heap.trim()
        return dict(
            group=tuple(p.to_base58() for p in group_info.peer_ids),
            gathered={peer.to_base58(): data for peer, data in gathered.items()},
            dropped_fraction=dropped,
            excluded_senders=excluded,
            bytes_sent=sent,
            bytes_received=received,
            findings=findings,
            audit_seconds=audit_seconds,
            audit_bytes=audit_bytes,
            repair_failures=repair_failures,
            allreduce_started=started,
            allreduce_finished=time.monotonic(),
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

    def ensure_idle(self) -> None:
        """Wait until the last step started here is over in the averager process; ``HelperError`` if it still
        runs ``IDLE_GRACE`` s after its own time was up.

        A step given up on (the swarm moved on, a timeout) is cancelled, but the averager process ends it only
        at its next look: an all-reduce it has begun runs to its end, and hivemind's own cancel could leave the
        step looking for a group until its deadline (``cancel_step``). Such a step takes part in a group anyway,
        on our buffers, and commits that group's average into them ("Can't set_result to a future that is
        CANCELLED" in its log). Seen in CI: a joiner's cancelled step of epoch 2 was still looking for a group
        when the joiner started its round of epoch 5; the new key let it in with its stale gather, the two
        honest groupmates each skipped the round, and the joiner's own step for epoch 5 found nobody. Until the
        step is over, the buffers are not ours to write and the group key is not ours to change. hivemind ends
        every step by its deadline (matchmaking, then its all-reduce), which our handle's ``deadline`` covers:
        past it, the process is stuck. A process that died meanwhile will never end it: that is said at once
        (``helpers.check_alive``)."""
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


def epoch_group_bits(epoch: int, bits: int = 16) -> str:
    """Matchmaking key bits for an epoch, so peers of different epochs never average together."""
    return format(epoch % (1 << bits), f"0{bits}b")
