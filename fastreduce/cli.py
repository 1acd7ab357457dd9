"""The ``fastreduce`` command: a dispatcher over subcommands (``fastreduce bench``, ``fastreduce info``).

Each subcommand's module is imported only when that subcommand is parsed (or its help
shown): ``fastreduce info`` need not import the bench suites (``torch.distributed.optim``
alone takes a second).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import IO, Any, Callable, Iterator

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


def _plan(parser: argparse.ArgumentParser) -> None:
    from . import plan_cli

    parser.description = plan_cli.__doc__.split("\n", 1)[0] if plan_cli.__doc__ else None
    plan_cli.add_arguments(parser)
    parser.set_defaults(handler=plan_cli.run)


def _coordinator(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Serve the coordinator of a fault-tolerant job (fastreduce.Membership): a c10d "
                          "TCPStore that no member hosts, until interrupted")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: every interface)")
    parser.add_argument("--port", type=int, default=29400, help="port (default 29400; 0: any free one)")
    parser.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    import time

    from .membership import serve

    store = serve(args.port, args.host)
    print(f"fastreduce coordinator: serving on {args.host}:{store.port}; give the members "
          f"FASTREDUCE_COORDINATOR=<this host>:{store.port}; Ctrl-C stops it", file=args.stdout, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastreduce", description="fastreduce tools")
    parser.add_argument("--version", action="version", version=f"fastreduce {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Subcommand)
    sub.add_parser("bench", setup=_bench, help="time gradient reduction, alone and in whole training steps, "
                                               "against its baselines and DDP")
    sub.add_parser("info", setup=_info, help="what fastreduce would do on this machine: device, process-group "
                                             "backend, graph capture, transport, each mode's defaults, "
                                             "optional integrations")
    sub.add_parser("plan", setup=_plan, help="what each data-parallel mode will cost on a cluster (bytes, time on "
                                             "the wire and exposed, memory) and which to use")
    sub.add_parser("coordinator", setup=_coordinator, help="serve the coordinator of a fault-tolerant job "
                                                           "(fastreduce.Membership)")
    return parser


@contextlib.contextmanager
def json_stdout() -> Iterator[IO[str]]:
    """For ``--json``: yields the real stdout, for the JSON alone, and points everything else at stderr.

    While the command runs, file descriptor 1 (what C++ libraries write to, e.g. torch 2.9's
    Gloo printing ``[Gloo] Rank 1 is connected to 1 peer ranks``, and what spawned ranks
    inherit) and ``sys.stdout`` are stderr; the JSON goes to a duplicate of the original
    descriptor. Both are restored on exit.
    """
    sys.stdout.flush()
    real = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    saved, sys.stdout = sys.stdout, sys.stderr
    try:
        yield real
    finally:
        sys.stdout = saved
        real.flush()
        os.dup2(real.fileno(), 1)
        real.close()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    with json_stdout() if getattr(args, "json", False) else contextlib.nullcontext(sys.stdout) as out:
        args.stdout = out  # where the report goes: the JSON's own stream under --json
        try:
            return args.handler(args)
        except ValueError as e:
            print(f"fastreduce {args.command}: error: {e}", file=sys.stderr)
            return 2
