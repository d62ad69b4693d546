"""`swarm-client`: the volunteer's command line (filled in by the client issue)."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarm-client",
        description="Pool your GPU with other volunteers to train a language model with DiLoCo.",
    )
    parser.add_subparsers(dest="command", metavar="{start,join,demo}")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
