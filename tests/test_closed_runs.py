"""Closed runs (--secret-file): the keys, the DHT authorizer, and real peers and outsiders in their own processes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from client_helpers import FAST, LOCAL, cli, spawn, wait_for_line
from diloco_helpers import tiny_manifest
from hivemind.proto import dht_pb2

from swarm.dht.access import MIN_SECRET_BYTES, RunSecret, check_access
from swarm.dht.authorizer import SecretAuthorizer
from swarm.errors import SecretError

SECRET = b"correct horse battery staple, 2026"
OTHER = b"another run's secret, not this one"


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# ---- the keys, in process ---------------------------------------------------------------------------


def test_a_secret_file_that_cannot_be_used_is_explained(tmp_path):
    with pytest.raises(SecretError, match="Cannot read the secret file"):
        RunSecret.from_file(tmp_path / "missing")
    with pytest.raises(SecretError, match=f"at least {MIN_SECRET_BYTES}"):
        RunSecret.from_file(write(tmp_path / "short", b"hunter2\n"))
    assert RunSecret.from_file(write(tmp_path / "s", SECRET + b"\n")) == RunSecret.from_bytes(SECRET)


def test_the_same_manifest_under_two_secrets_is_two_runs_and_the_secret_is_nowhere_in_it():
    base = tiny_manifest()
    a = base.model_copy(update=dict(access=RunSecret.from_bytes(SECRET).tag))
    b = base.model_copy(update=dict(access=RunSecret.from_bytes(OTHER).tag))
    assert len({base.run_id, a.run_id, b.run_id}) == 3
    assert SECRET.decode() not in a.canonical_json() and SECRET.hex() not in a.canonical_json()
    assert "secret" not in repr(RunSecret.from_bytes(SECRET)).lower().replace("runsecret", "")


def test_access_is_checked_against_the_manifest():
    ours = RunSecret.from_bytes(SECRET)
    check_access("r", None, None)
    check_access("r", ours.tag, ours)
    with pytest.raises(SecretError, match="is closed"):
        check_access("r", ours.tag, None)
    with pytest.raises(SecretError, match="another secret"):
        check_access("r", ours.tag, RunSecret.from_bytes(OTHER))
    with pytest.raises(SecretError, match="is open"):
        check_access("r", None, ours)


def test_the_dht_authorizer_refuses_wrong_keys_tampering_and_replays():
    async def main():
        ours = SecretAuthorizer(RunSecret.from_bytes(SECRET).dht_key)
        theirs = SecretAuthorizer(RunSecret.from_bytes(OTHER).dht_key)
        request = dht_pb2.PingRequest(validate=True)
        await ours.sign_request(request, None)
        assert await ours.validate_request(request)
        assert not await ours.validate_request(request)  # the same nonce again: a replay
        request = dht_pb2.PingRequest(validate=True)
        await theirs.sign_request(request, None)
        assert not await ours.validate_request(request)
        request = dht_pb2.PingRequest(validate=True)
        await ours.sign_request(request, None)
        request.validate = False  # tampered on the way
        assert not await ours.validate_request(request)
        request = dht_pb2.PingRequest(validate=True)
        await ours.sign_request(request, None)
        unsigned = dht_pb2.PingResponse(available=True)
        assert not await ours.validate_response(unsigned, request)
        response = dht_pb2.PingResponse(available=True)
        await ours.sign_response(response, request)
        assert await ours.validate_response(response, request)
        response.available = False
        assert not await ours.validate_response(response, request)

    asyncio.run(main())


# ---- real peers and outsiders -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def closed_run(tmp_path_factory):
    """A closed run's first peer, with the ports a volunteer would use (the defaults)."""
    root = tmp_path_factory.mktemp("closed")
    secret = write(root / "secret", SECRET)
    log = root / "first.log"
    args = ["start", "--preset", "tiny", *FAST, "--secret-file", str(secret), "--device", "cpu", "--no-dashboard"]
    proc = spawn(*args, "--workdir", str(root / "first"), "--name", "first", log=log)
    line = wait_for_line(log, "swarm-client join", proc, timeout=180)
    maddrs, run_id = line.split("--initial-peers ")[1].split(" --run ")
    maddr = maddrs.split()[0]  # this host's first address: the one a volunteer would be given
    wait_for_line(log, "round -> epoch 1", proc, timeout=180)
    yield root, maddr, run_id.strip(), secret
    if proc.poll() is None:
        proc.kill()


def assert_refused(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1, result.stderr
    for needle in needles:
        assert needle in error_lines[0], result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_a_peer_without_the_secret_is_refused_with_a_clear_message(closed_run, tmp_path):
    _, maddr, run_id, _ = closed_run
    result = cli("join", "--initial-peers", maddr, "--workdir", str(tmp_path), *LOCAL, timeout=150)
    assert_refused(result, "reachable but refused us", "--secret-file")
    assert run_id not in result.stdout + result.stderr  # it learned nothing about the run


def test_a_peer_with_a_wrong_secret_is_refused_with_a_clear_message(closed_run, tmp_path):
    _, maddr, run_id, _ = closed_run
    wrong = write(tmp_path / "wrong", OTHER)
    args = ["join", "--initial-peers", maddr, "--secret-file", str(wrong), "--workdir", str(tmp_path), *LOCAL]
    assert_refused(cli(*args, timeout=150), "is not this run's secret")


def test_status_needs_the_secret(closed_run):
    _, maddr, run_id, secret = closed_run
    assert_refused(cli("status", "--initial-peers", maddr, "--json", timeout=150), "--secret-file")
    result = cli("status", "--initial-peers", maddr, "--json", "--secret-file", str(secret), timeout=150)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["run_id"] == run_id


def test_an_outsider_gets_nothing_from_the_dht_matchmaking_all_reduce_or_state_download(closed_run, tmp_path):
    _, maddr, run_id, secret = closed_run
    outsider = Path(__file__).resolve().parent / "outsider.py"
    wrong = write(tmp_path / "wrong", OTHER)

    def attempt(*extra: str) -> dict:
        result = subprocess.run(
            [sys.executable, str(outsider), maddr, run_id, *extra], capture_output=True, text=True, timeout=240
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    seen = attempt("--token-secret-file", str(wrong))
    assert seen["dht"].startswith("refused"), seen
    assert seen["join"][-1] == "BAD_SCHEMA_HASH", seen  # during the peer's matchmaking: refused, never accepted
    # a guessed group id: refused, or (while the peer has no group of its own) left unanswered
    assert seen["aggregate"] in ("BAD_GROUP_ID", "error: TimeoutError"), seen
    assert seen["download_bytes"] == 0, seen
    # the same request with the run's own token is served: the refusal above is the token check
    assert attempt("--token-secret-file", str(secret), "--download-only")["download_bytes"] > 0


def test_a_peer_with_the_secret_joins_and_averages_on_default_ports(closed_run, tmp_path):
    root, maddr, run_id, secret = closed_run
    log = tmp_path / "second.log"
    args = ["join", "--initial-peers", maddr, "--secret-file", str(secret), "--device", "cpu", "--no-dashboard"]
    proc = spawn(*args, "--workdir", str(tmp_path / "second"), "--max-epochs", "30", log=log)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if "averaged with 2 peers" in text:
            break
        assert proc.poll() is None, text[-3000:]
        time.sleep(0.5)
    text = log.read_text()
    assert f"Joining run {run_id}" in text and "averaged with 2 peers" in text, text[-3000:]
    assert SECRET.decode() not in text + (root / "first.log").read_text()
