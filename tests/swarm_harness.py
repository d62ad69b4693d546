"""Runs engine workers as real processes on 127.0.0.1 (forked from a warm server: worker_fork) and cleans up
after them.

It also watches every p2pd daemon the workers start, so a test can assert that
none survives its peer: not after a graceful leave, not after SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import torch
from worker_fork import STACKS_SIGNAL, ForkedWorker, stacks_path

from swarm import RunManifest

WORKER = Path(__file__).resolve().parent / "engine_worker.py"
START_TIMEOUT = 90.0


def wait_for(predicate, timeout: float, what: str, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


class WorkerSwarm:
    def __init__(self, root: Path, manifest: RunManifest):
        self.root, self.manifest = root, manifest
        root.mkdir(parents=True, exist_ok=True)
        self.manifest_path = root / "manifest.json"
        self.manifest_path.write_text(manifest.canonical_json())
        self.procs: dict[int, ForkedWorker] = {}
        self.p2pd_pids: set[int] = set()
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch_p2pd, daemon=True)
        self._watcher.start()

    def out(self, rank: int) -> Path:
        return self.root / f"peer{rank}"

    def start(
        self,
        rank: int,
        max_epochs: int,
        *,
        extra_params: int = 0,
        bootstrap: int | None = 0,
        wait_ready: bool = True,
        extra_args: tuple[str, ...] = (),
    ) -> ForkedWorker:
        argv = [
            str(WORKER),
            "--manifest",
            str(self.manifest_path),
            "--out",
            str(self.out(rank)),
            "--rank",
            str(rank),
            "--max-epochs",
            str(max_epochs),
            "--extra-params",
            str(extra_params),
            *extra_args,
        ]
        if bootstrap is not None and bootstrap != rank:
            argv += ["--initial-peers", *self.maddrs(bootstrap)]
        log = self.root / f"peer{rank}.log"
        log.write_text("")
        self.procs[rank] = ForkedWorker(argv, log)
        if wait_ready:
            self.wait_ready(rank)
        return self.procs[rank]

    def wait_ready(self, rank: int) -> None:
        try:
            wait_for(
                lambda: (self.out(rank) / "maddrs.txt").exists() or self.procs[rank].poll() is not None,
                START_TIMEOUT,
                f"peer {rank} to start",
            )
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.diagnose(rank)}") from None
        assert self.procs[rank].poll() is None, f"peer {rank} exited early:\n{self.story(rank)}"

    def maddrs(self, rank: int) -> list[str]:
        path = self.out(rank) / "maddrs.txt"
        wait_for(path.exists, START_TIMEOUT, f"peer {rank} addresses")
        maddrs = path.read_text().split()
        assert maddrs, f"peer {rank} wrote no addresses: the next peer would start alone"
        return maddrs

    def log(self, rank: int) -> str:
        return (self.root / f"peer{rank}.log").read_text()[-4000:]

    def story(self, rank: int, chars: int = 4000) -> str:
        """What a failure shows: the last ``chars`` of the worker's log, then its matchmaking story's tail (why a
        round found no group)."""
        return self.log(rank)[-chars:] + matchmaking_tail(self.out(rank))

    def wait_exit(self, rank: int, timeout: float) -> int:
        code = self.wait_exit_or_none(rank, timeout)
        if code is None:
            story = f"{self.story(rank)}\n{self.diagnose(rank)}"
            raise AssertionError(f"peer {rank} did not finish in {timeout:.0f} s:\n{story}")
        return code

    def wait_exit_or_none(self, rank: int, timeout: float) -> int | None:
        try:
            return self.procs[rank].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def diagnose(self, rank: int) -> str:
        """What a stuck worker was doing: its processes, each one's threads (innermost frames), its last events, and
        the machine's memory, load and disk."""
        return diagnose(self.procs[rank].pid, stacks_path(self.root / f"peer{rank}.log"), self.events(rank))

    def kill(self, rank: int) -> None:
        self.procs[rank].send_signal(signal.SIGKILL)
        self.procs[rank].wait(timeout=10)

    def marker(self, rank: int, state: str, epoch: int) -> Path:
        return self.out(rank) / f"state-{state.replace(' ', '_')}-{epoch}"

    def reports(self, rank: int) -> list[dict]:
        path = self.out(rank) / "reports.json"
        return json.loads(path.read_text()) if path.exists() else []

    def events(self, rank: int) -> list[dict]:
        path = self.out(rank) / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def final(self, rank: int) -> dict:
        return torch.load(self.out(rank) / "final.pt", weights_only=False)

    def _watch_p2pd(self) -> None:
        while not self._stop.is_set():
            for proc in list(self.procs.values()):
                try:
                    for child in psutil.Process(proc.pid).children(recursive=True):
                        if child.name() == "p2pd":
                            self.p2pd_pids.add(child.pid)
                except psutil.Error:
                    pass
            time.sleep(0.2)

    def live_p2pd(self) -> list[int]:
        alive = []
        for pid in self.p2pd_pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        return alive

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        self._stop.set()
        self._watcher.join(timeout=2)
        try:
            wait_for(lambda: not self.live_p2pd(), 15, "p2pd daemons to exit")
        finally:
            for pid in self.live_p2pd():  # never leave strays behind, even when the assertion fails
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def matchmaking_tail(out: Path, lines: int = 30) -> str:
    """The last lines of a worker's ``matchmaking.log`` (``engine_worker.keep_matchmaking_story``), cut to 240
    characters each."""
    path = out / "matchmaking.log"
    if not path.exists():
        return ""
    tail = [line[:240] for line in path.read_text(errors="replace").splitlines()[-lines:]]
    return "\nmatchmaking.log:\n" + "\n".join(tail)


def diagnose(pid: int, stacks: Path, events: list[dict]) -> str:
    vm, disk = psutil.virtual_memory(), psutil.disk_usage(str(stacks.parent))
    lines = [
        f"machine: {vm.available / 2**30:.1f} GiB available of {vm.total / 2**30:.1f}, load {os.getloadavg()}, "
        f"{disk.free / 2**30:.1f} GiB free on the test disk",
        f"last events: {[e['kind'] + (':' + str(e.get('state')) if 'state' in e else '') for e in events[-6:]]}",
    ]
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return "\n".join([*lines, f"worker {pid} is gone"])
    for proc in tree:
        try:
            with proc.oneshot():
                cpu = proc.cpu_times()
                lines.append(
                    f"pid {proc.pid} {proc.name()} {proc.status()} cpu {cpu.user + cpu.system:.1f} s "
                    f"rss {proc.memory_info().rss >> 20} MiB threads {proc.num_threads()}"
                )
                python = proc.name().startswith("python")
        except psutil.Error:
            continue
        if python:  # the worker and the processes it forked (DHT, averager) dump their stacks; p2pd is Go
            before = stacks.stat().st_size if stacks.exists() else 0
            try:
                os.kill(proc.pid, STACKS_SIGNAL)
            except ProcessLookupError:
                continue
            time.sleep(0.5)
            if stacks.exists():
                with stacks.open() as f:
                    f.seek(before)
                    lines += summarize_stacks(f.read())
    return "\n".join(lines)


def summarize_stacks(dump: str, frames: int = 4) -> list[str]:
    """faulthandler's dump, a line per thread: its innermost frames as file:line function."""
    out = []
    for block in dump.split("\n\n"):
        head, *calls = [line.strip() for line in block.strip().splitlines()] or [""]
        if not head:
            continue
        where = []
        for call in calls[:frames]:  # 'File "/a/b.py", line 12 in f'
            path, _, rest = call.removeprefix('File "').partition('", line ')
            where.append(f"{Path(path).name}:{rest.replace(' in ', ' ')}")
        out.append(f"  {head.split(' (')[0]}: {' < '.join(where)}")
    return out
