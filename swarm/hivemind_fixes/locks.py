"""hivemind's process-wide locks, which a process that dies holding one leaves taken for good.

Works around: the four ``mp.Lock()`` hivemind makes at import (``utils/mpfuture.py``, ``utils/asyncio.py``), which
have no owner and no timeout (checked on hivemind 1.1.12).

hivemind makes them with ``mp.Lock()`` when it is imported: the futures' update and shared-byte locks, the
futures' backend lock and the async executor's lock. They are semaphores shared with every process forked
afterwards, so a DHT or averager process SIGKILLed (or terminated by hivemind's own ``shutdown`` after its grace
period) inside one leaves it locked:

- every later helper forked from the same process hung at its first future: ``start_dht`` then said "The DHT
  process was not ready after 120 s" (a CI worker's in-process tests, after an earlier test's helper died);
- the peer itself and its surviving helpers hung at their next future (the training process makes one for every
  DHT read and averager call), in an acquire with no timeout that not even SIGTERM gets out of.

Two defences. ``install`` puts a ``ReclaimableLock`` in each lock's place, before the first helper is forked, so
that the peer and every helper forked after it share it: a holder that has not let go after ``STUCK_AFTER``
seconds is taken to have died inside it, and the lock is replaced in the process that waited, with one warning
line. ``free_stuck_locks`` checks all four before a helper is made, with a shorter wait, and reclaims a stuck one
at once, so the new helper starts on free locks.

A dead holder keeps its lock for ever, so every live process that needs it ends up replacing it. Each
``ReclaimableLock`` is made with a few spare semaphores, before any helper is forked, so every process holds the
same spares in the same order: each one that reclaims moves to the same next one, and the processes still
exclude one another (two helpers writing one pipe at once would interleave their messages). A live holder keeps
one of these locks for milliseconds (a pipe write, a 16-byte shared-memory allocation, the first future of a
process), so a false reclaim needs a process descheduled inside one for ``STUCK_AFTER`` seconds.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from typing import Any

logger = logging.getLogger(__name__)

STUCK_AFTER = 20.0  # seconds a holder may keep one of these locks before it is taken to have died inside it
SPARES = 3  # replacements shared by every process forked after the lock was made; then each process's own


class ReclaimableLock:
    """A process-shared lock (``multiprocessing.Lock``) that a dead process may be holding.

    An acquire with no timeout of its own waits ``STUCK_AFTER`` seconds, then replaces the lock in this process
    (and the processes forked from it afterwards) with the next spare, which every process that reclaims moves to,
    and takes it. An acquire with its own timeout, or none at all, behaves as the plain lock's. Each acquire is
    released on the lock it took, even after a replacement."""

    def __init__(self, name: str):
        self.name = name
        self._lock = multiprocessing.Lock()
        self._spares = [multiprocessing.Lock() for _ in range(SPARES)]
        self._taken = threading.local()  # per thread, the locks this thread holds, innermost last

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        lock = self._lock
        if not block or timeout is not None:
            taken = lock.acquire(block, timeout) if block else lock.acquire(False)
        else:
            taken = lock.acquire(timeout=STUCK_AFTER)
            if not taken:
                lock = self.reclaim(lock, STUCK_AFTER)
                taken = lock.acquire()
        if taken:
            self._stack().append(lock)
        return taken

    def release(self) -> None:
        stack = self._stack()
        (stack.pop() if stack else self._lock).release()

    def __enter__(self) -> ReclaimableLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.release()

    def _stack(self) -> list:
        if not hasattr(self._taken, "locks"):
            self._taken.locks = []
        return self._taken.locks

    def reclaim(self, stuck: Any, waited: float) -> Any:
        """Move on from ``stuck`` (the semaphore nobody let go of for ``waited`` seconds) to the next spare, unless
        another thread of this process already did; the semaphore now in use."""
        if self._lock is stuck:
            self._lock = self._spares.pop(0) if self._spares else multiprocessing.Lock()
            logger.warning(
                "hivemind's %s was held for %.0f s, by a process that must have died inside it; replaced it",
                self.name,
                waited,
            )
        return self._lock

    @property
    def current(self) -> Any:
        return self._lock


def _holders() -> list[tuple[type, str]]:
    from hivemind.utils.asyncio import _AsyncContextWrapper
    from hivemind.utils.mpfuture import MPFuture, SharedBytes

    return [
        (MPFuture, "_initialization_lock"),
        (MPFuture, "_update_lock"),
        (SharedBytes, "_lock"),
        (_AsyncContextWrapper, "EXECUTOR_LOCK"),
    ]


def _names() -> list[tuple[type, str, str]]:
    return [(owner, name, f"{owner.__name__}.{name}") for owner, name in _holders()]


def _free_within(lock: Any, wait: float) -> bool:
    """Whether someone let go of ``lock`` within ``wait`` seconds (a live holder keeps one for milliseconds)."""
    if lock.acquire(timeout=wait):
        lock.release()
        return True
    return False


def stuck_locks(wait: float = 2.0) -> list[str]:
    """The names of the locks nobody released within ``wait`` seconds."""
    return [full_name for owner, name, full_name in _names() if not _free_within(getattr(owner, name), wait)]


def replace_locks() -> None:
    """Fresh locks for this process and the helpers forked from now on (the ones already running keep theirs)."""
    for owner, name, full_name in _names():
        setattr(owner, name, ReclaimableLock(full_name))


def install() -> None:
    """Reclaimable locks in place of hivemind's plain ones, unless they are there already. Call it before this
    process forks its first helper: a thread inside one of the old locks at that moment would not exclude a
    thread entering the new one."""
    if not all(isinstance(getattr(owner, name), ReclaimableLock) for owner, name in _holders()):
        replace_locks()


def free_stuck_locks(wait: float = 2.0) -> list[str]:
    """Install the reclaimable locks, and reclaim each one nobody let go of within ``wait`` seconds (one warning
    line each), so the helper about to be forked starts on free ones: the same spares the helpers already running
    move to when they meet the stuck lock. The names of the stuck ones."""
    install()
    stuck = []
    for owner, name, full_name in _names():
        lock = getattr(owner, name)
        current = lock.current
        if not _free_within(lock, wait):
            lock.reclaim(current, wait)
            stuck.append(full_name)
    return stuck
