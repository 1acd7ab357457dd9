"""The settings of a :class:`~fastreduce.ZeroOptimizer`, checked when it is made (a bad
value fails here, naming the field, before anything is built), and its default bucket."""

from __future__ import annotations

import torch

from ..buckets import default_bucket_mb
from ..codecs.quant import BlockQuant, check_wire
from ..comm import Comm
from ..sizing import AUTO, MB, ZERO_SHM_BUCKET_MB, AutoSizer, Sizing, check_bucket_mb

__all__ = ["ELEMENTWISE_OPTIMIZERS", "check_settings", "trainable", "shared_memory_buckets", "zero_bucket_mb", "zero_buckets"]

ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, n) for n in ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam",
                                      "RAdam", "Adadelta", "Rprop", "ASGD") if hasattr(torch.optim, n))
"""Optimizers whose update of an element reads only that element's state: a shard can
step alone. Add a class here (or subclass one) to allow another such optimizer."""


def zero_bucket_mb(pg_backend: str) -> float:
    """ZeRO's default bucket: at least 25 MB. Each bucket costs a reduce-scatter and an
    all-gather with their barriers; measured on 2 CPU ranks (12M fp32 parameters,
    AdamW), 24 MB buckets stepped in 0.94x the fused reducer's time, 6 MB ones in 1.05x."""
    return max(25.0, default_bucket_mb(pg_backend))


def shared_memory_buckets(wire_bytes: int, views: bool = False) -> Sizing:
    """ZeRO's ``"auto"`` on shared memory. ``views`` (``module=`` given, its forward pre-hook
    registered): one bucket, as the overlapped mode's. Gradients that ``zero_grad()``
    (``set_to_none=True``: torch's default, the Trainer's) dropped come back as zeroed views
    of the flat buffer before each forward (:mod:`.zero_grads`), so backward accumulates into
    it whatever the zeroing and allocates no gradient, and one bucket pays one reduce-scatter
    and one all-gather. 2 ranks, 48 x (Linear 512 + LayerNorm) (50 MB), AdamW, ms per step,
    medians of three interleaved runs (``fastreduce bench optim --model blocks
    --zero-bucket-mb 1,2,8,64 [--set-to-none]``): with ``zero_grad()`` one bucket 53.7, 2 MB
    58.8, 8 MB 57.7; zeroed in place 52.2, 57.7, 54.4.

    Without ``views`` backward allocates those gradients afresh, and a bucket copies them
    into the wire and frees them at its launch: buckets of :data:`ZERO_SHM_BUCKET_MB`. In
    one bucket all of them lived until backward ended and were freed at once, which glibc's
    malloc hands back to the system, so each backward faulted them in again (12,000-13,000
    minor faults per rank and step on that model; 600-1,200 with the views): 69.3 ms in one
    bucket against 56.3 at 2 MB, before the views. A size, not a count: a model under 1.5
    buckets' bytes stays one bucket (a bucket is cut once it reaches the size)."""
    whole = max(wire_bytes / MB, 1e-6)
    if views:
        return Sizing(whole, whole, 1, "shared memory, module= given: gradients that zero_grad() set to None "
                      "are re-attached as views before each forward, so backward allocates none; one "
                      "bucket pays one reduce-scatter and one all-gather")
    n = max(1, round(whole / ZERO_SHM_BUCKET_MB))
    if n == 1:
        return Sizing(whole, whole, 1, f"shared memory: {whole:.1f} MB of gradients, under 1.5 buckets of "
                      f"{ZERO_SHM_BUCKET_MB:g} MB")
    return Sizing(ZERO_SHM_BUCKET_MB, ZERO_SHM_BUCKET_MB, n,
                  "shared memory: gradients that zero_grad() set to None are copied and freed per bucket "
                  "during backward, not all at its end (one bucket: every backward page-faulted them in again)")


def zero_buckets(bucket_mb: float | str | None, comm: Comm, named: list[tuple[str, torch.nn.Parameter]],
                 wire: torch.dtype, fixed: bool = False,
                 views: bool = False) -> tuple[float, float, float | None, Sizing | None]:
    """``(bucket MB, first bucket MB, MB to cut a compiled graph at or None, the choice)``.
    A number is kept. ``"auto"`` (``None``) is chosen here, when the optimizer is built
    (collective), as :mod:`fastreduce.sizing` does for the overlapped mode, with two
    differences: no backward has run yet, so it is taken to be as long as the gradients'
    communication (on a slow link that only matters little; on a fast one it keeps
    buckets small), and it is not refreshed, since the layout holds the optimizer's
    shards. On shared memory (a one-page probe segment tells) :func:`shared_memory_buckets`
    (``views``: dropped gradients come back as views before each forward); ``fixed`` (a quantized wire, whose per-rank
    residuals a checkpoint holds in this layout) and a world of one take
    :func:`zero_bucket_mb`."""
    if bucket_mb not in (None, AUTO):
        return float(bucket_mb), float(bucket_mb), float(bucket_mb), None
    wire_bytes = sum(p.numel() for _, p in named) * wire.itemsize
    if comm.world == 1 or fixed:
        mb = zero_bucket_mb(comm.pg_backend)
        return mb, mb, mb, None
    if comm.wants_shm:
        comm.buffer(1, torch.float32)  # collective: whether the ranks share /dev/shm
    sizing = shared_memory_buckets(wire_bytes, views) if comm.shms else \
        AutoSizer().build(False, wire_bytes, None, comm.group, comm.device)
    return sizing.bucket_mb, sizing.first_bucket_mb, sizing.bucket_mb if sizing.buckets > 1 else None, sizing


def check_settings(optimizer_class: type, wire_dtype: torch.dtype | str | None, accumulate_dtype: torch.dtype | None,
                   bucket_mb: float | None, error_feedback: bool, gather_dtype: torch.dtype | None) -> BlockQuant | None:
    """``ValueError``/``TypeError`` for a bad setting; the quantized wire's codec, if any."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
    if not issubclass(optimizer_class, ELEMENTWISE_OPTIMIZERS):
        raise ValueError(f"{optimizer_class.__name__} is not an element-wise optimizer: its update of "
                         "one element reads others (whole tensors, or all of them), so it cannot step "
                         "on a shard. ZeroOptimizer takes "
                         f"{', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)} or their subclasses "
                         "(add yours to fastreduce.modes.zero.ELEMENTWISE_OPTIMIZERS if it is element-wise)")
    codec = check_wire(wire_dtype, "ZeroOptimizer", error_feedback=error_feedback)
    if accumulate_dtype not in (None, torch.float32):
        raise ValueError(f"accumulate_dtype must be None or torch.float32, got {accumulate_dtype}")
    check_bucket_mb(bucket_mb)
    if gather_dtype is not None and not (isinstance(gather_dtype, torch.dtype) and gather_dtype.is_floating_point
                                         and gather_dtype.itemsize >= 2):
        raise ValueError(f"gather_dtype must be None, torch.bfloat16, torch.float16 or torch.float32 (the "
                         f"parameters' all-gather), got {gather_dtype!r}")
    return codec


def trainable(param_groups: list[dict], names: dict[int, str]) -> tuple[list[tuple[str, torch.nn.Parameter]], list[int]]:
    """The parameters that require grad, named (``names``: the module's, by id; else their
    place), and each one's param group. A parameter listed twice (tied weights listed once
    per module: torch.optim warns, then steps it twice) is refused here, on every rank
    alike, before any collective: a shard holds each parameter once."""
    named: list[tuple[str, torch.nn.Parameter]] = []
    group_of: list[int] = []
    seen: dict[int, str] = {}
    for g, pg in enumerate(param_groups):
        for k, p in enumerate(pg["params"]):
            if not p.requires_grad:
                continue
            where = f"param_groups[{g}][{k}]"
            if id(p) in seen:
                what = f"the parameter {names[id(p)]}" if id(p) in names else f"a parameter of shape {list(p.shape)}"
                raise ValueError(f"ZeroOptimizer was given {what} twice (as {seen[id(p)]} and {where}; tied "
                                 "weights listed once per module?): "
                                 "list each parameter once, e.g. list(dict.fromkeys(params)), or the "
                                 "parameters() of the module that holds both (torch.optim would step it twice)")
            seen[id(p)] = where
            named.append((names.get(id(p), where), p))
            group_of.append(g)
    return named, group_of
