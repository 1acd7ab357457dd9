"""The watchdog (:mod:`fastreduce.faults`): a wait on a Gloo collective reads the heartbeat
counters while it lasts, and names a rank silent for the loss window at once (a partition
fails no Gloo collective before the group's timeout)."""

from __future__ import annotations

import pickle
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

import fastreduce.faults_heartbeat as heartbeat
import fastreduce.torch_internals as torch_internals
from .faults_errors import TransportError
from .faults_heartbeat import Heartbeat, StoreCaller, lost_after
from .process_identity import who_of

__all__ = ["abandon_groups", "all_gather_object_watched", "all_reduce_watched", "broadcast_object_watched",
           "pickled", "unpickled", "wait_watched", "waiter", "watch_heartbeats"]


# [Note: no Python callback on a collective's future]
# A callable added to a torch future (``add_done_callback``, ``then``) is held by the future
# in a C++ guard whose destructor takes the GIL. A Gloo work's future is let go by the Gloo
# thread that ran the work, just after it completes. On a busy host that thread can be
# descheduled right there, and let go only after the main thread has left ``main()`` and
# Python has begun to finalize: taking the GIL then ends the thread by unwinding through that
# destructor, and the C++ runtime aborts the process ("terminate called without an active
# exception", SIGABRT): a run that trained, saved and printed exits -6, and torchrun calls it
# failed. (Shown deterministically by a rank that adds a callback to an async all-reduce and
# exits before its peer joins it: SIGABRT every time; without the callback, exit 0.) So a
# collective is waited for in timed slices on the caller's thread (:class:`_Timed`), other works
# on fastreduce's waiter thread (joined at exit by :func:`.lifecycle.shutdown`), and no callback
# is added to a future fastreduce does not complete itself.

def wait_watched(work: Any) -> Any:
    """``work.wait()`` for a process group's collective, watched for ranks that go silent
    (a bundle of works, e.g. point-to-point pieces, waits through its ``wait_unwatched``).

    A dead process fails the collective by itself (its sockets close); a partition (a
    link or a host down, every process alive) does not: Gloo waits out the group's
    timeout. So once a wait has lasted a heartbeat, it reads the heartbeat counters of
    the ranks it watches (:data:`WATCHED_SUCCESSORS`) and the ranks published lost each
    heartbeat; a rank whose counter has not moved for
    ``$FASTREDUCE_LOST_AFTER_S`` is lost, and the wait raises :class:`TransportError`
    naming it, leaving the collective abandoned (the guard of the calling mode turns it
    into a :class:`RankLostError`; the process can exit, or torchrun restart it). A
    rank that is busy, or slow to send over a slow link, keeps beating (its heartbeat is
    a thread of its own, on a store connection of its own). If the store itself stops
    answering for as long, this host is the one cut off, and the wait raises saying so.

    A backend's collective is waited for on this thread, a heartbeat at a time
    (``work.wait(timeout)``: a slice that runs out leaves the work pending), never through a
    Python callback on its future (see [Note: no Python callback on a collective's future]).
    Gloo's point-to-point work, which has no future and takes one ``wait()`` only, and a
    work of fastreduce's own are waited for on a waiter thread (:func:`waiter`). A work made of works that
    it waits for through here itself (``watches_itself``, :class:`~.comm.Fp32Accumulate`)
    is waited on directly: on the waiter thread its own waits would queue behind it.
    Only where the host waits inside the collective (a Gloo default group): NCCL's and
    HCCL's ``wait()`` only orders the device's streams, and their own watchdogs (at the
    group's timeout) see a stuck collective there. Without a heartbeat, a plain wait."""
    if getattr(work, "watches_itself", False):  # a launch of several works, each waited through here
        return work.wait()
    wait = getattr(work, "wait_unwatched", None) or work.wait
    beat = heartbeat.heartbeat_now()
    if beat is None or not beat.host_waits or not beat.current():
        return wait()
    try:
        if work.is_completed():
            return wait()
    except Exception:  # noqa: BLE001 - a work kind that cannot tell
        pass
    if beat.lost:  # a rank of this group is known lost: raise at once, not after a watchdog tick (its
        # neighbours' processes may live on, their sockets open: at 64 ranks the wait took a second)
        abandon_groups()
        raise TransportError(f"fastreduce: rank(s) {sorted(beat.lost)} of this group were lost before this "
                             "collective; it is abandoned")
    if _is_collective(work, wait):  # waited here, a heartbeat at a time
        done = _Timed(work)
        if not done.wait(beat.interval):  # the common case: done within a heartbeat, no watching
            watch_heartbeats(beat, done)
        return True
    done, box = waiter().submit(wait)  # waited once, there: Gloo's point-to-point work takes one wait only
    if not done.wait(beat.interval):
        watch_heartbeats(beat, done)
    if isinstance(box[0], BaseException):
        raise box[0]
    return True


def _is_collective(work: Any, wait: Callable[[], Any]) -> bool:
    """Whether ``work`` is a backend's collective (it has a future; Gloo's point-to-point
    work has none), whose ``wait`` takes a timeout and may be called again after one."""
    if not isinstance(work, dist.Work) or wait != work.wait:
        return False
    try:
        work.get_future()
    except Exception:  # noqa: BLE001 - no future: point-to-point
        return False
    return True


class _Timed:
    """A backend's collective waited for in slices (what :func:`watch_heartbeats` takes as ``done``)."""

    def __init__(self, work: Any):
        self.work = work

    def wait(self, seconds: float) -> bool:
        """Whether the work is done within ``seconds``; its own error, if it failed."""
        try:
            self.work.wait(timedelta(seconds=seconds))
            return True
        except Exception:  # noqa: BLE001 - timed out, or failed: completed tells which
            if not self.work.is_completed():
                return False
        self.work.wait()  # done: its result, or its error
        return True


def all_reduce_watched(t: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None) -> None:
    """A blocking ``dist.all_reduce`` of ``t``, waited through :func:`wait_watched`."""
    wait_watched(dist.all_reduce(t, op=op, group=group, async_op=True))


def pickled(obj: Any) -> torch.Tensor:
    """``obj`` pickled, as the uint8 tensor the object collectives send (:func:`unpickled` reads it)."""
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def unpickled(t: torch.Tensor) -> Any:
    return pickle.loads(t.cpu().numpy().tobytes())


def _watched(group: dist.ProcessGroup | None) -> bool:
    """Whether a heartbeat watches ``group`` (this process's default group, on a backend
    whose host waits inside the collective: a :class:`~fastreduce.Membership`'s member)."""
    beat = heartbeat.heartbeat_now()
    return group in (None, dist.GroupMember.WORLD) and beat is not None and beat.host_waits and beat.current()


def all_gather_object_watched(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """``dist.all_gather_object``: every rank's ``obj``, in rank order. Where a heartbeat
    watches ``group`` (:func:`_watched`), its two gathers (the pickles' lengths, then the
    pickles) are waited for through :func:`wait_watched`: a member lost while the others
    gather (as they enter an epoch) names itself silent within the loss window, where the
    gather in torch's own waited the group's whole timeout on a live member that had given
    up the epoch and left (its sockets kept open: the group abandoned). Elsewhere, torch's own."""
    world = dist.get_world_size(group)
    if not _watched(group):
        out: list[Any] = [None] * world
        dist.all_gather_object(out, obj, group=group)
        return out
    data = pickled(obj)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    wait_watched(dist.all_gather(sizes, size, async_op=True))
    mine = torch.zeros(max(int(n) for n in sizes), dtype=torch.uint8)  # (every rank sends as many bytes)
    mine[:data.numel()] = data
    theirs = [torch.empty_like(mine) for _ in range(world)]
    wait_watched(dist.all_gather(theirs, mine, async_op=True))
    return [unpickled(t[:int(n)]) for t, n in zip(theirs, sizes)]


def broadcast_object_watched(obj: Any, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """``dist.broadcast_object_list([obj], src)``: rank ``src``'s ``obj`` (a global rank) on
    every rank, its two broadcasts (the pickle's length, then the pickle) waited for as
    :func:`all_gather_object_watched`'s are, where a heartbeat watches ``group``."""
    if not _watched(group):
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]
    mine = dist.get_rank() == src
    buf = pickled(obj) if mine else None
    size = torch.tensor([buf.numel() if buf is not None else 0], dtype=torch.int64)
    wait_watched(dist.broadcast(size, src=src, group=group, async_op=True))
    buf = buf if buf is not None else torch.empty(int(size), dtype=torch.uint8)
    wait_watched(dist.broadcast(buf, src=src, group=group, async_op=True))
    return obj if mine else unpickled(buf)


_lock = threading.Lock()
_waiter_caller: StoreCaller | None = None


def waiter() -> StoreCaller:
    """A daemon thread that waits for works without futures, one at a time (an abandoned
    work may keep it for good: :func:`abandon_groups` starts the next wait on a new one)."""
    global _waiter_caller
    with _lock:
        if _waiter_caller is None:
            _waiter_caller = StoreCaller("fastreduce-waiter")
        return _waiter_caller


def watch_heartbeats(beat: Heartbeat, done: threading.Event) -> None:
    """Until ``done``: raise if a rank's heartbeat stops for the window, or the store does."""
    window = lost_after()
    seen: dict[int, tuple[int, float]] = {}  # rank -> (its counter, when it was last seen to move)
    records: dict[int, str] = {}  # the silent ranks' registrations, read once (:meth:`Heartbeat.slow_here`)
    unanswered = None  # since when the store has not answered
    read = True  # at once (the wait has lasted a heartbeat: another rank may have published a loss), then a heartbeat apart
    while read or not done.wait(min(beat.interval, 1.0)):
        read, now = False, time.monotonic()
        try:
            silent = beat.silent(seen, window, records)
            found = beat.call(beat.verdict)
        except Exception as err:  # noqa: BLE001 - the store does not answer
            unanswered = unanswered or now
            if time.monotonic() - unanswered >= window:
                raise TransportError(f"fastreduce: the job's c10d store has not answered for "
                                     f"{time.monotonic() - unanswered:.0f} s while a collective waited "
                                     f"({type(err).__name__}): this host seems cut off from the others; the "
                                     "collective is abandoned") from err
            continue
        unanswered = None
        if found is not None:  # another rank named them first: the same names here
            beat.mark_lost(*found, publish=False)
            abandon_groups()
            raise TransportError(f"fastreduce: rank(s) {found[0]} were found lost by another rank during a "
                                 "collective; the collective is abandoned")
        if silent:
            how = (f"its heartbeat in the c10d store stopped for {window:g} s while a collective waited for it "
                   "(seen by the watchdog: its host or link is down, or its process is stopped)")
            beat.mark_lost(silent, how, who_of(beat.registered(silent, records)))
            abandon_groups()
            raise TransportError(f"fastreduce: rank(s) {silent} went silent during a collective; the "
                                 "collective is abandoned")



def abandon_groups(gone: Callable[[], bool] | None = None) -> None:
    """After a watchdog found a rank lost: let this process exit. A collective waiting on
    a peer that will never answer holds a Gloo thread in a socket read, and destroying
    its process group (at the latest, the interpreter's exit) joins that thread: the
    process would hang there. So every process group is aborted where the backend can
    (the pending work fails, its thread returns) and pinned: not destroyed until its
    timeout has passed and every collective of it has returned, then let go of at the next
    abandonment or epoch (:func:`.torch_internals.abandon_groups`, ``release_abandoned``),
    or as soon as ``gone()`` says every peer of them has exited. The group is of no further
    use either way: a job that lost a rank restarts (torchrun --max-restarts), or under a
    Membership goes on in a new group."""
    global _waiter_caller

    torch_internals.abandon_groups(gone)
    with _lock:  # its thread may wait for good on an abandoned work: later groups' waits get a new one
        if _waiter_caller is not None:
            _waiter_caller.close()  # (it ends once free)
        _waiter_caller = None
