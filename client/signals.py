"""Stop signals, handled from the first line of the program, and the deadline for leaving.

- SIGTERM or SIGINT (Ctrl-C): raise ``LeaveRequested`` in the main thread at once, wherever
  it is (building the model, joining, downloading the state, in an inner step, in a
  round), except inside ``shielded()`` sections, which finish first. The program then
  leaves: the last round's checkpoint stays on disk, the peer says goodbye, its
  processes stop. A second one ends the process at once.
- SIGUSR1: a flag; the loop finishes the round it is in, then leaves.
- A watchdog: ``LEAVE_DEADLINE`` seconds after the first stop signal the process ends
  whatever it is doing (a spot VM gets 30 s of notice), killing its helper processes
  and p2pd; the exit code says whether the newest checkpoint was on disk by then.

A stop that lands while the interpreter runs a finalizer (a ``__del__``, such as torch's storage
release) cannot leave it: Python swallows it there and prints "Exception ignored". The
unraisable hook catches that one and delivers the stop again to the main thread, where it leaves.

In a container the peer is PID 1, which the kernel does not kill for a signal it has
no handler for; installing these before anything heavy is imported leaves only the
interpreter's own start-up unprotected.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

from swarm.errors import LeaveRequested

LEAVE_DEADLINE = 20.0  # seconds from the first stop signal to exit, whatever happens
EXIT_MARGIN = 1.5  # the watchdog acts this long before the deadline
GOODBYES = 4.0  # seconds of a stop's deadline kept from the inner state's save: the peer's leave, then the result
RESULT_TIME = 0.5  # of them, for writing the result file once the peer has left, before the watchdog acts


def leave_timeout(budget_left: float) -> float:
    """How long the peer's leave may wait, with ``budget_left`` seconds of the save's budget left: the goodbyes'
    time too, but ending before the watchdog with time to write the result (at budget + 3 s a leave could run 0.5 s
    past the watchdog, whose exit writes no --result-file); at least a second."""
    return max(1.0, budget_left + GOODBYES - EXIT_MARGIN - RESULT_TIME)


def _reset_in_child() -> None:
    """Forked helpers (DHT, averager) die on SIGTERM as usual and ignore the terminal's Ctrl-C."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def kill_children() -> None:
    """SIGKILL every descendant (the DHT and averager processes, p2pd): nothing of the peer outlives it."""
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(children, timeout=3)


def _interrupt_soon(signum: int) -> None:
    """Deliver ``signum`` to the main thread's handler once the finalizer it was swallowed in has ended."""
    time.sleep(0.01)
    _thread.interrupt_main(signum)


class Stopper:
    def __init__(self, deadline: float = LEAVE_DEADLINE):
        self.deadline = deadline
        self.requested = False  # a stop signal arrived
        self.after_round = False  # SIGUSR1: finish the round, then leave
        self.signal_name = ""
        self.signalled_at: float | None = None
        self._shielded = 0
        self._pending = False  # a stop arrived inside a shielded section
        self._listeners: list[Callable[[str], None]] = []
        self._round_listeners: list[Callable[[], None]] = []
        self.checkpoint_done: Callable[[], bool] = lambda: True
        self._installed = False
        self._redeliver = False  # a stop swallowed in a finalizer is being delivered again
        self._next_unraisable_hook = sys.unraisablehook

    def install(self) -> None:
        if self._installed:
            return
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGUSR1, self._on_usr1)
        self._next_unraisable_hook = sys.unraisablehook
        sys.unraisablehook = self._on_unraisable
        os.register_at_fork(after_in_child=_reset_in_child)
        self._installed = True

    def on_stop(self, listener: Callable[[str], None]) -> None:
        """Called (on the main thread, from the handler) with the signal's name when a stop arrives."""
        self._listeners.append(listener)

    def on_leave_after_round(self, listener: Callable[[], None]) -> None:
        self._round_listeners.append(listener)

    @contextlib.contextmanager
    def shielded(self) -> Iterator[None]:
        """A section that must not be cut short: a stop arriving inside it is raised when it ends."""
        self._shielded += 1
        try:
            yield
        finally:
            self._shielded -= 1
        if self._shielded == 0 and self._pending:
            self._pending = False
            raise LeaveRequested(f"{self.signal_name} received")

    def check(self) -> None:
        """Raise ``LeaveRequested`` if a stop was asked for (for loops that poll)."""
        if self.requested and self._shielded == 0:
            raise LeaveRequested(f"{self.signal_name} received")

    def _on_stop(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        if self._redeliver:  # the stop a finalizer swallowed, delivered again
            self._redeliver = False
            self._raise_or_defer()
            return
        if self.requested:  # the second one: out now
            print(f"{name} received again: quitting at once.", file=sys.stderr, flush=True)
            kill_children()
            os._exit(130)
        self.requested, self.signal_name, self.signalled_at = True, name, time.monotonic()
        threading.Thread(target=self._watchdog, name="swarm-leave-deadline", daemon=True).start()
        for listener in self._listeners:
            listener(name)
        self._raise_or_defer()

    def _raise_or_defer(self) -> None:
        if self._shielded:
            self._pending = True
        else:
            raise LeaveRequested(f"{self.signal_name} received")

    def _on_unraisable(self, unraisable) -> None:
        """A stop raised inside a finalizer is lost there: raise it again in the main thread, silently."""
        if not (isinstance(unraisable.exc_value, LeaveRequested) and self.requested):
            self._next_unraisable_hook(unraisable)
            return
        self._redeliver = True
        signum = signal.Signals[self.signal_name]
        threading.Thread(target=_interrupt_soon, args=(signum,), name="swarm-stop-again", daemon=True).start()

    def _on_usr1(self, _signum: int, _frame) -> None:
        self.after_round = True
        for listener in self._round_listeners:
            listener()

    def _watchdog(self) -> None:
        time.sleep(max(0.0, self.deadline - EXIT_MARGIN))
        done = False
        with contextlib.suppress(Exception):
            done = bool(self.checkpoint_done())
        print(
            f"Still not out {self.deadline - EXIT_MARGIN:.0f} s after {self.signal_name}: exiting now "
            f"({'the last checkpoint is on disk' if done else 'the newest checkpoint was not finished'}).",
            file=sys.stderr,
            flush=True,
        )
        kill_children()
        os._exit(0 if done else 1)


STOP = Stopper()
