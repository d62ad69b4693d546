"""``Averaging.poll`` against a fake step control: the "has the swarm moved on" check reads the DHT, and while
it does the averager process may find a group and finish the all-reduce with us. Such a round is kept. And a
step that was given up on but that hivemind keeps running: nothing touches the buffers or the group key
until it has ended."""

import threading
import time
from types import SimpleNamespace

import pytest
from hivemind.averaging.control import AveragingStage

import swarm.averager.process as averaging_module
from swarm.averager.handle import Averaging, RoundAborted
from swarm.averager.process import PseudoGradientAverager, epoch_group_bits, group_epoch
from swarm.errors import HelperError
from swarm.events import PeerStats
from swarm.round.flight import Flight
from swarm.round.pipeline import OuterRound
from swarm.round.steps import RoundSteps


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


# ---- a cancelled step that hivemind keeps running ----------------------------------------------------------


def host(last_step: Averaging | None):
    """What ``PseudoGradientAverager``'s host side reads of itself, and a record of the calls made to the process."""
    fake = SimpleNamespace(_last_step=last_step, calls=[], is_alive=lambda: True, exitcode=None)
    fake.ensure_idle = lambda: PseudoGradientAverager.ensure_idle(fake)
    fake.set_group_bits = lambda bits, wait: fake.calls.append(("bits", bits, last_step_stage(fake))) or done_future()
    fake.step = lambda **kwargs: fake.calls.append(("step", kwargs["gather"])) or FakeControl()
    return fake


def last_step_stage(fake) -> AveragingStage | None:
    return None if fake._last_step is None else fake._last_step._control.stage


def done_future():
    return SimpleNamespace(result=lambda timeout: None)


def finish_later(control: FakeControl, seconds: float) -> threading.Thread:
    def finish():
        time.sleep(seconds)
        control.stage = AveragingStage.FINISHED

    thread = threading.Thread(target=finish, daemon=True)
    thread.start()
    return thread


def start(fake, epoch: int) -> Averaging:
    return PseudoGradientAverager.start_averaging(
        fake, weight=1.0, gather=dict(epoch=epoch), group_bits=epoch_group_bits(epoch), timeout=15.0, hard_timeout=60.0
    )


def test_the_next_step_waits_for_a_cancelled_one_that_hivemind_keeps_running():
    """As seen in CI: the step of epoch 2, cancelled when the swarm moved on, still ran when the round of epoch 5
    began; the new group key let it into that round's group with its epoch-2 data. The key is changed, and the
    new step started, only once the old one has ended in the averager process."""
    old = FakeControl()
    fake = host(averaging(old, abort_if=lambda: "moved on"))
    fake._last_step._deadline = time.monotonic() + 60
    with pytest.raises(RoundAborted):
        fake._last_step.poll()
    assert old.cancelled and old.stage == AveragingStage.LOOKING_FOR_GROUP  # cancelled, and still running
    finish_later(old, 0.3)
    start(fake, 5)
    assert fake.calls[0] == ("bits", epoch_group_bits(5), AveragingStage.FINISHED), fake.calls
    assert fake.calls[1] == ("step", dict(epoch=5))


def test_a_step_that_outlives_its_deadline_ends_the_peer_with_a_clear_error(monkeypatch):
    monkeypatch.setattr(averaging_module, "IDLE_GRACE", 0.2)
    stuck = averaging(FakeControl(), abort_if=lambda: None)
    stuck._deadline = time.monotonic()
    fake = host(stuck)
    with pytest.raises(HelperError, match="did not end an averaging step"):
        start(fake, 3)
    assert fake.calls == []  # nothing was changed in the averager process


def test_an_aborted_round_is_over_only_once_its_step_has_ended():
    """``OuterRound.poll``: the buffers are written after the round (a re-sync, a replay, the next
    pseudo-gradient), so an aborted round waits for its step to end in the averager process first."""
    control = FakeControl()
    step = averaging(control, abort_if=lambda: "moved on")
    step._deadline = time.monotonic() + 60
    fake = host(step)
    ctx = SimpleNamespace(
        averager=fake, manifest=SimpleNamespace(averaging=SimpleNamespace(overlap=True, merge_groups=False))
    )
    rounds = OuterRound(ctx, None, None, RoundSteps(), PeerStats(), on_findings=lambda findings, epoch: None)
    flight = Flight(epoch=2, samples=4, seconds={}, wait_until=0.0, attempt=step)
    finish_later(control, 0.3)
    assert rounds.poll(flight) is True
    assert flight.aborted is not None and control.stage == AveragingStage.FINISHED


def test_only_a_group_all_at_one_epoch_keeps_its_average_for_replay():
    assert group_epoch([dict(epoch=5), dict(epoch=5)]) == 5
    assert group_epoch([dict(epoch=2), dict(epoch=5), dict(epoch=5)]) is None  # the stale step's group
    assert group_epoch([dict(epoch=5), "garbage"]) is None
    assert group_epoch([dict(epoch=True)]) is None


def test_an_averager_that_died_under_a_running_step_is_said_at_once():
    """A dead process never ends its step: the wait for it stops at once, with the helper check's line."""
    fake = host(averaging(FakeControl(), abort_if=lambda: None))
    fake._last_step._deadline = time.monotonic() + 60
    fake.is_alive, fake.exitcode = (lambda: False), -9
    t0 = time.monotonic()
    with pytest.raises(HelperError, match="averager process ended"):
        start(fake, 3)
    assert time.monotonic() - t0 < 30 and fake.calls == []  # not the step's 60 s
