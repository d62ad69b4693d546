"""The trainer yields the CPU to its own averaging, and to the volunteer's other programs.

Overlapped rounds average in the background while the trainer takes its next inner steps. The averager,
the DHT and ``p2pd`` are separate processes; at the same priority as a trainer that keeps every core busy,
they queued for the CPU behind it. On this project's 2-core host (four ``tiny`` peers, the wan benchmark)
an average then landed 3.8-3.9 inner steps of 10 after it took off on fast links, and the convergence
benchmark prices each step of lag (docs/benchmarks.md, section 6). With the trainer at nice 10 and its helpers
left where they were, it landed 1.8-1.9 steps after in the same run (4.6 against 5.1 at 10 Mbit/s), with the
compute as busy. Volunteer clients (BOINC, Folding@home) run their work at low priority for the other
reason: the machine stays its owner's.

Linux keeps a niceness per thread: every thread the trainer has is lowered, and the threads and processes
it starts later inherit it. The helpers, forked before this is called, keep theirs.
"""

from __future__ import annotations

import logging
import os
import sys

import psutil

logger = logging.getLogger(__name__)

DEFAULT_NICE = 10
MAX_NICE = 19


def lower_priority(niceness: int) -> int:
    """Lower this process's threads to ``niceness`` (0: leave them); never raises one that is already lower.

    Returns how many threads were changed. A thread that ended meanwhile is skipped."""
    if niceness <= 0:
        return 0
    if sys.platform != "linux":  # one niceness per process elsewhere
        if os.getpriority(os.PRIO_PROCESS, 0) < niceness:
            os.setpriority(os.PRIO_PROCESS, 0, niceness)
            return 1
        return 0
    changed = 0
    for _ in range(3):  # a thread started during one pass by a thread not yet lowered is caught by the next
        moved = 0
        for thread in psutil.Process().threads():
            try:
                if os.getpriority(os.PRIO_PROCESS, thread.id) < niceness:
                    os.setpriority(os.PRIO_PROCESS, thread.id, niceness)
                    moved += 1
            except ProcessLookupError:
                logger.debug("thread %d ended before its priority was lowered", thread.id)
        changed += moved
        if not moved:
            break
    return changed
