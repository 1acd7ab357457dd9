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
ranks are lost or join; :mod:`.compiling` keeps their overlap under ``torch.compile``. This module holds the public names only.
"""

from . import checkpoint  # the submodule: fastreduce.checkpoint.Checkpointer
from .backends import GraphContractError
from .checkpoint import CheckpointDamagedError, CheckpointMismatchError
from .codecs import PowerSGD, SparseLoCo
from .compiling import compile_backend
from .engine import DistInfo, init_distributed
from .faults import RankLostError
from .grads import NonFiniteGradError
from .layout import LayoutMismatchError
from .membership import Membership, MembershipError
from .modes.diloco import DiLoCo
from .modes.functional import all_reduce_gradients, gradient_reducer
from .modes.fused import FusedReducer, ReducerConfig, ReducerStats
from .modes.gossip import DecentralizedDataParallel
from .modes.localsgd import LocalSGD
from .modes.zero import ZeroOptimizer
from .version import __version__

__all__ = [
    "CheckpointDamagedError",
    "CheckpointMismatchError",
    "DecentralizedDataParallel",
    "DiLoCo",
    "DistInfo",
    "FusedReducer",
    "GraphContractError",
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
]
