"""What a :class:`~fastreduce.ZeroOptimizer` step does about inf/NaN gradients: its own
``nonfinite=`` check, and a ``torch.amp.GradScaler`` driving it (the half of the
optimizer that decides whether a step is skipped, a mixin).

A rank holds only its shard of the averaged gradients, so every verdict is one fused
check of the shard and a one-element MAX all-reduce of the flag: an inf/NaN in any
rank's gradient reaches only the chunk of the rank that owns it.
"""

from __future__ import annotations

import bisect
import logging

import torch
import torch.distributed as dist

from ..faults import all_reduce_watched
from ..grads import agree_first, nonfinite_error
from ..profiling import span
from ..torch_internals import scaler_found_inf, scaler_scale

__all__ = ["ZeroFinite"]

log = logging.getLogger("fastreduce.modes.zero")


class ZeroFinite:
    """The skip-or-step half of :class:`~fastreduce.ZeroOptimizer` (a mixin).

    It reads what the optimizer built: ``shards``, ``buckets``, ``layout``, ``group``,
    ``world_size``, ``rank``, ``device``, ``nonfinite``, ``scaler``, ``_check`` (the fused
    check); it owns ``skipped_steps`` and ``_found`` (this step's scaler verdict).
    """

    # ------------------------------------------------------------------ non-finite gradients

    def _nonfinite(self) -> bool:
        """``nonfinite``: True if this step must be skipped (the same on every rank).

        One fused check of this rank's shard of the averaged gradients (every bucket's
        chunk, one kernel per dtype), then a one-element MAX all-reduce of the flag: a
        rank sees only its shard, and an inf/NaN in any rank's gradient reaches only the
        chunk of the rank that owns it."""
        if self.nonfinite == "ignore" or self._found is not None:  # a scaler decided already
            return False
        with span("fastreduce::nonfinite_check"):
            if not self._shard_flag().item():
                return False
        if self.nonfinite == "skip":
            self.skipped_steps += 1
            log.warning("fastreduce: ZeroOptimizer: the averaged gradients hold inf or NaN; this step is "
                        "skipped on every rank (nonfinite='skip')")
            return True
        name = self._first_nonfinite()
        raise nonfinite_error("the averaged gradients", name, "some rank's gradient was not finite, or "
                              "overflowed the wire dtype; nothing was stepped: the parameters and optimizer "
                              "state are as before this step.")

    def _shard_flag(self, inv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """1.0 on every rank if any rank's shard of the averaged gradients holds inf/NaN:
        one fused check of this rank's shard (unscaling it by ``inv_scale`` in the same
        kernel, for a GradScaler), then a one-element MAX all-reduce. The flag is the
        check's persistent tensor: valid until the next check."""
        flag = self._check.flag([s.master.grad for s in self.shards], inv_scale)
        if self.world_size > 1:
            all_reduce_watched(flag, dist.ReduceOp.MAX, self.group)
        return flag

    def _first_nonfinite(self) -> str | None:
        """The first parameter (layout order) holding inf/NaN in any rank's shard: this
        rank's first, then :func:`~fastreduce.grads.agree_first` (the error path only)."""
        W, r = self.world_size, self.rank
        mine = None
        for s, b in zip(self.shards, self.buckets):
            bad = (~torch.isfinite(s.master.grad)).nonzero()
            if bad.numel():
                at = r * (s.params.numel() // W) + int(bad[0, 0])  # offset in the bucket's segment
                offsets = [self.layout.slots[i].offset for i in b.slots]
                mine = b.slots[max(bisect.bisect_right(offsets, at) - 1, 0)]
                break
        i = agree_first(mine, len(self.layout), self.group, self.device)
        return None if i is None else self.layout.names[i]

    # ------------------------------------------------------------------ GradScaler

    def _unscale_for_scaler(self) -> None:
        """Under a scaler: unscale the shard once per step and note whether any rank's
        shard holds an inf/NaN (one MAX all-reduce)."""
        scaler = self.scaler
        if scaler is None or self._found is not None or not scaler.is_enabled():
            return
        scale = scaler_scale(scaler)
        if scale is None:  # the scaler has not scaled a loss yet
            return
        self._found = self._shard_flag(scale.double().reciprocal().float().to(self.device))

    def _scaled(self) -> bool:
        """Handle a GradScaler driving this step; True if the step must be skipped."""
        driven = getattr(self, "found_inf", None) is not None
        if not driven:
            return False
        if self.scaler is None:
            raise RuntimeError("a GradScaler is stepping this ZeroOptimizer but was not given to it: "
                               "pass scaler=your_scaler to ZeroOptimizer, so that an inf on any "
                               "rank's shard skips the step on every rank")
        if getattr(self, "grad_scale", None) is None and self._found is None:
            raise RuntimeError("scaler.unscale_(optimizer) unscales the full local gradients while "
                               "ZeroOptimizer reduces them; do not call it: opt.clip_grad_norm_() "
                               "unscales the averaged shard itself when a scaler is given")
        self._unscale_for_scaler()
        found = self._found
        assert found is not None
        # GradScaler.update() reads the inf flags it recorded from this rank's local
        # gradients; every rank must see the same verdict, or the scales drift apart.
        for flag in scaler_found_inf(self.scaler, self):
            flag.copy_(found.reshape(flag.shape).to(flag.device))
        return bool(found.item())
