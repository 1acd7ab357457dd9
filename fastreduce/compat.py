"""Where torch, accelerate, transformers or Lightning differ across the supported stacks.

One small helper per difference, each saying which versions do what; the rest of the
package calls the helper and never tests a version itself. The supported range (README,
"Supported stacks") is what ``make stack-NAME`` runs: Python 3.10 to 3.13, torch 2.6 to
2.15, transformers 4.49 to 5.x, accelerate 1.4 to 1.15, Lightning 2.5 to 2.6.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import re
from typing import Any, Iterable, Iterator

import torch

from .torch_internals import unsafe_preserve_version_counter

__all__ = ["version_of", "gloo_has_avg", "preserve_version_counters", "prepare_model_without_ddp"]


@functools.lru_cache(maxsize=None)
def version_of(distribution: str) -> tuple[int, ...]:
    """The installed release of ``distribution`` as a tuple (``"2.9.1+cu128"`` -> ``(2, 9, 1)``);
    ``()`` when it is not installed."""
    try:
        text = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ()
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])


def prepare_model_without_ddp(accelerator: Any, model: torch.nn.Module) -> torch.nn.Module:
    """``accelerator.prepare_model(model, evaluation_mode=True)`` (device placement, mixed
    precision, ``torch.compile``; no DDP), after which the accelerator's own
    ``prepare(model, optimizer)`` (what ``Trainer`` calls next) leaves the model as it is.

    accelerate 1.14 and newer return a model they have prepared unchanged
    (``_is_accelerate_prepared``). Before 1.14 a second ``prepare_model`` prepares it
    again, for training: it wraps the model in ``DistributedDataParallel`` and casts its
    forward once more. There this accelerator's ``prepare_model`` is wrapped so that it
    returns this model (or what was made of it) as it is; other models pass through.
    """
    prepared = accelerator.prepare_model(model, evaluation_mode=True)
    if version_of("accelerate") < (1, 14):
        original = accelerator.prepare_model

        def prepare_model(module: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
            return module if module is model or module is prepared else original(module, *args, **kwargs)

        accelerator.prepare_model = prepare_model
    return prepared


def gloo_has_avg() -> bool:
    """Whether Gloo's ``all_reduce`` takes ``ReduceOp.AVG``: torch 2.8 and newer.

    torch 2.6 and 2.7 raise ``Cannot use ReduceOp.AVG with Gloo``. The mean plan
    (:func:`fastreduce.comm.collectives.plan_mean`) reads this for Gloo and divides
    before a SUM where it is false (one more pass over the wire buffer); on a backend
    it does not know, it tries AVG once on the group. ``tests/test_compat.py`` checks
    it against a real Gloo all-reduce.
    """
    return version_of("torch") >= (2, 8)


@contextlib.contextmanager
def preserve_version_counters(tensors: Iterable[torch.Tensor]) -> Iterator[None]:
    """Hide the in-place writes made inside the block from autograd's version counters
    (``torch.autograd._unsafe_preserve_version_counter``), as DDP does when it broadcasts
    buffers that a saved graph may hold.

    torch 2.7 and newer take a tuple of tensors; torch 2.6 takes one tensor, so there each
    gets its own context.
    """
    tensors = tuple(tensors)
    with contextlib.ExitStack() as stack:
        if version_of("torch") >= (2, 7):
            stack.enter_context(unsafe_preserve_version_counter(tensors))
        else:
            for tensor in tensors:
                stack.enter_context(unsafe_preserve_version_counter(tensor))
        yield
