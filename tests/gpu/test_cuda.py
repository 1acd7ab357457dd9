"""Every mode with CUDA tensors: two ranks on one GPU over Gloo (NCCL needs a GPU per rank).

Skipped without a GPU (CI has none); run on a GPU machine with ``make test-gpu`` (or
``python3 -m pytest tests/gpu``). Parity with DDP runs over NCCL, a GPU per rank, where
the machine has two GPUs or more, and over Gloo with both ranks on one GPU otherwise. Each case compares against a reference built
from ``dist.all_reduce`` of the same local gradients and a plain torch optimizer.
What it shows: CUDA-graph pack/unpack (backend ``cuda``) replayed on persistent
buffers through ``zero_grad`` styles, results read on a side stream right after
``reduce()`` (the wait comes before the unpack), the overlapped mode, and ZeRO in fp32
and with bf16 parameters and fp32 masters.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

import fastreduce
import fastreduce.modes.topology
import fastreduce.optim_kernels
from fastreduce.launch import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(33, 257), torch.nn.GELU(), torch.nn.LayerNorm(257), torch.nn.Linear(257, 129),
              torch.nn.GELU(), torch.nn.Linear(129, 7)]
    return torch.nn.Sequential(*layers).to("cuda", dtype)


def _loss(model: torch.nn.Module, rank: int, step: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(100 * step + rank)
    x = torch.randn(16, 33, device="cuda", generator=g, dtype=dtype)
    return (model(x).float() ** 2).mean()


def _mean_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        g = p.grad.detach().clone()
        dist.all_reduce(g)
        out.append(g / dist.get_world_size())
    return out


def reducer_worker(rank: int, world: int) -> dict:
    torch.cuda.set_device(0)
    res: dict = {}
    for name, cfg in {"fused_bf16": dict(wire_dtype=torch.bfloat16),
                      "fused_fp32": dict(wire_dtype=torch.float32),
                      "overlap_bf16": dict(wire_dtype=torch.bfloat16, overlap=True, bucket_mb=0.05),
                      "overlap_fp32": dict(wire_dtype=torch.float32, overlap=True, bucket_mb=0.05)}.items():
        model, plain = _model(), _model()
        reducer = fastreduce.FusedReducer(model, **cfg)
        errs = []
        side = torch.cuda.Stream()
        for step in range(6):
            _loss(plain, rank, step).backward()
            expect = _mean_grads(plain)
            plain.zero_grad()
            _loss(model, rank, step).backward()
            with torch.cuda.stream(side):  # reduce and read on a stream of its own
                side.wait_stream(torch.cuda.default_stream())
                reducer.reduce()
                got = [p.grad.clone() for p in model.parameters()]
            torch.cuda.synchronize()
            errs.append(max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, expect)))
            if step % 2:
                model.zero_grad(set_to_none=True)
            else:
                reducer.zero_grad()
        res[name] = {"err": max(errs), "backend": reducer.backend.name, "buckets": reducer.num_buckets,
                     "in_backward": reducer.stats.launched_in_backward}
    return res


def zero_worker(rank: int, world: int, dtype_name: str, with_module: bool) -> dict:
    torch.cuda.set_device(0)
    dtype = getattr(torch, dtype_name)
    model = _model(dtype)
    ref = copy.deepcopy(model).float()  # fp32 masters, as ZeroOptimizer keeps for bf16
    opt = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                                   bucket_mb=0.05, module=model if with_module else None)
    # the reference steps with the kernel ZeroOptimizer picks at two ranks (fused on CUDA)
    kernel = fastreduce.optim_kernels.fused_if_possible(torch.optim.AdamW, list(ref.parameters()), {})
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, **kernel)
    norms = []
    for step in range(8):
        _loss(model, rank, step, dtype).backward()
        norm = opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        # reference: the same local grads (bf16 for a bf16 model), averaged in fp32
        shadow = copy.deepcopy(ref).to(dtype)
        _loss(shadow, rank, step, dtype).backward()
        for p, s in zip(ref.parameters(), shadow.parameters()):
            g = s.grad.float()
            dist.all_reduce(g)
            p.grad = g / world
        rnorm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ropt.step()
        ropt.zero_grad()
        norms.append((norm.item(), rnorm.item()))
    err = max(((a.float() - b.to(dtype).float()).abs().max() / b.abs().max()).item()
              for a, b in zip(model.parameters(), ref.parameters()))
    return {"err": err, "norms": norms, "device": str(next(model.parameters()).device),
            "buckets": opt.num_buckets, "state_bytes": opt.state_bytes()}


@pytest.fixture(scope="module")
def reducers() -> list[dict]:
    return run_ranks(reducer_worker, 2, timeout=300)


@pytest.mark.parametrize("name", ["fused_bf16", "fused_fp32", "overlap_bf16", "overlap_fp32"])
def test_reducer_on_cuda_matches_all_reduce(reducers, name: str) -> None:
    for r in reducers:
        out = r[name]
        assert out["err"] < (1e-2 if "bf16" in name else 1e-6), out
    if name.startswith("fused"):
        assert reducers[0][name]["backend"] == "cuda"  # pack/unpack replayed as CUDA graphs
    else:
        assert reducers[0][name]["buckets"] > 1 and reducers[0][name]["in_backward"] > 0


@pytest.mark.parametrize("dtype_name,with_module", [("float32", False), ("float32", True), ("bfloat16", True)])
def test_zero_on_cuda_matches_adamw(dtype_name: str, with_module: bool) -> None:
    out = run_ranks(zero_worker, 2, dtype_name, with_module, timeout=300)
    for r in out:
        assert r["device"].startswith("cuda")
        for n, rn in r["norms"]:
            assert abs(n - rn) <= 1e-4 * rn + 1e-6
        # fp32: the same arithmetic as AdamW; bf16: the reference steps fp32 masters
        # on the same bf16 grads, so the params differ by bf16 rounding at most
        assert r["err"] < (1e-5 if dtype_name == "float32" else 1.6e-2), r
    assert_close(torch.tensor(out[0]["err"]), torch.tensor(out[1]["err"]))


class _LopsidedPair(fastreduce.modes.topology.Topology):
    """Two ranks mixing 0.7 / 0.3: not uniform, so the exchange is point-to-point."""

    period = 1

    def build(self, step: int) -> torch.Tensor:
        return torch.tensor([[0.7, 0.3], [0.3, 0.7]], dtype=torch.float64)


def gossip_worker(rank: int, world: int, topology: str) -> dict:
    torch.cuda.set_device(0)
    model = _model()
    topo = _LopsidedPair(world) if topology == "lopsided" else topology
    ddp = fastreduce.DecentralizedDataParallel(model, lambda named: torch.optim.SGD([p for _, p in named], lr=0.0),
                                               topology=topo, bucket_mb=0.05)
    with torch.no_grad():
        for p in ddp.parameters():
            p.add_(float(rank))  # ranks differ by +rank: the mean is the base + (world - 1) / 2
    base = [p.detach().clone() - rank for p in ddp.parameters()]
    dists = []
    for step in range(6):
        _loss(ddp, rank, step).backward()
        dists.append(ddp.consensus_distance())
    ddp.wait_exchanges()
    ddp.global_avg()
    err = max((p - (b + (world - 1) / 2)).abs().max().item() for p, b in zip(ddp.parameters(), base))
    return {"dists": dists, "err": err, "device": str(next(model.parameters()).device),
            "buckets": ddp.num_buckets}


@pytest.mark.parametrize("topology", ["complete", "lopsided"])
def test_gossip_on_cuda_keeps_the_mean(topology: str) -> None:
    out = run_ranks(gossip_worker, 2, topology, timeout=300)
    for r in out:
        assert r["device"].startswith("cuda") and r["buckets"] > 1
        assert r["err"] < 1e-5, r  # lr=0: mixing only moves ranks towards the mean, never the mean
        if topology == "complete":
            assert r["dists"][1] < 1e-6, r["dists"]  # one mix: every rank holds the mean
        else:
            assert r["dists"][-1] < 0.5 * r["dists"][0], r["dists"]  # 0.7/0.3: contracts by 0.4 per mix


def local_worker(rank: int, world: int) -> dict:
    """LocalSGD and DiLoCo with CUDA parameters against plain reference loops."""
    torch.cuda.set_device(0)
    H, steps = 4, 10
    models = {k: _model() for k in ("local", "ref", "diloco1", "diloco_gpu", "diloco_cpu")}
    inner = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
    fastreduce.LocalSGD(models["local"], inner["local"], H)
    fastreduce.DiLoCo(models["diloco1"], inner["diloco1"], torch.optim.SGD(models["diloco1"].parameters(), lr=1.0),
                      H, wire_dtype=torch.float32)
    streaming = dict(fragments=2, fragment_delay=1, fragment_alpha=0.5)
    modes = {}
    for where in ("gpu", "cpu"):
        m = models[f"diloco_{where}"]
        outer = torch.optim.SGD(m.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        modes[where] = fastreduce.DiLoCo(m, inner[f"diloco_{where}"], outer, H, backup_device="cpu" if where == "cpu"
                                         else None, **streaming)
    for step in range(steps):
        for k, m in models.items():
            _loss(m, rank, step).backward()
            inner[k].step()
            inner[k].zero_grad()
        if (step + 1) % H == 0:  # the reference: a plain loop that averages every H steps
            with torch.no_grad():
                for p in models["ref"].parameters():
                    dist.all_reduce(p)
                    p.div_(world)

    def gap(a: str, b: str) -> float:
        return max((p - q).abs().max().item() for p, q in zip(models[a].parameters(), models[b].parameters()))

    return {"local_vs_ref": gap("local", "ref"), "diloco_lr1_vs_local": gap("diloco1", "local"),
            "cpu_vs_gpu_anchor": gap("diloco_cpu", "diloco_gpu"), "syncs": modes["gpu"].syncs,
            "anchor": str(modes["cpu"]._anchor[0].device), "device": str(next(models["local"].parameters()).device)}


def test_local_updates_on_cuda_match_reference_loops() -> None:
    for r in run_ranks(local_worker, 2, timeout=300):
        assert r["device"].startswith("cuda") and r["anchor"] == "cpu", r
        assert r["local_vs_ref"] < 1e-5, r
        assert r["diloco_lr1_vs_local"] < 1e-5, r
        assert r["cpu_vs_gpu_anchor"] < 1e-6, r
        assert r["syncs"] == 5, r  # fragments applied after steps 2, 4, 6, 8, 10 (launched a step before)


def ddp_worker(rank: int, world: int, overlap: bool) -> dict:
    """FusedReducer (fp32 wire) against DDP on the same CUDA model, SGD with momentum,
    zeroed with set_to_none (the forward re-attaches the flat buffer's views)."""
    nccl = torch.cuda.device_count() >= world
    device = torch.device("cuda", rank if nccl else 0)
    torch.cuda.set_device(device)
    group = dist.new_group(backend="nccl") if nccl else None
    model = _model().to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), device_ids=[device.index],
                                                    process_group=group)
    reducer = fastreduce.FusedReducer(model, group=group, wire_dtype=torch.float32, overlap=overlap)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ddp)]
    errs = []
    for step in range(6):
        for m, opt in zip((model, ddp), opts):
            opt.zero_grad()
            g = torch.Generator(device=device).manual_seed(100 * step + rank)
            (m(torch.randn(16, 33, device=device, generator=g)) ** 2).mean().backward()
            if m is model:
                reducer.reduce()
            opt.step()
        errs.append(max((p - q).abs().max().item() for p, q in zip(model.parameters(), ddp.module.parameters())))
    return {"errs": errs, "backend": dist.get_backend(group), "preattached": reducer.stats.preattached,
            "device": str(device)}


@pytest.mark.parametrize("overlap", [False, True], ids=["fused", "overlap"])
def test_reducer_on_cuda_matches_ddp(overlap: bool) -> None:
    for r in run_ranks(ddp_worker, 2, overlap, timeout=300):
        assert r["device"].startswith("cuda"), r
        assert max(r["errs"]) < 1e-5, r
        assert r["preattached"] > 0, r  # set_to_none grads came back as views at forward
