"""fastreduce: data-parallel gradient reduction as cheap as the collective itself.

    loss.backward()
    fastreduce.all_reduce_gradients(model)   # drop-in for optimum-habana's call
    optimizer.step()

Layers (one module each): :mod:`.engine` (process groups), :mod:`.backends` (device
dispatch: HPU graphs, CUDA graphs, eager), :mod:`.comm` (the communication layer:
all-reduce, reduce-scatter, all-gather; with :mod:`.comm.shm`, shared memory for CPU
ranks on one host), :mod:`.layout` and
:mod:`.buffer` (which grads, where in the flat buffer), and the modes on top
(:mod:`.fused`, :mod:`.overlap`, :mod:`.zero`, :mod:`.decentralized` with
:mod:`.topology`, :mod:`.local`); :mod:`.checkpoint` saves and resumes any of them.
"""

from . import checkpoint  # the submodule: fastreduce.checkpoint.Checkpointer
from .backends import GraphContractError
from .checkpoint import CheckpointMismatchError
from .decentralized import DecentralizedDataParallel
from .engine import DistInfo, init_distributed
from .faults import RankLostError
from .fused import (FusedReducer, NonFiniteGradError, ReducerConfig, ReducerStats, all_reduce_gradients,
                    gradient_reducer)
from .layout import LayoutMismatchError
from .local import DiLoCo, LocalSGD
from .zero import ZeroOptimizer

__all__ = [
    "CheckpointMismatchError",
    "DecentralizedDataParallel",
    "DiLoCo",
    "DistInfo",
    "FusedReducer",
    "GraphContractError",
    "LayoutMismatchError",
    "LocalSGD",
    "NonFiniteGradError",
    "RankLostError",
    "ReducerConfig",
    "ReducerStats",
    "ZeroOptimizer",
    "all_reduce_gradients",
    "checkpoint",
    "gradient_reducer",
    "init_distributed",
]

__version__ = "0.1.0"
