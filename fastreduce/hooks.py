"""The hooks the modes put on a user's model and its parameters: registered and removed
here, so that one place says what runs when (and, under ``torch.compile``, how).

Modes keep the handles these functions return and hand them back to :func:`remove_hooks`
when they close.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["on_grad_ready", "remove_hooks"]


def on_grad_ready(params: tuple[torch.nn.Parameter, ...] | list[torch.nn.Parameter],
                  fn: Callable[[int], None]) -> list[Any]:
    """Call ``fn(i)`` when ``params[i]``'s grad is accumulated; returns the hook handles."""
    index = {p: i for i, p in enumerate(params)}
    return [p.register_post_accumulate_grad_hook(lambda q: fn(index[q])) for p in params]


def remove_hooks(handles: list[Any]) -> None:
    for h in handles:
        h.remove()
