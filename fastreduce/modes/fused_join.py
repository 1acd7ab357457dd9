"""A :class:`~fastreduce.FusedReducer` under torch's ``Join`` (uneven inputs): a rank out
of batches shadows the active ranks' collectives on zeros, their mean is scaled by world /
active, and every rank ends with the last joiner's parameters (as DDP does).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..comm import complete
from ..comm.quantized import QuantMean
from ..join import JoinableMode, sync_from_last_joiner

__all__ = ["FusedJoin"]


class FusedJoin(JoinableMode):
    """The Join half of :class:`~fastreduce.FusedReducer` (a mixin: it reads the reducer's
    ``config``, ``model``, ``group`` and ``_built``, and calls its ``rebuild()``)."""

    @staticmethod
    def _scale_grads(built: Any, factor: float) -> None:
        """Averaged over the group with joined ranks' zeros in it: x world / active."""
        if factor != 1.0:
            torch._foreach_mul_(built.buffer.flats, factor)

    def scale_grads(self, factor: float) -> None:
        """Multiply this step's averaged gradients by ``factor``: a mode over this reducer
        that runs its own Join count (LocalSGD's warm-up)."""
        if self._built is not None:
            self._scale_grads(self._built, factor)

    def _join_check(self) -> None:
        """Joinables communicate in the order listed, an overlapped reducer from backward: not as the fused step."""
        if self.config.overlap and self._built is not None and self._built.schedule is None:
            self.rebuild()  # (the next reduce() builds its schedule: see _build)

    @torch.no_grad()
    def _join_shadow(self) -> None:
        """A joined rank's reduce(): the same collectives on a zeroed wire buffer (its
        gradients are zeros from here on); nothing else (its optimizer does not step)."""
        built = self._built
        if built is None:
            raise RuntimeError("a rank joined before its first reduce(): under Join every rank must "
                               "reduce at least once (the first step learns the layout on every rank)")
        built.buffer.wire.zero_()
        built.buffer.zero_()
        path = built.compressed
        if path is not None and path.compressing:  # the active ranks' collectives, on zeros
            works = path.shadow()
        elif built.schedule is not None:
            works = [built.schedule.launch(b, True) for b in range(len(built.schedule.buckets))]
        elif isinstance(built.plan, QuantMean):
            works = [built.plan.start()]
        else:
            works = [built.comm.all_reduce(built.buffer.wire, built.plan)]
        if built.flags is not None:
            built.flags.zero_()
            works.append((dist.all_reduce(built.flags, group=self.group, async_op=True), None))
        for pending in works:
            complete(pending)
        if path is not None:
            path.end_shadow()
        if built.undo is not None:  # (what a later skipped step puts back)
            built.undo.keep()

    def _join_finish(self, is_last_joiner: bool) -> None:
        """Joined ranks did not step: every rank takes a last joiner's parameters and
        buffers (as DDP does), so all end alike."""
        sync_from_last_joiner([t.data for t in self.model.parameters()] + list(self.model.buffers()),
                              self.group, is_last_joiner)
