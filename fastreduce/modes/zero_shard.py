"""What one rank of a :class:`~fastreduce.ZeroOptimizer` holds: its chunk of every
bucket (:class:`Shard`) and the fp32 masters of bf16/fp16 chunks (the torch optimizer
that steps them, a view per parameter piece, is :mod:`.zero_pieces`).

Every bucket of the flat parameter buffer is padded to split into N equal chunks;
rank r's chunk r is a view of the parameters (fp32), or an fp32 copy of it (bf16/fp16:
the master weights), and its gradient is chunk r of the wire buffer, where the
reduce-scatter lands the mean (or a separate fp32 tensor where the wire differs from
the master's dtype, or a GradScaler unscales it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..buckets import Bucket
from ..layout import GradLayout

__all__ = ["Shard", "make_shards"]


@dataclass(slots=True, eq=False)
class Shard:
    """Rank r's chunk of one bucket."""

    group: int  # param group index
    params: torch.Tensor  # the bucket's slice of the flat parameter buffer
    master: torch.Tensor  # chunk r of ``params`` (a view), or its fp32 copy
    out: torch.Tensor | None  # where the reduce-scatter puts chunk r (None: the wire itself)
    send: torch.Tensor | None = None  # ``gather_dtype``: the bucket in it, what the all-gather moves

    @property
    def low(self) -> bool:
        """The master is a separate fp32 copy: of bf16/fp16 parameters, or of parameters
        gathered in a narrower dtype (which hold the master rounded to it)."""
        return self.master.dtype != self.params.dtype or self.send is not None


@torch.no_grad()
def make_shards(layout: GradLayout, flats: list[torch.Tensor], buckets: list[Bucket], groups: list[int],
                rank: int, world: int, separate_out: bool, gather: torch.dtype | None = None,
                alloc: Any = None) -> list[Shard]:
    """This rank's :class:`Shard` of each bucket (one bucket per layout segment):
    ``flats`` the flat parameter buffers, ``groups`` each segment's param group;
    ``separate_out``: the reduce-scatter lands in a tensor of its own even where the
    wire's dtype is the master's (a GradScaler unscales it there); ``gather``: the
    parameters of a wider dtype are all-gathered in this one, through a buffer from
    ``alloc(numel, dtype)``, and the master is a separate fp32 copy."""
    shards = []
    for s, (seg, flat, bucket) in enumerate(zip(layout.segments, flats, buckets)):
        c = seg.numel // world
        chunk = flat[rank * c:(rank + 1) * c]
        narrow = gather is not None and gather.itemsize < seg.dtype.itemsize
        master = chunk.float().clone() if narrow else chunk if seg.dtype.itemsize >= 4 else chunk.float()
        out = None if (master.dtype == bucket.wire.dtype and not separate_out) else \
            torch.zeros(c, dtype=master.dtype, device=master.device)
        master.grad = bucket.wire[rank * c:(rank + 1) * c] if out is None else out
        shards.append(Shard(groups[s], flat, master, out, alloc(seg.numel, gather) if narrow else None))
    return shards
