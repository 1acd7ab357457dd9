"""What fastreduce runs in the background, and the one place that stops it.

fastreduce starts a few daemon threads: the heartbeat (:mod:`.faults`), the threads that
make store requests with a deadline (``fastreduce-store``, ``-waiter``, ``-coordinator``,
``-connect``, ``fastreduce status``'s ``-status``), the shared-memory transport's worker per
process group (``fastreduce-shm``) and the point-to-point ring's (``fastreduce-ring``). Each
is a :class:`Worker` (or, the heartbeat, owns one) and is listed here while it runs.
:func:`shutdown` stops them all, the last started first, each after the work queued on it is
done and within a bound; the next use of any of them starts it again. (A worker of one
process group's also ends once that group is gone: :meth:`Worker.let_go`, from a
finalizer.) :func:`shutdown` runs:

* at the interpreter's exit (``atexit``), before Python finalizes: there a daemon thread
  still inside a torch call is ended abruptly when it takes the GIL back, through C++
  frames that may not be unwound, and the C++ runtime aborts the process ("terminate
  called without an active exception", SIGABRT): a finished job would exit with -6, and
  torchrun, Slurm or Kubernetes would call it failed;
* at the end of the trainers' ``train()`` / ``fit()`` (:mod:`.integrations`), at a
  :class:`~fastreduce.Membership`'s ``close()`` and ``leave()``;
* wherever a user calls ``fastreduce.shutdown()``, e.g. before ``dist.destroy_process_group()``.

At the interpreter's exit, after :func:`shutdown`, :func:`.exit_quiet.quiet_backends` waits
until no thread of a process group's backend runs (:mod:`.exit_quiet` says why).

[Note: a stopped heartbeat is not a lost rank] A rank that stops its heartbeat mid-run
(``shutdown()`` at the end of a trainer's ``train()``, or a user's) adds :data:`RESTING` to
its counter first; a watcher reading a counter at or above it treats that rank as at rest,
never as lost (:mod:`.faults`), so one rank's end of ``train()`` cannot be read as its death
by a rank already in the next collective (an ``evaluate()``) while this one still saves. A
restarted heartbeat takes :data:`RESTING` off again. At the interpreter's exit and at
``Membership.close()`` the heartbeat stops without it (``rest=False``): the process is
leaving, and a peer that still counts on it must see it go.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
from typing import Any, Callable, Protocol

__all__ = ["RESTING", "Stoppable", "Worker", "own", "disown", "running", "shutdown"]

log = logging.getLogger(__name__)

RESTING = 1 << 40
"""Added to a heartbeat counter by a rank that stops its heartbeat on purpose."""

JOIN_S = 10.0
"""How long :func:`shutdown` waits for each worker to finish its queued work and end
(work that waits on a peer that never comes, e.g. a collective abandoned after a lost
rank, is given up on after this; a job that finished never needs it)."""


class Stoppable(Protocol):
    name: str

    def stop(self, timeout: float | None = None) -> bool:
        """End, after the work queued before; ``False`` where it did not end within ``timeout``.
        (A heartbeat, which has ``rests = True``, is called with ``rest=`` too: see the module's note.)"""


_lock = threading.Lock()
_running: dict[int, Stoppable] = {}  # by id, in start order (dicts keep insertion order)


def own(thing: Stoppable) -> None:
    """List ``thing`` as running: :func:`shutdown` stops it."""
    with _lock:
        _running.pop(id(thing), None)
        _running[id(thing)] = thing


def disown(thing: Stoppable) -> None:
    """``thing`` has stopped (or stops itself): no longer listed."""
    with _lock:
        if _running.get(id(thing)) is thing:
            del _running[id(thing)]


def running() -> list[str]:
    """The names of what runs now, in start order (``[]`` after :func:`shutdown`)."""
    with _lock:
        return [t.name for t in _running.values()]


def shutdown(timeout: float = JOIN_S, *, rest: bool = True) -> list[str]:
    """Stop every thread fastreduce runs in this process, the last started first, each
    after the work queued on it (a collective in flight is finished, not cut); returns the
    names of those that did not end within ``timeout`` seconds each (``[]``: all ended).
    Idempotent; whatever is used afterwards starts again. ``rest=False``: this process is
    leaving (its heartbeat's silence then reads as a loss to the others; see the module's note).
    Then the backends' threads are let finish what they hold (:func:`.exit_quiet.quiet_backends`,
    the GIL released, milliseconds): a group destroyed next, or let go of with the last
    reference to it (a DDP's), joins its threads with the GIL held, and a Gloo thread still
    to let go of a work (which takes the GIL) would wait on it forever.

    Example::

        trainer.train()
        fastreduce.shutdown()            # the trainers and Membership.close() call it too
        dist.destroy_process_group()
    """
    from .exit_quiet import quiet_backends  # imported only now (nothing of it imports lifecycle)

    stuck = []
    while True:
        with _lock:
            if not _running:
                quiet_backends()
                return stuck
            _, thing = _running.popitem()  # the last started
        ended = thing.stop(timeout, rest=rest) if getattr(thing, "rests", False) else thing.stop(timeout)
        if not ended:
            stuck.append(thing.name)


def _at_exit() -> None:
    from .exit_quiet import EXIT_CALM_S, quiet_backends

    shutdown(rest=False)
    quiet_backends(calm_s=EXIT_CALM_S)  # longer than inside a run: nothing waits on this exit but the exit


atexit.register(_at_exit)


_LET_GO = object()  # Worker.let_go()'s end mark


class Worker:
    """A daemon thread that runs the callables handed to it (:meth:`put`), one at a time, in
    order. Started by the first :meth:`put`, listed (:func:`own`) while it runs; :meth:`stop`
    ends it once the callables queued before are done, and the next :meth:`put` starts a
    new one. A callable handles its own errors (one that raises ends nothing: it is logged
    and the next one runs)."""

    def __init__(self, name: str, given_up: Callable[[], bool] | None = None):
        self.name = name
        self.given_up = given_up  # whether what it serves was given up (:meth:`stop` then waits for nothing)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue | None = None

    def put(self, job: Callable[[], Any]) -> None:
        with self._lock:
            if self._jobs is None:
                self._jobs = queue.SimpleQueue()  # a queue per thread: a stop's end mark is that thread's
                self._thread = threading.Thread(target=self._serve, args=(self._jobs,), name=self.name, daemon=True)
                self._thread.start()
                own(self)
            self._jobs.put(job)

    def let_go(self) -> None:
        """Stop the thread once the callables queued before are done, without waiting and
        without taking a lock: for a ``weakref.finalize`` of what the thread serves (a
        process group), which may run inside any code, a lock's holder included. The
        thread un-lists itself as it ends (a callable put after this is run first)."""
        jobs = self._jobs
        if jobs is not None:
            jobs.put(_LET_GO)  # (SimpleQueue.put is reentrant: safe from a finalizer)

    def _serve(self, jobs: queue.SimpleQueue) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            if job is _LET_GO:
                with self._lock:  # (a put() takes the lock: none lands in this queue after the check)
                    if self._jobs is not jobs:
                        continue  # stopped meanwhile: its end mark follows
                    if not jobs.empty():
                        jobs.put(_LET_GO)  # put() after the mark: those first
                        continue
                    self._thread = self._jobs = None
                    disown(self)  # under the lock: a put() right after lists its new thread
                    return
            try:
                job()
            except Exception:  # noqa: BLE001 - reported; the worker goes on with the next
                log.exception("fastreduce: a job of the %s thread failed", threading.current_thread().name)
            del job  # not held while waiting for the next (it may hold a store connection open)

    def stop(self, timeout: float | None = JOIN_S) -> bool:
        """End the thread once the callables queued before are done; wait up to ``timeout``
        seconds for it (``0``: do not wait); ``False`` where it is still running then."""
        with self._lock:
            thread, jobs = self._thread, self._jobs
            self._thread = self._jobs = None
        disown(self)
        if thread is None:
            return True
        jobs.put(None)
        if thread is threading.current_thread() or timeout == 0 or self.given_up is not None and self.given_up():
            return True  # (given up: a job may wait for good on a peer that never answers; it ends with the process)
        thread.join(timeout)
        return not thread.is_alive()

    @property
    def alive(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()
