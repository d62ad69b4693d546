"""Cancelling a hivemind averaging step so that the averager process cannot miss it.

Works around: hivemind 1.1.12's ``StepControl.cancel`` wakes the averager's watch before it marks the step cancelled
(checked on hivemind 1.1.12, ``averaging/control.py``). An averager that wakes in between kept the step alive
(``tests/test_step_cancel.py`` shows it with hivemind's own order).
"""

from __future__ import annotations

from hivemind.averaging.control import StepControl
from hivemind.utils.mpfuture import MPFuture


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
