"""Comm: the averaging collectives of one process group on one device, for every mode.

Modes never pick a transport or a collective; they ask a :class:`Comm` for

* ``all_reduce(buf, plan)``: ``buf`` := mean over the ranks (fused, overlapped modes);
* ``reduce_scatter(buf, out)``: ``out`` := this rank's chunk of that mean (ZeRO);
* ``all_gather(buf)``: every rank's chunk of ``buf`` to every rank, in place (ZeRO's
  parameters);
* ``mix(buf, out, matrix)``: ``out`` := this rank's row of a gossip mixing matrix
  applied to every rank's ``buf`` (decentralized modes);

each launched asynchronously and returned as a :data:`~.collectives.Pending`
``(work, then)``: wait on ``work``, then run ``then``. Chunk ``r`` of a buffer of ``n``
elements is elements ``[r n/W, (r+1) n/W)``; :attr:`Comm.shard_multiple` is what ``n``
must be a multiple of for that to be exact and cache-line aligned.

How the bytes travel, per buffer:

=================  =======================================================================
 shared memory      CPU ranks on one host (``transport`` ``auto``/``shm``): the buffer is
                    a region of a ``/dev/shm`` segment (:meth:`Comm.buffer`); rank r
                    averages chunk r over every rank's region (all-reduce: and pushes
                    it back; reduce-scatter: into ``out``); all-gather pulls chunk k from
                    rank k's region. See :mod:`.shm`.
 Gloo               point-to-point rows for both halves (what an all-to-all moves),
                    every receive posted before any send
                    (:func:`~.collectives.exchange_ops`), with the sum done locally in
                    fp32; an fp32 reduce-scatter over more than two ranks goes around a
                    ring instead (:class:`~.ring.RingReduceScatter`: one flow per
                    link, about 0.85x the time of the direct exchange over 100 Mbit/s
                    links): measured on torch 2.13 (2 ranks, 48 MB fp32, one host),
                    ``all_to_all_single`` 21 ms, the point-to-point exchange 21 ms,
                    against ``reduce_scatter_tensor`` 62 ms and
                    ``all_gather_into_tensor`` 49 ms; the gossip mix goes point to point
                    alike. All-reduce stays ``all_reduce``
                    (39 ms, faster than the two exchanges it would take). Device
                    tensors over Gloo take ``all_to_all_single`` and the all-gather:
                    Gloo's point to point moves host memory only.
 NCCL, HCCL, ...    the group's own ``all_reduce`` / reduce-scatter / all-gather, with
                    ``ReduceOp.AVG`` where the backend has it, else divided first.
=================  =======================================================================

One :class:`Comm` per (group, device, transport), shared by every mode that asks
(:func:`get_comm`); it holds the shared-memory segments it opened and the scratch the
Gloo path needs (one buffer's worth per buffer, allocated on first use, never per call),
and its group only weakly (the cache is keyed by it): a group its user let go of is freed.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..codecs.quant import divisor
from ..engine import require_distributed
from ..faults import start_heartbeat, wait_watched
from ..profiling import span
from .collectives import (Fp32Accumulate, MeanPlan, Messages, Pending, all_gather_flat, exchange_ops,
                          gather_by_exchange, held_group, plan_mean, reduce_scatter_flat, start_all_reduce)
from .ring import RingReduceScatter, ring_scratch_numel
from .shm import ALL_GATHER, MIX, REDUCE_SCATTER, ShmAllReduce, sum_order, weighted_sum
from .transport import resolve_transport, wants_shm

__all__ = ["Comm", "get_comm"]

_CHUNK_ALIGN = 64  # elements: no two ranks' chunks share a cache line


class Comm:
    """Averaging collectives of ``group`` for buffers on ``device`` (see the module doc).

    Build it with :func:`get_comm`. Every method that allocates or communicates is
    collective: all ranks of the group call it in the same order.
    """

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, transport: str):
        # The group held weakly: get_comm's cache is keyed by it, so a strong reference here
        # kept every group ever given to a mode alive (its sockets and threads), destroyed or not.
        self._group = None if group is None else weakref.ref(group)
        self.device, self.transport = device, resolve_transport(transport)
        if self.transport == "shm" and device.type != "cpu":
            raise ValueError(f"transport='shm' needs CPU tensors, these are on {device}; "
                             "use transport='auto' or 'process_group'")
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.pg_backend = dist.get_backend(group)
        self.by_all_to_all = self.pg_backend == "gloo"
        # Gloo's point to point moves host memory only (a device pointer fails in its
        # writev, "Bad address"): device tensors take its all-to-all and all-gather,
        # which stage through host memory themselves.
        self.by_exchange = self.by_all_to_all and device.type == "cpu"
        self.gather_by_exchange = self.by_exchange and gather_by_exchange(self.pg_backend, self.world)
        self.shms: list[ShmAllReduce] = []
        self._scratch: dict[tuple, torch.Tensor] = {}
        self._plans: dict[torch.dtype, MeanPlan] = {}
        self._accumulators: dict[tuple, Fp32Accumulate] = {}
        self._backlog: deque[Fp32Accumulate] = deque()  # launched, sum and gather not yet issued
        self._rows: dict[int, tuple] = {}  # mixing matrix -> (it, row, column, uniform)

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group (``None``: the default one); whoever uses this Comm holds it."""
        return held_group(self._group)

    @property
    def shard_multiple(self) -> int:
        """Buffers for :meth:`reduce_scatter` / :meth:`all_gather` are padded to a
        multiple of this: equal chunks, each a whole number of cache lines."""
        return self.world * _CHUNK_ALIGN

    @property
    def wants_shm(self) -> bool:
        return wants_shm(self.transport, self.device)

    # ------------------------------------------------------------------ buffers

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Zeroed storage for a buffer the collectives will move (collective).

        On the shared-memory transport it is this rank's region of a new segment, so a
        pack writes straight into memory the other ranks read; otherwise plain memory
        on the device.
        """
        if self.wants_shm and self.world > 1:
            shm = ShmAllReduce.open(self.group, numel * dtype.itemsize, required=self.transport == "shm")
            if shm is not None:
                self.shms.append(shm)
                return shm.region(dtype, numel)
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def release(self, buf: torch.Tensor) -> None:
        """Forget ``buf`` (from :meth:`buffer`; its user is done with it): its shared-memory
        segment, freed once no tensor maps it any more, and what was kept for it (scratch,
        accumulators). A reducer rebuilt again and again kept a segment per build for the
        group's life."""
        shm = self.shm_of(buf)
        if shm is not None:
            self.shms.remove(shm)
            base = shm.regions[shm.rank]
            start, end = base.data_ptr(), base.data_ptr() + shm.region_bytes
        else:
            start, end = buf.data_ptr(), buf.data_ptr() + buf.nbytes
        for cache in (self._scratch, self._accumulators):
            for key in [k for k in cache if start <= k[1] < end]:
                del cache[key]

    def everyones(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's counterpart of ``t``, a buffer from :meth:`buffer` on shared memory
        (:meth:`ShmAllReduce.everyones`); ``None`` elsewhere."""
        shm = self.shm_of(t)
        return None if shm is None else shm.everyones(t)

    def shm_of(self, buf: torch.Tensor) -> ShmAllReduce | None:
        """The shared-memory segment ``buf`` lives in, if any."""
        if buf.device.type != "cpu":
            return None
        ptr = buf.data_ptr()
        for shm in self.shms:
            base = shm.regions[shm.rank].data_ptr()
            if base <= ptr < base + shm.region_bytes:
                return shm
        return None

    def plan(self, wire_dtype: torch.dtype, accumulate_dtype: torch.dtype | None = None,
             buf: torch.Tensor | None = None) -> MeanPlan:
        """How a ``wire_dtype`` all-reduce of ``buf`` averages (collective on first use)."""
        shm = None if buf is None else self.shm_of(buf)
        if shm is not None or accumulate_dtype is not None:
            return plan_mean(self.group, wire_dtype, self.device, accumulate_dtype, shm)
        plan = self._plans.get(wire_dtype)
        if plan is None:
            plan = self._plans[wire_dtype] = plan_mean(self.group, wire_dtype, self.device)
        return plan

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, buf: torch.Tensor, plan: MeanPlan, pack: Callable[[], None] | None = None,
                   unpack: Callable[[], None] | None = None) -> Pending:
        """Launch ``buf`` := mean over ranks; ``pack`` fills it first (dividing, if
        ``plan.prescale``), ``unpack`` runs once it is done (see
        :func:`~.collectives.start_all_reduce`).

        A ``plan.fp32_accumulate`` plan launches the first half of
        :class:`~.collectives.Fp32Accumulate` (``buf`` splits into world-size chunks;
        its scratch is kept per buffer) and returns it to wait on; the second half of
        the previous such launch on this group (its fp32 sum and gather) is issued
        right after, so in the overlapped mode each bucket's sum runs while the next
        bucket's all-to-all is on the wire and the last one's in ``wait()``."""
        if not plan.fp32_accumulate:
            return start_all_reduce(buf, plan, pack, unpack)
        key = ("fp32_accumulate", buf.data_ptr(), buf.numel(), buf.dtype)
        accumulate = self._accumulators.get(key)
        if accumulate is None:
            accumulate = self._accumulators[key] = Fp32Accumulate(buf, plan, self._backlog, self.exchange,
                                                                  self.all_gather)
        if pack is not None:
            with span("fastreduce::pack"):
                pack()
        with span("fastreduce::all_reduce"):
            accumulate.start()  # all-to-all out; the fp32 sum and the gather follow
            if len(self._backlog) > 1:
                self._backlog[-2].advance()
        return accumulate, unpack

    def carries_riders(self, buf: torch.Tensor) -> bool:
        """Whether :meth:`reduce_scatter` of ``buf`` can carry a ``rider``: Gloo's point to
        point (the rider's values go in the buffer's own messages) and shared memory (they
        are written and summed between the buffer's own barriers), no round of their own;
        NCCL/HCCL would need a collective of their own, which the caller launches."""
        return self.world > 1 and (self.by_exchange or self.shm_of(buf) is not None)

    def reduce_scatter(self, buf: torch.Tensor, out: torch.Tensor | None = None,
                       pack: Callable[[], None] | None = None, fp32_sum: bool = False,
                       rider: tuple[torch.Tensor, torch.Tensor] | None = None) -> Pending:
        """Launch ``out`` := this rank's chunk of the mean of ``buf`` over ranks.

        ``out`` (default: that chunk of ``buf`` itself) may be wider than ``buf``: a
        bf16 ``buf`` averaged into an fp32 ``out`` is summed in fp32 and rounded once.
        ``pack`` fills ``buf`` first. ``buf``'s other chunks are left as they were, or
        (the default ``out``, Gloo) undefined. Shared memory and Gloo always sum in
        fp32; ``fp32_sum`` makes NCCL/HCCL do so too (an all-to-all and a local sum, the
        same bytes) instead of summing in ``buf``'s dtype inside the collective.
        ``rider`` = ``(mine, total)``, where :meth:`carries_riders`: ``total`` := the sum
        over ranks of every rank's ``mine`` (a few fp32 counts, exact), in the same messages;
        on shared memory ``total`` must come from :meth:`buffer` (every rank reads it).
        """
        n = self._chunk(buf)
        if rider is not None and not self.carries_riders(buf):
            raise ValueError("this reduce-scatter carries no rider (see Comm.carries_riders())")
        mine = buf[self.rank * n:(self.rank + 1) * n]
        if out is None or (out.data_ptr() == mine.data_ptr() and out.dtype == mine.dtype and out.shape == (n,)):
            out = mine  # (a view of this rank's own chunk is that chunk: summed in place, not into itself)
        elif out.shape != (n,):
            raise ValueError(f"reduce_scatter's output must be {n} elements, got {tuple(out.shape)}")
        shm = self.shm_of(buf)
        with span("fastreduce::reduce_scatter"):
            if shm is not None:
                slots = None if rider is None else self.everyones(rider[1])
                if rider is not None and slots is None:
                    raise ValueError("on shared memory a rider's total must be a buffer from Comm.buffer()")
                return shm.start(buf, pack, kind=REDUCE_SCATTER, out=None if out is mine else out,
                                 rider=None if slots is None else (rider[0], slots)), None
            if pack is not None:
                with span("fastreduce::pack"):
                    pack()
            if self.by_exchange and self.world > 2 and out.dtype == buf.dtype and buf.dtype.itemsize >= 4:
                m = 0 if rider is None else rider[0].numel()
                recv = self._scratch_like(buf, "recv", numel=max(buf.numel(), ring_scratch_numel(
                    self.world, n, m, buf.element_size())))
                return RingReduceScatter(buf.view(self.world, n), out, recv, self.group, self._global, rider), None
            if self.by_all_to_all or (fp32_sum and buf.dtype.itemsize < 4):  # Gloo, or a sum in fp32
                recv = self._scratch_like(buf, "recv")
                if rider is None:
                    return self.exchange(buf.view(self.world, n), recv.view(self.world, n)), \
                        lambda: self.sum_rows(recv, out)
                mine, total = rider
                theirs = mine.new_empty(self.world, mine.numel())
                work = self.exchange(buf.view(self.world, n), recv.view(self.world, n), (mine, theirs))

                def done() -> None:
                    self.sum_rows(recv, out)
                    torch.sum(theirs, 0, out=total)
                return work, done
            plan = self.plan(buf.dtype)
            if plan.prescale:
                buf.div_(self.world)
            dst = out if out.dtype == buf.dtype else self._scratch_like(mine, "rs_out")
            work = reduce_scatter_flat(dst, buf, plan.op, self.group, async_op=True)
            return work, (None if dst is out else lambda: out.copy_(dst))

    def exchange(self, rows: torch.Tensor, got: torch.Tensor,
                 rider: tuple[torch.Tensor, torch.Tensor] | None = None) -> Any:
        """Launch an all-to-all of ``rows`` (W rows): row j to rank j, and rank j's row
        r into ``got[j]`` (this rank's own row copied). On Gloo with CPU tensors it is
        point-to-point (:meth:`send_recv`); elsewhere ``all_to_all_single``. There,
        ``rider`` = ``(mine, theirs)`` also sends ``mine`` to every rank behind its row,
        rank j's into ``theirs[j]``. Returns the work to wait on."""
        if self.by_exchange:
            got[self.rank].copy_(rows[self.rank])
            peers = [j for j in range(self.world) if j != self.rank]
            if rider is None:
                return self.send_recv({j: rows[j] for j in peers}, {j: got[j] for j in peers})
            rider[1][self.rank].copy_(rider[0])
            return self.send_recv({j: (rows[j], rider[0]) for j in peers}, {j: (got[j], rider[1][j]) for j in peers})
        return dist.all_to_all_single(got, rows, group=self.group, async_op=True)

    def send_recv(self, sends: Messages, recvs: Messages) -> Any:
        """Launch point-to-point messages: ``sends[j]`` to rank ``j``, ``recvs[j]`` from
        it (each as long as what ``j`` sends), every receive posted before any send
        (:func:`~.collectives.exchange_ops`). Returns the work to wait on (once). Gloo
        moves host memory only (a device pointer fails in its writev): there a device
        tensor is sent from a host copy and received into a host buffer, copied to it by
        the wait (ZeRO's mirror of a shard on the next rank sends CUDA tensors here)."""
        back: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host buffer, the device tensor it lands in)
        if self.pg_backend == "gloo":  # Gloo moves host memory only: device tensors are staged through it
            sends = {j: _mapped(m, lambda t: t.cpu()) for j, m in sends.items()}
            recvs = {j: _mapped(m, lambda t: _staged(t, back)) for j, m in recvs.items()}
        ops = exchange_ops(sends, recvs, self.group, self._global, self.rank, self.world)
        return _AllWorks(dist.batch_isend_irecv(ops) if ops else [], back)

    def all_gather(self, buf: torch.Tensor) -> Pending:
        """Launch the all-gather of ``buf`` in place: chunk k of every rank's ``buf`` :=
        rank k's chunk k. On shared memory (``buf`` from :meth:`buffer`) each rank
        pulls the other chunks straight from their owners' regions."""
        n = self._chunk(buf)
        mine = buf[self.rank * n:(self.rank + 1) * n]
        shm = self.shm_of(buf)
        with span("fastreduce::all_gather"):
            if shm is not None:
                return shm.start(buf, kind=ALL_GATHER), None
            if self.gather_by_exchange:  # Gloo, 2 ranks: my chunk to the other, theirs into place
                rows = buf.view(self.world, n)
                peers = [j for j in range(self.world) if j != self.rank]
                return self.send_recv({j: mine for j in peers}, {j: rows[j] for j in peers}), None
            return all_gather_flat(buf, mine, self.group, async_op=True), None

    def mix(self, buf: torch.Tensor, out: torch.Tensor, matrix: torch.Tensor,
            pack: Callable[[], None] | None = None) -> Pending:
        """Launch gossip mixing: ``out`` := sum over ranks j of ``matrix[rank, j]`` x rank
        j's ``buf`` (summed in fp32 or wider), for a world x world mixing matrix that
        every rank passes whole. ``pack`` fills ``buf`` (the block this rank sends)
        first; ``out`` is as long as ``buf`` and apart from it (it may be another
        buffer of :meth:`buffer`, to be sent in a later round).

        Shared memory: each rank reads its row's sources straight from their regions; where
        ``out`` is a buffer of :meth:`buffer` too, the ranks whose rows are one mean split
        the sum, each writing its chunk into every one's ``out``.
        Process groups: a uniform matrix (every rank averages with every rank) on an
        fp32 ``buf`` is one averaging all-reduce (of a copy in ``out``: ``buf`` is never
        written); any other is point-to-point, ``buf`` sent to the ranks whose
        row uses it and received from those this rank's row uses (one receive buffer
        per peer, allocated on first use; Gloo moves only host memory, so device
        tensors are staged through it).
        """
        if out.shape != buf.shape:
            raise ValueError(f"mix's output must be as long as its input ({buf.numel()}), got {tuple(out.shape)}")
        if tuple(matrix.shape) != (self.world, self.world):
            raise ValueError(f"the mixing matrix must be {self.world} x {self.world}, got {tuple(matrix.shape)}")
        r = self.rank
        row, col, uniform, share = self.rows_of(matrix)
        shm = self.shm_of(buf)
        with span("fastreduce::mix"):
            if shm is not None:  # a clique's outputs, in whichever segment holds ``out`` (not always buf's)
                outs = self.everyones(out) if share else None
                return shm.start(buf, pack, kind=MIX, out=out, weights=tuple(row), share=share, outs=outs), None
            if pack is not None:
                with span("fastreduce::pack"):
                    pack()
            if out.dtype == buf.dtype and buf.dtype.itemsize >= 4 and uniform:
                plan = self.plan(buf.dtype)  # everyone averages with everyone: ``buf`` stays as sent
                out.copy_(buf)
                if plan.prescale:
                    out.div_(self.world)
                return dist.all_reduce(out, op=plan.op, group=self.group, async_op=True), None
            peers = [j for j in range(self.world) if j != r and row[j] != 0.0]
            # Gloo sends and receives host memory only: stage device tensors through it.
            host = torch.device("cpu") if self.pg_backend == "gloo" and buf.device.type != "cpu" else None
            send = buf if host is None else self._scratch_like(buf, "send_host", device=host).copy_(buf)
            recvs = [self._scratch_like(buf, f"recv{j}", device=host) for j in peers]
            work = self.send_recv({i: send for i in range(self.world) if i != r and col[i] != 0.0},
                                  dict(zip(peers, recvs)))
            acc = out if out.dtype.itemsize >= 4 else self._scratch_like(out, "mix_acc", torch.float32)
            tmp = None if buf.dtype == acc.dtype else self._scratch_like(buf, "mix_tmp", acc.dtype)
            ranks = sorted([r, *peers])  # summed in rank order, as on shared memory

            def combine() -> None:
                got = recvs if host is None else [self._scratch_like(buf, f"recv_dev{j}").copy_(t)
                                                  for j, t in zip(peers, recvs)]
                by_rank = {r: buf, **dict(zip(peers, got))}
                weighted_sum(out, acc, tmp, [row[j] for j in ranks], [by_rank[j] for j in ranks])
            return work, combine

    # ------------------------------------------------------------------ helpers

    def rows_of(self, matrix: torch.Tensor) -> tuple[list[float], list[float], bool, tuple[int, ...]]:
        """This rank's row and column of a mixing matrix, whether it is uniform, and the
        ranks this rank shares its mix with (below), read once per matrix (a topology
        hands out the same cached tensor every period).

        Sharing: when this rank's row is the plain mean of a set of ranks, each of which
        has that same row (every rank in ``complete``, the pairs of ``one-peer-exp``),
        those ranks compute one result: on shared memory they split it (each sums a
        chunk and writes it into every member's output). Otherwise ``()``."""
        key = id(matrix)
        got = self._rows.get(key)
        if got is None or got[0] is not matrix:
            if len(self._rows) >= 64:  # matrices made afresh per call: keep the cache small
                self._rows.clear()
            r = self.rank
            row = matrix[r].tolist()
            members = tuple(j for j, w in enumerate(row) if w != 0.0)
            share = members if all(row[j] == row[r] for j in members) and \
                all(matrix[j].tolist() == row for j in members) else ()
            got = self._rows[key] = (matrix, row, matrix[:, r].tolist(),
                                     bool((matrix == matrix[0, 0]).all()), share)
        return got[1], got[2], got[3], got[4]

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _chunk(self, buf: torch.Tensor) -> int:
        if buf.dim() != 1 or not buf.is_contiguous() or buf.numel() % self.world:
            raise ValueError(f"reduce-scatter and all-gather take a flat contiguous buffer that "
                             f"splits into {self.world} equal chunks; got {tuple(buf.shape)}")
        return buf.numel() // self.world

    def _scratch_like(self, buf: torch.Tensor, role: str, dtype: torch.dtype | None = None,
                      device: torch.device | None = None, numel: int | None = None) -> torch.Tensor:
        numel = buf.numel() if numel is None else numel
        key = (role, buf.data_ptr(), numel, dtype or buf.dtype)
        t = self._scratch.get(key)
        if t is None:
            t = self._scratch[key] = torch.empty(numel, dtype=dtype or buf.dtype, device=device or buf.device)
        return t

    def sum_rows(self, recv: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` := mean of the W rows of ``recv`` (chunk r from every rank), summed in
        fp32 (or wider) whatever the wire dtype, in :func:`~.shm.sum_order`: two
        roundings at any world size. ``out`` may be row r itself (it is added last)."""
        rows = recv.view(self.world, -1)
        wide = out.dtype.itemsize >= 4
        acc = out if wide else self._scratch_like(out, "acc", torch.float32)
        order = sum_order(self.rank, self.world)
        acc.copy_(rows[order[0]])
        tmp = None if rows.dtype == acc.dtype else self._scratch_like(out, "tmp", acc.dtype)
        for k in order[1:]:  # world-size ops, never per-parameter ones
            if tmp is None:
                acc.add_(rows[k])
            else:
                tmp.copy_(rows[k])
                acc.add_(tmp)
        acc.div_(divisor(self.world, acc))
        if acc is not out:
            out.copy_(acc)


def _mapped(message: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A message (a tensor, a tuple of them, ``None``) with ``fn`` applied to each tensor on a device."""
    if isinstance(message, tuple):
        return tuple(_mapped(t, fn) for t in message)
    return message if message is None or message.device.type == "cpu" else fn(message)


def _staged(t: torch.Tensor, back: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype)
    back.append((host, t))
    return host


class _AllWorks:
    """Several launched point-to-point operations, waited on as one; ``back``: host buffers
    received into, copied to their device tensors once every operation is done."""

    def __init__(self, works: list, back: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
        self.works, self.back = works, back or []

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> bool:
        """Every operation done (watched as one: Gloo's point-to-point work has no future)."""
        return wait_watched(self)

    def wait_unwatched(self) -> bool:
        for w in self.works:
            w.wait()
        for host, target in self.back:
            target.copy_(host)
        self.back = []
        return True


_comms: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def get_comm(group: dist.ProcessGroup | None, device: torch.device, transport: str | None = None) -> Comm:
    """The :class:`Comm` of ``group`` for ``device`` and ``transport`` (``None``:
    ``$FASTREDUCE_TRANSPORT``, else ``auto``), made on first use and then shared."""
    require_distributed()
    pg = group or dist.group.WORLD
    per_pg = _comms.setdefault(pg, {})
    key = (torch.device(device), resolve_transport(transport))
    comm = per_pg.get(key)
    if comm is None:
        comm = per_pg[key] = Comm(group, key[0], key[1])
    # After the transport's checks (a rank raises them alone, docs/design.md, invariant 11): the first touch of the store.
    start_heartbeat()  # so that a rank lost later can be named (fastreduce.faults)
    return comm
