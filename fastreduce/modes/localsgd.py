"""LocalSGD: periodic model averaging, post-local SGD and hierarchical averaging, on the
local-update mechanism (:mod:`.local`).

Communication pattern (step ``s`` counts the inner optimizer's steps from 1)::

    steps s <= warmup_steps:   pre-step hook: the gradients are averaged (the fused
                               reducer), as DDP would: parameters and optimizer state
                               stay identical on every rank
    after step s, (s - warmup_steps) % H == 0:
                               the parameters := their mean over the group (one
                               all-reduce per dtype, in place: the parameters are views
                               of the communication layer's buffer), and the float
                               buffers (BatchNorm statistics) too; with ``hierarchy``,
                               the group of the longest period dividing the count
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..checks import check_int
from ..codecs.quant import check_wire
from ..codecs.sparse import SparseLoCo
from ..comm import Comm, get_comm, resolve_transport
from ..engine import require_distributed
from ..faults import all_reduce_watched, guarded
from ..grads import NonFinite, agree_first, check_nonfinite, first_nonfinite, nonfinite_error, one_device
from ..hooks import on_grad_ready, on_step, remove_hooks
from .local import BUFFERS, SYNC_LOST, LocalUpdates, check_inner, trainable

__all__ = ["LocalSGD"]

log = logging.getLogger(__name__)

def _levels(hierarchy: dict[int, int] | None, sync_every: int, world: int) -> list[tuple[int, int]]:
    """``[(period, group size), ...]`` by period, the world's last, checked."""
    if hierarchy is None:
        return [(sync_every, world)]
    if not isinstance(hierarchy, dict) or not hierarchy:
        raise ValueError(f"hierarchy must be a non-empty {{period: group_size}} dict, got {hierarchy!r}")
    levels = sorted((check_int("a hierarchy period", p, 1), check_int("a hierarchy group size", g, 1))
                    for p, g in hierarchy.items())
    for _, g in levels:
        if world % g:
            raise ValueError(f"hierarchy: group size {g} does not divide the world ({world} ranks)")
    if levels[-1][1] == world:
        if levels[-1][0] != sync_every:
            raise ValueError(f"hierarchy averages the whole world ({world} ranks) every {levels[-1][0]} steps "
                             f"but sync_every is {sync_every}; make them agree (or leave the world out of "
                             "hierarchy: it then averages every sync_every steps)")
    else:
        levels.append((sync_every, world))
    for (p0, g0), (p1, g1) in zip(levels, levels[1:]):
        if p1 <= p0:
            raise ValueError(f"hierarchy: periods must grow with the group size; {g0} ranks every {p0} steps "
                             f"and {g1} ranks every {p1}")
        if g1 <= g0 or g1 % g0:
            raise ValueError(f"hierarchy: each group size must divide the next larger one and the world "
                             f"({world} ranks); got {g0} then {g1}")
    return levels


_subgroups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> {size: this rank's subgroup}


def _subgroup(group: dist.ProcessGroup | None, size: int) -> dist.ProcessGroup | None:
    """The group of ``size`` consecutive ranks of ``group`` this rank belongs to (as
    torch's ``new_subgroups``); only that group's ranks take part in making it. Made once
    per group and size, for every LocalSGD built on them: torch keeps a group until it is
    destroyed (with the default group), and a new one per build kept its sockets and
    threads for the process's life. (Not destroyed here: torch names a group made with
    ``use_local_synchronization`` by its ranks and the count of groups this process holds,
    torch 2.13, so a group destroyed at a moment that is not the same on every rank, as
    when its parent is let go of, would have the next one named apart on the ranks, each
    then waiting for the others for good.)"""
    world = dist.get_world_size(group)
    if size == world:
        return group
    parent = group or dist.group.WORLD
    made = _subgroups.setdefault(parent, {})
    if size not in made:
        start = dist.get_rank(group) // size * size
        ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(start, start + size)]
        made[size] = dist.new_group(ranks, use_local_synchronization=True)
    return made[size]


class LocalSGD(LocalUpdates):
    """Local SGD: each rank steps on its own, the parameters are averaged every ``sync_every`` steps.

    Args:
        model: the module every rank trains (its trainable parameters and float buffers
            are averaged).
        optimizer: the rank's optimizer over the model's parameters; its ``step()``
            drives the mode (step hooks). A ``GradScaler`` calls it every time (the mode
            marks it as an optimizer that unscales itself: :mod:`.local_scaler`), and an
            inf skips its update on that rank, counted in :attr:`skipped_steps`.
        sync_every: average after every ``sync_every``-th step (``H``).
        warmup_steps: the first steps are synchronous data parallel (post-local SGD):
            the gradients are averaged before each of them, as DDP does.
        group: process group (default: the world).
        hierarchy: ``{period: group_size}`` as torch's ``HierarchicalModelAverager``:
            groups of that many consecutive ranks average every ``period`` steps; at a
            count divisible by several periods the largest group does. The world's entry
            may be left out (it then averages every ``sync_every`` steps).
        wire_dtype: ``None``: the parameters are averaged in their own dtype, in place.
            A narrower float (``torch.bfloat16``): the change since the last average is
            sent in it and added to a full-precision copy of the last averaged
            parameters (one more model's worth of memory), so the parameters are never
            rounded to it. Not with ``hierarchy``. A quantized wire
            (``torch.float8_e4m3fn``, ``torch.float8_e5m2``, ``"int8"``, ``"int4"``) sends
            that change encoded, as :class:`~fastreduce.DiLoCo` does.
        error_feedback: with a quantized wire, what the encodings rounded away is added
            to the next sync's change (:class:`~fastreduce.DiLoCo`'s ``error_feedback``).
        compression: ``fastreduce.SparseLoCo(...)``: the change since the last average
            goes through a per-rank error-feedback accumulator and only each chunk's top-k
            entries, in a few bits, travel (an all-gather; :mod:`fastreduce.codecs.sparse`);
            ``x := last average - mean``. Kept in fp32 beside the parameters, as with a
            narrow ``wire_dtype`` (which it replaces). Not with ``hierarchy``.
        buffers: ``average`` (float buffers averaged with the parameters) or ``local``.
        transport: the communication layer's transport (default ``$FASTREDUCE_TRANSPORT``
            or ``auto``).
        nonfinite: inf/NaN: ``ignore`` (no check), ``skip`` or ``raise``. An inner step
            (no communication) checks this rank's gradients (one fused kernel per dtype):
            ``skip`` skips it on this rank (parameters and optimizer state untouched,
            :attr:`skipped_steps` counts it) and still counts the step, so the syncs stay
            matched; ``raise`` does the same, then raises
            :class:`~fastreduce.NonFiniteGradError` on this rank only. A warm-up step
            checks the averaged gradients (the fused reducer's check): every rank skips
            or raises alike. A sync checks what is averaged, the same on every rank: with
            ``wire_dtype`` the averaged change (``skip``: every rank returns to the last
            averaged parameters, the codec's state as before the sync); without, each
            rank's parameters before the in-place average, agreed by a one-element MAX
            all-reduce per sync (``skip``: no rank averages, each keeps its own);
            ``raise`` raises on every rank.
            :attr:`skipped_syncs` counts skipped syncs.

    Example::

        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> local = fastreduce.LocalSGD(model, opt, sync_every=8, warmup_steps=100)
        >>> for x, y in batches:
        ...     loss_fn(model(x), y).backward()
        ...     opt.step()          # every 8th step (after 100 synchronous ones) averages
        ...     opt.zero_grad()
    """

    mode_name = "local"  # (modes/contract.py)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, sync_every: int, *,
                 warmup_steps: int = 0, group: dist.ProcessGroup | None = None,
                 hierarchy: dict[int, int] | None = None, wire_dtype: torch.dtype | None = None,
                 buffers: str = "average", transport: str | None = None, nonfinite: NonFinite = "ignore",
                 compression: SparseLoCo | None = None, error_feedback: bool = False):
        self.sync_every = check_int("sync_every", sync_every, 1)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self.nonfinite = check_nonfinite(nonfinite)
        if buffers not in BUFFERS:
            raise ValueError(f"buffers must be one of {BUFFERS}, got {buffers!r}")
        require_distributed()
        self._named = trainable(model)
        check_inner(model, optimizer, "optimizer")
        own = {p.dtype for _, p in self._named}
        quant = check_wire(wire_dtype, "LocalSGD", int4=True, compression=compression,
                           error_feedback=error_feedback)
        if compression is not None and not isinstance(compression, SparseLoCo):
            raise ValueError(f"compression must be None or a fastreduce.SparseLoCo(...), got "
                             f"{type(compression).__name__}")
        if compression is not None:
            wire_dtype = torch.float32  # the change since the last average, staged in fp32 for the codec
        self._delta = compression is not None or (wire_dtype is not None and own != {wire_dtype})
        world = dist.get_world_size(group)
        self._level_sizes = _levels(hierarchy, self.sync_every, world)
        if self._delta and len(self._level_sizes) > 1:
            raise ValueError("a wire_dtype other than the parameters' (or compression=) works without hierarchy "
                             "only: each level would need its own copy of the last averaged parameters")
        # Checked: from here on the model changes. The world's Comm (the transport's checks) before any subgroup.
        device = one_device(self._named)
        comms = {size: get_comm(_subgroup(group, size), device, transport) for _, size in self._level_sizes[::-1]}
        self._levels = [(period, comms[size]) for period, size in self._level_sizes]
        self._setup(model, optimizer, group=group, wire_dtype=wire_dtype if self._delta else None,
                    accumulate_dtype=None, buffers=buffers, fragments=1, backup_device=None,
                    transport=transport, scratch=False, compression=compression, quant=quant,
                    error_feedback=error_feedback)
        self._reducer, self._transport = None, transport
        self._warm_reduced = False  # this backward's warm-up average done (average_warmup_grads)
        self._warm_hooks: list[Any] = []  # gradient hooks: a new backward's gradients undo the mark
        if self.warmup_steps:
            self._start_warmup()
        self._guard_steps()
        if self.rank == 0:
            log.info("fastreduce: LocalSGD: %s; average every %s, warm-up %d steps, %d ranks",
                     self.layout.describe(), ", ".join(f"{p} steps over {g} ranks" for p, g in self._level_sizes),
                     self.warmup_steps, self.world_size)

    def _join_check(self) -> None:
        if len(self._levels) > 1:
            raise ValueError("LocalSGD with hierarchy cannot run under Join: its subgroup averages "
                             "would need the active count of each subgroup; use one level (no "
                             "hierarchy) or give every rank the same number of batches")

    def _param_alloc(self) -> Callable[[int, torch.dtype], torch.Tensor]:
        return self._buffer_of(self._levels[0][1])  # the most frequent level's transport holds them

    # ------------------------------------------------------------------ public

    @guarded("{cls}.sync()", SYNC_LOST)
    @torch.no_grad()
    def sync(self) -> None:
        """Average the parameters (and float buffers) over the whole group now (collective)."""
        self._check_model()
        self._sync(self._levels[-1][1])

    def communicates_at(self, s: int) -> bool:
        """Whether inner step ``s`` (counted from 1) runs a collective: a warm-up step (its
        gradient average), or a sync at some level (:class:`fastreduce.Membership` puts a
        commit vote at those steps only)."""
        return s <= self.warmup_steps or any((s - self.warmup_steps) % p == 0 for p, _ in self._levels)

    def state_dict(self) -> dict[str, Any]:
        """Everything to resume exactly: the step count (warm-up included), this rank's
        parameters and, with a narrow ``wire_dtype``, the last averaged ones."""
        return {**self._header(), **self._state()}

    def _header(self) -> dict[str, Any]:
        return {"mode": "LocalSGD", "sync_every": self.sync_every, "warmup_steps": self.warmup_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (build the model, optimizer and mode first)."""
        if state_dict.get("mode") != "LocalSGD":
            raise ValueError(f"not a LocalSGD state_dict (mode {state_dict.get('mode')!r})")
        self._load(state_dict)
        if self.steps >= self.warmup_steps and self._reducer is not None:
            self._end_warmup()
        elif self.steps < self.warmup_steps and self._reducer is None:  # (a mode past its warm-up: back in it)
            self._start_warmup()
            # the inf/NaN check after the warm-up's average, as at construction ([Note: skipping an inner step])
            remove_hooks(self._nonfinite_hooks)
            self._nonfinite_hooks = on_step(self.optimizer, pre=self._check_step, post=self._raise_step_error)

    # ------------------------------------------------------------------ hooks

    def average_warmup_grads(self) -> None:
        """In the warm-up, this step's gradient average now, not at the optimizer's step: a
        trainer calls it after the backward, so that its clipping sees the average (DDP's
        clip(mean g), not mean(clip g)); the step then averages nothing again. Collective;
        outside the warm-up, nothing. The average is of this backward's gradients: where
        the loop does not step after it, the next backward's first gradient undoes the
        mark, and the next call (or step) averages again. Under a ``GradScaler`` the
        gradients it averages are still scaled: every rank's scale must be the same (it is
        where every warm-up step calls this, so that the scaler checks the average)."""
        if not self._warm_reduced:
            self._warm_reduced = self._reduce_warmup()
            if self._warm_reduced and not self._warm_hooks:  # on first use: a loop without it pays nothing
                self._warm_hooks = on_grad_ready([p for _, p in self._named], self._new_backward)
                self._hooks += self._warm_hooks  # (taken off with the warm-up's hooks, or by close())

    def _new_backward(self, _i: int) -> None:
        """A gradient of a backward after :meth:`average_warmup_grads`: that average (and
        its verdict on inf/NaN) is of gradients this backward adds to."""
        if self._warm_reduced:
            self._warm_reduced = False
            self._warm_verdict = None

    def _before_step(self, _optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if not self._warm_reduced and self._reduce_warmup():  # a scaler's inf flag: now the average's
            self._rechecked([p.grad for _, p in self._named if p.grad is not None])
        self._warm_reduced = False

    def _reduce_warmup(self) -> bool:
        """The warm-up's gradient average (``False`` past the warm-up: nothing done)."""
        if self._reducer is not None and self.steps < self.warmup_steps:
            self._check_model()  # (before the reducer's own check, which would say rebuild() it)
            st = self._reducer.stats
            sent, waited = st.bytes_reduced, st.wait_seconds
            finite = self._reducer.reduce()  # nonfinite="raise": raises here, on every rank
            self.stats.wire_bytes += st.bytes_reduced - sent  # the warm-up's average, in this mode's counters
            self.stats.wait_seconds += st.wait_seconds - waited
            if self.nonfinite != "ignore":
                self._warm_verdict = finite  # the same on every rank: skip (or not) alike
            self._reducer.scale_grads(self._join_factor())  # under Join
            return True
        return False

    def _after_step(self, s: int) -> None:
        if s <= self.warmup_steps:
            self._average_buffers(self._levels[-1][1])
            if s == self.warmup_steps:
                self._end_warmup()
            return
        count = s - self.warmup_steps
        for period, comm in reversed(self._levels):
            if count % period == 0:
                self._sync(comm)
                return

    def _start_warmup(self) -> None:
        """The fused mode averages the warm-up's gradients, before each optimizer step."""
        from .fused import FusedReducer

        self._reducer = FusedReducer(self.model, group=self.group, wire_dtype=None, nonfinite=self.nonfinite,
                                     transport=resolve_transport(self._transport))
        self._hooks += on_step(self.optimizer, pre=self._before_step)

    def _end_warmup(self) -> None:
        self._close_reducer()
        remove_hooks(self._hooks[1:])
        del self._hooks[1:]
        self._warm_hooks = []

    def _close_reducer(self) -> None:
        """The warm-up's reducer off the model (its forward pre-hook, its gradient hooks);
        its buffer is freed with the last grads that view it."""
        if self._reducer is not None:
            self._reducer.close()  # (it waits for every reduction it launches: nothing in flight)
            self._reducer = None

    def close(self, drain: bool = True) -> None:
        super().close(drain)
        self._close_reducer()  # closed in its warm-up

    def _sync(self, comm: Comm) -> None:
        if self._delta:  # x - anchor in the wire dtype, into x itself: x is replaced next
            self._launch(0)
            self._land(0)
        elif self._params_finite(comm):
            self._average(self._whole_flats(), comm)
            self.syncs += 1
        self._average_buffers(comm)

    def _params_finite(self, comm: Comm) -> bool:
        """``nonfinite``, for parameters averaged in place (no anchor to return to): one
        fused check of this rank's parameter blocks and a one-element MAX all-reduce over
        ``comm``'s group before the average (once per sync, every ``sync_every`` steps),
        so every rank decides alike and, if any rank's parameters hold inf/NaN, every
        rank skips the sync and keeps its own parameters."""
        if self.nonfinite == "ignore":
            return True
        flag = self._check.flag(self._whole_flats())
        all_reduce_watched(flag, dist.ReduceOp.MAX, comm.group)
        if not flag.item():
            return True
        self.skipped_syncs += 1
        if self.nonfinite == "skip":
            log.warning("fastreduce: LocalSGD: some rank's parameters hold inf or NaN; the sync is skipped on "
                        "every rank, each keeps its own parameters (nonfinite='skip')")
            return False
        i = agree_first(first_nonfinite([p for _, p in self._named]), len(self._named), comm.group, self.device)
        raise nonfinite_error("some rank's parameters", None if i is None else self._named[i][0],
                              "the sync did not run on any rank: each keeps its own parameters.")

    def _apply(self, k: int, mix: bool) -> None:
        """``x := anchor - mean(anchor - x)``; ``anchor := x``."""
        for j in self._frag_segments[k]:
            x, a = self._flats[j], self._anchor[j]
            x.copy_(self._wire[j])
            torch.sub(a, x, out=x)
            a.copy_(x)
