"""`swarm-client doctor`: the preflight a volunteer runs before joining, or when something is off.

Each check says pass, warn or fail and, when it is not a pass, the fix. The
network checks use a real DHT node, so "the peers answer" means they answered.
"""

from __future__ import annotations

import platform
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import psutil
from rich.console import Console

from client.preflight import DeviceKind, DoctorInputs
from swarm import SwarmError, claim_port, list_runs, start_dht
from swarm.dht.config import DEFAULT_PORT
from swarm.dht.network import probe_peers
from swarm.errors import PortTakenError

PASS, WARN, FAIL = "pass", "warn", "fail"
MIN_SHM = 1 << 30
MIN_OPEN_FILES = 4096
MIN_FREE_DISK = 10 << 30
CLOCK_WARN_SECONDS = 1.0
CLOCK_FAIL_SECONDS = 3.0  # hivemind refuses peers whose DHT time differs by more


@dataclass(frozen=True)
class Check:
    name: str
    outcome: str  # pass | warn | fail
    detail: str
    fix: str = ""


def run_checks(options: DoctorInputs, report: Callable[[Check], None]) -> list[Check]:
    """Run every check in order, handing each to ``report`` as soon as it is known."""
    checks: list[Check] = []
    for step in (_versions, _p2pd, _device, _shared_memory, _open_files, _disk, _network):
        for check in step(options):
            checks.append(check)
            report(check)
    return checks


def _versions(_: DoctorInputs) -> list[Check]:
    py = platform.python_version()
    out = [
        Check("python", PASS if sys.version_info >= (3, 11) else FAIL, py, "install Python 3.11 or newer"),
    ]
    for package, wanted in (("torch", ">=2.2,<3"), ("hivemind", ">=1.1.12,<1.2")):
        try:
            version = metadata.version(package)
            out.append(Check(package, PASS, version))
        except metadata.PackageNotFoundError:
            out.append(Check(package, FAIL, "not installed", f"pip install '{package}{wanted}'"))
    return out


def _p2pd(_: DoctorInputs) -> list[Check]:
    try:
        import hivemind.hivemind_cli as cli

        binary = Path(cli.__file__).parent / "p2pd"
        done = subprocess.run([str(binary), "-h"], capture_output=True, text=True, timeout=20)
        ok = "Usage" in done.stdout + done.stderr
    except (OSError, subprocess.SubprocessError, ImportError) as e:
        return [
            Check(
                "p2pd", FAIL, f"cannot run: {e}", "reinstall hivemind (its wheel ships p2pd): pip install -U hivemind"
            )
        ]
    if not ok:
        return [
            Check("p2pd", FAIL, f"{binary} did not start", "reinstall hivemind: pip install --force-reinstall hivemind")
        ]
    return [Check("p2pd", PASS, str(binary))]


def _device(options: DoctorInputs) -> list[Check]:
    import torch

    from client.hardware import choose_precision, detect

    try:
        hardware = detect(options.device)
    except SwarmError as e:
        return [Check("device", FAIL, str(e), "pick another --device, or fix the driver")]
    precision = choose_precision(hardware, prefer_bf16=False)
    if hardware.kind is DeviceKind.CPU:
        return [
            Check(
                "device",
                WARN,
                f"no GPU: training on {hardware.label} in {precision.label} (slow)",
                "on a GPU machine install a CUDA build of torch; in Docker pass --gpus all",
            )
        ]
    try:  # usable, not only visible: one small matmul under autocast
        x = torch.randn(256, 256, device=hardware.device)
        with torch.autocast(hardware.kind.value, dtype=precision.autocast_dtype or torch.float32):
            float((x @ x).sum())
    except Exception as e:
        return [Check("device", FAIL, f"{hardware.label} is visible but failed a test step: {e}", "check the driver")]
    return [Check("device", PASS, f"{hardware.label}, {precision.label}")]


def _shared_memory(_: DoctorInputs) -> list[Check]:
    try:
        size = psutil.disk_usage("/dev/shm").total
    except OSError:
        return [Check("shared memory", WARN, "/dev/shm not found", "hivemind passes tensors between processes there")]
    if size < MIN_SHM:
        return [
            Check(
                "shared memory",
                WARN,
                f"/dev/shm is {size / 2**20:.0f} MiB",
                "in Docker run with --ipc=host (or --shm-size=2g); the averager shares tensors through it",
            )
        ]
    return [Check("shared memory", PASS, f"/dev/shm {size / 2**30:.1f} GiB")]


def _open_files(_: DoctorInputs) -> list[Check]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < MIN_OPEN_FILES:
        return [
            Check(
                "open files",
                WARN,
                f"limit {soft} (hard {hard})",
                f"raise it: ulimit -n {min(hard, 65536) if hard > 0 else 65536} (Docker: --ulimit nofile=65536:65536)",
            )
        ]
    return [Check("open files", PASS, f"limit {soft}")]


def _disk(options: DoctorInputs) -> list[Check]:
    path = options.workdir.expanduser()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    detail = f"{free / 2**30:.1f} GiB free in {path}"
    if free < 1 << 30:
        return [Check("disk", FAIL, detail, "checkpoints need room: free space or pick another --workdir")]
    if free < MIN_FREE_DISK:
        return [Check("disk", WARN, detail, "a 1B-parameter run keeps two checkpoints of about 13 GB each")]
    return [Check("disk", PASS, detail)]


def _network(options: DoctorInputs) -> list[Check]:
    config = options.network
    if not config.initial_peers:
        return [
            Check(
                "initial peers",
                WARN,
                "none given: only local checks were run",
                "run `swarm-client doctor --initial-peers <multiaddr>` with the run's address",
            )
        ]
    checks: list[Check] = []
    try:
        claim = claim_port(config.host_ip, config.host_port)
    except PortTakenError:
        checks.append(
            Check(
                "port",
                WARN,
                f"port {config.host_port} is in use (a peer already running?)",
                "checked reachability on a random port instead; stop the other peer to test the real one",
            )
        )
        claim = claim_port(config.host_ip, 0)
        config = config.model_copy(update=dict(announce_ip=None))
    except SwarmError as e:
        return [Check("port", FAIL, "cannot listen", str(e))]
    if claim.moved:
        checks.append(
            Check(
                "port",
                WARN,
                f"port {DEFAULT_PORT} is in use on this machine (another peer?); a peer started now listens on "
                f"{claim.port}",
                f"forward port {claim.port} too, or give each peer its own --host-port",
            )
        )
    config = config.model_copy(update=dict(host_port=claim.port))
    try:
        dht = start_dht(config, claim)
    except SwarmError as e:
        return [*checks, Check("initial peers", FAIL, "no answer", str(e))]
    try:
        probes = probe_peers(dht, config.initial_peers, timeout=config.startup_timeout)
        answered = [p for p in probes if p.responded]
        if not answered:
            return [
                *checks,
                Check(
                    "initial peers",
                    FAIL,
                    "joined the DHT but no initial peer answered a ping",
                    "check the addresses and that the peers are still running",
                ),
            ]
        rtt = min(p.round_trip or 0.0 for p in answered)
        checks.append(
            Check("initial peers", PASS, f"{len(answered)}/{len(probes)} answered, round trip {rtt * 1000:.0f} ms")
        )
        checks.append(_reachability(answered, config.host_port, options.network.announce_ip))
        checks.append(_clock(answered))
        runs = list_runs(dht)
        names = ", ".join(f"{r.run_id} ({r.name})" for r in runs) or "none announced"
        checks.append(
            Check("runs", PASS if runs else WARN, names, "" if runs else "ask the operator whether the run is up")
        )
    finally:
        dht.shutdown()
    return checks


def _reachability(answered, port: int, announce_ip: str | None) -> Check:
    if any(p.dialed_back for p in answered):
        return Check("reachability", PASS, f"peers can dial this machine back on port {port}: direct connections")
    return Check(
        "reachability",
        WARN,
        "peers could not dial this machine back (NAT or firewall): you would be relayed or need client mode",
        f"forward TCP port {port} to this machine and pass --host-port {port} --announce-ip <your public IP>; "
        "or run with --client-mode (you train and average, but cannot serve state to others)"
        + ("" if announce_ip is None else f" (announced {announce_ip}: is that address right?)"),
    )


def _clock(answered) -> Check:
    offsets = [p.clock_offset for p in answered if p.clock_offset is not None]
    if not offsets:
        return Check("clock", WARN, "peers did not report their time", "")
    worst = max(offsets, key=abs)
    detail = f"offset against peers {worst:+.2f} s"
    fix = "sync the clock (e.g. enable NTP: timedatectl set-ntp true); records expire by wall-clock time"
    if abs(worst) > CLOCK_FAIL_SECONDS:
        return Check("clock", FAIL, detail, fix)
    if abs(worst) > CLOCK_WARN_SECONDS:
        return Check("clock", WARN, detail, fix)
    return Check("clock", PASS, detail)


_STYLES = {PASS: "green", WARN: "yellow", FAIL: "bold red"}


def print_check(check: Check, console: Console | None = None) -> None:
    console = console or Console(highlight=False)
    console.print(
        f"[{_STYLES[check.outcome]}]{check.outcome.upper():4}[/] {check.name}: {check.detail}", soft_wrap=True
    )
    if check.fix and check.outcome != PASS:
        console.print(f"     fix: {check.fix}", style="dim" if check.outcome == WARN else None, soft_wrap=True)
