"""Peak PSS of a peer's whole process tree, sampled in the background and split by phase and process.

PSS (proportional set size) charges each shared page to the processes that map it
in equal shares, so the sum over a tree counts shared memory (torch's libraries,
the averager's shared buffers, pages a fork still shares) once. It is read from
``/proc/PID/smaps_rollup`` through psutil.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil


def tree_by_role(root: psutil.Process, figure: Callable[[psutil.Process], float]) -> dict[str, float]:
    """``figure`` of ``root`` and each descendant, summed by role: trainer, dht, averager, p2pd,
    torch_shm_manager (torch's helper for shared tensors), other.

    The forked Python children are named by age: the peer starts its DHT first and its averager second.
    """
    try:
        children = root.children(recursive=True)
    except psutil.Error:
        return {}
    out: dict[str, float] = {}
    pythons = []
    for proc in [root, *children]:
        try:
            value = figure(proc)
            name = proc.name()
            created = proc.create_time()
        except psutil.Error:
            continue
        if proc.pid == root.pid:
            role = "trainer"
        elif name in ("p2pd", "torch_shm_manager"):
            role = name
        else:
            pythons.append((created, proc.pid, value))
            continue
        out[role] = out.get(role, 0) + value
    for index, (_, _, value) in enumerate(sorted(pythons)):
        role = ("dht", "averager")[index] if index < 2 else "other"
        out[role] = out.get(role, 0) + value
    return out


def tree_pss(root: psutil.Process) -> dict[str, int]:
    """PSS in bytes of ``root`` and its descendants, by role (``tree_by_role``)."""
    return tree_by_role(root, lambda proc: proc.memory_full_info().pss)


@dataclass
class Peak:
    total: int = 0
    by_role: dict[str, int] = field(default_factory=dict)
    at: float = 0.0  # unix time of the peak

    def offer(self, sample: dict[str, int], now: float) -> None:
        total = sum(sample.values())
        if total > self.total:
            self.total, self.by_role, self.at = total, dict(sample), now


class TreeSampler:
    """Samples a process tree every ``interval`` seconds; ``phase()`` names what the peer is doing."""

    def __init__(self, pid: int, phase: Callable[[], str], interval: float = 0.2):
        self.root = psutil.Process(pid)
        self.phase, self.interval = phase, interval
        self.peaks: dict[str, Peak] = {}
        self.overall = Peak()
        self.samples = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pss-{pid}", daemon=True)

    def start(self) -> TreeSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def sample(self) -> None:
        """One sample now (also called by the benchmark at a moment it must not miss, such as SIGTERM: a small
        peer can exit within one interval)."""
        sample = tree_pss(self.root)
        if sample:
            with self._lock:
                now = time.time()
                phase = self.phase()
                self.peaks.setdefault(phase, Peak()).offer(sample, now)
                self.overall.offer(sample, now)
                self.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)
