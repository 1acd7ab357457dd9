"""The settings of a :class:`~fastreduce.ZeroOptimizer`, checked when it is made (a bad
value fails here, naming the field, before anything is built), and its default bucket."""

from __future__ import annotations

import torch

from ..buckets import default_bucket_mb
from ..codecs.quant import BlockQuant, check_wire

__all__ = ["ELEMENTWISE_OPTIMIZERS", "check_settings", "zero_bucket_mb"]

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
    if bucket_mb is not None and not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
    if gather_dtype is not None and not (isinstance(gather_dtype, torch.dtype) and gather_dtype.is_floating_point
                                         and gather_dtype.itemsize >= 2):
        raise ValueError(f"gather_dtype must be None, torch.bfloat16, torch.float16 or torch.float32 (the "
                         f"parameters' all-gather), got {gather_dtype!r}")
    return codec
