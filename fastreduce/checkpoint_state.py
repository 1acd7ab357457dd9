"""What a checkpoint holds per rank, as DCP entries (:mod:`fastreduce.checkpoint`): trees
packed into tensors and a pickled skeleton, a ZeRO optimizer's ranges staged for a load,
the rank's random generators."""

from __future__ import annotations

import pickle
import random
from dataclasses import dataclass
from typing import Any

import torch

from .nested import map_leaves

# ---------------------------------------------------------------------- per-rank trees


@dataclass(frozen=True, slots=True)
class _TensorAt:
    """A tensor's place in a packed tree's skeleton: its number among the tree's tensors."""

    index: int


_TensorAt.__module__ = "fastreduce.checkpoint"  # the name pickled since format 1 (re-exported there)


def pack_tree(tree: Any, prefix: str) -> dict[str, Any]:
    """``tree`` as DCP entries: ``prefix/<i>`` per tensor, ``prefix/tree`` the pickled rest
    (containers keep their types, :func:`fastreduce.nested.map_leaves`)."""
    tensors: list[torch.Tensor] = []

    def strip(t: torch.Tensor) -> _TensorAt:
        tensors.append(t.detach())
        return _TensorAt(len(tensors) - 1)

    skeleton = map_leaves(tree, strip)
    return {f"{prefix}/tree": pickle.dumps(skeleton), **{f"{prefix}/{i}": t for i, t in enumerate(tensors)}}


def load_template(metadata: Any, prefix: str) -> dict[str, Any]:
    """Empty entries for :func:`pack_tree`'s keys under ``prefix``, from the checkpoint's metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(prefix + "/"):
            out[key] = torch.empty(md.size, dtype=md.properties.dtype) \
                if isinstance(md, TensorStorageMetadata) else b""
    return out


def staged_ranges(tree: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """``tree`` (a ZeroOptimizer's sharded_state_dict) with each range's live tensor
    replaced by a copy for DCP to fill; ``pairs`` gets ``(live, copy)``."""
    from .modes.zero_state import RangeShard

    def stage(shard: RangeShard) -> RangeShard:
        copy = shard.local.clone()
        pairs.append((shard.local, copy))
        return RangeShard(copy, shard.offset, shard.shape[0])

    return map_leaves(tree, stage, leaf=lambda x: isinstance(x, RangeShard))


def unpack_tree(state: dict[str, Any], prefix: str) -> Any:
    return map_leaves(pickle.loads(state[f"{prefix}/tree"]), lambda at: state[f"{prefix}/{at.index}"],
                      leaf=lambda x: isinstance(x, _TensorAt))


# ---------------------------------------------------------------------- random generators


def capture_rng_state() -> dict[str, Any]:
    """This process's generators: torch's CPU one, CUDA's (if CUDA is in use), Python's,
    NumPy's (if installed)."""
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        out["numpy"] = np.random.get_state()
    return out


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
