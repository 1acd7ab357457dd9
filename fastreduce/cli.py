"""The ``fastreduce`` command: a dispatcher over subcommands (``fastreduce bench``, ``fastreduce info``).

Each subcommand's module is imported only when that subcommand is parsed (or its help
shown): ``fastreduce info`` need not import the bench suites (``torch.distributed.optim``
alone takes a second).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from . import __version__

__all__ = ["main"]


class _Subcommand(argparse.ArgumentParser):
    """A subcommand's parser whose arguments ``setup(parser)`` adds on first use."""

    def __init__(self, *args: Any, setup: Callable[[argparse.ArgumentParser], None] | None = None,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._setup = setup

    def _ready(self) -> None:
        setup, self._setup = self._setup, None
        if setup is not None:
            setup(self)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        self._ready()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self._ready()
        return super().format_usage()

    def format_help(self) -> str:
        self._ready()
        return super().format_help()


def _bench(parser: argparse.ArgumentParser) -> None:
    from . import bench

    parser.description = bench.__doc__.split("\n", 1)[0] if bench.__doc__ else None
    bench.add_arguments(parser)
    parser.set_defaults(handler=bench.run)


def _info(parser: argparse.ArgumentParser) -> None:
    from . import info

    parser.description = info.__doc__.split("\n", 1)[0] if info.__doc__ else None
    info.add_arguments(parser)
    parser.set_defaults(handler=info.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastreduce", description="fastreduce tools")
    parser.add_argument("--version", action="version", version=f"fastreduce {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Subcommand)
    sub.add_parser("bench", setup=_bench, help="time gradient reduction, alone and in whole training steps, "
                                               "against its baselines and DDP")
    sub.add_parser("info", setup=_info, help="what fastreduce would do on this machine: device, process-group "
                                             "backend, graph capture, transport, each mode's defaults, "
                                             "optional integrations")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except ValueError as e:
        print(f"fastreduce {args.command}: error: {e}", file=sys.stderr)
        return 2
