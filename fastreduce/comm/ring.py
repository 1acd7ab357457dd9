"""The ring reduce-scatter of Gloo's CPU tensors beyond two ranks (:class:`RingReduceScatter`):
its messages, each step's pieces and tags, and the thread per group that sends each received
piece on. :class:`~.comm.Comm` launches it where Gloo has no reduce-scatter of its own that
moves one flow per link direction."""

from __future__ import annotations

import itertools
import weakref
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from ..faults import wait_watched
from ..lifecycle import Worker
from ..torch_internals import is_abandoned

__all__ = ["RING_PIECE_BYTES", "RING_TAG", "RingReduceScatter", "ring_scratch_numel"]


RING_PIECE_BYTES = 1 << 18
"""The piece of :class:`RingReduceScatter`'s messages (256 KiB): each received piece is
summed and sent on, so the ring's W - 1 steps overlap piece by piece."""


def _ring_pieces(n: int, m: int, itemsize: int) -> list[tuple[int, int]]:
    """The ``[a, b)`` pieces of a row of ``n`` elements that :class:`RingReduceScatter` sends
    one by one, the last one ``m`` longer (the rider behind it)."""
    step = max(1, RING_PIECE_BYTES // itemsize)
    starts = list(range(0, n, step)) or [0]
    return list(zip(starts, starts[1:] + [n + m]))


def ring_scratch_numel(world: int, n: int, m: int = 0, itemsize: int = 4) -> int:
    """How long :class:`RingReduceScatter`'s receive buffer must be for rows of ``n``
    elements (of ``itemsize`` bytes) and a rider of ``m``: a row per step with room for the
    rider, and where there is one, step 0's last piece staged with it."""
    tail = 0 if m == 0 else n + m - _ring_pieces(n, m, itemsize)[-1][0]
    return (world - 1) * (n + m) + tail


RING_TAG = 1 << 24
"""The first point-to-point tag of :class:`RingReduceScatter`'s messages: each step of
each launch has a tag of its own (from here up), apart from the other exchanges' (0)."""


class RingReduceScatter:
    """``out`` := this rank's chunk of the mean of every rank's ``rows`` (the buffer as
    world x chunk), around a ring of point-to-point messages: Gloo, CPU tensors, more
    than two ranks, an fp32 (or wider) wire.

    In step s (of W - 1) rank r sends its running sum of chunk r - 1 - s to rank r + 1
    and adds its own row to the running sum of chunk r - 2 - s that rank r - 1 sent; after
    the last step it holds chunk r summed over every rank in :func:`~.shm.sum_order`, what
    every transport sums in, and divides once. Each link direction carries one flow of
    (W - 1)/W of the buffer. Sending every row straight to its owner moves as many bytes
    but puts W - 1 flows on each host's link at once, which a rate-limited link moves
    more slowly: 4 hosts at 100 Mbit/s, 8.4 MB fp32, 590-700 ms straight against
    555-560 ms around the ring and 540 ms for Gloo's own ring all-gather (the wire's
    floor: 504 ms).

    The launch posts every receive (a buffer of its own per step: ``recv``, W - 1
    chunks) and step 0's sends (my own row). The later sends need the receive before
    them, so a thread of the group's own (:func:`_ring_of`) waits for each received
    piece (``RING_PIECE_BYTES``), adds my row to it and sends it on: the steps overlap
    piece by piece, and the next launch's first step is already on the wire when this
    one ends. Every step of every launch has a tag of its own, so which thread posts
    first never matters. ``wait()`` is watched for lost ranks like any Gloo wait
    (:func:`~fastreduce.faults.wait_watched`); a job whose wait raised, or whose group was
    abandoned, sends nothing more (its group is the one it was launched on, never the default
    group of a later epoch, which a later piece would otherwise go to).

    ``rider`` = ``(mine, total)``: ``total`` := the sum of every rank's ``mine`` (a few
    fp32 counts), carried around the same ring at the end of each step's last piece: no
    message of its own (step 0's last piece goes from a copy with ``mine`` behind it, the
    later steps' straight from the receive buffer, whose rows have room for it).
    """

    def __init__(self, rows: torch.Tensor, out: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup | None,
                 global_rank: Callable[[int], int], rider: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.rows, self.out, self.group, self.rider = rows, out, group or dist.group.WORLD, rider  # (pinned: see run)
        self.rank, self.world = dist.get_rank(group), rows.shape[0]
        r, w, n = self.rank, self.world, rows.shape[1]
        m = 0 if rider is None else rider[0].numel()
        need = ring_scratch_numel(w, n, m, rows.element_size())
        if recv.numel() < need:
            raise ValueError(f"a ring reduce-scatter needs a receive buffer of {need} elements")
        self.n, self.recv = n, recv[:(w - 1) * (n + m)].view(w - 1, n + m)
        self.pieces = _ring_pieces(n, m, rows.element_size())  # the last one carries the rider
        self.next, self.prev = global_rank((r + 1) % w), global_rank((r - 1) % w)
        jobs, launches = _ring_of(group)
        self.tag0 = RING_TAG + (next(launches) * w) % (1 << 22)
        self.error: BaseException | None = None
        self.abandoned = False
        self.future: torch.futures.Future = torch.futures.Future()
        self.recvs = [[dist.irecv(self.recv[s, a:b], self.prev, group, self.tag0 + s) for a, b in self.pieces]
                      for s in range(w - 1)]
        first = rows[(r - 1) % w]  # step 0 sends my own row, my rider behind its last piece
        if rider is not None:  # (that piece from the scratch's end: the same launch's, no allocation)
            tail = self.pieces[-1][0]
            at = (w - 1) * (n + m)
            staged = recv[at:at + n + m - tail]
            staged[:n - tail].copy_(first[tail:])
            staged[n - tail:].copy_(rider[0])
        self.sends = [dist.isend(first[a:b] if b <= n else staged, self.next, group, self.tag0)
                      for a, b in self.pieces]
        jobs.put(self.run)

    def run(self) -> None:
        """The steps after the first (on the ring thread)."""
        r, w, n = self.rank, self.world, self.n
        try:
            for s in range(w - 1):
                own = self.rows[(r - 2 - s) % w]
                for (a, b), work in zip(self.pieces, self.recvs[s]):
                    work.wait()
                    if self.abandoned or is_abandoned(self.group):  # (not a send more on a group let go of)
                        return
                    got = self.recv[s, a:b]  # the piece, and the rider's running sum behind the last one
                    piece = got[:min(b, n) - a].add_(own[a:min(b, n)])
                    if b > n:
                        got[n - a:].add_(self.rider[0])
                    if s < w - 2:
                        self.sends.append(dist.isend(got, self.next, self.group, self.tag0 + s + 1))
                        continue
                    torch.div(piece, w, out=self.out[a:min(b, n)])
                    if b > n:
                        self.rider[1].copy_(got[n - a:])
            for work in self.sends:
                work.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            self.error = e
        finally:
            self.future.set_result(None)

    def is_completed(self) -> bool:
        return self.future.done()

    def get_future(self) -> torch.futures.Future:
        return self.future

    def wait_unwatched(self) -> bool:
        self.future.wait()
        if self.error is not None:
            raise self.error
        return True

    def wait(self) -> bool:
        try:
            return wait_watched(self)
        except BaseException:
            self.abandoned = True
            raise


_ring_queues: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _ring_of(group: dist.ProcessGroup | None) -> tuple[Worker, Iterator[int]]:
    """``group``'s ring thread (a :class:`~fastreduce.lifecycle.Worker`: started on first
    use, stopped by ``fastreduce.shutdown()`` or once the group is gone: a launch in its queue
    holds the group, so none is left then; not waited for once the group is abandoned, where a
    receive from a peer gone on to its next epoch, its sockets open, waits for good), and its
    count of launches (the same on every rank: they launch in the same order)."""
    pg = group or dist.group.WORLD
    ring = _ring_queues.get(pg)
    if ring is None:
        held = weakref.ref(pg)  # (given up with its group: a receive from a peer gone on waits for good)
        ring = _ring_queues[pg] = (Worker("fastreduce-ring", lambda: (g := held()) is not None and is_abandoned(g)),
                                   itertools.count())
        weakref.finalize(pg, ring[0].let_go).atexit = False  # at the exit, shutdown() stops it
    return ring
