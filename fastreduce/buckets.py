"""Buckets in backward order, launched in order from gradient hooks: the mechanism under
the overlapped mode, ZeRO's reduce-scatters and gossip's per-bucket steps (as Megatron
splits buffer, bucket and bucket group).

:func:`make_buckets` cuts a layout's flat buffer into contiguous runs ordered by when
their last gradient arrives; :class:`OverlapSchedule` registers a post-accumulate-grad
hook per parameter, counts each bucket's gradients, and calls the mode's launch for
bucket k once it is complete and every bucket before it has launched. Launching strictly
in index order keeps every rank's sequence of collectives the same whatever order its
gradients arrive in: a parameter without a gradient, or a changed backward order, only
delays launches to ``finish()``, never hangs. :class:`OrderRecorder` and
:func:`agreed_order` learn the backward order on the first step (rank 0's, broadcast).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from .buffer import FusedBuffer, attached, cast_in
from .comm import Pending, complete
from .faults import broadcast_object_watched, guarded
from .hooks import on_grad_ready, remove_hooks
from .layout import GradLayout

__all__ = ["Bucket", "Launch", "OrderRecorder", "OverlapSchedule", "agreed_order", "default_bucket_mb",
           "first_bucket_mb", "make_buckets"]

log = logging.getLogger(__name__)


def default_bucket_mb(pg_backend: str) -> float:
    """Bucket size that pays on each backend: few large buckets where launches are dear."""
    return {"nccl": 25.0, "hccl": 64.0, "gloo": 6.0}.get(pg_backend, 16.0)


def first_bucket_mb(pg_backend: str) -> float | None:
    """A small first bucket starts communication early where launches are cheap (NCCL, as
    DDP does); on Gloo and HCCL a launch costs more than the head start (measured on Gloo:
    1 MB buckets were slower than 6 MB ones), so there the first bucket is like the rest."""
    return 1.0 if pg_backend == "nccl" else None


@dataclass(frozen=True, slots=True)
class Bucket:
    """A contiguous run of one dtype segment: ``slots`` (layout indices) and their buffers."""

    slots: tuple[int, ...]
    params: tuple[torch.nn.Parameter, ...]  # of ``slots``, for the per-launch identity check
    views: tuple[torch.Tensor, ...]
    flat: torch.Tensor  # grads' storage slice (same tensor as ``wire`` when no cast is needed)
    wire: torch.Tensor  # the slice of the wire buffer this bucket reduces
    residual: torch.Tensor | None = None  # error feedback: its slice of the segment's residual

    def pack(self, prescale_by: int | None = None) -> None:
        """Cast into the wire slice where the dtypes differ (with error feedback, see
        :func:`~fastreduce.buffer.cast_in`), then divide it by ``prescale_by`` if given
        (as :meth:`FusedBuffer.pack` does for the whole buffer)."""
        if self.flat is not self.wire:
            cast_in(self.wire, self.flat, self.residual)
        if prescale_by is not None:
            self.wire.div_(prescale_by)

    def unpack(self) -> None:
        self.flat.copy_(self.wire)


def make_buckets(layout: GradLayout, buffer: FusedBuffer, bucket_bytes: int,
                 first_bytes: int | None = None) -> list[Bucket]:
    """Cut each segment into runs of about ``bucket_bytes`` (one parameter at least);
    the run holding the earliest gradient of the backward is cut at ``first_bytes``.

    Buckets come ordered by when their last gradient arrives (``layout.position`` is
    the backward order), so in-order launches follow readiness across dtypes too.
    """
    elem = buffer.wire.element_size()
    buckets: list[tuple[int, Bucket]] = []  # (backward position of its last grad, bucket)
    first_index = 0
    for seg, flat, seg_wire, residual in zip(layout.segments, buffer.flats, buffer.wires, buffer.residuals):
        run: list[int] = []
        run_start = 0
        earliest = first_bytes is not None and layout.position[first_index] == 0
        for k in range(len(seg.slots)):
            end = seg.slots[k + 1].offset if k + 1 < len(seg.slots) else seg.numel
            run.append(first_index + k)
            limit = first_bytes if earliest else bucket_bytes
            if (end - run_start) * elem >= limit or k + 1 == len(seg.slots):
                earliest = False
                piece = flat[run_start:end]
                wire = piece if flat is seg_wire else seg_wire[run_start:end]
                ready = max(layout.position[i] for i in run)
                bucket = Bucket(tuple(run), tuple(layout.params[i] for i in run),
                                tuple(buffer.views[i] for i in run), piece, wire,
                                None if residual is None else residual[run_start:end])
                buckets.append((ready, bucket))
                run, run_start = [], end
        first_index += len(seg.slots)
    return [b for _, b in sorted(buckets, key=lambda t: t[0])]


class OrderRecorder:
    """First step only: notes the order in which parameters' grads become ready, and
    the seconds from the first to the last (``backward_s``: the backward's length)."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.order: list[int] = []
        self.times: list[float] = []
        self.handles = on_grad_ready(params, self._ready)

    def _ready(self, i: int) -> None:
        self.order.append(i)
        self.times.append(time.perf_counter())

    @property
    def backward_s(self) -> float:
        return self.times[-1] - self.times[0] if self.times else 0.0

    def remove(self) -> list[int]:
        remove_hooks(self.handles)
        seen, order = set(), []
        for i in self.order:  # a param fires once per backward; accumulation repeats it
            if i not in seen:
                seen.add(i)
                order.append(i)
        return order

    def among(self, order: list[int], params: list[torch.nn.Parameter]) -> list[int]:
        """``order`` (indices into the parameters recorded) as indices into ``params``: those
        trainable when the layout is learned, which may differ from those at construction
        (layers frozen since are left out; one unfrozen since was never seen)."""
        where = {id(p): k for k, p in enumerate(params)}
        return [where[id(self.params[i])] for i in order if id(self.params[i]) in where]


def agreed_order(order: list[int], n: int, group: dist.ProcessGroup | None) -> list[int]:
    """Rank 0's backward order (then the params it never saw, in model order), on every rank."""
    theirs = broadcast_object_watched(order, dist.get_global_rank(group, 0) if group else 0, group)
    order = [i for i in theirs if i < n]  # (rank 0 holding more: the layout check says so next)
    seen = set(order)
    return order + [i for i in range(n) if i not in seen]


Launch = Callable[[int, bool], Pending]
"""``launch(b, packed)`` starts bucket ``b``'s collective; ``packed``: its wire slice
already holds the gradients (they were cast straight in), so skip its pack."""


class OverlapSchedule:
    """Hooks, counters and in-flight collectives of a bucketed mode (overlapped, ZeRO).

    Args:
        layout: the layout (in backward order) whose parameters get the hooks.
        buckets: from :func:`make_buckets`.
        launch: starts one bucket's collective (:data:`Launch`).
        adopt: ``adopt(indices, direct) -> (missing, direct)`` brings re-allocated
            grads of those layout indices into the buffer (straight into the wire, and
            says so, where ``direct`` allows it) and returns the ones with no grad.
        direct: whether fresh grads may be cast straight into the wire (not where the
            pack must also divide).
        on_grad: also called with every gradient's index as it is accumulated, synced
            or not (the fused reducer's re-attach of freed gradients).
        version: where given, read at the first gradient after each :meth:`finish` (into
            ``first_version``): the gradient buffer's in-place writes, one of them that
            gradient's accumulation, or ``None`` (ZeRO tells whether a ``zero_grad()`` came before).

    Before :meth:`finish`, ``next`` counts the buckets started from hooks this step.
    """

    def __init__(self, layout: GradLayout, buckets: list[Bucket], launch: Launch,
                 adopt: Callable[[list[int], bool], tuple[list[int], bool]], direct: bool = True,
                 on_grad: Callable[[int], None] | None = None, version: Callable[[], int | None] | None = None):
        self.layout, self.buckets, self.launch, self.adopt = layout, buckets, launch, adopt
        self.on_grad, self.version = on_grad, version
        self.first_version: int | None = None
        self.direct = direct
        self.bucket_of = [0] * len(layout)
        for b, bucket in enumerate(buckets):
            for i in bucket.slots:
                self.bucket_of[i] = b
        self.sizes = [len(b.slots) for b in buckets]
        self.sync = True
        self.late = False  # some bucket had to wait for finish(): logged once
        self.backward_s: list[float] = []  # per synced step: first to last gradient (fastreduce.sizing)
        self._reset()
        self.handles = on_grad_ready(layout.params, self._ready)

    def _reset(self) -> None:
        self.pending = list(self.sizes)
        self.fired = [False] * len(self.layout)
        self.next = 0
        self.works: list[Pending] = []
        self.missing: list[int] = []
        self.failure: RuntimeError | None = None  # a launch in backward failed: raised by finish()
        self._first_grad = self._last_grad = 0.0
        self._touched = False  # a gradient accumulated since (under no_sync too)

    def remove(self) -> None:
        remove_hooks(self.handles)

    @property
    def got_grads(self) -> bool:
        """Whether a gradient was accumulated (synced or not) since the last :meth:`finish`."""
        return self._touched

    # -- hot path: one call per parameter per backward
    def _ready(self, i: int) -> None:
        if not self._touched:
            self._touched = True
            if self.version is not None:
                self.first_version = self.version()
        if self.on_grad is not None:
            self.on_grad(i)
        if not self.sync:
            return
        self._last_grad = time.perf_counter()
        if not self._first_grad:
            self._first_grad = self._last_grad
        if self.fired[i]:
            raise RuntimeError(f"parameter {self.layout.names[i]!r} got a second gradient in one "
                               "step while its bucket was already being reduced; run every "
                               "backward but the last of an accumulation under the mode's no_sync() "
                               "(reducer.no_sync(), or opt.no_sync() of a ZeroOptimizer)")
        self.fired[i] = True
        b = self.bucket_of[i]
        self.pending[b] -= 1
        if self.pending[b] == 0 and b == self.next:
            self._launch_ready()

    def _launch_ready(self) -> None:
        if self.failure is not None:
            return
        try:
            while self.next < len(self.buckets) and self.pending[self.next] == 0:
                self._launch(self.next)
        except RuntimeError as err:  # (a peer lost): raised by finish(), which the step calls, not out of
            self.failure = err  # the user's backward (under a Membership, its commit discards the step)

    @guarded("a bucket's launch in backward", "This step's gradients are lost (some buckets were "
             "launched, others not); the parameters and optimizer state are as before the step.")
    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        packed = False
        if not attached(bucket.params, bucket.views):
            missing, packed = self.adopt(list(bucket.slots), self.direct)
            self.missing += missing
        self.works.append(self.launch(b, packed))
        self.next = b + 1

    def drop(self) -> None:
        """Drop this step: what backward launched is waited for, not unpacked (the gradients
        stay as they were), and the schedule is ready for the next backward."""
        works = self.works
        self._reset()
        for work, _ in works:
            complete((work, None))

    def finish(self, quiet: bool = False) -> tuple[list[int], list[Pending]]:
        """Launch the buckets still waiting, in order; return the missing grads and, per
        bucket, its collective and what to run once it is done (its unpack). A launch that
        failed in backward is raised here, the step dropped."""
        if self.failure is not None:  # what was launched before it is not waited for: on the group that
            failure = self.failure  # failed, a receive from a peer that left it waits for the group's timeout
            self._reset()
            raise failure
        if self.next < len(self.buckets):
            if not (self.late or quiet):
                self.late = True
                log.info("fastreduce: %d of %d buckets were launched at finish(), not during "
                         "backward (unused parameters or a changed backward order); results "
                         "are complete, overlap is lost for them", len(self.buckets) - self.next,
                         len(self.buckets))
            try:
                while self.next < len(self.buckets):
                    self._launch(self.next)
            except BaseException:  # (a gradient missing: every rank alike) the step is dropped
                self.drop()
                raise
        missing, works = self.missing, self.works
        if self._first_grad and len(self.backward_s) < 64:
            self.backward_s.append(self._last_grad - self._first_grad)
        self._reset()
        return missing, works
