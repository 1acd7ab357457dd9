"""A CPU stand-in for graph capture that enforces the graph contract.

A real CUDA or HPU graph records kernels at capture and, at every replay, runs them on
the addresses it recorded, whatever the Python code would touch now. A reducer that
packs from a gradient that ``zero_grad(set_to_none=True)`` freed and the next backward
re-allocated would then silently read stale memory. :class:`CheckedBackend` turns that
silent corruption into an error on any machine:

* ``capture(fn)`` runs ``fn`` under a dispatch mode that records every op and the
  address, dtype, shape and strides of every tensor it touches, *without executing
  it* (as real capture does not), and rejects ops that would allocate memory;
* each replay runs ``fn`` again, checks op by op that it touches exactly what was
  recorded, and only then executes the op; a difference raises
  :class:`GraphContractError` before anything is written.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..torch_internals import TorchDispatchMode, op_schema, tree_flatten

__all__ = ["CheckedBackend", "GraphContractError"]


class GraphContractError(RuntimeError):
    """A captured function touched memory other than what it touched at capture."""


def _fingerprint(func: Any, args: tuple, kwargs: dict) -> tuple:
    flat, _ = tree_flatten((args, kwargs))
    tensors = tuple((t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
                    for t in flat if isinstance(t, torch.Tensor))
    return (str(func), tensors)


def _written(schema: Any, args: tuple, kwargs: dict) -> Any:
    """What an in-place or out= op returns, without running it: its written outputs."""
    if not schema.returns:  # e.g. _foreach_copy_
        return None
    outs = [kwargs[a.name] for a in schema.arguments
            if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write and a.name in kwargs]
    if len(schema.returns) > 1:
        return tuple(outs)
    return outs[0] if outs else (args[0] if args else None)


def _mutates_only(func: Any) -> bool:
    """True for in-place/out= ops and views: the ops a graph over fixed buffers may hold."""
    schema = op_schema(func)
    if schema.is_mutable:
        return True
    return all(r.alias_info is not None for r in schema.returns)


class _Recorder(TorchDispatchMode):
    def __init__(self, expected: list[tuple] | None):
        super().__init__()
        self.expected = expected
        self.seen: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fp = _fingerprint(func, args, kwargs)
        i = len(self.seen)
        self.seen.append(fp)
        if self.expected is None:  # capturing: record, run views, skip writes
            if not _mutates_only(func):
                raise GraphContractError(f"captured function allocates ({func}); graphs "
                                         "must only read and write persistent buffers")
            schema = op_schema(func)
            if schema.is_mutable:
                return _written(schema, args, kwargs)
            return func(*args, **kwargs)
        if i >= len(self.expected) or self.expected[i] != fp:
            want = self.expected[i] if i < len(self.expected) else "<nothing>"
            raise GraphContractError(f"replay op {i} touches memory the capture did not: "
                                     f"captured {want}, replay would run {fp}; a real "
                                     "graph would silently read or write stale addresses")
        return func(*args, **kwargs)


class CheckedBackend:
    """Graph-contract checker for tests: capture records, replay verifies then runs."""

    name = "checked"

    def __init__(self) -> None:
        self.replays = 0

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        rec = _Recorder(None)
        with torch.no_grad(), rec:
            fn()
        expected = rec.seen

        def replay() -> None:
            check = _Recorder(expected)
            with torch.no_grad(), check:
                fn()
            if len(check.seen) != len(expected):
                raise GraphContractError(f"replay ran {len(check.seen)} ops, capture "
                                         f"recorded {len(expected)}")
            self.replays += 1

        return replay
