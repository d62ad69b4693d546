"""Make hivemind's helper processes die with the peer that started them.

Works around: hivemind's forked DHT and averager processes (and the DHT's ``p2pd``) outliving a SIGKILLed parent
(checked on hivemind 1.1.12).

hivemind forks a DHT process and an averager process, and the DHT process starts
the ``p2pd`` daemon. When a volunteer's peer is killed with SIGKILL (an OOM kill,
a spot preemption), those children are orphaned and would keep answering in the
swarm as a ghost peer. A watcher thread in each forked child notices that its
parent is gone, terminates its own children (``p2pd``) and exits.
"""

from __future__ import annotations

import os
import threading
import time

import psutil

_installed = False
POLL_SECONDS = 0.5


def _reap_children_and_exit() -> None:
    me = psutil.Process()
    children = me.children(recursive=True)
    for child in children:
        try:
            child.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(children, timeout=3)
    for child in alive:
        try:
            child.kill()
        except psutil.Error:
            pass
    os._exit(0)


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(POLL_SECONDS)
        if os.getppid() != parent_pid:
            _reap_children_and_exit()


def _after_fork_in_child() -> None:
    parent = os.getppid()
    threading.Thread(target=_watch_parent, args=(parent,), name="swarm-orphan-watch", daemon=True).start()


def install_orphan_reaper() -> None:
    """Every process forked from here on exits, with its children, once its parent dies."""
    global _installed
    if not _installed:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _installed = True
