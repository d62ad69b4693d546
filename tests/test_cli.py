"""Command-line parsing, SWARM_* variables, and the bad-input messages (one paragraph, no traceback)."""

import json
import signal
import subprocess
import sys
import time

import hivemind
import pytest
from client_helpers import FAST, LOCAL, assert_clean_error, cli, spawn, wait_for_line
from diloco_helpers import tiny_manifest

from client.cli import build_parser
from client.options import ENV_VARS, EVAL_SEQUENCES_DEFAULT, held_out_sequences
from swarm import DatasetSpec, NetworkConfig, publish_manifest, start_dht, visible_maddrs

PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWMgLAsHqV95yhKK1Chk3q2GRsUsfnukFcEN4U5RqpfDt5"


def test_join_options_parse():
    args = build_parser().parse_args(
        [
            "join",
            "--initial-peers",
            PEER,
            PEER,
            "--run",
            "0123456789abcdef",
            "--name",
            "ada",
            "--host-port",
            "4000",
            "--micro-batch",
            "6",
            "--max-epochs",
            "3",
            "--client-mode",
            "--device",
            "cuda:1",
        ]
    )
    assert args.initial_peers == [PEER, PEER] and args.run == "0123456789abcdef" and args.name == "ada"
    assert args.host_port == 4000 and args.micro_batch == 6 and args.max_epochs == 3 and args.client_mode
    assert args.device == "cuda:1" and args.host_ip == "0.0.0.0"
    assert build_parser().parse_args(["join", "--initial-peers", PEER]).micro_batch is None  # auto


ENV_VALUES = {
    "initial_peers": (f"{PEER},{PEER}", [PEER, PEER]),
    "run": ("0123456789abcdef", "0123456789abcdef"),
    "name": ("ada", "ada"),
    "identity": ("/tmp/id.key", "/tmp/id.key"),
    "workdir": ("/tmp/w", "/tmp/w"),
    "host_ip": ("127.0.0.1", "127.0.0.1"),
    "host_port": ("4001", 4001),
    "announce_ip": ("203.0.113.9", "203.0.113.9"),
    "device": ("cpu", "cpu"),
    "micro_batch": ("3", 3),
    "max_epochs": ("7", 7),
    "client_mode": ("true", True),
    "eval_sequences": ("5", 5),
    "eval_every": ("2", 2),
    "verbose": ("1", True),
    "no_dashboard": ("yes", True),
    "log_json": ("/tmp/steps.jsonl", "/tmp/steps.jsonl"),
    "secret_file": ("/run/secrets/swarm", "/run/secrets/swarm"),
    "nice": ("0", 0),
    "data_path": ("/srv/corpus/*.txt", "/srv/corpus/*.txt"),
}


@pytest.mark.parametrize(
    "flags, expected",
    [
        ([], 0),
        (["--eval-every", "2"], EVAL_SEQUENCES_DEFAULT),  # alone: the default number of sequences
        (["--eval-every", "2", "--eval-sequences", "8"], 8),
        (["--eval-sequences", "8"], 8),  # scored at start and end only
    ],
)
def test_eval_every_alone_scores_the_default_number_of_sequences(flags, expected):
    args = build_parser().parse_args(["join", "--initial-peers", PEER, *flags])
    assert held_out_sequences(args) == expected


@pytest.mark.parametrize("dest", sorted(set(ENV_VARS) - {"preset", "manifest", "max_age"}))
def test_every_join_option_reads_its_environment_variable(monkeypatch, dest):
    raw, expected = ENV_VALUES[dest]
    monkeypatch.setenv(ENV_VARS[dest], raw)
    args = build_parser().parse_args(["join"] + ([] if dest == "initial_peers" else ["--initial-peers", PEER]))
    value = getattr(args, dest)
    assert (str(value) if dest in ("identity", "workdir", "log_json", "secret_file") else value) == expected


def test_health_reads_its_max_age_variable(monkeypatch):
    monkeypatch.setenv("SWARM_HEALTH_MAX_AGE", "90")
    monkeypatch.setenv("SWARM_WORKDIR", "/data")
    args = build_parser().parse_args(["health"])
    assert args.max_age == 90.0 and str(args.workdir) == "/data"


def test_start_reads_preset_and_manifest_variables(monkeypatch):
    monkeypatch.setenv("SWARM_PRESET", "150m")
    monkeypatch.setenv("SWARM_MANIFEST", "/tmp/run.toml")
    args = build_parser().parse_args(["start"])
    assert args.preset == "150m" and str(args.manifest) == "/tmp/run.toml"


def test_command_line_wins_over_environment(monkeypatch):
    monkeypatch.setenv("SWARM_NAME", "from-env")
    assert build_parser().parse_args(["join", "--initial-peers", PEER, "--name", "flag"]).name == "flag"


def test_malformed_multiaddr(tmp_path):
    result = cli("join", "--initial-peers", "/ip4/1.2.3/tcp/1", "--workdir", str(tmp_path), *LOCAL)
    assert_clean_error(result, "not a valid multiaddr", "/ip4/")


def test_unreachable_initial_peers(tmp_path):
    t0 = time.monotonic()
    result = cli("join", "--initial-peers", PEER, "--workdir", str(tmp_path), *LOCAL, timeout=150)
    assert_clean_error(result, "None of the initial peers answered")
    assert time.monotonic() - t0 < 150


def test_unknown_and_ambiguous_run_ids(tmp_path):
    dht = start_dht(NetworkConfig(host_ip="127.0.0.1", host_port=0))
    try:
        publish_manifest(dht, tiny_manifest(name="first"))
        maddr = visible_maddrs(dht)[0]
        result = cli("join", "--initial-peers", maddr, "--run", "fedcba9876543210", "--workdir", str(tmp_path), *LOCAL)
        assert_clean_error(result, "No peer announces run fedcba9876543210", tiny_manifest(name="first").run_id)
        publish_manifest(dht, tiny_manifest(name="second"))
        result = cli("join", "--initial-peers", maddr, "--workdir", str(tmp_path), *LOCAL)
        assert_clean_error(result, "hosts 2 runs", "--run")
    finally:
        dht.shutdown()


def test_a_local_run_without_data_path_is_one_line_saying_what_to_give(tmp_path):
    """The manifest never names a path on a peer's machine: each peer gives its own files, the creator included."""
    start = ["start", "--preset", "tiny", "--set", "dataset.source=local", "--workdir", str(tmp_path), *LOCAL]
    result = cli(*start)
    assert_clean_error(result, "This run's dataset is local", "--data-path")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    put_in = cli(*start, "--set", f"dataset.path={tmp_path}")  # the old way: refused, saying the new one
    assert_clean_error(put_in, "manifest is invalid", "never names a path on a peer's machine", "--data-path")
    assert_clean_error(cli(*start, "--data-path", str(tmp_path / "none.txt")), "matches no files")

    dht = start_dht(NetworkConfig(host_ip="127.0.0.1", host_port=0))
    try:
        local = tiny_manifest(name="local-data").model_copy(update=dict(dataset=DatasetSpec(source="local")))
        publish_manifest(dht, local)
        maddr = visible_maddrs(dht)[0]
        result = cli("join", "--initial-peers", maddr, "--workdir", str(tmp_path / "joiner"), *LOCAL, timeout=150)
        assert_clean_error(result, "This run's dataset is local", "--data-path")
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    finally:
        dht.shutdown()


def test_a_local_run_trains_on_the_files_of_its_data_path(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"part-{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 400)
    result_file = tmp_path / "result.json"
    args = [
        "start",
        "--preset",
        "tiny",
        *FAST,
        *LOCAL,
        "--workdir",
        str(tmp_path / "w"),
        "--set",
        "dataset.source=local",
    ]
    args += ["--set", "dataset.num_shards=2", "--data-path", str(corpus), "--eval-sequences", "4"]
    done = cli(*args, "--max-epochs", "1", "--result-file", str(result_file), timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr
    assert f"Training on your own 4 files of --data-path {corpus}." in done.stdout
    result = json.loads(result_file.read_text())
    assert result["rounds"] == 1 and result["eval_loss_end"] < result["eval_loss_start"], result
    manifest = json.loads(next((tmp_path / "w" / "runs").glob("*/manifest.json")).read_text())
    assert manifest["dataset"]["source"] == "local" and manifest["dataset"]["path"] is None  # no path published


def test_invalid_manifest_file(tmp_path):
    bad = tmp_path / "run.json"
    data = json.loads(tiny_manifest().canonical_json())
    data["inner_steps"] = -3
    bad.write_text(json.dumps(data))
    result = cli("start", "--manifest", str(bad), "--workdir", str(tmp_path), *LOCAL)
    assert_clean_error(result, "manifest is invalid", "inner_steps")
    toml = tmp_path / "run.toml"
    toml.write_text("inner_steps = [")
    assert_clean_error(cli("start", "--manifest", str(toml), "--workdir", str(tmp_path), *LOCAL), "not valid TOML")


def test_device_that_does_not_exist(tmp_path):
    result = cli(
        "start", "--preset", "tiny", "--workdir", str(tmp_path), "--host-ip", "127.0.0.1", "--device", "cuda:3"
    )
    assert_clean_error(result, "--device cuda:3")
    assert_clean_error(cli("start", "--workdir", str(tmp_path), "--device", "tpu"), "not one of")


def test_workdir_that_cannot_be_written(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = cli("join", "--initial-peers", PEER, "--workdir", str(blocker / "workdir"), *LOCAL)
    assert_clean_error(result, "cannot be written", "--workdir")


def test_help_lists_the_commands():
    result = cli()
    assert result.returncode == 0 and all(c in result.stdout for c in ("start", "join", "demo", "export"))
    assert hivemind.__version__.startswith("1.1")


def test_a_second_peer_on_the_same_workdir_is_refused(tmp_path):
    """Two peers sharing a workdir would share one identity and overwrite each other's checkpoints."""
    log = tmp_path / "first.log"
    first = spawn("start", "--preset", "tiny", "--workdir", str(tmp_path / "w"), *LOCAL, log=log)
    try:
        wait_for_line(log, "swarm-client join", first)
        result = cli("start", "--preset", "tiny", "--workdir", str(tmp_path / "w"), *LOCAL)
        assert_clean_error(result, "is in use by another peer on this machine", f"pid {first.pid}", "--workdir")
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=60) == 0, log.read_text()[-3000:]


def test_health_imports_neither_torch_nor_hivemind(tmp_path):
    """Docker runs it every 30 s with a 10 s timeout; importing torch and hivemind took 2-6 s."""
    probe = (
        "import sys; from client.cli import main; code = main(['health', '--workdir', sys.argv[1]]); "
        "heavy = sorted(m for m in ('torch', 'hivemind', 'transformers', 'datasets', 'numpy') if m in sys.modules); "
        "print('HEAVY', heavy, 'CODE', code)"
    )
    result = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert "HEAVY [] CODE 1" in result.stdout, result.stdout + result.stderr  # no status file here: unhealthy


def test_a_stop_while_the_command_line_is_read_exits_cleanly():
    """SIGTERM handling starts before the parser is built: a stop that arrives while it is (CI once saw one inside
    argparse's import of shutil) leaves at once with exit 0 and no traceback. The signal is sent from inside the
    parser's construction, so it lands there every time."""
    script = (
        "import os, signal\n"
        "import client.cli as cli\n"
        "build = cli.build_parser\n"
        "def interrupted():\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return build()\n"
        "cli.build_parser = interrupted\n"
        "cli.entry_point()\n"
    )
    result = subprocess.run([sys.executable, "-c", script, "status"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr


def test_a_dataset_file_that_cannot_be_parsed_ends_the_run_with_one_line_and_keeps_the_checkpoint(tmp_path):
    broken = tmp_path / "docs.jsonl"
    broken.write_text('{"text": "a first document that parses"}\n{"text": cut off here\n')
    workdir = tmp_path / "w"
    data = ("--set", "dataset.source=local", "--data-path", str(broken))  # the peer's own file, not the manifest's
    # with held-out sequences the main thread reads the file too, while the prefetch thread reads its shard
    result = cli("start", "--preset", "tiny", "--workdir", str(workdir), *LOCAL, *data, "--eval-sequences", "4")
    assert_clean_error(result, f"The local dataset {broken} could not be read", "JSON parse error")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr  # datasets' own error line is in the log
    assert list((workdir / "runs").glob("*/checkpoints/state-*.safetensors")), "the start's checkpoint was lost"
    assert "ArrowInvalid" in (workdir / "logs" / "swarm-client.log").read_text()  # the reader's story is kept


def test_a_bug_is_one_line_on_the_terminal_and_a_traceback_in_the_log(monkeypatch, capsys, caplog):
    import client.cli

    def broken(args):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(client.cli, "_status", broken)
    assert client.cli.main(["status", "--initial-peers", PEER]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: unexpected ZeroDivisionError: a bug. This is a bug in swarm-client"), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert any(r.exc_info and r.exc_info[0] is ZeroDivisionError for r in caplog.records)  # the traceback is logged
