"""The modes a trainer can run, by name: one small adapter per mode over what every
trainer does (build over the model and the trainer's optimizer, skip communication on
the micro-steps of gradient accumulation, reduce after the last backward, clip, save,
evaluate), so that each trainer integration (:mod:`.transformers`, :mod:`.lightning`)
is one class over this registry and never branches on a mode.

========== ============================================== =========================================
 name       what the trainer's loop runs                   the trainer's optimizer
========== ============================================== =========================================
 fused      :class:`~fastreduce.FusedReducer` after the    stepped as it is
            last backward of each accumulation window
 overlap    the same with ``overlap=True``: buckets go     stepped as it is
            out from backward hooks
 zero       :class:`~fastreduce.ZeroOptimizer` over the    replaced by its sharded twin (same
            trainer's param groups; it averages itself     class, groups and hyperparameters)
 localsgd   :class:`~fastreduce.LocalSGD` on the           steps locally; the mode averages every
            trainer's optimizer                            ``sync_every`` steps from its step hook
 diloco     :class:`~fastreduce.DiLoCo`, the trainer's     the inner optimizer; the outer one is
            optimizer as the inner one                     ``outer_optimizer`` (default: the
                                                           paper's Nesterov SGD, lr 0.7, 0.9)
 gossip     :class:`~fastreduce.DecentralizedDataParallel` its groups drive one optimizer per
            (the trainer calls its wrapper), each bucket   bucket; its own step does nothing
            stepped in backward
========== ============================================== =========================================

A mode's settings are its class's keyword arguments, with the same names, defaults and
errors; a name the class does not take is refused when the trainer is built.
Parameters differ across ranks between syncs in ``localsgd``, ``diloco`` and ``gossip``
(:attr:`TrainerMode.per_rank`): a saved model is their exact mean
(:meth:`TrainerMode.averaged`), a checkpoint holds every rank's own, and evaluation sees
the mean (``eval_params="mean"``, the default: one fp64 all-reduce of the parameters, 8
bytes each, per evaluation) or each rank's own (``"own"``: no communication; each rank
evaluates its own parameters on its share of the evaluation data, so the trainer's
metric is the mean over ranks of each rank's own model on its share).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..checkpoint import Checkpointer
from ..modes.diloco import DiLoCo
from ..modes.fused import FusedReducer, ReducerConfig
from ..modes.gossip import DecentralizedDataParallel
from ..modes.localsgd import LocalSGD
from ..modes.zero import ZeroOptimizer
from .trainer_mode import EVAL_PARAMS, TrainerMode, rebuild_args, wire_counts

__all__ = ["EVAL_PARAMS", "MODES", "TrainerMode", "make_mode"]

class Fused(TrainerMode):
    name, cls = "fused", FusedReducer
    fixed = ("model",)
    overlap = False

    @classmethod
    def settings(cls) -> list[str]:
        return ["group", *(f.name for f in dataclasses.fields(ReducerConfig) if f.name != "overlap")]

    @classmethod
    def check(cls, config: dict[str, Any]) -> None:
        super().check(config)
        config["overlap"] = cls.overlap
        ReducerConfig(**{k: v for k, v in config.items() if k != "group"})  # a bad value fails here

    def build(self, model, optimizer, scaler=None, max_grad_norm=0.0):
        self.obj = FusedReducer(model, **self.config)
        return optimizer

    def no_sync(self):
        return self.obj.no_sync()

    def after_backward(self) -> None:
        self.obj.reduce()

    def _counts(self):
        st = self.obj.stats
        out = {"reductions": st.calls, "bytes": st.bytes_reduced, "wait_seconds": st.wait_seconds,
               "nonfinite": st.nonfinite}
        if st.sizing is not None:
            out["buckets"] = st.sizing.buckets
        return out


class Overlap(Fused):
    name = "overlap"
    overlap = True


class Zero(TrainerMode):
    name, cls = "zero", ZeroOptimizer
    clips = True
    fixed = ("params", "optimizer_class", "module", "scaler")

    def build(self, model, optimizer, scaler=None, max_grad_norm=0.0):
        if optimizer is None:
            raise ValueError("fastreduce mode 'zero' shards the trainer's optimizer, and there is none yet")
        defaults, hypers = rebuild_args(optimizer)
        groups = [{"params": g["params"], **h} for g, h in zip(optimizer.param_groups, hypers) if g["params"]]
        self.obj = ZeroOptimizer(groups, type(optimizer), module=model, scaler=scaler, **defaults, **self.config)
        return self.obj

    def no_sync(self):
        return self.obj.no_sync()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        try:
            return self.obj.clip_grad_norm_(max_norm, norm_type)
        except RuntimeError as err:  # a lost member, under a Membership: the commit discards the step
            if self.failures is None:
                raise
            self.failures(err)
            return torch.zeros(())

    def checkpointer(self, directory: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> Checkpointer:
        return Checkpointer(directory, model, self.obj, keep=1)  # the optimizer is the mode

    def _counts(self):
        return {"buckets": self.obj.num_buckets, "skipped_steps": self.obj.skipped_steps, **wire_counts(self.obj.stats)}

    def finish(self) -> None:
        self.obj.wait_params()


class Local(TrainerMode):
    name, cls = "localsgd", LocalSGD
    fixed = ("model", "optimizer")
    per_rank = True
    scaler_steps = True

    def build(self, model, optimizer, scaler=None, max_grad_norm=0.0):
        self.obj = LocalSGD(model, optimizer, **self.config)
        return optimizer

    def after_backward(self) -> None:
        self.obj.average_warmup_grads()  # (the trainer's clipping, next, sees the warm-up's average)

    def _counts(self):
        m = self.obj
        return {"syncs": m.syncs, "skipped_steps": m.skipped_steps, "skipped_syncs": m.skipped_syncs,
                **wire_counts(m.stats)}


class Diloco(Local):
    name, cls = "diloco", DiLoCo
    fixed = ("model", "inner_optimizer")
    supplied = ("outer_optimizer",)  # the paper's Nesterov SGD (lr 0.7, momentum 0.9) when not given

    @classmethod
    def check(cls, config: dict[str, Any]) -> None:
        super().check(config)
        outer = config.get("outer_optimizer")
        if outer is not None and not (isinstance(outer, torch.optim.Optimizer) or callable(outer)):
            raise TypeError("outer_optimizer must be a torch optimizer over the model's parameters or a "
                            f"callable params -> optimizer, got {type(outer).__name__}")

    after_backward = TrainerMode.after_backward  # (no warm-up)

    def build(self, model, optimizer, scaler=None, max_grad_norm=0.0):
        config = dict(self.config)
        outer = config.pop("outer_optimizer", None)
        if outer is None or not isinstance(outer, torch.optim.Optimizer):
            params = [p for p in model.parameters() if p.requires_grad]
            outer = outer(params) if outer is not None else torch.optim.SGD(params, lr=0.7, momentum=0.9,
                                                                             nesterov=True)
        self.obj = DiLoCo(model, optimizer, outer, **config)
        return optimizer


class _Steered(torch.optim.Optimizer):
    """The trainer's optimizer under gossip: the same param groups, whose hyperparameters the
    trainer's LR scheduler drives; :meth:`step` only runs its ``closure`` (Lightning's
    training step and backward), as each bucket's optimizer is stepped in backward,
    reading its group's ``lr`` first."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        super().__init__([dict(g) for g in optimizer.param_groups], dict(optimizer.defaults))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()


class CalledThrough(nn.Module):
    """The model as the trainer prepared it (compiled), called through gossip's wrapper
    (:meth:`~fastreduce.DecentralizedDataParallel.forward_through`)."""

    def __init__(self, wrapper: DecentralizedDataParallel, prepared: nn.Module):
        super().__init__()
        self.wrapper, self.prepared = wrapper, prepared

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrapper.forward_through(self.prepared, *args, **kwargs)


class Gossip(TrainerMode):
    """Gossip (:class:`~fastreduce.DecentralizedDataParallel`): each bucket's optimizer is the
    trainer's (its class, defaults and the param groups' hyperparameters; the group's ``lr``
    read from the trainer's scheduler at each bucket step), stepped in backward, so the
    trainer's own step does nothing, and the trainer's clipping becomes the mode's
    ``grad_clip_norm`` (per bucket; "auto" is one bucket: this rank's whole gradient)."""

    name, cls = "gossip", DecentralizedDataParallel
    fixed = ("model", "optim_fn", "lr_scheduler_fn", "scaler")
    clips = True
    per_rank = True
    wraps_module = True
    _called: CalledThrough | None = None

    def build(self, model, optimizer, scaler=None, max_grad_norm=0.0):
        if optimizer is None:
            raise ValueError("fastreduce mode 'gossip' builds its optimizers like the trainer's, and there is none yet")
        steered = _Steered(optimizer)
        driven = optimizer if self.optimizer_kept else steered  # the optimizer the LR schedulers drive
        defaults, hypers = rebuild_args(optimizer)
        group_of = {id(p): k for k, g in enumerate(optimizer.param_groups) for p in g["params"]}

        def optim_fn(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
            members: dict[int, list[nn.Parameter]] = {}
            for _, p in named:
                members.setdefault(group_of[id(p)], []).append(p)
            opt = type(optimizer)([{"params": ps, **hypers[k]} for k, ps in members.items()], **defaults)

            def follow(o: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
                for g, k in zip(o.param_groups, members):
                    g["lr"] = driven.param_groups[k]["lr"]

            opt.register_step_pre_hook(follow)
            return opt

        config = {"grad_clip_norm": max_grad_norm or 0.0, **self.config}
        self.obj = DecentralizedDataParallel(model, optim_fn, scaler=scaler, **config)
        return steered

    def module_to_call(self, prepared: nn.Module) -> nn.Module:
        if prepared is self.obj.module:
            return self.obj
        called = self._called  # (asked at every forward under a Membership: ModeModule)
        if called is not None and called.wrapper is self.obj and called.prepared is prepared:
            return called
        if {id(p) for p in prepared.parameters()} != {id(p) for p in self.obj.module.parameters()}:
            raise NotImplementedError("fastreduce mode 'gossip' trains the model it was built over, and the trainer "
                                      "wrapped it in a module of other parameters: unwrap it")
        self._called = CalledThrough(self.obj, prepared)  # the model the trainer compiled, through gossip's wrapper
        return self._called

    def no_sync(self):
        return self.obj.no_sync()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clipped already, per bucket, in backward: the norm before clipping, over the buckets."""
        norms = [n for n in getattr(self.obj, "grad_norms", ()) if n is not None]
        return torch.stack(norms).square().sum().sqrt() if norms else torch.zeros(())

    def settle(self) -> None:
        self.obj.wait_exchanges()  # a bucket's exchange sends its parameter block itself

    def checkpointer(self, directory: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> Checkpointer:
        # the trainer saves its scheduler; the lr it set is in the steered groups, kept per rank
        return Checkpointer(directory, self.obj, None, mode=self.obj, keep=1, extras={"steered": optimizer})

    def _counts(self):
        return {"rounds": self.obj.step, "skipped_steps": self.obj.skipped_steps, "buckets": self.obj.num_buckets,
                **wire_counts(self.obj.stats)}

    def finish(self) -> None:
        self.obj.global_avg()


MODES: dict[str, type[TrainerMode]] = {m.name: m for m in (Fused, Overlap, Zero, Local, Diloco, Gossip)}
"""The trainer modes by name."""


def make_mode(name: str | None, config: Mapping[str, Any] | None, eval_params: str = "mean") -> TrainerMode:
    """The mode ``name`` (``None``: ``fused``, or ``overlap`` where ``config`` says
    ``overlap=True``) with ``config`` checked: ``ValueError`` for an unknown name,
    ``TypeError`` for a setting the mode does not take, the mode's own errors for a bad value;
    ``eval_params`` (:data:`EVAL_PARAMS`; ``"own"`` only in a mode whose ranks hold their own
    parameters, else ``ValueError``)."""
    config = dict(config or {})
    if name is None:
        name = "overlap" if config.pop("overlap", False) else "fused"
    if name not in MODES:
        raise ValueError(f"unknown fastreduce mode {name!r}: choose one of {', '.join(MODES)}")
    if eval_params == "own" and not MODES[name].per_rank:
        raise ValueError(f"fastreduce mode {name!r} keeps the same parameters on every rank, so there are "
                         "no ranks' own parameters to evaluate (eval_params='own'): drop it, or pick a mode "
                         f"whose ranks train their own ({', '.join(n for n, m in MODES.items() if m.per_rank)})")
    return MODES[name](config, eval_params)
