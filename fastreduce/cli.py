"""The ``fastreduce`` command: a dispatcher over subcommands (``fastreduce bench``)."""

from __future__ import annotations

import argparse
import sys

from . import __version__, bench

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastreduce", description="fastreduce tools")
    parser.add_argument("--version", action="version", version=f"fastreduce {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    p = sub.add_parser("bench", help="time gradient reduction, alone and in whole training steps, "
                                     "against its baselines and DDP",
                       description=bench.__doc__.split("\n", 1)[0] if bench.__doc__ else None)
    bench.add_arguments(p)
    p.set_defaults(handler=bench.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except ValueError as e:
        print(f"fastreduce {args.command}: error: {e}", file=sys.stderr)
        return 2
