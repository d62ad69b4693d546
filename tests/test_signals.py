"""Stop signals in a real process: one that lands inside a finalizer still makes the program leave, silently."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent(
    """
    import os, signal, sys, time
    from client.signals import Stopper
    from swarm.errors import LeaveRequested

    stop = Stopper(deadline=30.0)
    stop.install()

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, inside the finalizer
            sum(range(10000))

    try:
        {body}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.01)
        print("never left")
    except LeaveRequested as stopped:
        print("left:", stopped)
    """
)


def run(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROGRAM.format(body=body)], capture_output=True, text=True, timeout=60)


def test_a_stop_that_lands_in_a_finalizer_is_delivered_again_outside_it():
    done = run("Finalized()")
    assert done.stdout.strip() == "left: SIGTERM received", done.stdout + done.stderr
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 0


def test_a_stop_swallowed_in_a_finalizer_inside_a_shielded_section_waits_for_its_end():
    done = run("with stop.shielded():\n            Finalized(); time.sleep(0.3); print('shield ended')")
    assert done.stdout.split("\n")[:2] == ["shield ended", "left: SIGTERM received"], done.stdout + done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr


def test_a_stopped_peers_leave_ends_before_the_watchdog_with_time_for_the_result():
    from client.signals import EXIT_MARGIN, GOODBYES, LEAVE_DEADLINE, RESULT_TIME, leave_timeout

    save_budget = LEAVE_DEADLINE - GOODBYES  # the whole budget, nothing spent on the inner state's save
    assert save_budget + leave_timeout(0.0) <= LEAVE_DEADLINE - EXIT_MARGIN - RESULT_TIME
    for spent in (0.0, 5.0, save_budget):  # the leave starts when the save is over, and ends at the same time
        assert spent + leave_timeout(save_budget - spent) == save_budget + leave_timeout(0.0)
    assert leave_timeout(-30.0) == 1.0  # a save that overran still leaves a second to say goodbye
