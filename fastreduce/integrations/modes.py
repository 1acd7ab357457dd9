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

import contextlib
import dataclasses
import inspect
import time
from typing import Any, Callable, ClassVar, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint import Checkpointer
from ..modes.comm_stats import CommStats
from ..modes.diloco import DiLoCo
from ..modes.fused import FusedReducer, ReducerConfig
from ..modes.gossip import DecentralizedDataParallel
from ..modes.localsgd import LocalSGD
from ..modes.zero import ZeroOptimizer

__all__ = ["EVAL_PARAMS", "MODES", "TrainerMode", "make_mode"]

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
        if eval_params == "own" and not self.per_rank:
            raise ValueError(f"fastreduce mode {self.name!r} keeps the same parameters on every rank, so there are "
                             "no ranks' own parameters to evaluate (eval_params='own'): drop it, or pick a mode "
                             f"whose ranks train their own ({', '.join(m.name for m in _per_rank())})")
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
            dist.all_reduce(mean, group=group)  # one collective, not one per tensor
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

    def close(self, drain: bool = True) -> None:
        if self.obj is not None:
            self.obj.close(drain)


class Overlap(Fused):
    name = "overlap"
    overlap = True


def _wire(stats: CommStats) -> dict[str, float]:
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
        return {"buckets": self.obj.num_buckets, "skipped_steps": self.obj.skipped_steps, **_wire(self.obj.stats)}

    def finish(self) -> None:
        self.obj.wait_params()


class Local(TrainerMode):
    name, cls = "localsgd", LocalSGD
    fixed = ("model", "optimizer")
    per_rank = True

    def build(self, model, optimizer, scaler=None, max_grad_norm=0.0):
        self.obj = LocalSGD(model, optimizer, **self.config)
        return optimizer

    def _counts(self):
        m = self.obj
        return {"syncs": m.syncs, "skipped_steps": m.skipped_steps, "skipped_syncs": m.skipped_syncs,
                **_wire(m.stats)}

    def close(self, drain: bool = True) -> None:
        if self.obj is not None:
            self.obj.close(drain)


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
        if {id(p) for p in prepared.parameters()} != {id(p) for p in self.obj.module.parameters()}:
            raise NotImplementedError("fastreduce mode 'gossip' trains the model it was built over, and the trainer "
                                      "wrapped it in a module of other parameters: unwrap it")
        return CalledThrough(self.obj, prepared)  # the model the trainer compiled, called through gossip's wrapper

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
                **_wire(self.obj.stats)}

    def finish(self) -> None:
        self.obj.global_avg()

    def close(self, drain: bool = True) -> None:
        if self.obj is not None:
            self.obj.close(drain)


MODES: dict[str, type[TrainerMode]] = {m.name: m for m in (Fused, Overlap, Zero, Local, Diloco, Gossip)}
"""The trainer modes by name."""


def _per_rank() -> list[type[TrainerMode]]:
    return [m for m in MODES.values() if m.per_rank]


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
    return MODES[name](config, eval_params)
