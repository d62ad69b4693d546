"""Starts engine workers by forking them from a server that has already imported torch, transformers and
hivemind, instead of as fresh interpreters.

A fresh worker spends about 10 s of CPU before its first line of test code: 7-8 s importing torch,
transformers and hivemind, and 2-3 s in the first model build, which imports the rest of transformers
(torch.distributed.tensor, sympy). With three workers starting at once on CI's two cores, that was 15 s of
every engine test, over 55 starts a run. multiprocessing's fork server pays it once: it imports those
modules and builds a model (``worker_warmup``), then forks each worker from that state, as the stdlib's
``forkserver`` start method does for any program. Each worker is still its own process, with its own
hivemind DHT, averager and p2pd, and it runs ``engine_worker.main`` exactly as ``python engine_worker.py``
runs it. This is for the engine tests' workers only: the CLI tests start ``python -m client.cli`` as a
volunteer does.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
from pathlib import Path

from swarm.hivemind_fixes import locks as hivemind_locks

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["worker_warmup"])
_TESTS = str(Path(__file__).resolve().parent)
STACKS_SIGNAL = signal.SIGUSR2  # the client's SIGUSR1 means "finish the round and leave"; nothing uses SIGUSR2


def stacks_path(log: str | Path) -> Path:
    return Path(f"{log}.stacks")


def _ensure_server() -> None:
    """Start the fork server with this directory on its path: Python 3.11's server imports its preload modules
    with the path of a bare ``python -c`` (it ignores the sys_path it is given) and drops an ImportError
    silently, which left every worker to import everything itself."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_TESTS, saved) if p)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def _run(argv: list[str], log: str) -> None:
    """In the forked worker: its output to ``log``, then the worker's own main, ended as its script ends."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - fd 1 outlives this function
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    # a stuck worker's story: on STACKS_SIGNAL it (and each process it forks, which inherit the handler and the
    # file) writes every thread's stack to <log>.stacks, read by the harness when a worker outlives its timeout
    stacks = open(stacks_path(log), "a")  # noqa: SIM115 - kept open for the handler
    faulthandler.register(STACKS_SIGNAL, file=stacks, all_threads=True, chain=False)
    sys.argv = argv
    if "worker_warmup" not in sys.modules:
        print("worker_fork: the fork server did not preload worker_warmup; this worker imports everything itself")
    # the fork server's child inherits its start method; a fresh interpreter's default on Linux is fork, which
    # hivemind's DHT and averager processes need (their objects hold weak references and do not pickle)
    multiprocessing.set_start_method("fork", force=True)
    own_hivemind_locks()
    import engine_worker

    code = engine_worker.main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as engine_worker.py's __main__ does: hivemind's threads can abort a teardown


def own_hivemind_locks() -> None:
    """Give this worker hivemind's process-wide locks of its own, as a fresh interpreter has.

    Imported in the fork server, they were one set of semaphores shared by every worker of a pytest process and the
    DHT and averager processes they fork (``hivemind_locks``). A test that SIGKILLs a worker (or a worker killed at
    teardown) while one of its processes held one left it locked for good, and every later worker then hung at its
    first future: the last CI lost the overlap tests' peers that way, one not finishing and the next three not
    starting, with empty logs."""
    from hivemind.utils.mpfuture import MPFuture

    MPFuture.reset_backend()  # a new futures backend (its pipe and thread) for this process
    hivemind_locks.replace_locks()


def die_holding_hivemind_locks() -> None:
    """A forked process killed inside hivemind's locked sections (as a SIGKILL mid-all-reduce, an OOM kill or
    hivemind's own terminate can land)."""
    from hivemind.utils.mpfuture import MPFuture, SharedBytes

    for lock in (MPFuture._initialization_lock, MPFuture._update_lock, SharedBytes._lock):
        lock.acquire()
    os.kill(os.getpid(), signal.SIGKILL)


class ForkedWorker:
    """The parts of ``subprocess.Popen`` the harness and the tests use, for a worker from the fork server."""

    def __init__(self, argv: list[str], log: Path):
        self.args = argv
        _ensure_server()
        self._process = _CONTEXT.Process(target=_run, args=(argv, str(log)), daemon=False)
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
