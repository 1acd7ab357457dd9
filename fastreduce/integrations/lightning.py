"""Lightning: ``Trainer(strategy=FastReduceStrategy(...))``, a fastreduce mode instead of DDP.

    from fastreduce.integrations.lightning import FastReduceStrategy

    trainer = lightning.pytorch.Trainer(
        accelerator="cpu", devices=2, accumulate_grad_batches=4, gradient_clip_val=1.0,
        strategy=FastReduceStrategy(wire_dtype=torch.bfloat16, overlap=True))
    trainer.fit(module, datamodule)

(or ``strategy="fastreduce"``, ``"fastreduce_overlap"``, ``"fastreduce_zero"``,
``"fastreduce_localsgd"``, ``"fastreduce_diloco"``, ``"fastreduce_gossip"``, the mode with its
default settings, once ``fastreduce`` is imported, before or after ``lightning``:
:mod:`.lightning_names`). ``FastReduceStrategy(mode=...)`` runs any mode of
:mod:`fastreduce.integrations.modes` (``fused``, ``overlap``, ``zero``, ``localsgd``,
``diloco``, ``gossip``) over the LightningModule and the optimizer of
``configure_optimizers``. The strategy is Lightning's
``DDPStrategy`` (same launchers, process group, samplers, ``barrier``, ``broadcast``,
``reduce``, checkpoint files) except for the gradients: the LightningModule is not
wrapped in ``DistributedDataParallel`` (gossip wraps it in its own
:class:`~fastreduce.DecentralizedDataParallel`, through which Lightning then runs each
``training_step`` as it does through DDP); rank 0's parameters and buffers are broadcast
once when fitting starts, and the mode does the rest through Lightning's hooks:
:meth:`~FastReduceStrategy.post_backward` (right after each ``backward`` and before
``on_before_optimizer_step``, gradient clipping and the optimizer step) is the mode's
``after_backward`` (the fused modes average the gradients there); backward on the
non-final micro-batches of gradient accumulation runs inside
:meth:`~FastReduceStrategy.block_backward_sync`, the mode's ``no_sync()``. DDP's own
communication hooks are registered on CUDA only, so on CPU and HPU this is the way to
plug in a custom reducer.

Lightning is imported at the top of this module: import it only where ``lightning``
is installed (``pip install fastreduce[lightning]``); ``import fastreduce`` never
imports it.
"""

from __future__ import annotations

import contextlib
import logging
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn

from ..comm import broadcast_from_rank0
from ..compat import preserve_version_counters
from ..lifecycle import shutdown
from ..modes.fused import FusedReducer, ReducerConfig
from ..torch_internals import ddp_ignored_names, sync_params_and_buffers
from .lightning_checkpoints import CheckpointMixin
from .lightning_membership import MembershipMixin, set_global_step
from .lightning_optimizers import OptimizerMixin, by_norm_only
from .membership import ModeModule, TrainerMembership, check_plain_process
from ..modes.contract import commit_style, optimizer_role
from .modes import MODES, TrainerMode, make_mode

__all__ = ["FastReduceStrategy"]

log = logging.getLogger(__name__)

_SETTINGS = frozenset(s for m in MODES.values() for s in m.settings()) | {"overlap"}  # every mode's
_BROADCAST_BUCKET_BYTES = 250 * 2**20  # DDP's buffer broadcast buckets
_DDP_ARGS = frozenset({"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
                       "precision_plugin", "process_group_backend", "timeout", "start_method"})
# DDP constructor arguments that have no meaning here: what to use instead.
_DDP_ONLY = {
    "ddp_comm_state": "fastreduce replaces DDP's communication hooks; pass fastreduce's settings "
                      "(wire_dtype, overlap, ...) instead",
    "ddp_comm_hook": "fastreduce replaces DDP's communication hooks; pass fastreduce's settings "
                     "(wire_dtype, overlap, ...) instead",
    "ddp_comm_wrapper": "fastreduce replaces DDP's communication hooks; pass wire_dtype instead",
    "model_averaging_period": "for periodic model averaging use mode='localsgd' (sync_every=...)",
    "bucket_cap_mb": "use bucket_mb (overlap=True)",
    "device_ids": "Lightning picks the device",
    "output_device": "Lightning picks the device",
    "process_group": "the strategy reduces over the world group (a mode's own group: group=...)",
}


class FastReduceStrategy(MembershipMixin, CheckpointMixin, OptimizerMixin, DDPStrategy):
    """Lightning's ``DDPStrategy`` with a fastreduce mode in place of DDP.

    Args:
        mode: ``"fused"``, ``"overlap"``, ``"zero"``, ``"localsgd"``, ``"diloco"`` or ``"gossip"``
            (:mod:`fastreduce.integrations.modes`); ``None`` (default): ``"fused"``, or
            ``"overlap"`` where ``overlap=True`` is passed.
        eval_params: ``"mean"`` (default) or ``"own"``: what validation under ``fit`` sees in
            a mode whose ranks hold their own parameters (:mod:`~fastreduce.integrations.modes`).
        **kwargs: the mode's settings, the keyword arguments of its class
            (:class:`fastreduce.FusedReducer`'s :class:`fastreduce.ReducerConfig` fields:
            ``wire_dtype`` (default ``torch.bfloat16``; ``torch.float32`` for an exact
            average), ``bucket_mb``, ``unused_grads``, ...; :class:`fastreduce.ZeroOptimizer`'s,
            :class:`fastreduce.LocalSGD`'s (``sync_every``, ...), :class:`fastreduce.DiLoCo`'s),
            checked here: an unknown mode raises ``ValueError``, a setting the mode does not
            take ``TypeError``, a bad value the mode's own error. Every other keyword goes to
            ``DDPStrategy`` (``accelerator``, ``parallel_devices``, ``cluster_environment``,
            ``checkpoint_io``, ``precision_plugin``, ``process_group_backend``, ``timeout``,
            ``start_method``). Of DDP's own arguments these keep their meaning:
            ``find_unused_parameters=True`` is ``unused_grads="zero"`` (modes that take
            ``unused_grads``; refused by the others); ``broadcast_buffers`` (default
            ``True``) broadcasts rank 0's buffers before a training forward exactly when
            DDP would. ``static_graph`` and ``gradient_as_bucket_view`` are accepted and
            ignored; the others (``ddp_comm_hook``, ``bucket_cap_mb``, ...) raise
            ``TypeError`` naming what to use instead.

    The mode is built when fitting starts, after ``configure_optimizers`` and before the
    first backward: :attr:`mode` (a :class:`~fastreduce.integrations.modes.TrainerMode`;
    ``mode.obj`` the mode object, e.g. ``trainer.strategy.mode.obj.stats``), readable
    after ``fit`` returns; :attr:`reducer` is the :class:`~fastreduce.FusedReducer` in the
    fused modes. ``zero`` replaces the optimizer (``trainer.optimizers``) by its sharded
    twin and re-points the LR schedulers of ``configure_optimizers`` at it; norm clipping
    (``gradient_clip_val``) is then ZeRO's global norm. ``gossip`` steps one optimizer per
    bucket in backward, built like the configured one and at the lr its schedulers set,
    clipped per bucket at ``gradient_clip_val`` (one bucket by default: the whole
    gradient); ``trainer.optimizers`` then holds an optimizer whose step only runs
    Lightning's closure. ``zero`` and ``gossip`` clip by norm only. Modes other than fused
    and overlap take one optimizer. Checkpoints (``ModelCheckpoint``,
    ``trainer.save_checkpoint``) also save the mode's whole state, per rank, in the
    folder ``<checkpoint>.fastreduce`` beside the file, and ``fit(ckpt_path=...)``
    resumes it; in ``localsgd``, ``diloco`` and ``gossip`` (ranks hold their own
    parameters) the checkpoint's ``state_dict`` and validation under ``fit`` see the
    ranks' exact mean (``eval_params="own"``: validation sees each rank's own, with no
    communication; refused in the other modes). Every ``log_every_n_steps`` the mode's figures (``fastreduce/...``) are
    logged (``trainer.logged_metrics``, ``callback_metrics``, the logger).
    Validation, test and predict runs outside ``fit`` build no mode; they broadcast
    rank 0's parameters and buffers once, as ``DDPStrategy`` does.

    Example::

        >>> from fastreduce.integrations.lightning import FastReduceStrategy
        >>> trainer = Trainer(accelerator="cpu", devices=2, accumulate_grad_batches=2,
        ...                   strategy=FastReduceStrategy("zero", wire_dtype=torch.bfloat16))
    """

    strategy_name = "fastreduce"

    def __init__(self, mode: str | None = None, eval_params: str = "mean", membership: Any = None,
                 **kwargs: Any) -> None:
        bad = sorted(k for k in kwargs if k in _DDP_ONLY)
        if bad:
            raise TypeError(f"FastReduceStrategy does not take {bad[0]!r}: {_DDP_ONLY[bad[0]]}")
        unknown = sorted(set(kwargs) - _DDP_ARGS - _SETTINGS - {"find_unused_parameters", "broadcast_buffers",
                                                                  "static_graph", "gradient_as_bucket_view"})
        if unknown:
            raise TypeError(f"FastReduceStrategy got unexpected keyword argument(s) {unknown}: "
                            f"neither a fastreduce setting ({', '.join(sorted(_SETTINGS))}) "
                            f"nor a DDPStrategy argument ({', '.join(sorted(_DDP_ARGS))})")
        settings = {k: kwargs.pop(k) for k in list(kwargs) if k in _SETTINGS}
        find_unused = bool(kwargs.pop("find_unused_parameters", False))
        self._broadcast_buffers = bool(kwargs.pop("broadcast_buffers", True))
        kwargs.pop("static_graph", None)
        kwargs.pop("gradient_as_bucket_view", None)
        self._mode_arg, self._settings, self._eval_params = mode, settings, eval_params
        self._mode: TrainerMode = make_mode(mode, settings, eval_params)  # a typo or a bad value fails here
        if find_unused:
            if "unused_grads" not in self._mode.settings():
                raise ValueError(f"find_unused_parameters=True has no meaning in fastreduce mode "
                                 f"{self._mode.name!r}: drop it")
            if settings.setdefault("unused_grads", "zero") != "zero":
                raise ValueError("find_unused_parameters=True means unused_grads='zero', "
                                 f"but unused_grads={settings['unused_grads']!r} was passed")
            self._mode = make_mode(mode, settings, eval_params)
        self._membership: TrainerMembership | None = None
        if membership is not None:
            check_plain_process("FastReduceStrategy")
            self._membership = TrainerMembership(membership, self._mode, "FastReduceStrategy")
            self._broadcast_buffers = False  # no collective outside a commit: buffers stay each member's own
        super().__init__(**kwargs)
        self._blocked = False
        self._sync_buffers_next = True  # DDP's require_forward_param_sync: True before the first forward
        self._resume_from: str | None = None  # the checkpoint fit(ckpt_path=...) loads
        self._validating: contextlib.ExitStack | None = None
        self._clip_patched: Any = None  # the precision plugin whose clipping is the mode's
        self._committing: Any = None  # under a Membership: the optimizer stepped through the commit

    @property
    def mode(self) -> TrainerMode:
        """The mode: its settings from construction, the mode object (``mode.obj``) once ``fit`` starts."""
        return self._mode

    @property
    def reducer_config(self) -> ReducerConfig | None:
        """The fused modes' reducer settings (validated at construction); ``None`` in the other modes."""
        if commit_style(self._mode.cls) != "reduce":
            return None
        return ReducerConfig(**{k: v for k, v in self._mode.config.items() if k != "group"})

    @property
    def reducer(self) -> FusedReducer | None:
        """The :class:`fastreduce.FusedReducer` of the current (or last) ``fit`` in the fused
        modes; ``None`` before, and in the other modes."""
        obj = self._mode.obj
        return obj if commit_style(obj) == "reduce" else None

    # ------------------------------------------------------------------ setup: no DDP wrapper

    def configure_ddp(self) -> None:
        """Instead of wrapping in DDP: broadcast rank 0's parameters (and buffers, unless
        ``broadcast_buffers=False``) once, so every rank starts from the same weights.

        ``DDPStrategy.setup`` calls this when fitting, after the module is on its
        device and before the optimizers are created (:meth:`setup_optimizers` then
        builds the mode)."""
        assert isinstance(self.model, LightningModule)
        self._release()
        if _world() > 1:
            ignore = ddp_ignored_names(self.model)
            state = list(self.model.named_parameters())
            if self._broadcast_buffers:
                state += list(self.model.named_buffers())
            broadcast_from_rank0([t.detach() for n, t in state if n not in ignore], None)
        self._blocked = False
        self._sync_buffers_next = True

    def setup_optimizers(self, trainer: Any) -> None:
        """``configure_optimizers``, then the mode over the LightningModule and its optimizer.

        The mode's optimizer replaces the one configured where it differs (ZeRO); the
        LR schedulers that drove the configured one then drive it."""
        super().setup_optimizers(trainer)
        if trainer.state.fn != TrainerFn.FITTING or not isinstance(self.model, LightningModule):
            return
        self._release()
        mode = self._mode = make_mode(self._mode_arg, self._settings, self._eval_params)
        if self._membership is not None:  # built at each epoch by the Membership, which it joins at on_train_start
            self._membership.mode = mode
            self._membership.sampler = None
            if mode.wraps_module:  # gossip: every forward through the current epoch's wrapper
                self.model = ModeModule(self.model, mode)
            return
        optimizers = list(self.optimizers)
        if len(optimizers) > 1 and optimizer_role(mode.cls) != "user":  # the fused modes step the user's
            raise ValueError(f"FastReduceStrategy: fastreduce mode {mode.name!r} is built over one optimizer, and "
                             f"configure_optimizers returned {len(optimizers)}: return one (several param "
                             "groups are fine), or use mode='fused' or 'overlap'")
        configured = optimizers[0] if optimizers else None
        clip = trainer.gradient_clip_val or 0.0
        if clip and trainer.gradient_clip_algorithm not in (None, "norm") and mode.clips:
            raise ValueError(by_norm_only(mode))
        built = mode.build(self.model, configured, getattr(self.precision_plugin, "scaler", None), float(clip))
        if built is not configured:
            self._repoint_schedulers(configured, built)
            self.optimizers = [built]
        self.model = mode.module_to_call(self.model)  # gossip: its wrapper, through which every forward goes
        mode.start_figures(trainer.global_step)
        self._patch_clipping()
        self._log_figures(trainer)
        if self.global_rank == 0:
            log.info("fastreduce: FastReduceStrategy trains %s without DDP on %d ranks in mode %r",
                     type(self.model).__name__, _world(), mode.name)

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module stays as it is: no ``DistributedDataParallel`` wrapper."""
        return model

    def _register_ddp_hooks(self) -> None:
        """Nothing to register: DDP's communication hooks need a DDP module (and CUDA)."""

    # ------------------------------------------------------------------ every step

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Broadcast rank 0's buffers where DDP would, then run the module's ``training_step``.

        DDP (``broadcast_buffers=True``) broadcasts buffers before a forward when the
        previous forward through it ran with grad enabled and gradient sync on (or is
        the first); so with gradient accumulation, before the first micro-batch of each
        window. The same rule here leaves, e.g., BatchNorm running statistics as DDP
        leaves them.
        """
        lm = self.lightning_module
        # Lightning's DDP forward redirection turns sync off during the forward in
        # manual optimization, so there DDP broadcasts before the first forward only.
        self._before_forward(syncing=torch.is_grad_enabled() and not self._blocked
                             and (lm is None or lm.automatic_optimization))
        reattach = getattr(self._mode.obj, "reattach", None)
        if reattach is not None:  # training_step may call a submodule, not the module's forward
            reattach()
        return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's ``validation_step``, keeping DDP's buffer broadcasts.

        Under ``fit``, validation runs through the DDP wrapper with grad off, so DDP
        broadcasts buffers before it if the last forward synced, and not before the
        next training forward.
        """
        self._before_forward(syncing=False)
        return super().validation_step(*args, **kwargs)

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        """The mode's work after the backward that ends an accumulation window (the fused
        modes average the gradients), unless inside :meth:`block_backward_sync`.

        Lightning calls this right after ``backward`` (automatic optimization, and
        ``manual_backward``), before ``on_before_optimizer_step``, gradient clipping and
        the optimizer step, so clipping and the step see averaged gradients.
        """
        if self._mode.obj is not None and not self._blocked:
            if self._membership is not None:
                self._membership.after_backward()  # a loss: raised again in the commit
            else:
                self._mode.after_backward()

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward inside this block is in the mode's ``no_sync()``.

        Lightning enters it for every micro-batch but the last of an accumulation
        window (and ``LightningOptimizer.toggle_model(sync_grad=False)`` in manual
        optimization); the mode's work after the last backward covers the window.
        """
        if self._mode.obj is None:
            yield None
            return
        outer = self._blocked
        with self._mode.no_sync():
            self._blocked = True
            try:
                yield None
            finally:
                self._blocked = outer

    def on_validation_start(self) -> None:
        """Under ``fit``, per-rank modes validate the ranks' exact mean parameters (or each
        rank's own: ``eval_params="own"``)."""
        super().on_validation_start()
        if self._mode.obj is not None and self._mode.per_rank and self._validating is None \
                and self._membership is None and isinstance(self.model, torch.nn.Module):
            self._validating = contextlib.ExitStack()
            self._validating.enter_context(self._mode.evaluating(self.model))

    def on_validation_end(self) -> None:
        """Each rank's own parameters back, bit for bit."""
        if self._validating is not None:
            stack, self._validating = self._validating, None
            stack.close()
        super().on_validation_end()

    def teardown(self) -> None:
        """Take the mode's hooks off (the mode object and its counters stay readable) and
        stop fastreduce's background threads (:func:`fastreduce.shutdown`; the next use
        starts them again)."""
        if self._validating is not None:
            self.on_validation_end()
        self._release()
        super().teardown()
        shutdown()

    # ------------------------------------------------------------------ helpers

    def _before_forward(self, syncing: bool) -> None:
        """DDP's buffer rule: broadcast now if the previous forward synced; note this one."""
        if self._mode.obj is None or not self._broadcast_buffers:
            return
        if self._sync_buffers_next:
            self._sync_buffers()
        self._sync_buffers_next = syncing

    @torch.no_grad()
    def _sync_buffers(self) -> None:
        if _world() <= 1:
            return
        assert self.model is not None
        ignore = ddp_ignored_names(self.model)
        bufs = [b.detach() for n, b in self.model.named_buffers() if n not in ignore]
        if bufs:
            with preserve_version_counters(bufs):
                sync_params_and_buffers(dist.group.WORLD, bufs, _BROADCAST_BUCKET_BYTES, src=0)

    def _release(self) -> None:
        """Take the mode's hooks (and wrapper) off the module, parameters and optimizer, so
        that a second ``fit`` (a new mode) does not leave the old one's running."""
        self._unpatch_clipping()
        if isinstance(self.model, ModeModule) or self._mode.obj is not None and self.model is self._mode.obj:
            self.model = self.lightning_module
        self._mode.close()

    def _log_figures(self, trainer: Any) -> None:
        """Log the mode's figures (:class:`_Figures`), one callback per trainer."""
        if not any(isinstance(c, _Figures) for c in trainer.callbacks):
            trainer.callbacks.append(_Figures())

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``strategy="fastreduce"`` (the fused mode, default settings) and
        ``"fastreduce_<mode>"`` for the other modes with Lightning.

        Overrides ``DDPStrategy``'s, which would register the ``ddp*`` names to this class.
        """
        strategy_registry.register("fastreduce", cls, description="DDP strategy with gradients averaged by "
                                   "fastreduce.FusedReducer (no DDP wrapper)", override=True)
        for name in MODES:
            if name != "fused":
                strategy_registry.register(f"fastreduce_{name}", cls, description=f"fastreduce mode {name!r} "
                                           "in place of DDP", override=True, mode=name)


class _Figures(Callback):
    """Logs the mode's figures every ``log_every_n_steps`` optimizer steps, when Lightning logs."""

    def __init__(self) -> None:
        self._last = -1

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        strategy = trainer.strategy
        glue = getattr(strategy, "membership", None) if isinstance(strategy, FastReduceStrategy) else None
        if glue is not None and glue.committed is False:  # discarded on every member: no step
            glue.undo_schedulers()  # (Lightning stepped them after the optimizer's step)
            set_global_step(trainer, glue.m.step, stepping=True)
            glue.committed = None
        if glue is not None and glue.m.left:  # out of the job (evicted, leave(), or left out and back once it
            trainer.should_stop = True  # ended): its training ends here, nothing more logged
            return
        mode = getattr(strategy, "mode", None) if isinstance(strategy, FastReduceStrategy) else None
        step, every = trainer.global_step, trainer.log_every_n_steps
        if mode is None or mode.obj is None or not every or step == self._last or step % every:
            return
        self._last = step
        figures = {k: float(v) for k, v in mode.figures(step).items()}
        if strategy.membership is not None:
            figures.update(strategy.membership.figures())
        if figures:
            pl_module.log_dict(figures, on_step=True, on_epoch=False, rank_zero_only=True)


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


FastReduceStrategy.register_strategies(StrategyRegistry)
