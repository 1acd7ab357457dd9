"""Shared-memory all-reduce for CPU ranks on one host.

On CPU, Gloo moves every byte through loopback TCP: kernel copies, made by the same
cores that run backward (measured here: a 48 MB fp32 all-reduce between 2 ranks takes
about 28 ms over Gloo, 7 ms through shared memory). Ranks on one host can read each
other's wire buffers directly instead. Every rank's wire buffer is one region of a
single segment in ``/dev/shm``::

    segment  [ rank 0's wire | rank 1's wire | ... | rank W-1's wire ]

Averaging one slice of the wire (a bucket, or all of it), on rank ``r`` of ``W``::

    barrier A   every rank has packed its slice
    reduce      chunk r of my slice := mean over k of chunk r of rank k's slice
    push        chunk r of every other rank's slice := that mean
    barrier B   every chunk is averaged and pushed: each slice holds the result

Each rank does 1/W of the arithmetic and writes (W-1)/W of a slice into the others'
regions; no data goes through a socket. Chunk r of rank k's slice is only ever read
and then written by rank r, so after barrier B no rank touches another's region: the
owner may write its slice again (pack, backward) without a third barrier. Every
rank's result is bit-identical (each chunk is averaged once, by one rank), and it does
not depend on timing: chunk r is summed in the order of :func:`sum_order` (ranks r + 1,
r + 2, ..., r: a ring's), one rounding per addition (a bf16/fp16 wire in fp32), then
divided once by W (:func:`weighted_sum`). At W=2 that is
``fl(a + b) / 2``, what an averaging all-reduce over Gloo gives, bit for bit. The jobs run on one worker thread
per process group, so a launch from a backward hook returns at once and every rank
runs the jobs in launch order. The barriers are counters in the segment's first page
(x86-64; see :class:`FlagBarrier`), elsewhere one-element all-reduces on a Gloo
group of fastreduce's own.

The segment is unlinked as soon as every rank has mapped it, so nothing is left in
``/dev/shm`` when a rank dies. Ranks that cannot all open it (several hosts; separate
``/dev/shm``; too little space in it) fall back to the process group's all-reduce.
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import shutil
import struct
import threading
import uuid
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..faults import RankLostError, TransportError, broadcast_object_watched, group_timeout, wait_watched
from .shm_sync import LINE, FlagBarrier, channel_of, pid_namespace

__all__ = ["ALL_GATHER", "ALL_REDUCE", "MIX", "REDUCE_SCATTER", "ShmAllReduce", "ShmWork", "sum_order", "weighted_sum"]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PAGE = 4096
FLAG_BARRIERS = platform.machine().lower() in ("x86_64", "amd64")
"""Barriers through the segment (x86-64: total store order), else through Gloo."""
_ALIGN = 64  # chunk edges fall on multiples of 64 elements: no two ranks share a cache line
_PIECE = 1 << 16  # the sums' piece (elements): its sources and result stay in a core's L2


def _set_event() -> threading.Event:
    event = threading.Event()
    event.set()  # a job not yet started counts as done: nothing to wait for
    return event


ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, MIX = "all_reduce", "reduce_scatter", "all_gather", "mix"


@dataclass(slots=True, eq=False)
class ShmWork:
    """One slice's collective, queued on the worker; ``wait()`` like a ``dist.Work``.

    ``all_reduce``: chunk r averaged, then pushed into every rank's slice.
    ``reduce_scatter``: chunk r averaged into ``out`` (default: my own chunk), no push.
    ``all_gather``: every rank's chunk k copied from rank k's slice (``pulls``).
    ``mix``: ``out`` := sum over k of ``weights[k]`` x rank k's whole slice (``peers``
    holds every rank's slice, in rank order), summed in fp32.
    """

    own: torch.Tensor  # my chunk of my slice
    peers: tuple[torch.Tensor, ...]  # the same chunk of every other rank's slice (mix: every rank's slice)
    acc: torch.Tensor | None  # fp32 scratch when the wire dtype must not sum in place
    tmp: torch.Tensor | None
    barrier: Callable[[], None]  # waits until every rank has reached the same point
    kind: str = ALL_REDUCE
    out: torch.Tensor | None = None  # reduce_scatter: where my averaged chunk goes
    pulls: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()  # all_gather: (dst, src)
    weights: tuple[float, ...] = ()  # mix: this launch's weight for every rank's slice
    done: threading.Event = field(default_factory=_set_event)
    error: BaseException | None = None
    before: Callable[[], None] | None = None  # this launch's pack, run by the worker
    after: Callable[[], None] | None = None  # this launch's unpack, run by the worker
    order: tuple[torch.Tensor, ...] = ()  # all_reduce, reduce_scatter: my chunk of every rank's slice, in sum_order
    rank: int = 0
    share: tuple[int, ...] = ()  # mix: the ranks computing this launch's result together (a clique), or ()
    outs: tuple[torch.Tensor, ...] = ()  # mix: every rank's ``out`` (when it lies in the regions), or ()
    rider: tuple[tuple[torch.Tensor, ...], torch.Tensor] | None = None  # reduce_scatter: every rank's slot, the sum

    def wait(self) -> bool:
        self.done.wait()
        if self.error is not None:
            err, self.error = self.error, None
            if isinstance(err, RankLostError):
                raise err
            raise TransportError(f"fastreduce: the shared-memory {self.kind} failed: {err}") from err
        return True

    def reduce(self) -> None:
        """The work between the two barriers."""
        if self.kind == ALL_GATHER:
            for dst, src in self.pulls:
                dst.copy_(src)
            return
        if self.kind == MIX:
            self._mix()
            return
        # my chunk's mean over every rank's slice, summed in sum_order; all_reduce pushes it
        dst = self.own if self.out is None else self.out
        world = len(self.order)
        pair = world == 2 and dst.dtype == self.own.dtype != torch.float16  # fl(a + b) / 2 in the wire dtype
        acc = dst if pair or self.acc is None else self.acc
        _sum_and_push(dst, acc, self.tmp, (1.0 / world,) * world, self.order,
                      self.peers if self.kind == ALL_REDUCE else ())
        if self.rider is not None:
            slots, total = self.rider
            torch.sum(torch.stack(slots), 0, out=total)

    def _mix(self) -> None:
        out, acc, tmp = self.out, self.acc, self.tmp
        assert out is not None and acc is not None
        if not (len(self.share) > 1 and self.outs):
            weighted_sum(out, acc, tmp, self.weights, self.peers)
            return
        # A clique (every member's row is this same mean): each member computes its
        # chunk of the result and writes it into every member's output, 1/m of the work.
        b = _bounds(out.numel(), len(self.share))
        k = self.share.index(self.rank)
        part = slice(b[k], b[k + 1])
        mine = out[part]
        _sum_and_push(mine, mine if acc is out else acc[part], None if tmp is None else tmp[part],
                      self.weights, [src[part] for src in self.peers],
                      [self.outs[j][part] for j in self.share if j != self.rank])


def _riding(rank: int, before: Callable[[], None] | None, after: Callable[[], None] | None,
            mine: torch.Tensor, slots: Sequence[torch.Tensor]
            ) -> tuple[Callable[[], None], Callable[[], None], tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """:meth:`ShmAllReduce.start`'s ``before``, ``after`` and ``ShmWork.rider`` for a rider."""
    slot, total = slots[rank], torch.empty_like(slots[rank])

    def write() -> None:
        if before is not None:
            before()
        slot.copy_(mine)

    def read() -> None:
        slot.copy_(total)
        if after is not None:
            after()
    return write, read, (tuple(slots), total)


def sum_order(rank: int, world: int) -> list[int]:
    """The order in which every transport sums the ranks' copies of chunk ``rank`` of a
    buffer: ranks ``rank + 1``, ``rank + 2``, ..., ``rank`` (mod ``world``), the order a
    ring reduce-scatter adds them in on its way to the chunk's owner. One order for all,
    so a result does not depend on the transport (bit for bit); over two ranks it is
    ``fl(a + b)`` either way."""
    return [(rank + 1 + k) % world for k in range(world)]


def _sum_and_push(dst: torch.Tensor, acc: torch.Tensor, tmp: torch.Tensor | None, weights: Sequence[float],
                  sources: Sequence[torch.Tensor], pushes: Sequence[torch.Tensor]) -> None:
    """:func:`weighted_sum` of ``sources`` into ``dst``, then copied into each of
    ``pushes`` (all as long as ``dst``), a piece at a time: each piece is still in cache
    when it is scaled and pushed."""
    n = dst.numel()
    for a in range(0, n, _PIECE):
        z = min(a + _PIECE, n)
        piece = dst[a:z]
        weighted_sum(piece, piece if acc is dst else acc[a:z], None if tmp is None else tmp[a:z], weights,
                     [src[a:z] for src in sources])
        for p in pushes:
            p[a:z].copy_(piece)


def weighted_sum(out: torch.Tensor, acc: torch.Tensor, tmp: torch.Tensor | None,
                 weights: Sequence[float], sources: Sequence[torch.Tensor]) -> None:
    """``out`` := sum of ``weights[k] * sources[k]``, accumulated in ``acc`` (``out``
    itself when it is fp32 or wider) through ``tmp`` where a source's dtype differs (a
    mixed-dtype op would allocate a cast copy on CPU). Zero weights are skipped.

    One rounding per addition, in the order given (:func:`sum_order` for a mean of
    chunks, rank order for a mix: the result does not depend on timing or on which
    rank computes it). A mean, every nonzero weight 1/m
    (an average, and the row of every uniform gossip topology), is summed, then divided
    by m once: over two ranks ``fl(a + b) / 2``, bit for bit what an averaging
    all-reduce gives; other weights are multiply-adds. ``acc`` must not alias a
    source after the first two (the sum of the first two is written over it)."""
    terms = [(float(w), s) for w, s in zip(weights, sources) if w != 0.0]
    m = len(terms)

    def cast(src: torch.Tensor) -> torch.Tensor:
        if src.dtype == acc.dtype:
            return src
        assert tmp is not None
        return tmp.copy_(src)

    if all(abs(w * m - 1.0) < 1e-6 for w, _ in terms):
        if m >= 2 and terms[0][1].dtype == terms[1][1].dtype == acc.dtype:
            torch.add(terms[0][1], terms[1][1], out=acc)
            rest = terms[2:]
        else:
            acc.copy_(terms[0][1])
            rest = terms[1:]
        for _, src in rest:
            acc.add_(cast(src))
        if m & (m - 1) == 0:  # a power of two: its reciprocal is exact, and a multiply is cheaper
            if m > 1:
                acc.mul_(1.0 / m)
        else:
            acc.div_(m)
    else:
        for k, (w, src) in enumerate(terms):
            if k == 0:
                torch.mul(cast(src), w, out=acc)
            else:
                acc.add_(cast(src), alpha=w)
    if acc is not out:
        out.copy_(acc)


def _ceil(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _bounds(n: int, world: int) -> list[int]:
    """Chunk edges of an ``n``-element slice: W chunks of about n/W, cache-line aligned."""
    step = _ceil(_ceil(n, world) // world, _ALIGN)
    return [min(k * step, n) for k in range(world + 1)]


def _header_bytes(world: int) -> int:
    """The segment's head: one cache line of barrier count per rank, page-aligned."""
    return _ceil(world * LINE, PAGE)


def create_segment(size: int) -> tuple[str | None, str | None]:
    """Rank 0: a new, fully allocated segment file; (path, None) or (None, why not)."""
    if not os.path.isdir(SHM_DIR):
        return None, f"{SHM_DIR} does not exist"
    path = os.path.join(SHM_DIR, f"fastreduce-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as err:
        return None, f"cannot create {path}: {err.strerror}"
    try:
        os.posix_fallocate(fd, 0, size)  # ENOSPC now, not SIGBUS on first touch
    except OSError:
        os.unlink(path)
        free = shutil.disk_usage(SHM_DIR).free
        return None, (f"{SHM_DIR} has {free / 2**20:.0f} MB free but the shared-memory "
                      f"transport needs {size / 2**20:.0f} MB (in a container, raise --shm-size)")
    finally:
        os.close(fd)
    return path, None


class ShmAllReduce:
    """Averages slices of this rank's shared wire region across the group's ranks.

    Build it with :meth:`open` (collective), put the wire buffer in :meth:`region`,
    then :meth:`start` any contiguous slice of it on every rank in the same order.
    """

    def __init__(self, group: dist.ProcessGroup | None, segment: mmap.mmap, region_bytes: int):
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.channel = channel_of(group)
        header = _header_bytes(self.world)
        # One storage per region (each keeps the mapping alive): a tensor viewing this
        # rank's region, e.g. a parameter, saves with torch.save as that region alone.
        self.regions = [torch.frombuffer(segment, dtype=torch.uint8, count=region_bytes,
                                         offset=header + k * region_bytes) for k in range(self.world)]
        head = torch.frombuffer(segment, dtype=torch.uint8, count=header)
        self.barrier = (FlagBarrier(head, self.rank, self.world, group_timeout(group),
                                     dist.get_process_group_ranks(group or dist.group.WORLD))
                        if FLAG_BARRIERS else self.channel.gloo_barrier())
        self.region_bytes = region_bytes
        self.scratch: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # fp32 (or wider) sums
        self.works: dict[tuple[int, int, torch.dtype], ShmWork] = {}
        self.started = 0  # jobs queued so far

    @classmethod
    def open(cls, group: dist.ProcessGroup | None, nbytes: int, *,
             required: bool = False) -> ShmAllReduce | None:
        """Map one ``nbytes`` region per rank, or return ``None`` (with the reason
        logged once) when the ranks do not share a ``/dev/shm`` with room for it.

        Collective over ``group``. With ``required=True`` the reason is raised instead.
        """
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        region_bytes = _ceil(max(nbytes, 1), PAGE)
        size = _header_bytes(world) + region_bytes * world
        box: list[str | None] = list(create_segment(size)) if rank == 0 else [None, None]
        made = box[0] if rank == 0 else None
        try:  # (a peer lost before all have mapped it: rank 0 unlinks it all the same)
            path, why = broadcast_object_watched(box, dist.get_global_rank(group, 0) if group else 0, group)
            segment = None
            if path is not None:
                try:
                    fd = os.open(path, os.O_RDWR)
                    try:
                        segment = mmap.mmap(fd, size)
                    finally:
                        os.close(fd)
                    # who I am, for the barriers' check on exited ranks (FlagBarrier._check)
                    struct.pack_into("qq", segment, rank * LINE + 8, os.getpid(), pid_namespace())
                except OSError as err:
                    why = f"rank {rank} cannot map {path}: {err.strerror}"
            ok = torch.tensor([segment is not None], dtype=torch.int32)
            # (also: every rank has mapped it)
            wait_watched(dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group, async_op=True))
        finally:
            if made is not None:
                os.unlink(made)
        if not ok.item():
            why = why or "the ranks do not share one /dev/shm (several hosts?)"
            if required:
                raise RuntimeError(f"fastreduce: transport='shm' is not possible: {why}; "
                                   "use transport='auto' or 'process_group'")
            if rank == 0:
                log.info("fastreduce: shared-memory transport off (%s); using the process "
                         "group's all-reduce", why)
            return None
        return cls(group, segment, region_bytes)

    def region(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """This rank's region as ``numel`` elements of ``dtype`` (zeros when new)."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes > self.region_bytes:
            raise ValueError(f"{numel} x {dtype} needs {nbytes} bytes; the region has {self.region_bytes}")
        return self.regions[self.rank][:nbytes].view(dtype)

    def start(self, buf: torch.Tensor, before: Callable[[], None] | None = None,
              after: Callable[[], None] | None = None, *, kind: str = ALL_REDUCE,
              out: torch.Tensor | None = None, weights: tuple[float, ...] = (),
              share: tuple[int, ...] = (), outs: Sequence[torch.Tensor] | None = None,
              rider: tuple[torch.Tensor, Sequence[torch.Tensor]] | None = None) -> ShmWork:
        """Queue a collective on ``buf``, a contiguous slice of :meth:`region`.

        ``kind`` is ``all_reduce`` (average in place), ``reduce_scatter`` (this rank's
        chunk of the mean into ``out``, default: that chunk of ``buf``) or ``all_gather``
        (every rank's chunk of ``buf`` into ``out``, default ``buf`` itself), for these
        two ``buf`` must split into world-size equal chunks; or ``mix`` (``out``, as long
        as ``buf`` and apart from it, := the ``weights``-weighted sum of every rank's
        ``buf``; where ``share`` names the ranks whose rows are all this same mean and
        ``outs`` gives every rank's ``out`` in shared memory, in rank order (the
        :meth:`everyones` of the segment that holds ``out``, which may be another than
        ``buf``'s), those ranks split the work, each writing its chunk into every
        member's ``out``).
        ``before`` and ``after`` (e.g. the slice's pack and unpack) run on the worker
        too, right before and after the collective, off the caller's thread.
        ``rider`` = ``(mine, slots)`` (``reduce_scatter``): ``slots`` every rank's
        counterpart of a few fp32 counts in a region of this group's (:meth:`everyones`,
        mine at this rank's index), which ends holding the sum over ranks of every rank's
        ``mine``: written before barrier A, summed between A and B (into scratch: the
        others read my slot until B), put in my slot after B. No round of its own."""
        if not buf.is_contiguous():  # checked first: a strided view may share a slice's key
            raise ValueError("the buffer to average must be contiguous (a slice of "
                             "ShmAllReduce.region)")
        if getattr(self.barrier, "failed", False):  # a rank was lost: raise now, queue nothing
            self.barrier()
        key = (buf.data_ptr(), buf.numel(), buf.dtype, kind, None if out is None else out.data_ptr())
        work = self.works.get(key)
        if work is None:
            work = self.works[key] = self._plan(buf, kind, out)
        elif not work.done.is_set():
            raise RuntimeError("this slice is already being averaged; wait() for it before "
                               "starting it again")
        if rider is not None and (kind != REDUCE_SCATTER or len(rider[1]) != self.world):
            raise ValueError("a rider goes with a reduce_scatter, one slot per rank")
        work.done.clear()
        work.before, work.after, work.rider = before, after, None
        if rider is not None:
            work.before, work.after, work.rider = _riding(self.rank, before, after, *rider)
        if kind == MIX:
            if len(weights) != self.world:
                raise ValueError(f"mix needs one weight per rank ({self.world}), got {len(weights)}")
            work.weights = tuple(float(w) for w in weights)
            # per launch, never per plan: every member of a clique must agree to split it
            # (a plan made in a round without one would keep no outputs)
            split = bool(share) and self.rank in share and all(0 <= j < self.world for j in share) \
                and outs is not None and len(outs) == self.world
            work.share, work.outs = (share, tuple(outs)) if split else ((), ())
        self.started += 1
        self.channel.put(work)
        return work

    def everyones(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's counterpart of ``t`` (a contiguous slice of this rank's region):
        the same bytes of each rank's region, in rank order; ``None`` if ``t`` is not
        in the region. The ranks lay out their regions alike (the same buffers, taken
        in the same order)."""
        nbytes = t.numel() * t.element_size()
        at = t.data_ptr() - self.regions[self.rank].data_ptr()
        if at < 0 or at + nbytes > self.region_bytes or not t.is_contiguous():
            return None
        return [r[at:at + nbytes].view(t.dtype) for r in self.regions]

    def _plan(self, buf: torch.Tensor, kind: str, out: torch.Tensor | None) -> ShmWork:
        slices = self.everyones(buf)
        if slices is None:
            raise ValueError("the buffer to average is not a contiguous slice of this rank's "
                             "shared-memory region (ShmAllReduce.region)")
        if kind == MIX:
            return self._plan_mix(buf, slices, out)
        if kind == ALL_REDUCE:
            b = _bounds(buf.numel(), self.world)
        elif buf.numel() % self.world:
            raise ValueError(f"{kind} needs a buffer that splits into {self.world} equal chunks, "
                             f"got {buf.numel()} elements")
        else:
            b = [k * (buf.numel() // self.world) for k in range(self.world + 1)]
        r = self.rank
        own = slices[r][b[r]:b[r + 1]]
        peers = tuple(s[b[r]:b[r + 1]] for k, s in enumerate(slices) if k != r)
        if kind == ALL_GATHER:
            dst = slices[r] if out is None else out
            if dst.numel() != buf.numel() or not dst.is_contiguous():
                raise ValueError("all_gather's output must be contiguous and as long as its input")
            pulls = tuple((dst[b[k]:b[k + 1]], slices[k][b[k]:b[k + 1]])
                          for k in range(self.world) if k != r or out is not None)
            return ShmWork(own, (), None, None, self.barrier, kind, out, pulls)
        if out is not None and out.shape != own.shape:
            raise ValueError(f"reduce_scatter's output must hold {own.numel()} elements, got "
                             f"{tuple(out.shape)}")
        dst_dtype = buf.dtype if out is None else out.dtype
        pair = self.world == 2 and dst_dtype == buf.dtype != torch.float16  # summed in place (reduce)
        # the sum writes its first partial sum over the output: my own chunk (averaged in
        # place) must be one of the first two terms, or the sum goes to scratch
        clobbers = out is None and self.world > 2
        acc = tmp = None
        if not pair and (dst_dtype.itemsize < 4 or dst_dtype != buf.dtype or clobbers):
            wide = torch.promote_types(dst_dtype, torch.float32)
            if wide not in self.scratch:  # sized for the largest chunk of the region
                most = -(-self.region_bytes // (2 * self.world)) + _ALIGN
                self.scratch[wide] = (torch.empty(most, dtype=wide), torch.empty(most, dtype=wide))
            acc, tmp = (t[:own.numel()] for t in self.scratch[wide])
            if dst_dtype.itemsize >= 4 and not clobbers:
                acc = None  # summed in the output itself, through tmp
        order = tuple(slices[k][b[r]:b[r + 1]] for k in sum_order(r, self.world))
        return ShmWork(own, peers, acc, tmp, self.barrier, kind, out, order=order)

    def _plan_mix(self, buf: torch.Tensor, slices: list[torch.Tensor], out: torch.Tensor | None) -> ShmWork:
        start, end = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
        if out is None or out.shape != buf.shape or not out.is_contiguous() or \
                start < out.data_ptr() + out.numel() * out.element_size() and out.data_ptr() < end:
            raise ValueError("mix needs an output apart from its input, contiguous and as long as it")
        wide = out.dtype.itemsize >= 4
        acc = out if wide else torch.empty(buf.numel(), dtype=torch.float32, device=buf.device)
        tmp = None if buf.dtype == acc.dtype else torch.empty(buf.numel(), dtype=acc.dtype, device=buf.device)
        return ShmWork(slices[self.rank], tuple(slices), acc, tmp, self.barrier, MIX, out, rank=self.rank)
