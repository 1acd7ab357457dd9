"""Inf/NaN in a local-update mode (:class:`~fastreduce.modes.local.LocalUpdates`:
LocalSGD, DiLoCo) under ``nonfinite="raise"`` or ``"skip"``, or found by a ``GradScaler``
(:mod:`.local_scaler`): an inner step skipped on the rank whose gradients hold one (every
rank in LocalSGD's warm-up), a sync skipped on every rank when the average holds one, the
parameters back at the last synced ones and the codecs' state (error-feedback residuals,
SparseLoCo's accumulator) as before it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..buffer import slot_view
from ..grads import FiniteCheck, NonFiniteGradError, first_nonfinite, nonfinite_error
from ..hooks import on_step
from .step_undo import StepUndo

__all__ = ["LocalNonFinite"]

log = logging.getLogger("fastreduce.modes.local")


class LocalNonFinite:
    """The inf/NaN half of :class:`~fastreduce.modes.local.LocalUpdates` (a mixin: it reads
    the mode's optimizer, parameters, fragments, wire, anchor and codecs)."""

    def _guard_steps(self) -> None:
        """``nonfinite``: hooks around the inner optimizer's step, registered after the
        mode's own. [Note: skipping an inner step] A pre-hook checks the gradients the
        step will use (in warm-up, the fused reducer's verdict on the average; else this
        rank's own, one fused kernel per dtype); to skip, it sets every gradient of the
        optimizer to ``None`` for the call (torch's optimizers then leave a parameter and
        its state alone) and :meth:`_on_step` puts them back, so every step hook still
        runs: the step counter advances and the syncs stay matched across ranks. A
        GradScaler's inf skips a step the same way, whatever ``nonfinite`` is (so the hooks
        are there under ``"ignore"`` too)."""
        self.skipped_steps = 0  # inner steps this rank skipped for inf/NaN gradients (nonfinite's or a scaler's)
        self.skipped_syncs = 0  # syncs every rank skipped for an inf/NaN average
        self._check = FiniteCheck(self.device)
        self._stash: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._step_error: NonFiniteGradError | None = None
        self._warm_verdict: bool | None = None  # LocalSGD's warm-up: the average's verdict
        self._nonfinite_hooks: list[Any] = on_step(self.optimizer, pre=self._check_step,
                                                   post=self._raise_step_error)
        # per fragment, what a sync changes besides the parameters (the quantized wire's
        # residuals, SparseLoCo's accumulator): put back after a sync that is skipped
        self._undo: list[StepUndo] = []
        if self.nonfinite != "ignore":
            state = [(self._quant_means[k].state_tensors() if self._quant_means else [])
                     + (self._sparse[k].state_tensors() if self._sparse else []) for k in range(len(self._frag_wire))]
            self._undo = [StepUndo(tensors, None, self.device) for tensors in state] if any(state) else []

    def _check_step(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        verdict, self._warm_verdict = self._warm_verdict, None
        scaler_skips = self._scaler_skips()
        local = verdict is None
        if local and self.nonfinite != "ignore":  # no communication in this step: this rank's verdict
            grads = [p.grad for _, p in self._named if p.grad is not None]
            verdict = not grads or self._check(grads)
        if verdict is None or verdict:
            if scaler_skips:  # the scaler's inf (nonfinite's check, if any, found none or does not run)
                self.skipped_steps += 1
                self._skip_update(optimizer)
            return
        self.skipped_steps += 1
        if local and self.nonfinite == "raise":
            i = first_nonfinite([p.grad if p.grad is not None else p.detach()[:0] for _, p in self._named])
            self._step_error = nonfinite_error(
                f"rank {self.rank}'s gradients", None if i is None else self._named[i][0],
                "no collective is involved in an inner step, so only this rank raises; it skipped the step "
                "(parameters and optimizer state as before it) and counted it, so the syncs stay matched.")
        elif self.nonfinite == "skip":
            log.warning("fastreduce: %s: rank %d's %s gradients hold inf or NaN; the inner step is skipped "
                        "(nonfinite='skip')", type(self).__name__, self.rank, "own" if local else "averaged")
        self._skip_update(optimizer)

    def _skip_update(self, optimizer: torch.optim.Optimizer) -> None:
        """This step's update skipped: every gradient ``None`` for the call (put back by
        :meth:`_unstash`), so torch's optimizers leave every parameter and its state alone."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self._stash = [(p, p.grad) for p in params]
        for p in params:  # the skip path only: torch's optimizers pass over a parameter with no grad
            p.grad = None

    def _unstash(self) -> None:
        stash, self._stash = self._stash, []
        for p, g in stash:
            p.grad = g

    def _raise_step_error(self, _optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        err, self._step_error = self._step_error, None
        if err is not None:
            raise err

    def _average_finite(self, k: int) -> bool:
        """``nonfinite``: whether fragment ``k``'s averaged pseudo-gradient (the wire) is
        finite; one fused check, and every rank holds the same average, so every rank
        decides alike with no collective. If not, the outer step is skipped: every
        rank's parameters of the fragment := the last synced ones (the anchor, the
        parameters the outer step would have updated), outer optimizer untouched, and
        the codec's state (error-feedback residuals, SparseLoCo's accumulator) as after
        the last sync that stood."""
        if self.nonfinite == "ignore":
            return True
        if self._check((self._frag_wire[k],)):
            if self._undo:
                self._undo[k].keep()
            return True
        if self._undo:
            self._undo[k].undo()
        self.skipped_syncs += 1
        for j in self._frag_segments[k]:
            self._flats[j].copy_(self._anchor[j], non_blocking=True)
        if self.nonfinite == "skip":
            log.warning("fastreduce: %s: the averaged pseudo-gradient holds inf or NaN; the sync is skipped "
                        "on every rank, which return to the last synced parameters (nonfinite='skip')",
                        type(self).__name__)
            return False
        slots = [(j, slot) for j in self._frag_segments[k] for slot in self.layout.segments[j].slots]
        i = first_nonfinite([slot_view(self._wire[j], slot) for j, slot in slots])
        raise nonfinite_error("the averaged pseudo-gradients (anchor - x)", None if i is None else slots[i][1].name,
                              "the sync is lost on every rank: the fragment's parameters are reset to the last "
                              "synced ones, the outer optimizer did not step, the codec's state is as before it.")
