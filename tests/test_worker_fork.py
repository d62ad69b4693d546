"""The engine tests' workers come from a warm fork server (worker_fork): check that it is warm and that a worker
reports its end as subprocess.Popen would, since the engine tests read exit codes and kill workers by pid."""

from __future__ import annotations

import signal
import subprocess

import pytest
import worker_fork
from diloco_helpers import tiny_manifest
from swarm_harness import WORKER, wait_for
from worker_fork import ForkedWorker


def test_a_worker_starts_warm_and_exits_with_its_own_code(tmp_path):
    log = tmp_path / "help.log"
    worker = ForkedWorker([str(WORKER), "--help"], log)
    assert worker.wait(60) == 0 and worker.returncode == 0 and worker.poll() == 0
    text = log.read_text()
    assert "usage: engine_worker.py" in text, text  # its own argv, its output in its log
    assert "did not preload" not in text, text  # the server imported everything first: no cold start
    bad = ForkedWorker([str(WORKER), "--rank", "0"], tmp_path / "bad.log")  # argparse's error exit
    assert bad.wait(60) == 2, (tmp_path / "bad.log").read_text()


def test_a_waiting_worker_times_out_like_popen_and_dies_of_sigkill(tmp_path):
    manifest = tmp_path / "manifest.json"
    manifest.write_text(tiny_manifest().canonical_json())
    out = tmp_path / "peer"
    argv = [str(WORKER), "--manifest", str(manifest), "--out", str(out), "--rank", "0", "--max-epochs", "1"]
    worker = ForkedWorker([*argv, "--start-with", "3"], tmp_path / "peer.log")  # waits for two more peers
    wait_for(lambda: (out / "maddrs.txt").exists(), 60, "the worker's peer to start")
    with pytest.raises(subprocess.TimeoutExpired):
        worker.wait(0.2)
    assert worker.poll() is None
    worker.kill()
    assert worker.wait(10) == -signal.SIGKILL


def test_a_worker_killed_inside_hiveminds_locks_does_not_hang_the_next_one(tmp_path):
    # the locks the server imported with hivemind, taken for good by a process that died holding them
    worker_fork._ensure_server()  # the warm server, as ForkedWorker starts it (a cold one imports nothing)
    holder = worker_fork._CONTEXT.Process(target=worker_fork.die_holding_hivemind_locks)
    holder.start()
    holder.join(60)
    assert holder.exitcode == -signal.SIGKILL
    manifest = tmp_path / "manifest.json"
    manifest.write_text(tiny_manifest().canonical_json())
    out = tmp_path / "peer"
    argv = [str(WORKER), "--manifest", str(manifest), "--out", str(out), "--rank", "0", "--max-epochs", "1"]
    worker = ForkedWorker(argv, tmp_path / "peer.log")  # its DHT's first future needs those locks
    try:
        assert worker.wait(90) == 0, (tmp_path / "peer.log").read_text()
    finally:
        worker.kill()
    assert (out / "maddrs.txt").exists() and (out / "final.pt").exists()
    assert "did not preload" not in (tmp_path / "peer.log").read_text()  # it did share the server's hivemind
