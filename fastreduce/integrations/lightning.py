"""Lightning: ``Trainer(strategy=FastReduceStrategy(...))``, fastreduce instead of DDP.

    from fastreduce.integrations.lightning import FastReduceStrategy

    trainer = lightning.pytorch.Trainer(
        accelerator="cpu", devices=2, accumulate_grad_batches=4, gradient_clip_val=1.0,
        strategy=FastReduceStrategy(wire_dtype=torch.bfloat16, overlap=True))
    trainer.fit(module, datamodule)

(or ``strategy="fastreduce"`` once this module is imported). The strategy is Lightning's
``DDPStrategy`` (same launchers, process group, samplers, ``barrier``, ``broadcast``,
``reduce``, checkpointing) except for the gradients: the LightningModule is not wrapped
in ``DistributedDataParallel``; rank 0's parameters and buffers are broadcast once when
fitting starts, and a :class:`fastreduce.FusedReducer` averages the gradients in
:meth:`~FastReduceStrategy.post_backward`, which Lightning calls right after each
``backward`` and before ``on_before_optimizer_step``, gradient clipping and the
optimizer step. On the non-final micro-batches of gradient accumulation Lightning runs
backward inside :meth:`~FastReduceStrategy.block_backward_sync`; there the reducer is
in ``no_sync()`` and nothing is communicated. DDP's own communication hooks are
registered on CUDA only, so on CPU and HPU this is the way to plug in a custom reducer.

Lightning is imported at the top of this module: import it only where ``lightning``
is installed (``pip install fastreduce[lightning]``); ``import fastreduce`` never
imports it.
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch.distributed.utils import _sync_params_and_buffers

from ..comm import broadcast_from_rank0
from ..compat import preserve_version_counters
from ..modes.fused import FusedReducer, ReducerConfig

__all__ = ["FastReduceStrategy"]

log = logging.getLogger(__name__)

_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(ReducerConfig))
_BROADCAST_BUCKET_BYTES = 250 * 2**20  # DDP's buffer broadcast buckets
# DDP constructor arguments that have no meaning here: what to use instead.
_DDP_ONLY = {
    "ddp_comm_state": "fastreduce replaces DDP's communication hooks; pass fastreduce's settings "
                      "(wire_dtype, overlap, ...) instead",
    "ddp_comm_hook": "fastreduce replaces DDP's communication hooks; pass fastreduce's settings "
                     "(wire_dtype, overlap, ...) instead",
    "ddp_comm_wrapper": "fastreduce replaces DDP's communication hooks; pass wire_dtype instead",
    "model_averaging_period": "for periodic model averaging use fastreduce.LocalSGD in a "
                              "LightningModule with manual optimization",
    "bucket_cap_mb": "use bucket_mb (overlap=True)",
    "device_ids": "Lightning picks the device",
    "output_device": "Lightning picks the device",
    "process_group": "the strategy reduces over the world group",
}


class FastReduceStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` with fastreduce averaging the gradients instead of DDP.

    Args:
        **kwargs: fastreduce's settings, the fields of :class:`fastreduce.ReducerConfig`
            (``wire_dtype`` (default ``torch.bfloat16``; ``torch.float32`` for an exact
            average), ``overlap``, ``bucket_mb``, ``accumulate_dtype``, ``unused_grads``,
            ``use_graphs``, ``backend``, ``transport``), passed to
            ``fastreduce.FusedReducer(module, **config)``; every other keyword goes to
            ``DDPStrategy`` (``accelerator``, ``parallel_devices``, ``cluster_environment``,
            ``checkpoint_io``, ``precision_plugin``, ``process_group_backend``,
            ``timeout``, ``start_method``). Of DDP's own arguments these keep their
            meaning: ``find_unused_parameters=True`` is ``unused_grads="zero"``;
            ``broadcast_buffers`` (default ``True``) broadcasts rank 0's buffers before a
            training forward exactly when DDP would. ``static_graph`` and
            ``gradient_as_bucket_view`` are accepted and ignored (fastreduce learns the
            layout once and its gradients always are views of its buffer); the others
            (``ddp_comm_hook``, ``bucket_cap_mb``, ...) raise ``TypeError`` naming what to
            use instead.

    The reducer is built when fitting starts (``Trainer.fit``), before the first
    backward, so ``overlap=True`` works; it is :attr:`reducer` (e.g.
    ``trainer.strategy.reducer.stats``) and stays readable after ``fit`` returns.
    Validation, test and predict runs outside ``fit`` build no reducer; they broadcast
    rank 0's parameters and buffers once, as ``DDPStrategy`` does.

    Example::

        >>> from fastreduce.integrations.lightning import FastReduceStrategy
        >>> trainer = Trainer(accelerator="cpu", devices=2, accumulate_grad_batches=2,
        ...                   strategy=FastReduceStrategy(wire_dtype=torch.float32))
    """

    strategy_name = "fastreduce"

    def __init__(self, **kwargs: Any) -> None:
        config = {k: kwargs.pop(k) for k in list(kwargs) if k in _CONFIG_FIELDS}
        bad = sorted(k for k in kwargs if k in _DDP_ONLY)
        if bad:
            raise TypeError(f"FastReduceStrategy does not take {bad[0]!r}: {_DDP_ONLY[bad[0]]}")
        if kwargs.pop("find_unused_parameters", False):
            if config.setdefault("unused_grads", "zero") != "zero":
                raise ValueError("find_unused_parameters=True means unused_grads='zero', "
                                 f"but unused_grads={config['unused_grads']!r} was passed")
        self._broadcast_buffers = bool(kwargs.pop("broadcast_buffers", True))
        kwargs.pop("static_graph", None)
        kwargs.pop("gradient_as_bucket_view", None)
        ddp_args = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
                    "precision_plugin", "process_group_backend", "timeout", "start_method"}
        unknown = sorted(set(kwargs) - ddp_args)
        if unknown:
            raise TypeError(f"FastReduceStrategy got unexpected keyword argument(s) {unknown}: "
                            f"neither a fastreduce setting ({', '.join(sorted(_CONFIG_FIELDS))}) "
                            f"nor a DDPStrategy argument ({', '.join(sorted(ddp_args))})")
        self.reducer_config = ReducerConfig(**config)  # invalid settings fail here, not at fit
        """The settings the reducer is built with (validated at construction)."""
        self._config = config
        super().__init__(**kwargs)
        self._reducer: FusedReducer | None = None
        self._blocked = False
        self._sync_buffers_next = True  # DDP's require_forward_param_sync: True before the first forward

    @property
    def reducer(self) -> FusedReducer | None:
        """The :class:`fastreduce.FusedReducer` of the current (or last) ``fit``; ``None`` before."""
        return self._reducer

    # ------------------------------------------------------------------ setup: no DDP wrapper

    def configure_ddp(self) -> None:
        """Instead of wrapping in DDP: broadcast rank 0's state once, then build the reducer.

        ``DDPStrategy.setup`` calls this when fitting, after the module is on its
        device and before the optimizers are created. Like DDP's constructor it
        broadcasts rank 0's parameters (and buffers, unless ``broadcast_buffers=False``)
        so every rank starts from the same weights, then builds the
        :class:`~fastreduce.FusedReducer` (its overlap hooks must exist before the
        first backward).
        """
        assert isinstance(self.model, LightningModule)
        self._release()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ignore = set(getattr(self.model, "_ddp_params_and_buffers_to_ignore", ()))
            state = list(self.model.named_parameters())
            if self._broadcast_buffers:
                state += list(self.model.named_buffers())
            broadcast_from_rank0([t.detach() for n, t in state if n not in ignore], None)
        self._reducer = FusedReducer(self.model, **self._config)
        self._blocked = False
        self._sync_buffers_next = True

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
        if self._reducer is not None:  # training_step may call a submodule, not the module's forward
            self._reducer.reattach()
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
        """Average the gradients across ranks, unless inside :meth:`block_backward_sync`.

        Lightning calls this right after ``backward`` (automatic optimization, and
        ``manual_backward``), before ``on_before_optimizer_step``, gradient clipping and
        the optimizer step, so clipping and the step see averaged gradients.
        """
        if self._reducer is not None and not self._blocked:
            self._reducer.reduce()

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward inside this block reduces nothing.

        Lightning enters it for every micro-batch but the last of an accumulation
        window (and ``LightningOptimizer.toggle_model(sync_grad=False)`` in manual
        optimization); the reduce after the last backward averages the accumulated
        gradients once.
        """
        if self._reducer is None:
            yield None
            return
        outer = self._blocked
        with self._reducer.no_sync():
            self._blocked = True
            try:
                yield None
            finally:
                self._blocked = outer

    def teardown(self) -> None:
        """Remove the reducer's gradient hooks (overlap mode); the reducer and its stats stay readable."""
        self._release()
        super().teardown()

    # ------------------------------------------------------------------ helpers

    def _before_forward(self, syncing: bool) -> None:
        """DDP's buffer rule: broadcast now if the previous forward synced; note this one."""
        if self._reducer is None or not self._broadcast_buffers:
            return
        if self._sync_buffers_next:
            self._sync_buffers()
        self._sync_buffers_next = syncing

    @torch.no_grad()
    def _sync_buffers(self) -> None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        assert self.model is not None
        ignore = set(getattr(self.model, "_ddp_params_and_buffers_to_ignore", ()))
        bufs = [b.detach() for n, b in self.model.named_buffers() if n not in ignore]
        if bufs:
            with preserve_version_counters(bufs):
                _sync_params_and_buffers(dist.group.WORLD, bufs, _BROADCAST_BUCKET_BYTES, src=0)

    def _release(self) -> None:
        """Take the reducer's hooks off the module and its parameters, so that a second
        ``fit`` (a new reducer) does not leave the old one's running."""
        if self._reducer is not None:
            self._reducer.close()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``strategy="fastreduce"`` (default settings) with Lightning.

        Overrides ``DDPStrategy``'s, which would register the ``ddp*`` names to this class.
        """
        strategy_registry.register("fastreduce", cls, description="DDP strategy with gradients averaged by "
                                   "fastreduce.FusedReducer (no DDP wrapper)", override=True)


FastReduceStrategy.register_strategies(StrategyRegistry)
