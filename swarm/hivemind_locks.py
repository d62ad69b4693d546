"""hivemind's process-wide locks, which a process that dies holding one leaves taken for good.

hivemind makes them with ``mp.Lock()`` when it is imported: the futures' update and shared-byte locks, the
futures' backend lock and the async executor's lock. They are semaphores shared with every process forked
afterwards, so a DHT or averager process SIGKILLed (or terminated by hivemind's own ``shutdown`` after its grace
period) inside one leaves it locked, and every later helper forked from the same process hangs at its first
future: ``start_dht`` then said "The DHT process was not ready after 120 s" (a CI worker's in-process tests, after
an earlier test's helper died; a program that restarts a peer in the same process after a crash would meet it
too). ``start_dht`` and the averager free them before making their helper.

Replacing a lock is safe only because a dead holder keeps it for ever: a live process still using the old one can
never take it again, so it never writes to the pipe the new lock guards.
"""

from __future__ import annotations

import logging
import multiprocessing

logger = logging.getLogger(__name__)


def _holders() -> list[tuple[type, str]]:
    from hivemind.utils.asyncio import _AsyncContextWrapper
    from hivemind.utils.mpfuture import MPFuture, SharedBytes

    return [
        (MPFuture, "_initialization_lock"),
        (MPFuture, "_update_lock"),
        (SharedBytes, "_lock"),
        (_AsyncContextWrapper, "EXECUTOR_LOCK"),
    ]


def stuck_locks(wait: float = 2.0) -> list[str]:
    """The names of the locks nobody released within ``wait`` seconds (a live holder keeps one for milliseconds)."""
    stuck = []
    for owner, name in _holders():
        lock = getattr(owner, name)
        if lock.acquire(timeout=wait):
            lock.release()
        else:
            stuck.append(f"{owner.__name__}.{name}")
    return stuck


def replace_locks() -> None:
    """Fresh locks for the helpers forked from now on (the ones already running keep theirs)."""
    for owner, name in _holders():
        setattr(owner, name, multiprocessing.Lock())


def free_stuck_locks(wait: float = 2.0) -> list[str]:
    """Replace the locks if any is stuck, saying so; the names of the stuck ones."""
    stuck = stuck_locks(wait)
    if stuck:
        replace_locks()
        logger.warning("hivemind's process-wide locks were left taken by a helper process that died; replaced them")
        logger.debug("stuck: %s", ", ".join(stuck))
    return stuck
