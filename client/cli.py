"""`swarm-client`: start a run, join one, or watch a demo swarm on this machine.

Every option can also come from a ``SWARM_*`` environment variable (the Docker
image's way in); a flag on the command line wins over the variable.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from client.priority import DEFAULT_NICE, MAX_NICE
from client.signals import STOP
from swarm.errors import LeaveRequested, SwarmError

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
}


def _env(dest: str, default):
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


def _add_initial_peers(p: argparse.ArgumentParser, required: bool) -> None:
    peers = _env("initial_peers", [])
    p.add_argument(
        "--initial-peers",
        nargs="+",
        metavar="MADDR",
        default=peers,
        required=required and not peers,
        help="multiaddrs of peers already in the swarm, ending in /p2p/<id> [SWARM_INITIAL_PEERS]",
    )


def _add_secret_file(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--secret-file",
        type=Path,
        default=_env("secret_file", None),
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


def _add_host_port(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--host-port",
        type=_port,
        default=_env("host_port", None),  # a string default goes through _port, with argparse's error if bad
        help="TCP port to listen on; forward it for others to reach you. Default: 31337, or the next free port "
        "when another peer on this machine has it (one peer per GPU) [SWARM_HOST_PORT]",
    )


def _add_workdir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workdir",
        type=Path,
        default=Path(_env("workdir", str(DEFAULT_WORKDIR))),
        help="checkpoints, identity and caches [SWARM_WORKDIR]",
    )


def _add_peer_options(p: argparse.ArgumentParser, initial_peers_required: bool) -> None:
    _add_initial_peers(p, initial_peers_required)
    _add_secret_file(p)
    p.add_argument("--name", default=_env("name", ""), help="display name shown to others [SWARM_NAME]")
    p.add_argument(
        "--identity",
        type=Path,
        default=_env("identity", None),
        help="key file that keeps this peer's id across restarts (default: WORKDIR/identity.key) [SWARM_IDENTITY]",
    )
    _add_workdir(p)
    p.add_argument("--host-ip", default=_env("host_ip", "0.0.0.0"), help="address to listen on [SWARM_HOST_IP]")
    _add_host_port(p)
    p.add_argument(
        "--announce-ip",
        default=_env("announce_ip", None),
        help="public address to announce when behind NAT [SWARM_ANNOUNCE_IP]",
    )
    p.add_argument("--device", default=_env("device", "auto"), help="auto, cuda, cuda:N, mps or cpu [SWARM_DEVICE]")
    p.add_argument(
        "--micro-batch",
        type=_micro_batch,
        default=_micro_batch(_env("micro_batch", "auto")),
        help="samples per forward pass: auto or N [SWARM_MICRO_BATCH]",
    )
    p.add_argument(
        "--nice",
        type=_nice,
        default=_nice(_env("nice", str(DEFAULT_NICE))),
        help=f"CPU priority of the training, 0 (as started) to {MAX_NICE} (lowest); the averaging beside it keeps "
        f"the priority it started with, so a background average is not kept waiting. Default: {DEFAULT_NICE} "
        "[SWARM_NICE]",
    )
    p.add_argument(
        "--max-epochs",
        type=int,
        default=_env("max_epochs", None),
        help="leave after this many outer rounds [SWARM_MAX_EPOCHS]",
    )
    p.add_argument(
        "--client-mode",
        action="store_true",
        default=_env("client_mode", False),
        help="for peers that cannot accept incoming connections [SWARM_CLIENT_MODE]",
    )
    p.add_argument(
        "--eval-sequences",
        type=_count,
        default=_count(_env("eval_sequences", "0")),
        help="held-out sequences to score at start and end (0: none) [SWARM_EVAL_SEQUENCES]",
    )
    p.add_argument(
        "--eval-every",
        type=_count,
        default=_count(_env("eval_every", "0")),
        metavar="ROUNDS",
        help="also score the held-out sequences after every ROUNDS outer rounds (0: never; "
        f"without --eval-sequences, {EVAL_SEQUENCES_DEFAULT} of them) [SWARM_EVAL_EVERY]",
    )
    p.add_argument(
        "--no-dashboard",
        action="store_true",
        default=_env("no_dashboard", False),
        help="plain log lines even on a terminal [SWARM_NO_DASHBOARD]",
    )
    p.add_argument(
        "--log-json",
        type=Path,
        default=_env("log_json", None),
        metavar="FILE",
        help="append one JSON object per step, round and event to FILE [SWARM_LOG_JSON]",
    )
    p.add_argument("--result-file", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--verbose",
        action="store_true",
        default=_env("verbose", False),
        help="show hivemind's own logs [SWARM_VERBOSE]",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarm-client",
        description="Pool your GPU with other volunteers to train a language model with DiLoCo.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{start,join,status,doctor,demo,export,health}")

    start = sub.add_parser("start", help="create a new run and become its first peer")
    start.add_argument("--preset", default=_env("preset", "tiny"), help="tiny, 150m or 1b [SWARM_PRESET]")
    start.add_argument(
        "--manifest",
        type=Path,
        default=_env("manifest", None),
        help="a TOML or JSON manifest file instead of a preset [SWARM_MANIFEST]",
    )
    start.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a manifest field, e.g. --set inner_steps=100 --set averaging.compression=none",
    )
    _add_peer_options(start, initial_peers_required=False)

    join = sub.add_parser("join", help="join an existing run")
    join.add_argument("--run", default=_env("run", None), help="run id, when the swarm hosts several [SWARM_RUN]")
    _add_peer_options(join, initial_peers_required=True)

    status = sub.add_parser("status", help="watch a run without training: peers, epochs, speed")
    _add_initial_peers(status, required=True)
    _add_secret_file(status)
    status.add_argument("--run", default=_env("run", None), help="run id, when the swarm hosts several [SWARM_RUN]")
    status.add_argument("--json", action="store_true", help="print one JSON snapshot and exit (for scripts)")
    status.add_argument("--verbose", action="store_true", default=_env("verbose", False), help=argparse.SUPPRESS)

    doctor = sub.add_parser("doctor", help="check this machine and the network before joining")
    _add_initial_peers(doctor, required=False)
    _add_secret_file(doctor)
    _add_workdir(doctor)
    doctor.add_argument("--host-ip", default=_env("host_ip", "0.0.0.0"), help="address to listen on [SWARM_HOST_IP]")
    _add_host_port(doctor)
    doctor.add_argument("--announce-ip", default=_env("announce_ip", None), help="public address [SWARM_ANNOUNCE_IP]")
    doctor.add_argument(
        "--device", default=_env("device", "auto"), help="auto, cuda, cuda:N, mps or cpu [SWARM_DEVICE]"
    )
    doctor.add_argument("--timeout", type=float, default=15.0, help="seconds to wait for the initial peers")
    doctor.add_argument("--verbose", action="store_true", default=_env("verbose", False), help=argparse.SUPPRESS)

    demo = sub.add_parser("demo", help="train a tiny model with N local peers (no network needed)")
    demo.add_argument("--peers", type=int, default=2, help="number of peer processes (default 2)")
    demo.add_argument("--epochs", type=int, default=3, help="outer rounds each peer trains (default 3)")
    demo.add_argument("--workdir", type=Path, default=None, help="keep the demo's files here (default: temporary)")
    demo.add_argument(
        "--no-dashboard",
        action="store_true",
        default=_env("no_dashboard", False),
        help="stream the peers' log lines even on a terminal [SWARM_NO_DASHBOARD]",
    )

    export = sub.add_parser("export", help="write the latest checkpoint's model in Hugging Face format")
    export.add_argument("--workdir", type=Path, default=Path(_env("workdir", str(DEFAULT_WORKDIR))))
    export.add_argument("--out", type=Path, required=True, help="directory to write the model to")
    export.add_argument("--run", default=_env("run", None), help="run id, when the workdir holds several")

    health = sub.add_parser("health", help="exit 0 if the peer using WORKDIR is alive and progressing (Docker)")
    _add_workdir(health)
    health.add_argument(
        "--max-age",
        type=float,
        default=float(_env("max_age", 60.0)),
        help="seconds since the status file's last refresh before the peer counts as hung [SWARM_HEALTH_MAX_AGE]",
    )
    return parser


def _status(args: argparse.Namespace) -> int:
    from client.logs import setup_logging
    from client.status import run_status
    from swarm import NetworkConfig

    setup_logging(None, args.verbose)
    network = NetworkConfig(
        initial_peers=args.initial_peers,
        host_ip="0.0.0.0",
        host_port=0,
        client_mode=True,
        secret=_secret(args),
    )
    return run_status(network, args.run, as_json=args.json, live=sys.stdout.isatty())


def _doctor(args: argparse.Namespace) -> int:
    from client.doctor import FAIL, WARN, DoctorOptions, print_check, run_checks
    from client.logs import setup_logging

    setup_logging(None, args.verbose)
    options = DoctorOptions(
        workdir=args.workdir,
        initial_peers=args.initial_peers,
        host_ip=args.host_ip,
        host_port=args.host_port,
        announce_ip=args.announce_ip,
        device=args.device,
        timeout=args.timeout,
        secret=_secret(args),
    )
    checks = run_checks(options, print_check)
    failed = [c for c in checks if c.outcome == FAIL]
    warned = [c for c in checks if c.outcome == WARN]
    print(f"{len(checks) - len(failed) - len(warned)} passed, {len(warned)} warnings, {len(failed)} failed")
    return 1 if failed else 0


def _secret(args: argparse.Namespace):
    from client.run import read_secret

    return read_secret(args.secret_file)


def _health(args: argparse.Namespace) -> int:
    from client.health import check_health

    healthy, reason = check_health(args.workdir, args.max_age)
    print(f"{'healthy' if healthy else 'unhealthy'}: {reason}")
    return 0 if healthy else 1


def _export(args: argparse.Namespace) -> int:
    from client.export import export_model

    out = export_model(args.workdir.expanduser(), args.out, args.run)
    print(f"Model written to {out} (load it with AutoModelForCausalLM.from_pretrained).")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        if args.command in ("start", "join"):
            with STOP.shielded():  # a stop raised inside torch's import once aborted the process (exit -6, CI):
                from client.run import run_peer  # it is raised when the import is done, and we return 0

            return run_peer(args, creating=args.command == "start")
        if args.command == "status":
            return _status(args)
        if args.command == "doctor":
            return _doctor(args)
        if args.command == "health":
            return _health(args)
        if args.command == "demo":
            from client.demo import run_demo
            from client.run import use_dashboard

            return run_demo(args.peers, args.epochs, args.workdir, dashboard=use_dashboard(args))
        return _export(args)
    except SwarmError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except LeaveRequested:
        return 0  # asked to stop (SIGTERM, Ctrl-C) before or while starting: nothing went wrong
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug: the traceback goes to the log file (and the terminal with --verbose)
        logging.getLogger(__name__).error("swarm-client stopped on an unexpected error", exc_info=True)
        print(
            f"error: unexpected {type(e).__name__}: {e}. This is a bug in swarm-client: please report it with the "
            f"traceback from WORKDIR/logs/swarm-client.log (or run again with --verbose).",
            file=sys.stderr,
            flush=True,
        )
        return 1


def entry_point() -> None:
    """Console script: stop signals are handled from here on (before anything heavy is imported), and the
    process exits without interpreter teardown, which hivemind's helper threads can abort."""
    STOP.install()
    try:
        code = main()
    except LeaveRequested:  # asked to stop while the command line was still being read (CI: inside argparse's
        code = 0  # import of shutil, on a loaded machine): nothing had started, nothing went wrong
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except LeaveRequested:  # asked to stop while already leaving: what was left unflushed is lost either way
        pass
    os._exit(code)


if __name__ == "__main__":
    entry_point()
