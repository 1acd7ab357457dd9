"""What a :class:`~fastreduce.FusedReducer` learns on its first ``reduce()``: the layout
(in backward order where it overlaps), checked on every rank, the flat buffer and the wire,
the collective's plan, the captured pack and unpack, and the overlap's buckets.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from ..backends import Backend, select_backend
from ..buckets import OrderRecorder, OverlapSchedule, agreed_order, default_bucket_mb
from ..buffer import FusedBuffer
from ..comm import Comm, MeanPlan, get_comm
from ..comm.quantized import QuantMean, QuantMeans
from ..grads import Reattach, check_grads, missing_message
from ..layout import FrozenAtBuild, GradLayout, ParamsHeld, holding_dtype, verify_across_ranks
from ..torch_internals import compiled_inner
from .compressed import Compressed
from .fused_state import step_undo
from .overlap import bucket_segments, overlap_schedule
from .step_undo import StepUndo

__all__ = ["Built", "FusedBuild"]

log = logging.getLogger("fastreduce.modes.fused")


@dataclass(slots=True)
class Built:
    """Everything learned on the first call; replaced whole by :meth:`FusedReducer.rebuild`."""

    layout: GradLayout
    buffer: FusedBuffer
    comm: Comm
    plan: MeanPlan | QuantMean | QuantMeans
    backend: Backend
    pack: Callable[[], None] | None
    unpack: Callable[[], None] | None
    flags: torch.Tensor | None  # per-parameter "had a grad" counts, unused_grads="zero" only
    frozen: FrozenAtBuild = field(default_factory=lambda: FrozenAtBuild(()))
    held: ParamsHeld | None = None  # are the layout's parameters still the model's, on their storage?
    schedule: OverlapSchedule | None = None  # overlap mode only
    compressed: Compressed | None = None  # compression= only
    reattach: Reattach | None = None  # its forward pre-hook (and gradient hooks)
    undo: StepUndo | None = None  # nonfinite="raise"/"skip", with state kept between steps


class FusedBuild:
    """The first call of :class:`~fastreduce.FusedReducer` (a mixin: it reads the
    reducer's model, group, config, sizer and Join settings, and sets its recorder)."""

    def _record_order(self) -> None:
        """Overlap mode: learn the backward order (and time) on the first step, to lay
        buckets out in it (and size them). Not with a quantized wire: its blocks (what each
        rounding spans) follow the layout, so it takes the reverse model order, the same
        plain and compiled (whose backward hands over the gradients in another order)."""
        if self.config.overlap and self.world_size > 1:
            self._recorder = OrderRecorder([p for p in self.model.parameters() if p.requires_grad])

    def _check_alone(self) -> tuple[list, torch.device, Comm]:
        """The first reduce()'s checks a rank does alone, before the guard's heartbeat touches the store."""
        named = [(n, p) for n, p in self._named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("no parameter of the model requires grad: nothing to reduce")
        device = check_grads(named)
        return named, device, get_comm(self.group, device, self.config.transport)

    def _build(self, named: list, device: torch.device, comm: Comm) -> Built:
        cfg = self.config
        frozen = FrozenAtBuild(self.model.parameters())
        recorder, self._recorder = self._recorder, None
        backward_s = recorder.backward_s if recorder is not None else 0.0
        seen = recorder.remove() if recorder is not None else None
        if seen is not None and cfg.quant is None:  # lay the buffer out in backward order
            seen = recorder.among(seen, [p for _, p in named])  # (trainable now, maybe fewer than then)
            named = [named[i] for i in agreed_order(seen, len(named), self.group)]
        elif cfg.overlap and cfg.quant is not None:
            named = named[::-1]  # roughly the backward order (see _record_order)
        quant = cfg.quant  # a quantized wire: fp32 buffer, the codec runs in QuantMean
        wire_dtype = torch.float32 if quant else cfg.wire_dtype or holding_dtype(p.dtype for _, p in named)
        pg = dist.get_backend(self.group)
        comp = cfg.compression
        if comp is not None and not cfg.overlap:  # uncompressed first, then the matrices by shape
            named = sorted(named, key=lambda np: comp.order_key(np[1]))
        segments = bucket_segments(named, wire_dtype, self._fixed_mb or default_bucket_mb(pg), cfg.per_bucket,
                                   None if comp is None else comp.order_key)
        chunks = self.world_size * (quant.block if quant else 1)  # a bucket's equal chunks (of whole blocks)
        layout = GradLayout(named, first_dtype=wire_dtype, segments=segments,
                            pad_to=chunks if cfg.per_bucket and comp is None else 1)
        # Which grads are present goes into the check too: a parameter that got a grad on
        # one rank but not on another is caught here, on every rank, not as a hang.
        present = tuple(p.grad is not None for p in layout.params)
        verify_across_ranks(layout, self.group, device, present if cfg.unused_grads == "error" else None)
        if cfg.unused_grads == "error" and not all(present):
            raise RuntimeError(missing_message(layout, [i for i, ok in enumerate(present) if not ok]))
        pad = self.world_size * quant.block if quant else self.world_size if cfg.accumulate_dtype is not None else 1
        wire = comm.buffer(FusedBuffer.wire_numel(layout, pad), wire_dtype)
        buffer = FusedBuffer(layout, wire_dtype, device, pad, wire, cfg.error_feedback and not quant)
        plan = QuantMean(comm, wire, quant, cfg.error_feedback, gaps=buffer.gaps(wire)) \
            if quant and not cfg.overlap else comm.plan(wire_dtype, cfg.accumulate_dtype, wire)
        backend = select_backend(cfg.backend, device, cfg.use_graphs)
        sizing = self._sizer and self._sizer.build(bool(comm.shms), buffer.nbytes, backward_s, self.group, device)
        self.stats.sizing = sizing  # (overlap mode only: None in fused mode)
        if sizing is not None:
            self._cut_graphs(sizing)
        # one bucket for good (shm, or chosen again at the refresh): the fused step; not under Join (_join_check)
        overlap = cfg.overlap and (self.under_join or not (self._sizer and self._sizer.one_bucket))
        # Overlap mode packs and unpacks per bucket, eagerly: only the fused mode captures.
        pack, unpack = (None, None) if overlap else self._capture(backend, buffer, plan)
        flags = torch.zeros(len(layout), device=device) if cfg.unused_grads == "zero" else None
        built = Built(layout, buffer, comm, plan, backend, pack, unpack, flags, frozen,
                      held=ParamsHeld(layout, compiled_inner(self.model), whole=True))
        built.reattach = reattach = Reattach(layout, buffer, self.stats, grad_hooks=not overlap, held=built.held)
        if overlap:
            built.schedule, means = overlap_schedule(
                layout, buffer, comm, quant or plan, pg_backend=pg, per_segment=cfg.per_bucket,
                bucket_mb=sizing.bucket_mb if sizing else self._fixed_mb, first_mb=sizing and sizing.first_bucket_mb,
                opened=self._join_notify, adopt=lambda idx, direct: self._adopt(built, idx, direct),
                direct=not (plan.prescale or cfg.error_feedback or comp), on_grad=reattach.grad_ready,
                error_feedback=cfg.error_feedback)
            built.plan = means or plan
        if comp is not None:  # one group per bucket, or of every gradient
            built.compressed = Compressed(comp, layout, buffer, comm, backend, wire_dtype, built.schedule,
                                          self._join_notify, self._join_factor)
        if dist.get_rank(self.group) == 0:
            log.info("fastreduce: %s; wire %s (%.1f MB), %d ranks, %r, backend %s, %s%s",
                     layout.describe(), wire_dtype, buffer.nbytes / 2**20, self.world_size,
                     plan, backend.name, f"{len(built.schedule.buckets)} buckets in backward "
                     "order" if built.schedule else "one fused collective",
                     built.compressed and "; " + built.compressed.describe() or "")
            if self.stats.sizing is not None:
                log.info("fastreduce: %s", self.stats.sizing.describe())
        try:
            self._restore(built)  # residuals a checkpoint loaded before the layout existed
        except ValueError as err:  # it did not fit: unbuilt again, the state dropped
            built.reattach.remove()
            if built.schedule is not None:
                built.schedule.remove()
            self._record_order()
            raise ValueError(f"{err}. (The state was loaded before the first reduce(); it is dropped, "
                             "and this reduce() averaged nothing: the gradients are as they were.)") from err
        if cfg.nonfinite != "ignore":  # a skipped step's residuals and Q put back
            built.undo = step_undo(built)
        return built

    @staticmethod
    def _capture(backend: Backend, buffer: FusedBuffer, plan: MeanPlan):
        prescale_by = plan.world if plan.prescale else None
        needs_pack = bool(buffer.casts) or plan.prescale
        return (backend.capture(lambda: buffer.pack(prescale_by)) if needs_pack else None,
                backend.capture(buffer.unpack) if buffer.casts else None)
