"""One averaging round under way in the averager process, as the training thread sees it: a handle it polls
between inner steps (an overlapped round) or waits on (a blocking one), and what a round that succeeded did."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from hivemind.averaging.control import AveragingStage

from swarm.hivemind_fixes.step_cancel import cancel_step


@dataclass(frozen=True)
class AllReduceOutcome:
    """What one successful all-reduce did; returned by ``PseudoGradientAverager.average``."""

    group: tuple[str, ...]  # base58 peer ids, this peer included
    gathered: dict[str, Any]  # each groupmate's ``gather`` payload
    dropped_fraction: float  # share of values whose reducer vanished (set to zero)
    excluded_senders: int  # groupmates whose contribution was left out of some parts
    absent: tuple[str, ...] = ()  # their peer ids (a second stage is tried again without them)
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
    group_id: bytes = b""  # hivemind's id of the group
    digest: str = ""  # of the average's parts as every groupmate received them (hex): the same for all of them


class RoundAborted(RuntimeError):
    """Averaging was given up on purpose: ``leaving`` says whether the peer is on its way out."""

    def __init__(self, reason: str, leaving: bool = False):
        super().__init__(reason)
        self.reason, self.leaving = reason, leaving


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
