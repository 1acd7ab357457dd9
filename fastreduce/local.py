"""Local-update data parallelism: every rank steps on its own, and the ranks average now and then.

Two modes on one mechanism, both driven by the inner optimizer's ``step()`` (step hooks:
nothing else for the user to call). Step ``s`` counts the inner optimizer's steps from 1.

:class:`LocalSGD` (periodic model averaging; post-local SGD; hierarchical averaging)::

    steps s <= warmup_steps:   pre-step hook: the gradients are averaged (the fused
                               reducer), as DDP would: parameters and optimizer state
                               stay identical on every rank
    after step s, (s - warmup_steps) % H == 0:
                               the parameters := their mean over the group (one
                               all-reduce per dtype, in place: the parameters are views
                               of the communication layer's buffer), and the float
                               buffers (BatchNorm statistics) too; with ``hierarchy``,
                               the group of the longest period dividing the count

:class:`DiLoCo` (Douillard et al. 2023; streaming fragments after Douillard et al. 2025)::

    after step s, fragment k launched (s = t_k - tau mod H):
                               delta_k := anchor_k - x_k (the pseudo-gradient), cast to
                               the wire dtype, averaging all-reduce started (async)
    after step s = t_k mod H:  wait; x_k := anchor_k; x_k.grad := mean delta_k; the outer
                               optimizer steps fragment k; anchor_k := x_k;
                               x_k := alpha * (x_k before) + (1 - alpha) * x_k

with ``t_k = (k + 1) H / F`` (``F`` fragments, staggered; ``F = 1``: every ``H``). With
``fragment_delay = tau > 0`` the all-reduce runs during the ``tau`` inner steps before
it is applied. At most one fragment is on the wire at a time (``tau < H / F``).

What both keep, beside the model (``P`` = the trainable parameters' bytes):

* the parameters, as views of one flat block per dtype (no copy, no per-sync
  allocation: every sync is a constant number of flat ops, however many tensors);
* ``anchor``, the last synced parameters (DiLoCo, and LocalSGD with a low-precision
  ``wire_dtype``): ``P``, on the parameters' device unless ``backup_device="cpu"``;
* a wire buffer of the largest fragment in the wire dtype (bf16: ``P / 2F``);
* a scratch block of the largest fragment, only where the pseudo-gradient must be
  computed beside the live parameters (``fragment_delay > 0``, ``fragment_alpha > 0``,
  an anchor on the CPU).

Unlike torch's averagers (``PeriodicModelAverager``, ``HierarchicalModelAverager``,
``PostLocalSGDOptimizer``): no flattening into a new buffer per sync and no device
synchronization, float buffers averaged too, the step counter and warm-up saved with
:meth:`state_dict` (pytorch#74556), one ``warmup_steps`` argument (no second one to keep
in agreement, PR #73285's review), and warm-up is true DDP (averaged gradients). Unlike
torchft's DiLoCo: any device, the anchor on the parameters' device by default, the
pseudo-gradient's sign pinned by a test against the paper's equations.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from .buffer import TensorBlock, _view, params_as_views
from .faults import guarded
from .comm import Comm, Pending, complete, get_comm, resolve_transport
from .grads import (FiniteCheck, NonFinite, NonFiniteGradError, agree_first, check_nonfinite, first_nonfinite,
                    nonfinite_error, one_device, start_from_rank0)
from .join import JoinableMode
from .layout import GradLayout, verify_model
from .overlap import remove_hooks

__all__ = ["DiLoCo", "LocalSGD"]

log = logging.getLogger(__name__)

BUFFERS = ("average", "local")


# ---------------------------------------------------------------------- checks


def _check_int(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return value


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("no parameter of the model requires grad: nothing to train")
    return named


def _optimizer_params(optimizer: torch.optim.Optimizer, what: str) -> list[torch.Tensor]:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{what} must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return [p for g in optimizer.param_groups for p in g["params"]]


def _check_inner(model: nn.Module, optimizer: torch.optim.Optimizer, what: str) -> None:
    ours = {id(p) for p in model.parameters()}
    foreign = sum(id(p) not in ours for p in _optimizer_params(optimizer, what))
    if foreign:
        raise ValueError(f"the {what} holds {foreign} parameter(s) that are not the model's: build it "
                         "over model.parameters() (the mode averages the model it is given)")


def _fragments(named: list[tuple[str, nn.Parameter]], count: int) -> list[list[int]]:
    """Cut ``named`` (model order) into ``count`` contiguous runs of about equal numel."""
    if count > len(named):
        raise ValueError(f"fragments={count} is more than the model's {len(named)} trainable parameters; "
                         "a fragment holds whole parameters")
    total = sum(p.numel() for _, p in named)
    cuts, seen = [0], 0
    for k, (_, p) in enumerate(named):
        seen += p.numel()
        # cut after parameter k once this fragment has its share, leaving one per fragment left
        if len(cuts) < count and seen >= total * len(cuts) / count and len(named) - (k + 1) >= count - len(cuts):
            cuts.append(k + 1)
    while len(cuts) < count:  # tiny tails: take one parameter each from the end
        cuts.insert(len(cuts), cuts[-1] + 1)
    cuts.append(len(named))
    return [list(range(a, b)) for a, b in zip(cuts, cuts[1:])]


# ---------------------------------------------------------------------- the shared mechanism

_SYNC_LOST = ("The parameters are lost: the sync may have left them partly averaged, or holding "
              "its pseudo-gradient (anchor - x) instead of weights.")


class _LocalUpdates(JoinableMode):
    """Parameters as flat blocks, cut into fragments; anchors, wire, step hooks, state.

    The modes subclass it with :meth:`_after_step` (when to sync) and, for DiLoCo, how
    an averaged pseudo-gradient is applied.
    """

    _delta: bool  # average the change since the last sync (through ``anchor``)
    _averages_params = True  # under Join a sync is a mean over the active ranks, whatever the divisor asked

    def _setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, group: dist.ProcessGroup | None,
               wire_dtype: torch.dtype | None, accumulate_dtype: torch.dtype | None, buffers: str,
               fragments: int, backup_device: str | torch.device | None, transport: str | None,
               scratch: bool) -> None:
        """Build everything (after the mode's own checks: this changes the model)."""
        named = self._named
        self.model, self.optimizer, self.group = model, optimizer, group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.device = one_device(named)
        verify_model(named, group, self.device, type(self).__name__)
        self.comm: Comm = get_comm(group, self.device, transport)
        self.buffers = buffers
        self.wire_dtype = wire_dtype
        self.steps = 0
        self.syncs = 0
        members = _fragments(named, fragments)
        # One segment per (fragment, dtype), fragments in model order: a fragment is a run
        # of segments, and in the wire buffer one contiguous slice.
        segments = [[k for k in frag if named[k][1].dtype == d]
                    for frag in members for d in sorted({named[k][1].dtype for k in frag}, key=str)]
        pad = self.comm.shard_multiple if self._delta else 1  # fp32 accumulation splits the wire in chunks
        self.layout = GradLayout(named, named[0][1].dtype, segments=[s for s in segments if s], pad_to=pad)
        self.fragment_names: list[list[str]] = [[named[k][0] for k in frag] for frag in members]
        first = 0
        self._frag_segments: list[range] = []
        for frag in members:
            n = len({named[k][1].dtype for k in frag})
            self._frag_segments.append(range(first, first + n))
            first += n
        # The parameters: views of one block per dtype. Averaged in place, the block is the
        # communication layer's (shared memory on one host: the peers read it where it is).
        alloc = self._param_alloc() if not self._delta else self._zeros
        self._blocks: list[torch.Tensor] = []  # one per dtype: what a collective over all of them takes
        self._flats = params_as_views(self.layout, lambda n, d: self._blocks.append(alloc(n, d)) or self._blocks[-1])
        self._float_buffers = [b for b in model.buffers() if b.is_floating_point()]
        frozen = [p.data for p in model.parameters() if not p.requires_grad]
        start_from_rank0(self._whole_flats() + frozen + list(model.buffers()), group, type(self).__name__)
        self._anchor: list[torch.Tensor] = []
        self._wire: list[torch.Tensor] = []
        self._frag_wire: list[torch.Tensor] = []
        self._scratch: dict[torch.dtype, torch.Tensor] = {}
        self._in_flight: dict[int, Pending] = {}
        if self._delta:
            where = torch.device(backup_device) if backup_device is not None else self.device
            pin = where.type == "cpu" and self.device.type == "cuda"  # page-locked: fast, async uploads
            self._anchor = [f.detach().to(where, copy=True) for f in self._flats]
            if pin:
                self._anchor = [a.pin_memory() for a in self._anchor]
            sizes = [sum(self.layout.segments[j].numel for j in segs) for segs in self._frag_segments]
            assert wire_dtype is not None
            wire = self.comm.buffer(max(sizes), wire_dtype)
            self._frag_wire = [wire[:n] for n in sizes]
            for segs in self._frag_segments:
                at = 0
                for j in segs:
                    n = self.layout.segments[j].numel
                    self._wire.append(wire[at:at + n])
                    at += n
            self._plan = self.comm.plan(wire_dtype, accumulate_dtype, wire)
            if scratch:
                self._scratch = self._blocks_per_dtype()
        self._buffer_block: TensorBlock | None = None
        self._hooks = [optimizer.register_step_post_hook(self._on_step)]
        # Under Join: every inner step is an iteration; its notify precedes any collective
        # of the step (the warm-up's gradient average runs in a later pre-hook).
        self._init_join(group, self.device)
        self._join_hook = optimizer.register_step_pre_hook(lambda *_: self._join_notify())

    def _zeros(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, device=self.device)

    def _param_alloc(self) -> Callable[[int, torch.dtype], torch.Tensor]:
        return self.comm.buffer

    def _blocks_per_dtype(self) -> dict[torch.dtype, torch.Tensor]:
        """Device scratch as long as the largest fragment's part of each dtype."""
        most: dict[torch.dtype, int] = {}
        for segs in self._frag_segments:
            per: dict[torch.dtype, int] = {}
            for j in segs:
                seg = self.layout.segments[j]
                per[seg.dtype] = per.get(seg.dtype, 0) + seg.numel
            for d, n in per.items():
                most[d] = max(most.get(d, 0), n)
        return {d: self._zeros(n, d) for d, n in most.items()}

    def _scratch_of(self, k: int, pool: dict[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
        """Fragment ``k``'s segments' slices of a per-dtype scratch ``pool``."""
        out, used = [], {}
        for j in self._frag_segments[k]:
            seg = self.layout.segments[j]
            at = used.get(seg.dtype, 0)
            out.append(pool[seg.dtype][at:at + seg.numel])
            used[seg.dtype] = at + seg.numel
        return out

    def _whole_flats(self) -> list[torch.Tensor]:
        """The parameters' per-dtype blocks (what a collective over all of them takes)."""
        return self._blocks

    # ------------------------------------------------------------------ hooks

    @guarded("the sync after {cls}'s optimizer step", _SYNC_LOST)
    def _on_step(self, _optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self._unstash()  # a step skipped for inf/NaN gradients: they come back for the user
        self.steps += 1
        with torch.no_grad():
            self._after_step(self.steps)

    def _after_step(self, s: int) -> None:
        raise NotImplementedError

    def remove(self) -> None:
        """Take the step hooks off: the optimizer steps without syncing from here on."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._join_hook.remove()
        remove_hooks(self._nonfinite_hooks)
        self._nonfinite_hooks = []

    def _join_shadow(self) -> None:
        """A joined rank's inner step under Join: no update of its own, the step's
        collectives as on the active ranks (it sends zeros into every average)."""
        if not self._hooks:
            return
        reducer = getattr(self, "_reducer", None)
        if reducer is not None and self.steps < getattr(self, "warmup_steps", 0):
            reducer._join_shadow()  # the warm-up's gradient average
        self._on_step(self.optimizer, (), {})

    # ------------------------------------------------------------------ averaging

    def _average(self, bufs: list[torch.Tensor], comm: Comm) -> None:
        """Each of ``bufs`` := its mean over ``comm``'s group (in place, all launched, then waited)."""
        self._join_contribute(bufs, active_only=True)  # under Join: zeros from joined ranks
        pendings = []
        for b in bufs:
            plan = comm.plan(b.dtype, None, b)
            pack = (lambda b=b: b.div_(comm.world)) if plan.prescale else None
            pendings.append(comm.all_reduce(b, plan, pack))
        for p in pendings:
            complete(p)

    def _average_buffers(self, comm: Comm) -> None:
        bufs = self._float_buffers
        if self.buffers != "average" or not bufs:
            return
        if self._buffer_block is None:
            self._buffer_block = TensorBlock(bufs, self.comm.buffer)
        block = self._buffer_block
        block.load()
        self._average([block.flat], comm)
        block.store()

    def _launch(self, k: int) -> None:
        """Start averaging fragment ``k``'s pseudo-gradient ``anchor - x`` through the wire.

        Computed here, on the caller's thread (a shared-memory job runs on a worker
        thread while training goes on), into the parameters themselves when nothing
        needs them before the apply overwrites them, else into scratch."""
        segs = self._frag_segments[k]
        deltas = self._scratch_of(k, self._scratch) if self._scratch else [self._flats[j] for j in segs]
        for j, d in zip(segs, deltas):
            x, a = self._flats[j], self._anchor[j]
            if a.device == x.device:
                torch.sub(a, x, out=d)
            else:
                d.copy_(a, non_blocking=True)
                d.sub_(x)
            self._wire[j].copy_(d)
        wire = self._frag_wire[k]
        self._join_contribute([wire], active_only=self._averages_params)
        if self._plan.prescale:
            wire.div_(self.world_size)
        self._in_flight[k] = self.comm.all_reduce(wire, self._plan)

    def _land(self, k: int, mix: bool = True) -> None:
        """Wait for fragment ``k``'s average and apply it (:meth:`_apply`), unless
        ``nonfinite`` finds inf/NaN in it (:meth:`_average_finite`)."""
        complete(self._in_flight.pop(k))
        if not self._average_finite(k):
            return
        self._apply(k, mix)
        self.syncs += 1

    # ------------------------------------------------------------------ non-finite values

    def _guard_steps(self) -> None:
        """``nonfinite``: hooks around the inner optimizer's step, registered after the
        mode's own. [Note: skipping an inner step] A pre-hook checks the gradients the
        step will use (in warm-up, the fused reducer's verdict on the average; else this
        rank's own, one fused kernel per dtype); to skip, it sets every gradient of the
        optimizer to ``None`` for the call (torch's optimizers then leave a parameter and
        its state alone) and :meth:`_on_step` puts them back, so every step hook still
        runs: the step counter advances and the syncs stay matched across ranks."""
        self.skipped_steps = 0  # inner steps this rank skipped for inf/NaN gradients
        self.skipped_syncs = 0  # syncs every rank skipped for an inf/NaN average
        self._check = FiniteCheck(self.device)
        self._stash: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._step_error: NonFiniteGradError | None = None
        self._warm_verdict: bool | None = None  # LocalSGD's warm-up: the average's verdict
        self._nonfinite_hooks: list[Any] = []
        if self.nonfinite != "ignore":
            self._nonfinite_hooks = [self.optimizer.register_step_pre_hook(self._check_step),
                                     self.optimizer.register_step_post_hook(self._raise_step_error)]

    def _check_step(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        verdict, self._warm_verdict = self._warm_verdict, None
        local = verdict is None
        if local:  # no communication in this step: this rank's gradients, this rank's verdict
            grads = [p.grad for _, p in self._named if p.grad is not None]
            verdict = not grads or self._check(grads)
        if verdict:
            return
        self.skipped_steps += 1
        if local and self.nonfinite == "raise":
            i = first_nonfinite([p.grad if p.grad is not None else p.detach()[:0] for _, p in self._named])
            self._step_error = nonfinite_error(
                f"rank {self.rank}'s gradients", None if i is None else self._named[i][0],
                "no collective is involved in an inner step, so only this rank raises; it skipped the step "
                "(parameters and optimizer state as before it) and counted it, so the syncs stay matched.")
        elif self.nonfinite == "skip":
            log.warning("fastreduce: %s: rank %d's %s gradients hold inf or NaN; the inner step is skipped "
                        "(nonfinite='skip')", type(self).__name__, self.rank, "own" if local else "averaged")
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self._stash = [(p, p.grad) for p in params]
        for p in params:  # the skip path only: torch's optimizers pass over a parameter with no grad
            p.grad = None

    def _unstash(self) -> None:
        stash, self._stash = self._stash, []
        for p, g in stash:
            p.grad = g

    def _raise_step_error(self, _optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        err, self._step_error = self._step_error, None
        if err is not None:
            raise err

    def _average_finite(self, k: int) -> bool:
        """``nonfinite``: whether fragment ``k``'s averaged pseudo-gradient (the wire) is
        finite; one fused check, and every rank holds the same average, so every rank
        decides alike with no collective. If not, the outer step is skipped: every
        rank's parameters of the fragment := the last synced ones (the anchor, the
        parameters the outer step would have updated), outer optimizer untouched."""
        if self.nonfinite == "ignore" or self._check((self._frag_wire[k],)):
            return True
        self.skipped_syncs += 1
        for j in self._frag_segments[k]:
            self._flats[j].copy_(self._anchor[j], non_blocking=True)
        if self.nonfinite == "skip":
            log.warning("fastreduce: %s: the averaged pseudo-gradient holds inf or NaN; the sync is skipped "
                        "on every rank, which return to the last synced parameters (nonfinite='skip')",
                        type(self).__name__)
            return False
        slots = [(j, slot) for j in self._frag_segments[k] for slot in self.layout.segments[j].slots]
        i = first_nonfinite([_view(self._wire[j], slot) for j, slot in slots])
        raise nonfinite_error("the averaged pseudo-gradients (anchor - x)", None if i is None else slots[i][1].name,
                              "the sync is lost on every rank: the fragment's parameters are reset to the last "
                              "synced ones, the outer optimizer did not step.")

    def _apply(self, k: int, mix: bool) -> None:
        raise NotImplementedError

    @property
    def bytes_per_sync(self) -> int:
        """Bytes one full sync averages, per rank: every fragment's wire (or parameter
        block) once, as sent (alignment padding included: a few hundred elements per
        dtype and fragment); a step costs ``bytes_per_sync / sync_every`` on average."""
        if self._delta:
            return sum(w.numel() * w.element_size() for w in self._frag_wire)
        return sum(f.numel() * f.element_size() for f in self._whole_flats())

    # ------------------------------------------------------------------ state

    @guarded("the wait for {cls}'s sync in flight", "The sync in flight is lost; the parameters "
             "are this rank's own since the last sync that completed.")
    def _drain(self) -> None:
        """Wait for the fragment on the wire, if any (it stays due at its step)."""
        for k, pending in list(self._in_flight.items()):
            complete(pending)
            self._in_flight[k] = (None, None)

    def _state(self) -> dict[str, Any]:
        self._drain()
        out: dict[str, Any] = {
            "steps": self.steps, "syncs": self.syncs,
            "params": [f.detach().clone() for f in self._whole_flats()],
            "anchor": [a.clone() for a in self._anchor],
            "in_flight": {k: self._frag_wire[k].clone() for k in self._in_flight},
            "fragments": self.fragment_names,
        }
        return out

    def _load(self, state: dict[str, Any]) -> None:
        if state.get("fragments") != self.fragment_names:
            raise ValueError("this state_dict was saved for other parameters or fragments "
                             f"({state.get('fragments')!r}) than this mode's ({self.fragment_names!r}); "
                             "build the same model with the same fragments to resume")
        flats = self._whole_flats()
        if [tuple(t.shape) for t in state["params"]] != [tuple(f.shape) for f in flats] or \
                len(state["anchor"]) != len(self._anchor):
            raise ValueError("this state_dict's parameter blocks do not match this mode's "
                             "(another model, dtype or wire setting)")
        with torch.no_grad():
            for f, t in zip(flats, state["params"]):
                f.copy_(t)
            for a, t in zip(self._anchor, state["anchor"]):
                a.copy_(t)
            self._drain()
            self._in_flight = {}
            for k, t in state["in_flight"].items():
                self._frag_wire[int(k)].copy_(t)
                self._in_flight[int(k)] = (None, None)  # averaged already: applied at its step
        self.steps, self.syncs = int(state["steps"]), int(state["syncs"])


# ---------------------------------------------------------------------- LocalSGD


def _levels(hierarchy: dict[int, int] | None, sync_every: int, world: int) -> list[tuple[int, int]]:
    """``[(period, group size), ...]`` by period, the world's last, checked."""
    if hierarchy is None:
        return [(sync_every, world)]
    if not isinstance(hierarchy, dict) or not hierarchy:
        raise ValueError(f"hierarchy must be a non-empty {{period: group_size}} dict, got {hierarchy!r}")
    levels = sorted((_check_int("a hierarchy period", p, 1), _check_int("a hierarchy group size", g, 1))
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


def _subgroup(group: dist.ProcessGroup | None, size: int) -> dist.ProcessGroup | None:
    """The group of ``size`` consecutive ranks of ``group`` this rank belongs to (as
    torch's ``new_subgroups``); only that group's ranks take part in making it."""
    world = dist.get_world_size(group)
    if size == world:
        return group
    rank = dist.get_rank(group)
    start = rank // size * size
    ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(start, start + size)]
    return dist.new_group(ranks, use_local_synchronization=True)


class LocalSGD(_LocalUpdates):
    """Local SGD: each rank steps on its own, the parameters are averaged every ``sync_every`` steps.

    Args:
        model: the module every rank trains (its trainable parameters and float buffers
            are averaged).
        optimizer: the rank's optimizer over the model's parameters; its ``step()``
            drives the mode (step hooks).
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
            rounded to it. Not with ``hierarchy``.
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
            averaged parameters); without, each rank's parameters before the in-place
            average, agreed by a one-element MAX all-reduce per sync (``skip``: no rank
            averages, each keeps its own); ``raise`` raises on every rank.
            :attr:`skipped_syncs` counts skipped syncs.

    Example::

        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> local = fastreduce.LocalSGD(model, opt, sync_every=8, warmup_steps=100)
        >>> for x, y in batches:
        ...     loss_fn(model(x), y).backward()
        ...     opt.step()          # every 8th step (after 100 synchronous ones) averages
        ...     opt.zero_grad()
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, sync_every: int, *,
                 warmup_steps: int = 0, group: dist.ProcessGroup | None = None,
                 hierarchy: dict[int, int] | None = None, wire_dtype: torch.dtype | None = None,
                 buffers: str = "average", transport: str | None = None, nonfinite: NonFinite = "ignore"):
        self.sync_every = _check_int("sync_every", sync_every, 1)
        self.warmup_steps = _check_int("warmup_steps", warmup_steps, 0)
        self.nonfinite = check_nonfinite(nonfinite)
        if buffers not in BUFFERS:
            raise ValueError(f"buffers must be one of {BUFFERS}, got {buffers!r}")
        _require_distributed()
        self._named = _trainable(model)
        _check_inner(model, optimizer, "optimizer")
        own = {p.dtype for _, p in self._named}
        if wire_dtype is not None and not (isinstance(wire_dtype, torch.dtype) and wire_dtype.is_floating_point):
            raise ValueError(f"wire_dtype must be a floating dtype or None, got {wire_dtype!r}")
        self._delta = wire_dtype is not None and own != {wire_dtype}
        world = dist.get_world_size(group)
        self._level_sizes = _levels(hierarchy, self.sync_every, world)
        if self._delta and len(self._level_sizes) > 1:
            raise ValueError("a wire_dtype other than the parameters' works without hierarchy only: "
                             "each level would need its own copy of the last averaged parameters")
        # Checked: from here on the model changes.
        self._levels = [(period, get_comm(_subgroup(group, size), one_device(self._named), transport))
                        for period, size in self._level_sizes]
        self._setup(model, optimizer, group=group, wire_dtype=wire_dtype if self._delta else None,
                    accumulate_dtype=None, buffers=buffers, fragments=1, backup_device=None,
                    transport=transport, scratch=False)
        self._reducer = None
        if self.warmup_steps:
            from .fused import FusedReducer  # the fused mode averages the warm-up's gradients
            self._reducer = FusedReducer(model, group=group, wire_dtype=None, nonfinite=self.nonfinite,
                                         transport=resolve_transport(transport))
            self._hooks.append(optimizer.register_step_pre_hook(self._before_step))
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
        return self._levels[0][1].buffer  # the most frequent level's transport holds them

    # ------------------------------------------------------------------ public

    @guarded("{cls}.sync()", _SYNC_LOST)
    @torch.no_grad()
    def sync(self) -> None:
        """Average the parameters (and float buffers) over the whole group now (collective)."""
        self._sync(self._levels[-1][1])

    def state_dict(self) -> dict[str, Any]:
        """Everything to resume exactly: the step count (warm-up included), this rank's
        parameters and, with a narrow ``wire_dtype``, the last averaged ones."""
        return {"mode": "LocalSGD", "sync_every": self.sync_every, "warmup_steps": self.warmup_steps,
                **self._state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (build the model, optimizer and mode first)."""
        if state_dict.get("mode") != "LocalSGD":
            raise ValueError(f"not a LocalSGD state_dict (mode {state_dict.get('mode')!r})")
        self._load(state_dict)
        if self.steps >= self.warmup_steps and self._reducer is not None:
            self._end_warmup()

    # ------------------------------------------------------------------ hooks

    def _before_step(self, _optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if self._reducer is not None and self.steps < self.warmup_steps:
            finite = self._reducer.reduce()  # nonfinite="raise": raises here, on every rank
            if self.nonfinite != "ignore":
                self._warm_verdict = finite  # the same on every rank: skip (or not) alike
            self._reducer._scale_grads(self._reducer._built, self._join_factor())  # under Join

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

    def _end_warmup(self) -> None:
        self._reducer = None  # its buffer is freed with the last grads that view it
        for h in self._hooks[1:]:
            h.remove()
        del self._hooks[1:]

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
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=comm.group)
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


# ---------------------------------------------------------------------- DiLoCo


class DiLoCo(_LocalUpdates):
    """DiLoCo: ``sync_every`` inner steps on each rank, then an outer step on the averaged
    pseudo-gradient; with ``fragments``, Streaming DiLoCo (see the module doc).

    Args:
        model: the module every rank trains.
        inner_optimizer: the rank's optimizer (e.g. AdamW); its ``step()`` drives the mode.
        outer_optimizer: a torch optimizer over exactly the model's trainable parameters
            (the paper: ``SGD(lr=0.7, momentum=0.9, nesterov=True)``); it steps each
            fragment's last synced parameters with the averaged pseudo-gradient as grad.
        sync_every: inner steps between a fragment's syncs (``H``).
        fragments: the trainable parameters, in model order, cut into this many runs of
            about equal size, synced at staggered steps (``H`` must be a multiple).
        fragment_delay: inner steps between starting a fragment's all-reduce and applying
            it (``tau < H / fragments``): the communication overlaps those steps.
        fragment_alpha: on apply, the fragment's parameters := ``alpha * local + (1 -
            alpha) * global``.
        group: process group (default: the world).
        wire_dtype: dtype the pseudo-gradient is sent in (default bf16).
        accumulate_dtype: ``torch.float32``: a bf16 wire is summed in fp32 on process
            groups too (shared memory always does).
        backup_device: where the last synced parameters live (default: the parameters'
            device; ``"cpu"`` frees a model's worth of accelerator memory).
        buffers: ``average`` (float buffers averaged every ``H`` steps) or ``local``.
        transport: the communication layer's transport.
        nonfinite: inf/NaN: ``ignore`` (no check), ``skip`` or ``raise``. An inner step
            checks this rank's gradients, as :class:`LocalSGD` does (``skip``: this rank
            skips it, still counted, :attr:`skipped_steps`; ``raise``: the same, then
            :class:`~fastreduce.NonFiniteGradError` on this rank only). A fragment's
            averaged pseudo-gradient is checked once it lands (one fused kernel; it is
            the same on every rank, so every rank decides alike with no collective):
            ``skip`` skips the outer step and every rank's parameters of the fragment
            return to the last synced ones (outer optimizer untouched,
            :attr:`skipped_syncs` counts it); ``raise`` does the same and raises on every
            rank, naming the parameter.

    Example::

        >>> inner = torch.optim.AdamW(model.parameters(), lr=4e-4)
        >>> outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        >>> diloco = fastreduce.DiLoCo(model, inner, outer, sync_every=500)
        >>> for x, y in batches:
        ...     loss_fn(model(x), y).backward()
        ...     inner.step()        # every 500th step: the outer step on the averaged delta
        ...     inner.zero_grad()
    """

    _averages_params = False  # pseudo-gradients: divide_by_initial_world_size applies

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: torch.optim.Optimizer, sync_every: int, *, fragments: int = 1,
                 fragment_delay: int = 0, fragment_alpha: float = 0.0, group: dist.ProcessGroup | None = None,
                 wire_dtype: torch.dtype = torch.bfloat16, accumulate_dtype: torch.dtype | None = None,
                 backup_device: str | torch.device | None = None, buffers: str = "average",
                 transport: str | None = None, nonfinite: NonFinite = "ignore"):
        self.sync_every = H = _check_int("sync_every", sync_every, 1)
        self.nonfinite = check_nonfinite(nonfinite)
        self.num_fragments = F = _check_int("fragments", fragments, 1)
        self.fragment_delay = tau = _check_int("fragment_delay", fragment_delay, 0)
        if F > 1 and H % F:
            raise ValueError(f"sync_every={H} is not a multiple of fragments={F}: the fragments' syncs are "
                             f"staggered every sync_every / fragments steps")
        if tau * F >= H:
            raise ValueError(f"fragment_delay={tau} must be less than sync_every / fragments = {H / F:g}: "
                             "one fragment's all-reduce must land before the next one starts")
        if not 0.0 <= float(fragment_alpha) <= 1.0:
            raise ValueError(f"fragment_alpha must be in [0, 1], got {fragment_alpha!r}")
        if buffers not in BUFFERS:
            raise ValueError(f"buffers must be one of {BUFFERS}, got {buffers!r}")
        if not (isinstance(wire_dtype, torch.dtype) and wire_dtype.is_floating_point):
            raise ValueError(f"wire_dtype must be a floating dtype, got {wire_dtype!r}")
        if accumulate_dtype not in (None, torch.float32):
            raise ValueError(f"accumulate_dtype must be None or torch.float32, got {accumulate_dtype!r}")
        _require_distributed()
        self._named = _trainable(model)
        if outer_optimizer is inner_optimizer:
            raise ValueError("outer_optimizer is the inner optimizer; DiLoCo needs a second optimizer "
                             "over the same parameters (e.g. SGD(lr=0.7, momentum=0.9, nesterov=True))")
        _check_inner(model, inner_optimizer, "inner optimizer")
        outer = {id(p) for p in _optimizer_params(outer_optimizer, "outer_optimizer")}
        ours = {id(p): n for n, p in self._named}
        missing = [n for i, n in ours.items() if i not in outer]
        extra = len(outer - set(ours))
        if missing or extra:
            raise ValueError("outer_optimizer must hold exactly the model's trainable parameters: "
                             + (f"it lacks {missing[:3]}{' ...' if len(missing) > 3 else ''}" if missing else "")
                             + ("; " if missing and extra else "")
                             + (f"it holds {extra} other tensor(s)" if extra else "")
                             + "; build it over [p for p in model.parameters() if p.requires_grad]")
        device = one_device(self._named)
        if backup_device is not None:
            backup = torch.device(backup_device)
            if backup.type not in ("cpu", device.type):
                raise ValueError(f"backup_device must be 'cpu' or the parameters' device ({device}), got {backup}")
            backup_device = backup
        self.fragment_alpha = float(fragment_alpha)
        self.outer_optimizer = outer_optimizer
        self._delta = True
        on_cpu = backup_device is not None and backup_device != device
        # Scratch beside the live parameters: to keep them through the delay, or for alpha.
        scratch = tau > 0 or self.fragment_alpha > 0 or on_cpu
        self._setup(model, inner_optimizer, group=group, wire_dtype=wire_dtype,
                    accumulate_dtype=accumulate_dtype, buffers=buffers, fragments=F,
                    backup_device=backup_device, transport=transport, scratch=scratch)
        # Where the averaged pseudo-gradient lands as the outer step's grad: the anchor
        # (the parameters hold its values meanwhile), else a block on the device.
        self._spare = self._blocks_per_dtype() if on_cpu and self.fragment_alpha > 0 else (
            self._scratch if on_cpu else {})
        self._grad_views = []
        for k, segs in enumerate(self._frag_segments):
            homes = self._scratch_of(k, self._spare) if self._spare else [self._anchor[j] for j in segs]
            self._grad_views.append([(s.param, _view(home, s)) for j, home in zip(segs, homes)
                                     for s in self.layout.segments[j].slots])
        self._apply_at = [((k + 1) * H // F) % H for k in range(F)]
        if self.rank == 0:
            log.info("fastreduce: DiLoCo: %s; %d fragment(s) every %d inner steps (delay %d, alpha %g), "
                     "wire %s, anchor on %s, %d ranks", self.layout.describe(), F, H, tau,
                     self.fragment_alpha, wire_dtype, self._anchor[0].device, self.world_size)
        self._guard_steps()

    # ------------------------------------------------------------------ public

    @guarded("{cls}.sync()", _SYNC_LOST)
    @torch.no_grad()
    def sync(self) -> None:
        """An outer step of every fragment now (collective), the one on the wire first,
        without ``fragment_alpha``: every rank then holds the same global parameters
        (e.g. at the end of training). The schedule goes on counting as before."""
        landed = set(self._in_flight)
        for k in sorted(landed):
            self._land(k, mix=False)
        for k in range(self.num_fragments):
            if k not in landed:
                self._launch(k)
                self._land(k, mix=False)
        self._average_buffers(self.comm)

    def state_dict(self) -> dict[str, Any]:
        """Everything to resume exactly: the step count (hence the fragment phase), the
        last synced parameters, this rank's parameters, the outer optimizer's state and
        the fragment on the wire (as its averaged pseudo-gradient)."""
        return {"mode": "DiLoCo", "sync_every": self.sync_every, "outer_optimizer": self.outer_optimizer.state_dict(),
                **self._state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (build the model, both optimizers and the mode first)."""
        if state_dict.get("mode") != "DiLoCo":
            raise ValueError(f"not a DiLoCo state_dict (mode {state_dict.get('mode')!r})")
        self._load(state_dict)
        self.outer_optimizer.load_state_dict(state_dict["outer_optimizer"])

    # ------------------------------------------------------------------ every inner step

    def _after_step(self, s: int) -> None:
        H, tau = self.sync_every, self.fragment_delay
        for k, t in enumerate(self._apply_at):
            if s % H == t and k in self._in_flight:
                self._land(k)
        for k, t in enumerate(self._apply_at):
            if (s + tau) % H == t:
                self._launch(k)
                if tau == 0:
                    self._land(k)
        if s % H == 0:
            self._average_buffers(self.comm)

    def _apply(self, k: int, mix: bool) -> None:
        """The outer step of fragment ``k`` on its averaged pseudo-gradient (in the wire);
        ``mix``: then mix in the local parameters by ``fragment_alpha``."""
        segs = self._frag_segments[k]
        keep = self._scratch_of(k, self._scratch) if mix and self.fragment_alpha > 0 else None
        homes = self._scratch_of(k, self._spare) if self._spare else [self._anchor[j] for j in segs]
        for n, j in enumerate(segs):
            x, a = self._flats[j], self._anchor[j]
            if keep is not None:
                keep[n].copy_(x)
            x.copy_(a, non_blocking=True)    # the fragment's global parameters (an upload, if on the CPU)
            homes[n].copy_(self._wire[j])    # their grad: the mean pseudo-gradient
        self._outer_step(self._grad_views[k])
        for n, j in enumerate(segs):
            x, a = self._flats[j], self._anchor[j]
            a.copy_(x)
            if keep is not None:
                x.lerp_(keep[n], self.fragment_alpha)

    def _outer_step(self, grads: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
        """Step the outer optimizer with ``grads`` as the only gradients (the inner ones
        are put back after)."""
        params = [p for _, p in self._named]
        saved = [p.grad for p in params]
        try:
            for p in params:
                p.grad = None
            for p, g in grads:
                p.grad = g
            self.outer_optimizer.step()
        finally:
            for p, g in zip(params, saved):
                p.grad = g


def _require_distributed() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("torch.distributed is not initialized: call fastreduce.init_distributed() "
                           "(or torch.distributed.init_process_group) on every rank first")

