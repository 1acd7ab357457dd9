"""The ranks of a checkpoint's save or load agreeing (:mod:`fastreduce.checkpoint`): rank 0
deciding for every rank, every rank's problem seen by all."""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

from .faults_watchdog import all_gather_object_watched, broadcast_object_watched


# ---------------------------------------------------------------------- ranks agree


def current_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def current_world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def on_rank0(fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0, its result (or its error, raised) on every rank: a barrier too."""
    box: list[Any] = [None]
    if current_rank() == 0:
        try:
            box[0] = (True, fn())
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            box[0] = (False, f"{type(e).__name__}: {e}")
    if current_world() > 1:
        box[0] = broadcast_object_watched(box[0], 0)
    ok, value = box[0]
    if not ok:
        raise RuntimeError(f"fastreduce checkpoint: rank 0 failed: {value}")
    return value


def every_rank_says(problem: str | None) -> list[tuple[int, str]]:
    """``(rank, problem)`` of every rank that has one, on every rank (collective)."""
    problems = all_gather_object_watched(problem) if current_world() > 1 else [problem]
    return [(r, p) for r, p in enumerate(problems) if p is not None]
