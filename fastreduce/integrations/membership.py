"""The trainers under :class:`fastreduce.Membership`: the trainers' own loop goes on when a
member dies or a replacement joins (issue 49; the loop by hand: ``examples/keep_training.py``).

:class:`~fastreduce.integrations.transformers.FastReduceTrainer` takes
``fastreduce_membership=``, :class:`~fastreduce.integrations.lightning.FastReduceStrategy`
``membership=``: a :class:`fastreduce.Membership` not joined yet. Each member is a plain
process (one per device, not under ``torchrun``, whose agent restarts a host's workers when
one dies), started with the coordinator's address; a replacement is started the same way
and joins by itself. The trainer joins when training starts, with the whole training
state, so that a joiner takes it from a live member.

What the trainer keeps from this module (:class:`TrainerMembership`, one per trainer):

- **The step.** The trainer steps its optimizer through a wrapper,
  :class:`~fastreduce.integrations.committing.CommittingOptimizer` (the HF Trainer is given
  it as its optimizer, Lightning's precision plugin is handed it), whose ``step`` commits
  through :meth:`fastreduce.Membership.commit`; the optimizer itself is not touched. The fused modes reduce right after the backward
  that ends an accumulation window, as outside a Membership (the trainer clips the averaged
  gradients); a reduction that fails on a lost member is raised again inside the commit,
  where the Membership discards the step on every member (or, where another survivor
  completed it, heals this member forward to it). LocalSGD and DiLoCo sync inside
  the step, which the Membership redoes over the survivors; the run's last step also syncs
  every fragment (:meth:`~fastreduce.LocalSGD.sync`), inside the commit, so every member
  ends with the same parameters.
- **A discarded step is no step.** The trainer's global step is the Membership's committed
  step count and its LR schedulers step once per committed step; the HF Trainer makes no
  log, checkpoint, evaluation or stop decision at a discarded one (Lightning may log its
  batch's values under the same step again).
- **The data** (:class:`MembershipSampler`, installed by the trainer in place of its
  training sampler): each data epoch is a seeded permutation of the dataset; every member
  draws, for the step it trains, from the same global position, interleaved by
  :attr:`Membership.rank` over :attr:`Membership.world` of the current epoch, so a new
  epoch re-shards at once; a committed step moves the position past what every member
  drew. A discarded step's samples are drawn again over the survivors (none lost); in
  LocalSGD and DiLoCo a lost member's inner steps since the last sync are lost with it, and
  so are the samples it drew for them.
- **A joiner** is admitted right after a committed step and given the state as the step's
  optimizer update left it; it then does the rest of that step as the members do (its LR
  schedulers step once, its global step is the count committed), so its learning rate at
  each later step equals theirs.
- **No collective outside a commit.** A collective of the trainer's own (Lightning's
  ``barrier``, ``broadcast``, ``reduce`` of ``sync_dist`` logging, its loop's SIGTERM
  broadcast, the evaluation of the ranks' mean parameters, the mode's collective
  checkpoints) would fail on a lost member outside the commit, or wait forever on a joiner
  not there yet: under a Membership the trainer is a world of one to itself and those are
  each member's own (logged metrics are the member's own; evaluation and saved models see
  the member's own parameters; checkpoints are the trainer's own files).

- **ZeRO** (``redundant=True``, set for the trainer): the optimizer the trainer made stays
  the one it steps and its LR schedulers drive, holding no state; the mode's
  :class:`~fastreduce.ZeroOptimizer`, built again at each epoch over the trainer's param
  groups, takes their hyperparameters and steps inside the commit (its members meet between
  the reduce-scatter and the shards' step). The trainer's norm clipping is ZeRO's global norm;
  a loss during it is raised again inside the commit, which discards the step.

- **Gossip**: the trainer calls the current epoch's wrapper through :class:`ModeModule`;
  its buckets step and exchange in the trainer's forward and backward (Lightning's: in its
  closure), whose error on a lost member is kept (the trainer's step goes on with a loss
  that reaches no parameter) and raised again inside the commit, which discards the step;
  each survivor keeps its own state. The run's last step takes every member's exact mean
  (``global_avg``), inside its commit.

Refused under a Membership, with a message: DiLoCo's ``fragment_delay > 0`` with a compressed
wire (a fragment in flight is sent again over the survivors after a loss: a float wire's,
as kept), a run without ``max_steps``
(the steps per data epoch change with the world), an iterable dataset, data-loader worker
processes (they draw ahead of the step), a process launched by ``torchrun``.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Callable, Mapping

import torch

from ..modes.contract import commit_style, meets, membership_settings, settings_refusal, state_scope
from .committing import CommittingOptimizer
from .membership_data import MembershipSampler
from .modes import TrainerMode

__all__ = ["RESUME_UNDER_MEMBERSHIP", "MembershipSampler", "ModeModule", "TrainerMembership", "check_mode",
           "check_plain_process"]

log = logging.getLogger(__name__)

_NOT_HYPER = ("params", "foreach", "fused", "differentiable", "capturable")  # a param group's keys not set by schedules


def check_mode(mode: TrainerMode, who: str) -> None:
    """``ValueError`` for a mode's settings a Membership cannot run (every mode runs under one)."""
    refusal = settings_refusal(mode.cls, mode.config)
    if refusal is not None:
        raise ValueError(f"{who}: {refusal} under fastreduce.Membership")
    if mode.config.get("group") is not None:
        raise ValueError(f"{who}: a mode's own group= does not run under fastreduce.Membership, whose members "
                         "form a new default group at each epoch: drop group=")
    for key, value in membership_settings(mode.cls).items():  # (ZeRO: redundant=True, or a shard dies with its rank)
        if not meets(mode.config.get(key, value), value):
            raise ValueError(f"{who}: under fastreduce.Membership fastreduce mode {mode.name!r} runs with "
                             f"{key}={value!r} (set for you): drop {key}={mode.config[key]!r}")


def check_plain_process(who: str) -> None:
    """``RuntimeError`` where this process was launched by ``torchrun`` (or another launcher
    that sets ``RANK``/``WORLD_SIZE``): a Membership's members are plain processes."""
    if any(int(os.environ.get(k, "1") or 1) > 1 for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE")) or \
            "TORCHELASTIC_RUN_ID" in os.environ:
        raise RuntimeError(f"{who}: this process was launched by torchrun (WORLD_SIZE / TORCHELASTIC_RUN_ID are "
                           "set), but a fastreduce.Membership's members are plain processes, each started on its "
                           "own with the coordinator's address (torchrun's agent restarts every worker of a host "
                           "when one dies): start it with `python train.py`")


# ====================================================================== the trainer's side

class _Booked:
    """The committed steps whose trainer bookkeeping (LR schedulers) is done, healed with the
    state: a joiner admitted right after step k (booked k - 1) does step k's itself."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.steps = int(state["steps"])


class _Seen:
    """A trainer's mode as the Membership sees it: the mode's own state, closed through the
    trainer's side of it (:meth:`TrainerMode.close`)."""

    commit_style = state_scope = ""  # each kind's own, as its modes declare them (modes/contract.py)
    under_join = False  # (a trainer runs no mode under torch's Join)

    def __init__(self, mode: TrainerMode, owner: TrainerMembership):
        self.trainer_mode, self.obj, self.owner = mode, mode.obj, owner

    def state_dict(self) -> dict[str, Any]:
        return self.obj.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.obj.load_state_dict(state)

    def local_state_dict(self) -> dict[str, Any]:  # (gossip's, the local modes': nothing in flight waited for)
        return self.obj.local_state_dict()

    def close(self, drain: bool = True) -> None:
        self.trainer_mode.close(drain)

    @property
    def membership_refusal(self) -> str | None:
        """The mode's own (:func:`~fastreduce.modes.contract.check_membership` asks it)."""
        return getattr(self.obj, "membership_refusal", None)

    @property
    def stats(self) -> Any:
        """The mode's own figures (:func:`~fastreduce.modes.contract.wait_seconds` asks them)."""
        return self.obj.stats


class _Reduced(_Seen):
    """A fused mode: the reduction ran right after backward (before the trainer clipped);
    :meth:`reduce` raises its error again, if any, inside the commit."""

    commit_style, state_scope = "reduce", "replicated"

    def reduce(self) -> None:
        self.owner.raise_kept()


class _Gossiped(_Seen):
    """Gossip: its bucket steps and exchanges ran in the trainer's forward and backward (the
    trainer calls :class:`ModeModule`); the commit raises their error again, if any, and at
    a loss each survivor keeps its own state, the exchanges in flight dropped."""

    commit_style, state_scope = "gossip", "per_rank"

    def set_round(self, round_: int) -> None:
        self.obj.set_round(round_)


class ModeModule(torch.nn.Module):
    """What a trainer calls under a Membership where the mode trains through a wrapper of its
    own (gossip), which the Membership builds again at each epoch: each call goes through the
    current epoch's wrapper (:meth:`TrainerMode.module_to_call`). ``module`` is the model."""

    def __init__(self, module: torch.nn.Module, mode: TrainerMode):
        super().__init__()
        self.module, self.trainer_mode = module, mode

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        mode = self.trainer_mode
        return (self.module if mode.obj is None else mode.module_to_call(self.module))(*args, **kwargs)


class _Local(_Seen):
    """LocalSGD or DiLoCo: the run's last step communicates too (every fragment synced inside
    its commit)."""

    commit_style, state_scope = "local", "per_rank"

    @property
    def steps(self) -> int:
        return self.obj.steps

    def communicates_at(self, s: int) -> bool:
        return self.obj.communicates_at(s) or self.owner.pending == self.owner.last_step

    def sync(self) -> None:
        self.obj.sync()

    def keep_sent(self) -> None:
        self.obj.keep_sent()


RESUME_UNDER_MEMBERSHIP = (
    "under fastreduce.Membership a trainer's own checkpoint holds the whole job in the HF Trainer's fused and "
    "overlapped modes only (ZeRO's shards and the per-rank modes' state are each member's own, and Lightning's file "
    "keeps no job position): give the Membership checkpoints=fastreduce.JobCheckpoints(directory, every=N) and start "
    "the new job on that directory, without resume_from_checkpoint or ckpt_path: it resumes from the job's newest "
    "save, in every mode")
"""Why a trainer under a Membership refuses to resume its own checkpoint where that does not
hold the job (asked by both trainers); the job's own checkpoints resume in every mode."""


class TrainerMembership:
    """One trainer's side of a :class:`fastreduce.Membership` (see the module doc).

    Args:
        membership: the :class:`fastreduce.Membership`, not joined yet.
        mode: the trainer's :class:`~fastreduce.integrations.modes.TrainerMode`.
        who: the trainer's class name, for messages.
    """

    def __init__(self, membership: Any, mode: TrainerMode, who: str):
        from ..membership import Membership

        if not isinstance(membership, Membership):
            raise TypeError(f"{who}: the membership must be a fastreduce.Membership, got {type(membership).__name__}")
        if membership.epoch is not None:
            raise ValueError(f"{who}: the fastreduce.Membership has joined already; the trainer joins it when "
                             "training starts (with the model, optimizer, LR schedulers and data position)")
        check_mode(mode, who)
        self.m, self.mode, self.who = membership, mode, who
        self.failed: RuntimeError | None = None  # the fused reduction's error, raised again in the commit
        self.committed: bool | None = None  # whether the last optimizer step was committed
        self.pending = 0  # the step being committed
        self.last_step = 0  # the run's last step (max_steps)
        self.sampler: MembershipSampler | None = None
        self.booked = _Booked()
        self.schedulers: list[Any] = []
        self.joined_at: int | None = None  # the committed step this process joined at
        self._schedules: tuple[list[Any], list[Any]] = ([], [])  # the LR schedulers before a discarded step
        self._build_args: tuple[Any, ...] = ()
        self._resumed: dict[str, Any] | None = None  # the job's position in the checkpoint resumed (resume())

    # ------------------------------------------------------------------ set-up

    def make_sampler(self, dataset: Any, *, step_samples: int, seed: int, sized: bool,
                     num_workers: int = 0) -> MembershipSampler:
        if num_workers:
            raise ValueError(f"{self.who}: data-loader worker processes (num_workers={num_workers}) draw batches "
                             "ahead of the step, but under fastreduce.Membership the samples of a step are drawn "
                             "once the previous step is committed or discarded (so that a new epoch re-shards "
                             "at once): use 0 workers")
        if not hasattr(dataset, "__len__") or isinstance(dataset, torch.utils.data.IterableDataset):
            raise ValueError(f"{self.who}: an iterable dataset cannot be re-sharded when members come and go under "
                             "fastreduce.Membership: use a map-style dataset (with __len__ and __getitem__)")
        self.sampler = MembershipSampler(dataset, self.m, step_samples=step_samples, world_size=self.m.settings.world_size,
                                         seed=seed, sized=sized)
        return self.sampler

    def join(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, schedulers: list[Any], *,
             last_step: int, scaler: Any = None, max_grad_norm: float = 0.0,
             on_epoch: Callable[[], None] | None = None) -> int:
        """Join the job with the trainer's state; every epoch's mode is built over
        ``model`` and ``optimizer`` (the trainer steps it through :class:`CommittingOptimizer`).
        Returns the committed step count (a joiner's is the members')."""
        if self.sampler is None:
            raise RuntimeError(f"{self.who}: no MembershipSampler: the trainer did not make its training data loader")
        if last_step <= 0:
            raise ValueError(f"{self.who}: under fastreduce.Membership the run's length is its number of committed "
                             "optimizer steps (the LR schedule is over it, and the steps in a data epoch change "
                             "with the world): set max_steps")
        if scaler is not None:  # (a CommittingOptimizer the scaler did not step commits nothing on that rank)
            raise ValueError(f"{self.who}: fp16 with a GradScaler does not run under fastreduce.Membership: the "
                             "scaler skips the optimizer's step on a member whose gradients overflowed, where every "
                             "member must commit it (and the trainer counts a step the job did not commit): train "
                             "in bf16 (bf16=True, precision='bf16-mixed') or fp32")
        self.last_step, self.schedulers = last_step, [s for s in schedulers if s is not None]
        self._build_args = (model, optimizer, scaler, max_grad_norm, on_epoch)
        for key, value in membership_settings(self.mode.cls).items():  # (ZeRO's redundant=2 kept as given)
            self.mode.config.setdefault(key, value)
        self.mode.failures, self.mode.optimizer_kept = self.keep, True
        state: dict[str, Any] = {"model": model, "optimizer": optimizer, "data": self.sampler, "booked": self.booked}
        state.update({f"scheduler{k}": s for k, s in enumerate(self.schedulers)})
        start = 0
        if self._resumed is not None:  # the trainer loaded the rest (model, optimizer, schedulers)
            start = self.booked.steps = int(self._resumed["step"])
            self.sampler.load_state_dict(self._resumed["data"])
        self.m.join(state, self._build, start_step=start)
        self.joined_at = self.m.step
        self._catch_up()
        return self.m.step

    def _catch_up(self) -> None:
        """Admitted right after a committed step (joining, or joining again: left out of an
        epoch), with the members' state from before their trainers stepped its schedulers:
        do the rest of that step here."""
        if self.m.step > self.booked.steps:
            with warnings.catch_warnings():  # torch's: a scheduler stepped before its optimizer here
                warnings.simplefilter("ignore", UserWarning)
                for sched in self.schedulers:
                    sched.step()
            self.booked.steps = self.m.step

    def state_dict(self) -> dict[str, Any]:
        """What a trainer's checkpoint keeps of the job beside its own files (the model, the
        optimizer, the schedulers): the committed steps and the data stream's position."""
        return {"step": self.m.step, "data": self.sampler.state_dict() if self.sampler is not None else None}

    def resume(self, saved: dict[str, Any], checkpoint: str) -> None:
        """The job starts from a trainer's checkpoint (``saved``: its :meth:`state_dict`, read
        from ``checkpoint``): the first members at its committed steps and data position (a
        joiner takes the members'), once the trainer (the HF Trainer's; Lightning refuses
        its own) has loaded the rest. Refused, before anything joins, where the mode's state
        is not all in that checkpoint (its scope is not ``replicated``)."""
        if state_scope(self.mode.cls) != "replicated":
            raise ValueError(f"{self.who}: {RESUME_UNDER_MEMBERSHIP}")
        if not isinstance(saved, dict) or saved.get("data") is None or "step" not in saved:
            raise ValueError(f"{self.who}: {checkpoint} holds no fastreduce job position: it was not saved under a "
                             "fastreduce.Membership; resume it without one")
        self._resumed = saved

    def _build(self) -> Any:
        """The mode over this epoch's group (the Membership calls it at every new epoch)."""
        model, optimizer, scaler, max_grad_norm, on_epoch = self._build_args
        self.mode.obj = None
        self.mode.build(model, optimizer, scaler, max_grad_norm)
        self.mode.start_figures(self.m.step)
        if on_epoch is not None:
            on_epoch()
        style = commit_style(self.mode.obj)
        if style == "zero":  # the Membership runs the ZeroOptimizer itself (its meeting, its shards)
            return self.mode.obj
        return {"local": _Local, "gossip": _Gossiped}.get(style, _Reduced)(self.mode, self)

    def keep(self, err: RuntimeError) -> None:
        """A failure of the mode's clipping (ZeRO's global norm, a collective), kept for the
        commit, which discards the step, instead of raised inside the trainer."""
        self.failed = err

    def optimizer(self, optimizer: torch.optim.Optimizer) -> CommittingOptimizer:
        """``optimizer`` as the trainer is to step it: each step through :meth:`commit`."""
        return CommittingOptimizer(optimizer, self.commit)

    def raise_kept(self) -> None:
        """In the commit: the failure kept from the trainer's forward, backward or clipping
        (a lost member), raised again where the Membership discards the step."""
        err, self.failed = self.failed, None
        if err is not None:
            raise err

    def _zero_step(self) -> None:
        """ZeRO's step in the commit: a failure kept from clipping first (before the members
        meet: the step is discarded); the hyperparameters of the trainer's optimizer (its LR schedulers'),
        then the mode's step."""
        self.raise_kept()
        facade = self._build_args[1]
        zero = self.mode.obj
        for ours, theirs in zip(zero.param_groups, [g for g in facade.param_groups if g["params"]]):
            ours.update({k: v for k, v in theirs.items() if k in ours and k not in _NOT_HYPER})
        zero.step()

    # ------------------------------------------------------------------ every step

    def after_backward(self) -> None:
        """The mode's work after the backward that ends an accumulation window; a failure on
        a lost member is kept for the commit (the trainer clips and steps first)."""
        try:
            self.mode.after_backward()
        except RuntimeError as err:
            self.failed = err

    def commit(self, real_step: Callable[[], Any]) -> bool:
        """The optimizer's step through the Membership: committed on every member or none."""
        self.pending = self.m.step + 1
        sampler, pending, rejoins = self.sampler, self.pending, self.m.counters.rejoins

        def step() -> None:
            style = commit_style(self.mode.obj)
            if style == "zero":
                self._zero_step()
            elif style == "gossip":  # its buckets stepped in backward: the trainer's step is none
                self.raise_kept()
            else:
                real_step()
            if pending == self.last_step:  # the run's end: every member's parameters the same
                if style == "local":
                    self.m.mode.sync()
                elif style == "gossip":
                    self.mode.obj.global_avg()
            sampler.advance(pending)

        try:
            self.committed = self.m.commit(step)
            if self.committed:  # (ZeRO: a member whose meeting failed steps its held shards as the next
                sampler.advance(pending)  # epoch forms, its closure ended there; once per step)
        finally:
            self.failed = None
            sampler.redraw()
        if self.m.counters.rejoins != rejoins:  # left out of an epoch and in the job again: the members' state
            self._catch_up()
        if self.committed and self.m.step == self.last_step:  # the run's end, before the trainer saves anything
            self.m.confirm()  # (MembershipError: cut off, its steps not the job's)
        if self.committed:
            self.booked.steps = self.m.step  # the trainer steps its schedulers next
        else:  # discarded: the trainer steps them next all the same; kept as they are, to put back
            self._schedules = ([sched.state_dict() for sched in self.schedulers],
                               [g["lr"] for g in self._build_args[1].param_groups])
        return self.committed

    def undo_schedulers(self) -> None:
        """After a discarded step, from the trainer's step-end hook: the trainer stepped its LR
        schedulers as after any step (it knows of no discarded one); they, and the learning
        rates they set, go back to what they were before it (their classes untouched)."""
        states, lrs = self._schedules
        for sched, state in zip(self.schedulers, states):
            sched.load_state_dict(state)
        for group, lr in zip(self._build_args[1].param_groups, lrs):
            group["lr"] = lr

    def figures(self) -> dict[str, float]:
        """The Membership's figures for the trainer's log."""
        c = self.m.counters
        return {"fastreduce/world": float(self.m.world), "fastreduce/membership_epoch": float(self.m.epoch.number),
                "fastreduce/discarded_steps": float(c.discarded_steps), "fastreduce/losses": float(c.losses),
                "fastreduce/joins": float(c.joins), "fastreduce/resyncs": float(c.resyncs),
                "fastreduce/rejoins": float(c.rejoins)}
