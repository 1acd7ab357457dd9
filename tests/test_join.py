"""Uneven inputs: every mode under torch.distributed.algorithms.Join, on real Gloo ranks.

Each rank trains on its own number of batches (one rank 3 fewer; in the 3-rank group
two ranks short, by different amounts) inside ``Join``; no rank may hang (every spawn
has a timeout) and the final parameters must equal a real reference: torch DDP (and
torch's ZeroRedundancyOptimizer) under ``Join``, or, for the modes torch has no
counterpart of, a plain loop that averages over the ranks still active. Both
transports run here (each worker pins ``$FASTREDUCE_TRANSPORT``), so the file is not in
the Makefile's TRANSPORT_SUITES. One spawn per (world, transport) runs every sub-case.
"""

from __future__ import annotations

import os
import traceback
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close

import fastreduce
from fastreduce.launch import run_ranks
from test_fused import spawn_once

pytestmark = pytest.mark.timeout(240)

SPAWN_TIMEOUT = 150.0
TRANSPORTS = ("shm", "process_group")
LR = 0.1
COUNTS = {2: [6, 3], 3: [6, 3, 4]}  # batches per rank: rank 1 has 3 fewer; at 3 ranks rank 2 has 2 fewer


# ============================================================== helpers run in ranks

def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank + 17)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def loss_on(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = batch(rank, step)
    return ((model(x) - y) ** 2).mean()


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def guarded(fn: Callable[..., Any], *args: Any) -> dict:
    try:
        return {"ok": fn(*args)}
    except Exception:  # noqa: BLE001 - reported to the parent test
        return {"error": traceback.format_exc()}


class CountAllReduce:
    """Counts ``dist.all_reduce`` calls (every mode and Join reach it through the module)."""

    def __init__(self) -> None:
        self.calls = 0
        self.orig = dist.all_reduce

    def __enter__(self) -> CountAllReduce:
        def counting(*a: Any, **k: Any) -> Any:
            self.calls += 1
            return self.orig(*a, **k)
        dist.all_reduce = counting
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_reduce = self.orig


# -------------------------------------------------------------- fused / overlap

def train_reducer(rank: int, n: int, overlap: bool, divide: bool, accumulate: int = 1,
                  powersgd: bool = False) -> list[torch.Tensor]:
    model = make_model()
    # full-rank PowerSGD without error feedback is the exact mean: under Join a joined rank's shadow must issue
    # its P and Q collectives (with error feedback the joined rank's last residual is dropped: not DDP's result)
    comp = {"compression": fastreduce.PowerSGD(10**6, min_compression_rate=0, error_feedback=False)} if powersgd else {}
    reducer = fastreduce.FusedReducer(model, wire_dtype=torch.float32, overlap=overlap, **comp)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    with Join([reducer], divide_by_initial_world_size=divide):
        for s in range(n):
            for m in range(accumulate - 1):
                with reducer.no_sync():
                    loss_on(model, rank, 100 * s + m).backward()
            loss_on(model, rank, 100 * s + accumulate - 1).backward()
            reducer.reduce()
            opt.step()
            opt.zero_grad()
    return params(model)


def train_ddp(rank: int, n: int, divide: bool, accumulate: int = 1) -> list[torch.Tensor]:
    model = make_model()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    with Join([ddp], divide_by_initial_world_size=divide):
        for s in range(n):
            for m in range(accumulate - 1):
                with ddp.no_sync():
                    loss_on(ddp, rank, 100 * s + m).backward()
            loss_on(ddp, rank, 100 * s + accumulate - 1).backward()
            opt.step()
            opt.zero_grad()
    return params(model)


def case_reducer(rank: int, counts: list[int], overlap: bool, divide: bool, accumulate: int,
                 powersgd: bool = False) -> dict:
    return {"ours": train_reducer(rank, counts[rank], overlap, divide, accumulate, powersgd),
            "ref": train_ddp(rank, counts[rank], divide, accumulate)}


def case_functional(rank: int, counts: list[int]) -> dict:
    """all_reduce_gradients(model) under Join([gradient_reducer(model)])."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    with Join([fastreduce.gradient_reducer(model, torch.float32)]):
        for s in range(counts[rank]):
            loss_on(model, rank, 100 * s).backward()
            fastreduce.all_reduce_gradients(model, torch.float32)
            opt.step()
            opt.zero_grad()
    return {"ours": params(model), "ref": train_ddp(rank, counts[rank], False)}


def case_throw(rank: int, counts: list[int], overlap: bool) -> dict:
    """throw_on_early_termination=True: every rank raises (as DDP's Join does)."""
    model = make_model()
    reducer = fastreduce.FusedReducer(model, wire_dtype=torch.float32, overlap=overlap)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    try:
        with Join([reducer], throw_on_early_termination=True):
            for s in range(counts[rank]):
                loss_on(model, rank, s).backward()
                reducer.reduce()
                opt.step()
                opt.zero_grad()
    except RuntimeError as e:
        return {"raised": str(e)}
    return {"raised": None}


def case_no_extra(rank: int, counts: list[int], overlap: bool) -> dict:
    """Not under Join (before and after one): the reducer's all-reduces are its gradient
    collectives only; under Join each step adds exactly the notify. (A fixed bucket size:
    bucket_mb="auto" adds its refresh's one all-reduce after 8 steps, test_sizing.py.)"""
    model = make_model()
    reducer = fastreduce.FusedReducer(model, wire_dtype=torch.float32, overlap=overlap, bucket_mb=6)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def steps(k: int, offset: int) -> tuple[int, int]:
        before = reducer.stats.collectives
        with CountAllReduce() as c:
            for s in range(k):
                loss_on(model, rank, offset + s).backward()
                reducer.reduce()
                opt.step()
                opt.zero_grad()
        return c.calls, reducer.stats.collectives - before

    steps(1, 0)  # learns the layout
    plain = steps(3, 1)
    with Join([reducer]):
        joined = steps(3, 10)
    after = steps(3, 20)
    grad_ars = 0 if reducer._built.plan.shm is not None else 1  # dist.all_reduce per gradient collective
    return {"plain": plain, "joined": joined, "after": after, "grad_ars": grad_ars}


# -------------------------------------------------------------- plain references (every rank computes all)

def local_grads(model: nn.Module, rank: int, step: int) -> list[torch.Tensor]:
    model.zero_grad()
    loss_on(model, rank, step).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def reference_sync(world: int, counts: list[int], divide: bool, make_opt: Callable, clip: float | None = None,
                   seed: int = 0) -> list[torch.Tensor]:
    """Synchronous data parallel on uneven inputs, in one process: each step the
    gradients of the ranks that still have a batch, summed and divided by their number
    (or by the world), then one optimizer step."""
    model = make_model(seed)
    opt = make_opt(model.parameters())
    for s in range(max(counts)):
        active = [r for r in range(world) if counts[r] > s]
        per_rank = [local_grads(model, r, 100 * s) for r in active]
        for k, p in enumerate(model.parameters()):
            p.grad = sum(g[k] for g in per_rank) / (world if divide else len(active))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip)
        opt.step()
    return params(model)


def sgd(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(ps, lr=LR, momentum=0.9)


def adamw(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)


def case_two_reducers(rank: int, world: int, counts: list[int], built: bool = False) -> dict:
    """Two joinables in one Join (two models, one loss): the second counts the active
    ranks with an all-reduce of its own, which its hook matches on the joined ranks.
    Listed in the order they communicate (the overlapped one during backward). ``built``:
    the first step (every rank active) runs before the Join, so the overlapped reducer was
    built outside it (on shared memory as the fused step: one bucket) and must be built again."""
    a, b = make_model(0), make_model(1)
    ra = fastreduce.FusedReducer(a, wire_dtype=torch.float32)
    rb = fastreduce.FusedReducer(b, wire_dtype=torch.float32, overlap=True)
    opt = sgd(list(a.parameters()) + list(b.parameters()))

    def step(s: int) -> None:
        (loss_on(a, rank, 100 * s) + loss_on(b, rank, 100 * s)).backward()
        ra.reduce()
        rb.reduce()
        opt.step()
        opt.zero_grad()
    if built:
        step(0)
    with Join([rb, ra]):
        for s in range(int(built), counts[rank]):
            step(s)
    return {"ours": params(a) + params(b),
            "ref": reference_sync(world, counts, False, sgd) + reference_sync(world, counts, False, sgd, seed=1)}


# -------------------------------------------------------------- ZeRO

def case_zero(rank: int, world: int, counts: list[int], overlap: bool, divide: bool, clip: float | None) -> dict:
    model = make_model()
    opt = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01, weight_decay=0.1,
                                   wire_dtype=torch.float32, overlap=overlap)
    with Join([opt], divide_by_initial_world_size=divide):
        for s in range(counts[rank]):
            loss_on(model, rank, 100 * s).backward()
            if clip is not None:
                opt.clip_grad_norm_(clip)
            opt.step()
            opt.zero_grad(set_to_none=False)
    return {"ours": params(model), "ref": reference_sync(world, counts, divide, adamw, clip)}


# -------------------------------------------------------------- gossip

def case_gossip(rank: int, world: int, counts: list[int], topology: str) -> dict:
    model = make_model()
    ddp = fastreduce.DecentralizedDataParallel(model, lambda named: sgd([p for _, p in named]), topology=topology)
    with Join([ddp]):
        for s in range(counts[rank]):
            loss_on(ddp, rank, 100 * s).backward()
    ours = params(model)
    # Reference: every rank's model in one process. Rank r's step k+1: gradient at its
    # parameters p_k, parameters := sum_j W_{k-1}[r, j] p_k(j) (from step 2 on), then its
    # optimizer steps with that gradient; a rank out of batches only mixes.
    topo = fastreduce.modes.topology.make_topology(topology, world, world)
    models = [make_model() for _ in range(world)]
    opts = [sgd(m.parameters()) for m in models]
    for k in range(max(counts)):
        grads = [local_grads(models[r], r, 100 * k) if counts[r] > k else None for r in range(world)]
        if k > 0:
            W = topo.mixing(k - 1).double()
            flat = torch.stack([torch.cat([p.detach().reshape(-1).double() for p in m.parameters()])
                                for m in models])
            mixed = (W @ flat).float()
            for r, m in enumerate(models):
                torch.nn.utils.vector_to_parameters(mixed[r], m.parameters())
        for r, m in enumerate(models):
            if grads[r] is not None:
                for p, g in zip(m.parameters(), grads[r]):
                    p.grad = g
                opts[r].step()
    return {"ours": ours, "ref": params(models[rank])}


# -------------------------------------------------------------- LocalSGD / DiLoCo

def case_local(rank: int, world: int, counts: list[int], H: int, warmup: int, divide: bool) -> dict:
    model = make_model()
    opt = sgd(model.parameters())
    mode = fastreduce.LocalSGD(model, opt, sync_every=H, warmup_steps=warmup)
    with Join([mode], divide_by_initial_world_size=divide):
        for s in range(counts[rank]):
            loss_on(model, rank, 100 * s).backward()
            opt.step()
            opt.zero_grad()
    # Reference: per-rank models; warm-up steps average the active ranks' gradients (by
    # their number, or the world's under divide); then local steps, and every H steps
    # the parameters := their mean over the active ranks, on every rank.
    models = [make_model() for _ in range(world)]
    opts = [sgd(m.parameters()) for m in models]
    for k in range(max(counts)):
        active = [r for r in range(world) if counts[r] > k]
        grads = {r: local_grads(models[r], r, 100 * k) for r in active}
        if k < warmup:
            mean = [sum(grads[r][i] for r in active) / (world if divide else len(active))
                    for i in range(len(grads[active[0]]))]
            grads = {r: mean for r in active}
        for r in active:
            for p, g in zip(models[r].parameters(), grads[r]):
                p.grad = g
            opts[r].step()
        if k + 1 > warmup and (k + 1 - warmup) % H == 0:
            for ps in zip(*(m.parameters() for m in models)):
                avg = sum(ps[r].detach() for r in active) / len(active)
                for p in ps:
                    p.data.copy_(avg)
    return {"ours": params(model), "ref": params(models[rank])}


def case_diloco(rank: int, world: int, counts: list[int], H: int, divide: bool) -> dict:
    model = make_model()
    inner = sgd(model.parameters())
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    mode = fastreduce.DiLoCo(model, inner, outer, sync_every=H, wire_dtype=torch.float32)
    with Join([mode], divide_by_initial_world_size=divide):
        for s in range(counts[rank]):
            loss_on(model, rank, 100 * s).backward()
            inner.step()
            inner.zero_grad()
    # Reference (the paper's equations): inner steps on the active ranks; every H steps
    # the pseudo-gradient anchor - x averaged over the active ranks (or divided by the
    # world), an outer step from the anchor, and every rank restarts from the result.
    models = [make_model() for _ in range(world)]
    inners = [sgd(m.parameters()) for m in models]
    anchor = make_model()
    outer_ref = torch.optim.SGD(anchor.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    for k in range(max(counts)):
        active = [r for r in range(world) if counts[r] > k]
        for r in active:
            for p, g in zip(models[r].parameters(), local_grads(models[r], r, 100 * k)):
                p.grad = g
            inners[r].step()
        if (k + 1) % H == 0:
            for i, a in enumerate(anchor.parameters()):
                deltas = [a.detach() - list(models[r].parameters())[i].detach() for r in active]
                a.grad = sum(deltas) / (world if divide else len(active))
            outer_ref.step()
            for m in models:
                for p, a in zip(m.parameters(), anchor.parameters()):
                    p.data.copy_(a.detach())
    return {"ours": params(model), "ref": params(models[rank])}


# ============================================================== workers

def worker(rank: int, world: int, transport: str) -> dict:
    os.environ["FASTREDUCE_TRANSPORT"] = transport
    counts = COUNTS[world]
    out: dict[str, Any] = {}
    for overlap in (False, True):
        for divide in (False, True):
            out[("reducer", overlap, divide)] = guarded(case_reducer, rank, counts, overlap, divide, 1)
        out[("accumulate", overlap)] = guarded(case_reducer, rank, counts, overlap, False, 2)
        out[("powersgd", overlap)] = guarded(case_reducer, rank, counts, overlap, False, 1, True)
        out[("throw", overlap)] = guarded(case_throw, rank, counts, overlap)
        out[("no_extra", overlap)] = guarded(case_no_extra, rank, counts, overlap)
    out[("functional",)] = guarded(case_functional, rank, counts)
    out[("two_reducers",)] = guarded(case_two_reducers, rank, world, counts)
    out[("two_reducers", "built")] = guarded(case_two_reducers, rank, world, counts, True)
    for overlap in (False, True):
        for divide in (False, True):
            out[("zero", overlap, divide)] = guarded(case_zero, rank, world, counts, overlap, divide, None)
    out[("zero_clip",)] = guarded(case_zero, rank, world, counts, True, False, 0.05)
    out[("gossip",)] = guarded(case_gossip, rank, world, counts, "ring")
    for divide in (False, True):
        out[("local", divide)] = guarded(case_local, rank, world, counts, 2, 2, divide)
        out[("diloco", divide)] = guarded(case_diloco, rank, world, counts, 2, divide)
    return out


_cache: dict = {}


def results(world: int, transport: str) -> list[dict]:
    key = (world, transport)
    return spawn_once(_cache, key, lambda: run_ranks(worker, world, transport, timeout=SPAWN_TIMEOUT))


def per_rank(world: int, transport: str, key: tuple) -> list[Any]:
    out = []
    for r, res in enumerate(results(world, transport)):
        got = res[key]
        if "error" in got:
            pytest.fail(f"rank {r}, case {key}:\n{got['error']}")
        out.append(got["ok"])
    return out


WORLDS = pytest.mark.parametrize("world", [2, 3])
TRANSPORT = pytest.mark.parametrize("transport", TRANSPORTS)


# ============================================================== tests: fused / overlap

@WORLDS
@TRANSPORT
@pytest.mark.parametrize("overlap", [False, True], ids=["fused", "overlap"])
@pytest.mark.parametrize("divide", [False, True], ids=["active", "initial_world"])
def test_reducer_matches_ddp_join(world: int, transport: str, overlap: bool, divide: bool) -> None:
    got = per_rank(world, transport, ("reducer", overlap, divide))
    for r, res in enumerate(got):
        assert_close(res["ours"], res["ref"], rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {r}: {m}")
        assert_close(res["ours"], got[0]["ours"], rtol=0, atol=0)  # all ranks end alike


@WORLDS
@TRANSPORT
@pytest.mark.parametrize("overlap", [False, True], ids=["fused", "overlap"])
def test_full_rank_powersgd_matches_ddp_join(world: int, transport: str, overlap: bool) -> None:
    """A joined rank runs PowerSGD's two collectives per group on zeros: the active ranks'
    (full-rank, so exact) mean matches DDP's Join."""
    got = per_rank(world, transport, ("powersgd", overlap))
    for r, res in enumerate(got):
        assert_close(res["ours"], res["ref"], rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {r}: {m}")
        assert_close(res["ours"], got[0]["ours"], rtol=0, atol=0)


@WORLDS
@TRANSPORT
@pytest.mark.parametrize("overlap", [False, True], ids=["fused", "overlap"])
def test_no_sync_accumulation_under_join(world: int, transport: str, overlap: bool) -> None:
    for r, res in enumerate(per_rank(world, transport, ("accumulate", overlap))):
        assert_close(res["ours"], res["ref"], rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {r}: {m}")


@WORLDS
@TRANSPORT
@pytest.mark.parametrize("overlap", [False, True], ids=["fused", "overlap"])
def test_throw_on_early_termination_raises_everywhere(world: int, transport: str, overlap: bool) -> None:
    for r, res in enumerate(per_rank(world, transport, ("throw", overlap))):
        assert res["raised"] is not None, f"rank {r} did not raise"
        assert "exhausted" in res["raised"].lower() or "exhausted" in res["raised"]


@WORLDS
@TRANSPORT
@pytest.mark.parametrize("overlap", [False, True], ids=["fused", "overlap"])
def test_no_extra_collective_outside_join(world: int, transport: str, overlap: bool) -> None:
    for res in per_rank(world, transport, ("no_extra", overlap)):
        calls, grads = res["plain"]
        assert calls == grads * res["grad_ars"]
        assert res["after"] == res["plain"]
        j_calls, j_grads = res["joined"]
        assert j_grads == grads and j_calls == calls + 3  # one notify per step


@WORLDS
@TRANSPORT
def test_functional_all_reduce_gradients_under_join(world: int, transport: str) -> None:
    for r, res in enumerate(per_rank(world, transport, ("functional",))):
        assert_close(res["ours"], res["ref"], rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {r}: {m}")


@WORLDS
@TRANSPORT
@pytest.mark.parametrize("built", [False, True], ids=["built_inside", "built_before"])
def test_two_joinables_in_one_join(world: int, transport: str, built: bool) -> None:
    for r, res in enumerate(per_rank(world, transport, ("two_reducers", "built") if built else ("two_reducers",))):
        assert_close(res["ours"], res["ref"], rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {r}: {m}")


# ============================================================== tests: ZeRO, gossip, local updates

def check_reference(world: int, transport: str, key: tuple, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    got = per_rank(world, transport, key)
    for r, res in enumerate(got):
        assert_close(res["ours"], res["ref"], rtol=rtol, atol=atol, msg=lambda m: f"rank {r}: {m}")


@WORLDS
@TRANSPORT
@pytest.mark.parametrize("overlap", [False, True], ids=["at_step", "overlap"])
@pytest.mark.parametrize("divide", [False, True], ids=["active", "initial_world"])
def test_zero_matches_reference(world: int, transport: str, overlap: bool, divide: bool) -> None:
    check_reference(world, transport, ("zero", overlap, divide))
    got = per_rank(world, transport, ("zero", overlap, divide))
    for res in got:  # the joined ranks stepped their shards: every rank ends alike
        assert_close(res["ours"], got[0]["ours"], rtol=0, atol=0)


@WORLDS
@TRANSPORT
def test_zero_clip_grad_norm_under_join(world: int, transport: str) -> None:
    check_reference(world, transport, ("zero_clip",))


@WORLDS
@TRANSPORT
def test_gossip_joined_rank_keeps_mixing(world: int, transport: str) -> None:
    check_reference(world, transport, ("gossip",))


@WORLDS
@TRANSPORT
@pytest.mark.parametrize("divide", [False, True], ids=["active", "initial_world"])
def test_local_sgd_matches_reference(world: int, transport: str, divide: bool) -> None:
    check_reference(world, transport, ("local", divide))


@WORLDS
@TRANSPORT
@pytest.mark.parametrize("divide", [False, True], ids=["active", "initial_world"])
def test_diloco_matches_reference(world: int, transport: str, divide: bool) -> None:
    check_reference(world, transport, ("diloco", divide))
