"""Every module of the package imports on a machine without a GPU or a Gaudi (their
device code is imported lazily, inside the functions that need it)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import fastreduce

MODULES = sorted(m.name for m in pkgutil.walk_packages(fastreduce.__path__, "fastreduce.")
                 if not m.name.endswith("__main__"))  # that one runs the CLI


EXTRAS = {"fastreduce.integrations.lightning": "lightning", "fastreduce.integrations.transformers": "transformers"}
"""Integration modules and the optional package each needs (``fastreduce[lightning]``,
``fastreduce[hf]``): without it the module's import is skipped, not failed."""


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name: str) -> None:
    if name in EXTRAS:
        pytest.importorskip(EXTRAS[name], reason=f"{name} needs the optional package {EXTRAS[name]}")
    importlib.import_module(name)


def test_public_names_resolve() -> None:
    for name in fastreduce.__all__:
        assert getattr(fastreduce, name) is not None
