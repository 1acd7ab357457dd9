"""The settings of a :class:`~fastreduce.ZeroOptimizer`, checked when it is made (a bad
value fails here, naming the field, before anything is built), and its default bucket."""

from __future__ import annotations

import torch

from ..buckets import default_bucket_mb
from ..codecs.quant import BlockQuant, check_wire
from ..comm import Comm
from ..sizing import AUTO, MB, ZERO_SHM_BUCKET_MB, AutoSizer, Sizing, check_bucket_mb

__all__ = ["ELEMENTWISE_OPTIMIZERS", "check_settings", "shared_memory_buckets", "zero_bucket_mb", "zero_buckets"]

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


def shared_memory_buckets(wire_bytes: int) -> Sizing:
    """ZeRO's ``"auto"`` on shared memory: buckets of :data:`ZERO_SHM_BUCKET_MB`, for the gradients
    that ``zero_grad()`` (``set_to_none=True``: torch's default, the Trainer's) lets backward
    allocate afresh. A bucket copies them into the wire and frees them at its launch; in one
    bucket all of them live until backward ends and are freed at once, which glibc's malloc
    hands back to the system, so each backward faults them in again. 2 ranks, 48 x (Linear
    512 + LayerNorm) (50 MB), AdamW, ``zero_grad()``: 9,000 to 12,000 minor page faults per
    rank and step in one bucket or 4 and 8 MB ones, at most a few hundred at 0.5 to 2 MB;
    the step 69.3 ms in one bucket, 56.3 at 2 MB, the fastest (medians of three interleaved
    runs, ``fastreduce bench --suite optim --optim-model blocks --set-to-none --zero-bucket-mb
    ...``). Zeroed in place (nothing allocated) one bucket is the fastest, 52.1 ms against
    58.3 (the optim suite's model: 77.2 against 84.5): 2 MB is the size whose worse case of
    the two is least (1.12x the best against one bucket's 1.23x). A size, not a count: a
    model under 1.5 buckets' bytes stays one bucket (a bucket is cut once it reaches the size)."""
    whole = max(wire_bytes / MB, 1e-6)
    n = max(1, round(whole / ZERO_SHM_BUCKET_MB))
    if n == 1:
        return Sizing(whole, whole, 1, f"shared memory: {whole:.1f} MB of gradients, under 1.5 buckets of "
                      f"{ZERO_SHM_BUCKET_MB:g} MB")
    return Sizing(ZERO_SHM_BUCKET_MB, ZERO_SHM_BUCKET_MB, n,
                  "shared memory: gradients that zero_grad() set to None are copied and freed per bucket "
                  "during backward, not all at its end (one bucket: every backward page-faulted them in again)")


def zero_buckets(bucket_mb: float | str | None, comm: Comm, named: list[tuple[str, torch.nn.Parameter]],
                 wire: torch.dtype, fixed: bool = False) -> tuple[float, float, float | None, Sizing | None]:
    """``(bucket MB, first bucket MB, MB to cut a compiled graph at or None, the choice)``.
    A number is kept. ``"auto"`` (``None``) is chosen here, when the optimizer is built
    (collective), as :mod:`fastreduce.sizing` does for the overlapped mode, with two
    differences: no backward has run yet, so it is taken to be as long as the gradients'
    communication (on a slow link that only matters little; on a fast one it keeps
    buckets small), and it is not refreshed, since the layout holds the optimizer's
    shards. On shared memory (a one-page probe segment tells) :func:`shared_memory_buckets`,
    not the overlapped mode's one bucket; ``fixed`` (a quantized wire, whose per-rank
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
    sizing = shared_memory_buckets(wire_bytes) if comm.shms else \
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
