"""What a step changes besides its result, kept aside so that a step whose average holds
inf/NaN (``nonfinite="raise"`` or ``"skip"``) leaves it as before: the fused reducer's
error-feedback residuals and PowerSGD's state, a local-update mode's quantized wire
residuals and SparseLoCo accumulators (one per fragment).
"""

from __future__ import annotations

from typing import Any

import torch

from ..buffer import TensorBlock

__all__ = ["StepUndo"]


class StepUndo:
    """The state ``tensors`` (and a codec's step count: PowerSGD's), copied aside after every
    step whose average is finite (:meth:`keep`: one fused copy per dtype) and put back after
    one whose average is not (:meth:`undo`), so that a skipped step leaves them as before it.
    Only under ``nonfinite="raise"`` or ``"skip"``: with ``"ignore"`` nothing is copied."""

    def __init__(self, tensors: list[torch.Tensor], codec: Any, device: torch.device):
        self.codec = codec
        self.blocks = TensorBlock.per_dtype(tensors, lambda n, d: torch.empty(n, dtype=d, device=device))
        self.step = 0
        self.keep()

    def keep(self) -> None:
        """The state now is what :meth:`undo` puts back."""
        for block in self.blocks:
            block.load()
        if self.codec is not None:
            self.step = self.codec.step

    def undo(self) -> None:
        """The state as :meth:`keep` last found it."""
        for block in self.blocks:
            block.store()
        if self.codec is not None:
            self.codec.step = self.step
