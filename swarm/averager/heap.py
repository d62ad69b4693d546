"""Freed memory goes back to the system in the averager process, which allocates and frees a round's worth of
buffers (parts as sent, as received, the averages, audits) every round.

glibc keeps freed memory in its heaps, and after each large block it frees it raises the size from which it
maps blocks on their own (up to 32 MiB), so every later part-sized buffer comes from a heap that does not
shrink; each executor thread gets a heap (arena) of its own, too. At 115M parameters the averager process
held much of that freed memory at the peak of a round, which put a peer over its memory budget (the memory
benchmark: docs/benchmarks.md, section 5). A fixed mapping threshold turns that raising off, so large buffers are
unmapped when freed; fewer arenas and a trim after each round return the rest. Elsewhere than glibc, nothing
is changed.
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # mallopt's parameters, from glibc's malloc.h
MMAP_THRESHOLD = 1 << 20  # blocks from 1 MiB up are mapped on their own, and unmapped when freed
ARENAS = 2


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): its allocator is left as it is
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def limit_retention(mmap_threshold: int = MMAP_THRESHOLD, arenas: int = ARENAS) -> bool:
    """Set this process's allocator to give large freed blocks back at once; True if it could."""
    libc = _libc()
    if libc is None:
        return False
    ok = all(
        libc.mallopt(param, value) == 1
        for param, value in ((M_MMAP_THRESHOLD, mmap_threshold), (M_TRIM_THRESHOLD, 2 * mmap_threshold))
    )
    ok = libc.mallopt(M_ARENA_MAX, arenas) == 1 and ok
    if not ok:
        logger.debug("mallopt refused a setting; the allocator keeps its defaults for it")
    return ok


def trim() -> None:
    """Give the free memory at the top of every heap back to the system (glibc's malloc_trim)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
