"""The wait for the image's background build (tests/image_build.py): what it returns and how it fails."""

from __future__ import annotations

import json
import subprocess
import sys

import image_build
import pytest


@pytest.fixture
def build(tmp_path, monkeypatch):
    """A builder that has already exited (a short-lived process), and its folder."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    (tmp_path / "build.log").write_text("debootstrap bookworm\nE: failed to fetch\n")
    monkeypatch.setenv(image_build.ENV, f"{proc.pid}:{tmp_path}")
    return tmp_path


def test_a_finished_build_is_returned(build):
    fields = dict(image="localhost/swarm-client:test", seconds=1.5, size_bytes=10, base_size_bytes=5)
    (build / "result").write_text(json.dumps(dict(ok=True, **fields)))
    assert image_build.built(timeout=5, log=lambda line: None) == image_build.pm.Built(**fields)


def test_a_failed_build_fails_with_its_error_and_log(build):
    (build / "result").write_text(json.dumps(dict(ok=False, error="PodmanError: podman build failed (125)")))
    with pytest.raises(AssertionError, match=r"(?s)podman build failed \(125\).*failed to fetch"):
        image_build.built(timeout=5, log=lambda line: None)


def test_a_builder_that_died_without_a_result_fails_at_once(build):
    with pytest.raises(AssertionError, match=r"(?s)ended without a result.*failed to fetch"):
        image_build.built(timeout=60, log=lambda line: None)
