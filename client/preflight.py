"""`swarm-client start`, `join` and `status` check what they were given before torch and hivemind are imported.

Those imports take 6 s on an idle machine and 25 s on a loaded one; a wrong --device, a manifest that cannot
be read or is invalid, a malformed --initial-peers address, a missing --secret-file or a workdir that cannot
be written is reported in a fraction of a second instead, with the message and exit code that the later
check gives on the paths that skip this one (the library). What is checked here is returned parsed (the
device, the DHT settings with the run's keys) and every command uses that, so nothing is read twice. Nothing
here imports torch, hivemind, transformers or datasets (tests/test_preflight.py checks it).
"""

from __future__ import annotations

import argparse
import enum
import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import psutil

from client.presets import build_manifest
from client.sources import DataSource, data_source
from swarm.dht.access import RunSecret
from swarm.dht.config import NetworkConfig
from swarm.errors import SwarmError
from swarm.inputs import check_initial_peer, check_ip, light_multiaddr
from swarm.manifest import RunManifest

_workdir_lock = None  # held for the life of the process
LEFTOVER_WAIT = 10.0  # seconds to wait for the helpers of a killed peer to leave its workdir (they take ~4 s)


class DeviceKind(enum.Enum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"
    MPS = "mps"


@dataclass(frozen=True)
class DeviceRequest:
    """A ``--device`` as written; whether this machine has it is ``client.hardware.detect``'s question."""

    kind: DeviceKind
    index: int | None = None  # the N of cuda:N


def parse_device(device: str) -> DeviceRequest:
    """``auto``, ``cpu``, ``cuda``, ``cuda:N`` or ``mps``, or a SwarmError naming them."""
    name, colon, index = device.partition(":")
    kind = next((k for k in DeviceKind if k.value == name), None)
    if kind is not None and not colon:
        return DeviceRequest(kind)
    if kind is DeviceKind.CUDA and index.isascii() and index.isdigit():
        return DeviceRequest(kind, int(index))
    raise SwarmError(f"--device {device!r} is not one of auto, cuda, cuda:N, mps or cpu.")


def prepare_workdir(workdir: Path, exclusive: bool = False) -> Path:
    """The workdir, writable; with ``exclusive``, locked against a second peer using it (the same identity
    twice would make two processes one peer, and their checkpoints would overwrite each other)."""
    global _workdir_lock
    workdir = workdir.expanduser()
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe = workdir / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise SwarmError(
            f"The workdir {workdir} cannot be written ({e.strerror}). Pick another with --workdir or "
            "fix its permissions (in Docker: mount a volume at /data)."
        ) from None
    if exclusive:
        handle = (workdir / ".peer.lock").open("a+")
        deadline = time.monotonic() + LEFTOVER_WAIT
        while not _try_lock(handle):
            handle.seek(0)
            owner = handle.read().strip() or "?"
            if owner_alive(owner) or time.monotonic() > deadline:
                handle.close()
                raise SwarmError(
                    f"The workdir {workdir} is in use by another peer on this machine (pid {owner}). Each peer "
                    "needs its own --workdir, where its identity and checkpoints live: e.g. --workdir "
                    "~/.cache/swarm/gpu1."
                )
            time.sleep(0.2)  # a killed peer's helper processes still hold its lock, and are leaving
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        _workdir_lock = handle
    return workdir


def _try_lock(handle: IO) -> bool:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # EWOULDBLOCK: another process holds it (a filesystem without locks: the same answer)
        return False
    return True


def owner_alive(owner: str) -> bool:
    """Whether the pid written in a workdir's lock file is a running process (unreadable: assume it is). A dead
    one's lock is held by its forked helpers (DHT, averager), leaving within seconds (swarm.hivemind_fixes.orphans)."""
    return not owner.isdecimal() or psutil.pid_exists(int(owner))


@dataclass(frozen=True)
class PeerInputs:
    """What `start` and `join` have checked, for ``client.run.run_peer``."""

    workdir: Path  # writable, and locked by this process
    manifest: RunManifest | None  # the run `start` creates; None for `join`, which reads its run from the swarm
    data: DataSource | None  # `start`: its run's dataset, with this peer's --data-path; None for `join`
    device: DeviceRequest
    network: NetworkConfig  # with the run's keys when it is closed


@dataclass(frozen=True)
class DoctorInputs:
    """What `doctor` has checked, for ``client.doctor.run_checks``."""

    workdir: Path
    device: DeviceRequest
    network: NetworkConfig


def network_config(args: argparse.Namespace, **fields) -> NetworkConfig:
    """The DHT settings on a command line (addresses, port, the secret file's keys), each checked once here, with
    ``fields`` on top (a client-mode observer, the identity file)."""
    _check_initial_peers(args.initial_peers)
    values = dict(initial_peers=list(args.initial_peers), secret=read_secret(getattr(args, "secret_file", None)))
    if hasattr(args, "host_ip"):
        values["host_ip"] = check_ip(args.host_ip, "--host-ip")
    if getattr(args, "announce_ip", None) is not None:
        values["announce_ip"] = check_ip(args.announce_ip, "--announce-ip")
    if hasattr(args, "host_port"):
        values["host_port"] = args.host_port
    return NetworkConfig(**{**values, **fields})


def read_secret(path: Path | None) -> RunSecret | None:
    """A closed run's keys from ``--secret-file`` (None: an open run), or a SwarmError saying what is wrong."""
    return None if path is None else RunSecret.from_file(path)


def check_status_command(args: argparse.Namespace) -> NetworkConfig:
    """Check a `status` command line (its addresses and secret file) before torch and hivemind are imported: the
    settings of the client-mode node that reads the run."""
    return network_config(args, host_ip="0.0.0.0", host_port=0, client_mode=True)


def check_doctor_command(args: argparse.Namespace) -> DoctorInputs:
    """Check a `doctor` command line as `join` would, without locking the workdir (a peer may be using it)."""
    device = parse_device(args.device)
    return DoctorInputs(args.workdir, device, network_config(args, startup_timeout=args.timeout))


def _check_initial_peers(peers: list[str]) -> None:
    multiaddr = light_multiaddr()
    if multiaddr is not None:  # None: this hivemind has no copy of its parser where we look; start_dht checks them
        for peer in peers:
            check_initial_peer(peer, multiaddr)


def check_peer_command(args: argparse.Namespace, creating: bool) -> PeerInputs:
    """Check a `start` (``creating``) or `join` command line, raising the SwarmError the volunteer would
    otherwise see seconds later, and return what it says, parsed. The workdir comes last: it is created and
    locked, the rest only read."""
    device = parse_device(args.device)
    network = network_config(args, client_mode=args.client_mode)
    manifest = build_manifest(args.preset, args.manifest, args.overrides) if creating else None
    if manifest is not None and network.secret is not None:  # a closed run: its id is another run's
        manifest = manifest.model_copy(update=dict(access=network.secret.tag))
    data = data_source(manifest.dataset, args.data_path) if manifest is not None else None
    workdir = prepare_workdir(args.workdir, exclusive=True)
    identity = args.identity or workdir / "identity.key"
    return PeerInputs(workdir, manifest, data, device, network.model_copy(update=dict(identity_path=identity)))
