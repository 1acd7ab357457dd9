"""What a :class:`~fastreduce.FusedReducer` saves and restores: per rank, its error-feedback
residuals (of the wire cast, or under ``"wire"`` a quantized wire's two) and, with
``compression=``, the codec's state (residuals, Q, step count).

The layout and buffers are learned again from the model, so a state loaded before the
first ``reduce()`` waits until that call has built them. Under ``nonfinite="raise"`` or
``"skip"`` the same state is also kept in memory after each step that stands
(:func:`step_undo`), and put back after one that does not.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..codecs.powersgd import check_state
from .step_undo import StepUndo

__all__ = ["ReducerState", "step_undo"]

log = logging.getLogger("fastreduce.modes.fused")


def step_undo(built: Any) -> StepUndo | None:
    """A :class:`~fastreduce.modes.step_undo.StepUndo` of what a step of ``built`` changes
    besides the gradients (its state as it is now), or ``None`` where a step changes
    nothing else."""
    tensors = [r for r in built.buffer.residuals if r is not None]
    if hasattr(built.plan, "state_tensors"):  # a quantized wire
        tensors += built.plan.state_tensors()
    codec = built.compressed.codec if built.compressed is not None else None
    if codec is not None:
        tensors += codec.state_tensors()
    return StepUndo(tensors, codec, built.buffer.wire.device) if tensors or codec is not None else None


class ReducerState:
    """The checkpoint half of :class:`~fastreduce.FusedReducer` (a mixin: it reads the
    reducer's ``config``, ``model`` and ``_built``)."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's own state, for a checkpoint (``fastreduce.checkpoint.Checkpointer``
        saves it under a per-rank key): each parameter's error-feedback residual, flat, by
        name (empty without ``error_feedback`` or before the first ``reduce()``, but for what
        :meth:`load_state_dict` loaded), and with
        ``compression=`` the codec's state under ``"compression"``."""
        built = self._built
        state: dict[str, Any] = {"residuals": self.__dict__.get("_pending_state", {}) if built is None  # (loaded,
                                 else built.buffer.residual_state(built.layout)}  # not yet placed: as loaded)
        if built is not None and built.compressed is not None:
            state["compression"] = built.compressed.codec.state_dict()
        elif "_pending_codec" in self.__dict__:
            state["compression"] = self._pending_codec
        wire = getattr(built, "plan", None)
        if self.config.quant is not None and self.config.error_feedback:  # the quantized wire's residuals
            state["wire"] = wire.state_dict() if hasattr(wire, "load_state_dict") else \
                self.__dict__.get("_pending_wire", {})
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: now, or, before the first ``reduce()``, when that
        learns the layout. Checked first (``ValueError``, nothing changed). What the state
        has none of (a state saved before a first step) starts as in a fresh reducer."""
        residuals = state_dict.get("residuals") if isinstance(state_dict, dict) else None
        if not isinstance(residuals, dict):
            raise ValueError("not a FusedReducer.state_dict() (no 'residuals' entry)")
        if residuals and not self.config.error_feedback:
            raise ValueError("this state holds error-feedback residuals but the reducer was built "
                             "without error_feedback=True; build it with the settings it was saved with")
        sizes = {n: p.numel() for n, p in self._named_parameters() if p.requires_grad}
        for name, t in residuals.items():
            if not torch.is_tensor(t) or sizes.get(name) != t.numel():
                raise ValueError(f"the residual saved for {name!r} does not fit this model (its trainable "
                                 f"parameter {name!r} has {sizes.get(name)} elements); another model?")
        codec = state_dict.get("compression")
        if codec is not None and self.config.compression is None:
            raise ValueError("this state holds a codec's state (PowerSGD's residuals and Q) but the reducer was "
                             "built without compression=; build it with the settings it was saved with")
        if codec is not None and self._built is None:  # checked against the model now, as a built codec's load is
            check_state(codec, self.config.compression.state_sizes(
                (n, p) for n, p in self._named_parameters() if p.requires_grad))
        wire = state_dict.get("wire")
        if wire and not (self.config.quant is not None and self.config.error_feedback):
            raise ValueError("this state holds a quantized wire's error-feedback residuals but the reducer was "
                             "built without a quantized wire_dtype and error_feedback=True; build it with the "
                             "settings it was saved with")
        built = self._built
        # A part the state has none of (saved before a first step) is as before a first step: a
        # quantized wire's residuals zero; PowerSGD at step 0, with each matrix's first Q, no residual.
        if self.config.quant is not None and self.config.error_feedback:
            if built is not None:
                built.plan.load_state_dict(wire or {})  # checked before anything is changed
            else:
                self._pending_wire = wire or {}
                self.__dict__.pop("_wire_layout", None)  # (a rebuild's state replaced: this one must fit)
        if self.config.compression is not None:
            if built is not None:
                lowrank = built.compressed.codec
                lowrank.load_state_dict(lowrank.initial_state() if codec is None else codec)  # checked first
            else:
                self.__dict__.pop("_codec_lenient", None)  # (as above)
                if codec is None:
                    self.__dict__.pop("_pending_codec", None)
                else:
                    self._pending_codec = codec
        self._pending_state = residuals
        if built is not None:
            self._restore(built)
            if built.undo is not None:  # (what a skipped step puts back from now on)
                built.undo.keep()

    def _restore(self, built: Any) -> None:
        """Copy what :meth:`load_state_dict` (or a rebuild: leniently) left waiting into ``built``."""
        pending = self.__dict__.pop("_pending_state", None)
        if pending is not None:  # (an empty one too: no residual, every one zero)
            built.buffer.load_residuals(built.layout, pending)
        wire = self.__dict__.pop("_pending_wire", None)
        laid = self.__dict__.pop("_wire_layout", None)  # a rebuild's: where its residuals were
        if wire and hasattr(built.plan, "load_state_dict"):
            if laid is None or laid == _places(built.layout):
                built.plan.load_state_dict(wire)
            else:
                log.info("fastreduce: the gradients were laid out anew; the quantized wire's residuals "
                         "start at zero")
        codec = self.__dict__.pop("_pending_codec", None)
        lenient = self.__dict__.pop("_codec_lenient", False)
        if codec is not None and built.compressed is not None:
            built.compressed.codec.load_state_dict(codec, strict=not lenient)

    def _keep_state(self) -> None:
        """Before a rebuild: what the reducer keeps between steps carries over to the new layout
        (as a state loaded before the first ``reduce()``): the residuals, by name; a quantized
        wire's where the gradients keep their places; the codec's state, what still fits."""
        built = self._built
        if built is None:
            return
        self._pending_state = built.buffer.residual_state(built.layout)
        if hasattr(built.plan, "load_state_dict"):
            self._pending_wire, self._wire_layout = built.plan.state_dict(), _places(built.layout)
        if built.compressed is not None:
            self._pending_codec, self._codec_lenient = built.compressed.codec.state_dict(), True


def _places(layout: Any) -> tuple:
    """Where ``layout`` puts each gradient (a quantized wire's residuals are per place)."""
    return layout.signature, layout.position, tuple(seg.numel for seg in layout.segments)
