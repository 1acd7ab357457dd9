"""Collectives: the cheapest correct call per process-group backend.

Averaging: where the backend offers ``ReduceOp.AVG`` (NCCL; Gloo on recent torch;
probed once per group) the collective divides for free. Elsewhere, and always for an
fp16 wire (a sum of fp16 values can overflow before it is divided), the buffer is
divided by the world size *before* the sum, as DDP does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["MeanPlan", "plan_mean", "start_all_reduce"]


class MeanPlan:
    """How one buffer is averaged over a group: AVG in the collective, or divide first."""

    __slots__ = ("group", "world", "op", "prescale")

    def __init__(self, group: dist.ProcessGroup | None, world: int, use_avg: bool):
        self.group = group
        self.world = world
        self.op = dist.ReduceOp.AVG if use_avg else dist.ReduceOp.SUM
        self.prescale = not use_avg

    def __repr__(self) -> str:
        return f"MeanPlan(world={self.world}, {'AVG' if not self.prescale else 'divide then SUM'})"


def _avg_works(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Try ``ReduceOp.AVG`` once; a backend without it rejects the op on every rank alike."""
    probe = torch.full((1,), float(dist.get_rank(group) % 2), device=device)
    try:
        dist.all_reduce(probe, op=dist.ReduceOp.AVG, group=group)
    except (RuntimeError, ValueError):
        return False
    expect = sum(r % 2 for r in range(dist.get_world_size(group))) / dist.get_world_size(group)
    return abs(probe.item() - expect) < 1e-6


def plan_mean(group: dist.ProcessGroup | None, wire_dtype: torch.dtype, device: torch.device) -> MeanPlan:
    """Decide, collectively, how a ``wire_dtype`` buffer is averaged over ``group``."""
    world = dist.get_world_size(group)
    backend = dist.get_backend(group)
    if wire_dtype == torch.float16:
        use_avg = False  # sum before divide could overflow fp16
    elif backend == "nccl":
        use_avg = True
    else:
        use_avg = _avg_works(group, device)
    return MeanPlan(group, world, use_avg)


def start_all_reduce(buf: torch.Tensor, plan: MeanPlan) -> dist.Work:
    """Launch the averaging all-reduce of ``buf`` (already pre-divided if the plan says so)."""
    work = dist.all_reduce(buf, op=plan.op, group=plan.group, async_op=True)
    assert work is not None
    return work
