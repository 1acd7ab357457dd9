"""The Gaudi path: HPU-graph pack/unpack and the reducer over HCCL.

Skipped unless ``habana_frameworks`` imports and sees an HPU (run on a Gaudi machine with
``make test-gpu``, in lazy mode: ``PT_HPU_LAZY_MODE=1``). Written to the Habana
documentation and **not yet run on a Gaudi** (no session has had one); the same checks
run on CUDA in ``test_cuda.py``.

* pack and unpack captured as HPU graphs replay the eager casts exactly, and read the
  gradients' *current* values at each replay (the graphs only touch the persistent
  flat buffers: invariant 3);
* with two or more HPUs, ``FusedReducer`` over an HCCL group (one rank per card) equals
  the mean of ``dist.all_reduce`` of the same gradients, fused and overlapped.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fastreduce
from fastreduce.backends import hpu as hpu_backend
from fastreduce.launch import run_ranks

pytestmark = pytest.mark.skipif(not hpu_backend.available(), reason="needs a Gaudi (habana_frameworks and an HPU)")


def _model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(33, 257), torch.nn.GELU(), torch.nn.Linear(257, 7)]
    return torch.nn.Sequential(*layers).to(device)


def _sync() -> None:
    import habana_frameworks.torch.core as htcore  # noqa: PLC0415

    htcore.mark_step()
    torch.hpu.synchronize()


@pytest.mark.skipif(not hpu_backend.lazy_mode(), reason="HPU graphs need lazy mode (PT_HPU_LAZY_MODE=1)")
def test_hpu_graph_pack_unpack_replay_the_eager_casts() -> None:
    from fastreduce.backends import select_backend
    from fastreduce.buffer import FusedBuffer
    from fastreduce.layout import GradLayout

    device = torch.device("hpu")
    model = _model(device)
    named = [(n, p) for n, p in model.named_parameters()]
    layout = GradLayout(named, first_dtype=torch.bfloat16)
    buffer = FusedBuffer(layout, torch.bfloat16, device)
    for p, v in zip(layout.params, buffer.views):
        p.grad = v
    backend = select_backend("auto", device, True)
    assert backend.name == "hpu"
    pack, unpack = backend.capture(buffer.pack), backend.capture(buffer.unpack)
    for trial in range(3):  # new values each time: the replay must read them, not the captured ones
        for v in buffer.views:
            v.copy_(torch.randn(v.shape, device=device) * (trial + 1))
        want = torch.cat([v.detach().reshape(-1).to(torch.bfloat16) for v in buffer.views])
        pack()
        _sync()
        got = torch.cat([w.detach().reshape(-1) for w in buffer.wire_views])
        assert torch.equal(got.cpu(), want.cpu())
        buffer.wire.mul_(2)
        unpack()
        _sync()
        for v, w in zip(buffer.views, buffer.wire_views):
            assert torch.equal(v.cpu(), w.float().cpu())


def hccl_worker(rank: int, world: int, overlap: bool) -> float:
    hpu_backend.import_hccl()
    device = torch.device("hpu", rank)
    group = dist.new_group(backend="hccl")
    model = _model(device)
    reducer = fastreduce.FusedReducer(model, group=group, wire_dtype=torch.float32, overlap=overlap)
    err = 0.0
    for step in range(4):
        model.zero_grad()
        g = torch.Generator().manual_seed(100 * step + rank)
        (model(torch.randn(16, 33, generator=g).to(device)) ** 2).mean().backward()
        want = []
        for p in model.parameters():
            t = p.grad.detach().clone()
            dist.all_reduce(t, group=group)
            want.append(t / world)
        reducer.reduce()
        _sync()
        err = max([err] + [(p.grad - w).abs().max().item() for p, w in zip(model.parameters(), want)])
    return err


@pytest.mark.parametrize("overlap", [False, True], ids=["fused", "overlap"])
def test_reducer_over_hccl_matches_all_reduce(overlap: bool) -> None:
    import habana_frameworks.torch.hpu as hthpu  # noqa: PLC0415

    if hthpu.device_count() < 2:
        pytest.skip("HCCL needs an HPU per rank: this machine has one")
    for err in run_ranks(hccl_worker, 2, overlap, timeout=300):
        assert err < 1e-5
