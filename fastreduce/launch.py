"""Run a function on N local Gloo ranks: the harness behind the tests and ``fastreduce bench``.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` fresh processes, joins them in
one Gloo process group (its store on a loopback port that rank 0 binds), calls
``fn(rank, world_size, *args)`` in each and returns the per-rank results in rank order. A rank that raises fails the whole
call with every failing rank's traceback; a rank that dies without a result (SIGKILL, the
OOM killer, a segfault, ``os._exit``) is named with its exit code ahead of them (its peers'
errors, Gloo's "Connection reset by peer", are only the consequence); a rank that has not
answered within ``timeout`` seconds (a hang in a collective, say) gets every rank killed
and raises :class:`RankTimeout`, so a hang fails a test instead of a CI job. On a failure
or a timeout the ranks still running are stopped at once (SIGTERM, then SIGKILL after
:data:`STOP_AFTER_FAILURE_S`); every process the call started has ended when it returns
or raises.

The processes fork from a server process (multiprocessing's ``forkserver``) that imported
torch and fastreduce once: a 2-rank group starts in about 0.1 s instead of the 3-4 s two
spawned interpreters spend importing them, which is most of a test's cost where a group
runs a few steps. The server has run no torch op and started no thread pool, so forking
it is safe; each rank is still a new process with a new group. A forked child has the
server's environment, from when it started, so the parent's current one is handed over
(cwd and ``sys.path`` travel with multiprocessing's own preparation data).
"""

from __future__ import annotations

import io
import os
import queue as queue_mod
import random
import signal
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from .lifecycle import shutdown

__all__ = ["run_ranks", "rank_context", "RankFailure", "RankTimeout", "free_port"]

PRELOAD = ("torch", "torch.distributed", "fastreduce")
"""Imported once by the fork server, before it forks any rank."""
EXIT_AFTER_RESULT_S = 5.0
"""How long a rank that handed back its result may take to end (its barrier, its group's
and fastreduce's teardown) before it is killed."""
STOP_AFTER_FAILURE_S = 1.0
"""After a failure or a timeout: how long, in all, the ranks get to end after SIGTERM (or,
those that reported, on their own) before SIGKILL."""


class RankFailure(RuntimeError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


class RankTimeout(RuntimeError):
    """Ranks did not finish in time; all of them were killed."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, below the kernel's ephemeral
    range where it can: there no outgoing connection (Gloo's many) takes it before the
    caller binds it; only another explicit bind can."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    rng = random.Random()  # not the global one: tests seed it
    candidates = [rng.randrange(low // 2, low) for _ in range(20)] if low >= 4096 else []
    for port in [*candidates, 0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free TCP port on 127.0.0.1")


_preloads: list[str] = list(PRELOAD)
"""What this process's fork server imports when it starts: :data:`PRELOAD` and every module
a :func:`rank_context` call named before then."""


def rank_context(*preload: str) -> Any:
    """The multiprocessing context that rank processes start from: a fork server that
    imported :data:`PRELOAD` and ``preload``. The server is one per process, started at its
    first fork and kept: the modules named by every call until then are imported there (a
    module it lacks, the child imports itself), so a harness that names at once what all its
    launches import (tests/conftest.py) pays for each import once."""
    ctx = mp.get_context("forkserver")
    _preloads.extend(name for name in preload if name not in _preloads)
    ctx.set_forkserver_preload(list(_preloads))
    return ctx


def _store(rank: int, world_size: int, ports: Any, timeout: float) -> Any:
    """The group's TCPStore. Rank 0 binds port 0 (the kernel picks a free one, with no
    window for another process to take it, as a port found free and bound later has) and
    hands the port to the other ranks through ``ports``."""
    import torch.distributed as dist

    wait = timedelta(seconds=timeout)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=wait, wait_for_workers=False)
        for _ in range(world_size - 1):
            ports.put(store.port)
    else:
        store = dist.TCPStore("127.0.0.1", ports.get(timeout=timeout), world_size, False, timeout=wait)
    os.environ["MASTER_PORT"] = str(store.port)
    return store


def _worker(fn: Callable[..., Any], rank: int, world_size: int, ports: Any, args: tuple,
            threads: int, timeout: float, env: dict[str, str], results: Any) -> None:
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(env)  # the parent's, as it is now (the fork server's is from its start)
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", store=_store(rank, world_size, ports, timeout), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        out = io.BytesIO()
        # One byte string per result: a Queue would pass each tensor through its own
        # shared-memory file descriptor, and results with many tensors run out of them.
        torch.save(fn(rank, world_size, *args), out)
        results.put((rank, True, out.getvalue()))
        dist.barrier()
        shutdown()  # fastreduce's threads stopped and Gloo's let go of their works: then the destroy
        dist.destroy_process_group()  # cannot wait, GIL held, on a thread that needs it (torch 2.6)
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()  # then the process ends as any does (fastreduce.shutdown() at exit)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
              threads: int | None = None) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned Gloo ranks.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function). Returns the
    ranks' return values in rank order.

    Example::

        >>> def worker(rank, world_size):
        ...     t = torch.tensor([float(rank)])
        ...     dist.all_reduce(t)
        ...     return t.item()
        >>> run_ranks(worker, 2)
        [1.0, 1.0]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    ctx = rank_context()
    results, ports = ctx.Queue(), ctx.Queue()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(fn, r, world_size, ports, args, threads, timeout, env, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    finished = False
    try:
        while len(outcome) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(outcome))
                raise RankTimeout(f"ranks {missing} did not finish within {timeout:.0f}s "
                                  f"(a hang in a collective?); all ranks were killed"
                                  + _died(procs, outcome, "\n") + _failures(outcome))
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outcome and p.exitcode is not None]
                if dead:
                    time.sleep(0.5)  # a result may still be in flight
                    while not results.empty():
                        rank, ok, value = results.get()
                        outcome[rank] = (ok, value)
                    dead = [r for r in dead if r not in outcome]
                    if dead:
                        raise RankFailure((_died(procs, outcome, "") + _failures(outcome)).rstrip("\n"))
                continue
            outcome[rank] = (ok, value)
            if not ok:
                # Give the other ranks a moment to report their own errors (or to be seen
                # dead: one that died without a result often caused this one's error), then stop.
                end = time.monotonic() + 5.0
                while len(outcome) < world_size and time.monotonic() < end:
                    try:
                        r2, ok2, v2 = results.get(timeout=0.2)
                        outcome[r2] = (ok2, v2)
                    except queue_mod.Empty:
                        if all(p.exitcode is not None for r, p in enumerate(procs) if r not in outcome):
                            break  # every rank left has ended: a result of theirs would be here by now
                raise RankFailure((_died(procs, outcome, "") + _failures(outcome)).lstrip("\n"))
        finished = True
    finally:
        _stop(procs, outcome, finished)
    return [torch.load(io.BytesIO(outcome[r][1]), weights_only=False) for r in range(world_size)]


def _stop(procs: list[Any], outcome: dict[int, tuple[bool, Any]], finished: bool) -> None:
    """End every rank process (the call that started them owns their stop). After a full
    set of results, each gets :data:`EXIT_AFTER_RESULT_S` to end as it does; after a failure
    or a timeout, those that never answered are sent SIGTERM at once, and all of them get
    :data:`STOP_AFTER_FAILURE_S` in all; then SIGKILL to whatever still runs."""
    if finished:
        for p in procs:
            p.join(timeout=EXIT_AFTER_RESULT_S)
    else:
        for r, p in enumerate(procs):
            if r not in outcome and p.exitcode is None:
                p.terminate()
        end = time.monotonic() + STOP_AFTER_FAILURE_S
        for p in procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            p.kill()
    for p in procs:
        p.join()


def _died(procs: list[Any], outcome: dict[int, tuple[bool, Any]], lead: str) -> str:
    """The ranks whose process ended without a result, with their exit codes (``""``: none)."""
    dead = [r for r, p in enumerate(procs) if r not in outcome and p.exitcode is not None]
    if not dead:
        return ""
    codes = [_exit_code(procs[r].exitcode) for r in dead]
    then = ("; the other ranks' errors below may only be its consequence"
            if any(not ok for ok, _ in outcome.values()) else "")
    return f"{lead}rank(s) {dead} died without a result (exit code(s) [{', '.join(codes)}]){then}\n"


def _exit_code(code: int) -> str:
    """``3``, or ``-9 (SIGKILL)`` for a process a signal ended."""
    if code >= 0:
        return str(code)
    try:
        return f"{code} ({signal.Signals(-code).name})"
    except ValueError:
        return str(code)


def _failures(outcome: dict[int, tuple[bool, Any]]) -> str:
    return "".join(f"\n--- rank {r} failed ---\n{v}" for r, (ok, v) in sorted(outcome.items()) if not ok)
