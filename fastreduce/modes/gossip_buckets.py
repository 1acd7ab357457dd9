"""How a :class:`~fastreduce.DecentralizedDataParallel` lays out its buckets, once the
backward order is known (or given by a checkpoint): each bucket's parameters as views of
one flat block, a second block the mix lands in, the send blocks where the wire's dtype
differs, and one optimizer (and scheduler) per bucket.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from ..buckets import Bucket, OverlapSchedule
from ..buffer import slot_view, params_as_views
from ..comm import Pending
from ..comm.quantized import QuantMix
from ..hooks import remove_hooks
from ..layout import GradLayout, ParamsHeld, bucket_runs, counted
from ..optim_kernels import prefer_fused
from ..sizing import GOSSIP_AUTO_WHY, Sizing

__all__ = ["GossipBuckets"]

log = logging.getLogger("fastreduce.modes.gossip")


class GossipBuckets:
    """The bucket layout of :class:`~fastreduce.DecentralizedDataParallel` (a mixin: it
    reads the mode's settings, communication layer and recorded order, and sets its
    blocks, views, buckets, optimizers and schedule)."""

    def _build(self, order: list[int], sizes: list[int] | None = None) -> None:
        self._give_back(self._comm_blocks)  # a rebuild (a state laid out in other buckets): the last layout's
        if self._recorder is not None:  # built from a checkpoint: no order to learn
            self._recorder.remove()
            self._recorder = None
        remove_hooks(self._marks)
        self._marks = []
        named = [self._named[i] for i in order]
        if sizes is None:
            if self.bucket_mb is None:  # "auto": one bucket (one per dtype)
                numel = sum(p.numel() for _, p in named)
                segments = bucket_runs(named, [0] * len(named), numel)
                mb = numel * named[0][1].element_size() / 2**20
                self.sizing = Sizing(mb, mb, 1, GOSSIP_AUTO_WHY)
            else:
                wire = torch.uint8 if self._quant else self.wire_dtype or named[0][1].dtype
                segments = bucket_runs(named, [0] * len(named), int(self.bucket_mb * 2**20) // wire.itemsize)
        else:
            starts = [sum(sizes[:k]) for k in range(len(sizes))]
            segments = [list(range(s, s + n)) for s, n in zip(starts, sizes)]
        layout = GradLayout(named, named[0][1].dtype, segments=segments)
        self._names = layout.names
        # Sent in the parameters' own dtype, a rank sends its parameter block itself: both
        # blocks then come from the communication layer (shared memory on one host), so
        # the peers read it where it is. A cast wire needs a send block of its own.
        quant = self._quant  # quantized: private blocks, the codes go point to point
        in_place = quant is None and (self.wire_dtype is None or all(seg.dtype == self.wire_dtype
                                                                     for seg in layout.segments))
        private = lambda n, d: torch.zeros(n, dtype=d, device=self.device)  # noqa: E731
        shared = self._taking(self._comm_blocks)
        alloc = shared if in_place else private
        self._flats = params_as_views(layout, alloc)
        self._mixed = self._blocks_like([f.dtype for f in self._flats], alloc)
        self._held = ParamsHeld(layout, self.module, "Call close() on every rank and build DecentralizedDataParallel "
                                "again after changing the model's parameters", whole=True, storage=False)
        # Per bucket, each parameter's view of either block: the mix lands in the block
        # the parameters do not use, and applying it swaps the two (no copy).
        self._views = [[(s.param, slot_view(f, s), slot_view(m, s)) for s in seg.slots]
                       for seg, f, m in zip(layout.segments, self._flats, self._mixed)]
        sends = self._flats if in_place or quant else self._blocks_like([self.wire_dtype] * len(self._flats), shared)
        self._sends = None if in_place or quant else sends
        self._qmix = None if quant is None else [QuantMix(self.comm, f.numel(), quant, self.device, self._compensate)
                                                 for f in self._flats]
        self._buckets = []
        first = 0
        for seg, flat, send in zip(layout.segments, self._flats, sends):
            slots = tuple(range(first, first + len(seg.slots)))
            self._buckets.append(Bucket(slots, (), (), flat, send))  # the schedule reads slots only
            first += len(seg.slots)
        self._optims = [self.optim_fn([(s.name, s.param) for s in seg.slots]) for seg in layout.segments]
        fused = [prefer_fused(o) for o in self._optims] if self.world_size > 1 else []
        self._scheds = [self.lr_scheduler_fn(o) if self.lr_scheduler_fn else None for o in self._optims]
        self.grad_norms: list[torch.Tensor | None] = [None] * len(self._optims)  # each bucket's, before clipping
        self._exchanges: list[Pending | None] = [None] * len(self._buckets)
        self._schedule = OverlapSchedule(layout, self._buckets, self._update, lambda idx, direct: ([], False),
                                         on_grad=self._grad_arrived)
        self._schedule.sync = not self._accumulating
        self._built = True
        if self.rank == 0:
            log.info("fastreduce: DecentralizedDataParallel: %s, in %s%s; topology %s (period %d), "
                     "%d ranks%s", layout.describe(), counted(len(self._buckets), "bucket"),
                     "" if self.sizing is None else f"; {self.sizing.describe()}", self.topology.name,
                     self.topology.period, self.world_size,
                     ", optimizers on torch's fused kernel (optim_fn chose none)" if any(fused) else "")

    def _blocks_like(self, dtypes: list[torch.dtype], alloc: Callable[[int, torch.dtype], torch.Tensor]
                     ) -> list[torch.Tensor]:
        """One block per bucket, as long as its parameter block, in ``dtypes``: slices of
        one ``alloc(numel, dtype)`` buffer per dtype."""
        sizes: dict[torch.dtype, int] = {}
        for d, f in zip(dtypes, self._flats):
            sizes[d] = sizes.get(d, 0) + f.numel()
        whole = {d: alloc(n, d) for d, n in sizes.items()}
        offsets = dict.fromkeys(sizes, 0)
        out = []
        for d, f in zip(dtypes, self._flats):
            out.append(whole[d][offsets[d]:offsets[d] + f.numel()])
            offsets[d] += f.numel()
        return out

    def _taking(self, into: list[torch.Tensor]) -> Callable[[int, torch.dtype], torch.Tensor]:
        """:meth:`~fastreduce.comm.Comm.buffer`, each block it gives also put in ``into``
        (for :meth:`_give_back`)."""
        def alloc(numel: int, dtype: torch.dtype) -> torch.Tensor:
            into.append(self.comm.buffer(numel, dtype))
            return into[-1]
        return alloc

    def _give_back(self, blocks: list[torch.Tensor]) -> None:
        """Release ``blocks`` (:meth:`~fastreduce.comm.Comm.release`): the communication
        layer forgets them and what it kept for them, and a shared-memory segment is
        unmapped once no tensor views it any more."""
        for block in blocks:
            self.comm.release(block)
        blocks.clear()

    @torch.no_grad()
    def _own_memory(self) -> None:
        """Every parameter of the buckets into memory of its own (a copy, its strides kept):
        none views a block any more, so the blocks go with the mode."""
        for views in self._views:
            for p, _, _ in views:
                p.data = p.data.clone()
