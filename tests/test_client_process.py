"""The real `swarm-client` as volunteers run it: demo, resume after SIGKILL, corrupt checkpoints, SIGTERM."""

import json
import re
import signal
import time

import torch
from client_helpers import FAST, LOCAL, cli, spawn, wait_for_line
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

JOIN = re.compile(r"swarm-client join --initial-peers (\S+) --run ([0-9a-f]{16})")


def test_demo_two_peers_two_epochs_end_to_end(tmp_path):
    result = cli("demo", "--peers", "2", "--epochs", "2", "--workdir", str(tmp_path), timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "loss went down: yes; all peers hold the same parameters: yes" in result.stdout
    assert "Using custom data configuration" not in result.stdout + result.stderr  # datasets' noise, not ours
    peers = [json.loads((tmp_path / f"peer{i}.json").read_text()) for i in range(2)]
    assert all(p["eval_loss_end"] < p["eval_loss_start"] - 0.1 for p in peers), peers
    assert peers[0]["checksum"] == peers[1]["checksum"] and peers[0]["epoch"] == peers[1]["epoch"] == 2
    # one state, one figure: an overlapped peer scores its outer state, not the steps it took in flight
    assert abs(peers[0]["eval_loss_end"] - peers[1]["eval_loss_end"]) < 1e-6, peers
    assert all(p["averaged_rounds"] >= 1 for p in peers)

    out = tmp_path / "exported"
    exported = cli("export", "--workdir", str(tmp_path / "peer0"), "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)  # written beside the model: the folder generates text as it is
    prompt = tokenizer("def main(", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert generated.shape[1] == prompt.input_ids.shape[1] + 12
    assert tokenizer.decode(generated[0], skip_special_tokens=True).startswith("def main(")
    with safe_open(peers[0]["checkpoint"], framework="pt") as ckpt:
        outer = [ckpt.get_tensor(f"param.{i:05d}") for i in range(len(list(model.parameters())))]
        assert ckpt.metadata()["epoch"] == "2"
    assert all(torch.equal(p.detach(), g) for p, g in zip(model.parameters(), outer))


def test_an_overlapped_peer_takes_the_stand_in_steps_out_of_its_first_moment_as_each_round_lands(tmp_path):
    """Alone, each overlapped round lands as a local one after the matchmaking timeout, while training goes on
    from the stand-in: the trainer corrects AdamW's first moment at every landing (``client/moments.py``)."""
    result_file = tmp_path / "result.json"
    overlap = ["--set", "averaging.overlap=true", "--set", "averaging.compression=fp4"]
    args = ["start", "--preset", "tiny", *FAST, *overlap, *LOCAL, "--workdir", str(tmp_path / "w")]
    done = cli(*args, "--max-epochs", "2", "--result-file", str(result_file), timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr
    result = json.loads(result_file.read_text())
    assert result["rounds"] == 2 and result["averaged_rounds"] == 0
    assert result["first_moment_corrections"] == 2, result


def test_an_overlapped_peer_training_while_its_round_matchmakes_says_training_in_its_status_file(tmp_path):
    """Its record says matchmaking, for the others' matchmaking, from the round's first moment until the average
    lands; the volunteer's status file and dashboard say it trains, and what the round is doing meanwhile."""
    log, workdir = tmp_path / "peer.log", tmp_path / "w"
    slow_round = ["--set", "inner_steps=15", "--set", "averaging.matchmaking_timeout=60.0"]  # alone: it times out
    proc = spawn("start", "--preset", "tiny", *FAST, *slow_round, *LOCAL, "--workdir", str(workdir), log=log)
    seen: set[tuple[str, str | None]] = set()
    deadline = time.monotonic() + 180
    while ("training", "matchmaking") not in seen and time.monotonic() < deadline and proc.poll() is None:
        try:
            status = json.loads((workdir / "status.json").read_text())
            seen.add((status["state"], status.get("round")))
        except (OSError, ValueError):  # not written yet
            pass
        time.sleep(0.1)
    assert ("training", "matchmaking") in seen, (seen, log.read_text()[-3000:])
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    assert "the round averaging in the background is dropped" in log.read_text()


def test_resume_after_sigkill_keeps_identity_and_epoch(tmp_path):
    args = ["start", "--preset", "tiny", *FAST, *LOCAL, "--workdir", str(tmp_path)]
    log = tmp_path / "first.log"
    proc = spawn(*args, log=log)
    first_id = wait_for_line(log, "Peer ", proc).split()[1]
    wait_for_line(log, "round -> epoch 2", proc, timeout=180)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    second = cli(*args, "--max-epochs", "1", timeout=180)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr
    # the kill may land between the round's log line and its checkpoint: epoch 1 or 2 is the last good one
    resumed = re.search(r"Resuming from state-\d+\.safetensors \(epoch (\d+)\)", second.stdout)
    assert resumed and int(resumed.group(1)) >= 1, second.stdout
    epoch = int(resumed.group(1))
    assert f"starting at epoch {epoch}: resumed from checkpoint" in second.stdout
    assert f"Peer {first_id} " in second.stdout  # same identity after the restart
    assert f"round -> epoch {epoch + 1}:" in second.stdout


def test_corrupt_checkpoint_falls_back_to_peers_and_sigterm_leaves_cleanly(tmp_path):
    a_log, b_log = tmp_path / "a.log", tmp_path / "b.log"
    a = spawn("start", "--preset", "tiny", *FAST, *LOCAL, "--workdir", str(tmp_path / "a"), "--name", "a", log=a_log)
    maddr, run_id = JOIN.search(wait_for_line(a_log, "swarm-client join", a)).groups()
    b_args = ["join", "--initial-peers", maddr, *LOCAL, "--workdir", str(tmp_path / "b"), "--name", "b"]
    b = spawn(*b_args, log=b_log)
    wait_for_line(b_log, "round -> epoch 2", b, timeout=180)
    ckpt_dir = tmp_path / "b" / "runs" / run_id / "checkpoints"
    deadline = time.monotonic() + 60  # the round's checkpoint is written just after its log line
    while not list(ckpt_dir.glob("state-*.safetensors")) and time.monotonic() < deadline:
        time.sleep(0.2)
    b.send_signal(signal.SIGKILL)
    b.wait(timeout=10)
    checkpoints = sorted(ckpt_dir.glob("state-*.safetensors"))
    assert checkpoints
    for path in checkpoints:
        path.write_bytes(b"\x00" * 100)  # a disk that lost them

    restarted = cli(*b_args, "--max-epochs", "1", timeout=180)
    assert restarted.returncode == 0, restarted.stdout[-3000:] + restarted.stderr
    assert "Traceback" not in restarted.stdout + restarted.stderr
    assert restarted.stdout.count("is unusable") == len(checkpoints)
    # from the peers: the whole state, or (the fresh model is epoch 0's, which the swarm's checksums still
    # name) the few rounds since, replayed
    fetched = r"state of epoch \d+ (?:\(checksum \w+\) )?loaded from|caught up to epoch \d+ by replaying \d+ rounds"
    got = re.search(fetched, restarted.stdout)
    assert got, restarted.stdout
    # the line others join with comes once this peer has caught up: a joiner that came sooner found no state
    assert got.start() < restarted.stdout.index("Others join with:\nswarm-client join"), restarted.stdout

    a.send_signal(signal.SIGTERM)
    assert a.wait(timeout=20) == 0, a_log.read_text()[-3000:]
    text = a_log.read_text()
    assert "SIGTERM received" in text and "Checkpoint written" in text
    assert text.index("Run ") < text.index("Peer Qm") < text.index("Others join with:"), text[:3000]
    assert list((tmp_path / "a" / "runs" / run_id / "checkpoints").glob("state-*.safetensors"))


def test_sigusr1_finishes_the_round_then_leaves_and_health_says_left(tmp_path):
    log = tmp_path / "peer.log"
    workdir = tmp_path / "w"
    proc = spawn("start", "--preset", "tiny", *FAST, *LOCAL, "--workdir", str(workdir), log=log)
    wait_for_line(log, "round -> epoch 1", proc, timeout=180)
    healthy = cli("health", "--workdir", str(workdir))
    assert healthy.returncode == 0 and healthy.stdout.startswith("healthy: "), healthy.stdout
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=90) == 0, log.read_text()[-3000:]
    lines = log.read_text().splitlines()
    signalled = next(i for i, line in enumerate(lines) if "SIGUSR1 received" in line)
    finished = [line for line in lines[signalled:] if line.startswith("round -> epoch")]
    assert len(finished) == 1, lines[signalled:]  # exactly the round in progress, then out
    assert any("Checkpoint written" in line for line in lines[signalled:])
    left = cli("health", "--workdir", str(workdir))
    assert left.returncode == 1 and "the peer has left" in left.stdout, left.stdout
