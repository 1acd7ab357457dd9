"""The Lightning strategy's side of ``membership=`` (:mod:`.membership`): each member a world of
one to Lightning, joining at ``on_train_start``, with Lightning's step the committed steps.
A base of :class:`~fastreduce.integrations.lightning.FastReduceStrategy`; imports Lightning
only inside its methods."""

from __future__ import annotations

from typing import Any

import torch

from .membership import TrainerMembership

__all__ = ["MembershipMixin"]


class MembershipMixin:
    """``FastReduceStrategy``'s methods under a Membership (before ``DDPStrategy`` in its bases)."""

    @property
    def membership(self) -> TrainerMembership | None:
        """This strategy's side of ``membership=`` (:mod:`fastreduce.integrations.membership`)."""
        return self._membership

    # ------------------------------------------------------------------ under a Membership
    # Each member is one process of one device, and a world of one to Lightning: outside a
    # commit a collective would fail on a lost member, or wait on a joiner not there yet, so
    # the strategy's collectives are each member's own, and Lightning's loops, which
    # broadcast on their own where the world is larger (the SIGTERM flag, every batch),
    # see a world of one. The global rank is the Membership's (rank 0 writes).

    @property
    def global_rank(self) -> int:
        glue = self._membership
        if glue is None:
            return super().global_rank
        return glue.m.rank if glue.m.epoch is not None else 0

    @property
    def world_size(self) -> int:
        return super().world_size if self._membership is None else 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return super().distributed_sampler_kwargs if self._membership is None else {"num_replicas": 1, "rank": 0}

    def setup_environment(self) -> None:
        """Under a Membership: the device only; the Membership forms each epoch's process group."""
        if self._membership is None:
            return super().setup_environment()
        from lightning.pytorch.strategies import DDPStrategy

        super(DDPStrategy, self).setup_environment()

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self._membership is None:
            super().barrier(*args, **kwargs)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj if self._membership is not None else super().broadcast(obj, src)

    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor if self._membership is not None else super().reduce(tensor, *args, **kwargs)

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        if self._membership is not None:
            return tensor.unsqueeze(0)
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision if self._membership is not None else super().reduce_boolean_decision(decision, all)

    # Gossip steps and exchanges inside the training step's forward and backward, which run in
    # Lightning's closure: an error there on a lost member is kept for the commit (which
    # discards the step), and the closure goes on with a loss that reaches no parameter.

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        glue = self._membership
        if glue is None or not self._mode.wraps_module:
            return super().training_step(*args, **kwargs)
        try:
            return super().training_step(*args, **kwargs)
        except RuntimeError as err:
            glue.keep(err)
            return torch.zeros((), requires_grad=True)

    def backward(self, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        glue = self._membership
        if glue is None or not self._mode.wraps_module:
            return super().backward(closure_loss, *args, **kwargs)
        try:
            return super().backward(closure_loss, *args, **kwargs)
        except RuntimeError as err:
            glue.keep(err)
            return closure_loss

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Under a Membership, the precision plugin steps the configured optimizer through
        :class:`~fastreduce.integrations.committing.CommittingOptimizer`: its closure (training
        step, backward, clipping), then the commit."""
        glue = self._membership
        if glue is not None and glue.m.epoch is not None:
            if self._committing is None or self._committing.optimizer is not optimizer:
                self._committing = glue.optimizer(optimizer)
            optimizer = self._committing
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def process_dataloader(self, dataloader: object) -> object:
        """Under a Membership, the training loader draws from a
        :class:`~fastreduce.integrations.membership.MembershipSampler`."""
        from lightning.pytorch.trainer.states import RunningStage, TrainerFn

        glue = self._membership
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if glue is None or trainer is None or not trainer.training or trainer.state.fn != TrainerFn.FITTING \
                or not isinstance(dataloader, torch.utils.data.DataLoader):  # validation: each member's own
            return super().process_dataloader(dataloader)
        from lightning.pytorch.utilities.data import _update_dataloader

        sampler = glue.sampler  # a reloaded training loader goes on from the same position
        if sampler is None:
            seed = getattr(dataloader.sampler, "seed", None)
            sampler = glue.make_sampler(dataloader.dataset, step_samples=(dataloader.batch_size or 1)
                                        * trainer.accumulate_grad_batches, seed=int(seed or 0), sized=True,
                                        num_workers=dataloader.num_workers)
        return _update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING)

    def on_train_start(self) -> None:
        """Under a Membership: join it (a joiner takes the model, optimizer, LR schedulers,
        data position and step count from a live member)."""
        super().on_train_start()
        glue = self._membership
        if glue is None:
            return
        trainer = self.lightning_module.trainer
        if trainer.max_steps is None or trainer.max_steps <= 0 or trainer.max_epochs not in (None, -1):
            raise ValueError("FastReduceStrategy: under fastreduce.Membership the run's length is its number of "
                             "committed optimizer steps (the steps in an epoch change with the world): pass "
                             "Trainer(max_steps=...) and no max_epochs")
        bad = [c for c in self.lr_scheduler_configs if c.interval != "step" or c.frequency != 1 or
               c.reduce_on_plateau]
        if bad:
            raise ValueError("FastReduceStrategy: under fastreduce.Membership an LR scheduler steps once per committed "
                             "step (interval='step', frequency=1; not ReduceLROnPlateau), so that a joiner's equals "
                             "the members'")
        if len(self.optimizers) != 1:
            raise ValueError("FastReduceStrategy: under fastreduce.Membership configure_optimizers returns one "
                             f"optimizer (several param groups are fine), got {len(self.optimizers)}")
        if not self.lightning_module.automatic_optimization:
            raise ValueError("FastReduceStrategy: under fastreduce.Membership a step is Lightning's automatic "
                             "optimization step (its global step follows the committed steps); manual optimization "
                             "is not supported yet")
        step = glue.join(self.lightning_module, self.optimizers[0], [c.scheduler for c in self.lr_scheduler_configs],
                         last_step=trainer.max_steps, scaler=getattr(self.precision_plugin, "scaler", None),
                         max_grad_norm=float(trainer.gradient_clip_val or 0.0), on_epoch=self._on_new_epoch)
        set_global_step(trainer, step)
        if self._mode.clips:  # ZeRO's global norm (the mode's clip, kept for the commit on a loss)
            self._patch_clipping()
        self._log_figures(trainer)

    def _on_new_epoch(self) -> None:
        from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
        from lightning.pytorch.utilities.rank_zero import rank_zero_only

        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank


def set_global_step(trainer: Any, step: int, stepping: bool = False) -> None:
    """Make Lightning's global step (its optimizer-step count) ``step``, the Membership's
    committed steps, and its loggers' step with it (``stepping``: in a batch that Lightning
    counts as stepped once it ends)."""
    loop = trainer.fit_loop.epoch_loop
    tracker = loop.automatic_optimization.optim_progress.optimizer.step
    delta = tracker.total.completed - step
    for t in (tracker.total, tracker.current):
        t.ready -= delta
        t.completed -= delta
    # The loggers' step goes through the loop's own checkpoint state (its on_save_checkpoint and
    # on_load_checkpoint, as a resumed fit sets it; Lightning 2.5.1 and 2.6.6 tested)
    state = loop.on_save_checkpoint()
    state["_batches_that_stepped"] = step - 1 if stepping else step
    loop.on_load_checkpoint(state)
