"""Checkpoints of the Lightning strategy: Lightning's file, and beside it, per rank, the mode's
whole state in the folder ``<checkpoint>.fastreduce``, which ``fit(ckpt_path=...)`` resumes."""

from __future__ import annotations

import os
import shutil
from typing import Any

from .membership import RESUME_UNDER_MEMBERSHIP

__all__ = ["CheckpointMixin"]

_SUFFIX = ".fastreduce"  # the mode's state, beside a Lightning checkpoint file


class CheckpointMixin:
    """``FastReduceStrategy``'s checkpoint methods (before ``DDPStrategy`` in its bases)."""

    # ------------------------------------------------------------------ checkpoints

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state (collective in per-rank modes: the ranks' exact mean)."""
        if self._mode.obj is None or not self._mode.per_rank or self._membership is not None:
            return super().lightning_module_state_dict()
        assert self.lightning_module is not None
        with self._mode.averaged(self.lightning_module):
            return {k: v.clone() for k, v in super().lightning_module_state_dict().items()}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Lightning's file (rank 0), and the mode's whole state in ``<filepath>.fastreduce``
        (every rank: Lightning calls this on all of them)."""
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if self._mode.obj is not None and "optimizer_states" in checkpoint and self._membership is None:
            # (not a weights-only save; under a Membership Lightning's file only: the Checkpointer is collective)
            self._checkpointer(os.fspath(filepath) + _SUFFIX).save(int(checkpoint.get("global_step", 0)))

    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove the file and its ``.fastreduce`` folder (``ModelCheckpoint(save_top_k=...)``)."""
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            shutil.rmtree(os.fspath(filepath) + _SUFFIX, ignore_errors=True)

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if self._membership is not None:
            raise ValueError(f"FastReduceStrategy: {RESUME_UNDER_MEMBERSHIP}")
        self._resume_from = os.fspath(checkpoint_path)
        return super().load_checkpoint(checkpoint_path, *args, **kwargs)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Resume the mode's whole state (model, optimizer, mode, random generators) from
        the ``.fastreduce`` folder beside the checkpoint being resumed; Lightning's own
        file restores the loops and LR schedulers."""
        if self._mode.obj is None:
            return super().load_optimizer_state_dict(checkpoint)
        folder = (self._resume_from or "") + _SUFFIX
        if not os.path.isdir(folder):  # ModelCheckpoint(save_last="link"): last.ckpt links to a checkpoint saved
            folder = os.path.realpath(self._resume_from or "") + _SUFFIX
        if not os.path.isdir(folder):
            raise ValueError(f"FastReduceStrategy: {self._resume_from} has no fastreduce state beside it "
                             f"({folder}): it was not saved by a FastReduceStrategy in a fastreduce mode; "
                             "resume it with the strategy that saved it")
        self._checkpointer(folder).load_latest()
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        self._mode.start_figures(int(checkpoint.get("global_step", 0)) if trainer is None else trainer.global_step)

    def _checkpointer(self, folder: str) -> Any:
        optimizer = self.optimizers[0] if self.optimizers else None
        return self._mode.checkpointer(folder, self.lightning_module, optimizer)
