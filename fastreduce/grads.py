"""Checking parameters and gradients, and bringing re-allocated gradients back into a
flat buffer: shared by every mode that keeps gradients as views of one.

After ``zero_grad(set_to_none=True)`` autograd hands each parameter a fresh gradient
instead of accumulating into its view of the flat buffer. :func:`adopt` copies those in
(one ``_foreach_copy_``) and re-attaches the views, after validating every gradient
first, so an error leaves all of them as they were.
"""

from __future__ import annotations

import logging
import warnings
from typing import Sequence

import torch
import torch.distributed as dist

from .buffer import FusedBuffer, foreach_copy
from .comm import broadcast_from_rank0
from .layout import GradLayout

__all__ = ["adopt", "check_grad", "missing_message", "one_device", "start_from_rank0"]


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


def missing_message(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (f"parameter(s) {shown} require grad but have no gradient after backward. "
            "Freeze parameters you do not train (param.requires_grad_(False)), or pass "
            "unused_grads='zero' to count a missing gradient as zero (like DDP's "
            "find_unused_parameters=True)")


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
        raise RuntimeError(missing_message([layout.names[i] for i in missing]))
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
