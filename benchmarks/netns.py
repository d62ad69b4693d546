"""A private network of namespaces for real peers: each peer behind its own shaped link.

Layout: one bridge namespace holding a Linux bridge; each peer namespace is joined
to it by a veth pair (``eth0`` in the peer, ``vpN`` on the bridge). Addresses are
10.77.0.x/24 and exist only inside these namespaces, so nothing on the host or
beyond is reachable. A link is shaped with ``tc tbf`` on both ends' egress (the
peer's upload on its ``eth0``, its download on the bridge's ``vpN``): netem is not
available on these machines, so there is rate but no added delay.

Everything is named with a prefix and removed on exit (finally, atexit, SIGTERM),
and a stale lab from a killed run is removed before a new one starts.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

PREFIX = "swbench"
SUBNET = "10.77.0"
BRIDGE_NS = f"{PREFIX}-br"


class LabError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise LabError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def _tc(ns: str, *args: str) -> None:
    result = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise LabError(f"tc {' '.join(args)} in {ns}: {result.stderr.strip()}")


def require_root() -> None:
    """The lab needs root (CAP_NET_ADMIN); say so plainly instead of failing halfway."""
    if os.geteuid() != 0:
        raise SystemExit(
            "This benchmark creates network namespaces, veth pairs and tc qdiscs, which needs root. "
            "Run it as root (e.g. sudo -E env PATH=$PATH python -m benchmarks.wan)."
        )
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            raise SystemExit(f"'{tool}' (iproute2) is needed for this benchmark and was not found.")


def stale_namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def remove_all() -> None:
    """Delete every namespace of ours; their veths go with them."""
    for ns in stale_namespaces():
        for pid in _ip("netns", "pids", ns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _ip("netns", "del", ns, check=False)


def burst_bytes(rate_mbit: float) -> int:
    """Token bucket depth: 20 ms at the rate, and never below one 64 KiB GSO super-packet (veths keep GSO on)."""
    return max(65536, int(rate_mbit * 1e6 / 8 * 0.02))


@dataclass
class Lab:
    """The bridge namespace plus the peer namespaces added so far."""

    peers: dict[int, str] = field(default_factory=dict)  # index -> namespace
    rate_mbit: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __enter__(self) -> Lab:
        remove_all()
        atexit.register(remove_all)
        previous = signal.getsignal(signal.SIGTERM)
        if previous in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
        _ip("netns", "add", BRIDGE_NS)
        self._in(BRIDGE_NS, "ip", "link", "set", "lo", "up")
        self._in(BRIDGE_NS, "ip", "link", "add", "br0", "type", "bridge")
        self._in(BRIDGE_NS, "ip", "link", "set", "br0", "up")
        return self

    def __exit__(self, *exc) -> None:
        remove_all()

    @staticmethod
    def _in(ns: str, *cmd: str) -> str:
        result = subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True)
        if result.returncode != 0:
            raise LabError(f"{' '.join(cmd)} in {ns}: {result.stderr.strip()}")
        return result.stdout

    @staticmethod
    def address(index: int) -> str:
        return f"{SUBNET}.{10 + index}"

    def add_peer(self, index: int) -> str:
        """A new namespace wired to the bridge at the lab's current rate; returns its name."""
        ns = f"{PREFIX}-p{index}"
        _ip("netns", "add", ns)
        self._in(BRIDGE_NS, "ip", "link", "add", f"vp{index}", "type", "veth", "peer", "name", "eth0", "netns", ns)
        self._in(BRIDGE_NS, "ip", "link", "set", f"vp{index}", "master", "br0", "up")
        self._in(ns, "ip", "link", "set", "lo", "up")
        self._in(ns, "ip", "addr", "add", f"{self.address(index)}/24", "dev", "eth0")
        self._in(ns, "ip", "link", "set", "eth0", "up")
        with self._lock:
            self.peers[index] = ns
        self._shape(index, self.rate_mbit, first=True)
        return ns

    def kill_processes(self, index: int) -> None:
        """SIGKILL everything in a peer's namespace (its CLI, averager and p2p daemon): the machine died."""
        ns = self.peers.get(index)
        if ns is None:
            return
        for pid in _ip("netns", "pids", ns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    def remove_peer(self, index: int) -> None:
        with self._lock:
            ns = self.peers.pop(index, None)
        if ns:
            _ip("netns", "del", ns, check=False)  # its eth0 goes, and with it the bridge's end of the pair

    def _shape(self, index: int, rate_mbit: float | None, first: bool = False) -> None:
        ns = self.peers[index]
        for where, dev in ((ns, "eth0"), (BRIDGE_NS, f"vp{index}")):
            if not first:
                subprocess.run(
                    ["ip", "netns", "exec", where, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True
                )
            if rate_mbit is not None:
                _tc(
                    where,
                    *("qdisc", "add", "dev", dev, "root", "tbf"),
                    *("rate", f"{rate_mbit}mbit", "burst", str(burst_bytes(rate_mbit)), "latency", "100ms"),
                )

    def set_rate(self, rate_mbit: float | None) -> None:
        """Shape every link (both directions) to ``rate_mbit``; None removes the limit."""
        self.rate_mbit = rate_mbit
        with self._lock:
            indices = list(self.peers)
        for index in indices:
            self._shape(index, rate_mbit)

    def counters(self) -> dict[int, tuple[int, int]]:
        """Wire bytes (tx, rx) of each peer's eth0, as its own namespace sees them."""
        with self._lock:
            peers = dict(self.peers)
        out = {}
        for index, ns in peers.items():
            result = subprocess.run(
                ["ip", "-n", ns, "-s", "-j", "link", "show", "dev", "eth0"], capture_output=True, text=True
            )
            if result.returncode != 0:
                continue
            stats = json.loads(result.stdout)[0]["stats64"]
            out[index] = (int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"]))
        return out


class CounterSampler(threading.Thread):
    """Samples the veth byte counters twice a second, so any time window's wire bytes can be read off."""

    def __init__(self, lab: Lab, period: float = 0.5):
        super().__init__(daemon=True)
        self.lab, self.period = lab, period
        self.samples: dict[int, list[tuple[float, int, int]]] = {}
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            now = time.time()
            for index, (tx, rx) in self.lab.counters().items():
                self.samples.setdefault(index, []).append((now, tx, rx))
            self._stop_event.wait(self.period)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)

    def window(self, index: int, start: float, end: float) -> tuple[int, int] | None:
        """(tx, rx) bytes between two unix times, from the nearest samples at or outside the window."""
        series = self.samples.get(index, [])
        before = [s for s in series if s[0] <= start]
        after = [s for s in series if s[0] >= end]
        if not before or not after:
            return None
        return after[0][1] - before[-1][1], after[0][2] - before[-1][2]
