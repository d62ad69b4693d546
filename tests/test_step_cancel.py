"""A step given up on must be seen cancelled by the averager process.

hivemind's ``StepControl.cancel`` wakes the averager before it marks the step cancelled. A training process
descheduled between the two (a loaded machine) left the averager running the step: in a CI run a joiner's
cancelled step of epoch 2 went on looking for a group and joined epoch 5's with its old gather.
``swarm.hivemind_fixes.step_cancel.cancel_step`` marks the step first."""

from __future__ import annotations

import time

from client_helpers import run_script
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.utils.mpfuture import MPFuture

from swarm.averager.handle import Averaging, RoundAborted
from swarm.hivemind_fixes.step_cancel import cancel_step


class Watch:
    """Stands in for the averager's end of the cancel future: records whether the step was already marked
    cancelled when the averager was woken."""

    def __init__(self, control: StepControl):
        self.control, self.seen = control, []

    def set_result(self, value) -> None:
        self.seen.append(self.control.cancelled())


def new_step() -> StepControl:
    # a plain MPFuture first: the first one a process makes sets up the class's backend, and StepControl's own
    # set-up (a classmethod) would set it up on StepControl instead
    MPFuture().set_result(None)
    return StepControl(scheduled_time=time.time(), deadline=time.time() + 60, allow_retries=True, weight=1.0,
                       data_for_gather=b"")  # fmt: skip


def attached_step() -> tuple[StepControl, Watch]:
    control = new_step()
    control.attach(MPFuture(), MPFuture())
    watch = Watch(control)
    control._cancel = watch  # the averager's side, as it would be woken
    return control, watch


def test_hivemind_wakes_the_averager_before_it_marks_the_step_cancelled():
    control, watch = attached_step()  # why cancel_step exists: if hivemind changes this order, so may we
    control.cancel()
    assert watch.seen == [False]
    assert control.cancelled()


def test_a_step_given_up_on_is_marked_cancelled_before_the_averager_is_woken():
    control, watch = attached_step()
    control.stage = AveragingStage.LOOKING_FOR_GROUP
    handle = Averaging(
        control, deadline=float("inf"), hard_timeout=60.0, on_stage=lambda stage: None,
        abort_if=lambda: "the swarm moved on", leaving=lambda: False, abort_poll=0.0,
    )  # fmt: skip
    try:
        handle.poll()
        raise AssertionError("the step was not given up on")
    except RoundAborted:
        pass
    assert watch.seen == [True]
    assert control.cancelled()


def test_cancel_step_cancels_the_step_and_its_futures():
    control = new_step()
    control.attach(MPFuture(), MPFuture())
    trigger, cancel = control._trigger, control._cancel
    cancel_step(control)
    assert control.cancelled() and trigger.cancelled() and cancel.done()


SCRIPT = r"""
import concurrent.futures, json, os, sys, time
import torch
from hivemind.averaging.control import StepControl
import swarm.averager.handle as handle_module
from swarm.averager.handle import RoundAborted
from swarm.averager.process import PseudoGradientAverager, epoch_group_bits
from swarm.dht.network import NetworkConfig, start_dht

if sys.argv[1] == "hivemind":
    handle_module.cancel_step = lambda control: control.cancel()  # hivemind's own order
mark = concurrent.futures.Future.cancel
def descheduled(self):  # the training process loses the CPU right before it marks the step cancelled
    if isinstance(self, StepControl):
        time.sleep(1.0)
    return mark(self)
concurrent.futures.Future.cancel = descheduled

dht = start_dht(NetworkConfig(host_ip="127.0.0.1", host_port=0))
averager = PseudoGradientAverager(
    [torch.zeros(4)], dht, run_id="0" * 16, prefix="t", start=True, min_group_size=2, target_group_size=2,
    min_matchmaking_time=1.0, request_timeout=0.5,
)
handle = averager.start_averaging(
    weight=1.0, gather=dict(epoch=0), group_bits=epoch_group_bits(0), timeout=MATCHMAKING, hard_timeout=90.0,
    abort_if=lambda: "the swarm moved on", abort_poll=0.0,
)
aborted = False
try:
    while not handle.poll():
        time.sleep(0.02)
except RoundAborted:
    aborted = True
given_up = time.monotonic()
while not handle.finished and time.monotonic() - given_up < MATCHMAKING + 15:
    time.sleep(0.05)
print("RESULT " + json.dumps(dict(aborted=aborted, finished=handle.finished, seconds=time.monotonic() - given_up)))
sys.stdout.flush()
os._exit(0)
"""
MATCHMAKING = 40.0  # the step's own time to find a group: a step the averager kept runs until about then


def test_a_step_given_up_on_ends_in_the_averager_process_though_the_trainer_was_descheduled(tmp_path):
    script = SCRIPT.replace("MATCHMAKING", repr(MATCHMAKING))
    result, _ = run_script(script, "swarm", cwd=tmp_path, timeout=180)
    assert result["aborted"] and result["finished"], result
    # hivemind's order leaves the step looking for a group until its matchmaking time is up (about 40 s here)
    assert result["seconds"] < MATCHMAKING / 2, result
