"""The image tests' build, started in the background when the session starts, so that it overlaps other tests.

Built from nothing (debootstrap, the torch wheel, the project's dependencies), the image takes about six
minutes on two cores, mostly downloads and unpacking. Built inside the image tests' fixture, it held one of
CI's two pytest workers for all of that time. The session's first process (the xdist controller, or pytest
itself without xdist) now starts ``python -m benchmarks.podman`` at a lower priority and tells every worker
where the result will be, in an environment variable they inherit; the fixture waits for it there.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from benchmarks import podman as pm

ENV = "SWARM_TEST_IMAGE_BUILD"  # "PID:FOLDER": the builder, and the folder of its result and log
IMAGE_TESTS = Path(__file__).with_name("test_image.py")
NICENESS = 10  # a tenth of a busy core's share: the tests that run meanwhile keep their timing
REPO = Path(__file__).resolve().parent.parent


def _selects_the_image_tests(config: pytest.Config) -> bool:
    for arg in config.args:
        path = Path(arg.split("::")[0]).resolve()
        if path == IMAGE_TESTS or (path.is_dir() and IMAGE_TESTS.is_relative_to(path)):
            return True
    return False


def start(config: pytest.Config) -> subprocess.Popen | None:
    """In the session's first process, when the image tests are selected and can run here: start the build."""
    if hasattr(config, "workerinput") or config.option.collectonly or ENV in os.environ:
        return None
    if pm.missing() is not None or not _selects_the_image_tests(config):
        return None
    folder = Path(tempfile.mkdtemp(prefix="swarm-image-build-"))
    with (folder / "build.log").open("w") as log:
        command = [sys.executable, "-m", "benchmarks.podman", "--result", str(folder / "result")]
        proc = subprocess.Popen(
            ["nice", "-n", str(NICENESS), *command],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,  # stopped as a group, podman's children with it
        )
    os.environ[ENV] = f"{proc.pid}:{folder}"
    return proc


def stop(proc: subprocess.Popen | None) -> None:
    """At the end of the session: a build still running (its tests deselected or failed) is stopped."""
    if proc is None:
        return
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    folder = Path(os.environ.pop(ENV).split(":", 1)[1])
    shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def built(timeout: float, log=print) -> pm.Built:
    """The image: the background build's, waited for (bounded), or, when none was started, built here."""
    if ENV not in os.environ:
        return pm.build_image(log=log)
    pid, folder = os.environ[ENV].split(":", 1)
    result, build_log = Path(folder) / "result", Path(folder) / "build.log"
    started = time.monotonic()
    while not result.exists():
        if not _alive(int(pid)) and not result.exists():
            raise AssertionError(f"the image build ended without a result:\n{build_log.read_text()[-3000:]}")
        if time.monotonic() - started > timeout:
            raise AssertionError(f"the image build took over {timeout:.0f} s:\n{build_log.read_text()[-3000:]}")
        time.sleep(1)
    outcome = json.loads(result.read_text())
    log(f"waited {time.monotonic() - started:.0f} s for the background image build")
    if not outcome.pop("ok"):
        raise AssertionError(f"the image build failed: {outcome['error']}\n{build_log.read_text()[-3000:]}")
    return pm.Built(**outcome)
