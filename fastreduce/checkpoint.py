"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), on any world size.

A ZeRO shard is a contiguous range of a flat buffer, so the piece of a parameter's
state that a rank holds is a contiguous range of that parameter's elements, of any
length, possibly empty. Neither of DCP's own sharded types fits: a ``DTensor`` is cut
evenly, and a ``ShardedTensor`` (deprecated) is dropped from a load plan on ranks that
hold none of it. :class:`RangeShard` is the small missing piece: a 1-D tensor of the
parameter's full length that carries only this rank's range and answers DCP's
checkpoint protocol (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``). Saving writes each range once, from its owner; loading on
another world size reads, into each rank's range, whatever saved ranges overlap it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["RangeShard"]


class RangeShard(torch.Tensor):
    """``numel`` elements, of which this rank holds ``local`` at ``offset``.

    Only a checkpoint view: DCP reads and fills ``local`` in place; any other
    operation on it raises.
    """

    local: torch.Tensor
    offset: int

    @staticmethod
    def __new__(cls, local: torch.Tensor, offset: int, numel: int) -> RangeShard:
        if local.dim() != 1 or not 0 <= offset <= offset + local.numel() <= numel:
            raise ValueError(f"a range of {local.numel()} elements at {offset} does not fit in {numel}")
        t = torch.Tensor._make_wrapper_subclass(cls, (numel,), dtype=local.dtype, device=local.device)
        t.local, t.offset = local, offset
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(f"{func} on a fastreduce RangeShard: it is a checkpoint view of one "
                                  "rank's range; read .local instead")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"RangeShard([{self.offset}, {self.offset + self.local.numel()}) of {self.shape[0]}, {self.dtype})"

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        if self.local.numel() == 0:
            return []
        offsets = torch.Size([self.offset])
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=offsets, sizes=self.local.shape),
                              properties=TensorProperties.create_from_tensor(self.local),
                              size=self.shape))]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        if self.local.numel() == 0:
            return []
        return [ChunkStorageMetadata(offsets=torch.Size([self.offset]), sizes=self.local.shape)]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return self.local
