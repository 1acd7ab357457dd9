"""fastreduce.compat: one helper per difference between the supported stacks, each tested on
the stack it runs on (``make stack-NAME`` runs this file on every stack in stacks/) and,
where one process can show it, on the other side of the difference too."""

from __future__ import annotations

import importlib.metadata
from typing import Any

import pytest
import torch

from fastreduce import compat
from fastreduce.launch import run_ranks

pytestmark = pytest.mark.timeout(120)


def test_version_of() -> None:
    assert compat.version_of("torch") == tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:3])
    assert compat.version_of("no-such-distribution-here") == ()
    assert compat.version_of("torch") >= (2, 6)


@pytest.mark.parametrize("per_tensor", [False, True], ids=["installed-torch", "torch-2.6"])
def test_preserve_version_counters(per_tensor: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if per_tensor:  # torch 2.6's form (one tensor per context), whatever torch is installed
        monkeypatch.setattr(compat, "version_of", lambda distribution: (2, 6, 0))
    bufs = [torch.zeros(3), torch.ones(2)]
    before = [b._version for b in bufs]
    with compat.preserve_version_counters(bufs):
        for b in bufs:
            b.add_(1.0)
    assert [b._version for b in bufs] == before
    assert torch.equal(bufs[0], torch.ones(3)) and torch.equal(bufs[1], torch.full((2,), 2.0))
    bufs[0].add_(1.0)  # outside the block, writes count again
    assert bufs[0]._version == before[0] + 1


def _avg_worker(rank: int, world_size: int) -> bool | str:
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    try:
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
    except (RuntimeError, ValueError) as err:
        return str(err)
    return t.item() == 0.5


def test_gloo_has_avg() -> None:
    """What compat says of this torch's Gloo is what a real Gloo all_reduce does."""
    outs = run_ranks(_avg_worker, 2)
    if compat.gloo_has_avg():
        assert outs == [True, True], outs
    else:
        assert all(isinstance(o, str) and "AVG" in o for o in outs), outs


def _plan_worker(rank: int, world_size: int) -> tuple[list[str], str]:
    import torch.distributed as dist

    from fastreduce.comm.collectives import plan_mean

    ops, real = [], dist.all_reduce

    def spy(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, *args: Any, **kwargs: Any) -> Any:
        ops.append(str(op))  # the real collective still runs
        return real(tensor, op, *args, **kwargs)

    dist.all_reduce = spy
    try:
        plan = plan_mean(None, torch.float32, torch.device("cpu"))
    finally:
        dist.all_reduce = real
    return ops, repr(plan)


def test_gloo_mean_plan_sends_no_probe() -> None:
    """On Gloo the mean plan follows torch's version and sends nothing to find out: on
    torch 2.6 a refused AVG probe could still be in the group's work in progress when
    the next barrier gathered it, and that barrier raised "Cannot use ReduceOp.AVG
    with Gloo" (the overlapped mode's link probe, two network-namespace hosts)."""
    for ops, plan in run_ranks(_plan_worker, 2):
        assert ops == [], ops
        assert ("AVG" in plan) == compat.gloo_has_avg(), plan


def _accelerate_worker(rank: int, world_size: int, force_old: bool) -> dict[str, bool]:
    from accelerate import Accelerator

    if force_old:  # take the branch for accelerate < 1.14 whatever is installed
        compat.version_of = lambda distribution: (1, 13, 0)
    model, other = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accelerator = Accelerator(cpu=True)
    out: dict[str, bool] = {"distributed": accelerator.num_processes == world_size}
    prepared = compat.prepare_model_without_ddp(accelerator, model)
    again, _ = accelerator.prepare(model, optimizer)  # what Trainer does next
    out["kept"] = again is prepared and not isinstance(again, torch.nn.parallel.DistributedDataParallel)
    # Another model is still prepared for training: wrapped in DDP.
    out["other_wrapped"] = isinstance(accelerator.prepare(other), torch.nn.parallel.DistributedDataParallel)
    # The difference itself: without the helper, accelerate < 1.14 wraps a model it has
    # prepared for evaluation when it is prepared again; 1.14 and newer keep it.
    plain = torch.nn.Linear(4, 2)
    twice = accelerator.prepare(accelerator.prepare_model(plain, evaluation_mode=True))
    out["plain_wrapped_twice"] = isinstance(twice, torch.nn.parallel.DistributedDataParallel)
    return out


@pytest.mark.parametrize("force_old", [False, True], ids=["installed-accelerate", "accelerate-before-1.14"])
def test_prepare_model_without_ddp(force_old: bool) -> None:
    pytest.importorskip("accelerate")
    for out in run_ranks(_accelerate_worker, 2, force_old):
        assert out["distributed"] and out["kept"] and out["other_wrapped"], out
        old = tuple(int(p) for p in importlib.metadata.version("accelerate").split(".")[:2]) < (1, 14)
        assert out["plain_wrapped_twice"] == old, out
