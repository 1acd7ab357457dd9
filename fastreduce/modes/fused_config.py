"""The settings of a :class:`~fastreduce.FusedReducer` (:class:`ReducerConfig`), checked
when they are made: a bad value fails here, naming the field, before any collective."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..backends import BACKENDS
from ..codecs.powersgd import PowerSGD
from ..codecs.quant import BlockQuant, check_wire, wire_format
from ..comm import TRANSPORT_ENV, TRANSPORTS, Transport
from ..grads import NonFinite, check_nonfinite
from ..sizing import check_bucket_mb
from .compressed import check_compression

__all__ = ["ReducerConfig", "UnusedGrads"]

UnusedGrads = Literal["error", "zero"]


@dataclass(kw_only=True, slots=True, frozen=True)
class ReducerConfig:
    """Settings of a :class:`FusedReducer`."""

    wire_dtype: torch.dtype | str | None = torch.bfloat16
    """dtype sent over the network; ``None`` sends each gradient in its own dtype
    (mixed-dtype models then use the one that holds them all: the widest, float32 for
    fp16 with bf16, :func:`~fastreduce.layout.holding_dtype`). A quantized wire,
    ``torch.float8_e4m3fn``, ``torch.float8_e5m2`` or ``"int8"``, sends codes with one
    fp32 scale per block of 256 values; the sum is exact fp32 of the decoded values,
    the mean encoded once more (:mod:`fastreduce.comm.quantized`; overlapped: per
    bucket, each bucket padded to whole blocks per rank)."""
    use_graphs: bool = True
    """Record pack and unpack as device graphs where the device has them (CUDA; HPU
    in lazy mode); elsewhere ignored."""
    backend: str = "auto"
    """``auto`` (from the gradients' device), ``eager``, ``cuda``, ``hpu`` or
    ``checked`` (the graph-contract checker used in tests)."""
    unused_grads: UnusedGrads = "error"
    """A parameter that requires grad but has none after backward: ``error`` raises
    (freeze it, or choose ``zero``); ``zero`` counts it as a zero gradient, and a
    parameter no rank produced a gradient for keeps ``grad=None``, as DDP does with
    ``find_unused_parameters=True``."""
    accumulate_dtype: torch.dtype | None = None
    """``torch.float32`` sums a bf16/fp16 wire in fp32 (same bytes, two roundings at
    any world size, see :class:`~fastreduce.collectives.Fp32Accumulate`); ``None``
    lets the collective sum in the wire dtype. In overlap mode each bucket is laid out
    to split into world-size equal chunks and its sum and gather are issued after the
    next bucket's all-to-all (at the latest in ``reduce()``). The shared-memory
    transport sums in fp32 either way."""
    nonfinite: NonFinite = "ignore"
    """What a reduction whose averaged gradients hold inf or NaN does (one check of the
    wire buffer after the collective: a non-finite value on any rank reaches every
    rank's average, so every rank decides alike with no collective of its own):
    ``ignore`` (no check); ``raise`` (:class:`NonFiniteGradError` on every rank, naming
    the first such parameter); ``skip`` (:meth:`FusedReducer.reduce` returns ``False``
    on every rank, as ``GradScaler`` skips a step: do not step the optimizer)."""
    error_feedback: bool = False
    """With a wire narrower than the gradients (bf16/fp16 for fp32 grads): each rank
    adds what its last cast rounded away to the next step's gradients before casting
    (a persistent residual per gradient, fp32, one more model's worth of memory), so
    rounding errors cancel over steps instead of accumulating. The residual is per rank;
    :meth:`FusedReducer.state_dict` holds it, for ``fastreduce.checkpoint``."""
    overlap: bool = False
    """Reduce during backward: buckets in backward order, each launched from a
    gradient hook as soon as its last gradient is ready."""
    bucket_mb: float | str | None = "auto"
    """Bucket size on the wire in overlap mode (MB). ``"auto"`` (or ``None``): chosen on
    the first step from the link (a short probe of the group's all-reduce) and the
    backward's time, and once more from the backward times of the next steps
    (:mod:`fastreduce.sizing`); one bucket on shared memory, sent after backward as in the
    fused mode (so is one bucket chosen again over a process group). With a quantized or
    compressed wire or ``accumulate_dtype``, "auto" is the backend's size (6 MB on Gloo,
    25 on NCCL, 64 on HCCL)."""
    transport: Transport = field(default_factory=lambda: os.environ.get(TRANSPORT_ENV, "auto"))
    """How the wire buffer's bytes travel (default: ``$FASTREDUCE_TRANSPORT``, else
    ``auto``). ``process_group``: the group's all-reduce (HCCL, NCCL, Gloo). ``shm``:
    CPU ranks on one host average through a shared-memory segment
    (:mod:`fastreduce.comm.shm`; several times faster than Gloo's loopback TCP), and it is
    an error if they cannot. ``auto``: ``shm`` where it works, else the group."""

    compression: PowerSGD | None = None
    """``fastreduce.PowerSGD(...)``: send low-rank factors of the gradients' matrices, in
    ``wire_dtype``, two collectives per step or bucket (:mod:`.compressed`)."""

    @property
    def quant(self) -> BlockQuant | None:
        """The codec of a quantized ``wire_dtype``, else ``None``."""
        fmt = wire_format(self.wire_dtype)
        return None if fmt is None else BlockQuant(fmt)

    @property
    def per_bucket(self) -> bool:
        """Overlapped with a collective per bucket that is more than an all-reduce (fp32
        sums of a low-precision wire, a quantized or compressed wire): buckets of the
        backend's size for ``bucket_mb="auto"``."""
        return self.overlap and (self.accumulate_dtype is not None or self.compression is not None
                                 or self.quant is not None)

    def __post_init__(self) -> None:
        check_compression(self.compression, self.accumulate_dtype, self.error_feedback)
        if self.accumulate_dtype not in (None, torch.float32):
            raise ValueError(f"accumulate_dtype must be None or torch.float32, got {self.accumulate_dtype}")
        check_bucket_mb(self.bucket_mb)
        check_wire(self.wire_dtype, "FusedReducer", compression=self.compression)
        check_nonfinite(self.nonfinite)
        if self.unused_grads not in ("error", "zero"):
            raise ValueError(f"unused_grads must be 'error' or 'zero', got {self.unused_grads!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {self.transport!r} (argument or ${TRANSPORT_ENV}); "
                             f"choose one of {', '.join(TRANSPORTS)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
