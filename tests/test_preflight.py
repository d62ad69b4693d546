"""`start` and `join` check their command line before torch and hivemind are imported (client/preflight.py)."""

import os
import re
import subprocess
import sys
import time

import pytest
from client_helpers import LOCAL, assert_clean_error, cli

from client.cli import build_parser
from client.preflight import (
    DeviceKind,
    DeviceRequest,
    check_peer_command,
    owner_alive,
    parse_device,
    prepare_workdir,
)
from swarm import ManifestError, NetworkConfigError, SecretError, SwarmError, parse_initial_peer
from swarm.inputs import MIN_SECRET_BYTES, check_initial_peer, light_multiaddr

PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWMgLAsHqV95yhKK1Chk3q2GRsUsfnukFcEN4U5RqpfDt5"
NOT_A_DEVICE = "is not one of auto, cuda, cuda:N, mps or cpu"


@pytest.mark.parametrize(
    "text, request_",
    [
        ("auto", DeviceRequest(DeviceKind.AUTO)),
        ("cpu", DeviceRequest(DeviceKind.CPU)),
        ("mps", DeviceRequest(DeviceKind.MPS)),
        ("cuda", DeviceRequest(DeviceKind.CUDA)),
        ("cuda:0", DeviceRequest(DeviceKind.CUDA, 0)),
        ("cuda:12", DeviceRequest(DeviceKind.CUDA, 12)),
    ],
)
def test_device_syntax_is_read(text, request_):
    assert parse_device(text) == request_


@pytest.mark.parametrize("text", ["tpu", "CPU", "", "cuda:", "cuda:x", "cuda:-1", "cuda:²", "cudax", "cpu:0", "mps:1"])
def test_a_device_that_is_no_device_string_is_refused(text):
    with pytest.raises(SwarmError, match=NOT_A_DEVICE):
        parse_device(text)


def test_detect_takes_the_parsed_device_and_says_what_this_machine_lacks():
    """The --device string is parsed once, before torch is imported; ``detect`` says whether the machine has it."""
    import torch

    from client.hardware import detect
    from client.preflight import DeviceKind

    assert detect(parse_device("cpu")).kind is DeviceKind.CPU
    if not torch.cuda.is_available():
        with pytest.raises(SwarmError, match="no CUDA GPU is visible"):
            detect(parse_device("cuda:7"))


@pytest.mark.parametrize(
    "bad",
    ["garbage", "/ip4/1.2.3/tcp/5/p2p/12D3KooWMgLAsHqV95yhKK1Chk3q2GRsUsfnukFcEN4U5RqpfDt5", "/ip4/1.2.3.4/tcp/1"],
)
def test_hivemind_parser_loaded_without_hivemind_says_what_hivemind_says(bad):
    light = light_multiaddr()
    assert light is not None, "hivemind keeps no copy of py-multiaddr at hivemind/utils/multiaddr any more"
    with pytest.raises(NetworkConfigError) as early:
        check_initial_peer(bad, light)
    with pytest.raises(NetworkConfigError) as late:
        parse_initial_peer(bad)  # hivemind's own Multiaddr, where the DHT is built
    assert str(early.value) == str(late.value)
    assert str(check_initial_peer(PEER, light)) == PEER


def _args(tmp_path, command, *flags):
    peers = ["--initial-peers", PEER] if command == "join" and "--initial-peers" not in flags else []
    return build_parser().parse_args([command, *peers, "--workdir", str(tmp_path / "w"), *flags])


@pytest.mark.parametrize(
    "command, flags, error, needle",
    [
        ("start", ["--device", "tpu"], SwarmError, NOT_A_DEVICE),
        ("join", ["--initial-peers", "/ip4/1.2.3/tcp/1"], NetworkConfigError, "not a valid multiaddr"),
        ("join", ["--initial-peers", PEER, "/ip4/1.2.3.4/tcp/1"], NetworkConfigError, "has no /p2p/<peer id>"),
        ("start", ["--host-ip", "localhost"], NetworkConfigError, "--host-ip 'localhost' is not an IPv4"),
        ("join", ["--announce-ip", "my.host"], NetworkConfigError, "--announce-ip 'my.host' is not an IPv4"),
        ("join", ["--secret-file", "{tmp}/missing"], SecretError, "Cannot read the secret file"),
        ("start", ["--secret-file", "{tmp}/short"], SecretError, f"needs at least {MIN_SECRET_BYTES}"),
        ("start", ["--manifest", "{tmp}/missing.toml"], ManifestError, "Cannot read manifest file"),
        ("start", ["--manifest", "{tmp}/broken.toml"], ManifestError, "is not valid TOML/JSON"),
        ("start", ["--set", "inner_steps=-3"], ManifestError, "The manifest is invalid"),
        ("start", ["--preset", "7b"], ManifestError, "Unknown preset '7b'"),
    ],
)
def test_each_bad_input_is_refused_before_the_workdir_is_touched(tmp_path, command, flags, error, needle):
    (tmp_path / "short").write_text("hunter2\n")
    (tmp_path / "broken.toml").write_text("inner_steps = [")
    args = _args(tmp_path, command, *[flag.format(tmp=tmp_path) for flag in flags])
    with pytest.raises(error, match=re.escape(needle)):
        check_peer_command(args, creating=command == "start")
    assert not (tmp_path / "w").exists()  # a typo leaves no workdir (nor its lock) behind


def test_a_workdir_that_cannot_be_written_is_refused(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    args = build_parser().parse_args(["start", "--workdir", str(tmp_path / "a-file" / "w")])
    with pytest.raises(SwarmError, match="cannot be written"):
        check_peer_command(args, creating=True)


def test_a_good_command_line_gives_the_manifest_and_a_locked_workdir(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * MIN_SECRET_BYTES)
    started = check_peer_command(_args(tmp_path, "start", "--set", "inner_steps=7", "--secret-file", str(secret)), True)
    assert started.workdir == tmp_path / "w" and started.manifest.inner_steps == 7
    with pytest.raises(SwarmError, match=f"in use by another peer on this machine \\(pid {os.getpid()}\\)"):
        check_peer_command(_args(tmp_path, "join"), creating=False)
    joined = check_peer_command(_args(tmp_path / "other", "join"), creating=False)
    assert joined.manifest is None and (tmp_path / "other" / "w" / ".peer.lock").read_text() == str(os.getpid())


HOLDER = (  # holds a workdir's lock as a peer's forked helper does, with the pid of the peer that took it written in
    "import fcntl, sys, time\n"
    "h = open(sys.argv[1], 'a+'); fcntl.flock(h, fcntl.LOCK_EX); h.seek(0); h.truncate(); h.write(sys.argv[2])\n"
    "h.flush(); print('locked', flush=True); time.sleep(float(sys.argv[3]))\n"
)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


def test_a_lock_file_owner_is_alive_unless_its_pid_is_gone():
    assert owner_alive(str(os.getpid())) and owner_alive("?")
    assert not owner_alive(str(_dead_pid()))


@pytest.mark.parametrize("owner_gone", [True, False])
def test_a_killed_peers_helpers_are_waited_for_and_a_live_peer_is_not(tmp_path, owner_gone):
    """SIGKILL leaves the peer's forked helpers holding its lock a few seconds (swarm.hivemind_fixes.orphans): a restart
    that comes sooner waits for them; a peer that is still running is refused at once."""
    (tmp_path / "w").mkdir()
    owner = _dead_pid() if owner_gone else os.getpid()
    args = [str(tmp_path / "w" / ".peer.lock"), str(owner), "2"]
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, *args], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        if owner_gone:
            assert prepare_workdir(tmp_path / "w", exclusive=True) == tmp_path / "w"
            assert time.monotonic() - t0 > 0.5 and (tmp_path / "w" / ".peer.lock").read_text() == str(os.getpid())
        else:
            with pytest.raises(SwarmError, match=f"in use by another peer on this machine \\(pid {owner}\\)"):
                prepare_workdir(tmp_path / "w", exclusive=True)
            assert time.monotonic() - t0 < 1.5
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_bad_command_lines_are_refused_without_importing_torch_or_hivemind(tmp_path):
    probe = (
        "import sys; from client.cli import main\n"
        "codes = [main(argv.split()) for argv in sys.argv[1:]]\n"
        "heavy = sorted(m for m in ('torch', 'hivemind', 'transformers', 'datasets', 'numpy') if m in sys.modules)\n"
        "print('HEAVY', heavy, 'CODES', codes)\n"
    )
    (tmp_path / "a-file").write_text("not a directory")
    argvs = [
        f"start --device tpu --workdir {tmp_path}/w",
        f"start --manifest {tmp_path}/missing.toml --workdir {tmp_path}/w",
        f"start --set dataset.source=local --workdir {tmp_path}/w",  # no --data-path: the manifest names no files
        f"start --set dataset.source=local --data-path {tmp_path}/none.txt --workdir {tmp_path}/w",
        f"start --data-path {tmp_path}/a-file --workdir {tmp_path}/w",  # the built-in corpus takes no files
        f"join --initial-peers /ip4/1.2.3/tcp/1 --workdir {tmp_path}/w",
        f"join --initial-peers {PEER} --secret-file {tmp_path}/missing --workdir {tmp_path}/w",
        f"join --initial-peers {PEER} --workdir {tmp_path}/a-file/w",
        "status --initial-peers /ip4/1.2.3/tcp/1",
        f"status --initial-peers {PEER} --secret-file {tmp_path}/missing",
    ]
    result = subprocess.run([sys.executable, "-c", probe, *argvs], capture_output=True, text=True, timeout=120)
    assert "HEAVY [] CODES [2, 2, 2, 2, 2, 2, 2, 2, 2, 2]" in result.stdout, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == len(argvs) and all(line.startswith("error: ") for line in lines), result.stderr


def test_the_real_command_reports_a_missing_secret_file_in_one_line(tmp_path):
    missing = tmp_path / "no-such-secret"
    result = cli("join", "--initial-peers", PEER, "--secret-file", str(missing), "--workdir", str(tmp_path), *LOCAL)
    assert_clean_error(result, f"Cannot read the secret file {missing}: No such file or directory.")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / ".peer.lock").exists()  # refused before the workdir was claimed
