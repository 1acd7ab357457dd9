"""A :class:`~fastreduce.ZeroOptimizer` under torch's ``Join`` (uneven inputs): a rank out
of batches shadows the others' step on zero gradients, as torch's ZeroRedundancyOptimizer
does.
"""

from __future__ import annotations

import torch

from ..join import JoinableMode

__all__ = ["ZeroJoin"]


class ZeroJoin(JoinableMode):
    """The Join half of :class:`~fastreduce.ZeroOptimizer` (a mixin: it reads the optimizer's
    scaler, layout, buffer and last clipping, and calls its ``step()``, ``clip_grad_norm_()``
    and ``_wait_gathers()``)."""

    def _join_check(self) -> None:
        if self.scaler is not None:
            raise ValueError("ZeroOptimizer with a GradScaler cannot run under Join: a joined rank "
                             "has no loss scale of the step to unscale with; train without the "
                             "scaler (bf16) or give every rank the same number of batches")

    def _join_shadow(self) -> None:
        """A joined rank's step: zero gradients into the reduce-scatter, its shard stepped
        with the average (and clipped if its last step was), the all-gather; as torch's
        ZeroRedundancyOptimizer does under Join. It uses no parameter itself."""
        with torch.no_grad():
            for p, v in zip(self.layout.params, self.buffer.views):
                p.grad = v
            self.buffer.zero_()
        self._shadowing = True
        try:
            if self._last_clip is not None:
                self.clip_grad_norm_(*self._last_clip)
            self.step()
        finally:
            self._shadowing = False
        self._wait_gathers()

    def _join_finish(self, is_last_joiner: bool) -> None:
        self._wait_gathers()  # every rank's parameters are the all-gathered ones: alike
