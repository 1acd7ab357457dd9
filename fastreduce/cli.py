"""The ``fastreduce`` command: a dispatcher over subcommands (``fastreduce bench``, ``fastreduce info``).

Each subcommand's module is imported only when that subcommand is parsed (or its help
shown): ``fastreduce info`` need not import the bench suites (``torch.distributed.optim``
alone takes a second).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from typing import IO, Any, Callable, Iterator

from . import __version__

__all__ = ["main"]


DESCRIPTIONS = {
    "bench": "Time gradient reduction, alone and inside whole training steps, against the bare "
             "collective, per-parameter loops and DDP, on Gloo ranks this command starts. Without a "
             "suite it runs 'reduce' and 'step'; 'fastreduce bench SUITE --help' shows a suite's options.",
    "info": "Say what fastreduce would do on this machine, without starting a process group: torch, "
            "the device and process-group backend, graph capture, the transport, each mode's "
            "defaults and which optional integrations import.",
    "coordinator": "Serve the coordinator of a fault-tolerant job (fastreduce.Membership) until "
                   "stopped with Ctrl-C. Start one per job, then give every member "
                   "FASTREDUCE_COORDINATOR=HOST:PORT.",
    "status": "Show a fault-tolerant job (fastreduce.Membership) as its coordinator sees it: the epoch, "
              "its members in rank order, each one's committed step, seconds per step, seconds of it "
              "waiting for the others and working (busy), and the slowest member named (a straggler where "
              "it works 1.25x the median or more).",
}
"""Each subcommand's description in its ``--help``: plain text, as a terminal shows it."""

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


def _module(name: str) -> Callable[[argparse.ArgumentParser], None]:
    """The set-up of the subcommand that module ``name`` (imported on first use) serves: its
    arguments and its ``run``."""
    def setup(parser: argparse.ArgumentParser) -> None:
        module = importlib.import_module(f".{name}", __package__)
        parser.description = DESCRIPTIONS.get(name)  # (plan_cli writes its own)
        module.add_arguments(parser)
        parser.set_defaults(handler=module.run)
    return setup


def _coordinator(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTIONS["coordinator"]
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: every interface)")
    parser.add_argument("--port", type=_port, default=29400, help="port (default 29400; 0: any free one)")
    parser.set_defaults(handler=_serve)


def _port(text: str) -> int:
    """``--port``: 0 to 65535 (argparse's one-line error otherwise)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535 (0: any free one), got {text!r}")
    return port


def _quiet_cpp_logs() -> None:
    """This command's own process: its errors are its one line, not c10d's C++ logs
    (``TORCH_CPP_LOG_LEVEL`` is read once, as torch loads; one set by the user is kept)."""
    if "torch" not in sys.modules:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")


def _serve(args: argparse.Namespace) -> int:
    import signal
    import threading

    _quiet_cpp_logs()
    from .membership import serve

    try:
        store = serve(args.port, args.host)
    except (RuntimeError, OSError) as err:  # the port taken (EADDRINUSE), not ours (EACCES), a bad host
        # (c10d's DistNetworkError; torch 2.6's a RuntimeError)
        why = (str(err).strip().splitlines() or [""])[0][:300]
        print(f"fastreduce coordinator: cannot listen on {args.host}:{args.port} ({type(err).__name__}: {why})",
              file=sys.stderr)
        return 1
    print(f"fastreduce coordinator: serving on {args.host}:{store.port}; give the members "
          f"FASTREDUCE_COORDINATOR=<this host>:{store.port}; Ctrl-C stops it", file=args.stdout, flush=True)
    stop = threading.Event()  # Ctrl-C, or SIGTERM (how Kubernetes, Slurm and kill stop it): exit 0
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(3600):
            pass
    except KeyboardInterrupt:
        pass
    return 0


def _status(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTIONS["status"]
    parser.add_argument("coordinator", nargs="?", default=os.environ.get("FASTREDUCE_COORDINATOR"),
                        help="the coordinator's HOST:PORT, or etcd://HOST:PORT[,HOST:PORT...][/JOB] "
                             "(default: $FASTREDUCE_COORDINATOR)")
    parser.add_argument("--watch", type=float, default=0.0, metavar="S",
                        help="show it again every S seconds until Ctrl-C (default: once)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (per look) and nothing else")
    parser.set_defaults(handler=_show_status)


_LOOK_S = 30.0
"""``fastreduce status``: how long one look at the coordinator may take before it is called gone."""


def _show_status(args: argparse.Namespace) -> int:
    import json
    import time

    _quiet_cpp_logs()
    import torch.distributed as dist

    from .coordinator import MembershipError, connect
    from .faults import StoreCaller, TransportError
    from .faults_errors import StoreUnreachable
    from .status import STRAGGLER_RATIO, format_status, read_status

    if not args.coordinator:
        raise ValueError("no coordinator: give HOST:PORT or set $FASTREDUCE_COORDINATOR")
    try:
        store = connect(args.coordinator, timeout_s=10.0)
    except MembershipError as err:
        print(f"fastreduce status: {err}", file=sys.stderr)
        return 1
    caller = StoreCaller("fastreduce-status")  # each look bounded: a silent link blocks a TCPStore's read for minutes
    try:
        since = 0
        while True:
            try:
                status = caller.call(read_status, store, STRAGGLER_RATIO, since, seconds=_LOOK_S)
            except (dist.DistError, StoreUnreachable, TransportError) as err:  # (the coordinator gone mid-watch)
                why = (str(err).strip().splitlines() or [""])[0][:300]
                print(f"fastreduce status: the coordinator at {args.coordinator} stopped answering "
                      f"({type(err).__name__}: {why})", file=sys.stderr)
                return 1
            since = status["epoch"]["number"] if status["epoch"] is not None else 0
            print(json.dumps(status) if args.json else format_status(status), file=args.stdout, flush=True)
            if args.watch <= 0:
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
    finally:
        caller.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastreduce", description="Tools for fastreduce, data-parallel gradient reduction for PyTorch.",
        epilog="'fastreduce COMMAND --help' shows a command's options.")
    parser.add_argument("--version", action="version", version=f"fastreduce {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Subcommand)
    sub.add_parser("bench", setup=_module("bench"), help="time gradient reduction, alone and in whole training steps, "
                                               "against its baselines and DDP")
    sub.add_parser("info", setup=_module("info"), help="what fastreduce would do on this machine: device, process-group "
                                             "backend, graph capture, transport, each mode's defaults, "
                                             "optional integrations")
    sub.add_parser("plan", setup=_module("plan_cli"), help="what each data-parallel mode will cost on a cluster (bytes, time on "
                                             "the wire and exposed, memory) and which to use")
    sub.add_parser("coordinator", setup=_coordinator, help="serve the coordinator of a fault-tolerant job "
                                                           "(fastreduce.Membership)")
    sub.add_parser("status", setup=_status, help="a fault-tolerant job's members, step rate, each one's step, "
                                                 "wait and work, the slowest named")
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
