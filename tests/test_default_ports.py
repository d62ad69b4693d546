"""Several peers on one host with the defaults a user would use: no --host-port, no --host-ip.

The bootstrap is a stock `hivemind-dht` on the default port 31337. Its p2pd binds
with SO_REUSEPORT, so a peer that merely tried to bind would share the port with
it and dials would reach the wrong process. Each peer must instead take the next
free port and say so, and all of them must average together; one is SIGKILLed and
a newcomer (default port again) takes its place. A port given explicitly that is
taken fails with one clear line.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from client_helpers import FAST, cli, spawn, wait_for_line

from swarm.dht.network import DEFAULT_PORT

HIVEMIND_DHT = Path(sys.executable).parent / "hivemind-dht"
MOVED = re.compile(rf"Port {DEFAULT_PORT} is in use on this machine \(another peer\?\); listening on (\d+) instead")
PORT_WAIT = 180.0  # seconds
pytestmark = pytest.mark.timeout(720)  # the wait for the port, then up to three 240 s waits for rounds
ROUNDS = r"round -> epoch (\d+): averaged with (\d+) peers"


def listening_ports(pid: int) -> set[int]:
    """TCP ports the p2pd daemons under ``pid`` listen on."""
    ports = set()
    for child in psutil.Process(pid).children(recursive=True):
        if child.name() == "p2pd":
            for conn in child.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    ports.add(conn.laddr.port)
    return ports


def priorities(pid: int) -> tuple[set[int], set[int]]:
    """The niceness of every thread of the peer's own process, and of every thread of the processes under it
    (its DHT, its averager, their p2pd)."""
    own = {os.getpriority(os.PRIO_PROCESS, t.id) for t in psutil.Process(pid).threads()}
    helpers = {
        os.getpriority(os.PRIO_PROCESS, t.id) for c in psutil.Process(pid).children(recursive=True) for t in c.threads()
    }
    return own, helpers


def wait_for_rounds(log: Path, proc: subprocess.Popen, group: int, count: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [int(g) for _, g in re.findall(ROUNDS, log.read_text())]
        if sum(g >= group for g in found) >= count:
            return
        if proc.poll() is not None:
            raise AssertionError(f"exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"no {count} rounds averaged in a group of {group}:\n{log.read_text()[-3000:]}")


@pytest.fixture
def bootstrap(tmp_path):
    """A stock hivemind-dht on the default port, as the operator guide runs it."""
    # another test file's peer may hold the default port for a while (test_closed_runs has one on default ports,
    # and pytest-xdist runs files side by side): wait for it, bounded
    deadline = time.monotonic() + PORT_WAIT
    while any(c.laddr.port == DEFAULT_PORT and c.status == psutil.CONN_LISTEN for c in psutil.net_connections("tcp")):
        if time.monotonic() > deadline:
            pytest.fail(f"port {DEFAULT_PORT} stayed in use for {PORT_WAIT:.0f} s; this test needs it free to start")
        time.sleep(1)
    log, key = tmp_path / "bootstrap.log", tmp_path / "bootstrap.key"
    with log.open("w") as handle:
        proc = subprocess.Popen(
            [str(HIVEMIND_DHT), "--host_maddrs", f"/ip4/0.0.0.0/tcp/{DEFAULT_PORT}", "--identity_path", str(key)],
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
    try:
        line = wait_for_line(log, "--initial_peers", proc, timeout=60)
        maddr = next(a for a in line.split() if a.startswith("/ip4/127.0.0.1/"))
        yield proc, maddr
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_peers_with_default_ports_pick_free_ports_and_average_together_through_a_stock_bootstrap(tmp_path, bootstrap):
    _, maddr = bootstrap
    logs = [tmp_path / f"peer{i}.log" for i in range(4)]
    first = spawn(
        "start", "--preset", "tiny", *FAST, "--initial-peers", maddr, "--workdir", str(tmp_path / "p0"), log=logs[0]
    )
    procs = [first]
    try:
        run_id = re.search(r"--run ([0-9a-f]{16})", wait_for_line(logs[0], "swarm-client join", first)).group(1)
        join = ["join", "--initial-peers", maddr, "--run", run_id]
        for i in (1, 2):
            procs.append(spawn(*join, "--workdir", str(tmp_path / f"p{i}"), "--name", f"p{i}", log=logs[i]))
        for i, proc in enumerate(procs):
            wait_for_rounds(logs[i], proc, group=3, count=1)
        moved = [int(MOVED.search(log.read_text()).group(1)) for log in logs[:3]]  # each said so in one line
        assert len(set(moved)) == 3 and DEFAULT_PORT not in moved, moved
        ports = [listening_ports(proc.pid) for proc in procs]
        assert [len(p) for p in ports] == [1, 1, 1] and {p for s in ports for p in s} == set(moved), (ports, moved)
        base = os.getpriority(os.PRIO_PROCESS, 0)  # the peers started at this test's priority
        for proc in procs:  # the training yields the CPU to its averaging (client.priority), on a user's defaults
            assert priorities(proc.pid) == ({max(base, 10)}, {base}), priorities(proc.pid)

        procs[2].send_signal(signal.SIGKILL)  # a volunteer vanishes; a newcomer takes the default port again
        procs[2].wait(timeout=10)
        procs.append(spawn(*join, "--workdir", str(tmp_path / "p3"), "--name", "p3", log=logs[3]))
        wait_for_rounds(logs[3], procs[3], group=3, count=1)
        newcomer = int(MOVED.search(logs[3].read_text()).group(1))
        assert newcomer not in moved[:2] and newcomer != DEFAULT_PORT

        for i, log in enumerate(logs):  # hivemind's background failures go to the log file, not the terminal
            assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
            assert (tmp_path / f"p{i}" / "logs" / "swarm-client.log").stat().st_size > 0

        taken = cli("join", *join[1:], "--host-port", str(moved[0]), "--workdir", str(tmp_path / "p4"), timeout=60)
        assert taken.returncode == 2 and "Traceback" not in taken.stderr, taken.stderr
        assert f"Port {moved[0]} on 0.0.0.0 is taken" in taken.stderr and len(taken.stderr.strip().splitlines()) == 1
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
