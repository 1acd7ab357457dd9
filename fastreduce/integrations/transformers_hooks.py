"""Where the HF Trainer adapter (:mod:`.transformers`) reaches into the Trainer's own objects:
the mode's clipping on the Trainer's Accelerator, the training loader left unprepared under a
Membership, and the callback that joins a Membership when training starts (with the two step
counts the Trainer offers no public way to set). Each says which transformers versions it was
tested on; docs/design.md ("Other libraries' objects") lists them. Imports transformers only
inside its functions."""

from __future__ import annotations

from typing import Any

import torch

from .committing import unwrapped
from .modes import TrainerMode

__all__ = ["clip_with", "membership_callback", "unprepared"]


def clip_with(accelerator: Any, mode: TrainerMode) -> None:
    """Make ``accelerator.clip_grad_norm_`` (which every Trainer clips and reads its
    ``grad_norm`` through) the mode's own, on this accelerator only: transformers (4.55.4,
    5.25.0 tested) clips through it with no hook of its own (5.x's ``_clip_grad_norm`` is
    private; 4.55's clips inline), and the Trainer makes its Accelerator itself."""
    def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        return mode.clip_grad_norm_(max_norm, norm_type)

    accelerator.clip_grad_norm_ = clip_grad_norm_


def unprepared(*objects: Any, **_: Any) -> Any:
    """``Accelerator.prepare`` that prepares nothing (the training loader under a Membership)."""
    return objects[0] if len(objects) == 1 else objects


def membership_callback(trainer: Any) -> Any:
    """The callback that joins ``trainer``'s Membership when training starts, and makes a
    discarded step no step (the last callback, after the Trainer's own flow decisions)."""
    from transformers import TrainerCallback

    class FastReduceMembership(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            glue, mode = trainer.fastreduce_membership, trainer.fastreduce_mode
            if "unused_grads" in mode.settings() and "unused_grads" not in mode.config \
                    and args.ddp_find_unused_parameters:
                mode.config["unused_grads"] = "zero"
            step = glue.join(trainer.fastreduce_model, unwrapped(trainer.optimizer),
                             [trainer.lr_scheduler], last_step=state.max_steps,
                             scaler=getattr(trainer.accelerator, "scaler", None), max_grad_norm=args.max_grad_norm)
            # transformers (4.55.4, 5.25.0 tested) sets these two from the step count only before
            # on_train_begin, the first public hook after the model is prepared: a joiner's step
            # (the members') comes after, so the loss averaged per log and the throughput count
            # from it only if they are set here too (no public way)
            state.global_step = trainer._globalstep_last_logged = step
            if mode.clips:  # ZeRO's global norm (the mode's clip, kept for the commit on a loss)
                clip_with(trainer.accelerator, mode)
            if hasattr(trainer, "_initial_global_step"):
                trainer._initial_global_step = step
            state.epoch = glue.sampler.data_epoch

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            glue = trainer.fastreduce_membership
            if glue.committed is False:  # discarded on every member: no step, so no log, save, eval or stop
                glue.undo_schedulers()  # (the Trainer stepped them after the optimizer's step)
                state.global_step = glue.m.step
                control.should_log = control.should_save = control.should_evaluate = False
                control.should_training_stop = control.should_training_stop and state.global_step >= state.max_steps
            if glue.m.left:  # out of the job (evicted, leave(), or left out and back once it ended): it ends here
                control.should_training_stop = True
                control.should_log = control.should_save = control.should_evaluate = False
            state.epoch = glue.sampler.data_epoch  # data epochs drawn, the same on every member

    return FastReduceMembership()
