"""Checking parameters and gradients, and bringing re-allocated gradients back into a
flat buffer: shared by every mode that keeps gradients as views of one.

After ``zero_grad(set_to_none=True)`` autograd hands each parameter a fresh gradient
instead of accumulating into its view of the flat buffer. :func:`adopt` copies those in
(one ``_foreach_copy_``) and re-attaches the views, after validating every gradient
first, so an error leaves all of them as they were.

Non-finite gradients (every mode's ``nonfinite`` setting): :class:`FiniteCheck` looks
for inf/NaN in a mode's flat buffers (or a list of gradients) with one fused kernel per
dtype; :func:`nonfinite_error` names the first parameter holding one.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Literal, Sequence

import torch
import torch.distributed as dist

from .buffer import FusedBuffer, attached, foreach_copy
from .comm import broadcast_from_rank0
from .faults import all_reduce_watched
from .hooks import on_grad_ready, remove_hooks
from .layout import GradLayout
from .torch_internals import at_backward_end, non_finite_check_and_unscale_

__all__ = ["NONFINITE", "FiniteCheck", "NonFinite", "NonFiniteGradError", "Reattach", "adopt", "agree_first",
           "attach_used", "check_grad", "check_grads", "check_nonfinite", "first_nonfinite", "missing_message",
           "nonfinite_error", "one_device", "start_from_rank0"]

NonFinite = Literal["ignore", "raise", "skip"]
NONFINITE = ("ignore", "raise", "skip")


class NonFiniteGradError(RuntimeError):
    """Gradients (or what a mode averages: parameters, pseudo-gradients) hold inf or NaN
    under ``nonfinite="raise"``; raised on every rank that shares the verdict."""


def check_nonfinite(value: str) -> str:
    """``value`` if it is a ``nonfinite`` setting, else a ``ValueError`` listing them."""
    if value not in NONFINITE:
        raise ValueError(f"nonfinite must be 'ignore', 'raise' or 'skip', got {value!r}")
    return value


class FiniteCheck:
    """Whether tensors hold inf or NaN: one ``torch._amp_foreach_non_finite_check_and_unscale_``
    per dtype (GradScaler's kernel, with a unit scale, so the values stay bit-identical)
    into a persistent flag, so a check allocates nothing and launches one kernel per
    dtype, however many tensors (on CPU, measured: 10 ms for 10M fp32 elements against
    140 ms for ``isfinite(t).all()``, which allocates a mask). The flag stays on the
    device; :meth:`__call__` reads it back (one host sync)."""

    def __init__(self, device: torch.device):
        self.found = torch.zeros(1, dtype=torch.float32, device=device)
        self.unit = torch.ones(1, dtype=torch.float32, device=device)

    def flag(self, tensors: Sequence[torch.Tensor], inv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """The device flag: 1.0 if any of ``tensors`` holds inf/NaN, else 0.0. With
        ``inv_scale`` (a one-element fp32 tensor) the same kernel also unscales them in
        place, as ``GradScaler.unscale_`` does."""
        self.found.zero_()
        dtypes: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:  # a few flat buffers, or one list per dtype
            dtypes.setdefault(t.dtype, []).append(t)
        for same in dtypes.values():
            non_finite_check_and_unscale_(same, self.found, self.unit if inv_scale is None else inv_scale)
        return self.found

    def __call__(self, tensors: Sequence[torch.Tensor]) -> bool:
        """True when every one of ``tensors`` is finite."""
        return not bool(self.flag(tensors).item())


def first_nonfinite(tensors: Sequence[torch.Tensor]) -> int | None:
    """Index of the first of ``tensors`` holding inf/NaN (error path only: one check each)."""
    return next((i for i, t in enumerate(tensors) if not bool(torch.isfinite(t).all())), None)


def agree_first(index: int | None, n: int, group: dist.ProcessGroup | None, device: torch.device) -> int | None:
    """The smallest of every rank's ``index`` (``None``: none on this rank) of ``n``, on
    every rank: one MIN all-reduce, to name the same parameter everywhere (error path)."""
    t = torch.tensor([float(n if index is None else index)], device=device)
    if dist.get_world_size(group) > 1:
        all_reduce_watched(t, dist.ReduceOp.MIN, group)
    first = int(t.item())
    return first if first < n else None


def nonfinite_error(what: str, name: str | None, state: str) -> NonFiniteGradError:
    """The error of ``nonfinite="raise"``: ``what`` holds inf/NaN, first in ``name``;
    ``state`` says what the failed step left behind."""
    where = f", first in parameter {name!r}" if name is not None else ""
    return NonFiniteGradError(
        f"{what} hold inf or NaN{where}; {state} Lower the learning rate or loss scale, use a "
        "GradScaler, or pass nonfinite='skip' to skip such steps")


def one_device(named: Sequence[tuple[str, torch.Tensor]]) -> torch.device:
    """The one device all of ``named`` live on, or a ``ValueError`` saying what to do."""
    devices = {p.device for _, p in named}
    if len(devices) > 1:
        where = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(f"the trainable parameters live on several devices ({where}); "
                         "fastreduce reduces one device's gradients per reducer or optimizer: "
                         "move the model with model.to(device), or build one per device")
    device = devices.pop()
    if device.type == "meta":
        raise ValueError("the parameters are on the meta device; materialize them "
                         "(e.g. model.to_empty(device=...)) first")
    return device


def check_grad(name: str, p: torch.Tensor, device: torch.device) -> None:
    """Raise a ``ValueError`` for a gradient fastreduce cannot reduce (sparse, elsewhere)."""
    g = p.grad
    if g is None:
        return
    if g.is_sparse or g.layout != torch.strided:
        raise ValueError(f"parameter {name!r} has a sparse gradient ({g.layout}); fastreduce "
                         "reduces dense gradients only: build the layer with sparse=False "
                         "(e.g. nn.Embedding(..., sparse=False))")
    if g.device != device:
        raise ValueError(f"parameter {name!r} has its gradient on {g.device}, the others on "
                         f"{device}; keep all gradients of one reducer on one device")


def check_grads(named: Sequence[tuple[str, torch.Tensor]]) -> torch.device:
    """The one device of ``named`` (:func:`one_device`), each gradient there checked
    (:func:`check_grad`): what a mode checks at its first call before it talks to another
    rank or to the store, so that every rank raises it, however soon another left
    (docs/design.md, invariant 11)."""
    device = one_device(named)
    for name, p in named:
        check_grad(name, p, device)
    return device


def missing_message(layout: GradLayout, indices: Sequence[int]) -> str:
    """Why the parameters ``indices`` of ``layout`` have no gradient, and what to do."""
    frozen = [layout.names[i] for i in indices if not layout.params[i].requires_grad]
    if frozen:  # frozen since the layout was learned
        return (f"parameter(s) {_shown(frozen)} were trainable when fastreduce learned the layout and are "
                "frozen now; call reducer.rebuild() on every rank after changing requires_grad")
    return (f"parameter(s) {_shown([layout.names[i] for i in indices])} require grad but have no gradient "
            "after backward. Freeze parameters you do not train (param.requires_grad_(False)), or pass "
            "unused_grads='zero' to count a missing gradient as zero (like DDP's "
            "find_unused_parameters=True)")


def _shown(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def attach_used(layout: GradLayout, buffer: FusedBuffer, flags: torch.Tensor, missing: list[int]) -> None:
    """``unused_grads="zero"``: a grad missing on this rank but present on another (its count in
    ``flags`` after their all-reduce) becomes its view of the average; the others stay ``None``."""
    for i, count in zip(missing, flags[missing].tolist()):
        if count > 0:
            layout.params[i].grad = buffer.views[i]


def adopt(layout: GradLayout, buffer: FusedBuffer, indices: Sequence[int], *, direct: bool = False,
          missing_ok: bool = True) -> tuple[list[int], int, bool]:
    """Bring re-allocated grads of layout ``indices`` into ``buffer`` and re-attach views.

    Validates everything first, so an error leaves all grads as they were. Returns the
    indices with no grad (zeroed in the buffer; an error unless ``missing_ok``), how
    many grads were copied in, and whether they went straight into the wire buffer:
    ``direct=True`` allows that when every grad of ``indices`` that needs a cast was
    re-allocated, one pass over them instead of two; the caller must then skip packing
    ``indices``, and their views hold stale values until the unpack.
    """
    views = buffer.views
    device = buffer.wire.device
    missing, moved = [], []
    for i in indices:
        g = layout.params[i].grad
        if g is views[i]:
            continue
        if g is None:
            missing.append(i)
        else:
            check_grad(layout.names[i], layout.params[i], device)
            moved.append(i)
    if missing and not missing_ok:
        raise RuntimeError(missing_message(layout, missing))
    cast = buffer.cast
    direct = direct and bool(moved) and sum(map(cast.__getitem__, moved)) == sum(map(cast.__getitem__, indices))
    if moved:
        dst = buffer.wire_views if direct else views
        foreach_copy([dst[i] for i in moved], [layout.params[i].grad for i in moved])
        for i in moved:
            layout.params[i].grad = views[i]
    if missing:
        torch._foreach_zero_([views[i] for i in missing])
    return missing, len(moved), direct


def start_from_rank0(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None, mode: str) -> None:
    """Give every rank rank 0's ``tensors`` (a model's parameters and buffers, as DDP does
    at construction), and warn on every rank when some rank's differed."""
    if broadcast_from_rank0(list(tensors), group):
        msg = (f"fastreduce.{mode}: the ranks' initial parameters or buffers differed; rank 0's were "
               f"broadcast to every rank. Seed the model alike on every rank (to resume, load the "
               f"{mode}'s state_dict after building it)")
        warnings.warn(msg, UserWarning, stacklevel=4)
        logging.getLogger("fastreduce").warning(msg)


class Reattach:
    """Gradients that ``zero_grad(set_to_none=True)`` freed come back as zeroed views of
    the flat buffer at the next forward (the mode's forward pre-hook calls :meth:`before_forward`),
    so that backward accumulates into the buffer; one that backward then leaves unwritten is ``None``
    again as backward ends (a callback queued from the first gradient hook of that
    backward), and at the latest in ``reduce()``: unused parameters look exactly as
    without the re-attach, and ``unused_grads`` sees them.

    Args:
        layout, buffer: the gradients and their flat buffer.
        stats: counts the re-attached gradients in its ``preattached``.
        grad_hooks: register this object's own gradient hooks (calling :meth:`grad_ready`),
            on the first re-attach, so that a loop zeroing with ``reducer.zero_grad()``
            never pays for a Python hook per gradient; ``False`` where another owner's
            hooks call :meth:`grad_ready` already (the overlapped schedule's).
        held: whether the layout's parameters are still the model's
            (:class:`~fastreduce.layout.ParamsHeld`): where not, nothing is re-attached.
    """

    def __init__(self, layout: GradLayout, buffer: FusedBuffer, stats: Any, *, grad_hooks: bool,
                 held: Callable[[], bool] | None = None):
        self.params, self.views, self.buffer, self.stats = layout.params, buffer.views, buffer, stats
        self.held = held
        self.written = [False] * len(layout)  # per grad: backward wrote it since it was re-attached
        self.fresh: list[int] = []  # re-attached since the last reduce
        self.queued = False
        self.watch = grad_hooks
        self.handles: list[Any] = []

    def remove(self) -> None:
        """Take this object's hooks off the parameters."""
        remove_hooks(self.handles)
        self.handles = []

    @torch.no_grad()
    def before_forward(self) -> None:
        params, views = self.params, self.views
        if attached(params, views):
            return
        fresh = [i for i, p in enumerate(params) if p.grad is None]
        if not fresh:
            return  # re-allocated ones (not None): reduce() copies them in
        if not all(params[i].requires_grad for i in fresh) or (self.held is not None and not self.held()):
            return  # one frozen, replaced or moved since the layout was learned: reduce() says to rebuild()
        if len(fresh) == len(params):
            self.buffer.zero_()
        else:
            torch._foreach_zero_([views[i] for i in fresh])
        if self.watch:
            self.handles += on_grad_ready(self.params, self.grad_ready)
            self.watch = False
        for i in fresh:
            params[i].grad = views[i]
            self.written[i] = False
        self.fresh += fresh
        self.stats.preattached += len(fresh)

    def grad_ready(self, i: int) -> None:
        """Every gradient hook, fused or overlapped: note it, and at the first one of a
        backward with re-attached gradients, queue :meth:`settle` for its end."""
        self.written[i] = True
        if self.fresh and not self.queued:
            self.queued = True
            at_backward_end(self.settle)

    def settle(self, done: bool = False) -> None:
        """Re-attached gradients that no backward wrote become ``None`` again; ``done``
        (the reduction): forget which were re-attached."""
        self.queued = False
        if self.fresh:
            for i in self.fresh:
                if not self.written[i]:
                    self.params[i].grad = None
            self.fresh = [] if done else [i for i in self.fresh if self.written[i]]
