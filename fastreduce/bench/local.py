"""``fastreduce bench local``: local-update training (LocalSGD, DiLoCo) against DDP.

Two parts, both on real Gloo ranks at each world size of ``--local-ranks`` (default 2):

**Step time and bytes on the wire.** Whole training steps (forward + backward + SGD
with momentum 0.9, its fastest kernel, + zero_grad in place; the step suite's loss) on
the step suite's ``many`` model, by default at 4M parameters and the step suite's batch
of 64 rows per rank (a third of the other suites' model: the whole suite runs in about
four minutes on two cores; ``--params-m`` and ``--batch`` change it). A sync costs
per parameter, a step per parameter and row: at a small batch the same H costs more.

=========================  ==============================================================
 ``no_comm``                forward, backward, SGD step, zero_grad: no communication (the
                            floor)
 ``ddp``                    ``DistributedDataParallel(gradient_as_bucket_view=True)`` +
                            the same SGD: the fp32 gradients all-reduced every step
 ``localsgd_H<H>``          ``fastreduce.LocalSGD(model, sgd, sync_every=H)``: the
                            parameters averaged (fp32) after every H-th step
 ``diloco_H<H>``            ``fastreduce.DiLoCo(model, sgd, outer, sync_every=H)``: the
                            pseudo-gradient averaged on the default bf16 wire every H
                            steps, outer ``SGD(lr=0.7, momentum=0.9, nesterov=True)``
                            (its fastest kernel too: ``fused`` on a CPU, 3 ms a sync
                            here against 9.5 ms for torch's default per-tensor loop)
 ``diloco_H32_int4``        the same at H = 32 with an int4 wire (two values a byte, a
                            scale per 256) and error feedback
=========================  ==============================================================

for H = 1, 8 and 32. A local-update method pays for its averaging every H-th step
only, so a step timed alone would or would not hold a sync. Each timed call is
therefore a block of :data:`BLOCK` (32) consecutive steps of one method, which holds
exactly 32 / H syncs whatever the phase, and the figure is the block's time per step
(the slowest rank's; blocks interleaved round-robin, see :mod:`.common`). "Wire" is
the payload one rank sends per step: DDP's fp32 gradients every step, a mode's
``bytes_per_sync / H``, 0 for ``no_comm``.

**Loss after the same number of steps.** What the saved communication costs: a small
MLP student (32 -> 128 -> 128 -> 8, GELU) learns a fixed random teacher MLP
(32 -> 64 -> 8) from noisy samples (label noise 0.3), each rank drawing its own stream
(batch 32 per rank and step, fixed seeds, the same stream for every method), with
**AdamW** (lr 1e-3, no weight decay) as the (inner) optimizer of every method, for
:data:`LOSS_STEPS` (256) inner steps: DDP, LocalSGD and DiLoCo (outer SGD lr 0.7,
momentum 0.9, Nesterov; bf16 wire) at H = 8 and 32. The table gives the held-out MSE
(4096 noiseless samples) of the synced model after the last step (a multiple of every
H, so LocalSGD and DiLoCo have just averaged), and the largest difference between the
ranks' parameters then, which must be 0.

Target (reported, never enforced), at 2 ranks: ``localsgd_H8``, ``diloco_H8``,
``localsgd_H32`` and ``diloco_H32`` at most 1.05x ``no_comm`` per step.
"""

from __future__ import annotations

import copy
import gc
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fastreduce

from ..launch import run_ranks
from ..optim_kernels import fused_if_possible
from .common import Method, machine_info, slowest_rank, summary_ms, time_round_robin
from .optim import OptimMethod, fastest_kernel
from .report import judge_ratios, target_lines
from .step import _plain, batch_for, build_model, ddp_method

__all__ = ["LOSS_METHODS", "LocalConfig", "METHODS", "format_text", "run_local_bench"]

MODEL = "many"
DEFAULT_PARAMS_M = 4.0
DEFAULT_BATCH = 64
"""The timing part's default model size and rows per rank (``--params-m``/``--batch`` override)."""
DEFAULT_WORLD_SIZES = (2,)
BLOCK = 32
"""Steps per timed call: a multiple of every period, so each block holds whole periods."""
PERIODS = (1, 8, 32)
REFERENCE = "no_comm"
METHODS = (REFERENCE, "ddp", *(f"localsgd_H{h}" for h in PERIODS), *(f"diloco_H{h}" for h in PERIODS),
           "diloco_H32_int4")
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
TARGET_WORLD = 2
TARGETS = tuple((f"{m}_H{h}_hidden", f"{m}_H{h}", REFERENCE, "<=", 1.05)
                for h in (8, 32) for m in ("localsgd", "diloco"))

LOSS_METHODS = ("ddp", "localsgd_H8", "localsgd_H32", "diloco_H8", "diloco_H32")
LOSS_STEPS, QUICK_LOSS_STEPS = 256, 64
LOSS_LR = 1e-3
LOSS_BATCH = 32
IN, HIDDEN, OUT, TEACHER_HIDDEN = 32, 128, 8, 64
TEACHER_GAIN, LABEL_NOISE, EVAL_ROWS = 5.0, 0.3, 4096


@dataclass(frozen=True)
class LocalConfig:
    """What to run: ``iters`` timed blocks per method and world size, then the loss table."""

    world_sizes: tuple[int, ...] = DEFAULT_WORLD_SIZES
    iters: int = 10
    params_m: float = DEFAULT_PARAMS_M
    batch: int = DEFAULT_BATCH
    threads: int | None = None
    quick: bool = False
    warmup_rounds: int = 1
    loss_steps: int = LOSS_STEPS


# ---------------------------------------------------------------- methods

@dataclass
class LocalMethod(OptimMethod):
    """A training step (:class:`~fastreduce.bench.optim.OptimMethod`) and the local-update
    mode hooked on its optimizer, if any."""

    mode: Any = None
    period: int = 1

SGD_LR, SGD_MOMENTUM = 1e-3, 0.9  # the inner optimizer of every method


def _sgd(params: list[nn.Parameter]) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=SGD_LR, momentum=SGD_MOMENTUM,
                           **(fused_if_possible(torch.optim.SGD, params, {}) or {"foreach": True}))


def _total(nbytes: int | list[int]) -> int:
    return sum(nbytes) if isinstance(nbytes, (list, tuple)) else int(nbytes)


def build_method(name: str, model: nn.Module,
                 inner: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> LocalMethod:
    """``name`` (one of :data:`METHODS`) on ``model``, with ``inner`` as the (inner) optimizer."""
    base = ddp_method(name, model, None) if name == "ddp" else _plain(name, model, lambda ps: (lambda: None), 0)
    opt = inner(list(base.module.parameters()))
    mode, period = None, 1
    if name.startswith(("localsgd_H", "diloco_H")):
        period = int(name.rsplit("_H", 1)[1].split("_")[0])
        quant = {"wire_dtype": "int4", "error_feedback": True} if name.endswith("_int4") else {}
        if name.startswith("localsgd"):
            mode = fastreduce.LocalSGD(model, opt, period)
        else:
            outer = torch.optim.SGD(base.params, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True,
                                    **(fused_if_possible(torch.optim.SGD, base.params, {}) or {"foreach": True}))
            mode = fastreduce.DiLoCo(model, opt, outer, period, **quant)
        base.nbytes = _total(mode.bytes_per_sync)  # per sync; ddp_method's: the fp32 gradients
    return LocalMethod(base, opt, lambda: 0, mode=mode, period=period)


def _info(m: LocalMethod) -> dict[str, Any]:
    mode = m.mode
    return {"bytes_per_step": m.base.nbytes / m.period, "sync_every": m.period if mode is not None else None,
            "syncs": mode.syncs if mode is not None else None, "steps": mode.steps if mode is not None else None}


def _block(m: LocalMethod, x: torch.Tensor) -> Method:
    def run() -> None:
        for _ in range(BLOCK):
            m.train_step(x)
    return Method(m.name, run)


# ---------------------------------------------------------------- the loss table

def _mlp(seed: int, hidden: int, layers: int) -> nn.Sequential:
    torch.manual_seed(seed)  # the same weights on every rank
    mods: list[nn.Module] = []
    width = IN
    for _ in range(layers):
        mods += [nn.Linear(width, hidden), nn.GELU()]
        width = hidden
    return nn.Sequential(*mods, nn.Linear(width, OUT))


def _teacher() -> nn.Sequential:
    teacher = _mlp(1, TEACHER_HIDDEN, 1).requires_grad_(False)
    with torch.no_grad():  # outputs of about unit variance
        teacher[-1].weight.mul_(TEACHER_GAIN)
        teacher[-1].bias.zero_()
    return teacher


def _samples(teacher: nn.Module, gen: torch.Generator, rows: int, noise: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(rows, IN, generator=gen)
    y = teacher(x)
    return x, y + noise * torch.randn(y.shape, generator=gen)


def _rank_spread(params: list[nn.Parameter]) -> float:
    """Largest difference of any parameter between any two ranks (0: the model is synced)."""
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        hi, lo = flat.clone(), flat.neg()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MAX)
        return (hi + lo).max().item()


def loss_table(rank: int, steps: int) -> dict[str, Any]:
    teacher, student = _teacher(), _mlp(0, HIDDEN, 2)
    ex, ey = _samples(teacher, torch.Generator().manual_seed(7), EVAL_ROWS, 0.0)

    def adamw(params: list[nn.Parameter]) -> torch.optim.AdamW:
        return torch.optim.AdamW(params, lr=LOSS_LR, weight_decay=0.0, **fastest_kernel(params))

    with torch.no_grad():
        out: dict[str, Any] = {"initial_loss": F.mse_loss(student(ex), ey).item(), "methods": {}}
    for name in LOSS_METHODS:
        m = build_method(name, copy.deepcopy(student), adamw)
        gen = torch.Generator().manual_seed(2000 + rank)  # this rank's stream, the same for every method
        for _ in range(steps):
            x, y = _samples(teacher, gen, LOSS_BATCH, LABEL_NOISE)
            F.mse_loss(m.base.module(x), y).backward()
            m.optimizer.step()  # type: ignore[union-attr]
            m.base.zero()
        with torch.no_grad():
            loss = F.mse_loss(m.base.module(ex), ey).item()
        out["methods"][name] = {"loss": loss, "rank_spread": _rank_spread(m.base.params), **_info(m)}
    return out


# ---------------------------------------------------------------- one rank

def local_rank(rank: int, world: int, cfg: LocalConfig) -> dict[str, Any]:
    """Everything one rank does; module-level so :func:`run_ranks` can pickle it."""
    os.dup2(2, 1)  # stdout stays the report's
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    base = build_model(MODEL, cfg.params_m)
    x = batch_for(base, rank, cfg.batch)
    methods = [build_method(name, copy.deepcopy(base), _sgd) for name in METHODS]
    times = time_round_robin([_block(m, x) for m in methods], cfg.iters, 1, cfg.warmup_rounds)
    out = {"times": {k: [t / BLOCK for t in v] for k, v in times.items()},
           "info": {m.name: _info(m) for m in methods}, "threads": torch.get_num_threads(),
           "width": base.in_features, "tensors": sum(1 for _ in base.parameters()),
           "numel": sum(p.numel() for p in base.parameters())}
    del methods
    gc.collect()
    out["loss"] = loss_table(rank, cfg.loss_steps)
    return out


# ---------------------------------------------------------------- the report

def run_local_bench(cfg: LocalConfig) -> dict[str, Any]:
    """Spawn the ranks for each world size, time every method, train the loss table; the
    report (JSON-able)."""
    if cfg.loss_steps % BLOCK:
        raise ValueError(f"loss_steps must be a multiple of {BLOCK}, got {cfg.loss_steps}")
    t0 = time.perf_counter()
    report: dict[str, Any] = {"config": asdict(cfg), "machine": machine_info(), "block": BLOCK, "worlds": {}}
    for world in cfg.world_sizes:
        per_rank = run_ranks(local_rank, world, cfg, threads=cfg.threads,
                             timeout=180.0 if cfg.quick else 1800.0)
        r0 = per_rank[0]
        methods = {n: {**summary_ms(slowest_rank([r["times"] for r in per_rank], n)), **r0["info"][n]}
                   for n in METHODS}
        ref = methods[REFERENCE]["median_ms"]
        for m in methods.values():
            m["vs_no_comm"] = m["median_ms"] / ref
        loss = r0["loss"]
        for name, m in loss["methods"].items():  # the largest over ranks (equal when synced)
            m["loss"] = max(r["loss"]["methods"][name]["loss"] for r in per_rank)
        report["worlds"][str(world)] = {"methods": methods, "threads": r0["threads"], "loss": loss}
        report["model"] = {k: r0[k] for k in ("width", "tensors", "numel")}
    if str(TARGET_WORLD) in report["worlds"]:
        ms = report["worlds"][str(TARGET_WORLD)]["methods"]
        report["targets"] = judge_ratios(TARGETS, lambda n: ms[n]["median_ms"], f"{TARGET_WORLD} ranks: ")
    else:
        report["targets"] = {}
    report["config"]["wall_seconds"] = round(time.perf_counter() - t0, 1)
    return report


def format_text(report: dict[str, Any]) -> str:
    c, mod = report["config"], report["model"]
    lines = [f"local suite (forward + backward + SGD step (lr {SGD_LR:g}, momentum {SGD_MOMENTUM:g}) + zero_grad, "
             f"blocks of {report['block']} steps per method, per step, slowest rank): model {MODEL}: "
             f"{mod['numel'] / 1e6:.2f}M fp32 params in {mod['tensors']} tensors (width {mod['width']}), "
             f"batch {c['batch']}/rank, {c['iters']} timed blocks/method (round-robin); DiLoCo: bf16 wire, "
             f"outer SGD lr {OUTER_LR:g}, momentum {OUTER_MOMENTUM:g}, Nesterov"]
    for world, w in report["worlds"].items():
        lines += ["", f"{world} Gloo ranks x {w['threads']} thread(s)",
                  f"{'method':<16}{'median ms':>10}{'p10':>9}{'p90':>9}{'vs no_comm':>11}{'wire MB/step':>14}  notes"]
        for name, m in w["methods"].items():
            note = f"{m['syncs']} syncs in {m['steps']} steps" if m["syncs"] is not None else ""
            lines.append(f"{name:<16}{m['median_ms']:>10.2f}{m['p10_ms']:>9.2f}{m['p90_ms']:>9.2f}"
                         f"{m['vs_no_comm']:>10.2f}x{m['bytes_per_step'] / 1e6:>14.3f}  {note}")
        loss = w["loss"]
        ddp = loss["methods"]["ddp"]["loss"]
        lines += ["", f"loss after {c['loss_steps']} inner steps, {world} ranks: MLP student on a teacher MLP "
                      f"task, AdamW lr {LOSS_LR:g}, batch {LOSS_BATCH}/rank, held-out MSE of the synced model "
                      f"(initial {loss['initial_loss']:.4f})",
                  f"{'method':<16}{'held-out MSE':>13}{'vs ddp':>9}{'syncs':>7}{'wire KB/step':>14}{'rank spread':>13}"]
        for name, m in loss["methods"].items():
            syncs = "-" if m["syncs"] is None else str(m["syncs"])
            lines.append(f"{name:<16}{m['loss']:>13.4f}{m['loss'] / ddp:>8.2f}x{syncs:>7}"
                         f"{m['bytes_per_step'] / 1e3:>14.2f}{m['rank_spread']:>13.1e}")
    if c["quick"]:
        lines.append("(--quick: a tiny model proves the benchmark runs; fixed per-call costs "
                     "dominate its timings, so the targets mean little)")
    if report["targets"]:
        lines += ["", "targets (report only):", *target_lines(report["targets"], width=24)]
    return "\n".join(lines)
