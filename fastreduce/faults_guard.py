"""The guard (:mod:`fastreduce.faults`): a mode's call that waits on collectives re-raises a
transport failure whose diagnosis finds a lost rank as a :class:`~.faults_errors.RankLostError`
that says what the call left behind."""

from __future__ import annotations

import atexit
import functools
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

import torch.distributed as dist

import fastreduce.faults_heartbeat as heartbeat
from .faults_diagnosis import store_host_rank, diagnose
from .faults_errors import RankLostError, is_transport_failure
from .faults_heartbeat import heartbeat_interval, lost_after, start_heartbeat

__all__ = ["as_rank_lost", "guard", "guarded"]

F = TypeVar("F", bound=Callable[..., Any])


def as_rank_lost(err: BaseException, where: str, state: str) -> RankLostError | None:
    """``err`` as a :class:`RankLostError` of the call ``where`` leaving ``state``, or
    ``None`` when it is not a lost rank's doing (or is one already told)."""
    if isinstance(err, RankLostError):
        if err.where is not None:
            return None
        _linger_if_store_host()
        return err.at(where, state)
    beat = heartbeat.heartbeat_now()
    known = beat is not None and bool(beat.lost)  # then any failure is the loss's doing (e.g. a
    # collective left in flight by the failed call), and every later call raises at once
    if not (known or is_transport_failure(err)) or not dist.is_initialized():
        return None
    ranks, how, who = diagnose()
    if not ranks:
        return None
    _linger_if_store_host()
    return RankLostError(ranks, where, state, how, dist.get_world_size(), who)


_lingering = False


def _linger_if_store_host() -> None:
    """On the rank that hosts the store: at exit, wait one diagnosis window, so that the
    other survivors finish theirs before the store goes (see [Note: the store dies
    mid-diagnosis]); a few seconds, only in a job that lost a rank."""
    global _lingering
    if _lingering or not dist.is_initialized() or store_host_rank() != dist.get_rank():
        return
    _lingering = True
    atexit.register(time.sleep, lost_after() + heartbeat_interval())


@contextmanager
def guard(where: str, state: str) -> Iterator[None]:
    """Re-raise a collective failure inside the block as a :class:`RankLostError` of
    ``where`` (e.g. ``"ZeroOptimizer.step()"``), whose message says ``state`` (what the
    failure left behind), when a diagnosis finds a lost rank; else unchanged."""
    if heartbeat.heartbeat_now() is None:
        start_heartbeat()
    try:
        yield
    except RuntimeError as err:
        _raise_lost(err, where, state)
        raise


def _raise_lost(err: RuntimeError, where: str, state: str) -> None:
    """Raise ``err`` as the :class:`RankLostError` a diagnosis makes of it; return where it
    finds no lost rank (the caller re-raises ``err``)."""
    lost = as_rank_lost(err, where, state)
    if lost is None:
        return
    try:
        raise lost from err
    finally:  # this frame, in lost's traceback, must not hold it: a cycle the collector frees late
        del lost  # (with the failed mode, its group's sockets and threads in it)


def guarded(where: str, state: str) -> Callable[[F], F]:
    """:func:`guard` as a method decorator (a plain ``try``, no context manager on the
    hot path). ``where`` may hold ``{cls}`` (the instance's class name).

    Example::

        @guarded("{cls}.step()", "this step's gradients are lost; the parameters are as before it.")
        def step(self): ...
    """
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(self: Any, *args: Any, **kwargs: Any) -> Any:
            if heartbeat.heartbeat_now() is None:  # a mode's first collectives may come before its Comm
                start_heartbeat()
            try:
                return fn(self, *args, **kwargs)
            except RuntimeError as err:
                _raise_lost(err, where.format(cls=type(self).__name__), state)
                raise
        return inner  # type: ignore[return-value]
    return wrap
