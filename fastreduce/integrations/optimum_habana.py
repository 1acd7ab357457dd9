"""optimum-habana: make ``GaudiTrainer``'s ``fast_ddp`` path reduce gradients with fastreduce.

One line before ``trainer.train()``::

    from fastreduce.integrations import optimum_habana

    optimum_habana.install()        # or install(fusion_buffer_dtype=torch.float32): exact fp32 average

    args = GaudiTrainingArguments(..., distribution_strategy="fast_ddp")
    trainer = GaudiTrainer(model=model, gaudi_config=gaudi_config, args=args, train_dataset=ds)
    trainer.train()                 # under torchrun / gaudi_spawn.py, one process per card

What ``GaudiTrainer`` does with ``distribution_strategy="fast_ddp"`` (read from
optimum-habana 1.21.2's ``transformers/trainer.py``; ``tests/test_optimum_habana.py``
checks it on the installed copy): it does not wrap the model in DDP; at the start of
every ``train()`` (in ``_inner_training_loop``) it runs
``from ..distributed import all_reduce_gradients`` and broadcasts rank 0's parameters
(``torch.distributed.broadcast(param.data, src=0)`` for each); then, after backward on
each micro-step that ends a gradient-accumulation window, it calls
``all_reduce_gradients(model, use_hpu_graphs=True)``, before clipping and the optimizer
step; and it zeroes gradients with ``set_to_none=False``.

:func:`install` sets the attribute ``all_reduce_gradients`` of
``optimum.habana.distributed`` (where the trainer's import finds it), of
``optimum.habana.distributed.fast_ddp`` (where it is defined) and of any other
``optimum.habana`` module already imported that holds optimum-habana's function, to
a function that calls :func:`fastreduce.all_reduce_gradients`, which takes the same
arguments (``model, fusion_buffer_dtype=torch.bfloat16, use_hpu_graphs=True``) with
the same meaning and defaults. The trainer looks the function up anew at every
``train()``, so :func:`install` may come before or after the trainer is built, as long
as it comes before ``train()``; code that imported the function itself before
:func:`install` (``from optimum.habana.distributed import all_reduce_gradients``) keeps
optimum-habana's. The trainer's broadcast of rank 0's parameters is left as it is:
fastreduce, like optimum-habana's function, needs every rank to start from the same
parameters, and keeps the gradients equal across ranks from there on.

:func:`uninstall` puts optimum-habana's function back. Importing this module imports
nothing from optimum-habana; :func:`install` does, and raises :class:`ImportError`
(with the real error chained) where ``optimum.habana`` does not import: its package
``__init__`` imports the trainers and checks Habana's plugin's version (``pip list``), so
it needs Habana's software and the transformers version optimum-habana pins.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

import torch

from ..modes import functional

__all__ = ["FastReduceGaudiTrainer", "install", "uninstall", "installed"]

_PACKAGE = "optimum.habana.distributed"
_NAME = "all_reduce_gradients"
_UNSET: Any = object()

# While installed: optimum-habana's function and the modules whose attribute was set.
_original: Callable[..., Any] | None = None
_patched: list[Any] = []


def install(fusion_buffer_dtype: torch.dtype | None = _UNSET, use_hpu_graphs: bool | None = None,
            **settings: Any) -> Callable[..., None]:
    """Make optimum-habana's ``all_reduce_gradients`` (``GaudiTrainer``'s ``fast_ddp``
    path) call :func:`fastreduce.all_reduce_gradients`; return the function installed.

    Call it on every rank before ``trainer.train()``. Calling it again replaces the
    settings; :func:`uninstall` restores optimum-habana's function.

    Args:
        fusion_buffer_dtype: the wire dtype when the caller does not pass one (the
            trainer does not): fastreduce's default, like optimum-habana's, is
            ``torch.bfloat16``; ``torch.float32`` (or ``None``) averages exactly as
            DDP does. A caller's explicit argument wins.
        use_hpu_graphs: ``None`` (default): as the caller says (the trainer always
            passes ``True``: pack/unpack are recorded as HPU graphs, as optimum-habana's
            function does); ``True``/``False`` overrides the caller.
        **settings: keyword arguments of :func:`fastreduce.all_reduce_gradients`
            (``group``, ``backend``, ``unused_grads``, ``accumulate_dtype``,
            ``transport``), used when the caller does not pass them.

    Raises:
        ImportError: ``optimum.habana.distributed`` does not import (optimum-habana
            missing, or its package ``__init__`` failing without Habana's software);
            the error it raised is chained.
        TypeError: a setting :func:`fastreduce.all_reduce_gradients` does not take.
    """
    global _original
    allowed = {"group", "backend", "unused_grads", "accumulate_dtype", "transport"}
    unknown = sorted(set(settings) - allowed)
    if unknown:
        raise TypeError(f"install() got settings fastreduce.all_reduce_gradients does not take: {unknown}; "
                        f"it takes {sorted(allowed)}")
    package = _import_distributed()
    current = getattr(package, _NAME)
    original = _original if _is_ours(current) and _original is not None else current
    replacement = _make_replacement(fusion_buffer_dtype, use_hpu_graphs, settings)

    modules = [package]
    defining = sys.modules.get(f"{_PACKAGE}.fast_ddp")
    if defining is not None:
        modules.append(defining)
    for name, module in list(sys.modules.items()):
        if (name.startswith("optimum.habana") and module is not None and module not in modules
                and _holds(module, original)):
            modules.append(module)
    for module in _patched:
        if module not in modules:
            modules.append(module)
    for module in modules:
        setattr(module, _NAME, replacement)
    _original = original
    _patched[:] = modules
    return replacement


def uninstall() -> None:
    """Put optimum-habana's ``all_reduce_gradients`` back where :func:`install` replaced
    it. Does nothing when not installed."""
    global _original
    if _original is None:
        return
    for module in _patched:
        if _is_ours(getattr(module, _NAME, None)):
            setattr(module, _NAME, _original)
    _patched.clear()
    _original = None


def installed() -> bool:
    """Whether ``optimum.habana.distributed.all_reduce_gradients`` is fastreduce's now
    (``False`` also when optimum-habana has not been imported)."""
    package = sys.modules.get(_PACKAGE)
    return package is not None and _is_ours(getattr(package, _NAME, None))


# ---------------------------------------------------------------------- helpers

def _import_distributed() -> Any:
    try:
        return importlib.import_module(_PACKAGE)
    except Exception as exc:  # noqa: BLE001 - its __init__ fails in several ways without Habana's stack
        raise ImportError(
            "fastreduce.integrations.optimum_habana.install() needs optimum-habana importable "
            "(pip install optimum-habana, on Habana's software stack: habana_frameworks / SynapseAI, and the "
            f"transformers version it pins); `import {_PACKAGE}` failed with "
            f"{type(exc).__name__}: {exc}") from exc


def _make_replacement(fusion_buffer_dtype: Any, use_hpu_graphs: bool | None,
                      settings: dict[str, Any]) -> Callable[..., None]:
    default_dtype = torch.bfloat16 if fusion_buffer_dtype is _UNSET else fusion_buffer_dtype

    def all_reduce_gradients(model: torch.nn.Module, fusion_buffer_dtype: torch.dtype | None = default_dtype,
                             use_hpu_graphs: bool = True, **kwargs: Any) -> None:
        graphs = use_hpu_graphs if forced_graphs is None else forced_graphs
        functional.all_reduce_gradients(model, fusion_buffer_dtype, graphs, **{**settings, **kwargs})

    forced_graphs = use_hpu_graphs
    all_reduce_gradients._fastreduce_installed = True  # type: ignore[attr-defined]
    all_reduce_gradients.__doc__ = ("fastreduce's all_reduce_gradients, installed in optimum-habana's place by "
                                    "fastreduce.integrations.optimum_habana.install().\n\n"
                                    + (functional.all_reduce_gradients.__doc__ or ""))
    return all_reduce_gradients


def _is_ours(fn: Any) -> bool:
    return getattr(fn, "_fastreduce_installed", False) is True


def _holds(module: Any, original: Any) -> bool:
    try:  # a lazily importing module may raise more than AttributeError
        fn = module.__dict__.get(_NAME)
    except Exception:  # noqa: BLE001
        return False
    return fn is not None and (fn is original or _is_ours(fn))


def _make_gaudi_trainer() -> type:
    from optimum.habana import GaudiTrainer

    from .transformers import FastReduceMixin

    class FastReduceGaudiTrainer(FastReduceMixin, GaudiTrainer):
        """optimum-habana's ``GaudiTrainer`` in any fastreduce mode (``fastreduce_mode``,
        ``fastreduce_config``: :class:`~fastreduce.integrations.transformers.FastReduceMixin`),
        with ``distribution_strategy="ddp"`` (the mode replaces DDP; ``fast_ddp`` is
        :func:`install`'s path, for the fused mode only). Written against optimum-habana
        1.21's ``GaudiTrainer``, a ``transformers.Trainer`` subclass with a training loop of its
        own; its whole ``train()`` runs in every mode on optimum-habana's CPU path
        (``use_habana=False``) in tests/test_gaudi_trainer.py; on an HPU, not yet run."""

    FastReduceGaudiTrainer.__module__ = __name__
    FastReduceGaudiTrainer.__qualname__ = "FastReduceGaudiTrainer"
    return FastReduceGaudiTrainer


def __getattr__(name: str) -> Any:
    # GaudiTrainer imports Habana's software: build the class on first use only.
    if name == "FastReduceGaudiTrainer":
        try:
            cls = _make_gaudi_trainer()
        except Exception as exc:  # noqa: BLE001 - optimum.habana's import also checks Habana's plugin's version
            raise ImportError("fastreduce.integrations.optimum_habana.FastReduceGaudiTrainer needs optimum-habana "
                              "(1.21: transformers 4.55) and Habana's software, and `import optimum.habana` failed "
                              f"({type(exc).__name__}: {exc})") from exc
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
