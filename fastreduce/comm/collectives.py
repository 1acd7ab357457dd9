"""Collectives: the cheapest correct call per process-group backend.

Averaging: where the backend offers ``ReduceOp.AVG`` (NCCL; Gloo from torch 2.8, known
by version; another backend probed once per group) the collective divides for free.
Elsewhere, and always for an fp16 wire (a sum of fp16 values can overflow before it is
divided), the buffer is divided by the world size *before* the sum, as DDP does.

fp32 accumulation of a low-precision wire (``accumulate_dtype=torch.float32``): a
ring all-reduce in bf16 rounds every partial sum, so its error grows with the number
of ranks. :class:`Fp32Accumulate` sends the same bytes as a ring all-reduce but rounds
only twice at any world size: an all-to-all hands each rank one chunk from every
rank, the rank sums its chunk in fp32 and divides, and an all-gather returns every
rank's averaged chunk (both through :class:`~.comm.Comm`'s exchange and all-gather: on
Gloo with CPU tensors point to point, every receive posted first).

CPU ranks on one host skip the process group for the data: :mod:`.shm` averages
through a shared-memory segment (summing low-precision wires in fp32 as well), and a
plan that carries one sends every launch there.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from ..compat import gloo_has_avg
from ..faults import wait_watched
from ..profiling import span
from .shm import ShmAllReduce, sum_order

__all__ = ["Fp32Accumulate", "MeanPlan", "Messages", "Pending", "Waitable", "advance", "all_gather_flat",
           "broadcast_from_rank0", "complete", "gather_by_exchange", "held_group", "plan_mean", "reduce_scatter_flat",
           "start_all_reduce"]

_BROADCAST_CHUNK = 1 << 24  # elements received at a time when checking what rank 0 sends


class Waitable(Protocol):
    """A launched collective: ``dist.Work`` or a :class:`~fastreduce.shm.ShmWork`."""

    def wait(self) -> bool: ...


Pending = tuple[Waitable | None, Callable[[], None] | None]
"""A launched collective (``None`` if it already ran) and what to run once it is done."""


def advance(pending: Pending) -> None:
    """Issue the second collective of a two-phase launch now (:meth:`Fp32Accumulate.advance`:
    wait for its all-to-all, sum, start the gather), so that its wait later finds both
    done; a no-op for any other. Every rank must call it at the same point of the
    program, as any collective."""
    work = pending[0]
    if isinstance(work, Fp32Accumulate):
        work.advance()


def complete(pending: Pending) -> None:
    """Wait for a launched collective, then run what was to follow it."""
    work, then = pending
    if work is not None:
        wait_watched(work)
    if then is not None:
        then()


class MeanPlan:
    """How one buffer is averaged over a group: AVG in the collective, divide first,
    (``fp32_accumulate``) the all-to-all scheme of :class:`Fp32Accumulate`, or (``shm``)
    through shared memory, which averages by itself."""

    __slots__ = ("_group", "world", "op", "prescale", "fp32_accumulate", "shm")

    def __init__(self, group: dist.ProcessGroup | None, world: int, use_avg: bool,
                 fp32_accumulate: bool = False, shm: ShmAllReduce | None = None):
        self._group = None if group is None else weakref.ref(group)  # a Comm caches plans: see held_group
        self.world = world
        self.op = dist.ReduceOp.AVG if use_avg else dist.ReduceOp.SUM
        self.prescale = not (use_avg or fp32_accumulate or shm is not None)
        self.fp32_accumulate = fp32_accumulate
        self.shm = shm

    @property
    def group(self) -> dist.ProcessGroup | None:
        return held_group(self._group)

    def __repr__(self) -> str:
        how = ("shared memory" if self.shm is not None else "fp32 accumulate" if self.fp32_accumulate else
               "divide then SUM" if self.prescale else "AVG")
        return f"MeanPlan(world={self.world}, {how})"


def held_group(ref: weakref.ref | None) -> dist.ProcessGroup | None:
    """The process group behind a weak reference (``None``: the default group). A
    :class:`~.comm.Comm` and its plans hold their group weakly: :func:`~.comm.get_comm`'s
    cache is keyed by the group, and a strong reference there kept every group ever given
    to a mode alive, with its sockets and threads, after its user destroyed it. A mode holds
    its group itself, so a Comm in use always finds it."""
    if ref is None:
        return None
    group = ref()
    if group is None:
        raise RuntimeError("fastreduce: this mode's process group is gone (destroyed, and nothing refers "
                           "to it any more); build the mode again on a live group")
    return group


def _avg_works(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Try ``ReduceOp.AVG`` once; a backend without it rejects the op on every rank alike."""
    probe = torch.full((1,), float(dist.get_rank(group) % 2), device=device)
    try:
        dist.all_reduce(probe, op=dist.ReduceOp.AVG, group=group)
    except (RuntimeError, ValueError):
        return False
    expect = sum(r % 2 for r in range(dist.get_world_size(group))) / dist.get_world_size(group)
    return abs(probe.item() - expect) < 1e-6


def plan_mean(group: dist.ProcessGroup | None, wire_dtype: torch.dtype, device: torch.device,
              accumulate_dtype: torch.dtype | None = None,
              shm: ShmAllReduce | None = None) -> MeanPlan:
    """Decide, collectively, how a ``wire_dtype`` buffer is averaged over ``group``
    (through ``shm`` when given: it sums low-precision wires in fp32 anyway)."""
    world = dist.get_world_size(group)
    backend = dist.get_backend(group)
    if shm is not None:
        return MeanPlan(group, world, use_avg=False, shm=shm)
    if accumulate_dtype == torch.float32 and torch.finfo(wire_dtype).bits < 32:
        return MeanPlan(group, world, use_avg=False, fp32_accumulate=True)
    if wire_dtype == torch.float16:
        use_avg = False  # sum before divide could overflow fp16
    elif backend == "nccl":
        use_avg = True
    elif backend == "gloo":
        # Never a failing AVG on Gloo: on torch 2.6 the failed op can still be in the
        # group's work in progress when the next barrier gathers it, and that barrier
        # then raises "Cannot use ReduceOp.AVG with Gloo" (seen on two network hosts).
        use_avg = gloo_has_avg()
    else:
        use_avg = _avg_works(group, device)
    return MeanPlan(group, world, use_avg)


def start_all_reduce(buf: torch.Tensor, plan: MeanPlan, pack: Callable[[], None] | None = None,
                     unpack: Callable[[], None] | None = None) -> Pending:
    """Launch the averaging all-reduce of ``buf``: ``pack`` fills it first (and divides,
    if the plan says so), ``unpack`` reads the result. On the shared-memory transport
    both run on its worker thread, off the caller's; otherwise ``pack`` runs here and
    ``unpack`` comes back for whoever waits on the collective."""
    if plan.shm is not None:
        with span("fastreduce::all_reduce"):
            return plan.shm.start(buf, pack, unpack), None
    if pack is not None:
        with span("fastreduce::pack"):
            pack()
    with span("fastreduce::all_reduce"):
        work = dist.all_reduce(buf, op=plan.op, group=plan.group, async_op=True)
    assert work is not None
    return work, unpack


Messages = dict[int, "torch.Tensor | tuple[torch.Tensor, ...]"]
"""Per peer rank: a tensor, or several sent (received) one after the other on one tag."""


def exchange_ops(sends: Messages, recvs: Messages,
                 group: dist.ProcessGroup | None, global_rank: Callable[[int], int], me: int, world: int) -> list[Any]:
    """Point-to-point ops of group rank ``me`` (of ``world``) sending ``sends[j]`` to group
    rank ``j`` and receiving ``recvs[j]`` from it (each as long as what the other side
    sends; a tuple: its tensors in order), every receive posted before any send.

    Gloo's sender holds a message until the receiver's "ready to receive" note for it
    has arrived, and that note travels on the same connection as the receiver's own
    data: posted after a send, a rank's note queues behind its data (megabytes, over a
    slow link hundreds of milliseconds), and the peer's send waits as long. Two
    namespace hosts at 100 Mbit/s, ZeRO's 4.2 MB each way per phase (floor 336 ms, 350
    with TCP's headers): sends and receives interleaved in 64 KiB pieces, half the
    phases took 405-545 ms with stalls of 25-80 ms where the link carried nothing;
    receives first, 349-372 ms in each of 44 phases. Cut into pieces, the messages only
    cost more once the receives go first (4.2 MB each way, medians of 45: 100 Mbit/s
    373 ms whole, 377 in 256 KiB pieces, 388 in 64 KiB; 1 Gbit/s 37.3, 37.7, 40.7; one
    host, 24 MB each way, 21.2, 28.7, 48.2): they go whole.

    In ring order: this rank's k-th send goes to rank ``me + k`` and its k-th receive
    comes from ``me - k``, so each round of first, second, ... messages is a permutation:
    every rank's incoming link takes one sender's data. In rank order every rank sent to
    the lowest rank first, and that rank's incoming link carried the others' messages at
    once. All-to-alls of 1.06 MB bf16 on namespace hosts,
    each rank waiting on its works directly, medians of 27 (the slowest rank's): 8 hosts at
    1 Gbit/s, 11.3 ms in rank order against 8.5 in ring order; 4 hosts, 5.8 and 5.1; 8
    hosts at 100 Mbit/s, 106.3 and 97.2 (the wire's floor: 77.6)."""
    posts = [(dist.irecv, recvs, lambda j: (me - j) % world), (dist.isend, sends, lambda j: (j - me) % world)]
    return [dist.P2POp(kind, t, global_rank(j), group) for kind, tensors, order in posts
            for j in sorted(tensors, key=order) for t in _each(tensors[j]) if t is not None and t.numel()]


def _each(message: torch.Tensor | tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor | None, ...]:
    return message if isinstance(message, tuple) else (message,)


def gather_by_exchange(backend: str, world: int) -> bool:
    """Whether an all-gather goes point to point (each rank's chunk straight to every
    other, whole) rather than through the backend's all-gather: on Gloo at 2 ranks.
    Over 100 Mbit/s links, 8.4 MB fp32: 2 hosts, 354 ms point to point against 371 ms
    for Gloo's all-gather; 4 hosts, 624 ms against 535 ms (Gloo's ring: one flow per
    link direction, where point to point sends every host 3 flows at once; floor
    504 ms), and with every receive posted first 675 against 567 (medians of 12). On
    one host both take 7-12 ms."""
    return backend == "gloo" and world == 2


def all_gather_flat(out: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None,
                    async_op: bool = False) -> Any:
    """All-gather equal shards into ``out`` under whichever name this torch has
    (``all_gather_single`` from 2.13 on, ``all_gather_into_tensor`` before)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, shard, group=group, async_op=async_op)


def reduce_scatter_flat(out: torch.Tensor, buf: torch.Tensor, op: Any, group: dist.ProcessGroup | None,
                        async_op: bool = False) -> Any:
    """Reduce-scatter ``buf`` into equal shards under whichever name this torch has
    (``reduce_scatter_single`` from 2.13 on, ``reduce_scatter_tensor`` before)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(out, buf, op=op, group=group, async_op=async_op)


class Fp32Accumulate:
    """Average a bf16/fp16 ``wire`` buffer in place, summing in fp32 (see the module doc).

    ``wire.numel()`` must be a multiple of the world size. Holds persistent scratch:
    one wire-sized receive buffer and two fp32 chunks, so a launch allocates nothing.
    ``exchange(rows, got)`` launches the all-to-all and ``gather(buf)`` the in-place
    all-gather: :class:`~.comm.Comm`'s, which builds these (on Gloo with CPU tensors both
    go point to point, every receive posted first: Gloo's ``all_to_all_single`` there
    took 2x the wire's time over a 100 Mbit/s link, its stall on "ready to receive" notes).

    Two phases, so that a bucket launched from a backward hook never waits there for
    its own data: :meth:`start` launches the all-to-all and returns; :meth:`advance`
    waits for it, sums this rank's chunk in fp32 and launches the gather;
    :meth:`wait` advances, then waits for the gather. Every rank must issue the
    collectives of a group in the same order, so the accumulations of one group share
    a ``backlog`` (started, not yet advanced, in launch order) and an advance first
    advances every earlier one: the order of the second collectives is then the launch
    order on every rank, whatever the timing. The caller decides when to advance (the
    overlapped mode: the previous bucket, right after launching the next one, so the
    sum of one bucket overlaps the next one's all-to-all; on NCCL/HCCL a wait is a
    stream wait, so nothing there blocks the host).
    """

    collectives = 2
    """Collectives per launch (for counters)."""
    watches_itself = True
    """Its waits go through :func:`~fastreduce.faults.wait_watched` themselves."""

    def __init__(self, wire: torch.Tensor, plan: MeanPlan, backlog: deque[Fp32Accumulate],
                 exchange: Callable[[torch.Tensor, torch.Tensor], Any], gather: Callable[[torch.Tensor], Pending]):
        world = plan.world
        if wire.numel() % world:
            raise ValueError(f"buffer of {wire.numel()} elements does not split into {world} chunks")
        self.wire, self.world = wire, world
        self.rank = dist.get_rank(plan.group)
        self.recv = torch.empty_like(wire)
        self.rows = self.recv.view(world, -1)
        self.sent = wire.view(world, -1)  # row j goes to rank j; row rank then takes the mean
        self.mine = self.sent[self.rank]
        self.acc = torch.empty(self.rows.shape[1], dtype=torch.float32, device=wire.device)
        self.tmp = torch.empty_like(self.acc)
        self.exchange, self.gather = exchange, gather  # Comm's (same calls as its other users)
        self.backlog = backlog
        self.first: Any = None  # the all-to-all in flight (phase 1)
        self.second: Any = None  # the gather in flight (phase 2)

    def __call__(self) -> None:
        """Both phases, synchronously."""
        self.start().wait()

    def start(self) -> Fp32Accumulate:
        """Launch the all-to-all of every rank's chunks (phase 1); return ``self`` to wait on."""
        if self.first is not None or self.second is not None:
            raise RuntimeError("this buffer's fp32 accumulation is already in flight; wait() for "
                               "it before starting it again")
        self.first = self.exchange(self.sent, self.rows)
        self.backlog.append(self)
        return self

    def advance(self) -> None:
        """Sum and launch the gather (phase 2) of this accumulation and, first, of every
        earlier one of the backlog; a no-op once done."""
        while self.first is not None:
            self.backlog.popleft()._gather()

    def _gather(self) -> None:
        wait_watched(self.first)
        self.first = None
        order = sum_order(self.rank, self.world)
        self.acc.copy_(self.rows[order[0]])
        for r in order[1:]:  # world-size ops, never per-parameter ones
            self.tmp.copy_(self.rows[r])
            self.acc.add_(self.tmp)
        self.acc.div_(self.world)
        self.mine.copy_(self.acc)  # the wire's own chunk was sent in phase 1: free now
        self.second = self.gather(self.wire)[0]

    def wait(self) -> bool:
        """Advance, then wait for the gather: ``wire`` holds the mean."""
        self.advance()
        if self.second is not None:
            second, self.second = self.second, None
            wait_watched(second)
        return True


def broadcast_from_rank0(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> bool:
    """Give every rank rank 0's values of ``tensors`` (in place, as DDP does at
    construction); return whether any rank's differed (the same answer on every rank).

    Each rank receives into scratch of at most 16M elements at a time and compares
    before copying, so a mode can say when it overwrote a rank's model."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    rank0 = dist.get_rank(group) == 0
    differed = False
    for t in tensors:
        whole = t.contiguous()  # (a strided view goes as a dense copy: Gloo sends the memory as it lies)
        changed = False
        for piece in whole.view(-1).split(_BROADCAST_CHUNK):
            if rank0:
                wait_watched(dist.broadcast(piece, src=src, group=group, async_op=True))
                continue
            got = torch.empty_like(piece)
            wait_watched(dist.broadcast(got, src=src, group=group, async_op=True))
            if not torch.equal(got, piece):
                changed = True
                piece.copy_(got)
        if changed and whole is not t:
            t.copy_(whole)
        differed = differed or changed
    device = tensors[0].device if tensors else torch.device("cpu")
    flag = torch.tensor([float(differed)], device=device)
    wait_watched(dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True))
    return bool(flag.item())
