"""The whole job's view of gossip's models, which differ between ranks: their exact
mean (to evaluate, then put back) and how far apart they are (the half of
:class:`~fastreduce.DecentralizedDataParallel` that looks across ranks, a mixin).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..faults import all_reduce_watched

__all__ = ["GossipAverage"]


class GossipAverage:
    """It reads the mode's ``group``, ``world_size``, ``_named``, ``_built``, ``_flats`` and
    ``_mixed``, and calls its ``_drain()`` and ``_state_tensors()``."""

    @torch.no_grad()
    def global_avg(self) -> None:
        """Every rank's parameters and float buffers := their exact mean over ranks
        (e.g. to evaluate); :meth:`revert_global_avg` puts this rank's own back."""
        self._drain()
        self._before_avg = ([t.clone() for t in self._state_tensors()],
                       [m.clone() for m in self._mixed] if self._built else [])
        for t in self._state_tensors():
            all_reduce_watched(t, dist.ReduceOp.SUM, self.group)
            t.div_(self.world_size)
        for b, flat in enumerate(self._flats if self._built else ()):
            self._mixed[b].copy_(flat)  # the pending mix is now the average itself

    @torch.no_grad()
    def revert_global_avg(self) -> None:
        """Undo the last :meth:`global_avg` on this rank."""
        saved = getattr(self, "_before_avg", None)  # (not "_saved": GossipState's method of that name)
        if saved is None:
            raise RuntimeError("revert_global_avg() needs a global_avg() before it")
        tensors, mixed = saved
        for t, s in zip(self._state_tensors() + (self._mixed if self._built else []), tensors + mixed):
            t.copy_(s)
        self._before_avg = None

    @torch.no_grad()
    def consensus_distance(self) -> float:
        """Mean over ranks of ``||x_r - mean|| / ||mean||`` over all trainable parameters:
        0 when every rank holds the same parameters. The same number on every rank."""
        x = torch.cat([p.detach().reshape(-1).double() for _, p in self._named])
        mean = x.clone()
        all_reduce_watched(mean, dist.ReduceOp.SUM, self.group)
        mean.div_(self.world_size)
        d = torch.stack([(x - mean).norm() / mean.norm().clamp_min(1e-30)])
        all_reduce_watched(d, dist.ReduceOp.SUM, self.group)
        return float(d.item() / self.world_size)
