"""Hugging Face: ``FastReduceTrainer`` for ``transformers.Trainer``, and the Accelerate recipe.

Switching a ``Trainer`` to fastreduce is one line::

    from fastreduce.integrations.transformers import FastReduceTrainer

    trainer = FastReduceTrainer(model=model, args=args, train_dataset=train_ds,
                                fastreduce_config=dict(wire_dtype=torch.bfloat16, overlap=True))
    trainer.train()          # torchrun --nproc-per-node N train.py

Under ``torchrun`` (more than one rank) the trainer leaves the model unwrapped by
DDP, gives every rank rank 0's parameters and buffers once, and averages the
gradients with a :class:`fastreduce.FusedReducer` after backward on each step that
ends a gradient-accumulation window (the micro-steps before it accumulate locally),
before the Trainer clips and steps. With one process it is the stock ``Trainer``.
To add the same behaviour to another ``Trainer`` subclass (``Seq2SeqTrainer``, TRL's
trainers), put :class:`FastReduceMixin` first in its bases.

With Accelerate's own loop, prepare the model in evaluation mode (device placement,
mixed precision and ``torch.compile``, but no DDP) and reduce in the loop::

    model = accelerator.prepare_model(model, evaluation_mode=True)
    broadcast_parameters(model)                     # rank 0's weights on every rank
    reducer = fastreduce.FusedReducer(model, wire_dtype=torch.bfloat16)
    optimizer, loader = accelerator.prepare(optimizer, loader)
    for batch in loader:
        with accelerator.accumulate(model):         # sets accelerator.sync_gradients
            with contextlib.nullcontext() if accelerator.sync_gradients else reducer.no_sync():
                accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                reducer.reduce()                    # average, then clip and step
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                reducer.zero_grad()                 # grads stay views of the flat buffer

(``examples/accelerate_train.py`` runs it.) This module imports ``transformers``
only when :class:`FastReduceTrainer` is first looked up.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.distributed as dist

from ..comm.collectives import broadcast_from_rank0
from ..compat import prepare_model_without_ddp
from ..modes.fused import FusedReducer, ReducerConfig

if TYPE_CHECKING:  # pragma: no cover
    import transformers

__all__ = ["FastReduceMixin", "FastReduceTrainer", "broadcast_parameters"]

log = logging.getLogger(__name__)


def broadcast_parameters(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> bool:
    """Give every rank of ``group`` rank 0's parameters and buffers, in place, as DDP does
    when it wraps a model; return whether any rank's differed (the same answer everywhere).

    Collective: call it on every rank, once, before the first forward. Frozen
    parameters are included; a tied parameter is sent once.
    """
    tensors = [t.detach() for t in model.parameters()] + [b.detach() for b in model.buffers()]
    differed = broadcast_from_rank0(tensors, group)
    if differed and dist.get_rank(group) == 0:
        log.info("fastreduce: the ranks' initial parameters or buffers differed; every rank now holds rank 0's")
    return differed


class FastReduceMixin:
    """Makes a ``transformers.Trainer`` (sub)class reduce gradients with fastreduce, not DDP.

    Put it first in the bases: ``class MyTrainer(FastReduceMixin, Trainer)``;
    :class:`FastReduceTrainer` is ``FastReduceMixin`` over ``Trainer``. It takes one
    keyword argument more than the trainer it is mixed into:

    Args:
        fastreduce_config: keyword arguments for :class:`fastreduce.FusedReducer`:
            the fields of :class:`fastreduce.ReducerConfig` (``wire_dtype``,
            ``overlap``, ``bucket_mb``, ``accumulate_dtype``, ``unused_grads``,
            ``transport``, ``use_graphs``, ``backend``) and ``group``. Checked when
            the trainer is built. fastreduce's defaults apply: a bf16 wire;
            ``wire_dtype=torch.float32`` (or ``None``) averages exactly as DDP does.
            ``unused_grads`` defaults to ``"zero"`` when
            ``TrainingArguments.ddp_find_unused_parameters`` is ``True``, to
            ``"error"`` otherwise.

    What it changes, in a run of more than one process (with one, nothing):

    - ``_wrap_model`` (training): prepares the model with
      ``accelerator.prepare_model(model, evaluation_mode=True)`` (device placement,
      mixed precision, ``torch.compile``; no DDP) so that the Trainer's
      ``accelerator.prepare(model, optimizer)`` leaves it as it is (on every
      accelerate: :func:`fastreduce.compat.prepare_model_without_ddp`); then
      broadcasts rank 0's parameters and buffers and builds the reducer (once per
      model: a second ``train()`` reuses both).
    - ``training_step``: on a micro-step that does not end an accumulation window
      (``accelerator.sync_gradients`` false) backward runs under
      ``reducer.no_sync()``; on one that does, ``reducer.reduce()`` follows backward,
      so the Trainer clips (``max_grad_norm``) and steps on averaged gradients.

    Buffers are broadcast once, at the start; a buffer that forward updates
    (BatchNorm statistics) then stays per rank, as under DDP with
    ``ddp_broadcast_buffers=False``. DeepSpeed, FSDP, tensor/context parallelism and
    models sharded at load time reduce gradients their own way and are refused.
    """

    def __init__(self, *args: Any, fastreduce_config: Mapping[str, Any] | None = None, **kwargs: Any):
        config = dict(fastreduce_config or {})
        ReducerConfig(**{k: v for k, v in config.items() if k != "group"})  # a typo fails here
        self.fastreduce_config: dict[str, Any] = config
        self.fastreduce_reducer: FusedReducer | None = None
        """The reducer of the model being trained (``None`` until ``train()`` starts on
        more than one rank); its ``stats`` count the reductions."""
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ Trainer hooks

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader: Any = None) -> torch.nn.Module:
        """Prepare the model for training without DDP and attach the reducer (see the class)."""
        if not training or not self._fastreduce_world():
            return super()._wrap_model(model, training=training, dataloader=dataloader)
        self._fastreduce_check_supported()
        accelerator = self.accelerator
        if accelerator.unwrap_model(model, keep_torch_compile=False) is not model:
            return model  # prepared by an earlier train() (e.g. compiled): keep it and its reducer
        prepared = prepare_model_without_ddp(accelerator, model)
        self._fastreduce_attach(accelerator.unwrap_model(prepared, keep_torch_compile=False))
        return prepared

    def training_step(self, model: torch.nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The Trainer's step (forward, backward), then the average on a sync step."""
        reducer = self.fastreduce_reducer
        if reducer is None:
            return super().training_step(model, inputs, *args, **kwargs)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise RuntimeError(f"{type(self).__name__}: the Trainer wrapped the model in DistributedDataParallel "
                               "after fastreduce prepared it, so gradients would be averaged twice. This "
                               "transformers/accelerate pair is not supported: please report the versions")
        state = self.accelerator.gradient_state
        sync = state.sync_gradients or bool(getattr(state, "plugin_kwargs", {}).get("sync_each_batch", False))
        with contextlib.nullcontext() if sync else reducer.no_sync():
            loss = super().training_step(model, inputs, *args, **kwargs)
        if sync:
            reducer.reduce()
        return loss

    # ------------------------------------------------------------------ helpers

    def _fastreduce_world(self) -> bool:
        group = self.fastreduce_config.get("group")
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1

    def _fastreduce_check_supported(self) -> None:
        ours = type(self).__name__
        other = ("DeepSpeed" if getattr(self, "is_deepspeed_enabled", False) else
                 "FSDP" if getattr(self, "is_fsdp_enabled", False) or getattr(self, "is_fsdp_xla_enabled", False) else
                 "a model sharded at load time" if getattr(self, "is_distributed_loading_by_transformers", False) else
                 "a ParallelismConfig" if getattr(self.accelerator, "parallelism_config", None) is not None else
                 None)
        if other is not None:
            raise ValueError(f"{ours} replaces DDP's gradient all-reduce, but this run uses {other}, "
                             "which reduces gradients its own way: use the stock Trainer for it")

    def _fastreduce_attach(self, model: torch.nn.Module) -> None:
        reducer = self.fastreduce_reducer
        if reducer is not None and reducer.model is model:
            return
        config = dict(self.fastreduce_config)
        if "unused_grads" not in config and self.args.ddp_find_unused_parameters:
            config["unused_grads"] = "zero"
        group = config.pop("group", None)
        broadcast_parameters(model, group)
        self.fastreduce_reducer = FusedReducer(model, group=group, **config)
        if dist.get_rank(group) == 0:
            cfg = self.fastreduce_reducer.config
            log.info("fastreduce: %s trains %s without DDP on %d ranks: wire %s, %s", type(self).__name__,
                     type(model).__name__, dist.get_world_size(group), cfg.wire_dtype,
                     "overlapped" if cfg.overlap else "fused")


def _make_trainer() -> type:
    from transformers import Trainer

    class FastReduceTrainer(FastReduceMixin, Trainer):
        """``transformers.Trainer`` with fastreduce in place of DDP (see :class:`FastReduceMixin`).

        Takes the Trainer's arguments plus ``fastreduce_config``, the keyword
        arguments of :class:`fastreduce.FusedReducer`::

            trainer = FastReduceTrainer(model=model, args=args, train_dataset=ds,
                                        fastreduce_config=dict(wire_dtype=torch.float32, overlap=True))
        """

    FastReduceTrainer.__module__ = __name__
    FastReduceTrainer.__qualname__ = "FastReduceTrainer"
    return FastReduceTrainer


def __getattr__(name: str) -> Any:
    # FastReduceTrainer subclasses transformers.Trainer: build it (importing
    # transformers) on first use, so that importing this module needs no extra.
    if name == "FastReduceTrainer":
        try:
            cls = _make_trainer()
        except ImportError as exc:
            raise ImportError("fastreduce.integrations.transformers.FastReduceTrainer needs transformers and "
                              "accelerate: pip install 'fastreduce[hf]'") from exc
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:  # pragma: no cover
    class FastReduceTrainer(FastReduceMixin, transformers.Trainer):
        ...
