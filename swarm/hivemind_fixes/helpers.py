"""hivemind's helper processes (the DHT, the averager): a bounded start, and a check that they still run.

Works around: ``run_in_background(await_ready=True)`` waits for ever for a helper that died or hangs before it
is ready (checked on hivemind 1.1.12, ``utils/mpfuture.py`` and ``dht/dht.py``).

hivemind's own ``run_in_background(await_ready=True)`` waits for ever: a helper that dies
before it says it is ready (killed by the OOM killer, a crash in its first lines) or that
hangs there leaves the peer waiting with no message. Here the wait ends as soon as the
helper has died, or after ``READY_SECONDS``; either way the helper and its children (the
DHT's ``p2pd``) are killed and the volunteer gets one line saying what to do.

A helper that dies later, mid-run, took the peer down 30 s into its next round with a bare
``TimeoutError`` from a call to the dead averager. ``check_alive`` is called at each outer
round, and ends the peer at once with one line that says what happened.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import time

import psutil

from swarm.errors import HelperError

logger = logging.getLogger(__name__)

READY_SECONDS = 120.0  # a DHT bootstraps from its initial peers in this time (3-20 s over the internet)
POLL_SECONDS = 0.5
LAST_WORD_SECONDS = 2.0  # how long a helper's exception may trail its exit


def start_and_wait(helper: mp.Process, what: str) -> None:
    """Start a hivemind DHT or averager (created with start=False) and wait until it serves.

    Raises the helper's own exception if it failed to start, and ``HelperError`` if it died
    silently or did not get ready in ``READY_SECONDS``.
    """
    helper.run_in_background(await_ready=False)
    deadline = time.monotonic() + READY_SECONDS
    try:
        while True:
            try:
                helper.wait_until_ready(timeout=POLL_SECONDS)
                return
            except TimeoutError:
                pass
            if not helper.is_alive():
                # a helper that failed sends its exception just before it ends; it may arrive after the end is seen
                # (a closed run's refusal read as "out of memory", once): take it if it comes, else say it died
                with contextlib.suppress(TimeoutError):
                    helper.wait_until_ready(timeout=LAST_WORD_SECONDS)
                raise HelperError(
                    f"The {what} process ended (exit code {helper.exitcode}) before it was ready. This machine may be "
                    f"out of memory; free some, then start again."
                )
            if time.monotonic() > deadline:
                raise HelperError(
                    f"The {what} process was not ready after {READY_SECONDS:.0f} s. This machine may be overloaded or "
                    f"short of memory; check it with `swarm-client doctor`, then start again."
                )
    except BaseException:  # a failed start, a stop signal: nothing of the helper may outlive this peer
        kill_tree(helper.pid)
        raise


def check_alive(helpers: dict[str, mp.Process | None]) -> None:
    """Raise ``HelperError`` if one of the peer's helper processes (by name) has ended."""
    for what, helper in helpers.items():
        if helper is not None and not helper.is_alive():
            raise HelperError(
                f"The {what} process ended (exit code {helper.exitcode}) while the peer was training; this machine "
                f"may be out of memory. The last round's checkpoint is kept: free some memory, then start again."
            )


def kill_tree(pid: int | None) -> None:
    """SIGKILL a process and every process under it (a stuck helper cannot be asked to leave)."""
    if pid is None:
        return
    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
        except psutil.Error:
            logger.debug("could not kill helper process %s", proc.pid, exc_info=True)
    psutil.wait_procs(procs, timeout=5)
