"""The mode contract: what every mode declares, so that the code that runs a mode
(:class:`~fastreduce.Membership`, the trainers, checkpoints) asks it instead of guessing
from which attributes the mode happens to have.

Two parts of it hold for every mode today:

* **how a step commits** under a Membership: the class attribute ``commit_style``, one of
  :data:`COMMIT_STYLES` (read through :func:`commit_style`);
* **how a mode closes**: ``close(drain=True)``, its hooks off the model, what is in flight
  waited for (``drain=False``: dropped, a peer was lost).

The rest of what the consumers need (a mode's state per rank, its figures, its settings)
is still read in several places; docs/design.md, "The modes and what they share".
"""

from __future__ import annotations

from typing import Any

__all__ = ["COMMIT_STYLES", "commit_style"]

COMMIT_STYLES: dict[str, str] = {
    "reduce": "the fused and overlapped reducers: commit() runs the reduction, the members vote, "
              "then the optimizer steps",
    "zero": "ZeroOptimizer: the members vote inside its step(), between the last gradient collective "
            "and the shards' step (its commit_point())",
    "gossip": "DecentralizedDataParallel: its steps and exchanges run inside forward and backward; "
              "commit(fn) runs them, then the members vote",
    "local": "LocalSGD and DiLoCo: the collectives run inside the optimizer's step; the members vote "
             "only before a step that syncs",
}
"""Every way a mode's step commits, with what it means."""


def commit_style(mode: Any) -> str:
    """How a step of ``mode`` commits (a key of :data:`COMMIT_STYLES`), as its class declares
    it (``commit_style``); ``""`` for an object that declares none: not a mode."""
    style = getattr(type(mode), "commit_style", "")
    return style if style in COMMIT_STYLES else ""
