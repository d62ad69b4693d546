"""``Averaging.poll`` against a fake step control: the "has the swarm moved on" check reads the DHT, and while
it does the averager process may find a group and finish the all-reduce with us. Such a round is kept."""

import pytest
from hivemind.averaging.control import AveragingStage

from swarm.averaging import Averaging, RoundAborted


class FakeControl:
    def __init__(self):
        self.stage = AveragingStage.LOOKING_FOR_GROUP
        self.finished = False
        self.cancelled = False

    def done(self) -> bool:
        return self.finished or self.cancelled

    def cancel(self) -> bool:
        self.cancelled = not self.finished
        return self.cancelled


def averaging(control, abort_if) -> Averaging:
    return Averaging(
        control, deadline=float("inf"), hard_timeout=60.0, on_stage=lambda stage: None,
        abort_if=abort_if, leaving=lambda: False, abort_poll=0.0,
    )  # fmt: skip


def test_a_swarm_that_moved_on_aborts_a_step_still_looking_for_a_group():
    control = FakeControl()
    step = averaging(control, abort_if=lambda: "moved on")
    with pytest.raises(RoundAborted):
        step.poll()
    assert control.cancelled


@pytest.mark.parametrize("finished", [False, True], ids=["all-reduce-running", "all-reduce-done"])
def test_a_group_found_while_the_check_read_the_dht_is_kept(finished):
    control = FakeControl()

    def moved_on_meanwhile() -> str:  # the groupmates finished the round with us and published their new epoch
        control.stage = AveragingStage.FINISHED if finished else AveragingStage.RUNNING_ALLREDUCE
        control.finished = finished
        return "moved on"

    step = averaging(control, abort_if=moved_on_meanwhile)
    assert step.poll() is False  # not aborted: the next poll sees the step's own end
    assert not control.cancelled
    control.stage, control.finished = AveragingStage.FINISHED, True
    assert step.poll() is True
