"""What every mode a trainer runs by name is to the trainer: :class:`TrainerMode`, the base of
the adapters in :mod:`.modes` (build over the model and the trainer's optimizer, skip
communication on the micro-steps of gradient accumulation, reduce after the last backward,
clip, save, evaluate on the ranks' mean, report figures), and the helpers they share."""

from __future__ import annotations

import contextlib
import inspect
import time
from typing import Any, Callable, ClassVar, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint import Checkpointer
from ..faults import all_reduce_watched
from ..modes.comm_stats import CommStats

__all__ = ["EVAL_PARAMS", "TrainerMode", "rebuild_args", "wire_counts"]

EVAL_PARAMS = ("mean", "own")
"""What a per-rank mode evaluates: the ranks' exact mean parameters, or each rank's own."""

_IMPLEMENTATION = ("foreach", "fused", "differentiable")  # torch.optim's kernel choices, None/False: not chosen


def _unflatten_into(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy consecutive runs of ``flat`` into ``tensors`` (each cast to its own dtype)."""
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(part.view_as(t))


class TrainerMode:
    """One fastreduce mode inside a trainer (see the module doc); built in two steps:
    the settings when the trainer is built (:func:`make_mode`, checked there), the mode
    itself when training starts (:meth:`build`, collective)."""

    name: ClassVar[str]
    cls: ClassVar[Callable[..., Any]]
    """The mode's own class: its keyword arguments are the settings."""
    fixed: ClassVar[tuple[str, ...]] = ()
    """Its arguments the trainer fills (model, optimizer, ...): not settings."""
    per_rank: ClassVar[bool] = False
    clips: ClassVar[bool] = False
    """The mode clips the gradients its own way (:meth:`clip_grad_norm_`: ZeRO's global norm
    over the shards, gossip's per rank): the trainers route their clipping to it."""
    scaler_steps: ClassVar[bool] = False
    """A ``GradScaler`` steps the mode's optimizer every time and hands it the scale (torch's
    protocol for an optimizer that unscales itself, as a fused one does: LocalSGD and DiLoCo,
    modes/local_scaler.py); a trainer that would unscale first only for other optimizers
    still does (Lightning: its clipping sees unscaled gradients)."""

    wraps_module: ClassVar[bool] = False
    """The trainer calls the mode's wrapper (:meth:`module_to_call`), not the model (gossip)."""

    optimizer_kept = False
    """The trainer steps (and its LR schedulers drive) its own optimizer, not one the mode
    gives back from :meth:`build` (under a Membership, which builds the mode at each epoch)."""

    failures: Callable[[RuntimeError], None] | None = None
    """Where a failure of the mode's own clipping goes instead of being raised (set by a
    trainer's Membership, whose commit then discards the step)."""

    def __init__(self, config: Mapping[str, Any], eval_params: str = "mean"):
        self.config = dict(config)
        self.check(self.config)
        if eval_params not in EVAL_PARAMS:
            raise ValueError(f"eval_params must be one of {', '.join(map(repr, EVAL_PARAMS))}, got {eval_params!r}")
        self.eval_params = eval_params
        self.obj: Any = None  # the mode object, once built
        self._last = (time.perf_counter(), 0)  # (when, steps) the figures were last read
        self._sent, self._waited = 0, 0.0  # the byte and wait counters then

    # ------------------------------------------------------------------ settings

    @classmethod
    def settings(cls) -> list[str]:
        sig = inspect.signature(cls.cls)
        return [n for n, p in sig.parameters.items()
                if n not in cls.fixed and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]

    supplied: ClassVar[tuple[str, ...]] = ()
    """Settings the mode's class requires that the adapter fills when not given (DiLoCo's outer optimizer)."""

    @classmethod
    def check(cls, config: dict[str, Any]) -> None:
        """``TypeError`` for a setting the mode does not take (with the ones it does), or a
        setting it needs that is missing (a mode chosen by name alone, e.g. Lightning's
        ``strategy="fastreduce_localsgd"``, must fail when the trainer is built, not at its
        first step)."""
        bad = sorted(set(config) - set(cls.settings()))
        if bad:
            raise TypeError(f"fastreduce mode {cls.name!r} ({cls.cls.__name__}) does not take the setting "
                            f"{bad[0]!r}; its settings: {', '.join(cls.settings())}")
        params = inspect.signature(cls.cls).parameters
        missing = [n for n in cls.settings() if n in params and params[n].default is inspect.Parameter.empty
                   and n not in config and n not in cls.supplied]
        if missing:
            raise TypeError(f"fastreduce mode {cls.name!r} ({cls.cls.__name__}) needs the setting {missing[0]!r}: "
                            f"pass it with the mode (HF Trainer: fastreduce_config={{{missing[0]!r}: ...}}; "
                            f"Lightning: FastReduceStrategy({cls.name!r}, {missing[0]}=...); the strategy name alone "
                            "cannot carry it)")

    # ------------------------------------------------------------------ build

    def build(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, scaler: Any = None,
              max_grad_norm: float = 0.0) -> torch.optim.Optimizer | None:
        """Build the mode over ``model`` (on its device, every rank's parameters rank 0's)
        and the trainer's ``optimizer``; return the optimizer the trainer steps.
        ``max_grad_norm``: the trainer's clipping, for a mode that must clip itself."""
        raise NotImplementedError

    # ------------------------------------------------------------------ every step

    def module_to_call(self, prepared: nn.Module) -> nn.Module:
        """What the trainer calls forward on: ``prepared`` (the model as the trainer prepared
        it), or the mode's wrapper where the mode must see each forward (gossip)."""
        return prepared

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Around the backward of a micro-step that does not end an accumulation window."""
        return contextlib.nullcontext()

    def after_backward(self) -> None:
        """After the backward of the micro-step that ends an accumulation window."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """The global gradient norm, clipped, where the mode holds the gradients its own
        way (ZeRO); ``None``: the trainer's own clipping is right."""
        return None

    @contextlib.contextmanager
    def averaged(self, model: nn.Module) -> Iterator[None]:
        """Inside: every rank's parameters and float buffers are their exact mean over
        ranks (collective), for modes whose ranks hold their own (:attr:`per_rank`);
        afterwards each rank's own again, bit for bit."""
        if not self.per_rank or self.obj is None:
            yield
            return
        self.settle()  # nothing in flight may read the parameters while they hold the mean
        group = self.config.get("group")
        tensors = [p.detach() for p in model.parameters() if p.requires_grad]
        tensors += [b.detach() for b in model.buffers() if b.is_floating_point()]
        with torch.no_grad():
            own = torch.cat([t.reshape(-1).double() for t in tensors])  # this rank's, exact in fp64
            mean = own.clone()
            all_reduce_watched(mean, dist.ReduceOp.SUM, group)  # one collective, not one per tensor
            mean.div_(dist.get_world_size(group))
            _unflatten_into(tensors, mean)
        try:
            yield
        finally:
            with torch.no_grad():
                _unflatten_into(tensors, own)

    def settle(self) -> None:
        """Wait for the mode's work in flight that reads the parameters' own storage (a
        peer may read it after this rank wrote something else there); its result stays
        due where it was. Nothing for a mode whose transfers read buffers of their own."""

    def evaluating(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Around an evaluation: :meth:`averaged` (``eval_params="mean"``), or each rank's own
        parameters as they are (``"own"``)."""
        return self.averaged(model) if self.eval_params == "mean" else contextlib.nullcontext()

    # ------------------------------------------------------------------ state and figures

    def checkpointer(self, directory: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> Checkpointer:
        """The :class:`~fastreduce.checkpoint.Checkpointer` of this mode's whole state."""
        return Checkpointer(directory, model, optimizer, mode=self.obj, keep=1)

    def start_figures(self, steps: int) -> None:
        """Count the figures from now on, the trainer at ``steps`` (after a build or a resume)."""
        counts = self._counts()
        self._last = (time.perf_counter(), steps)
        self._sent, self._waited = counts.get("bytes", 0), counts.get("wait_seconds", 0.0)

    def figures(self, steps: int) -> dict[str, float]:
        """What the trainer's log shows, over the optimizer steps since the last call
        (``steps``: the trainer's step count now), under the same keys in every mode:
        ``fastreduce/bytes_per_step`` (the bytes handed to the mode's collectives, its
        ``stats``' ``wire_bytes`` or ``bytes_reduced``, per step), ``fastreduce/wait_seconds_per_step``
        (the seconds it waited on them, per step) and ``fastreduce/comm_share`` (those seconds
        over the wall time since the last call); then the mode's own counts as they stand
        (``syncs``, ``rounds``, ``buckets``, ``skipped_steps``, ...)."""
        now = time.perf_counter()
        since, then = self._last
        self._last = (now, steps)
        n = max(steps - then, 1)
        out = {f"fastreduce/{k}": v for k, v in self._counts().items()}
        sent = out.pop("fastreduce/bytes", None)
        if sent is not None:
            out["fastreduce/bytes_per_step"] = (sent - self._sent) / n
            self._sent = sent
        waited = out.pop("fastreduce/wait_seconds", None)
        if waited is not None:
            out["fastreduce/wait_seconds_per_step"] = (waited - self._waited) / n
            out["fastreduce/comm_share"] = (waited - self._waited) / max(now - since, 1e-9)
            self._waited = waited
        return out

    def _counts(self) -> dict[str, float]:
        """Cumulative counters of the mode (``bytes`` and ``wait_seconds`` become per step)."""
        return {}

    def finish(self) -> None:
        """End of training (collective): every rank's parameters complete and, where the
        mode keeps them per rank, synced (LocalSGD, DiLoCo: a last sync now; gossip: the
        global average; ZeRO: the last all-gather)."""
        if self.per_rank:
            self.obj.sync()

    def close(self, drain: bool = True) -> None:
        """Take the mode's hooks off the model and optimizer (``drain``: as the modes'
        ``close(drain)``: ``False`` drops what is in flight, a peer was lost)."""
        if self.obj is not None:
            self.obj.close(drain)


def wire_counts(stats: CommStats) -> dict[str, float]:
    """A mode's :class:`~fastreduce.modes.comm_stats.CommStats` as :meth:`TrainerMode._counts` names them."""
    return {"bytes": stats.wire_bytes, "wait_seconds": stats.wait_seconds}


def rebuild_args(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """What makes ``optimizer`` again: its constructor's keyword arguments (the defaults it
    takes, less kernel choices left unchosen) and, per param group, the hyperparameters in
    which the group differs from them (``lr``: the base lr, where an LR scheduler already
    set the group's, as transformers < 5 does before the model is wrapped)."""
    takes = inspect.signature(type(optimizer)).parameters  # defaults may hold more (AdamW's decoupled_...)
    defaults = {k: v for k, v in optimizer.defaults.items()
                if k in takes and not (k in _IMPLEMENTATION and v in (None, False))}
    hypers = [{k: v for k, v in {**g, "lr": g.get("initial_lr", g["lr"])}.items()  # an LR scheduler's base lr
               if k not in ("params", "initial_lr") and defaults.get(k) != v
               and not (k in _IMPLEMENTATION and v in (None, False))} for g in optimizer.param_groups]
    return defaults, hypers

