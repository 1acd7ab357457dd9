"""``fastreduce bench reduce``: what the reduction call costs, next to what it cannot avoid.

What is measured
----------------
Real Gloo ranks (spawned by :func:`fastreduce.launch.run_ranks`) build the same
MLP-like stack of Linear layers (~100 layers, ~200 tensors, ~12M fp32 parameters by
default), run one forward/backward to create gradients, and then time **only the
reduction step** of each method below, on the same model and gradients:

==========================  ====================================================
 ``fastreduce_bf16``         ``all_reduce_gradients(model, torch.bfloat16,
                             transport="process_group")``: over Gloo
 ``fastreduce_fp32``         the same with ``torch.float32``
 ``bare_allreduce_bf16``     ``dist.all_reduce`` of a packed flat bf16 buffer
 ``bare_allreduce_fp32``     ``dist.all_reduce`` of a packed flat fp32 buffer
 ``flat_bf16_unavoidable``   a bf16 wire's unavoidable work on one flat fp32
                             buffer: cast in, (divide,) all-reduce, cast back
 ``per_param_loop_bf16``     the per-parameter loop optimum-habana runs: cast
                             and scale each grad into a fused bf16 buffer, one
                             SUM all-reduce, cast each slice back
 ``fastreduce_bf16_shm``     ``all_reduce_gradients(model, torch.bfloat16)`` with
                             the default transport: shared memory on one host
 ``fastreduce_fp32_shm``     the same with ``torch.float32``
 ``bare_shm_bf16/fp32``      the shared-memory averaging alone, on the packed
                             wire buffer of the reducer above
==========================  ====================================================

The issue-2 targets are defined against Gloo's all-reduce, so they use the
``process_group`` rows; the ``_shm`` rows show the same call on the transport
fastreduce picks by default for ranks on one host (each against its own bare
averaging; if /dev/shm is unusable they fall back to Gloo and say so).

Every fastreduce method and the loop get their own ``deepcopy`` of the model, so
each has its own reducer and gradients; between calls the gradients are zeroed in
place (``zero_grad(set_to_none=False)``, untimed) so they stay views of the flat
buffer, as in a training loop. The bare collectives use the reducer's own averaging
op (``ReduceOp.AVG`` where the backend has it).

Why like this
-------------
The machine is shared and noisy, so methods are interleaved round-robin: every
round runs each method a few times (the starting method rotates), and drift hits
all methods alike. A ``dist.barrier()`` precedes each timed call, and a step's
time is the **maximum over ranks** of that iteration's time: the slowest rank is
what the optimizer step waits for. Medians and p10/p90 are reported, never means.

The targets say what "as cheap as the collective itself" means: fastreduce's bf16
step within 10% of the unavoidable flat cast+all-reduce+cast, its fp32 step within
10% of a bare all-reduce, at least 1.2x faster than the per-parameter loop, and a
constant number of dispatched ops per call (counted with a ``TorchDispatchMode``,
c10d ops included) whether the model has 50 or 500 gradient tensors.
"""

from __future__ import annotations

import copy
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..launch import run_ranks
from ..modes.functional import all_reduce_gradients
from ..modes.fused import FusedReducer
from .common import Method, machine_info, ohabana_loop, slowest_rank, summary_ms, time_round_robin
from .report import judge_ratios, target_lines

__all__ = ["BenchConfig", "format_text", "run_bench"]

N_LAYERS = 100
"""Linear layers of the timed model: weight + bias each, so ~200 gradient tensors."""
OPS_MODEL_TENSORS = (50, 500)
"""Gradient-tensor counts of the two small models whose per-call ops are counted."""
BASELINES = {
    "fastreduce_bf16": "bare_allreduce_bf16",
    "fastreduce_fp32": "bare_allreduce_fp32",
    "bare_allreduce_bf16": "bare_allreduce_bf16",
    "bare_allreduce_fp32": "bare_allreduce_fp32",
    "flat_bf16_unavoidable": "bare_allreduce_bf16",
    "per_param_loop_bf16": "bare_allreduce_bf16",
    "fastreduce_bf16_shm": "bare_shm_bf16",
    "fastreduce_fp32_shm": "bare_shm_fp32",
    "bare_shm_bf16": "bare_shm_bf16",
    "bare_shm_fp32": "bare_shm_fp32",
}
"""Each method's table ratio is its median over this method's median (same wire dtype)."""
METHODS = tuple(BASELINES)
RATIO_TARGETS = (  # (target name, numerator, denominator, comparison, limit)
    ("bf16_vs_unavoidable", "fastreduce_bf16", "flat_bf16_unavoidable", "<=", 1.1),
    ("loop_vs_bf16", "per_param_loop_bf16", "fastreduce_bf16", ">=", 1.2),
    ("fp32_vs_bare", "fastreduce_fp32", "bare_allreduce_fp32", "<=", 1.1),
)


@dataclass(frozen=True)
class BenchConfig:
    """What to run; ``iters`` timed calls per method, ``reps`` of them per round."""

    ranks: int = 2
    iters: int = 20
    params_m: float = 12.0
    quick: bool = False
    reps: int = 2
    warmup_rounds: int = 1
    batch: int = 8

    @property
    def rounds(self) -> int:
        return -(-self.iters // self.reps)

    @property
    def width(self) -> int:
        """Features per layer so that ``N_LAYERS`` layers hold ``params_m`` million parameters."""
        return max(4, round((self.params_m * 1e6 / N_LAYERS) ** 0.5))


# ---------------------------------------------------------------- model and grads

def make_model(n_layers: int, width: int) -> nn.Sequential:
    """Linear+ReLU stack, He-initialized so gradients stay normal floats (no denormals)."""
    torch.manual_seed(0)  # same weights on every rank
    layers: list[nn.Module] = []
    for _ in range(n_layers):
        lin = nn.Linear(width, width)
        nn.init.normal_(lin.weight, std=(2.0 / width) ** 0.5)
        nn.init.normal_(lin.bias, std=0.01)
        layers += [lin, nn.ReLU()]
    return nn.Sequential(*layers)


def backward_once(model: nn.Sequential, rank: int, batch: int) -> None:
    """One forward/backward on rank-specific data, leaving a gradient on every parameter."""
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(batch, model[0].in_features, generator=gen)
    model(x).square().mean().backward()


def clone_with_grads(model: nn.Module) -> nn.Module:
    """A ``deepcopy`` of ``model`` with its own copy of every gradient (deepcopy drops them)."""
    twin = copy.deepcopy(model)
    for p, q in zip(model.parameters(), twin.parameters()):
        q.grad = None if p.grad is None else p.grad.clone()
    return twin


def _reducer_of(model: nn.Module) -> FusedReducer:
    """The reducer ``all_reduce_gradients`` keeps on ``model`` (exactly one here)."""
    (reducer,) = model.__dict__["_fastreduce_reducers"].values()
    return reducer


# ---------------------------------------------------------------- the methods

def fastreduce_method(name: str, model: nn.Module, dtype: torch.dtype,
                      transport: str = "process_group") -> tuple[Method, FusedReducer]:
    """``all_reduce_gradients`` on a private copy; the first (untimed) call builds the reducer."""
    m = clone_with_grads(model)
    all_reduce_gradients(m, dtype, transport=transport)  # type: ignore[arg-type]
    reducer = _reducer_of(m)
    assert reducer._built is not None
    return (Method(name, lambda: all_reduce_gradients(m, dtype, transport=transport),  # type: ignore[arg-type]
                   lambda: m.zero_grad(set_to_none=False), reducer._built.buffer.nbytes), reducer)


def bare_method(name: str, reducer: FusedReducer) -> Method:
    """The reducer's averaging alone on an already-packed buffer: its shared-memory job on
    its own wire buffer, or the process group's all-reduce of a copy with its op."""
    built = reducer._built
    assert built is not None
    wire = built.buffer.wire
    if built.plan.shm is not None:
        shm = built.plan.shm
        return Method(name, lambda: shm.start(wire).wait(), nbytes=built.buffer.nbytes)
    buf = torch.randn(wire.numel()).to(wire.dtype)
    op = built.plan.op
    return Method(name, lambda: dist.all_reduce(buf, op=op), nbytes=buf.numel() * buf.element_size())


def flat_unavoidable_method(name: str, reducer: FusedReducer) -> Method:
    """A bf16 wire's unavoidable work for fp32 grads: contiguous cast in, reduce, cast out."""
    built = reducer._built
    assert built is not None
    plan = built.plan
    flat = torch.randn(built.buffer.wire.numel())
    wire = torch.empty(flat.numel(), dtype=built.buffer.wire.dtype)

    def step() -> None:
        wire.copy_(flat)
        if plan.prescale:
            wire.div_(plan.world)
        dist.all_reduce(wire, op=plan.op)
        flat.copy_(wire)

    return Method(name, step, nbytes=wire.numel() * wire.element_size())


def per_param_loop_method(name: str, model: nn.Module) -> Method:
    """optimum-habana's per-parameter loop (:func:`.common.ohabana_loop`) on a private copy."""
    m = clone_with_grads(model)
    params = [p for p in m.parameters() if p.requires_grad]
    return Method(name, ohabana_loop(params), lambda: m.zero_grad(set_to_none=False),
                  sum(p.numel() for p in params) * 2)


def build_methods(model: nn.Module) -> tuple[list[Method], dict[str, str]]:
    """Every method in :data:`METHODS` order, and each reducer's averaging plan."""
    bf16, r_bf16 = fastreduce_method("fastreduce_bf16", model, torch.bfloat16)
    fp32, r_fp32 = fastreduce_method("fastreduce_fp32", model, torch.float32)
    bf16_shm, s_bf16 = fastreduce_method("fastreduce_bf16_shm", model, torch.bfloat16, "auto")
    fp32_shm, s_fp32 = fastreduce_method("fastreduce_fp32_shm", model, torch.float32, "auto")
    plans = {name: repr(r._built.plan) for name, r in  # type: ignore[union-attr]
             (("bf16", r_bf16), ("fp32", r_fp32), ("bf16_shm", s_bf16), ("fp32_shm", s_fp32))}
    return [bf16, fp32,
            bare_method("bare_allreduce_bf16", r_bf16),
            bare_method("bare_allreduce_fp32", r_fp32),
            flat_unavoidable_method("flat_bf16_unavoidable", r_bf16),
            per_param_loop_method("per_param_loop_bf16", model),
            bf16_shm, fp32_shm,
            bare_method("bare_shm_bf16", s_bf16),
            bare_method("bare_shm_fp32", s_fp32)], plans


# ---------------------------------------------------------------- op counting

class OpCounter(TorchDispatchMode):
    """Counts every op reaching the dispatcher (aten, c10d, profiler) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def count_ops(n_tensors: int, dtype: torch.dtype, rank: int) -> dict[str, Any]:
    """Ops dispatched by one warm ``all_reduce_gradients`` call on an ``n_tensors`` model."""
    model = make_model(n_tensors // 2, 8)
    backward_once(model, rank, 2)
    # Gloo's collectives run on this thread, so the counter sees them (shared memory's
    # run on a worker thread; tests/test_shm.py counts those).
    all_reduce_gradients(model, dtype, transport="process_group")  # cold call: builds the reducer
    model.zero_grad(set_to_none=False)
    with OpCounter() as counter:
        all_reduce_gradients(model, dtype, transport="process_group")
    return {"total": sum(counter.ops.values()), "ops": dict(counter.ops)}


def count_all_ops(rank: int) -> dict[str, dict[str, dict[str, Any]]]:
    return {name: {str(n): count_ops(n, dtype, rank) for n in OPS_MODEL_TENSORS}
            for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32))}


# ---------------------------------------------------------------- one rank

def bench_rank(rank: int, world: int, cfg: BenchConfig) -> dict[str, Any]:
    """Everything one rank does; module-level so :func:`run_ranks` can pickle it."""
    os.dup2(2, 1)  # a rank never writes to stdout: --json output must stay one object
    ops = count_all_ops(rank)
    model = make_model(N_LAYERS, cfg.width)
    backward_once(model, rank, cfg.batch)
    methods, plans = build_methods(model)
    times = time_round_robin(methods, cfg.iters, cfg.reps, cfg.warmup_rounds)
    return {"times": times, "nbytes": {m.name: m.nbytes for m in methods}, "ops": ops, "plans": plans,
            "tensors": sum(1 for p in model.parameters()),
            "numel": sum(p.numel() for p in model.parameters())}


# ---------------------------------------------------------------- the report

def summarize(per_rank: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    times = [r["times"] for r in per_rank]
    return {name: {**summary_ms(slowest_rank(times, name)), "mb": per_rank[0]["nbytes"][name] / 1e6}
            for name in METHODS}


def judge(methods: dict[str, dict[str, float]], ops: dict[str, dict[str, int]]) -> dict[str, dict[str, Any]]:
    """Each target's value, limit and verdict."""
    targets = judge_ratios(RATIO_TARGETS, lambda name: methods[name]["median_ms"])
    small, large = (str(n) for n in OPS_MODEL_TENSORS)
    for dt, counts in ops.items():
        targets[f"ops_constant_{dt}"] = {
            "value": counts[large], "limit": counts[small], "op": "==",
            "pass": counts[large] == counts[small], "what": f"ops/call {dt}: {large} vs {small} tensors"}
    return targets


def build_report(cfg: BenchConfig, per_rank: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    r0 = per_rank[0]
    methods = summarize(per_rank)
    ops = {dt: {n: c["total"] for n, c in by_n.items()} for dt, by_n in r0["ops"].items()}
    ratios = {f"{n}/{b}": methods[n]["median_ms"] / methods[b]["median_ms"] for n, b in BASELINES.items()}
    ratios.update({f"{num}/{den}": methods[num]["median_ms"] / methods[den]["median_ms"]
                   for _, num, den, _, _ in RATIO_TARGETS})
    config = {**asdict(cfg), "rounds": cfg.rounds, "layers": N_LAYERS, "width": cfg.width,
              "tensors": r0["tensors"], "numel": r0["numel"], "averaging": r0["plans"],
              "step_time": "max over ranks per iteration", "wall_seconds": round(seconds, 1)}
    return {"config": config, "methods": methods, "ratios": ratios, "targets": judge(methods, ops),
            "ops_per_call": ops,
            "ops_breakdown": {dt: {n: c["ops"] for n, c in by_n.items()} for dt, by_n in r0["ops"].items()},
            "torch_version": torch.__version__, "machine": machine_info()}


def format_text(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [f"reduce suite (the reduction call alone): {c['ranks']} Gloo ranks, {c['tensors']} grad tensors, "
             f"{c['numel'] / 1e6:.2f}M fp32 params, {c['iters']} timed calls/method "
             f"({c['rounds']} rounds x {c['reps']}), step = slowest rank; torch {report['torch_version']}",
             "",
             f"{'method':<24}{'median ms':>10}{'p10':>9}{'p90':>9}{'MB wire':>9}  ratio (vs bare, same wire dtype)"]
    for name, m in report["methods"].items():
        base = BASELINES[name]
        lines.append(f"{name:<24}{m['median_ms']:>10.2f}{m['p10_ms']:>9.2f}{m['p90_ms']:>9.2f}"
                     f"{m['mb']:>9.1f}  {report['ratios'][f'{name}/{base}']:.2f}x {base}")
    lines.append("averaging: " + ", ".join(f"{k} {v}" for k, v in c["averaging"].items()))
    if c["quick"]:
        lines.append("(--quick: a tiny model proves the benchmark runs; fixed per-call costs "
                     "dominate its timings, so its targets mean little)")
    lines += ["", "ops per warm call: " + ", ".join(
        f"{dt} {' / '.join(f'{n} tensors: {k}' for n, k in by_n.items())}"
        for dt, by_n in report["ops_per_call"].items()), "", "targets:"]
    lines += target_lines(report["targets"])
    return "\n".join(lines)


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Spawn the ranks, time every method, and return the report (a JSON-able dict)."""
    t0 = time.perf_counter()
    per_rank = run_ranks(bench_rank, cfg.ranks, cfg, timeout=120.0 if cfg.quick else 900.0)
    return build_report(cfg, per_rank, time.perf_counter() - t0)
