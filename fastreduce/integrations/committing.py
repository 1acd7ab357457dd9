"""The optimizer a trainer steps under a :class:`fastreduce.Membership`: a wrapper, not a patch.

The HF Trainer is given it in place of its optimizer (``create_optimizer``), Lightning's
precision plugin steps it (``FastReduceStrategy.optimizer_step``). Its ``step`` runs the
trainer's closure, if any, then commits the step through the Membership
(:meth:`~fastreduce.integrations.membership.TrainerMembership.commit`), which steps the
wrapped optimizer on every member or on none. Everything else (param groups, state, state
dicts, ``zero_grad``) is the wrapped optimizer's, so LR schedulers, Accelerate's wrapper,
gradient scalers and checkpoints see the trainer's own optimizer; nothing of it is
replaced or marked.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch

__all__ = ["CommittingOptimizer", "commits", "unwrapped"]


class CommittingOptimizer(torch.optim.Optimizer):
    """``optimizer``, whose ``step`` commits through ``commit`` (a callable given the wrapped
    optimizer's ``step``; it returns whether the step was committed).

    A subclass of ``torch.optim.Optimizer`` (LR schedulers and Accelerate ask for one) that
    holds nothing of its own: ``Optimizer.__init__`` is not called, every attribute the
    trainers read is the wrapped optimizer's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, commit: Callable[[Callable[[], Any]], bool]):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"CommittingOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer, self.commit = optimizer, commit

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """The closure (Lightning's: its training step, backward, clipping), then the commit."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.commit(self.optimizer.step)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        self.optimizer.load_state_dict(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"CommittingOptimizer({self.optimizer!r})"


def _chain(optimizer: Any) -> list[Any]:
    """``optimizer``, then each optimizer inside Accelerate's wrapper and a
    :class:`CommittingOptimizer` (each holds it as ``.optimizer``)."""
    accelerated = getattr(sys.modules.get("accelerate.optimizer"), "AcceleratedOptimizer", ())
    out = [optimizer]
    while isinstance(out[-1], (CommittingOptimizer, accelerated)):
        out.append(out[-1].optimizer)
    return out


def unwrapped(optimizer: Any) -> Any:
    """The trainer's own optimizer inside Accelerate's wrapper and a :class:`CommittingOptimizer`."""
    return _chain(optimizer)[-1]


def commits(optimizer: Any) -> bool:
    """Whether ``optimizer`` steps through a commit: a :class:`CommittingOptimizer`, or one
    inside Accelerate's wrapper (a trainer's second ``train()``)."""
    return any(isinstance(o, CommittingOptimizer) for o in _chain(optimizer))
