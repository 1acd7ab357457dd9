"""Walks over a nested state (``state_dict``\\ s: dicts, lists and tuples of tensors and
plain values), the one place they are written: a copy, the tensors swapped for where they
travel (:mod:`fastreduce.heal`), and back.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

__all__ = ["clone_state", "map_leaves"]


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def map_leaves(state: Any, fn: Callable[[Any], Any], leaf: Callable[[Any], bool] = _is_tensor) -> Any:
    """``state`` with ``fn(x)`` in place of each leaf ``x`` (a tensor unless ``leaf`` says
    otherwise), in the order met; dicts, lists and tuples keep their types (a ``Counter``'s
    counts, a ``defaultdict``'s factory, a module state's ``_metadata``, a namedtuple's
    fields), anything else is kept as it is."""
    if leaf(state):
        return fn(state)
    if isinstance(state, dict):  # a copy of it, then each value mapped: not type(state)(pairs),
        new = copy.copy(state)  # which a Counter counts and a defaultdict refuses
        for k, v in state.items():
            new[k] = map_leaves(v, fn, leaf)
        return new
    if isinstance(state, tuple) and hasattr(state, "_fields"):  # a namedtuple: its fields by position
        return type(state)(*(map_leaves(v, fn, leaf) for v in state))
    if isinstance(state, (list, tuple)):
        return type(state)(map_leaves(v, fn, leaf) for v in state)
    return state


def clone_state(state: Any) -> Any:
    """A deep copy of a state's tensors (torch's optimizers return their own, not copies)."""
    return map_leaves(state, torch.Tensor.clone)
