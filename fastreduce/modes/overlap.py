"""The overlapped mode, ``FusedReducer(model, overlap=True)``: buckets in backward order,
each all-reduced as soon as its gradients are ready.

Communication pattern, per step::

    backward:  grad of p ready -> post-accumulate-grad hook: pending[bucket] -= 1
               bucket k complete and buckets < k launched -> pack k, start its all-reduce
    finish():  launch what is left (unused params, changed order), then per bucket in
               order: wait, unpack it (while later buckets are still on the wire)

Buckets are launched strictly in index order on every rank, so ranks always issue the
same collectives in the same sequence, whatever order their grads arrive in: a changed
backward order or a parameter without a grad only delays launches to ``finish()``,
never hangs. The first step learns the backward order (rank 0's, broadcast); the flat
buffer is laid out in that order, so each bucket is one contiguous slice of it.

The hooks, counters and in-order launches are :class:`~fastreduce.buckets.OverlapSchedule`
(ZeRO's and gossip's too); this module says what the overlapped reducer launches (an
averaging all-reduce per bucket) and how its buckets are cut. With fp32 accumulation
(``accumulate_dtype=torch.float32``) every bucket is a layout segment of its own, padded
to split into world-size chunks; its all-to-all starts from the hook and its fp32 sum
and gather are issued after the next bucket's launch (:class:`~fastreduce.comm.Comm`).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from ..buckets import Bucket, Launch, OverlapSchedule, default_bucket_mb, first_bucket_mb, make_buckets
from ..buffer import FusedBuffer
from ..codecs.quant import BlockQuant
from ..comm import Comm, MeanPlan, Pending
from ..comm.quantized import QuantMean, QuantMeans
from ..layout import GradLayout, bucket_runs

__all__ = ["all_reduce_launcher", "bucket_segments", "overlap_schedule", "quant_launcher"]


def bucket_segments(named: list[tuple[str, torch.nn.Parameter]], wire_dtype: torch.dtype, bucket_mb: float,
                    per_bucket: bool, order: Callable[[torch.nn.Parameter], tuple] | None = None
                    ) -> list[list[int]] | None:
    """The layout's segments: ``None`` (one per dtype, cut into buckets later) unless
    ``per_bucket``: the wire is summed in fp32, whose collectives split a buffer into
    world-size chunks, or compressed; then every bucket is a segment of its own (padded
    by the layout), its members sorted by ``order`` if given (a codec's grouping)."""
    if not per_bucket:
        return None
    runs = bucket_runs(named, [0] * len(named), int(bucket_mb * 2**20) // wire_dtype.itemsize)
    return runs if order is None else [sorted(run, key=lambda k: order(named[k][1])) for run in runs]


def all_reduce_launcher(comm: Comm, plan: MeanPlan, buckets: list[Bucket]) -> Launch:
    """Each bucket's launch: its pack (and divide, where the plan says so), an averaging
    all-reduce, and its unpack once done."""
    prescale_by = plan.world if plan.prescale else None
    packs = [None if b.flat is b.wire and prescale_by is None else partial(b.pack, prescale_by)
             for b in buckets]
    unpacks = [None if b.flat is b.wire else b.unpack for b in buckets]

    def launch(b: int, packed: bool) -> Pending:
        return comm.all_reduce(buckets[b].wire, plan, None if packed else packs[b], unpacks[b])

    return launch


def quant_launcher(comm: Comm, codec: BlockQuant, error_feedback: bool, buckets: list[Bucket],
                   buffer: FusedBuffer) -> tuple[Launch, QuantMeans]:
    """Each bucket's launch through a quantized wire (a :class:`QuantMean` per bucket,
    every bucket an fp32 segment of whole blocks per rank): its pack, encoding and
    exchange; then the previous bucket's sum and all-gather (its ``advance``), so that
    one bucket's sum runs while the next one's exchange is on the wire, in launch order
    on every rank. ``reduce()`` decodes each bucket and launches the last one's gather."""
    means = QuantMeans([QuantMean(comm, b.wire, codec, error_feedback, gaps=buffer.gaps(b.wire)) for b in buckets])
    packs = [None if b.flat is b.wire else b.pack for b in buckets]
    unpacks = [None if b.flat is b.wire else b.unpack for b in buckets]

    def launch(b: int, packed: bool) -> Pending:
        pending = means[b].start(None if packed else packs[b], unpacks[b], hold=True)
        if b:
            means[b - 1].advance()
        return pending

    return launch, means


def overlap_schedule(layout: GradLayout, buffer: FusedBuffer, comm: Comm, plan: MeanPlan | BlockQuant, *,
                     pg_backend: str, bucket_mb: float | None, per_segment: bool, opened: Callable[[], None],
                     adopt: Callable[[list[int], bool], tuple[list[int], bool]], direct: bool,
                     on_grad: Callable[[int], None], error_feedback: bool = False, first_mb: float | None = None
                     ) -> tuple[OverlapSchedule, QuantMeans | None]:
    """The reducer's buckets and the hooks that launch them; with a quantized wire
    (``plan`` a codec, ``error_feedback`` its setting) also its per-bucket means.
    ``bucket_mb`` is the user's size (``None``: the backend's, with a small first bucket
    where launches are cheap), ``first_mb`` the first bucket's if it differs; ``per_segment``: one bucket per layout segment (fp32
    accumulation, a quantized wire); ``opened`` runs
    as bucket 0 launches (the step's first collective: Join's notice); ``adopt``,
    ``direct`` and ``on_grad`` as :class:`~fastreduce.buckets.OverlapSchedule` takes them."""
    first = first_mb if first_mb is not None else \
        first_bucket_mb(pg_backend) if bucket_mb is None and not per_segment else None
    size = 2**62 if per_segment else int((bucket_mb or default_bucket_mb(pg_backend)) * 2**20)
    buckets = make_buckets(layout, buffer, size, first and int(first * 2**20))
    if isinstance(plan, BlockQuant):
        launch, means = quant_launcher(comm, plan, error_feedback, buckets, buffer)
    else:
        launch, means = all_reduce_launcher(comm, plan, buckets), None

    def launch_opened(b: int, packed: bool) -> Pending:
        if b == 0:  # buckets launch in order: bucket 0 opens the step's collectives
            opened()
        return launch(b, packed)

    schedule = OverlapSchedule(layout, buckets, launch_opened, adopt, direct=direct, on_grad=on_grad)
    return schedule, means
