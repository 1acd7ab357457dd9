"""Lightning's strategy names for fastreduce, known once ``lightning`` and ``fastreduce`` are
both imported, in either order: ``Trainer(strategy="fastreduce_zero")``, ``"fastreduce"``
(the fused mode), ``"fastreduce_overlap"``, ``"fastreduce_localsgd"``, ``"fastreduce_diloco"``,
``"fastreduce_gossip"``, each the mode with its default settings (LocalSGD and DiLoCo need
``sync_every``, which a name cannot carry: theirs fail when the ``Trainer`` is built, saying
to pass ``FastReduceStrategy(mode, sync_every=...)``).

Lightning learns a strategy's name only from code that registers it in its
``StrategyRegistry``: it reads no entry points for strategies (only for callback factories,
and those when a ``Trainer`` is built, after the strategy name was checked). So ``import
fastreduce`` calls :func:`register`: where ``lightning.pytorch`` is imported already, it imports
:mod:`fastreduce.integrations.lightning`, whose last line registers the names; otherwise a
finder on ``sys.meta_path`` does so right after ``lightning.pytorch`` is first imported (the
module itself loads as it would have, with its own loader), and takes itself off.
``import fastreduce`` never imports Lightning itself.

``pytorch_lightning`` (Lightning's standalone package) keeps a registry of its own, and
``FastReduceStrategy`` is a ``lightning.pytorch`` strategy: there the names are registered
to an error that says so and what to use instead.
"""

from __future__ import annotations

import importlib
import importlib.abc
import logging
import sys
from types import ModuleType
from typing import Any, Sequence

__all__ = ["register"]

log = logging.getLogger(__name__)

_TARGETS = ("lightning.pytorch", "pytorch_lightning")


def register() -> None:
    """Make the names known to each Lightning package imported now, and to each one imported later."""
    later = [name for name in _TARGETS if name not in sys.modules]
    for name in _TARGETS:
        if name in sys.modules:
            _loaded(name)
    if later and not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(later))


def _loaded(name: str) -> None:
    """``name`` (one of :data:`_TARGETS`) is imported: register the names in its registry.
    A failure is logged, never raised: it must not fail the user's ``import lightning``."""
    try:
        if name == "lightning.pytorch":
            importlib.import_module("fastreduce.integrations.lightning")  # registers as it ends
        else:
            _refuse_in_pytorch_lightning()
    except Exception as exc:  # noqa: BLE001 (logged with its cause: Lightning's "invalid strategy name" follows)
        log.warning("fastreduce: Lightning's strategy names (strategy='fastreduce_zero', ...) could not be "
                    "registered with %s: %s: %s. Pass strategy=FastReduceStrategy(mode) from "
                    "fastreduce.integrations.lightning instead (importing it shows the whole error)",
                    name, type(exc).__name__, exc)


def _refuse_in_pytorch_lightning() -> None:
    from pytorch_lightning.strategies import StrategyRegistry

    from .modes import MODES

    for mode in MODES:
        name = "fastreduce" if mode == "fused" else f"fastreduce_{mode}"
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, _only_in_lightning, description="fastreduce's strategies run in "
                                      "lightning.pytorch's Trainer", strategy_name=name)


def _only_in_lightning(strategy_name: str) -> Any:
    raise TypeError(f"strategy={strategy_name!r} is fastreduce's FastReduceStrategy, a strategy of the `lightning` "
                    "package (lightning.pytorch), and this Trainer is pytorch_lightning's: build the Trainer from "
                    "lightning.pytorch (`from lightning.pytorch import Trainer`; your LightningModule from "
                    "lightning.pytorch too)")


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls :func:`_loaded` right after each of ``names`` is first imported, then leaves ``sys.meta_path``."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = set(names)

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname not in self.names:
            return None
        self.names.discard(fullname)  # once (and the lookup below must not come back here)
        if not self.names and self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if finder is not self and find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenRegister(spec.loader, fullname)
        return spec


class _ThenRegister(importlib.abc.Loader):
    """``loader``, then :func:`_loaded`; the module keeps ``loader`` as its own."""

    def __init__(self, loader: Any, name: str) -> None:
        self.loader, self.name = loader, name

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self.loader
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self.loader
        self.loader.exec_module(module)
        _loaded(self.name)

    def __getattr__(self, attr: str) -> Any:  # the rest (is_package, get_resource_reader, ...) is the loader's
        return getattr(self.loader, attr)
