"""``fastreduce bench step``: whole training steps, fastreduce against DDP and the loops.

What is measured
----------------
Real Gloo ranks (spawned by :func:`fastreduce.launch.run_ranks`) time one data-parallel
**step** per call::

    forward + backward + gradient reduction + zero_grad(set_to_none=False)

(for DDP the reduction happens inside backward; fastreduce zeroes with
``reducer.zero_grad()``). The optimizer step is left out on purpose: it is the same
work for every method and would only dilute the differences. With no optimizer step
the weights never change, so every timed step of a method does identical work.

Two models of ~12M fp32 parameters each (``--params-m``), built from one seed:

* ``many``: a transformer-like stack of 33 pre-norm residual MLP blocks (LayerNorm,
  Linear d->4d, GELU, Linear 4d->d) and a final LayerNorm: 200 gradient tensors;
* ``few``: 5 large Linear layers with ReLU between them: 10 gradient tensors.

Every rank feeds every method the same batch (``--batch`` rows, drawn from a
rank-specific seed), and each method runs on its own ``deepcopy`` of the model:

=============================  =========================================================
 ``per_param_allreduce_fp32``   one blocking ``dist.all_reduce`` (SUM) per gradient,
                                then a divide by the world size
 ``ohabana_loop_bf16``          optimum-habana's loop: cast and scale each gradient
                                into a fused bf16 buffer, one SUM all-reduce, cast
                                each slice back
 ``fastreduce_fused_bf16/fp32`` ``FusedReducer(wire_dtype=...)``: one fused collective
                                after backward
 ``fastreduce_overlap_bf16/fp32`` ``FusedReducer(overlap=True)``: buckets reduced
                                during backward (``--bucket-mb``; default: the
                                backend's default bucket size)
 ``fastreduce_*_set_to_none``    fused fp32 and overlapped bf16 zeroed as trainers and
                                most loops do, ``model.zero_grad()`` (``set_to_none=True``):
                                the next forward re-attaches the gradients as zeroed
                                views of the flat buffer
 ``fastreduce_*_bf16_pg``       the fused and overlapped bf16 methods with
                                ``transport="process_group"``: Gloo's all-reduce
                                instead of the shared-memory transport that the
                                methods above pick by default on one host
 ``fastreduce_*_int8``          fused and overlapped with the quantized ``"int8"`` wire and
                                error feedback: a byte a value and a scale per 256, the
                                sum in fp32 by each chunk's owner (a quarter of fp32's bytes)
 ``ddp_fp32``                   ``DistributedDataParallel(gradient_as_bucket_view=True)``,
                                default buckets
 ``ddp_fp32_set_to_none``       ``ddp_fp32`` zeroed with ``set_to_none=True`` (PyTorch's
                                default): autograd's fresh gradient is copied into
                                DDP's bucket instead of accumulated into it in place,
                                DDP's fastest setting on a CPU box (not a target's
                                yardstick: reported beside the targets)
 ``ddp_fp16_hook``              the same with ``fp16_compress_hook`` (DDP's bf16 hook
                                refuses Gloo)
 ``no_reduce``                  reference only: forward + backward + zero_grad, no
                                communication at all (the floor)
=============================  =========================================================

Before timing, one step of every method is checked against the fp32 per-parameter
loop (largest gradient difference relative to the largest gradient, the largest over
ranks) and held to its wire's tolerance (:func:`grad_tolerance`: 1e-5 where the wire is
fp32, which only sums in another order; 3e-2 where it is 16-bit or quantized, each value
rounded once), so the suite cannot time a method that skips work or averages wrongly: a
method over it is not timed (reported as skipped, with its error), and a target it
enters is reported as SKIP, never judged. Methods are interleaved round-robin with a
barrier before each step; a step's time is the slowest rank's (see
:mod:`fastreduce.bench.common`). "MB wire" is the payload all-reduced per step per
rank (the ring's own traffic is a multiple of it, the same for every method).

Targets (reported, never enforced), on the ``many`` model: overlapped bf16 at most
0.9x DDP fp32 and at most 1.0x DDP with the fp16 hook; fused bf16 at most 1.0x DDP fp32.
"DDP fp32" is ``ddp_fp32``, zeroed like every other method (in place, so backward
accumulates into the same buffers). DDP is faster on this kind of machine when zeroed
with ``set_to_none=True``, so the report also gives fastreduce's ratios against
``ddp_fp32_set_to_none``.
"""

from __future__ import annotations

import copy
import gc
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ..buckets import default_bucket_mb
from ..launch import run_ranks
from ..modes.fused import FusedReducer
from .common import Method, machine_info, ohabana_loop, slowest_rank, summary_ms, time_round_robin
from .report import judge_ratios, target_lines

__all__ = ["METHODS", "MODELS", "StepConfig", "csv_rows", "format_text", "grad_tolerance", "run_step_bench"]

MODELS = ("many", "few")
MANY_BLOCKS = 33
"""Residual MLP blocks of the ``many`` model: 6 tensors each, + a final LayerNorm = 200."""
FEW_LAYERS = 5
"""Linear layers of the ``few`` model: 10 tensors."""
DDP_BASELINE = "ddp_fp32"
REFERENCE = "no_reduce"
METHODS = ("per_param_allreduce_fp32", "ohabana_loop_bf16", "fastreduce_fused_bf16",
           "fastreduce_fused_fp32", "fastreduce_overlap_bf16", "fastreduce_overlap_fp32",
           "fastreduce_fused_fp32_set_to_none", "fastreduce_overlap_bf16_set_to_none",
           "fastreduce_fused_bf16_pg", "fastreduce_overlap_bf16_pg",
           "fastreduce_fused_int8", "fastreduce_overlap_int8",
           "ddp_fp32", "ddp_fp32_set_to_none", "ddp_fp16_hook", REFERENCE)
FP32_TOL = 1e-5
"""Largest relative gradient error of a method whose wire is fp32: the same sum in another order."""
NARROW_TOL = 3e-2
"""Of a 16-bit or quantized wire (bf16, the fp16 hook, int8 with a scale per 256 values): each
value rounded once (bf16's unit roundoff is 2**-8); what tests/test_bench.py holds these rows to."""
DDP_FASTEST = "ddp_fp32_set_to_none"
ALSO_VS_FASTEST_DDP = ("fastreduce_overlap_bf16", "fastreduce_fused_bf16", "fastreduce_fused_fp32",
                       "fastreduce_overlap_fp32")
TARGET_MODEL = "many"
TARGETS = (  # (name, numerator, denominator, comparison, limit), on TARGET_MODEL
    ("overlap_bf16_vs_ddp", "fastreduce_overlap_bf16", "ddp_fp32", "<=", 0.9),
    ("overlap_bf16_vs_ddp_fp16", "fastreduce_overlap_bf16", "ddp_fp16_hook", "<=", 1.0),
    ("fused_bf16_vs_ddp", "fastreduce_fused_bf16", "ddp_fp32", "<=", 1.0),
    # the path trainers take (zero_grad(set_to_none=True)) as fast as reducer.zero_grad()
    ("set_to_none_vs_reducer_zero_grad", "fastreduce_fused_fp32_set_to_none", "fastreduce_fused_fp32", "<=", 1.05),
    ("set_to_none_vs_fastest_ddp", "fastreduce_fused_fp32_set_to_none", DDP_FASTEST, "<=", 1.0),
)


@dataclass(frozen=True)
class StepConfig:
    """What to run: ``iters`` timed steps per method and model, after ``warmup_rounds`` rounds."""

    ranks: int = 2
    iters: int = 20
    params_m: float = 12.0
    batch: int = 64
    bucket_mb: float | None = None
    """Overlapped fastreduce's bucket size; ``None``: the backend's default."""
    threads: int | None = None
    """Intra-op threads per rank; ``None``: cores / ranks."""
    quick: bool = False
    warmup_rounds: int = 2


# ---------------------------------------------------------------- models

class MLPBlock(nn.Module):
    """Pre-norm residual MLP block, as in a transformer layer: 6 gradient tensors."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class ManyTensorNet(nn.Module):
    """``blocks`` :class:`MLPBlock` and a final LayerNorm: ``6 * blocks + 2`` tensors."""

    def __init__(self, width: int, blocks: int = MANY_BLOCKS):
        super().__init__()
        self.in_features = width
        self.blocks = nn.Sequential(*(MLPBlock(width) for _ in range(blocks)))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.blocks(x))


class FewTensorNet(nn.Sequential):
    """``layers`` square Linear layers with ReLU between: ``2 * layers`` tensors."""

    def __init__(self, width: int, layers: int = FEW_LAYERS):
        mods: list[nn.Module] = []
        for i in range(layers):
            mods.append(nn.Linear(width, width))
            if i + 1 < layers:
                mods.append(nn.ReLU())
        super().__init__(*mods)
        self.in_features = width


def model_width(kind: str, params_m: float) -> int:
    """Width that gives ``kind`` about ``params_m`` million parameters (multiple of 8)."""
    n = params_m * 1e6
    if kind == "many":  # per block 8w^2 + 7w, plus 2w for the final norm
        w = (-7 + math.sqrt(49 + 32 * n / MANY_BLOCKS)) / 16
    elif kind == "few":
        w = math.sqrt(n / FEW_LAYERS)
    else:
        raise ValueError(f"unknown model {kind!r}")
    return max(8, round(w / 8) * 8)


def build_model(kind: str, params_m: float) -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    width = model_width(kind, params_m)
    return ManyTensorNet(width) if kind == "many" else FewTensorNet(width)


def batch_for(model: nn.Module, rank: int, batch: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(batch, model.in_features, generator=gen)


# ---------------------------------------------------------------- methods

@dataclass
class StepMethod:
    """One way to run a step: ``module`` to call, ``reduce`` after backward, ``zero`` at the end."""

    name: str
    module: nn.Module
    params: list[nn.Parameter]
    reduce: Callable[[], Any]
    zero: Callable[[], Any]
    nbytes: int
    reducer: FusedReducer | None = None
    ddp: DDP | None = None

    def forward_backward_reduce(self, x: torch.Tensor) -> None:
        self.module(x).square().mean().backward()
        self.reduce()

    def timed(self, x: torch.Tensor) -> Method:
        def step() -> None:
            self.forward_backward_reduce(x)
            self.zero()
        return Method(self.name, step, nbytes=self.nbytes)

    def info(self) -> dict[str, Any]:
        """Bucket count (and overlap achieved) where the method has buckets."""
        if self.reducer is not None:
            r = self.reducer
            sizing = r.stats.sizing  # bucket_mb="auto": what it chose
            mb = sizing.bucket_mb if sizing else r._fixed_mb or default_bucket_mb(dist.get_backend(r.group))
            shm = r._built is not None and r._built.plan.shm is not None
            return {"buckets": r.num_buckets, "bucket_mb": mb if r.config.overlap else None,
                    "sizing": sizing and sizing.describe(), "transport": "shm" if shm else dist.get_backend(r.group)}
        if self.ddp is not None:
            data = self.ddp._get_ddp_logging_data()
            sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or "")
            return {"buckets": len([s for s in sizes.split(",") if s.strip()]) or None,
                    "bucket_mb": data.get("bucket_cap_bytes", 0) / 2**20 or None}
        return {"buckets": None, "bucket_mb": None}


def _numel(params: list[nn.Parameter]) -> int:
    return sum(p.numel() for p in params)


def _plain(name: str, model: nn.Module, reduce: Callable[[list[nn.Parameter]], Callable[[], Any]],
           nbytes: int) -> StepMethod:
    params = [p for p in model.parameters() if p.requires_grad]
    return StepMethod(name, model, params, reduce(params),
                      lambda: model.zero_grad(set_to_none=False), nbytes)


def per_param_allreduce(params: list[nn.Parameter]) -> Callable[[], None]:
    """The textbook loop: one blocking SUM all-reduce per fp32 gradient, then divide."""
    world = dist.get_world_size()

    def reduce() -> None:
        for p in params:
            dist.all_reduce(p.grad)
            p.grad.div_(world)
    return reduce


def fastreduce_method(name: str, model: nn.Module, dtype: torch.dtype | str, overlap: bool,
                      bucket_mb: float | None, transport: str = "auto", set_to_none: bool = False) -> StepMethod:
    """A FusedReducer row; ``dtype`` ``"int8"``: the quantized wire, with error feedback."""
    quant = isinstance(dtype, str)
    reducer = FusedReducer(model, wire_dtype=dtype, overlap=overlap, error_feedback=quant,
                           bucket_mb=bucket_mb if overlap else None, transport=transport)
    params = [p for p in model.parameters() if p.requires_grad]
    nbytes = _numel(params) * (1 if quant else torch.empty((), dtype=dtype).element_size())  # exact once built
    zero = (lambda: model.zero_grad(set_to_none=True)) if set_to_none else reducer.zero_grad
    return StepMethod(name, model, params, reducer.finish if overlap else reducer.reduce,
                      zero, nbytes, reducer=reducer)


def ddp_method(name: str, model: nn.Module, hook: Callable | None, set_to_none: bool = False) -> StepMethod:
    ddp = DDP(model, gradient_as_bucket_view=True)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    params = [p for p in model.parameters() if p.requires_grad]
    elem = 2 if hook is fp16_compress_hook else 4
    return StepMethod(name, ddp, params, lambda: None,
                      lambda: ddp.zero_grad(set_to_none=set_to_none), _numel(params) * elem, ddp=ddp)


def build_methods(base: nn.Module, cfg: StepConfig) -> list[StepMethod]:
    """Every method of :data:`METHODS`, each on its own copy of ``base`` (same order on all ranks)."""
    def twin() -> nn.Module:
        return copy.deepcopy(base)

    bf16, fp32 = torch.bfloat16, torch.float32
    return [
        _plain("per_param_allreduce_fp32", twin(), per_param_allreduce, _numel(list(base.parameters())) * 4),
        _plain("ohabana_loop_bf16", twin(), ohabana_loop, _numel(list(base.parameters())) * 2),
        fastreduce_method("fastreduce_fused_bf16", twin(), bf16, False, None),
        fastreduce_method("fastreduce_fused_fp32", twin(), fp32, False, None),
        fastreduce_method("fastreduce_overlap_bf16", twin(), bf16, True, cfg.bucket_mb),
        fastreduce_method("fastreduce_overlap_fp32", twin(), fp32, True, cfg.bucket_mb),
        fastreduce_method("fastreduce_fused_fp32_set_to_none", twin(), fp32, False, None, set_to_none=True),
        fastreduce_method("fastreduce_overlap_bf16_set_to_none", twin(), bf16, True, cfg.bucket_mb,
                          set_to_none=True),
        fastreduce_method("fastreduce_fused_bf16_pg", twin(), bf16, False, None, "process_group"),
        fastreduce_method("fastreduce_overlap_bf16_pg", twin(), bf16, True, cfg.bucket_mb, "process_group"),
        fastreduce_method("fastreduce_fused_int8", twin(), "int8", False, None),
        fastreduce_method("fastreduce_overlap_int8", twin(), "int8", True, cfg.bucket_mb),
        ddp_method("ddp_fp32", twin(), None),
        ddp_method("ddp_fp32_set_to_none", twin(), None, set_to_none=True),
        ddp_method("ddp_fp16_hook", twin(), fp16_compress_hook),
        _plain(REFERENCE, twin(), lambda params: (lambda: None), 0),
    ]


def grad_tolerance(name: str) -> float:
    """The largest gradient error (relative to the largest gradient) method ``name`` may show
    in :func:`check_against_reference` and still be timed: :data:`FP32_TOL` where its wire
    is fp32, :data:`NARROW_TOL` where it is 16-bit or quantized."""
    return FP32_TOL if "fp32" in name else NARROW_TOL


def check_against_reference(methods: list[StepMethod], x: torch.Tensor) -> dict[str, float]:
    """One step of each method; each one's largest gradient error relative to the fp32
    loop's, the largest over ranks (every rank then skips the same methods: NaN counts as inf)."""
    grads = {}
    for m in methods:
        m.zero()
        m.forward_backward_reduce(x)
        grads[m.name] = [p.grad.detach().clone() for p in m.params]
        m.zero()
        if m.reducer is not None:  # exact wire bytes now that the buffer exists (a quantized one's codes)
            built = m.reducer._built  # type: ignore[union-attr]
            m.nbytes = getattr(built.plan, "wire_bytes", built.buffer.nbytes)
    ref = grads["per_param_allreduce_fp32"]
    scale = max(g.abs().max().item() for g in ref) or 1.0
    names = [name for name in grads if name != REFERENCE]
    errs = torch.tensor([max((a - b).abs().max().item() for a, b in zip(grads[name], ref)) / scale
                         for name in names], dtype=torch.float64).nan_to_num(nan=math.inf)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    return dict(zip(names, errs.tolist()))


def failed_checks(errors: dict[str, float]) -> dict[str, str]:
    """Why each method over its :func:`grad_tolerance` is not timed (the others: absent)."""
    return {name: f"gradients off the fp32 loop's by {err:.1e} (> {grad_tolerance(name):g}, the largest "
                  "over ranks): not timed"
            for name, err in errors.items() if not err <= grad_tolerance(name)}


# ---------------------------------------------------------------- one rank

def step_rank(rank: int, world: int, cfg: StepConfig) -> dict[str, Any]:
    """Everything one rank does; module-level so :func:`run_ranks` can pickle it."""
    os.dup2(2, 1)  # a rank never writes to stdout: --json output must stay one object
    out: dict[str, Any] = {"threads": torch.get_num_threads(),
                           "default_bucket_mb": default_bucket_mb(dist.get_backend())}
    for kind in MODELS:
        base = build_model(kind, cfg.params_m)
        x = batch_for(base, rank, cfg.batch)
        methods = build_methods(base, cfg)
        errors = check_against_reference(methods, x)
        failed = failed_checks(errors)
        fr = {m.name: m.reducer for m in methods if m.reducer is not None}
        before = {n: (r.stats.calls, r.stats.launched_in_backward) for n, r in fr.items()}
        times = time_round_robin([m.timed(x) for m in methods if m.name not in failed], cfg.iters, 1,
                                 cfg.warmup_rounds)
        info = {m.name: m.info() for m in methods}
        for n, r in fr.items():
            calls = r.stats.calls - before[n][0]
            launched = r.stats.launched_in_backward - before[n][1]
            info[n]["launched_in_backward"] = launched / calls if r.config.overlap and calls else None
        out[kind] = {"times": times, "nbytes": {m.name: m.nbytes for m in methods}, "info": info,
                     "errors": errors, "skipped": failed, "width": base.in_features,
                     "tensors": sum(1 for _ in base.parameters()),
                     "numel": sum(p.numel() for p in base.parameters())}
        del methods, fr
        gc.collect()
    return out


# ---------------------------------------------------------------- the report

def build_report(cfg: StepConfig, per_rank: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    r0 = per_rank[0]
    models: dict[str, Any] = {}
    untimed = {"median_ms": None, "p10_ms": None, "p90_ms": None}
    for kind in MODELS:
        times = [r[kind]["times"] for r in per_rank]
        skipped = r0[kind].get("skipped", {})
        methods = {name: {**(untimed if name in skipped else summary_ms(slowest_rank(times, name))),
                          "mb_wire": r0[kind]["nbytes"][name] / 1e6, **r0[kind]["info"][name],
                          "max_rel_err": r0[kind]["errors"].get(name),
                          "grad_tol": None if name == REFERENCE else grad_tolerance(name),
                          "skipped": skipped.get(name)}
                   for name in METHODS}
        ddp = methods[DDP_BASELINE]["median_ms"]
        for m in methods.values():
            m["speedup_vs_ddp"] = ddp / m["median_ms"] if ddp and m["median_ms"] else None
        models[kind] = {"width": r0[kind]["width"], "tensors": r0[kind]["tensors"],
                        "numel": r0[kind]["numel"], "methods": methods}
    ms = models[TARGET_MODEL]["methods"]
    targets: dict[str, Any] = {}
    for spec in TARGETS:  # a method that failed its check is not timed: its targets are SKIP, never judged
        name, num, den, op, limit = spec
        out = [f"{n}: {ms[n]['skipped']}" for n in (num, den) if ms[n]["median_ms"] is None]
        if out:
            targets[name] = {"value": None, "limit": limit, "op": op, "pass": None,
                             "what": f"{TARGET_MODEL}: {num} / {den}: {'; '.join(out)}"}
        else:
            targets.update(judge_ratios([spec], lambda n: ms[n]["median_ms"], where=f"{TARGET_MODEL}: "))
    fastest = ms[DDP_FASTEST]["median_ms"]
    vs_fastest_ddp = {name: ms[name]["median_ms"] / fastest if fastest and ms[name]["median_ms"] else None
                      for name in ALSO_VS_FASTEST_DDP}
    config = {**asdict(cfg), "threads": r0["threads"], "default_bucket_mb": r0["default_bucket_mb"],
              "step": "forward + backward + reduce + zero_grad(set_to_none=False); no optimizer step",
              "step_time": "max over ranks per iteration", "wall_seconds": round(seconds, 1)}
    return {"config": config, "models": models, "targets": targets, "vs_fastest_ddp": vs_fastest_ddp,
            "torch_version": torch.__version__, "machine": machine_info()}


def csv_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (model, timed method): the CSV's and the chart's data."""
    return [{"model": kind, "method": name, **{k: m[k] for k in
                                                ("median_ms", "p10_ms", "p90_ms", "mb_wire", "speedup_vs_ddp")}}
            for kind, mod in report["models"].items() for name, m in mod["methods"].items()
            if m["median_ms"] is not None]


def chart_title(report: dict[str, Any]) -> str:
    c = report["config"]
    return (f"fastreduce bench, step suite: {c['ranks']} Gloo ranks x {c['threads']} thread(s), "
            f"batch {c['batch']}/rank, {c['iters']} steps/method, torch {report['torch_version']}\n"
            "step = forward + backward + reduce + zero_grad (no optimizer step), slowest rank")


def format_text(report: dict[str, Any]) -> str:
    c = report["config"]
    bucket = f"{c['bucket_mb']:g} MB" if c["bucket_mb"] else \
        f"'auto' (a quantized wire: the backend's {c['default_bucket_mb']:g} MB)"
    lines = [f"step suite (forward + backward + reduce + zero_grad, no optimizer step): {c['ranks']} Gloo "
             f"ranks x {c['threads']} thread(s), batch {c['batch']}/rank, {c['iters']} timed steps/method "
             f"(round-robin), step = slowest rank; overlap buckets: {bucket}"]
    for kind, mod in report["models"].items():
        lines += ["", f"model {kind}: {mod['numel'] / 1e6:.2f}M fp32 params in {mod['tensors']} tensors "
                      f"(width {mod['width']})",
                  f"{'method':<37}{'median ms':>10}{'p10':>9}{'p90':>9}{'MB wire':>9}{'buckets':>8}"
                  f"{'vs DDP':>8}  notes"]
        for name, m in mod["methods"].items():
            buckets = "-" if m["buckets"] is None else str(m["buckets"])
            if m.get("skipped"):
                lines.append(f"{name:<37}{'-':>10}{'-':>9}{'-':>9}{m['mb_wire']:>9.1f}{buckets:>8}{'-':>8}  "
                             f"skipped: {m['skipped']}")
                continue
            notes = [f"via {m['transport']}"] if m.get("transport") else []
            if m.get("launched_in_backward") is not None:
                notes.append(f"{m['launched_in_backward']:.0f}/{m['buckets']} launched in backward")
            if name == REFERENCE:
                notes.append("reference: no communication")
            elif m["max_rel_err"] is not None and m["max_rel_err"] > 0:
                notes.append(f"grad err {m['max_rel_err']:.1e}")
            lines.append(f"{name:<37}{m['median_ms']:>10.2f}{m['p10_ms']:>9.2f}{m['p90_ms']:>9.2f}"
                         f"{m['mb_wire']:>9.1f}{buckets:>8}{m['speedup_vs_ddp']:>7.2f}x  {', '.join(notes)}")
    if c["quick"]:
        lines.append("(--quick: tiny models prove the benchmark runs; fixed per-call costs "
                     "dominate their timings, so the targets mean little)")
    lines += ["", "targets (report only):"] + target_lines(report["targets"], width=26)
    lines += ["", f"also, {TARGET_MODEL}, against DDP's fastest setting here ({DDP_FASTEST}):"]
    lines += [f"  {name:<26}" + (f"{ratio:.3f}x" if ratio is not None else "not timed")
              for name, ratio in report["vs_fastest_ddp"].items()]
    return "\n".join(lines)


def run_step_bench(cfg: StepConfig) -> dict[str, Any]:
    """Spawn the ranks, time every method on both models, and return the report (JSON-able)."""
    t0 = time.perf_counter()
    per_rank = run_ranks(step_rank, cfg.ranks, cfg, threads=cfg.threads,
                         timeout=120.0 if cfg.quick else 1800.0)
    return build_report(cfg, per_rank, time.perf_counter() - t0)
