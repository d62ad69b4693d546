"""Running the real `swarm-client` CLI in subprocesses, as a volunteer would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

FAST = [
    "--set",
    "inner_steps=5",
    "--set",
    "averaging.matchmaking_time=1.0",
    "--set",
    "averaging.matchmaking_timeout=4.0",
    "--set",
    "averaging.consistency_timeout=2.0",
]
LOCAL = ["--host-ip", "127.0.0.1", "--host-port", "0", "--device", "cpu"]
# Several peers share this 2-core host, and CI runs two test files at once: one torch thread per peer, as
# `swarm-client demo` gives its peers (cores // peers), unless the caller's environment says otherwise. With two
# threads each, parallel regions wait on threads the other processes have descheduled (with a third pytest
# worker the in-process convergence smoke took over 280 s instead of 64-100 s).
PEER_ENV = {"OMP_NUM_THREADS": "1"}


def cli(*args: str, timeout: float = 120, env: dict | None = None, cwd: Path | None = None):
    return subprocess.run(
        [sys.executable, "-m", "client.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**PEER_ENV, **os.environ, **(env or {})},
        cwd=cwd,
    )


def assert_clean_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    """The command failed as a volunteer's mistake should: exit 2, one ``error:`` paragraph, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stderr.startswith("error: ")
    for needle in needles:
        assert needle in result.stderr, result.stderr


def run_script(script: str, *args: str, cwd: Path, timeout: float) -> tuple[dict, subprocess.CompletedProcess]:
    """Run ``script`` in a fresh interpreter; what it printed last on a ``RESULT {json}`` line, and the process."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1].removeprefix("RESULT ")), proc


SPAWNED: list[subprocess.Popen] = []  # killed after each test (conftest), whether it passed or not


def spawn(*args: str, log: Path) -> subprocess.Popen:
    handle = log.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "client.cli", *args],
        stdout=handle,
        stderr=subprocess.STDOUT,
        env={**PEER_ENV, **os.environ, "PYTHONUNBUFFERED": "1"},
    )
    SPAWNED.append(proc)
    return proc


def kill_spawned(keep: int = 0) -> None:
    """A failed assertion must not leave a training peer behind to slow every later test.

    The first ``keep`` processes stay: they belong to a wider fixture (a module's swarm) that outlives
    the test.
    """
    while len(SPAWNED) > keep:
        proc = SPAWNED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def wait_for_line(
    log: Path, needle: str, proc: subprocess.Popen, timeout: float = 120, others: Sequence[subprocess.Popen] = ()
) -> str:
    """The first line of ``log`` holding ``needle``; fails at once if ``proc`` (or one of ``others``, peers the
    line depends on) exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        for line in text.splitlines():
            if needle in line:
                return line
        if proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before printing {needle!r}:\n{text[-3000:]}")
        gone = [other for other in others if other.poll() is not None]
        if gone:
            raise AssertionError(f"{gone[0].args[-8:]} exited ({gone[0].returncode}) before {needle!r} was printed")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {needle!r}:\n{log.read_text()[-3000:]}")


class Ghosts:
    """Extra keys (``benchmarks.liar_records``' ghosts: each its own process, DHT node and libp2p identity) whose
    records follow the epoch of the peer whose status file is ``status``; ``ahead`` says what they claim (a number of
    epochs ahead, with a made-up checksum; or ``inflate``: no vote, an epoch-mate still training)."""

    def __init__(self, count: int, run_id: str, maddr: str, status: Path, folder: Path, ahead: str) -> None:
        self.epoch_file, self.status, self.stop = folder / "epoch", status, threading.Event()
        self.epoch_file.write_text("0")
        (folder / "ahead").write_text(ahead)
        self.follower = threading.Thread(target=self._follow, daemon=True)
        self.follower.start()
        command = [sys.executable, "-m", "benchmarks.liar_records", run_id, str(self.epoch_file), maddr]
        env = {**os.environ, **PEER_ENV}
        root = Path(__file__).resolve().parents[1]
        self.processes = [subprocess.Popen(command, env=env, cwd=root, stdout=subprocess.DEVNULL) for _ in range(count)]

    def _follow(self) -> None:
        from client.health import PeerStatus

        while not self.stop.wait(0.5):
            try:
                self.epoch_file.write_text(str(PeerStatus.model_validate_json(self.status.read_text()).epoch))
            except (OSError, ValueError):
                continue  # not written yet, or caught mid-replace

    def close(self) -> None:
        self.stop.set()
        for process in self.processes:
            process.kill()
            process.wait(timeout=10)
