"""How the ranks of a shared-memory group (:mod:`.shm`) keep in step: the barrier through the
segment's first page, which also watches for ranks that have exited, or else a Gloo barrier,
and the one worker thread per process group that runs every job in launch order."""

from __future__ import annotations

import itertools
import os
import socket
import time
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..faults import RankLostError, TransportError, group_token, note_lost
from ..lifecycle import Worker
from ..profiling import span

LINE = 64
EXITED_CHECK_S = 0.05
"""How often a rank waiting at a shared-memory barrier looks whether another has exited (a
read of ``/proc/<pid>/stat`` per rank): a lost peer fails the wait within this, wherever in
its wait the waiter was when the peer died."""


class FlagBarrier:
    """A barrier through the segment itself: each rank stores how many barriers it has
    reached in a cache line of its own and polls the others'. Microseconds when the
    ranks arrive together, against a Gloo round trip per barrier; while it waits it
    yields the core, then sleeps, so a rank still in backward keeps its CPU. A wait
    checks every :data:`EXITED_CHECK_S` whether a rank has exited (its pid, stored next to
    its count) and raises :class:`~fastreduce.faults.RankLostError` then, naming it by
    its global rank (``ranks``), rather than at the timeout (the process group's).
    Once failed it stays failed: every later barrier raises at once.

    A rank that finds others exited writes whom (a bit per rank, the line's fourth word)
    before it fails, and the others take its word: it may itself exit once it has raised,
    before a slower survivor looks, and is no lost rank for that (3 ranks, rank 1 killed:
    rank 0 named ranks 1 and 2 when rank 2 had raised and exited first).

    Ordering: the data a rank wrote before storing its count is visible to a rank that
    has read that count, on x86-64's total store order (every store of ATen's kernels
    and of ``fill_`` is a plain store, each kernel an opaque call). Elsewhere the Gloo
    barrier is used.
    """

    def __init__(self, header: torch.Tensor, rank: int, world: int, timeout: float,
                 ranks: Sequence[int] | None = None):
        lines = header.view(torch.int64).view(-1, LINE // 8)[:world]  # [count, pid, pid ns, lost]
        self.flags, self.pids, self.pidns, self.verdicts = lines[:, 0], lines[:, 1], lines[:, 2], lines[:, 3]
        self.rank = rank
        self.mine = lines[rank, 0:1]
        self.count = 0
        self.timeout = timeout
        self.ranks = list(ranks) if ranks is not None else list(range(world))  # global ranks
        self.failed = False
        self.lost: RankLostError | None = None
        self.group = group_token()  # whose heartbeat a loss found here is noted in (:func:`note_lost`)

    def __call__(self) -> None:
        if self.failed:  # stays failed: never let the others pass on a broken result
            if self.lost is not None:
                raise self.lost
            raise TransportError("fastreduce: an earlier shared-memory all-reduce failed on this rank")
        self.count += 1
        self.mine.fill_(self.count)
        flags, count = self.flags, self.count
        if int(flags.min()) >= count:
            return
        deadline = time.monotonic() + self.timeout
        check_at = time.monotonic() + EXITED_CHECK_S
        for spin in itertools.count():
            least = int(flags.min())
            if least >= count:
                return
            if least < 0:
                self._check_exited()  # a rank that failed because another one exited
                failed = [self.ranks[k] for k, c in enumerate(flags.tolist()) if c < 0]
                raise TransportError(f"fastreduce: rank(s) {failed} of the shared-memory group failed "
                                     "in an all-reduce; its result is not valid")
            if spin < 200:
                os.sched_yield()
                continue
            time.sleep(5e-5 if spin < 2000 else 1e-3)
            if time.monotonic() >= check_at:  # (a peer may die at any point of a long wait: checked on time)
                self._check(deadline)
                check_at = time.monotonic() + EXITED_CHECK_S

    def fail(self) -> None:
        """Tell the other ranks this rank's job failed: their wait raises, not hangs."""
        self.failed = True
        self.mine.fill_(-1)

    def _check(self, deadline: float) -> None:
        """Raise instead of waiting for a rank that has exited, or past the timeout."""
        self._check_exited()
        if time.monotonic() > deadline:
            raise TransportError(f"fastreduce: a rank did not reach the shared-memory barrier "
                                 f"within {self.timeout:g} s (the process group's timeout)")

    def _check_exited(self) -> None:
        """Raise :class:`RankLostError` if a rank's process has exited."""
        if len(set(self.pidns.tolist())) != 1:  # pids do not mean the same thing to every rank
            return
        host = socket.gethostname()
        exited = {k for k, pid in enumerate(self.pids.tolist()) if not _alive(pid)}
        told = {k: v for k, v in enumerate(self.verdicts.tolist()) if v}  # local rank -> lost ranks' bits
        lost = (exited - set(told)) | {k for v in told.values() for k in range(len(self.ranks)) if v >> k & 1}
        pids = self.pids.tolist()
        gone = {self.ranks[k]: f"pid {pids[k]} on host {host}" for k in sorted(lost)}
        if gone:
            if len(self.ranks) < 64:  # this rank's word for the others (see the class docstring)
                self.verdicts[self.rank] = sum(1 << k for k in lost)
            how = "its process exited (seen by the shared-memory transport)"
            note_lost(gone, how, self.group)
            world = dist.get_world_size() if dist.is_initialized() else None
            self.lost = RankLostError(list(gone), how=how, world=world, who=gone)
            self.fail()
            raise self.lost


def _alive(pid: int) -> bool:
    """False only when ``pid`` is known to have exited (gone, or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return not os.path.isdir("/proc/self")
    except (OSError, IndexError):
        return True


def pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


class _Channel:
    """The worker thread and barrier group shared by every reducer on one process group.

    One FIFO for all of them: ranks submit jobs in the same program order, so they run
    them, and issue their barriers, in the same order.
    """

    def __init__(self, group: dist.ProcessGroup | None):
        self.ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        self.sync: dist.ProcessGroup | None = None  # Gloo barriers' group (gloo_barrier())
        self.worker = Worker("fastreduce-shm")  # stopped by lifecycle.shutdown(), started again by a job
        weakref.finalize(self, self.worker.let_go).atexit = False  # or once this channel is gone
        self.tick = torch.zeros(1, dtype=torch.int32)

    def gloo_barrier(self) -> Callable[[], None]:
        """The barrier through Gloo, where flag barriers are not safe: on a group of its own,
        so that it never meets the user's collectives, made by the first call (collective
        over the ranks: called as a segment is opened). Only then: torch keeps a group until
        it is destroyed, and a channel made for each of the user's groups made one whose
        sockets and threads outlived the user's group, used or not."""
        if self.sync is None:
            self.sync = dist.new_group(self.ranks, backend="gloo", use_local_synchronization=True)
        return self.barrier

    def barrier(self) -> None:
        dist.all_reduce(self.tick, group=self.sync)

    def put(self, job: Any) -> None:  # a ShmWork (.shm)
        self.worker.put(lambda: self._run(job))

    @staticmethod
    def _run(job: Any) -> None:
        try:
            # Ranges show in a profile taken with profile_all_threads=True.
            if job.before is not None:
                with span("fastreduce::pack"):
                    job.before()
            with span("fastreduce::shm_average"):
                job.barrier()  # A: every rank packed
                job.reduce()
                job.barrier()  # B: every chunk averaged and pushed
            if job.after is not None:
                with span("fastreduce::unpack"):
                    job.after()
        except BaseException as err:  # noqa: BLE001 - handed to wait()
            job.error = err
            fail = getattr(job.barrier, "fail", None)
            if fail is not None:
                fail()
        job.done.set()


_channels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def channel_of(group: dist.ProcessGroup | None) -> _Channel:
    pg = group or dist.group.WORLD
    ch = _channels.get(pg)
    if ch is None:
        ch = _channels[pg] = _Channel(group)
    return ch
