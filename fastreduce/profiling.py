"""Profiler ranges that cost nothing when no profiler is recording.

``record_function`` dispatches two ops and runs Python on every entry even with the
profiler off, which on a small model costs more than the collective it labels; so
:func:`span` hands out a real range only while a profiler is active.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from torch.profiler import record_function

from .torch_internals import profiler_enabled

__all__ = ["span"]

_NULL = nullcontext()


def span(name: str) -> AbstractContextManager:
    """``record_function(name)`` while a profiler records (on this thread, or anywhere in the
    process: a profile taken with ``profile_all_threads=True`` also records fastreduce's
    worker thread), else a no-op context."""
    if profiler_enabled():
        return record_function(name)
    return _NULL
