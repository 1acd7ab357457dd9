"""``fastreduce bench decentralized``: gossip training steps against the reducers and decent-dp.

Real Gloo ranks time whole training steps (forward + backward + the mode's update:
AdamW in every method, as users write it, ``torch.optim.AdamW(params, lr)``; with
``optimizer="fused"``, ``--gossip-optimizer fused``, its fastest kernel) on a stack of ``Linear(w, w) + LayerNorm(w)``
blocks (48 of width 512 by default: 12.66M parameters), batch 32, at each world size of
``--gossip-ranks`` (default 2 and 4):

=========================  ==============================================================
 ``no_comm``                forward, backward, AdamW step, zero_grad: no communication (the
                            floor)
 ``no_comm_fused``          the same with ``AdamW(fused=True)`` (plain runs only): the
                            kernel the gossip mode's optimizers step with when ``optim_fn``
                            chose none (:mod:`fastreduce.optim_kernels`), like against like
 ``fused_fp32``             ``FusedReducer(wire_dtype=None)`` + AdamW
 ``overlap_fp32``           ``FusedReducer(wire_dtype=None, overlap=True)`` + AdamW
 ``gossip_<topology>``      ``DecentralizedDataParallel(model, AdamW per bucket, topology)``
                            for ``complete``, ``ring`` and ``one-peer-exp``: each bucket
                            mixes, steps and sends from its backward hook
 ``gossip_one-peer-exp_fp8`` the same on ``one-peer-exp`` with an fp8 (e4m3) wire: each
                            peer gets the quantized difference from the public copy both
                            keep (CHOCO-SGD), point to point
 ``decentdp_<topology>``    decent-dp's ``DecentralizedDataParallel`` (the same AdamW per
                            bucket), for ``complete`` and ``one-peer-exp``, where
                            ``decent_dp`` imports (``pip install decent-dp==0.2.3``)
=========================  ==============================================================

A gossip step's exchange finishes during the next step's compute, so a single step
timed between other methods would have its communication hidden by them. Each timed
call is therefore a block of :data:`BLOCK` consecutive steps of one method, the gossip
ones ending with every exchange waited for, and the figure is the block's time per
step (the slowest rank's; blocks interleaved round-robin).

Targets (reported, never enforced): at 2 ranks ``gossip_complete`` at most 1.15x
``no_comm``; at every world size, each topology at least 1.3x faster than decent-dp's.
"""

from __future__ import annotations

import copy
import gc
import math
import os
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Callable

import torch
from torch import nn

from ..launch import run_ranks
from ..modes.fused import FusedReducer
from ..modes.gossip import DecentralizedDataParallel
from ..optim_kernels import fused_if_possible
from .common import Method, machine_info, slowest_rank, summary_ms, time_round_robin
from .report import judge_ratios, target_lines

__all__ = ["GossipConfig", "format_text", "run_gossip_bench"]

BLOCK = 4
LR = 1e-4
BLOCKS = 48
DEFAULT_PARAMS_M = 12.66  # 48 x (Linear 512 + LayerNorm 512)
DEFAULT_BATCH = 32
TOPOLOGIES = ("complete", "ring", "one-peer-exp")
PEER_TOPOLOGIES = ("complete", "one-peer-exp")  # decent-dp's, timed where it imports
REFERENCE = "no_comm"
FUSED_REFERENCE = "no_comm_fused"  # the same step with AdamW(fused=True), where torch has it
TARGET_WORLD = 2
HIDDEN = ("gossip_hidden", "gossip_complete", REFERENCE, "<=", 1.15)  # at TARGET_WORLD ranks
VS_PEER = 1 / 1.3  # gossip / decent-dp, every topology and world size


@dataclass(frozen=True)
class GossipConfig:
    """What to run: ``iters`` timed blocks per method and world size."""

    world_sizes: tuple[int, ...] = (2, 4)
    iters: int = 10
    params_m: float = DEFAULT_PARAMS_M
    batch: int = DEFAULT_BATCH
    threads: int | None = None
    quick: bool = False
    warmup_rounds: int = 1
    optimizer: str = "plain"  # torch.optim.AdamW(params, lr); "fused": fused=True where torch has it


class BlockNet(nn.Sequential):
    """``blocks`` x (``Linear(w, w)``, ``LayerNorm(w)``): ``4 * blocks`` tensors."""

    def __init__(self, width: int, blocks: int = BLOCKS):
        super().__init__(*(m for _ in range(blocks) for m in (nn.Linear(width, width), nn.LayerNorm(width))))
        self.in_features = width


def build_gossip_model(params_m: float) -> BlockNet:
    """About ``params_m`` million parameters (width a multiple of 8), the same on every rank."""
    per_block = params_m * 1e6 / BLOCKS  # w^2 + 3w
    width = max(8, round((-3 + math.sqrt(9 + 4 * per_block)) / 2 / 8) * 8)
    torch.manual_seed(0)
    return BlockNet(width)


def _adamw_of(params: list[nn.Parameter], kind: str = "plain") -> torch.optim.AdamW:
    """AdamW as users write it, or (``kind="fused"``) with fused=True where torch has it."""
    fused = fused_if_possible(torch.optim.AdamW, params, {}) if kind == "fused" else {}
    return torch.optim.AdamW(params, lr=LR, **fused)


def _decent_dp() -> Any:
    """decent-dp's ``DecentralizedDataParallel``, or ``None`` where it is not installed."""
    try:
        from decent_dp.ddp import DecentralizedDataParallel as PeerDDP
    except ImportError:
        return None
    try:  # its per-rank DEBUG lines would drown the report
        from loguru import logger
        logger.disable("decent_dp")
    except ImportError:
        pass
    return PeerDDP


def _block(step: Callable[[], None], end: Callable[[], None] = lambda: None) -> Callable[[], None]:
    def run() -> None:
        for _ in range(BLOCK):
            step()
        end()
    return run


def build_methods(base: nn.Module, x: torch.Tensor, optimizer: str = "plain"
                  ) -> tuple[list[Method], dict[str, dict[str, Any]]]:
    methods, info = [], {}
    _adamw = partial(_adamw_of, kind=optimizer)
    loss = lambda out: out.square().mean()  # noqa: E731 - the step suite's loss

    plain = copy.deepcopy(base)
    opt = _adamw(list(plain.parameters()))

    def no_comm() -> None:
        loss(plain(x)).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    methods.append(Method(REFERENCE, _block(no_comm)))
    if optimizer == "plain":  # what gossip steps with when optim_fn chose no kernel: like against like
        fused = copy.deepcopy(base)
        fopt = _adamw_of(list(fused.parameters()), "fused")

        def no_comm_fused() -> None:
            loss(fused(x)).backward()
            fopt.step()
            fopt.zero_grad(set_to_none=False)
        methods.append(Method(FUSED_REFERENCE, _block(no_comm_fused)))

    for name, overlap in (("fused_fp32", False), ("overlap_fp32", True)):
        model = copy.deepcopy(base)
        reducer = FusedReducer(model, wire_dtype=None, overlap=overlap)
        ropt = _adamw(list(model.parameters()))

        def step(model=model, reducer=reducer, ropt=ropt) -> None:
            loss(model(x)).backward()
            reducer.reduce()
            ropt.step()
            reducer.zero_grad()
        methods.append(Method(name, _block(step)))
        info[name] = {"reducer": reducer}

    for topo in TOPOLOGIES:
        ddp = DecentralizedDataParallel(copy.deepcopy(base), lambda named: _adamw([p for _, p in named]),
                                        topology=topo)

        def gstep(ddp=ddp) -> None:
            loss(ddp(x)).backward()
        methods.append(Method(f"gossip_{topo}", _block(gstep, ddp.wait_exchanges)))
        info[f"gossip_{topo}"] = {"ddp": ddp}

    ddp = DecentralizedDataParallel(copy.deepcopy(base), lambda named: _adamw([p for _, p in named]),
                                    topology="one-peer-exp", wire_dtype=torch.float8_e4m3fn)  # CHOCO's copies

    def qstep(ddp=ddp) -> None:
        loss(ddp(x)).backward()
    methods.append(Method("gossip_one-peer-exp_fp8", _block(qstep, ddp.wait_exchanges)))
    info["gossip_one-peer-exp_fp8"] = {"ddp": ddp}

    PeerDDP = _decent_dp()
    for topo in PEER_TOPOLOGIES if PeerDDP is not None else ():
        peer = PeerDDP(copy.deepcopy(base), lambda named: _adamw([p for _, p in named]), topology=topo)

        def pstep(peer=peer) -> None:
            loss(peer(x)).backward()

        def pwait(peer=peer) -> None:  # its exchanges in flight (it has no public wait)
            for op in peer._comm_ops:
                if op is not None:
                    op.wait()
        methods.append(Method(f"decentdp_{topo}", _block(pstep, pwait)))
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
                         "consensus": d.consensus_distance(),
                         "kernel": "fused" if d._optims[0].param_groups[0].get("fused") else "torch's default"}
    return out


def gossip_rank(rank: int, world: int, cfg: GossipConfig) -> dict[str, Any]:
    os.dup2(2, 1)  # stdout stays the report's
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    base = build_gossip_model(cfg.params_m)
    x = torch.randn(cfg.batch, base.in_features, generator=torch.Generator().manual_seed(1000 + rank))
    methods, info = build_methods(base, x, cfg.optimizer)
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
    report["targets"] = {}
    for world, w in report["worlds"].items():
        ms = w["methods"]
        specs = [HIDDEN] if world == str(TARGET_WORLD) else []
        specs += [(f"vs_decentdp_{topo}_{world}r", f"gossip_{topo}", f"decentdp_{topo}", "<=", round(VS_PEER, 3))
                  for topo in PEER_TOPOLOGIES if f"decentdp_{topo}" in ms]
        report["targets"].update(judge_ratios(specs, lambda n: ms[n]["median_ms"], f"{world} ranks: "))
    if not any(name.startswith("decentdp_") for w in report["worlds"].values() for name in w["methods"]):
        report["note"] = "decent-dp not installed: pip install decent-dp==0.2.3 to time it side by side"
    return report


def format_text(report: dict[str, Any]) -> str:
    lines = [f"decentralized suite (forward + backward + the mode's AdamW step ({report['config']['optimizer']}), "
             f"blocks of {report['block']} "
             f"steps, gossip exchanges waited at each block's end): {BLOCKS} x (Linear + LayerNorm), "
             f"batch {report['config']['batch']}"]
    for world, w in report["worlds"].items():
        lines += ["", f"{world} Gloo ranks x {w['threads']} thread(s), {w['numel'] / 1e6:.2f}M fp32 params",
                  f"{'method':<24}{'median ms':>10}{'p10':>9}{'p90':>9}{'vs no_comm':>11}  notes"]
        for name, m in w["methods"].items():
            notes = []
            if "transport" in m:
                notes.append(f"via {m['transport']}, {m['buckets']} bucket(s)")
            if "period" in m:
                notes.append(f"{m['buckets']} bucket(s), period {m['period']}, consensus distance "
                             f"{m['consensus']:.1e}, {m['kernel']} AdamW")
            lines.append(f"{name:<24}{m['median_ms']:>10.2f}{m['p10_ms']:>9.2f}{m['p90_ms']:>9.2f}"
                         f"{m['vs_no_comm']:>10.2f}x  {', '.join(notes)}")
        ms = w["methods"]
        if FUSED_REFERENCE in ms and "gossip_complete" in ms:
            lines.append(f"like against like (fused AdamW on both sides): gossip_complete / {FUSED_REFERENCE} = "
                         f"{ms['gossip_complete']['median_ms'] / ms[FUSED_REFERENCE]['median_ms']:.3f}")
    if report.get("note"):
        lines += ["", report["note"]]
    if report["targets"]:
        lines += ["", "targets (report only):", *target_lines(report["targets"])]
    return "\n".join(lines)
