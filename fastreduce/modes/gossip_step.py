"""How a :class:`~fastreduce.DecentralizedDataParallel` steps one bucket's optimizer: the
``GradScaler``'s unscale, step and update, clipping to ``grad_clip_norm``, the inf/NaN
check of ``nonfinite``, then the gradients zeroed and the bucket's scheduler stepped.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..grads import first_nonfinite, nonfinite_error
from ..torch_internals import at_backward_end, in_backward

__all__ = ["GossipStep"]

log = logging.getLogger("fastreduce.modes.gossip")


class GossipStep:
    """The optimizer step of :class:`~fastreduce.DecentralizedDataParallel`'s buckets (a
    mixin: it reads the mode's optimizers, schedulers, scaler and settings, and sets
    ``grad_norms``, ``skipped_steps`` and the error ``nonfinite="raise"`` raises)."""

    _scaler_stepped = False  # some bucket's scaler.step() since the scaler's last update()

    def _step_optimizer(self, b: int) -> None:
        opt = self._optims[b]
        params = [p for g in opt.param_groups for p in g["params"]]
        if self.scaler is not None:
            if any(p.grad is not None for p in params):  # none: skipped, as torch.optim skips a None grad
                if self.grad_clip_norm > 0:
                    self.scaler.unscale_(opt)
                    self.grad_norms[b] = torch.nn.utils.clip_grad_norm_(params, self.grad_clip_norm)
                self.scaler.step(opt)
                self._scaler_stepped = True
            if b == len(self._optims) - 1 and self._scaler_stepped:  # once per step, if a bucket stepped
                self._scaler_stepped = False
                self.scaler.update()
        elif self._finite(b, params):
            if self.grad_clip_norm > 0:
                self.grad_norms[b] = torch.nn.utils.clip_grad_norm_(params, self.grad_clip_norm)
            opt.step()
        opt.zero_grad(set_to_none=False)  # kept: freeing them costs a fresh allocation (page faults) in every backward
        if self._scheds[b] is not None:
            self._scheds[b].step()

    def _finite(self, b: int, params: list[nn.Parameter]) -> bool:
        """``nonfinite``: whether bucket ``b``'s gradients are finite (one fused check of
        them); if not, count it and, under ``raise``, arrange for the error."""
        if self.nonfinite == "ignore":
            return True
        grads = [p.grad for p in params if p.grad is not None]
        if not grads or self._check(grads):
            return True
        self.skipped_steps += 1
        if self.nonfinite == "skip":
            log.warning("fastreduce: DecentralizedDataParallel: rank %d's gradients hold inf or NaN; its step "
                        "of bucket %d is skipped (nonfinite='skip')", self.rank, b)
        elif self._nonfinite_error is None:
            names = [self._names[i] for i in self._buckets[b].slots]
            i = first_nonfinite([p.grad if p.grad is not None else p.detach()[:0] for p in params])
            self._nonfinite_error = nonfinite_error(
                f"rank {self.rank}'s gradients", None if i is None else names[i],
                "this rank skipped that bucket's optimizer step and sent its parameters as usual: the "
                "parameters and optimizer state are as before the step, and the other ranks go on.")
            if in_backward():  # raise as it ends
                at_backward_end(self._raise_nonfinite)
        return False

    def _raise_nonfinite(self) -> None:
        err, self._nonfinite_error = self._nonfinite_error, None
        if err is not None:
            raise err
