"""`swarm-client demo`: a whole swarm on this machine, to see DiLoCo work in a few minutes.

It starts real peers as separate `swarm-client` processes on 127.0.0.1 (nothing
is dialled beyond loopback), on the tiny preset and the built-in corpus, and
reports each peer's held-out loss before and after, and whether they agree.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from client.dashboard import LiveDashboard
from client.status import observer_dashboard
from client.telemetry import Telemetry
from swarm import NetworkConfig, SwarmError
from swarm.observer import Observer

START_TIMEOUT = 120.0
EVAL_SEQUENCES = 32
_JOIN_LINE = re.compile(r"^swarm-client join --initial-peers (?P<maddrs>.+) --run (?P<run>[0-9a-f]{16})$")


def _peer_command(workdir: Path, index: int, epochs: int, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "client.cli",
        *extra,
        "--host-ip",
        "127.0.0.1",
        "--host-port",
        "0",
        "--workdir",
        str(workdir / f"peer{index}"),
        "--name",
        f"demo-{index}",
        "--device",
        "cpu",
        "--max-epochs",
        str(epochs),
        "--eval-sequences",
        str(EVAL_SEQUENCES),
        "--result-file",
        str(workdir / f"peer{index}.json"),
    ]


def _pump(proc: subprocess.Popen, prefix: str, show: Callable[[str, str], None], lines: list[str]) -> None:
    for line in proc.stdout:
        line = line.rstrip("\n")
        lines.append(line)
        show(prefix, line)


def run_demo(
    peers: int, epochs: int, workdir: Path | None = None, console: Console | None = None, dashboard: bool = False
) -> int:
    """``dashboard``: watch the swarm live (as `status` does) instead of streaming the peers' log lines."""
    if peers < 1 or epochs < 1:
        raise SwarmError("demo needs --peers >= 1 and --epochs >= 1.")
    console = console or Console()
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="swarm-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // peers)))
    console.print(
        f"[bold]swarm demo[/bold]: {peers} peers x {epochs} outer rounds, tiny preset, built-in corpus; files in {root}"
    )
    procs: list[subprocess.Popen] = []
    outputs: list[list[str]] = []
    threads: list[threading.Thread] = []
    telemetry = Telemetry()

    def show(prefix: str, line: str) -> None:
        if not dashboard:
            console.print(f"[dim]{prefix}[/dim] {line}", markup=True, highlight=False, soft_wrap=True)
        elif "round ->" in line or "error" in line.lower():
            telemetry.event("round" if "averaged" in line else "log", f"{prefix}: {line}")

    def spawn(index: int, args: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(
            _peer_command(root, index, epochs, args),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        procs.append(proc)
        outputs.append([])
        threads.append(threading.Thread(target=_pump, args=(proc, f"peer{index}", show, outputs[-1]), daemon=True))
        threads[-1].start()
        return proc

    try:
        first = spawn(0, ["start", "--preset", "tiny"])
        deadline = time.monotonic() + START_TIMEOUT
        join = None
        while join is None:
            if first.poll() is not None or time.monotonic() > deadline:
                raise SwarmError("The demo's first peer did not start:\n" + "\n".join(outputs[0][-20:]))
            join = next((m for line in outputs[0] if (m := _JOIN_LINE.match(line))), None)
            time.sleep(0.1)
        for index in range(1, peers):
            spawn(index, ["join", "--initial-peers", *join["maddrs"].split(), "--run", join["run"]])
        if dashboard:
            _watch_live(join["maddrs"].split(), join["run"], procs, telemetry, console)
        codes = [proc.wait() for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
    for thread in threads:
        thread.join(timeout=5)
    return _summarize(root, peers, codes, console)


def _watch_live(
    maddrs: list[str], run_id: str, procs: list[subprocess.Popen], telemetry: Telemetry, console: Console
) -> None:
    """The demo's swarm as `status` shows it, until every peer has exited."""
    network = NetworkConfig(initial_peers=maddrs, host_ip="127.0.0.1", host_port=0)
    deadline = time.monotonic() + START_TIMEOUT
    while True:  # the first peer announces its run only once its model is built
        try:
            observer = Observer.connect(network, run_id)
            break
        except SwarmError as e:
            if time.monotonic() > deadline or all(proc.poll() is not None for proc in procs):
                console.print(f"(no live view: {e})")  # the demo still works without its view
                return
            time.sleep(1.0)
    source = observer_dashboard(observer, telemetry, "swarm-client demo")
    watch = source.watch.start()
    try:
        with LiveDashboard(source, console=console):
            while any(proc.poll() is None for proc in procs):
                time.sleep(0.5)
    finally:
        watch.stop()
        observer.close()


def _summarize(root: Path, peers: int, codes: list[int], console: Console) -> int:
    results = []
    for index in range(peers):
        path = root / f"peer{index}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    table = Table(title="swarm demo result")
    for column in ("peer", "exit", "rounds (averaged)", "epoch", "held-out loss before", "after", "checksum"):
        table.add_column(column)
    for index, (code, result) in enumerate(zip(codes, results)):
        if result is None:
            table.add_row(f"demo-{index}", str(code), "-", "-", "-", "-", "-")
            continue
        table.add_row(
            f"demo-{index}",
            str(code),
            f"{result['rounds']} ({result['averaged_rounds']})",
            str(result["epoch"]),
            f"{result['eval_loss_start']:.4f}",
            f"{result['eval_loss_end']:.4f}",
            result["checksum"][:12],
        )
    console.print(table)
    ok = all(code == 0 for code in codes) and all(r is not None for r in results)
    if ok:
        improved = all(r["eval_loss_end"] < r["eval_loss_start"] for r in results)
        agree = len({(r["epoch"], r["checksum"]) for r in results}) == 1
        console.print(
            f"loss went down: {'yes' if improved else 'NO'}; "
            f"all peers hold the same parameters: {'yes' if agree else 'NO'}"
        )
        ok = improved and agree
    return 0 if ok else 1
