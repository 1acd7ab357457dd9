"""``fastreduce bench optim``: whole training steps with the AdamW step, ZeRO against the rest.

What is measured
----------------
Real Gloo ranks (spawned by :func:`fastreduce.launch.run_ranks`, once per world size
in ``--optim-ranks``, 2 and 4 by default; 2 only with ``--quick``) time one
data-parallel **training step** per call::

    forward + backward + gradient reduction + AdamW step + zero_grad (in place)

on the step suite's ``many`` model (:mod:`fastreduce.bench.step`: ~12M fp32
parameters in 200 tensors, ``--params-m`` scales it), with the step suite's batch
(``--batch`` rows per rank, a rank-specific seed, the same data for every method).
Every method runs on its own ``deepcopy`` of one seeded model, with AdamW at
``lr=1e-3, weight_decay=0.01``:

=========================  ==============================================================
 ``zero_adamw``             ``fastreduce.ZeroOptimizer(params, torch.optim.AdamW,
                            module=model)``: gradients reduce-scattered during backward,
                            each rank steps its shard, parameters gathered back; step =
                            ``backward(); opt.step(); opt.zero_grad(set_to_none=False)``
                            (then ``opt.wait_params()``: no all-gather may run on into
                            the next method's timed step)
 ``zero_adamw_nooverlap``   the same with ``overlap=False`` (all reduction in ``step()``)
 ``zero_adamw_redundant``   ``zero_adamw`` with ``redundant=True`` (each shard also kept
                            and stepped on the next rank: what ``fastreduce.Membership``
                            needs); its state bytes include that copy and its gradients
 ``zero_adamw_redundant2``  ``redundant=2`` and ``3``: 2 and 3 copies of each shard (at
 ``zero_adamw_redundant3``  most world - 1: on 2 ranks both are ``redundant=True``)
 ``fused_adamw``            ``FusedReducer(model, wire_dtype=None)`` (fp32, one fused
                            collective after backward: fastreduce's fastest setting on a
                            CPU box) + ``torch.optim.AdamW(fused=True)``, zeroed with
                            ``reducer.zero_grad()``
 ``ddp_adamw``              ``DistributedDataParallel(gradient_as_bucket_view=True)`` +
                            ``torch.optim.AdamW(fused=True)``, zeroed in place: the
                            reference for parameters, speed ("vs DDP") and state bytes
 ``torch_zero_adamw``       PyTorch's recipe: ``ZeroRedundancyOptimizer(optimizer_class=
                            AdamW, fused=True)`` on the same DDP model (DDP
                            all-reduces, each rank steps the parameters it owns, then
                            broadcasts them)
=========================  ==============================================================

(Every AdamW runs the fastest kernel the device has, the one ``ZeroOptimizer`` picks
for its shard: ``fused=True``, else ``foreach=True``; ``ZeroRedundancyOptimizer``'s inner
one included. On CPU PyTorch's default is the per-tensor loop, 6x slower than fused
on this model, which would credit ``ZeroOptimizer`` with a kernel choice rather than
with sharding.)

Before timing, every method takes two steps and its parameters are compared with
``ddp_adamw``'s: ``||P - P_ddp|| / ||P_ddp||`` (2-norms over all parameters together,
the largest over ranks) must be at most 1e-4, else the method is not timed (it is
reported, with its difference). On the 12M model two AdamW steps move the
parameters by about 1.6e-2 on that scale (the ``ddp_adamw`` row's note), so a method
that skips the update, the reduction or half the shards is far off; an fp32
reduction that only rounds differently stays near 4e-6 (AdamW divides by the root
of the second moment, which blows a gradient's last-bit differences up where the
gradient is near ``eps``, so the largest single-element difference is no good
measure). A ``ZeroOptimizer`` that fastreduce does not have (yet) is reported as
skipped.

Optimizer-state bytes per rank are measured from the tensors: the sum of ``nbytes``
over every tensor in the optimizer's ``state`` (``ZeroOptimizer.state_bytes()``, or
its ``inner`` optimizer's state; ``ZeroRedundancyOptimizer.optim.state``; plain
AdamW's ``state``), the largest over ranks, and its ratio to plain AdamW's.

Methods are interleaved round-robin with a barrier before each step; a step's time is
the slowest rank's (see :mod:`fastreduce.bench.common`). The weights change every
step, but every step of a method does the same work.

Options: ``--zero-bucket-mb 0.5,1,2`` adds a ``zero_adamw_<mb>mb`` row per size (``bucket_mb``
fixed, everything else as ``zero_adamw``), timed side by side with its ``"auto"``;
``--optim-model blocks`` runs the decentralized suite's 48 x (``Linear`` + ``LayerNorm``)
(12.66M parameters, batch 32 unless given) instead of ``many``; ``--set-to-none`` zeroes
every method with ``zero_grad(set_to_none=True)``, torch's default, so each backward
allocates its gradients afresh (the fused reducer: ``model.zero_grad()``).

Targets (reported, never enforced), at 2 ranks: ``zero_adamw`` at most 1.0x
``fused_adamw`` and 1.0x ``ddp_adamw``, at most 0.8x ``torch_zero_adamw``; and at every
world size N, ``zero_adamw``'s state bytes per rank at most plain AdamW's / N +
2 * 4 * 64 * N * buckets (two fp32 moments, padding of up to 64 * N elements per
bucket).
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
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

import fastreduce

from ..launch import run_ranks
from ..layout import ALIGN
from ..optim_kernels import fused_if_possible
from .common import Method, machine_info, slowest_rank, summary_ms, time_round_robin
from .gossip import build_gossip_model
from .report import judge_ratios
from .step import StepMethod, batch_for, build_model, ddp_method, fastreduce_method

__all__ = ["METHODS", "OptimConfig", "csv_rows", "format_text", "parse_world_sizes", "run_optim_bench"]

MODEL = "many"
MODELS = (MODEL, "blocks")
LR = 1e-3
WEIGHT_DECAY = 0.01
COPIES = (2, 3)
"""The ``redundant=k`` rows beside ``zero_adamw_redundant`` (k = 1): the cost of each copy."""
ZERO_METHODS = ("zero_adamw", "zero_adamw_nooverlap", "zero_adamw_redundant",
                *(f"zero_adamw_redundant{k}" for k in COPIES))
DDP_BASELINE = "ddp_adamw"
"""Parameters are checked against it, speed is given relative to it ("vs DDP")."""
PLAIN = "ddp_adamw"
"""Whose state bytes are plain AdamW's (``fused_adamw``'s are the same)."""
METHODS = (*ZERO_METHODS, "fused_adamw", DDP_BASELINE, "torch_zero_adamw")
CHECK_STEPS = 2
PARAM_TOL = 1e-4
"""Most ``||P - P_ddp|| / ||P_ddp||`` after :data:`CHECK_STEPS` steps: above it a method is not timed."""
STATE_PAD_ELEMS = 64
"""A bucket is padded to a multiple of N x this many elements (equal, cache-line chunks)."""
TARGET_WORLD = 2
TARGETS = (  # (name, numerator, denominator, comparison, limit), at TARGET_WORLD ranks
    ("zero_vs_fused", "zero_adamw", "fused_adamw", "<=", 1.0),
    ("zero_vs_ddp", "zero_adamw", "ddp_adamw", "<=", 1.0),
    ("zero_vs_torch_zero", "zero_adamw", "torch_zero_adamw", "<=", 0.8),
)
DEFAULT_WORLD_SIZES = (2, 4)
QUICK_WORLD_SIZES = (2,)


@dataclass(frozen=True)
class OptimConfig:
    """What to run: ``iters`` timed steps per method and world size, after ``warmup_rounds`` rounds."""

    world_sizes: tuple[int, ...] = DEFAULT_WORLD_SIZES
    iters: int = 20
    params_m: float = 12.0
    batch: int = 64
    bucket_mb: float | None = None
    """``ZeroOptimizer``'s bucket size; ``None``: its default."""
    zero_bucket_mbs: tuple[float, ...] = ()
    """Also ``zero_adamw`` at each of these bucket sizes (``zero_adamw_<mb>mb``), side by side."""
    model: str = MODEL
    """``"many"`` (the step suite's) or ``"blocks"`` (the decentralized suite's)."""
    set_to_none: bool = False
    """Every method zeroes with ``set_to_none=True`` (torch's default) instead of in place."""
    threads: int | None = None
    """Intra-op threads per rank; ``None``: cores / ranks."""
    quick: bool = False
    warmup_rounds: int = 2


def parse_world_sizes(text: str, option: str = "--optim-ranks") -> tuple[int, ...]:
    """``"2,4"`` -> ``(2, 4)``; every size at least 2, no repeats (errors name ``option``)."""
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"{option} must be comma-separated integers, got {text!r}") from None
    if not sizes or any(n < 2 for n in sizes) or len(set(sizes)) != len(sizes):
        raise ValueError(f"{option} needs distinct world sizes of at least 2, got {text!r}")
    return sizes


# ---------------------------------------------------------------- methods

def state_tensor_bytes(state: Any) -> int:
    """Sum of ``nbytes`` over every tensor in an optimizer's ``state`` (param -> dict)."""
    total = 0
    for entry in state.values():
        values = entry.values() if isinstance(entry, dict) else [entry]
        total += sum(v.nbytes for v in values if isinstance(v, torch.Tensor))
    return total


@dataclass
class OptimMethod:
    """A :class:`~fastreduce.bench.step.StepMethod` (forward, backward, reduce, zero) plus an optimizer."""

    base: StepMethod
    optimizer: torch.optim.Optimizer | None
    state_bytes: Callable[[], int]
    extra_info: Callable[[], dict[str, Any]] | None = None
    """Overrides :meth:`StepMethod.info`'s entries (buckets, transport) where it knows nothing."""
    skipped: str | None = None
    """Why the method is not timed (set before or by the check); ``None``: it is."""

    @property
    def name(self) -> str:
        return self.base.name

    def train_step(self, x: torch.Tensor) -> None:
        self.base.forward_backward_reduce(x)
        self.optimizer.step()  # type: ignore[union-attr]
        self.base.zero()

    def timed(self, x: torch.Tensor) -> Method:
        return Method(self.name, lambda: self.train_step(x))

    def info(self) -> dict[str, Any]:
        if self.skipped is not None:
            return {"buckets": None, "bucket_mb": None}
        info = self.base.info()
        if self.extra_info is not None:
            info.update(self.extra_info())
        return info


def _skipped(name: str, why: str) -> OptimMethod:
    return OptimMethod(StepMethod(name, nn.Identity(), [], lambda: None, lambda: None, 0),
                       None, lambda: 0, skipped=why)


def fastest_kernel(params: list[Any]) -> dict[str, Any]:
    """AdamW's fastest implementation for ``params``: the one ZeroOptimizer picks at
    two or more ranks (``fused`` where the device has it), else ``foreach``."""
    return fused_if_possible(torch.optim.AdamW, params, {}) or {"foreach": True}


def _plain_adamw(params: Any) -> torch.optim.AdamW:
    params = list(params)
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, **fastest_kernel(params))


def zero_method(name: str, model: nn.Module, overlap: bool, bucket_mb: float | None,
                set_to_none: bool = False, redundant: bool | int = False) -> OptimMethod:
    """``fastreduce.ZeroOptimizer`` (it reduces the gradients itself: no DDP, no reducer)."""
    zero_cls = getattr(fastreduce, "ZeroOptimizer", None)
    if zero_cls is None:
        return _skipped(name, "fastreduce.ZeroOptimizer not available")
    kwargs: dict[str, Any] = {"module": model, "overlap": overlap}
    if redundant:
        kwargs["redundant"] = redundant
    if bucket_mb is not None:
        kwargs["bucket_mb"] = bucket_mb
    opt = zero_cls(model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY, **kwargs)
    params = [p for p in model.parameters() if p.requires_grad]
    wait = getattr(opt, "wait_params", lambda: None)

    def zero() -> None:
        opt.zero_grad(set_to_none=set_to_none)
        wait()  # no all-gather left running into the next method's timed step
    base = StepMethod(name, model, params, lambda: None, zero, 0)

    def state_bytes() -> int:
        if hasattr(opt, "state_bytes"):
            return int(opt.state_bytes())
        return state_tensor_bytes(opt.inner.state)

    def info() -> dict[str, Any]:
        n = getattr(opt, "num_buckets", None)
        out: dict[str, Any] = {"buckets": int(n) if n is not None else None, "bucket_mb": bucket_mb,
                               "tensors": len(params)}
        try:
            out["transport"] = "shm" if opt.comm.shm_of(opt.buffer.wire) is not None else opt.comm.pg_backend
        except AttributeError:  # an internal this suite peeks at has changed: say nothing
            pass
        if hasattr(opt, "state_bytes") and hasattr(opt, "inner"):  # cross-check from the tensors
            out["inner_state_bytes"] = state_tensor_bytes(opt.inner.state)
        return out
    return OptimMethod(base, opt, state_bytes, info)


def fused_method(name: str, model: nn.Module, set_to_none: bool = False) -> OptimMethod:
    base = fastreduce_method(name, model, None, False, None, set_to_none=set_to_none)  # type: ignore[arg-type]
    opt = _plain_adamw(model.parameters())
    return OptimMethod(base, opt, lambda: state_tensor_bytes(opt.state))


def ddp_adamw_method(name: str, model: nn.Module, set_to_none: bool = False) -> OptimMethod:
    base = ddp_method(name, model, None, set_to_none)
    opt = _plain_adamw(base.module.parameters())
    return OptimMethod(base, opt, lambda: state_tensor_bytes(opt.state))


def torch_zero_method(name: str, model: nn.Module, set_to_none: bool = False) -> OptimMethod:
    base = ddp_method(name, model, None, set_to_none)
    params = list(base.module.parameters())
    opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW,
                                  lr=LR, weight_decay=WEIGHT_DECAY, **fastest_kernel(params))
    return OptimMethod(base, opt, lambda: state_tensor_bytes(opt.optim.state))


def build_methods(base: nn.Module, cfg: OptimConfig) -> list[OptimMethod]:
    """Every method of :data:`METHODS` (and the bucket sweep's), each on its own copy of
    ``base`` (same order on all ranks)."""
    def twin() -> nn.Module:
        return copy.deepcopy(base)

    none = cfg.set_to_none
    return [
        zero_method("zero_adamw", twin(), True, cfg.bucket_mb, none),
        *(zero_method(sweep_name(mb), twin(), True, mb, none) for mb in cfg.zero_bucket_mbs),
        zero_method("zero_adamw_nooverlap", twin(), False, cfg.bucket_mb, none),
        zero_method("zero_adamw_redundant", twin(), True, cfg.bucket_mb, none, redundant=True),
        *(zero_method(f"zero_adamw_redundant{k}", twin(), True, cfg.bucket_mb, none, redundant=k) for k in COPIES),
        fused_method("fused_adamw", twin(), none),
        ddp_adamw_method(DDP_BASELINE, twin(), none),
        torch_zero_method("torch_zero_adamw", twin(), none),
    ]


def sweep_name(mb: float) -> str:
    """The bucket sweep's row for ``bucket_mb=mb``."""
    return f"zero_adamw_{mb:g}mb"


def _norm(tensors: Any) -> float:
    return math.sqrt(sum(t.double().square().sum().item() for t in tensors))


def check_against_ddp(methods: list[OptimMethod], init: list[torch.Tensor],
                      x: torch.Tensor) -> dict[str, float]:
    """:data:`CHECK_STEPS` steps of each method; each one's ``||P - P_ddp|| / ||P_ddp||``
    (the largest over ranks), and under the key ``"update"`` ``||P_ddp - P_0|| / ||P_ddp||``,
    the difference a method that skipped its steps would show.

    Methods over :data:`PARAM_TOL` get ``skipped`` set, on every rank alike.
    """
    live = [m for m in methods if m.skipped is None]
    for m in live:
        for _ in range(CHECK_STEPS):
            m.train_step(x)
    ref = next(m for m in live if m.name == DDP_BASELINE).base.params
    with torch.no_grad():
        scale = _norm(ref) or 1.0
        rel = [_norm(p - r for p, r in zip(m.base.params, ref)) / scale for m in live]
        rel.append(_norm(r - i for r, i in zip(ref, init)) / scale)
    errs = torch.tensor(rel, dtype=torch.float64)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    errors = dict(zip([*(m.name for m in live), "update"], errs.tolist()))
    for m in live:
        if not errors[m.name] <= PARAM_TOL:  # NaN fails too
            m.skipped = (f"parameters off ddp_adamw's by {errors[m.name]:.1e} after {CHECK_STEPS} steps "
                         f"(> {PARAM_TOL:g}; the steps moved them by {errors['update']:.1e}): not timed")
    return errors


# ---------------------------------------------------------------- one rank

def optim_rank(rank: int, world: int, cfg: OptimConfig) -> dict[str, Any]:
    """Everything one rank does; module-level so :func:`run_ranks` can pickle it."""
    os.dup2(2, 1)  # a rank never writes to stdout: --json output must stay one object
    base = build_model(MODEL, cfg.params_m) if cfg.model == MODEL else build_gossip_model(cfg.params_m)
    x = batch_for(base, rank, cfg.batch)
    init = [p.detach().clone() for p in base.parameters()]
    methods = build_methods(base, cfg)
    errors = check_against_ddp(methods, init, x)
    live = [m for m in methods if m.skipped is None]
    times = time_round_robin([m.timed(x) for m in live], cfg.iters, 1, cfg.warmup_rounds)
    out = {"threads": torch.get_num_threads(), "times": times, "errors": errors,
           "skipped": {m.name: m.skipped for m in methods},
           "state_bytes": {m.name: m.state_bytes() for m in live},
           "info": {m.name: m.info() for m in methods},
           "width": base.in_features, "tensors": len(init), "numel": sum(t.numel() for t in init)}
    del methods, live
    gc.collect()
    return out


# ---------------------------------------------------------------- the report

def state_bound(plain: int, world: int, buckets: int, tensors: int) -> int:
    """Most state bytes per rank a sharded AdamW may keep: 1/N of plain AdamW's plus its
    share of the layout's padding (two fp32 states per padded element): up to N x 64
    elements per bucket and ALIGN - 1 per parameter tensor (each starts aligned), and
    one 4-byte step counter per bucket."""
    pad_elems = buckets * world * STATE_PAD_ELEMS + tensors * (ALIGN - 1)
    return plain // world + -(-2 * 4 * pad_elems // world) + 4 * buckets


def build_world(world: int, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    r0 = per_rank[0]
    times = [r["times"] for r in per_rank]
    plain = max(r["state_bytes"].get(PLAIN, 0) for r in per_rank)
    methods: dict[str, Any] = {}
    for name, skipped in r0["skipped"].items():  # METHODS, the sweep's after zero_adamw
        m: dict[str, Any] = {"median_ms": None, "p10_ms": None, "p90_ms": None, **r0["info"][name],
                             "param_err": r0["errors"].get(name), "skipped": skipped}
        if skipped is None:
            m.update(summary_ms(slowest_rank(times, name)))
            per = [r["state_bytes"][name] for r in per_rank]
            m.update(state_bytes=max(per), state_bytes_per_rank=per,
                     state_vs_plain=max(per) / plain if plain else None)
        methods[name] = m
    ddp = methods[DDP_BASELINE]["median_ms"]
    for m in methods.values():
        m["speedup_vs_ddp"] = ddp / m["median_ms"] if m["median_ms"] and ddp else None
    out: dict[str, Any] = {"ranks": world, "threads": r0["threads"], "methods": methods,
                           "plain_state_bytes": plain, "param_update": r0["errors"]["update"]}
    zero = methods["zero_adamw"]
    if zero["skipped"] is None and zero.get("buckets"):
        bound = state_bound(plain, world, zero["buckets"], zero["tensors"])
        out["state_bound"] = {"value": zero["state_bytes"], "limit": bound, "op": "<=",
                              "pass": zero["state_bytes"] <= bound, "plain": plain, "buckets": zero["buckets"],
                              "tensors": zero["tensors"],
                              "what": f"{world} ranks: zero_adamw state bytes/rank"}
    else:
        why = zero["skipped"] or "zero_adamw reports no bucket count"
        out["state_bound"] = {"value": None, "limit": None, "op": "<=", "pass": None, "what": why}
    return out


def build_report(cfg: OptimConfig, per_world: dict[int, list[dict[str, Any]]], seconds: float) -> dict[str, Any]:
    worlds = {str(n): build_world(n, per_rank) for n, per_rank in per_world.items()}
    r0 = next(iter(per_world.values()))[0]
    targets: dict[str, Any] = {}
    if str(TARGET_WORLD) in worlds:
        ms = worlds[str(TARGET_WORLD)]["methods"]
        for spec in TARGETS:
            name, num, den = spec[:3]
            missing = [n for n in (num, den) if ms[n]["median_ms"] is None]
            if missing:
                targets[name] = {"value": None, "limit": spec[4], "op": spec[3], "pass": None,
                                 "what": f"{TARGET_WORLD} ranks: {num} / {den}: not timed ({', '.join(missing)})"}
            else:
                targets.update(judge_ratios([spec], lambda n: ms[n]["median_ms"], where=f"{TARGET_WORLD} ranks: "))
    for n, w in worlds.items():
        targets[f"zero_state_bytes_{n}ranks"] = w["state_bound"]
    config = {**asdict(cfg), "lr": LR, "weight_decay": WEIGHT_DECAY,
              "check_steps": CHECK_STEPS, "param_tol": PARAM_TOL,
              "step": "forward + backward + reduce + AdamW step + zero_grad(set_to_none=False)",
              "step_time": "max over ranks per iteration", "wall_seconds": round(seconds, 1)}
    return {"config": config,
            "model": {"kind": cfg.model, "width": r0["width"], "tensors": r0["tensors"], "numel": r0["numel"]},
            "worlds": worlds, "targets": targets, "torch_version": torch.__version__, "machine": machine_info()}


def csv_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (world size, timed method), in the step suite's CSV columns (``model``
    is ``many@Nranks``; no ``mb_wire``)."""
    return [{"model": f"{report['model']['kind']}@{n}ranks", "method": name,
             **{k: m[k] for k in ("median_ms", "p10_ms", "p90_ms", "speedup_vs_ddp")}}
            for n, w in report["worlds"].items() for name, m in w["methods"].items() if m["median_ms"] is not None]


def _target_lines(targets: dict[str, dict[str, Any]], width: int) -> list[str]:
    lines = []
    for name, t in targets.items():
        if t["pass"] is None:
            lines.append(f"  SKIP  {name:<{width}}{t['what']}")
            continue
        value = f"{t['value']:.3f}" if isinstance(t["value"], float) else str(t["value"])
        lines.append(f"  {'PASS' if t['pass'] else 'FAIL'}  {name:<{width}}{t['what']} = {value} "
                     f"({t['op']} {t['limit']})")
    return lines


def format_text(report: dict[str, Any]) -> str:
    c, mod = report["config"], report["model"]
    zero = "zero_grad(set_to_none=True)" if c["set_to_none"] else "zero_grad"
    lines = [f"optim suite (forward + backward + reduce + AdamW step + {zero}): model {mod['kind']}: "
             f"{mod['numel'] / 1e6:.2f}M fp32 params in {mod['tensors']} tensors (width {mod['width']}), "
             f"batch {c['batch']}/rank, {c['iters']} timed steps/method (round-robin), step = slowest rank; "
             f"AdamW lr {LR:g}, weight decay {WEIGHT_DECAY:g}"]
    for n, w in report["worlds"].items():
        lines += ["", f"{n} Gloo ranks x {w['threads']} thread(s); plain AdamW state "
                      f"{w['plain_state_bytes'] / 1e6:.1f} MB/rank",
                  f"{'method':<23}{'median ms':>10}{'p10':>9}{'p90':>9}{'state MB':>10}{'vs plain':>9}"
                  f"{'buckets':>8}{'vs DDP':>8}  notes"]
        for name, m in w["methods"].items():
            buckets = "-" if m.get("buckets") is None else str(m["buckets"])
            if m["skipped"] is not None:
                lines.append(f"{name:<23}{'-':>10}{'-':>9}{'-':>9}{'-':>10}{'-':>9}{buckets:>8}{'-':>8}  "
                             f"skipped: {m['skipped']}")
                continue
            notes = [f"via {m['transport']}"] if m.get("transport") else []
            if m.get("inner_state_bytes") not in (None, m["state_bytes"]):
                notes.append(f"state_bytes() {m['state_bytes']} B but inner state tensors "
                             f"{m['inner_state_bytes']} B")
            if name != DDP_BASELINE:
                notes.append(f"param diff {m['param_err']:.1e}")
            else:
                notes.append(f"reference; its {CHECK_STEPS} steps moved params {w['param_update']:.1e}")
            ratio = f"{m['state_vs_plain']:.3f}" if m["state_vs_plain"] is not None else "-"
            lines.append(f"{name:<23}{m['median_ms']:>10.2f}{m['p10_ms']:>9.2f}{m['p90_ms']:>9.2f}"
                         f"{m['state_bytes'] / 1e6:>10.2f}{ratio:>9}{buckets:>8}{m['speedup_vs_ddp']:>7.2f}x  "
                         f"{', '.join(notes)}")
        b = w["state_bound"]
        if b["pass"] is not None:
            pad = b["limit"] - b["plain"] // int(n)
            lines.append(f"zero_adamw state: {b['value']} B/rank <= plain/N + padding share "
                         f"(2*4*({b['buckets']} buckets*{n}*{STATE_PAD_ELEMS} + {b['tensors']} tensors*{ALIGN - 1})/{n}"
                         f" + 4*{b['buckets']}) = {b['plain'] // int(n)} + {pad} = {b['limit']} B")
    lines.append(f"(param diff: ||P - P_ddp|| / ||P_ddp|| after {CHECK_STEPS} steps, all parameters, "
                 f"largest over ranks; above {PARAM_TOL:g} a method is not timed)")
    if c["quick"]:
        lines.append("(--quick: a tiny model proves the benchmark runs; fixed per-call costs "
                     "dominate its timings, so the targets mean little)")
    lines += ["", "targets (report only):"] + _target_lines(report["targets"], width=25)
    return "\n".join(lines)


def run_optim_bench(cfg: OptimConfig) -> dict[str, Any]:
    """Spawn the ranks for each world size, time every method, and return the report (JSON-able)."""
    t0 = time.perf_counter()
    per_world = {n: run_ranks(optim_rank, n, cfg, threads=cfg.threads,
                              timeout=180.0 if cfg.quick else 1800.0)
                 for n in cfg.world_sizes}
    return build_report(cfg, per_world, time.perf_counter() - t0)
