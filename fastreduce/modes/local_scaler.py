"""A ``torch.amp.GradScaler`` driving the inner optimizer of a local-update mode
(:class:`~fastreduce.modes.local.LocalUpdates`: LocalSGD, DiLoCo).

A scaler that finds an inf in a rank's gradients does not call that rank's
``optimizer.step()``, so the step hooks that count the steps and run the syncs would not
run there: that rank's count would fall behind, its syncs would pair with the other
ranks' later ones, and the first collective that does not line up would hang. So the
mode takes the protocol torch has for optimizers that handle the scale themselves (a
fused AdamW's): the scaler calls ``step()`` on every rank, every time, and hands it the
scale and its inf flag; a pre-hook unscales the gradients (this rank's own, in the
LocalSGD warm-up before they are averaged) and, where they hold an inf, the update is
skipped on that rank as ``nonfinite="skip"`` skips it: the step still counts and its
sync runs on every rank.
"""

from __future__ import annotations

from typing import Any

import torch

from ..grads import FiniteCheck
from ..hooks import on_step, remove_hooks
from ..torch_internals import scale_handed, scale_handed_back, scaler_always_steps

__all__ = ["LocalScaler"]


class LocalScaler:
    """The GradScaler half of :class:`~fastreduce.modes.local.LocalUpdates` (a mixin: it
    reads the mode's optimizer and device; :meth:`_check_step` reads its verdict)."""

    def _take_scaler_steps(self) -> None:
        """The optimizer marked, and the pre-hook that unscales: registered before the
        warm-up's average and the inf/NaN check, which run after it."""
        self._scaler_found: torch.Tensor | None = None  # this step's inf flag, where a scaler steps it
        self._scaler_handed: Any = None  # what the scaler set on the optimizer, until the step's post-hook
        self._scaler_check = FiniteCheck(self.device)
        self._scaler_unmark = scaler_always_steps(self.optimizer)
        self._scaler_hooks = on_step(self.optimizer, pre=self._unscale)

    def _unscale(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        """A scaler's step: the gradients unscaled by this rank's scale in one fused kernel
        per dtype, which also finds whether they hold an inf (after ``scaler.unscale_``,
        they are unscaled already and the scaler's flag says it)."""
        self._scaler_found = None
        self._scaler_handed = handed = scale_handed(optimizer)
        if handed is None:  # a plain step(), or a scaler that is disabled
            return
        grad_scale, found_inf = handed
        if grad_scale is None:
            self._scaler_found = found_inf
            return
        inv_scale = grad_scale.double().reciprocal().float().to(self.device)
        grads = []
        for p in (p for g in optimizer.param_groups for p in g["params"] if p.grad is not None):
            if p.grad.is_sparse:  # (an embedding's): coalesced, as the scaler does, and its values unscaled
                p.grad = p.grad.coalesce()
            grads.append(p.grad.values() if p.grad.is_sparse else p.grad)
        self._scaler_found = self._scaler_check.flag(grads, inv_scale)

    def _rechecked(self, grads: list[torch.Tensor]) -> None:
        """Where a scaler steps this warm-up step and the average ran after :meth:`_unscale`:
        the flag is the average's, the same on every rank (every rank skips alike)."""
        if self._scaler_found is not None:
            self._scaler_found = self._scaler_check.flag(grads)

    def _scaler_skips(self) -> bool:
        """Whether this step's scaler found an inf (one host sync, as the scaler's own step)."""
        found, self._scaler_found = self._scaler_found, None
        return found is not None and bool(found.item())

    def _scale_back(self) -> None:
        """What the scaler set on the optimizer, put back for it to take off (the post-hook)."""
        handed, self._scaler_handed = self._scaler_handed, None
        if handed is not None:
            scale_handed_back(self.optimizer, handed)

    def _release_scaler(self) -> None:
        """At close: the pre-hook off, and the optimizer's own mark back (a scaler then
        skips its step on an inf, as before the mode)."""
        remove_hooks(self._scaler_hooks)
        self._scaler_hooks = []
        self._scaler_unmark()
