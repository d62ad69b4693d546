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

from client.options import (
    add_device,
    add_initial_peers,
    add_network,
    add_peer_options,
    add_run,
    add_secret_file,
    add_verbose,
    add_workdir,
    env_default,
)
from client.signals import STOP
from swarm.errors import LeaveRequested, SwarmError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarm-client",
        description="Pool your GPU with other volunteers to train a language model with DiLoCo.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{start,join,status,doctor,demo,export,health}")

    start = sub.add_parser("start", help="create a new run and become its first peer")
    start.add_argument("--preset", default=env_default("preset", "tiny"), help="tiny, 150m or 1b [SWARM_PRESET]")
    start.add_argument(
        "--manifest",
        type=Path,
        default=env_default("manifest", None),
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
    add_peer_options(start, initial_peers_required=False)

    join = sub.add_parser("join", help="join an existing run")
    add_run(join)
    add_peer_options(join, initial_peers_required=True)

    status = sub.add_parser("status", help="watch a run without training: peers, epochs, speed")
    add_initial_peers(status, required=True)
    add_secret_file(status)
    add_run(status)
    status.add_argument("--json", action="store_true", help="print one JSON snapshot and exit (for scripts)")
    add_verbose(status)

    doctor = sub.add_parser("doctor", help="check this machine and the network before joining")
    add_initial_peers(doctor, required=False)
    add_secret_file(doctor)
    add_workdir(doctor)
    add_network(doctor)
    add_device(doctor)
    doctor.add_argument("--timeout", type=float, default=15.0, help="seconds to wait for the initial peers")
    add_verbose(doctor)

    demo = sub.add_parser("demo", help="train a tiny model with N local peers (no network needed)")
    demo.add_argument("--peers", type=int, default=2, help="number of peer processes (default 2)")
    demo.add_argument("--epochs", type=int, default=3, help="outer rounds each peer trains (default 3)")
    demo.add_argument("--workdir", type=Path, default=None, help="keep the demo's files here (default: temporary)")
    demo.add_argument(
        "--no-dashboard",
        action="store_true",
        default=env_default("no_dashboard", False),
        help="stream the peers' log lines even on a terminal [SWARM_NO_DASHBOARD]",
    )

    export = sub.add_parser("export", help="write the latest checkpoint's model in Hugging Face format")
    add_workdir(export)
    export.add_argument("--out", type=Path, required=True, help="directory to write the model to")
    add_run(export)

    health = sub.add_parser("health", help="exit 0 if the peer using WORKDIR is alive and progressing (Docker)")
    add_workdir(health)
    health.add_argument(
        "--max-age",
        type=float,
        default=float(env_default("max_age", 60.0)),
        help="seconds since the status file's last refresh before the peer counts as hung [SWARM_HEALTH_MAX_AGE]",
    )
    return parser


def _status(args: argparse.Namespace) -> int:
    from client.logs import setup_logging
    from client.preflight import check_status_command

    network = check_status_command(args)  # a mistyped address is reported before the imports, not 6-25 s later
    from client.status import run_status

    setup_logging(None, args.verbose)
    return run_status(network, args.run, as_json=args.json, live=sys.stdout.isatty())


def _doctor(args: argparse.Namespace) -> int:
    from client.preflight import check_doctor_command

    inputs = check_doctor_command(args)
    from client.doctor import FAIL, WARN, print_check, run_checks
    from client.logs import setup_logging

    setup_logging(None, args.verbose)
    checks = run_checks(inputs, print_check)
    failed = [c for c in checks if c.outcome == FAIL]
    warned = [c for c in checks if c.outcome == WARN]
    print(f"{len(checks) - len(failed) - len(warned)} passed, {len(warned)} warnings, {len(failed)} failed")
    return 1 if failed else 0


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
            from client.preflight import check_peer_command

            inputs = check_peer_command(args, creating=args.command == "start")  # before torch and hivemind
            # a stop raised inside an import once aborted the process (torch's: exit -6, CI) and once left numpy
            # half-imported (a RecursionError, exit 1, a suite run); so every heavy module a peer uses is imported
            # here, the stop raised when they are done, and we return 0
            with STOP.shielded():
                import client.hardware  # noqa: F401
                import client.trainer  # noqa: F401
                import swarm.dht.network  # noqa: F401
                from client.run import run_peer

            return run_peer(args, inputs)
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
