"""The flags `swarm-client` shares between its commands, each with its ``SWARM_*`` environment variable.

A flag on the command line wins over its variable; an empty variable counts as unset.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from client.priority import DEFAULT_NICE, MAX_NICE

DEFAULT_WORKDIR = Path("~/.cache/swarm").expanduser()

# option dest -> environment variable; tests check that each is honoured
EVAL_SEQUENCES_DEFAULT = 64  # held-out sequences scored when --eval-every is given alone

ENV_VARS = {
    "initial_peers": "SWARM_INITIAL_PEERS",
    "run": "SWARM_RUN",
    "name": "SWARM_NAME",
    "identity": "SWARM_IDENTITY",
    "workdir": "SWARM_WORKDIR",
    "host_ip": "SWARM_HOST_IP",
    "host_port": "SWARM_HOST_PORT",
    "announce_ip": "SWARM_ANNOUNCE_IP",
    "device": "SWARM_DEVICE",
    "micro_batch": "SWARM_MICRO_BATCH",
    "max_epochs": "SWARM_MAX_EPOCHS",
    "client_mode": "SWARM_CLIENT_MODE",
    "preset": "SWARM_PRESET",
    "manifest": "SWARM_MANIFEST",
    "eval_sequences": "SWARM_EVAL_SEQUENCES",
    "eval_every": "SWARM_EVAL_EVERY",
    "verbose": "SWARM_VERBOSE",
    "no_dashboard": "SWARM_NO_DASHBOARD",
    "log_json": "SWARM_LOG_JSON",
    "max_age": "SWARM_HEALTH_MAX_AGE",
    "secret_file": "SWARM_SECRET_FILE",
    "nice": "SWARM_NICE",
    "data_path": "SWARM_DATA_PATH",
}


def env_default(dest: str, default):
    """The default of the option ``dest``: its environment variable if set, else ``default``."""
    value = os.environ.get(ENV_VARS[dest])
    if value is None or value == "":
        return default
    if isinstance(default, bool):
        return value.strip().lower() in ("1", "true", "yes", "on")
    if dest == "initial_peers":
        return value.replace(",", " ").split()
    return value


def _whole(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be {what}")
    return value


def _nice(text: str) -> int:
    value = _whole(text, 0, f"a whole number from 0 to {MAX_NICE}")
    if value > MAX_NICE:
        raise argparse.ArgumentTypeError(f"must be a whole number from 0 to {MAX_NICE}")
    return value


def _micro_batch(text: str) -> int | None:
    return None if str(text) == "auto" else _whole(text, 1, "'auto' or a positive integer")


def _count(text: str) -> int:
    return _whole(text, 0, "a whole number, 0 or more")


def held_out_sequences(args: argparse.Namespace) -> int:
    """Held-out sequences a peer scores: --eval-sequences, or EVAL_SEQUENCES_DEFAULT when only --eval-every is
    given (asking for a score every few rounds and getting none would be a surprise), or none."""
    if args.eval_sequences:
        return args.eval_sequences
    return EVAL_SEQUENCES_DEFAULT if args.eval_every else 0


def add_initial_peers(p: argparse.ArgumentParser, required: bool) -> None:
    peers = env_default("initial_peers", [])
    p.add_argument(
        "--initial-peers",
        nargs="+",
        metavar="MADDR",
        default=peers,
        required=required and not peers,
        help="multiaddrs of peers already in the swarm, ending in /p2p/<id> [SWARM_INITIAL_PEERS]",
    )


def add_secret_file(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--secret-file",
        type=Path,
        default=env_default("secret_file", None),
        metavar="FILE",
        help="a closed run's secret (at least 16 bytes; never sent, logged or published): only peers holding "
        "the same one take part. Without it the run is open [SWARM_SECRET_FILE]",
    )


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a port number from 0 to 65535") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError("must be a port number from 0 to 65535")
    return value


def add_host_port(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--host-port",
        type=_port,
        default=env_default("host_port", None),  # a string default goes through _port, with argparse's error if bad
        help="TCP port to listen on; forward it for others to reach you. Default: 31337, or the next free port "
        "when another peer on this machine has it (one peer per GPU) [SWARM_HOST_PORT]",
    )


def add_workdir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workdir",
        type=Path,
        default=Path(env_default("workdir", str(DEFAULT_WORKDIR))),
        help="checkpoints, identity and caches [SWARM_WORKDIR]",
    )


def add_host_ip(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host-ip", default=env_default("host_ip", "0.0.0.0"), help="address to listen on [SWARM_HOST_IP]")


def add_announce_ip(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--announce-ip",
        default=env_default("announce_ip", None),
        help="public address to announce when behind NAT [SWARM_ANNOUNCE_IP]",
    )


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device", default=env_default("device", "auto"), help="auto, cuda, cuda:N, mps or cpu [SWARM_DEVICE]"
    )


def add_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", default=env_default("run", None), help="run id, when there are several [SWARM_RUN]")


def add_verbose(p: argparse.ArgumentParser, shown: bool = False) -> None:
    p.add_argument(
        "--verbose",
        action="store_true",
        default=env_default("verbose", False),
        help="show hivemind's own logs [SWARM_VERBOSE]" if shown else argparse.SUPPRESS,
    )


def add_network(p: argparse.ArgumentParser) -> None:
    """Where this machine listens and what it announces."""
    add_host_ip(p)
    add_host_port(p)
    add_announce_ip(p)


def add_peer_options(p: argparse.ArgumentParser, initial_peers_required: bool) -> None:
    add_initial_peers(p, initial_peers_required)
    add_secret_file(p)
    p.add_argument("--name", default=env_default("name", ""), help="display name shown to others [SWARM_NAME]")
    p.add_argument(
        "--identity",
        type=Path,
        default=env_default("identity", None),
        help="key file that keeps this peer's id across restarts (default: WORKDIR/identity.key) [SWARM_IDENTITY]",
    )
    add_workdir(p)
    add_network(p)
    add_device(p)
    p.add_argument(
        "--micro-batch",
        type=_micro_batch,
        default=_micro_batch(env_default("micro_batch", "auto")),
        help="samples per forward pass: auto or N [SWARM_MICRO_BATCH]",
    )
    p.add_argument(
        "--nice",
        type=_nice,
        default=_nice(env_default("nice", str(DEFAULT_NICE))),
        help=f"CPU priority of the training, 0 (as started) to {MAX_NICE} (lowest); the averaging beside it keeps "
        f"the priority it started with, so a background average is not kept waiting. Default: {DEFAULT_NICE} "
        "[SWARM_NICE]",
    )
    p.add_argument(
        "--data-path",
        default=env_default("data_path", None),
        metavar="PATH",
        help="this peer's own training text, for a run whose dataset is local (the manifest never names a path on "
        "your machine): a file, a directory or a glob of .txt or .jsonl files [SWARM_DATA_PATH]",
    )
    p.add_argument(
        "--max-epochs",
        type=int,
        default=env_default("max_epochs", None),
        help="leave after this many outer rounds [SWARM_MAX_EPOCHS]",
    )
    p.add_argument(
        "--client-mode",
        action="store_true",
        default=env_default("client_mode", False),
        help="for peers that cannot accept incoming connections [SWARM_CLIENT_MODE]",
    )
    p.add_argument(
        "--eval-sequences",
        type=_count,
        default=_count(env_default("eval_sequences", "0")),
        help="held-out sequences to score at start and end (0: none) [SWARM_EVAL_SEQUENCES]",
    )
    p.add_argument(
        "--eval-every",
        type=_count,
        default=_count(env_default("eval_every", "0")),
        metavar="ROUNDS",
        help="also score the held-out sequences after every ROUNDS outer rounds (0: never; "
        f"without --eval-sequences, {EVAL_SEQUENCES_DEFAULT} of them) [SWARM_EVAL_EVERY]",
    )
    p.add_argument(
        "--no-dashboard",
        action="store_true",
        default=env_default("no_dashboard", False),
        help="plain log lines even on a terminal [SWARM_NO_DASHBOARD]",
    )
    p.add_argument(
        "--log-json",
        type=Path,
        default=env_default("log_json", None),
        metavar="FILE",
        help="append one JSON object per step, round and event to FILE [SWARM_LOG_JSON]",
    )
    p.add_argument("--result-file", type=Path, default=None, help=argparse.SUPPRESS)
    add_verbose(p, shown=True)
