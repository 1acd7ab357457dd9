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
import json
import logging
import os
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.distributed as dist

from ..comm.collectives import broadcast_from_rank0
from ..compat import prepare_model_without_ddp
from ..lifecycle import shutdown
from ..modes.fused import FusedReducer
from .committing import commits
from .membership import ModeModule, TrainerMembership, check_plain_process
from ..modes.contract import commit_style, optimizer_role
from .modes import CalledThrough, TrainerMode, make_mode
from .transformers_hooks import clip_with, membership_callback, unprepared

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
    """Makes a ``transformers.Trainer`` (sub)class train in a fastreduce mode, not DDP.

    Put it first in the bases: ``class MyTrainer(FastReduceMixin, Trainer)``;
    :class:`FastReduceTrainer` is ``FastReduceMixin`` over ``Trainer``. It takes two
    keyword arguments more than the trainer it is mixed into:

    Args:
        fastreduce_mode: ``"fused"`` (the default), ``"overlap"``, ``"zero"``,
            ``"localsgd"``, ``"diloco"`` or ``"gossip"`` (:mod:`fastreduce.integrations.modes`).
        fastreduce_config: the mode's settings: the keyword arguments of its class
            (:class:`fastreduce.FusedReducer`'s :class:`fastreduce.ReducerConfig` fields,
            :class:`fastreduce.ZeroOptimizer`'s, :class:`fastreduce.LocalSGD`'s,
            :class:`fastreduce.DiLoCo`'s, ``group`` included), with their names, defaults
            and errors; checked when the trainer is built. Without ``fastreduce_mode``,
            ``overlap=True`` here means the ``"overlap"`` mode. For ``"fused"`` and
            ``"overlap"``, ``unused_grads`` defaults to ``"zero"`` when
            ``TrainingArguments.ddp_find_unused_parameters`` is ``True``.

    What it changes, in a run of more than one process (with one, nothing):

    - ``_wrap_model`` (training): prepares the model with
      ``accelerator.prepare_model(model, evaluation_mode=True)`` (device placement,
      mixed precision, ``torch.compile``; no DDP), broadcasts rank 0's parameters and
      buffers, and builds the mode over the model and the Trainer's optimizer (``zero``
      replaces the optimizer by a :class:`~fastreduce.ZeroOptimizer` of the same class,
      param groups and hyperparameters, which the LR scheduler then drives; ``localsgd``
      and ``diloco`` hook the Trainer's optimizer, the inner one; ``gossip`` wraps the
      model, which the Trainer then calls, and steps one optimizer like the Trainer's per
      bucket during backward, at the ``lr`` the Trainer's scheduler sets, clipping each
      bucket at ``max_grad_norm``; the Trainer's own step then does nothing). Once per
      model: a second ``train()`` reuses it.
    - ``training_step``: backward of a micro-step that does not end an accumulation
      window runs under the mode's ``no_sync()``; after the one that does, the fused and
      overlapped modes average the gradients, so the Trainer clips (``max_grad_norm``)
      and steps on averaged gradients. ZeRO's clipping is its global norm.
    - ``evaluate()`` and ``save_model()`` (so a checkpoint's model files too) see the
      exact mean of the ranks' parameters in ``localsgd``, ``diloco`` and ``gossip``, whose ranks
      hold their own between syncs; afterwards each rank trains on its own again.
      ``fastreduce_eval_params="own"`` evaluates each rank's own parameters instead (no
      communication; the metric is then the mean over ranks of each rank's model on its
      share of the evaluation data); a mode whose ranks share their parameters refuses it.
    - Checkpoints (``save_steps``): the mode's whole state (ZeRO's shards, each rank's
      own parameters and optimizer, anchors, outer optimizer, residuals, step counts) is
      saved with :class:`fastreduce.checkpoint.Checkpointer` in the checkpoint's
      ``fastreduce/`` folder, beside the Trainer's files, and
      ``train(resume_from_checkpoint=...)`` resumes it (a ZeRO checkpoint on any world size).
    - ``log``: each training log (every ``logging_steps``) holds the mode's figures
      (``fastreduce/...``: bytes per step, seconds waiting per step and their share of
      the time, syncs, skipped steps, the buckets).

    Buffers are broadcast once, at the start; a buffer that forward updates
    (BatchNorm statistics) then stays per rank, as under DDP with
    ``ddp_broadcast_buffers=False``. DeepSpeed, FSDP, tensor/context parallelism and
    models sharded at load time reduce gradients their own way and are refused.
    """

    def __init__(self, *args: Any, fastreduce_mode: str | None = None,
                 fastreduce_config: Mapping[str, Any] | None = None, fastreduce_eval_params: str = "mean",
                 fastreduce_membership: Any = None, **kwargs: Any):
        self.fastreduce_mode: TrainerMode = make_mode(fastreduce_mode, fastreduce_config,  # a typo fails here
                                                      fastreduce_eval_params)
        """The mode (settings now; :attr:`TrainerMode.obj` is the mode object once training starts)."""
        self.fastreduce_model: torch.nn.Module | None = None  # the module the mode is built on
        self.fastreduce_membership: TrainerMembership | None = None
        """This trainer's side of ``fastreduce_membership`` (:mod:`fastreduce.integrations.membership`)."""
        if fastreduce_membership is not None:
            check_plain_process(type(self).__name__)
            self.fastreduce_membership = TrainerMembership(fastreduce_membership, self.fastreduce_mode,
                                                           type(self).__name__)
        # deepspeed= / fsdp= asked for: refused before the Trainer builds either
        self._fastreduce_refuse(_other_in(kwargs.get("args", args[1] if len(args) > 1 else None)))
        super().__init__(*args, **kwargs)
        self._fastreduce_refuse(_other_in(self.args) or _other_made(self))  # and what the Trainer made
        if self.fastreduce_membership is not None:
            if self.args.max_steps <= 0:
                raise ValueError(f"{type(self).__name__}: under fastreduce.Membership the run's length is its number "
                                 "of committed optimizer steps (the LR schedule is over it, and the steps in a data "
                                 "epoch change with the world): set TrainingArguments(max_steps=...)")
            self.add_callback(membership_callback(self))
        self._fastreduce_users_scheduler = getattr(self, "lr_scheduler", None) is not None  # optimizers=(opt, sched)
        if optimizer_role(self.fastreduce_mode.cls) == "self" and self._fastreduce_users_scheduler \
                and self.fastreduce_membership is None:  # (under one, the Trainer's optimizer and scheduler stay)
            raise ValueError(f"{type(self).__name__}: fastreduce mode 'zero' replaces the Trainer's optimizer by "
                             "its sharded twin, and the scheduler passed in optimizers=(optimizer, scheduler) "
                             "drives the one replaced: pass optimizers=(optimizer, None), or "
                             "optimizer_cls_and_kwargs, and let the Trainer build the scheduler")

    @property
    def fastreduce_reducer(self) -> FusedReducer | None:
        """The fused or overlapped reducer of the model being trained (``None`` until
        ``train()`` starts on more than one rank, and in the other modes); its ``stats``
        count the reductions."""
        obj = self.fastreduce_mode.obj
        return obj if commit_style(obj) == "reduce" else None

    # ------------------------------------------------------------------ Trainer hooks

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader: Any = None) -> torch.nn.Module:
        """Prepare the model for training without DDP and build the mode (see the class)."""
        if training and self.fastreduce_membership is not None:  # the Membership builds the mode, at each epoch
            if isinstance(model, ModeModule):
                return model  # prepared by an earlier train()
            prepared = prepare_model_without_ddp(self.accelerator, model)
            self.fastreduce_model = self.accelerator.unwrap_model(prepared, keep_torch_compile=False)
            return ModeModule(prepared, self.fastreduce_mode) if self.fastreduce_mode.wraps_module else prepared
        if not training or not self._fastreduce_world():
            return super()._wrap_model(model, training=training, dataloader=dataloader)
        accelerator = self.accelerator
        mode = self.fastreduce_mode
        if model is mode.obj or isinstance(model, CalledThrough) or \
                accelerator.unwrap_model(model, keep_torch_compile=False) is not model:
            return model  # prepared by an earlier train() (e.g. compiled, or gossip's wrapper): keep it and its mode
        prepared = prepare_model_without_ddp(accelerator, model)
        inner = accelerator.unwrap_model(prepared, keep_torch_compile=False)
        if inner is not self.fastreduce_model:
            mode.close()
            mode.obj = None
            self.fastreduce_model = inner
            broadcast_parameters(inner, mode.config.get("group"))
            self._fastreduce_build()
        return prepared if mode.obj is None else mode.module_to_call(prepared)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train()``; once it returns, fastreduce's background threads stop
        (:func:`fastreduce.shutdown`: the communication in flight finished first), so a
        ``dist.destroy_process_group()`` or the interpreter's exit after it meets none of
        them. Whatever runs next (``evaluate()``, another ``train()``) starts them again."""
        resume = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        if self.fastreduce_membership is not None and resume:
            self._fastreduce_resume_job(resume)
        if self.fastreduce_mode.obj is not None:  # a mode kept from an earlier train(): its figures from step 0
            self.fastreduce_mode.start_figures(0)  # (a resume sets them at its step)
        result = super().train(*args, **kwargs)
        shutdown()
        return result

    def create_optimizer(self, *args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        """The Trainer's optimizer (under a Membership, stepped through
        :class:`~fastreduce.integrations.committing.CommittingOptimizer`); then the mode, where
        the model is prepared already."""
        optimizer = super().create_optimizer(*args, **kwargs)
        glue = self.fastreduce_membership
        if glue is not None and not commits(self.optimizer):
            self.optimizer = glue.optimizer(self.optimizer)  # each step commits through the Membership
        self._fastreduce_build()
        return self.optimizer if self.optimizer is not None else optimizer

    def create_scheduler(self, num_training_steps: int, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's scheduler; its step count is kept, so that the scheduler can be made
        again over ZeRO where transformers < 5 makes it before the model is wrapped."""
        self._fastreduce_steps = num_training_steps
        return super().create_scheduler(num_training_steps, *args, **kwargs)

    def training_step(self, model: torch.nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The Trainer's step (forward, backward), then the mode's work after the last micro-step."""
        mode = self.fastreduce_mode
        if mode.obj is None:
            return super().training_step(model, inputs, *args, **kwargs)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise RuntimeError(f"{type(self).__name__}: the Trainer wrapped the model in DistributedDataParallel "
                               "after fastreduce prepared it, so gradients would be averaged twice. This "
                               "transformers/accelerate pair is not supported: please report the versions")
        state = self.accelerator.gradient_state
        sync = state.sync_gradients or bool(getattr(state, "plugin_kwargs", {}).get("sync_each_batch", False))
        with contextlib.nullcontext() if sync else mode.no_sync():
            try:
                loss = super().training_step(model, inputs, *args, **kwargs)
            except RuntimeError as err:  # gossip's exchanges in forward and backward: kept for the commit
                if self.fastreduce_membership is None or not mode.wraps_module:
                    raise
                self.fastreduce_membership.keep(err)
                return torch.zeros((), device=self.args.device)
        if sync:
            if self.fastreduce_membership is not None:
                self.fastreduce_membership.after_backward()  # a loss: raised again in the commit
            else:
                mode.after_backward()
        return loss

    def get_train_dataloader(self) -> Any:
        """The Trainer's; under a Membership a plain ``DataLoader`` over a
        :class:`~fastreduce.integrations.membership.MembershipSampler` (Accelerate's
        prepared loader fetches a batch ahead, before the step in flight commits; the
        Trainer moves each batch to its device itself)."""
        if self.fastreduce_membership is None:
            return super().get_train_dataloader()
        accelerator = self.accelerator
        # this call only: the loader as the Trainer made it (transformers 4.55.4 and 5.25.0 prepare
        # it inside get_train_dataloader, with no setting to keep it as it is)
        accelerator.prepare = unprepared
        try:
            return super().get_train_dataloader()
        finally:
            del accelerator.prepare

    def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
        glue = self.fastreduce_membership
        if glue is None:
            return super()._get_train_sampler(*args, **kwargs)
        dataset = args[0] if args else kwargs.get("train_dataset", self.train_dataset)
        dataset = self.train_dataset if dataset is None else dataset
        return glue.make_sampler(dataset, step_samples=self._train_batch_size * self.args.gradient_accumulation_steps,
                                 seed=self.args.data_seed if self.args.data_seed is not None else self.args.seed,
                                 sized=False, num_workers=self.args.dataloader_num_workers)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """The Trainer's evaluation, on the ranks' mean parameters where each holds its own
        (or each rank's own: ``fastreduce_eval_params="own"``)."""
        model = self.fastreduce_model
        own = model is None or self.fastreduce_membership is not None  # no collective outside a commit
        with contextlib.nullcontext() if own else self.fastreduce_mode.evaluating(model):
            return super().evaluate(*args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The Trainer's ``save_model`` (call it on every rank), of the ranks' mean
        parameters where each holds its own: the model a user loads with ``from_pretrained``."""
        with self._fastreduce_averaged():
            super().save_model(output_dir, _internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.fastreduce_membership is not None:  # the Trainer's files (no collective), and the job's position
            super()._save_optimizer_and_scheduler(output_dir)
            with open(os.path.join(output_dir, _JOB), "w") as f:
                json.dump(self.fastreduce_membership.state_dict(), f)
            return None
        if self.fastreduce_mode.obj is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self._fastreduce_checkpointer(output_dir).save(self.state.global_step)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        folder = os.path.join(checkpoint or "", _FOLDER)
        if checkpoint is not None and self.fastreduce_mode.obj is None and os.path.isdir(folder) \
                and self.fastreduce_membership is None:  # (the Trainer's own files would be looked for, not found)
            raise ValueError(f"{type(self).__name__}: {checkpoint} holds its optimizer's state in fastreduce's form "
                             f"({_FOLDER}/, saved in mode {self.fastreduce_mode.name!r} on several ranks), and this "
                             "run has one process, so no fastreduce mode runs to load it: resume on several ranks "
                             "(the fused, overlapped and zero modes on any number of them)")
        if checkpoint is None or self.fastreduce_mode.obj is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if not os.path.isdir(folder):
            raise ValueError(f"{checkpoint} holds no fastreduce state ({_FOLDER}/): it was not saved by a "
                             f"{type(self).__name__} in a fastreduce mode; resume it with the trainer that saved it")
        self._fastreduce_checkpointer(checkpoint).load_latest()
        sched = os.path.join(checkpoint, _SCHEDULER)
        if self.lr_scheduler is not None and os.path.isfile(sched):
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))
        self.fastreduce_mode.start_figures(self.state.global_step)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's log; a training log (one with ``loss``) also gets the mode's figures."""
        if self.fastreduce_mode.obj is not None and "loss" in logs:
            logs.update(self.fastreduce_mode.figures(self.state.global_step))
            if self.fastreduce_membership is not None:
                logs.update(self.fastreduce_membership.figures())
        super().log(logs, *args, **kwargs)

    # ------------------------------------------------------------------ helpers

    def _fastreduce_world(self) -> bool:
        group = self.fastreduce_mode.config.get("group")
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1

    def _fastreduce_build(self) -> None:
        """Build the mode once the model is prepared and (but for the fused modes) the
        optimizer exists; ``_wrap_model`` and ``create_optimizer`` come in either order."""
        mode, model = self.fastreduce_mode, self.fastreduce_model
        if self.fastreduce_membership is not None or mode.obj is not None or model is None or \
                (self.optimizer is None and optimizer_role(mode.cls) != "user"):  # (the reducers need none)
            return
        if "unused_grads" in mode.settings() and "unused_grads" not in mode.config \
                and self.args.ddp_find_unused_parameters:
            mode.config["unused_grads"] = "zero"
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # under Accelerate's wrapper
        if self._fastreduce_users_scheduler:  # gossip: the user's scheduler drives the user's optimizer,
            mode.optimizer_kept = True  # whose groups' lr each bucket's optimizer then reads
        built = mode.build(model, optimizer, getattr(self.accelerator, "scaler", None), self.args.max_grad_norm)
        if built is not optimizer:
            self.optimizer = built
            if self.lr_scheduler is not None and not self._fastreduce_users_scheduler:
                # transformers < 5 made it already, over the optimizer replaced (a user's stays: above)
                self.lr_scheduler = None
                self.create_scheduler(num_training_steps=self._fastreduce_steps, optimizer=built)
        mode.start_figures(self.state.global_step)
        if mode.clips:
            clip_with(self.accelerator, mode)
        group = mode.config.get("group")
        if dist.get_rank(group) == 0:
            log.info("fastreduce: %s trains %s without DDP on %d ranks in mode %r", type(self).__name__,
                     type(model).__name__, dist.get_world_size(group), mode.name)

    def _fastreduce_resume_job(self, resume: str | bool) -> None:
        """Under a Membership, ``train(resume_from_checkpoint=...)``: the job starts at the
        checkpoint's committed steps and data position (:meth:`TrainerMembership.resume`);
        the Trainer skips no batches, as the Membership's sampler starts where it stood."""
        from transformers.trainer_utils import get_last_checkpoint

        folder = get_last_checkpoint(self.args.output_dir) if resume is True else str(resume)
        job = os.path.join(folder or "", _JOB)
        saved = None
        if os.path.isfile(job):
            with open(job) as f:
                saved = json.load(f)
        self.fastreduce_membership.resume(saved, folder or self.args.output_dir)
        # TrainingArguments' own setting, for this run: the data position comes with the job's state
        self.args.ignore_data_skip = True

    def _fastreduce_checkpointer(self, output_dir: str) -> Any:
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        return self.fastreduce_mode.checkpointer(os.path.join(output_dir, _FOLDER), self.fastreduce_model, optimizer)

    def _fastreduce_averaged(self) -> contextlib.AbstractContextManager:
        model = self.fastreduce_model
        own = model is None or self.fastreduce_membership is not None  # no collective outside a commit
        return contextlib.nullcontext() if own else self.fastreduce_mode.averaged(model)

    def _fastreduce_refuse(self, other: str | None) -> None:
        if other is not None:
            raise ValueError(f"{type(self).__name__} trains in fastreduce mode {self.fastreduce_mode.name!r}, which "
                             f"replaces DDP, but this run also asks for {other}, which reduces gradients its own "
                             f"way: drop the {other} setting (deepspeed=, fsdp=, ...), or use the stock Trainer for it")


def _other_in(args: Any) -> str | None:
    """What ``TrainingArguments`` ask for that reduces gradients its own way, if anything
    (optimum-habana's ``fast_ddp`` too: ``GaudiTrainer`` would average every step's gradients
    again, which in a local-update mode would silently be DDP)."""
    if getattr(args, "distribution_strategy", None) == "fast_ddp":
        return "optimum-habana's fast_ddp (distribution_strategy=\"fast_ddp\")"
    return "DeepSpeed" if getattr(args, "deepspeed", None) else "FSDP" if getattr(args, "fsdp", None) else None


def _other_made(trainer: Any) -> str | None:
    """What the built Trainer runs that reduces gradients its own way, if anything."""
    return ("DeepSpeed" if getattr(trainer, "is_deepspeed_enabled", False) else
            "FSDP" if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_fsdp_xla_enabled", False) else
            "a model sharded at load time" if getattr(trainer, "is_distributed_loading_by_transformers", False) else
            "a ParallelismConfig" if getattr(trainer.accelerator, "parallelism_config", None) is not None else None)


_FOLDER = "fastreduce"  # the mode's state, in a Trainer checkpoint folder
_JOB = "fastreduce_membership.json"  # under a Membership: the job's committed steps and data position
_SCHEDULER = "scheduler.pt"  # the Trainer's name for its scheduler's state (transformers.trainer.SCHEDULER_NAME)


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
