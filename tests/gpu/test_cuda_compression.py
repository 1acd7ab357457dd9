"""Fewer bytes on the wire with CUDA tensors: every lossy wire and codec, on the GPU and on the
CPU from the same gradients, in the same two Gloo ranks (both on one GPU).

The CPU runs are the reference: CI holds each of them bit for bit against the algorithm
written in its own test (tests/test_quantized_*.py, tests/test_powersgd.py,
tests/test_sparseloco.py). Here each rank injects the same seeded gradients into a CUDA
model and a CPU model (``loss = sum(p * g)``, whose backward writes ``g`` exactly and fires
the modes' hooks as a real backward does) and compares what each mode made of them:

* quantized wires (fp8 e4m3 and e5m2, int8; with and without error feedback) in the fused,
  overlapped, ZeRO, gossip, LocalSGD (int4) and DiLoCo modes; SparseLoCo in DiLoCo and
  LocalSGD: **bit for bit**. Their codecs are elementwise (scales, rounding, casts), their
  sums in a fixed order, and the optimizers step by ``lr = 0.5`` (SGD), a power of two, so
  that a fused multiply-add rounds as a multiply and an add do: any difference is a CUDA
  path that computes another thing.
* PowerSGD (fused, with the encode and decode as CUDA graphs, and overlapped): its matrix
  products and QR differ from the CPU's by rounding, so within ``1e-4`` of the largest
  gradient on the fp32 wire and ``2e-2`` on the default bf16 wire; at full rank it is the
  mean, within ``1e-5`` of ``dist.all_reduce``.

``FASTREDUCE_GPU_TESTS_DEVICE=cpu`` runs the file with CPU tensors on both sides (a check of
the test itself where there is no GPU); otherwise it needs CUDA and is skipped without it.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fastreduce
from fastreduce.launch import run_ranks

DEVICE = os.environ.get("FASTREDUCE_GPU_TESTS_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (FASTREDUCE_GPU_TESTS_DEVICE=cpu runs it on CPU)")
STEPS, LR = 4, 0.5


def _model(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(33, 257), nn.GELU(), nn.LayerNorm(257), nn.Linear(257, 129), nn.GELU(),
                         nn.Linear(129, 7)).to(device)


def _grads(model: nn.Module, rank: int, step: int) -> list[torch.Tensor]:
    """This rank's gradients at ``step``, drawn on the CPU; each parameter at its own scale (1e-3 to 10)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(p.shape, generator=g) * 10.0 ** (i % 5 - 3) for i, p in enumerate(model.parameters())]


def _backward(model: nn.Module, rank: int, step: int, forward: Callable[[], torch.Tensor] | None = None) -> None:
    """A backward that writes this rank's gradients exactly (through the modes' hooks);
    ``forward``: a forward through a mode that must see one (gossip), its output times zero."""
    loss = sum((p * g.to(p.device)).sum() for p, g in zip(model.parameters(), _grads(model, rank, step)))
    if forward is not None:
        loss = loss + forward().sum() * 0.0
    loss.backward()


def _flat(tensors: Any) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


REDUCERS: dict[str, dict[str, Any]] = {
    "fused_e4m3_ef": dict(wire_dtype=torch.float8_e4m3fn, error_feedback=True),
    "fused_e5m2": dict(wire_dtype=torch.float8_e5m2),
    "fused_int8_ef": dict(wire_dtype="int8", error_feedback=True),
    "overlap_int8_ef": dict(wire_dtype="int8", error_feedback=True, overlap=True, bucket_mb=0.05),
    "overlap_e4m3": dict(wire_dtype=torch.float8_e4m3fn, overlap=True, bucket_mb=0.05),
    "powersgd_fp32": dict(wire_dtype=torch.float32, compression=lambda: fastreduce.PowerSGD(rank=2, warmup_steps=1)),
    "powersgd_bf16": dict(compression=lambda: fastreduce.PowerSGD(rank=2, warmup_steps=1)),
    "powersgd_overlap": dict(wire_dtype=torch.float32, overlap=True, bucket_mb=0.05,
                             compression=lambda: fastreduce.PowerSGD(rank=2, warmup_steps=1)),
    "powersgd_full": dict(wire_dtype=torch.float32,
                          compression=lambda: fastreduce.PowerSGD(rank=10**6, min_compression_rate=0)),
}
"""The reducers' cases: the reduced gradients of every step are compared."""


def _reducer_run(rank: int, device: str, settings: dict[str, Any]) -> dict[str, Any]:
    model = _model(device)
    cfg = {k: (v() if k == "compression" else v) for k, v in settings.items()}
    reducer = fastreduce.FusedReducer(model, transport="process_group", **cfg)
    got, gaps = [], []
    for step in range(STEPS):
        _backward(model, rank, step)
        mean = [p.grad.detach().clone() for p in model.parameters()]
        for g in mean:
            dist.all_reduce(g)
            g.div_(dist.get_world_size())
        reducer.reduce()
        got.append(_flat(p.grad for p in model.parameters()))
        gaps.append(float((got[-1] - _flat(mean)).abs().max() / _flat(mean).abs().max()))
        reducer.zero_grad()
    return {"steps": torch.stack(got), "backend": reducer.backend.name, "gap_to_mean": max(gaps),
            "device": str(next(model.parameters()).device)}


def _stepped(model: nn.Module, rank: int, opt: Any) -> torch.Tensor:
    """The parameters after each of ``STEPS`` steps of ``opt`` on this rank's gradients."""
    got = []
    for step in range(STEPS):
        _backward(model, rank, step)
        opt.step()
        opt.zero_grad()
        got.append(_flat(model.parameters()))
    return torch.stack(got)


def _zero_run(rank: int, device: str, settings: dict[str, Any]) -> dict[str, Any]:
    model = _model(device)
    opt = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=LR, bucket_mb=0.05,
                                   transport="process_group", **settings)
    return {"steps": _stepped(model, rank, opt), "device": str(next(model.parameters()).device)}


def _local_run(rank: int, device: str, kind: str, settings: dict[str, Any]) -> dict[str, Any]:
    model = _model(device)
    inner = _sgd(model.parameters())
    cfg = {k: (v() if k == "compression" else v) for k, v in settings.items()}
    if kind == "diloco":
        mode: Any = fastreduce.DiLoCo(model, inner, torch.optim.SGD(model.parameters(), lr=1.0), 2, **cfg)
    else:
        mode = fastreduce.LocalSGD(model, inner, 2, **cfg)
    return {"steps": _stepped(model, rank, inner), "syncs": mode.syncs, "device": str(next(model.parameters()).device)}


def _gossip_run(rank: int, device: str, settings: dict[str, Any]) -> dict[str, Any]:
    model = _model(device)
    ddp = fastreduce.DecentralizedDataParallel(model, lambda named: _sgd([p for _, p in named]), **settings)
    x = torch.randn(4, 33, generator=torch.Generator().manual_seed(rank)).to(device)
    got = []
    for step in range(STEPS):
        _backward(model, rank, step, forward=lambda: ddp(x))
        got.append(_flat(model.parameters()))
    ddp.global_avg()
    got.append(_flat(model.parameters()))
    return {"steps": torch.stack(got), "device": str(next(model.parameters()).device)}


OTHERS: dict[str, tuple[Callable[..., dict[str, Any]], tuple]] = {
    "zero_int8": (_zero_run, (dict(wire_dtype="int8"),)),
    "zero_e4m3_ef": (_zero_run, (dict(wire_dtype=torch.float8_e4m3fn, error_feedback=True),)),
    "gossip_int8": (_gossip_run, (dict(wire_dtype="int8", topology="ring"),)),
    "localsgd_int4": (_local_run, ("localsgd", dict(wire_dtype="int4"))),
    "diloco_int8_ef": (_local_run, ("diloco", dict(wire_dtype="int8", error_feedback=True))),
    "diloco_sparseloco": (_local_run, ("diloco", dict(compression=lambda: fastreduce.SparseLoCo()))),
    "localsgd_sparseloco": (_local_run, ("localsgd", dict(compression=lambda: fastreduce.SparseLoCo()))),
}
"""The other modes' cases: the parameters after every step are compared."""


def worker(rank: int, world: int) -> dict[str, Any]:
    if DEVICE == "cuda":
        torch.cuda.set_device(0)
    out: dict[str, Any] = {}
    for name, settings in REDUCERS.items():
        out[name] = {where: _reducer_run(rank, dev, settings) for where, dev in (("gpu", DEVICE), ("cpu", "cpu"))}
    for name, (run, args) in OTHERS.items():
        out[name] = {where: run(rank, dev, *args) for where, dev in (("gpu", DEVICE), ("cpu", "cpu"))}
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_ranks(worker, 2, timeout=400)


EXACT = [n for n in REDUCERS if not n.startswith("powersgd")] + list(OTHERS)


@pytest.mark.parametrize("name", EXACT)
def test_a_lossy_wire_on_cuda_equals_its_cpu_run_bit_for_bit(runs: list[dict[str, Any]], name: str) -> None:
    for rank, r in enumerate(runs):
        gpu, cpu = r[name]["gpu"], r[name]["cpu"]
        assert gpu["device"].startswith(DEVICE), gpu["device"]
        if "syncs" in gpu:
            assert gpu["syncs"] == cpu["syncs"] == STEPS // 2, (gpu["syncs"], cpu["syncs"])
        diff = (gpu["steps"] - cpu["steps"]).abs()
        assert torch.equal(gpu["steps"], cpu["steps"]), \
            f"rank {rank}: {int((diff > 0).sum())} values differ, the largest by {float(diff.max()):.3g} " \
            f"(first at step {int((diff > 0).any(1).nonzero()[0])})"
    # every rank ends with the same values: the mean (reducers, ZeRO), a sync (local modes), global_avg (gossip)
    assert torch.equal(runs[0][name]["gpu"]["steps"][-1], runs[1][name]["gpu"]["steps"][-1])


@pytest.mark.parametrize("name, tol", [("powersgd_fp32", 1e-4), ("powersgd_overlap", 1e-4), ("powersgd_bf16", 2e-2),
                                       ("powersgd_full", 1e-5)])
def test_powersgd_on_cuda_equals_its_cpu_run_to_rounding(runs: list[dict[str, Any]], name: str, tol: float) -> None:
    for rank, r in enumerate(runs):
        gpu, cpu = r[name]["gpu"], r[name]["cpu"]
        scale = cpu["steps"].abs().amax(1, keepdim=True)
        gap = float(((gpu["steps"] - cpu["steps"]).abs() / scale).max())
        assert gap < tol, f"rank {rank}: the GPU's reduced gradients are {gap:.3g} (of the largest) from the CPU's"
        if name != "powersgd_overlap":
            assert gpu["backend"] == ("cuda" if DEVICE == "cuda" else cpu["backend"]), gpu["backend"]
        if name == "powersgd_full":  # at full rank: the mean itself
            assert gpu["gap_to_mean"] < 1e-5 and cpu["gap_to_mean"] < 1e-5, (gpu["gap_to_mean"], cpu["gap_to_mean"])
    assert torch.equal(runs[0][name]["gpu"]["steps"], runs[1][name]["gpu"]["steps"])  # every rank the same mean
