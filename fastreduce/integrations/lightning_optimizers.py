"""The configured optimizer under a mode of the Lightning strategy: its LR schedulers re-pointed
at the mode's optimizer where the mode replaces it (ZeRO), Lightning's clipping routed to the
mode's where the mode holds the gradients its own way, and a GradScaler's unscaling kept before
the clipping where the mode has the scaler always step its optimizer (LocalSGD, DiLoCo)."""

from __future__ import annotations

from functools import wraps
from typing import Any
from weakref import ref

import torch

from .modes import TrainerMode

__all__ = ["OptimizerMixin"]


class OptimizerMixin:
    """``FastReduceStrategy``'s optimizer and clipping helpers (before ``DDPStrategy`` in its bases)."""

    def _repoint_schedulers(self, old: torch.optim.Optimizer | None, new: torch.optim.Optimizer) -> None:
        """The LR schedulers of ``configure_optimizers`` drove ``old``: make them drive ``new``
        (the mode's twin, same param groups in the same order and hyperparameters)."""
        for config in self.lr_scheduler_configs:
            sched = config.scheduler
            if getattr(sched, "optimizer", None) is not old:
                continue
            if len(new.param_groups) != len(old.param_groups):  # type: ignore[union-attr]
                raise ValueError(f"FastReduceStrategy: fastreduce mode {self._mode.name!r} replaces the optimizer, "
                                 f"and the new one has {len(new.param_groups)} param groups where the configured "
                                 f"one has {len(old.param_groups)} (an empty group?), so the LR scheduler "  # type: ignore[union-attr]
                                 f"{type(sched).__name__} cannot drive it: drop the empty param groups")
            for theirs, ours in zip(old.param_groups, new.param_groups):  # type: ignore[union-attr]
                for key in ("lr", "initial_lr"):  # as the scheduler set them
                    if key in theirs:
                        ours[key] = theirs[key]
            sched.optimizer = new
            _track_step(sched, new)

    def _patch_clipping(self) -> None:
        """Route Lightning's norm clipping (``precision_plugin.clip_grad_by_norm``) to the
        mode's ``clip_grad_norm_`` where the mode holds the gradients its own way (ZeRO's
        global norm); clipping by value is refused there."""
        self._unpatch_clipping()
        mode, plugin = self._mode, self.precision_plugin
        if mode.scaler_steps and getattr(plugin, "scaler", None) is not None:
            _unscale_before_clipping(plugin)
            self._clip_patched = plugin
        if not mode.clips:
            return

        def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
            mode.clip_grad_norm_(float(clip_val), 2.0)

        def clip_grad_by_value(optimizer: Any, clip_val: float) -> None:
            raise ValueError(by_norm_only(mode))

        # Lightning (2.5.1, 2.6.6 tested) clips through the precision plugin, which the strategy
        # is given, not makes: its two methods are shadowed on this instance, and put back at teardown
        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]
        plugin.clip_grad_by_value = clip_grad_by_value  # type: ignore[method-assign]
        self._clip_patched = plugin

    def _unpatch_clipping(self) -> None:
        plugin, self._clip_patched = self._clip_patched, None
        if plugin is not None:
            for name in ("clip_grad_by_norm", "clip_grad_by_value", "optimizer_step", "clip_gradients"):
                plugin.__dict__.pop(name, None)


def _unscale_before_clipping(plugin: Any) -> None:
    """Lightning's ``MixedPrecision`` unscales the gradients after the closure (backward),
    before ``on_before_optimizer_step`` and clipping, unless the optimizer unscales itself
    (``_step_supports_amp_scaling``, a fused one's mark), where it refuses clipping. A local
    mode marks its inner optimizer so that the scaler always steps it, but a scaler that
    unscaled first is as good to it: both of the plugin's methods are shadowed on this
    instance to unscale as for any optimizer, in Lightning's own order (2.6.6 tested)."""
    from lightning.pytorch.plugins.precision import Precision

    cls, scaler = type(plugin), plugin.scaler

    def optimizer_step(optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        def closure_then_unscale() -> Any:
            result = closure()
            if result is not None or not model.automatic_optimization:  # (Lightning's: a backward ran)
                scaler.unscale_(optimizer)
            return result
        return cls.optimizer_step(plugin, optimizer, model, closure_then_unscale, **kwargs)

    def clip_gradients(optimizer: Any, *args: Any, **kwargs: Any) -> None:
        Precision.clip_gradients(plugin, optimizer, *args, **kwargs)  # (without the fused optimizer's refusal)

    plugin.optimizer_step = optimizer_step
    plugin.clip_gradients = clip_gradients


def by_norm_only(mode: TrainerMode) -> str:
    return (f"FastReduceStrategy: fastreduce mode {mode.name!r} clips the averaged gradients its own way (zero: "
            "their global norm over the shards; gossip: each bucket's norm in backward), by norm only: use "
            "gradient_clip_algorithm='norm'")


def _track_step(sched: Any, optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer.step`` (the mode's own optimizer: ZeroOptimizer) as torch's LR
    schedulers do when built over it, so the scheduler's first ``step()`` does not warn that
    the optimizer was replaced: torch (2.6 to 2.13 tested) has no public way to re-point a
    scheduler, and these two marks are its own (``torch.optim.lr_scheduler``)."""
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched") or not hasattr(step, "__func__"):
        return
    opt_ref, func = ref(optimizer), step.__func__

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = opt_ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return func.__get__(opt, opt.__class__)(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]
