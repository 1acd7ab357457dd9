"""fastreduce: data-parallel gradient reduction as cheap as the collective itself.

    loss.backward()
    fastreduce.all_reduce_gradients(model)   # drop-in for optimum-habana's call
    optimizer.step()

Layers, bottom up: :mod:`.engine` (process groups), :mod:`.backends` (device dispatch:
HPU graphs, CUDA graphs, eager), :mod:`.comm` (the communication layer: all-reduce,
reduce-scatter, all-gather; :mod:`.comm.shm`, shared memory for CPU ranks on one host),
:mod:`.layout`, :mod:`.buffer` and :mod:`.grads` (which grads, where in the flat buffer),
:mod:`.buckets` (backward-order buckets launched from hooks), then the modes, one module
each in :mod:`.modes` (fused, overlap, functional, zero, gossip, localsgd, diloco);
:mod:`.checkpoint` saves and resumes any of them; :mod:`.membership` keeps training when
ranks are lost or join; :mod:`.compiling` keeps their overlap under ``torch.compile``; :mod:`.lifecycle` stops
what runs in the background (``fastreduce.shutdown()``, and at exit). This module holds the public names only.
"""

import importlib
from typing import Any

from .version import __version__

_WHERE = {  # each public name -> the module that defines it, imported on first use
    "CheckpointDamagedError": ".checkpoint", "CheckpointMismatchError": ".checkpoint",
    "DecentralizedDataParallel": ".modes.gossip", "DiLoCo": ".modes.diloco", "DistInfo": ".engine",
    "FusedReducer": ".modes.fused", "GraphContractError": ".backends", "JobCheckpoints": ".job_checkpoints",
    "LayoutMismatchError": ".layout",
    "LocalSGD": ".modes.localsgd", "Membership": ".membership", "MembershipError": ".membership",
    "NonFiniteGradError": ".grads", "PowerSGD": ".codecs", "RankLostError": ".faults",
    "ReducerConfig": ".modes.fused", "ReducerStats": ".modes.fused", "SparseLoCo": ".codecs",
    "ZeroOptimizer": ".modes.zero", "all_reduce_gradients": ".modes.functional", "compile_backend": ".compiling",
    "gradient_reducer": ".modes.functional", "init_distributed": ".engine", "shutdown": ".lifecycle",
}
"""[Note: lazy names] ``import fastreduce`` imports neither torch nor a mode: a name is
imported where it is first used (``fastreduce.ZeroOptimizer``, ``from fastreduce import
Membership``), so the command line's ``fastreduce plan`` answers in a fraction of a second
and ``fastreduce --help`` does not wait for torch."""


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value: Any = getattr(importlib.import_module(_WHERE[name], __name__), name)
    else:  # a submodule, as an attribute (fastreduce.checkpoint.Checkpointer, fastreduce.comm.shm)
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'fastreduce' has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "CheckpointDamagedError",
    "CheckpointMismatchError",
    "DecentralizedDataParallel",
    "DiLoCo",
    "DistInfo",
    "FusedReducer",
    "GraphContractError",
    "JobCheckpoints",
    "LayoutMismatchError",
    "LocalSGD",
    "Membership",
    "MembershipError",
    "NonFiniteGradError",
    "PowerSGD",
    "RankLostError",
    "ReducerConfig",
    "ReducerStats",
    "SparseLoCo",
    "ZeroOptimizer",
    "all_reduce_gradients",
    "checkpoint",
    "compile_backend",
    "gradient_reducer",
    "init_distributed",
    "shutdown",
]

from .integrations import lightning_names as _lightning_names  # noqa: E402

_lightning_names.register()  # Lightning's strategy="fastreduce_zero", ...: known once lightning is imported too
