"""The Docker image, built from the Dockerfile and run with podman: demo, join a host peer, health, SIGTERM, restart.

The image is built on a local Debian base (``benchmarks/podman.py``); the first
build here takes a few minutes, later runs reuse the base. In a whole run it is
built in the background from the session's start (``image_build.py``). Without podman (or
root) the tests skip and say why; CI installs podman first (README).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import uuid

import image_build
import pytest
from client_helpers import FAST, spawn, wait_for_line

from benchmarks import podman as pm

WHY_NOT = pm.missing()
pytestmark = [pytest.mark.skipif(WHY_NOT is not None, reason=f"image not built: {WHY_NOT}"), pytest.mark.timeout(1800)]
JOIN = re.compile(r"swarm-client join --initial-peers (\S+) --run ([0-9a-f]{16})")
LEAVE_DEADLINE = 20.0


@pytest.fixture(scope="module")
def image():
    built = image_build.built(timeout=1500, log=lambda line: print(line, file=sys.stderr))
    print(
        f"\nimage {built.image}: Dockerfile built in {built.seconds:.0f} s; {built.size_bytes / 1e6:.0f} MB "
        f"(base {built.base_size_bytes / 1e6:.0f} MB)",
        file=sys.stderr,
    )
    return built


@pytest.fixture
def names():
    made: list[tuple[str, str]] = []

    def make(kind: str) -> str:
        name = f"swarm-test-{kind}-{uuid.uuid4().hex[:8]}"
        made.append((kind, name))
        return name

    yield make
    for kind, name in made:
        if kind == "volume":
            pm.podman("volume", "rm", "-f", name, check=False)
        else:
            pm.podman("rm", "-f", "-t", "0", name, check=False)


def logs(container: str) -> str:
    result = pm.podman("logs", container, check=False)
    return result.stdout + result.stderr


def wait_for_log(container: str, needle: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = logs(container)
        if needle in text:
            return text
        state = pm.podman("inspect", "--format", "{{.State.Status}}", container, check=False).stdout.strip()
        if state in ("exited", "stopped"):
            raise AssertionError(f"{container} exited before printing {needle!r}:\n{text[-3000:]}")
        time.sleep(1)
    raise AssertionError(f"{container}: no {needle!r} in {timeout:.0f} s:\n{logs(container)[-3000:]}")


def stop(container: str) -> tuple[int, float]:
    """SIGTERM (what `docker stop` sends) with a grace period longer than our deadline; (exit code, seconds)."""
    started = time.monotonic()
    pm.podman("stop", "-t", "60", container, timeout=120)
    seconds = time.monotonic() - started
    code = int(pm.podman("inspect", "--format", "{{.State.ExitCode}}", container).stdout.strip())
    return code, seconds


def test_demo_runs_in_the_image(image, names):
    name = names("container")
    result = pm.podman("run", "--name", name, "--network", "host", image.image, "demo", "--peers", "2", "--epochs", "1")
    assert "all peers hold the same parameters: yes" in result.stdout, result.stdout[-3000:]


def test_health_answers_fast_enough_for_the_healthcheck_without_a_peer(image, names):
    inspect = json.loads(pm.podman("image", "inspect", image.image).stdout)[0]
    assert inspect["Healthcheck"]["Test"] == ["CMD", "swarm-client", "health"]  # --format docker kept it
    started = time.monotonic()
    result = pm.podman("run", "--rm", image.image, "health", check=False)
    assert result.returncode == 1 and "no status file at /data/status.json" in result.stdout, result.stdout
    print(f"\n`podman run ... health` (container start included): {time.monotonic() - started:.1f} s", file=sys.stderr)


def test_join_a_host_peer_leave_on_sigterm_and_restart_with_the_same_identity(image, names, tmp_path):
    host_log = tmp_path / "host.log"
    host = spawn(
        "start",
        "--preset",
        "tiny",
        *FAST,
        "--host-ip",
        "127.0.0.1",
        "--host-port",
        "0",
        "--device",
        "cpu",
        "--workdir",
        str(tmp_path / "host"),
        log=host_log,
    )
    try:
        maddr, run_id = JOIN.search(wait_for_line(host_log, "swarm-client join", host)).groups()
        volume, container = names("volume"), names("container")
        pm.podman("volume", "create", volume)
        run = [
            "run",
            "-d",
            "--name",
            container,
            "--network",
            "host",
            "-v",
            f"{volume}:/data",
            "-e",
            f"SWARM_INITIAL_PEERS={maddr}",
            "-e",
            f"SWARM_RUN={run_id}",
            "-e",
            "SWARM_HOST_IP=127.0.0.1",
            "-e",
            "SWARM_HOST_PORT=0",
            image.image,
        ]
        pm.podman(*run)
        text = wait_for_log(container, "round -> epoch", timeout=300)
        # the host peer's state, downloaded, or (the host being a few local rounds from the seed) its steps replayed,
        # or (the host still at epoch 0, the seed's weights, which the container built too) nothing to download
        got = r"state of epoch \d+ (?:\(checksum \w+\) )?loaded from|caught up to epoch \d+ by replaying"
        assert re.search(f"{got}|starting at epoch 0: the swarm holds the seed", text), text[-3000:]
        peer_id = re.search(r"^Peer (\S+) on ", text, re.M).group(1)
        healthy = pm.podman("exec", container, "swarm-client", "health", check=False)
        assert healthy.returncode == 0 and healthy.stdout.startswith("healthy: "), healthy.stdout + healthy.stderr

        code, seconds = stop(container)
        text = logs(container)
        assert code == 0 and seconds < LEAVE_DEADLINE + 5, (code, seconds, text[-3000:])
        assert "SIGTERM received" in text and "Checkpoint written: /data/runs/" in text, text[-3000:]
        listing = pm.podman("run", "--rm", "-v", f"{volume}:/data", "--entrypoint", "ls", image.image, "-R", "/data")
        assert re.search(r"state-\d+\.safetensors", listing.stdout), listing.stdout
        assert "identity.key" in listing.stdout

        pm.podman("start", container)  # the same container and volume: a preempted spot VM coming back
        text = wait_for_log(container, "Resuming from state-", timeout=180)
        text = wait_for_log(container, f"Peer {peer_id} on ", timeout=180)  # the same identity
        code, _ = stop(container)
        assert code == 0, logs(container)[-3000:]
    finally:
        host.send_signal(signal.SIGTERM)
        try:
            host.wait(timeout=30)
        except subprocess.TimeoutExpired:
            host.kill()


def test_sigterm_during_start_up_is_not_ignored_by_pid_1(image, names):
    """Without --init the peer is PID 1; it handles SIGTERM from its first line, even while importing."""
    container = names("container")
    pm.podman("run", "-d", "--name", container, "--network", "host", "-e", "SWARM_HOST_PORT=0", image.image, "start")
    time.sleep(2)  # importing torch and hivemind, or starting the DHT
    code, seconds = stop(container)
    assert code == 0 and seconds < LEAVE_DEADLINE + 5, (code, seconds, logs(container)[-3000:])
