"""``fastreduce bench --suite device``: what fastreduce adds around the collective, on one device.

A collective needs several devices; the rest of a reduction does not. On one device
(``--device cuda``, or ``cpu``) this suite times, without any process group:

* **pack + unpack** of the ``many`` model's gradients (``--params-m`` M fp32 params,
  200 tensors; and the same parameters in 2000 tensors) into a bf16 wire buffer and
  back: optimum-habana's per-parameter loop (a cast per gradient each way), the
  fused reducer's pack/unpack eagerly (one ``copy_`` per dtype each way: the
  gradients are views of the flat buffer) and replayed as a CUDA graph;
* **the optimizer step**: ``torch.optim.AdamW`` over every parameter tensor
  (``foreach``; and ``fused`` on CUDA) against what one of N ZeRO ranks steps, AdamW
  on one flat 1/N shard with the kernel :class:`~fastreduce.ZeroOptimizer` picks
  (``fused`` where the device has one), for N = 2, 4, 8.

* **a local-update sync's own work** (a one-rank group, NCCL on a GPU, Gloo on the CPU,
  so the collective is nearly free and what is left is each method's work around it),
  on the same model:
  torch's ``average_parameters`` (what ``PeriodicModelAverager`` runs: a new flat
  buffer per call, a device synchronize, each parameter re-pointed), ``LocalSGD.sync()``
  in place on the flat blocks, and ``DiLoCo.sync()`` (pseudo-gradient, bf16 wire, the
  outer Nesterov step) with the anchor on the device and on the CPU.

Times are medians of ``--iters`` runs of 10 calls each, with CUDA events on a GPU.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from ..backends import select_backend
from ..buffer import FusedBuffer
from ..layout import GradLayout
from ..optim_kernels import fused_if_possible
from .common import machine_info
from .step import build_model

__all__ = ["run_device_bench", "format_text"]

CALLS = 10


def _timer(device: torch.device, fn: Callable[[], None], iters: int) -> float:
    """Median ms per call of ``fn`` over ``iters`` batches of CALLS calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(CALLS):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / CALLS)
        else:
            t0 = time.perf_counter()
            for _ in range(CALLS):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / CALLS)
    return statistics.median(times)


def _split(model: torch.nn.Module, pieces: int) -> list[torch.nn.Parameter]:
    """The model's parameters re-cut into ``pieces`` tensors of about equal size."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return [torch.nn.Parameter(t.clone()) for t in flat.chunk(pieces)]


def _pack_unpack(params: list[torch.nn.Parameter], device: torch.device, iters: int) -> dict[str, float]:
    for p in params:
        p.grad = torch.randn_like(p)
    layout = GradLayout([(f"p{i}", p) for i, p in enumerate(params)], first_dtype=torch.bfloat16)
    buffer = FusedBuffer(layout, torch.bfloat16, device)
    for p, v in zip(layout.params, buffer.views):
        v.copy_(p.grad)
        p.grad = v

    slices, start = [], 0
    loop_wire = torch.empty(sum(p.numel() for p in params), dtype=torch.bfloat16, device=device)
    for p in params:
        slices.append(loop_wire[start:start + p.numel()].view_as(p))
        start += p.numel()

    def loop() -> None:  # optimum-habana: each gradient cast into the wire and back
        for s, p in zip(slices, params):
            s.copy_(p.grad)
        for s, p in zip(slices, params):
            p.grad.copy_(s)

    def fused() -> None:
        buffer.pack()
        buffer.unpack()

    out = {"ohabana_loop": _timer(device, loop, iters), "fastreduce_eager": _timer(device, fused, iters)}
    if device.type == "cuda":
        backend = select_backend("auto", device, True)
        pack, unpack = backend.capture(buffer.pack), backend.capture(buffer.unpack)

        def graphs() -> None:
            pack()
            unpack()

        out["fastreduce_cuda_graph"] = _timer(device, graphs, iters)
    return out


def _adamw(params: list[torch.Tensor], iters: int, device: torch.device, **kw: Any) -> float:
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **kw)
    return _timer(device, opt.step, iters)


def _local_sync(model: torch.nn.Module, device: torch.device, iters: int) -> dict[str, float]:
    import torch.distributed as dist
    from torch.distributed.algorithms.model_averaging.utils import average_parameters

    from ..modes.diloco import DiLoCo
    from ..modes.localsgd import LocalSGD

    own = not dist.is_initialized()
    if own:  # one rank: each method's own work around the collective
        backend = "nccl" if device.type == "cuda" else "gloo"  # (Gloo would stage GPU tensors via the host)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    out = {"torch_average_parameters": _timer(device, lambda: average_parameters(list(model.parameters()), None),
                                              iters)}
    mode = LocalSGD(model, torch.optim.SGD(model.parameters(), lr=0.0), 1 << 30)
    out["fastreduce_localsgd"] = _timer(device, mode.sync, iters)
    mode.remove()
    for where in ("device", "cpu") if device.type != "cpu" else ("device",):
        outer = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9, nesterov=True)
        mode = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.0), outer, 1 << 30,
                      backup_device="cpu" if where == "cpu" else None)
        out[f"fastreduce_diloco_anchor_on_{where}"] = _timer(device, mode.sync, iters)
        mode.remove()
    if own:
        dist.destroy_process_group()
    return out


def run_device_bench(device: str = "cuda", params_m: float = 12.0, iters: int = 20) -> dict[str, Any]:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--suite device --device cuda needs a GPU (torch.cuda.is_available() is False)")
    model = build_model("many", params_m).to(dev)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    report: dict[str, Any] = {"device": str(dev), "params": numel, "machine": machine_info()}
    if dev.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(dev)
    report["pack_unpack_ms"] = {f"{len(params)} tensors": _pack_unpack(params, dev, iters),
                                "2000 tensors": _pack_unpack(_split(model, 2000), dev, iters)}
    step = {"adamw_foreach_all": _adamw([torch.nn.Parameter(p.detach().clone()) for p in params],
                                        iters, dev, foreach=True)}
    if dev.type == "cuda":
        step["adamw_fused_all"] = _adamw([torch.nn.Parameter(p.detach().clone()) for p in params],
                                         iters, dev, fused=True)
    for n in (2, 4, 8):  # the kernel ZeroOptimizer picks: fused where the device has it
        shard = [torch.zeros(-(-numel // (n * 64)) * 64, device=dev)]
        kw = fused_if_possible(torch.optim.AdamW, shard, {})
        step[f"zero_shard_1_of_{n}"] = _adamw(shard, iters, dev, **kw)
    report["optimizer_step_ms"] = step
    report["local_sync_ms"] = _local_sync(model, dev, max(3, iters // 4))
    return report


def format_text(report: dict[str, Any]) -> str:
    lines = [f"device suite on {report.get('gpu', report['device'])}: {report['params'] / 1e6:.2f}M fp32 params",
             "", "pack + unpack into a bf16 wire (no collective), ms per call:"]
    for model, row in report["pack_unpack_ms"].items():
        cells = "  ".join(f"{k} {v:7.3f}" for k, v in row.items())
        lines.append(f"  {model:>12}: {cells}")
    lines += ["", "optimizer step, ms per call:"]
    for k, v in report["optimizer_step_ms"].items():
        lines.append(f"  {k:<22} {v:8.3f}")
    lines += ["", "a local-update sync's work around the collective (one rank), ms per call:"]
    for k, v in report.get("local_sync_ms", {}).items():
        lines.append(f"  {k:<32} {v:8.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--params-m", type=float, default=12.0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rep = run_device_bench(a.device, a.params_m, a.iters)
    print(json.dumps(rep, indent=1) if a.json else format_text(rep))
