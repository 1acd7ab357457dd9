"""``fastreduce bench --suite decentralized``: gossip training steps against the reducers.

Real Gloo ranks time whole training steps (forward + backward + the mode's update:
SGD with momentum 0.9 in every method, its fastest kernel) on the step suite's ``many``
model, at each world size of ``--gossip-ranks`` (default 2 and 4):

=========================  ==============================================================
 ``no_comm``                forward, backward, SGD step, zero_grad: no communication (the
                            floor)
 ``fused_fp32``             ``FusedReducer(wire_dtype=None)`` + SGD
 ``overlap_fp32``           ``FusedReducer(wire_dtype=None, overlap=True)`` + SGD
 ``gossip_<topology>``      ``DecentralizedDataParallel(model, SGD per bucket, topology)``
                            for ``complete``, ``ring`` and ``one-peer-exp``: each bucket
                            mixes, steps and sends from its backward hook
=========================  ==============================================================

A gossip step's exchange finishes during the next step's compute, so a single step
timed between other methods would have its communication hidden by them. Each timed
call is therefore a block of :data:`BLOCK` consecutive steps of one method, the gossip
ones ending with every exchange waited for, and the figure is the block's time per
step (the slowest rank's; blocks interleaved round-robin).

Target (reported, never enforced), at 2 ranks: ``gossip_one-peer-exp`` at most 1.1x
``no_comm`` (the exchange hidden behind compute).
"""

from __future__ import annotations

import copy
import gc
import os
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..launch import run_ranks
from ..modes.fused import FusedReducer
from ..modes.gossip import DecentralizedDataParallel
from ..modes.zero_shard import fused_if_possible
from .common import Method, machine_info, slowest_rank, summary_ms, time_round_robin
from .report import judge_ratios, target_lines
from .step import batch_for, build_model

__all__ = ["GossipConfig", "format_text", "run_gossip_bench"]

BLOCK = 4
LR, MOMENTUM = 1e-3, 0.9
TOPOLOGIES = ("complete", "ring", "one-peer-exp")
REFERENCE = "no_comm"
TARGETS = (("gossip_hidden", "gossip_one-peer-exp", REFERENCE, "<=", 1.1),)
TARGET_WORLD = 2


@dataclass(frozen=True)
class GossipConfig:
    """What to run: ``iters`` timed blocks per method and world size."""

    world_sizes: tuple[int, ...] = (2, 4)
    iters: int = 10
    params_m: float = 12.0
    batch: int = 64
    threads: int | None = None
    quick: bool = False
    warmup_rounds: int = 1


def _sgd(params: list[nn.Parameter]) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM,
                           **(fused_if_possible(torch.optim.SGD, params, {}) or {"foreach": True}))


def _block(step: Callable[[], None], end: Callable[[], None] = lambda: None) -> Callable[[], None]:
    def run() -> None:
        for _ in range(BLOCK):
            step()
        end()
    return run


def build_methods(base: nn.Module, x: torch.Tensor) -> tuple[list[Method], dict[str, dict[str, Any]]]:
    methods, info = [], {}
    loss = lambda out: out.square().mean()  # noqa: E731 - the step suite's loss

    plain = copy.deepcopy(base)
    opt = _sgd(list(plain.parameters()))

    def no_comm() -> None:
        loss(plain(x)).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    methods.append(Method(REFERENCE, _block(no_comm)))

    for name, overlap in (("fused_fp32", False), ("overlap_fp32", True)):
        model = copy.deepcopy(base)
        reducer = FusedReducer(model, wire_dtype=None, overlap=overlap)
        ropt = _sgd(list(model.parameters()))

        def step(model=model, reducer=reducer, ropt=ropt) -> None:
            loss(model(x)).backward()
            reducer.reduce()
            ropt.step()
            reducer.zero_grad()
        methods.append(Method(name, _block(step)))
        info[name] = {"reducer": reducer}

    for topo in TOPOLOGIES:
        ddp = DecentralizedDataParallel(copy.deepcopy(base), lambda named: _sgd([p for _, p in named]),
                                        topology=topo)

        def gstep(ddp=ddp) -> None:
            loss(ddp(x)).backward()
        methods.append(Method(f"gossip_{topo}", _block(gstep, ddp.wait_exchanges)))
        info[f"gossip_{topo}"] = {"ddp": ddp}
    return methods, info


def _describe(info: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, obj in info.items():
        if "reducer" in obj:
            r = obj["reducer"]
            out[name] = {"buckets": r.num_buckets,
                         "transport": "shm" if r._built and r._built.plan.shm is not None else "gloo"}
        else:
            d = obj["ddp"]
            out[name] = {"buckets": d.num_buckets, "period": d.topology.period,
                         "consensus": d.consensus_distance()}
    return out


def gossip_rank(rank: int, world: int, cfg: GossipConfig) -> dict[str, Any]:
    os.dup2(2, 1)  # stdout stays the report's
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    base = build_model("many", cfg.params_m)
    x = batch_for(base, rank, cfg.batch)
    methods, info = build_methods(base, x)
    times = time_round_robin(methods, cfg.iters, 1, cfg.warmup_rounds)
    times = {k: [t / BLOCK for t in v] for k, v in times.items()}
    out = {"times": times, "info": _describe(info), "threads": torch.get_num_threads(),
           "numel": sum(p.numel() for p in base.parameters())}
    del methods, info
    gc.collect()
    return out


def run_gossip_bench(cfg: GossipConfig) -> dict[str, Any]:
    report: dict[str, Any] = {"config": asdict(cfg), "machine": machine_info(), "block": BLOCK, "worlds": {}}
    for world in cfg.world_sizes:
        per_rank = run_ranks(gossip_rank, world, cfg, timeout=1800.0, threads=cfg.threads)
        names = list(per_rank[0]["times"])
        methods = {n: {**summary_ms(slowest_rank([r["times"] for r in per_rank], n)), **per_rank[0]["info"].get(n, {})}
                   for n in names}
        ref = methods[REFERENCE]["median_ms"]
        for m in methods.values():
            m["vs_no_comm"] = m["median_ms"] / ref
        report["worlds"][str(world)] = {"methods": methods, "threads": per_rank[0]["threads"],
                                        "numel": per_rank[0]["numel"]}
    if str(TARGET_WORLD) in report["worlds"]:
        ms = report["worlds"][str(TARGET_WORLD)]["methods"]
        report["targets"] = judge_ratios(TARGETS, lambda n: ms[n]["median_ms"], f"{TARGET_WORLD} ranks: ")
    else:
        report["targets"] = {}
    return report


def format_text(report: dict[str, Any]) -> str:
    lines = [f"decentralized suite (forward + backward + the mode's SGD step, blocks of {report['block']} "
             "steps, gossip exchanges waited at each block's end): model many"]
    for world, w in report["worlds"].items():
        lines += ["", f"{world} Gloo ranks x {w['threads']} thread(s), {w['numel'] / 1e6:.2f}M fp32 params",
                  f"{'method':<24}{'median ms':>10}{'p10':>9}{'p90':>9}{'vs no_comm':>11}  notes"]
        for name, m in w["methods"].items():
            notes = []
            if "transport" in m:
                notes.append(f"via {m['transport']}, {m['buckets']} bucket(s)")
            if "period" in m:
                notes.append(f"{m['buckets']} buckets, period {m['period']}, consensus distance "
                             f"{m['consensus']:.1e}")
            lines.append(f"{name:<24}{m['median_ms']:>10.2f}{m['p10_ms']:>9.2f}{m['p90_ms']:>9.2f}"
                         f"{m['vs_no_comm']:>10.2f}x  {', '.join(notes)}")
    if report["targets"]:
        lines += ["", "targets (report only):", *target_lines(report["targets"])]
    return "\n".join(lines)
