"""Real `swarm-client` peers, each in its own namespace, and the records they write.

The benchmarks measure the volunteer's program, not a model of it: every peer is
``python -m client.cli start|join`` in its own process and network namespace. Its
per-step and per-round figures come from the CLI's ``--log-json`` lines; each
line is stamped with unix time, so rounds can be matched with wire counters.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import tied_to_us
from benchmarks.netns import Lab

PORT = 31337
_JOIN_LINE = re.compile(r"swarm-client join --initial-peers (?P<maddrs>.+) --run (?P<run>[0-9a-f]{16})")


@dataclass
class JoinInfo:
    maddrs: list[str]
    run_id: str


@dataclass
class PeerProcess:
    index: int
    ns: str
    proc: subprocess.Popen
    stdout: Path
    log_json: Path
    started_at: float  # unix time the command was launched

    def records(self, kind: str | None = None) -> list[dict]:
        return read_records(self.log_json, kind)

    def rounds(self) -> list[dict]:
        return self.records("round")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def terminate(self, timeout: float = 30) -> None:
        if not self.alive():
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()


def read_records(path: Path, kind: str | None = None) -> list[dict]:
    """The complete JSON lines written so far (a line being written is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if kind is None or record.get("type") == kind:
            out.append(record)
    return out


def peer_command(
    lab: Lab,
    index: int,
    workdir: Path,
    log_json: Path,
    overrides: list[str],
    join: JoinInfo | None,
    extra: list[str] = (),
) -> list[str]:
    address = lab.address(index)
    head = ["start", "--preset", "tiny", *(a for o in overrides for a in ("--set", o))]
    if join is not None:
        head = ["join", "--initial-peers", *join.maddrs, "--run", join.run_id]
    return [
        *("ip", "netns", "exec", lab.peers[index]),
        *(sys.executable, "-m", "client.cli", *head),
        *("--host-ip", address, "--host-port", str(PORT), "--announce-ip", address),
        *("--device", "cpu", "--workdir", str(workdir / f"peer{index}"), "--name", f"bench-{index}"),
        *("--no-dashboard", "--log-json", str(log_json)),
        *extra,
    ]


def spawn_peer(
    lab: Lab,
    index: int,
    workdir: Path,
    overrides: list[str] = (),
    join: JoinInfo | None = None,
    extra: list[str] = (),
    threads: int = 1,
) -> PeerProcess:
    """Add a namespace for the peer (if it has none) and start the real CLI in it."""
    if index not in lab.peers:
        lab.add_peer(index)
    workdir.mkdir(parents=True, exist_ok=True)
    log_json = workdir / f"peer{index}.jsonl"
    stdout = workdir / f"peer{index}.log"
    log_json.unlink(missing_ok=True)
    command = peer_command(lab, index, workdir, log_json, list(overrides), join, list(extra))
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    repo_root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo_root), env.get("PYTHONPATH", "")]))
    started = time.time()
    with stdout.open("w") as handle:
        proc = subprocess.Popen(
            command, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=repo_root, **tied_to_us()
        )
    return PeerProcess(index, lab.peers[index], proc, stdout, log_json, started)


def wait_for_join_info(peer: PeerProcess, timeout: float = 180) -> JoinInfo:
    """The join command line the first peer prints once its DHT is up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = peer.stdout.read_text() if peer.stdout.exists() else ""
        if match := _JOIN_LINE.search(text):
            return JoinInfo(match["maddrs"].split(), match["run"])
        if not peer.alive():
            raise RuntimeError(f"peer {peer.index} exited ({peer.proc.returncode}):\n{text[-3000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"peer {peer.index} printed no join line in {timeout:.0f} s:\n{peer.stdout.read_text()[-3000:]}")


def stop_all(peers: list[PeerProcess], timeout: float = 30) -> None:
    """SIGTERM everyone at once (they checkpoint and leave), then SIGKILL stragglers."""
    for p in peers:
        if p.alive():
            p.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in peers:
        try:
            p.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


def tail(path: Path, chars: int = 2000) -> str:
    return path.read_text()[-chars:] if path.exists() else ""
