"""``all_reduce_gradients(model)``: optimum-habana's call, on the fused reducer.

The function form keeps its :class:`~fastreduce.modes.fused.FusedReducer` on the model
itself (``model._fastreduce_reducers``, one per process group and settings), so a loop
that calls ``all_reduce_gradients(model)`` after every ``backward()`` pays the layout
and the buffers once. :func:`gradient_reducer` hands out that same reducer (for ``Join``,
``no_sync()``, ``stats``); :func:`functional_state` and :func:`load_functional_state`
are what ``fastreduce.checkpoint`` saves of it (error-feedback residuals).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import Transport
from ..grads import NonFinite
from ..torch_internals import compiled_inner
from ..codecs.powersgd import PowerSGD
from .fused import FusedReducer, UnusedGrads

__all__ = ["all_reduce_gradients", "functional_state", "gradient_reducer", "load_functional_state"]


class _ReducerCache(dict):
    """Reducers kept on the model; copies and pickles of the model start without any.
    ``restore``: a reducer state a checkpoint loaded before any reducer existed, handed
    to the next one made."""

    restore: dict[str, Any] | None = None

    def __deepcopy__(self, memo: dict) -> _ReducerCache:
        return _ReducerCache()

    def __reduce__(self):
        return (_ReducerCache, ())


def all_reduce_gradients(model: torch.nn.Module, fusion_buffer_dtype: torch.dtype | None = torch.bfloat16,
                         use_hpu_graphs: bool = True, *, group: dist.ProcessGroup | None = None,
                         backend: str = "auto", unused_grads: UnusedGrads = "error",
                         accumulate_dtype: torch.dtype | None = None,
                         transport: Transport | None = None, error_feedback: bool = False,
                         nonfinite: NonFinite = "ignore", compression: PowerSGD | None = None) -> bool:
    """Average ``model``'s gradients across ranks: call after ``backward()``, before ``step()``;
    returns :meth:`FusedReducer.reduce`'s verdict (``False``: skip the step, only under
    ``nonfinite="skip"``).

    A drop-in for optimum-habana's function of the same name (same positional
    arguments and defaults) that runs on HPU, CUDA and CPU. The reducer behind it is
    kept on the model, one per group and settings; see :class:`FusedReducer` for the
    object form and the meaning of each argument. ``use_hpu_graphs`` means "record
    pack/unpack as device graphs where the device has them". For the overlapped mode,
    which must be set up before the first backward, use ``FusedReducer(overlap=True)``.

    Example::

        >>> loss.backward()
        >>> fastreduce.all_reduce_gradients(model)             # bf16 on the wire
        >>> fastreduce.all_reduce_gradients(model, torch.float32)  # exact fp32
        >>> fastreduce.all_reduce_gradients(model, compression=fastreduce.PowerSGD(rank=4))  # low-rank
        >>> optimizer.step()

    Under uneven inputs pass :func:`gradient_reducer` (the same reducer) to ``Join``.
    """
    return gradient_reducer(model, fusion_buffer_dtype, use_hpu_graphs, group=group, backend=backend,
                            unused_grads=unused_grads, accumulate_dtype=accumulate_dtype, transport=transport,
                            error_feedback=error_feedback, nonfinite=nonfinite, compression=compression).reduce()


def gradient_reducer(model: torch.nn.Module, fusion_buffer_dtype: torch.dtype | None = torch.bfloat16,
                     use_hpu_graphs: bool = True, *, group: dist.ProcessGroup | None = None,
                     backend: str = "auto", unused_grads: UnusedGrads = "error",
                     accumulate_dtype: torch.dtype | None = None,
                     transport: Transport | None = None, error_feedback: bool = False,
                     nonfinite: NonFinite = "ignore", compression: PowerSGD | None = None) -> FusedReducer:
    """The :class:`FusedReducer` that :func:`all_reduce_gradients` uses for ``model`` with
    the same arguments (made now if it does not exist yet; made by any rank, it is
    built collectively at the first reduction). It is what to hand to ``Join`` (and
    what exposes ``stats``, ``no_sync()`` and ``zero_grad()``).

    Example::

        >>> from torch.distributed.algorithms.join import Join
        >>> with Join([fastreduce.gradient_reducer(model)]):   # this rank may run out first
        ...     for x, y in my_batches:
        ...         loss_fn(model(x), y).backward()
        ...         fastreduce.all_reduce_gradients(model)      # averaged over the active ranks
        ...         optimizer.step()
        ...         optimizer.zero_grad()
    """
    held = compiled_inner(model).__dict__  # (a compiled model's reducers are its module's)
    cache = held.get("_fastreduce_reducers")
    if cache is None:
        cache = held["_fastreduce_reducers"] = _ReducerCache()
    pg = group if group is not None else dist.group.WORLD  # None before init: the reducer says so
    # the group held weakly: the model must not keep a group alive that its user destroyed
    key = (pg if pg is None else weakref.ref(pg), fusion_buffer_dtype,
           use_hpu_graphs, backend, unused_grads, accumulate_dtype, transport, error_feedback, nonfinite, compression)
    reducer = cache.get(key)
    if reducer is None:
        for old in [k for k, r in cache.items() if r.group_built.changed()]:
            cache.pop(old).close()  # built on a process group since destroyed and re-made
        extra = {} if transport is None else {"transport": transport}
        reducer = cache[key] = FusedReducer(model, group=group, wire_dtype=fusion_buffer_dtype,
                                            use_graphs=use_hpu_graphs, backend=backend,
                                            unused_grads=unused_grads, accumulate_dtype=accumulate_dtype,
                                            error_feedback=error_feedback, nonfinite=nonfinite,
                                            compression=compression, **extra)
        if cache.restore is not None:
            reducer.load_state_dict(_its_part(reducer, cache.restore))
            cache.restore = None
    return reducer


def functional_state(model: nn.Module) -> dict[str, Any]:
    """The error-feedback residuals of the reducers ``all_reduce_gradients`` keeps on
    ``model``, a quantized wire's (``"wire"``), and PowerSGD's state (residuals, Q, step) of
    the one that compresses; where none was made yet, what :func:`load_functional_state`
    handed to the next one."""
    residuals: dict[str, torch.Tensor] = {}
    state: dict[str, Any] = {"residuals": residuals}
    cache = compiled_inner(model).__dict__.get("_fastreduce_reducers", {})
    if not cache and getattr(cache, "restore", None) is not None:
        return cache.restore
    for reducer in cache.values():
        mine = reducer.state_dict()
        for name, t in mine["residuals"].items():
            residuals.setdefault(name, t)
        for kind in ("compression", "wire"):
            if kind in mine:
                state.setdefault(kind, mine[kind])
    return state


def load_functional_state(model: nn.Module, state: dict[str, Any]) -> None:
    """Residuals (and PowerSGD's state) into the reducers on ``model`` that use them, or,
    if there is none yet, handed to the next one ``all_reduce_gradients`` makes."""
    if not state["residuals"] and "compression" not in state and not state.get("wire"):
        return
    cache = compiled_inner(model).__dict__.setdefault("_fastreduce_reducers", _ReducerCache())
    users = [r for r in cache.values() if r.config.error_feedback or r.config.compression is not None]
    for reducer in users:
        reducer.load_state_dict(_its_part(reducer, state))
    if not users:
        cache.restore = state


def _its_part(reducer: FusedReducer, state: dict[str, Any]) -> dict[str, Any]:
    """What of a saved functional state ``reducer`` uses: residuals if it has error
    feedback (a quantized wire's too), PowerSGD's state if it compresses."""
    part: dict[str, Any] = {"residuals": state["residuals"] if reducer.config.error_feedback else {}}
    if reducer.config.compression is not None and "compression" in state:
        part["compression"] = state["compression"]
    if reducer.config.quant is not None and reducer.config.error_feedback and state.get("wire"):
        part["wire"] = state["wire"]  # a quantized wire's residuals
    return part
