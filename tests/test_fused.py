"""FusedReducer and all_reduce_gradients on real Gloo process groups.

Each multi-process test gets its data from a module-scoped fixture that spawns one
group (``run_ranks``) and runs many sub-cases in it; the tests then assert on the
returned per-rank results here, in the parent. A sub-case that raises inside a rank
is returned as its traceback (see :func:`guarded`) and re-raised by :func:`unwrap`,
so one broken sub-case fails its own tests, not the whole group.
"""

from __future__ import annotations

import copy
import importlib
import io
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

import fastreduce
from fastreduce.backends import CheckedBackend, GraphContractError
from fastreduce.compat import gloo_has_avg
from fastreduce.launch import RankFailure, RankTimeout, run_ranks

from models import (ShapeModel, SparseEmbeddingModel, batch_for, frozen_backbone_model,
                    linear_stack, loss_of, many_tensor_model, mixed_dtype_model, skip_model)

SEED = 7
STEPS = 3
SPAWN_TIMEOUT = 90.0  # per spawned group; every group here finishes in seconds
WIRES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MIXED_WIRES = {**WIRES, "fp16": torch.float16, None: None}

# Tolerances, as (rtol, atol per unit of gradient scale). The scale of a tensor is
# the largest |local grad| over all ranks (the average itself can be ~0 by
# cancellation, so it is no yardstick for absolute error).
#  fp32: the two sides sum the same values in a different order (DDP divides by N
#    before a Gloo sum, fastreduce sums with ReduceOp.AVG, and the bucket layouts
#    differ), so they differ by a few fp32 ulps of the summands: 8 * 2**-23 ~ 1e-6.
#  bf16: every contribution is rounded to bf16 once (unit roundoff u = 2**-8), the
#    Gloo sum of N=2..3 terms rounds up to N-1 more times and the average once more:
#    at most (N + 1) * u * scale <= 2**-6 * scale, which is atol (a worst case; the
#    errors seen are far smaller); rtol 2e-2 (~5 bf16 ulps) covers elements far from zero.
TOL = {"fp32": (1e-6, 8 * 2.0**-23), "bf16": (2e-2, 2.0**-6)}

pytestmark = pytest.mark.timeout(180)


# ============================================================== spawning

def spawn(worker: Callable[..., Any], world: int, *args: Any, timeout: float = SPAWN_TIMEOUT) -> list[Any]:
    return run_ranks(worker, world, *args, timeout=timeout)


def spawn_once(cache: dict, key: Any, start: Callable[[], Any]) -> Any:
    """``cache[key]``, from ``start()`` (a spawn) the first time. A failed spawn is kept and
    reported by every test that asks for it (``pytest.fail``), never retried by each."""
    if key not in cache:
        try:
            cache[key] = start()
        except Exception as e:  # noqa: BLE001
            cache[key] = e
    res = cache[key]
    if isinstance(res, BaseException):
        pytest.fail(f"the spawn {key!r} failed: {res}")
    return res


def _run_cases(rank: int, world: int, module: str, todo: list[tuple]) -> dict:
    fns = importlib.import_module(module).CASE_FNS
    return {case: guarded(fns[case[0]], rank, world, *case[1:]) for case in todo}


def case_runner(module: str, cases: Callable[[int], list[tuple]], timeout: float) -> Callable[[int], list[dict]]:
    """``run(world)``: one group of that many ranks (started by the first test that asks,
    :func:`spawn_once`) runs every case of ``cases(world)``, each ``(kind, *args)`` as
    ``module.CASE_FNS[kind](rank, world, *args)`` under :func:`guarded`; per rank, a dict
    from case to result."""
    runs: dict = {}

    def run(world: int) -> list[dict]:
        return spawn_once(runs, world, lambda: run_ranks(_run_cases, world, module, cases(world), timeout=timeout))
    return run


def saved_and_loaded(state: Any) -> Any:
    """``state`` through ``torch.save`` and ``torch.load`` (in memory): what a checkpoint gives back."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


# ============================================================== helpers run in ranks

def guarded(fn: Callable[..., Any], *args: Any) -> dict:
    """Run one sub-case; an exception becomes ``{"error": traceback}`` for the parent."""
    try:
        return {"ok": fn(*args)}
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # noqa: BLE001 - reported to the parent test (DCP's CheckpointException is a BaseException)
        return {"error": traceback.format_exc()}


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def grad_scale(model: torch.nn.Module) -> dict[str, float]:
    """Per parameter, the largest |local grad| over all ranks (0 where no rank has one)."""
    named = list(model.named_parameters())
    local = torch.tensor([0.0 if p.grad is None else p.grad.abs().max().item() for _, p in named])
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return {n: float(v) for (n, _), v in zip(named, local)}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, sparse tensors included."""
    if a.is_sparse or b.is_sparse:
        return a.is_sparse == b.is_sparse and torch.equal(a.to_dense(), b.to_dense())
    return torch.equal(a, b)


def snapshot(model: torch.nn.Module) -> list[tuple]:
    return [(n, p.grad, None if p.grad is None else p.grad.clone(), p.detach().clone())
            for n, p in model.named_parameters()]


def changed_since(snap: list[tuple], model: torch.nn.Module) -> list[str]:
    """Names whose grad (object or value) or data differ from ``snap``."""
    params = dict(model.named_parameters())
    bad = []
    for name, grad, grad_copy, data in snap:
        p = params[name]
        same_grad = p.grad is grad and (grad is None or same(p.grad, grad_copy))
        if not same_grad or not torch.equal(p.detach(), data):
            bad.append(name)
    return bad


def reducer_of(model: torch.nn.Module) -> fastreduce.FusedReducer:
    """The reducer ``all_reduce_gradients`` keeps on ``model``."""
    (reducer,) = model.__dict__["_fastreduce_reducers"].values()
    return reducer


def grads_are_views(reducer: fastreduce.FusedReducer) -> bool:
    built = reducer._built
    return all(p.grad is v for p, v in zip(built.layout.params, built.buffer.views))


def zero_grads(model: torch.nn.Module, mode: str, reducer: fastreduce.FusedReducer | None) -> None:
    """``none``: set_to_none=True; ``zeros``: set_to_none=False; ``reducer``: reducer.zero_grad()."""
    if mode == "reducer" and reducer is not None:
        reducer.zero_grad()
    else:
        model.zero_grad(set_to_none=(mode == "none"))


def ddp_zero(mode: str) -> bool:
    """set_to_none for the DDP reference matching a fastreduce zero mode."""
    return mode == "none"


def expect_raises(exc_type: type, fn: Callable[[], Any]) -> dict:
    """Call ``fn`` expecting ``exc_type``; report what happened and how long it took."""
    t0 = time.monotonic()
    try:
        fn()
    except exc_type as e:
        return {"raised": type(e).__name__, "message": str(e), "elapsed": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001
        return {"raised": type(e).__name__, "message": traceback.format_exc(), "elapsed": time.monotonic() - t0}
    return {"raised": None, "message": "", "elapsed": time.monotonic() - t0}


# ============================================================== helpers run in the parent

def unwrap(result: dict) -> Any:
    if "error" in result:
        pytest.fail("sub-case raised inside a rank:\n" + result["error"], pytrace=False)
    return result["ok"]


def divides_first(reducer: fastreduce.FusedReducer) -> bool:
    """Whether an fp32/bf16 mean must divide before a SUM: on the process-group transport
    where Gloo has no AVG (torch < 2.8); shared memory averages by itself."""
    return reducer._built.plan.shm is None and not gloo_has_avg()


def per_rank(results: list[dict], key: str) -> list[Any]:
    return [unwrap(r[key]) for r in results]


def assert_steps_match_ddp(outs: list[dict], world: int, wire: str, steps: int) -> None:
    """Every rank's fastreduce grads match its DDP reference at every step."""
    for rank, out in enumerate(outs):
        for step in range(steps):
            assert_grads_close(out["fr"][step], out["ddp"][step], out["scale"][step], wire,
                               f"world {world} rank {rank} step {step}")


def assert_steps_identical_on_ranks(outs: list[dict], steps: int) -> None:
    """Every rank holds bit-identical fastreduce grads at every step."""
    for out in outs[1:]:
        for step in range(steps):
            for name, g in outs[0]["fr"][step].items():
                assert torch.equal(out["fr"][step][name], g), f"step {step} {name}"


def assert_grads_close(got: dict, want: dict, scale: dict, tol: str, where: str) -> None:
    rtol, atol_unit = TOL[tol]
    assert got.keys() == want.keys(), where
    for name, w in want.items():
        g = got[name]
        got_none, want_none = g is None, w is None
        assert got_none == want_none, (f"{where}: {name}: fastreduce grad is {'None' if got_none else 'set'}, "
                                       f"reference grad is {'None' if want_none else 'set'}")
        if w is not None:
            assert_close(g, w, rtol=rtol, atol=atol_unit * scale[name],
                         msg=lambda m, name=name: f"{where}: {name}: {m}")


# ============================================================== parity with DDP

@dataclass(frozen=True)
class Case:
    wire: str
    backend: str
    zero: str          # "none" | "zeros" | "reducer" (see zero_grads)
    api: str = "object"  # FusedReducer, or the all_reduce_gradients function

    @property
    def id(self) -> str:
        return f"{self.api}-{self.wire}-{self.backend}-zero_{self.zero}"


PARITY_CASES = tuple(
    [Case(w, b, z) for w in WIRES for b in ("eager", "checked") for z in ("none", "zeros", "reducer")]
    + [Case(w, "eager", z, "function") for w in WIRES for z in ("none", "zeros")])


def parity_case(rank: int, world: int, case: Case) -> dict:
    model = many_tensor_model(SEED)
    ddp = DDP(copy.deepcopy(model))
    wire = WIRES[case.wire]
    if case.api == "object":
        reducer = fastreduce.FusedReducer(model, wire_dtype=wire, backend=case.backend)
        reduce = reducer.reduce
    else:
        reducer = None
        reduce = lambda: fastreduce.all_reduce_gradients(model, wire, backend=case.backend)  # noqa: E731
    out: dict[str, list] = {"fr": [], "ddp": [], "scale": [], "views": [], "reattached": [], "preattached": []}
    for step in range(STEPS):
        inputs = batch_for(model, rank, step)
        zero_grads(model, case.zero, reducer)
        ddp.zero_grad(set_to_none=ddp_zero(case.zero))
        loss_of(model, inputs).backward()
        out["scale"].append(grad_scale(model))
        reduce()
        reducer = reducer or reducer_of(model)
        loss_of(ddp, inputs).backward()
        out["fr"].append(grads_of(model))
        out["ddp"].append(grads_of(ddp.module))
        out["views"].append(grads_are_views(reducer))
        out["reattached"].append(reducer.stats.reattached)
        out["preattached"].append(reducer.stats.preattached)
    out["replays"] = getattr(reducer.backend, "replays", None)
    out["divides"] = divides_first(reducer)
    out["layout_names"] = reducer.layout.names
    out["calls"] = reducer.stats.calls
    out["stats"] = (reducer.stats.calls, reducer.stats.collectives, reducer.stats.bytes_reduced)
    out["wire_bytes"] = reducer.layout.numel * wire.itemsize
    out["strides"] = {n: (p.grad.stride(), p.stride()) for n, p in model.named_parameters()}
    return out


def subgroup_case(rank: int, world: int) -> dict | None:
    """Reduce over ranks {0, 1} of a larger world; the other ranks stay out of it."""
    group = dist.new_group([0, 1])  # collective over the whole world
    if rank > 1:
        return None
    model = many_tensor_model(SEED)
    loss_of(model, batch_for(model, rank, 0)).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    for g in want.values():
        dist.all_reduce(g, group=group)
        g /= 2
    scale = {n: 1.0 for n in want}
    fastreduce.all_reduce_gradients(model, torch.float32, group=group, backend="checked")
    return {"fr": grads_of(model), "want": want, "scale": scale,
            "world_size": reducer_of(model).world_size}


def parity_worker(rank: int, world: int, cases: tuple[Case, ...]) -> dict:
    out = {case.id: guarded(parity_case, rank, world, case) for case in cases}
    if world > 2:
        out["subgroup"] = guarded(subgroup_case, rank, world)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def parity(request) -> tuple[int, list[dict]]:
    world = request.param
    return world, spawn(parity_worker, world, PARITY_CASES)


@pytest.mark.parametrize("case", PARITY_CASES, ids=lambda c: c.id)
def test_grads_match_ddp(parity, case: Case) -> None:
    world, results = parity
    assert_steps_match_ddp(per_rank(results, case.id), world, case.wire, STEPS)


@pytest.mark.parametrize("case", PARITY_CASES, ids=lambda c: c.id)
def test_every_rank_holds_the_same_grads(parity, case: Case) -> None:
    _, results = parity
    assert_steps_identical_on_ranks(per_rank(results, case.id), STEPS)


@pytest.mark.parametrize("case", PARITY_CASES, ids=lambda c: c.id)
def test_grads_are_views_of_the_flat_buffer(parity, case: Case) -> None:
    _, results = parity
    for out in per_rank(results, case.id):
        assert out["views"] == [True] * STEPS
        assert out["calls"] == STEPS


@pytest.mark.parametrize("case", PARITY_CASES, ids=lambda c: c.id)
def test_reattached_counts_only_reallocated_grads(parity, case: Case) -> None:
    """The first call adopts every grad; after it nothing is copied in: what
    zero_grad(set_to_none=True) freed is re-attached, zeroed, at the next forward."""
    _, results = parity
    for out in per_rank(results, case.id):
        n = len(out["layout_names"])
        per_call = [b - a for a, b in zip([0] + out["reattached"], out["reattached"])]
        assert per_call == [n] + [0] * (STEPS - 1)
        pre = [b - a for a, b in zip([0] + out["preattached"], out["preattached"])]
        assert pre == [0] + [n if case.zero == "none" else 0] * (STEPS - 1)


@pytest.mark.parametrize("case", [c for c in PARITY_CASES if c.backend == "checked"], ids=lambda c: c.id)
def test_checked_backend_replays_pack_and_unpack(parity, case: Case) -> None:
    """With fp32 grads and a bf16 wire, unpack is replayed each call, and so is pack
    whenever the grads are still views of the flat buffer: every call but the first,
    which finds autograd's fresh grads and casts them straight into the wire (after
    zero_grad(set_to_none=True) the next forward re-attaches the views). With an fp32
    wire (and Gloo's AVG, or shared memory) there is nothing to pack or unpack: no replays.
    Where Gloo has no AVG (torch < 2.8), pack divides first, on every call."""
    _, results = parity
    for out in per_rank(results, case.id):
        packs = STEPS if out["divides"] else STEPS - 1
        assert out["replays"] == (STEPS + packs if case.wire == "bf16" else STEPS if out["divides"] else 0)


def test_tied_parameters_are_reduced_once(parity) -> None:
    _, results = parity
    names = per_rank(results, PARITY_CASES[0].id)[0]["layout_names"]
    model = many_tensor_model(SEED)
    unique = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(unique) < len(list(model.named_parameters(remove_duplicate=False)))  # the model ties
    assert len(names) == len(unique) == len(set(names))
    assert "emb.weight" in names and "head.weight" not in names


@pytest.mark.parametrize("name", ["conv_cl.weight", "transposed"])
def test_grad_view_keeps_the_param_strides(parity, name) -> None:
    """A dense parameter's grad view has the parameter's strides (channels_last conv
    weight; a transposed weight), as AccumulateGrad's layout contract expects: otherwise
    every backward warns "grad and param do not obey the gradient layout contract"."""
    _, results = parity
    for case in PARITY_CASES:
        for out in per_rank(results, case.id):
            grad_stride, param_stride = out["strides"][name]
            assert grad_stride == param_stride, f"{case.id}: {name}"


@pytest.mark.parametrize("case", PARITY_CASES, ids=lambda c: c.id)
def test_stats_count_calls_collectives_and_bytes(parity, case: Case) -> None:
    _, results = parity
    for out in per_rank(results, case.id):
        assert out["stats"] == (STEPS, STEPS, STEPS * out["wire_bytes"])


def test_reduce_over_a_subgroup(parity) -> None:
    world, results = parity
    if world < 3:
        pytest.skip("needs a world larger than the group")
    outs = per_rank(results, "subgroup")
    assert outs[2:] == [None] * (world - 2)
    for rank, out in enumerate(outs[:2]):
        assert out["world_size"] == 2
        assert_grads_close(out["fr"], out["want"], out["scale"], "fp32", f"rank {rank}")


# ============================================================== one group, many checks

def mixed_dtype_case(rank: int, world: int, wire_name: str | None) -> dict:
    """fastreduce vs a hand-written dist.all_reduce average, on a bf16+fp32 model."""
    model = mixed_dtype_model(SEED)
    reducer = fastreduce.FusedReducer(model, wire_dtype=MIXED_WIRES[wire_name], backend="checked")
    out: dict[str, list] = {"fr": [], "ref": [], "scale": []}
    for step in range(STEPS):
        model.zero_grad(set_to_none=step % 2 == 0)
        loss_of(model, batch_for(model, rank, step)).backward()
        ref = {}
        for n, p in model.named_parameters():
            g = p.grad.to(torch.float32, copy=True)
            dist.all_reduce(g)
            ref[n] = (g / world).to(p.dtype)
        out["scale"].append(grad_scale(model))
        reducer.reduce()
        out["fr"].append(grads_of(model))
        out["ref"].append(ref)
    out["dtypes"] = {n: p.grad.dtype for n, p in model.named_parameters()}
    out["segments"] = [seg.dtype for seg in reducer.layout.segments]
    out["plan"] = repr(reducer._built.plan)
    out["replays"] = reducer.backend.replays
    return out


def fp16_bf16_case(rank: int, world: int) -> dict:
    """wire_dtype=None on fp16 and bf16 parameters (neither dtype holds the other): an fp32 wire,
    so a bf16 gradient beyond fp16's range and an fp16 one below bf16's precision both arrive."""
    model = nn.ParameterList([nn.Parameter(torch.ones(4, dtype=torch.float16)),
                              nn.Parameter(torch.ones(4, dtype=torch.bfloat16))])
    reducer = fastreduce.FusedReducer(model, wire_dtype=None)
    (model[0].float() * (1 + 2.0**-10) * (rank + 1)).sum().backward()
    (model[1].float() * 1e5 * (rank + 1)).sum().backward()
    want = []
    for p in model:
        g = p.grad.float()
        dist.all_reduce(g)
        want.append((g / world).to(p.dtype))
    reducer.reduce()
    return {"wire": reducer._built.buffer.wire.dtype, "got": [p.grad.clone() for p in model], "want": want}


def frozen_case(rank: int, world: int) -> dict:
    """Frozen params are left alone, even with a stale (rank-specific) grad on one."""
    model = frozen_backbone_model(SEED)
    reducer = fastreduce.FusedReducer(model, wire_dtype=torch.float32)
    stale = model.backbone[0].weight
    stale.grad = torch.full_like(stale, float(rank + 1))
    loss_of(model, batch_for(model, rank, 0)).backward()
    before = {n: (p.grad, None if p.grad is None else p.grad.clone(), p.detach().clone())
              for n, p in model.named_parameters() if not p.requires_grad}
    local = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    reducer.reduce()
    for g in local.values():
        dist.all_reduce(g)
    frozen_untouched = all(
        p.grad is grad and (grad is None or torch.equal(p.grad, value)) and torch.equal(p.detach(), data)
        for n, p in model.named_parameters() if not p.requires_grad
        for grad, value, data in [before[n]])
    return {
        "layout_names": reducer.layout.names,
        "frozen_untouched": frozen_untouched,
        "frozen_grads_none": [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is None],
        "stale_value": stale.grad.flatten()[0].item(),
        "trainable_ok": all(torch.allclose(p.grad, local[n] / world, rtol=1e-6, atol=1e-7)
                            for n, p in model.named_parameters() if p.requires_grad),
    }


def unfreeze_case(rank: int, world: int) -> dict:
    """Unfreezing after the layout is learned is an error until rebuild()."""
    model = frozen_backbone_model(SEED)
    reducer = fastreduce.FusedReducer(model, wire_dtype=torch.float32)
    loss_of(model, batch_for(model, rank, 0)).backward()
    reducer.reduce()
    model.backbone[2].requires_grad_(True)
    model.zero_grad(set_to_none=True)
    loss_of(model, batch_for(model, rank, 1)).backward()
    snap = snapshot(model)
    failed = expect_raises(RuntimeError, reducer.reduce)
    failed["changed"] = changed_since(snap, model)
    reducer.rebuild()
    reducer.reduce()
    model.backbone[2].requires_grad_(False)  # and frozen again: its grad goes missing
    model.zero_grad(set_to_none=True)
    loss_of(model, batch_for(model, rank, 2)).backward()
    refrozen = expect_raises(RuntimeError, reducer.reduce)
    return {"failed": failed, "layout_after_rebuild": reducer.layout.names, "refrozen": refrozen}


REPLACED_CASES = {  # name: (how the parameters change, overlap, how grads are zeroed before it)
    "assign": ("assign", False, "grads"),
    "double": ("double", False, "grads"),
    "double-after-none": ("double", False, "none"),
    "overlap-assign": ("assign", True, "none"),
    "overlap-double": ("double", True, "reducer"),
    "overlap-double-after-none": ("double", True, "none"),
    "added": ("added", False, "grads"),
    "overlap-added-after-none": ("added", True, "none"),
    "added-frozen-then-unfrozen": ("added-frozen", False, "grads"),
}


def replaced_case(rank: int, world: int, name: str) -> dict:
    """Parameters replaced (load_state_dict(assign=True)), moved to new storage (model.double())
    or added (a layer appended; one appended frozen is reduced without, until it is unfrozen)
    after the layout was learned: a clear error on every rank, nothing touched; averaged again
    after rebuild()."""
    how, overlap, zero = REPLACED_CASES[name]
    model = linear_stack(SEED, 6)
    kw = {"overlap": True, "bucket_mb": 1e-4, "transport": "process_group"} if overlap else {}
    reducer = fastreduce.FusedReducer(model, wire_dtype=torch.float32, **kw)
    dtype = torch.float32

    def backward(step: int) -> None:
        (x,) = batch_for(model, rank, step)
        loss_of(model, (x.to(dtype),)).backward()

    for step in range(2):
        model.zero_grad(set_to_none=True)
        backward(step)
        reducer.reduce()
    if zero == "none":
        model.zero_grad(set_to_none=True)
    elif zero == "reducer":
        reducer.zero_grad()
    frozen_ok = None
    if how == "assign":
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    elif how.startswith("added"):
        model.layers.append(nn.Linear(4, 4).requires_grad_(how == "added"))
        if how == "added-frozen":  # reduced as before (its parameters have no grad), until unfrozen
            backward(2)
            frozen_ok = expect_raises(RuntimeError, reducer.reduce)["raised"] is None
            model.zero_grad(set_to_none=False)
            model.layers[-1].requires_grad_(True)
    else:
        model.double()
        dtype = torch.float64
    failed = expect_raises(RuntimeError, lambda: backward(2))  # (overlap after set_to_none: from backward)
    if failed["raised"] is None:
        snap = snapshot(model)
        failed = expect_raises(RuntimeError, reducer.reduce) | {"changed": changed_since(snap, model)}
    reducer.rebuild()
    model.zero_grad(set_to_none=True)
    backward(3)
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    reducer.reduce()
    worst = 0.0
    for n, p in model.named_parameters():
        dist.all_reduce(local[n])
        worst = max(worst, float((p.grad - local[n] / world).abs().max()))
    return {"failed": failed, "after_rebuild": worst, "dtype": str(model.layers[0].weight.grad.dtype),
            "frozen_ok": frozen_ok}


def op_trace_case(rank: int, world: int) -> dict:
    """The ops one warm reduce() dispatches, per (wire, number of tensors, zero mode)."""
    traces = {}
    for wire_name in WIRES:
        for tensors in (50, 500):
            for zero in ("reducer", "none"):
                model = linear_stack(SEED, tensors)
                assert len(list(model.parameters())) == tensors
                reducer = fastreduce.FusedReducer(model, wire_dtype=WIRES[wire_name], backend="eager")
                for step in range(3):  # two warm-up calls, the third is traced
                    zero_grads(model, zero, reducer)
                    loss_of(model, batch_for(model, rank, step)).backward()
                    if step < 2:
                        reducer.reduce()
                with OpRecorder() as rec:
                    reducer.reduce()
                traces[(wire_name, tensors, zero)] = rec.ops
                traces["shm"] = reducer._built.plan.shm is not None
    return traces


class OpRecorder(TorchDispatchMode):
    """Records the name of every op dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


TRAIN_CASES = {  # name: (optimizer, wire, backend, zero mode)
    "sgd-fp32-eager-none": ("sgd", "fp32", "eager", "none"),
    "adamw-fp32-eager-reducer": ("adamw", "fp32", "eager", "reducer"),
    "adamw-fp32-checked-zeros": ("adamw", "fp32", "checked", "zeros"),
    "sgd-bf16-checked-none": ("sgd", "bf16", "checked", "none"),
}
TRAIN_STEPS = 5


def make_optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def train_case(rank: int, world: int, name: str) -> dict:
    """TRAIN_STEPS optimizer steps through fastreduce and through DDP from the same start."""
    opt_kind, wire, backend, zero = TRAIN_CASES[name]
    model = many_tensor_model(SEED)
    ddp = DDP(copy.deepcopy(model))
    reducer = fastreduce.FusedReducer(model, wire_dtype=WIRES[wire], backend=backend)
    opt, ddp_opt = make_optimizer(opt_kind, model), make_optimizer(opt_kind, ddp)
    for step in range(TRAIN_STEPS):
        inputs = batch_for(model, rank, step)
        zero_grads(model, zero, reducer)
        ddp_opt.zero_grad(set_to_none=ddp_zero(zero))
        loss_of(model, inputs).backward()
        reducer.reduce()
        opt.step()
        loss_of(ddp, inputs).backward()
        ddp_opt.step()
    return {"fr": {n: p.detach().clone() for n, p in model.named_parameters()},
            "ddp": {n: p.detach().clone() for n, p in ddp.module.named_parameters()},
            "replays": getattr(reducer.backend, "replays", None), "divides": divides_first(reducer)}


def misc_worker(rank: int, world: int) -> dict:
    out = {f"mixed-{w}": guarded(mixed_dtype_case, rank, world, w) for w in MIXED_WIRES}
    out["frozen"] = guarded(frozen_case, rank, world)
    out["fp16_bf16"] = guarded(fp16_bf16_case, rank, world)
    out["unfreeze"] = guarded(unfreeze_case, rank, world)
    out.update({f"replaced-{n}": guarded(replaced_case, rank, world, n) for n in REPLACED_CASES})
    out["ops"] = guarded(op_trace_case, rank, world)
    out.update({f"train-{n}": guarded(train_case, rank, world, n) for n in TRAIN_CASES})
    return out


@pytest.fixture(scope="module")
def misc() -> list[dict]:
    return spawn(misc_worker, 2)


@pytest.mark.parametrize("wire", list(MIXED_WIRES))
def test_mixed_dtype_model_matches_manual_all_reduce(misc, wire) -> None:
    for rank, out in enumerate(per_rank(misc, f"mixed-{wire}")):
        assert out["dtypes"]["mid.0.weight"] == torch.bfloat16  # grads keep their own dtypes
        assert out["dtypes"]["inp.weight"] == torch.float32
        assert set(out["segments"]) == {torch.bfloat16, torch.float32}
        # fp16 sums could overflow before the divide, so that wire divides first (as every
        # wire does where Gloo has no AVG); the shared-memory transport sums low-precision
        # wires in fp32, so never needs to.
        expect = ("shared memory)" if "shared memory" in out["plan"] else
                  "divide then SUM)" if wire == "fp16" or not gloo_has_avg() else "AVG)")
        assert out["plan"].endswith(expect), out["plan"]
        # One segment is never the wire dtype: unpack every step; pack too, except on the
        # first call when nothing divides first: it adopts autograd's fresh grads, cast
        # straight into the wire (later, set_to_none grads are re-attached at forward).
        divides = expect == "divide then SUM)"
        packs = STEPS if divides else STEPS - 1
        assert out["replays"] == STEPS + packs, out["replays"]
        for step in range(STEPS):
            for name, want in out["ref"][step].items():
                # fp32 only where both the grad and the wire are fp32 (wire None = widest = fp32).
                tol = "fp32" if want.dtype == torch.float32 and wire in ("fp32", None) else "bf16"
                assert_grads_close({name: out["fr"][step][name]}, {name: want}, out["scale"][step],
                                   tol, f"rank {rank} step {step}")


def test_no_wire_dtype_sends_fp16_with_bf16_in_fp32(misc) -> None:
    for out in per_rank(misc, "fp16_bf16"):
        for got, want in zip(out["got"], out["want"]):
            assert got.dtype == want.dtype and torch.equal(got, want), (got, want)
        assert out["wire"] == torch.float32


def test_frozen_params_untouched(misc) -> None:
    for out in per_rank(misc, "frozen"):
        assert all(n.startswith("head.") for n in out["layout_names"]), out["layout_names"]
        assert out["frozen_untouched"]
        assert out["frozen_grads_none"] == ["backbone.0.bias", "backbone.2.weight", "backbone.2.bias"]
        assert out["trainable_ok"]
    assert [out["stale_value"] for out in per_rank(misc, "frozen")] == [1.0, 2.0]  # not averaged


def test_unfreezing_after_first_call_needs_rebuild(misc) -> None:
    for out in per_rank(misc, "unfreeze"):
        failed = out["failed"]
        assert failed["raised"] == "RuntimeError", failed["message"]
        assert "backbone.2" in failed["message"] and "rebuild()" in failed["message"]
        assert failed["changed"] == []
        assert "backbone.2.weight" in out["layout_after_rebuild"]
        refrozen = out["refrozen"]  # (it said "require grad but have no gradient": freeze what you do not train)
        assert refrozen["raised"] == "RuntimeError" and "frozen now" in refrozen["message"], refrozen["message"]
        assert "rebuild()" in refrozen["message"] and "backbone.2.weight" in refrozen["message"]


@pytest.mark.parametrize("name", list(REPLACED_CASES))
def test_parameters_replaced_moved_or_added_after_the_layout_raise_on_every_rank_until_rebuild(misc, name) -> None:
    for rank, out in enumerate(per_rank(misc, f"replaced-{name}")):
        failed = out["failed"]
        assert failed["raised"] == "RuntimeError", f"rank {rank}: {failed['raised']}: {failed['message']}"
        if "added" in name:  # (before, the new layer trained on each rank's own gradients, unsaid)
            assert "were added to the model" in failed["message"], failed["message"]
            assert "'layers.3.weight', 'layers.3.bias'" in failed["message"], failed["message"]
            assert out["frozen_ok"] is (True if "frozen" in name else None), out["frozen_ok"]
        else:
            assert "changed since fastreduce learned the gradient layout" in failed["message"], failed["message"]
            assert "'layers.0.bias'" in failed["message"], failed["message"]
        assert "rebuild()" in failed["message"], failed["message"]
        assert failed.get("changed", []) == [], f"rank {rank}: a failed call changed {failed['changed']}"
        assert failed["elapsed"] < 10.0
        assert out["after_rebuild"] < 1e-6, out["after_rebuild"]
        assert out["dtype"] == ("torch.float64" if "double" in name else "torch.float32")


ALLOCATING_OPS = {"empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like",
                  "full", "full_like", "clone", "_to_copy", "contiguous"}


@pytest.mark.parametrize("zero", ["reducer", "none"])
@pytest.mark.parametrize("wire", list(WIRES))
def test_warm_reduce_op_count_does_not_grow_with_tensors(misc, wire, zero) -> None:
    for traces in per_rank(misc, "ops"):
        small, large = traces[(wire, 50, zero)], traces[(wire, 500, zero)]
        # The recorder sees the collective; the shared-memory transport runs it on its
        # worker thread instead (its ops are counted in test_shm.py).
        assert ("c10d.allreduce_.default" in small) != traces["shm"], small
        assert small == large
        aten = [op.split(".")[1] for op in small if op.startswith("aten.")]
        allocs = [op for op in aten if op in ALLOCATING_OPS or op.startswith("new_")]
        assert allocs == [], small
        # Views kept (reducer.zero_grad): nothing but the collective, plus one cast each way
        # when the wire is narrower than the fp32 grads (and the divide where Gloo has no AVG).
        if zero == "reducer":
            div = [] if traces["shm"] or gloo_has_avg() else ["div_"]
            assert aten == (["copy_", *div, "copy_"] if wire == "bf16" else div), small


@pytest.mark.parametrize("name", list(TRAIN_CASES))
@pytest.mark.cell("loop", "train", modes=("fused",))
def test_training_matches_ddp(misc, name) -> None:
    outs = per_rank(misc, f"train-{name}")
    wire = TRAIN_CASES[name][1]
    for out in outs:
        for n, want in out["ddp"].items():
            if wire == "fp32":
                assert_close(out["fr"][n], want, rtol=1e-6, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
            else:  # bf16 grads drift a little over 5 steps; the params stay close
                assert_close(out["fr"][n], want, rtol=2e-2, atol=2e-3, msg=lambda m, n=n: f"{n}: {m}")
    for out in outs[1:]:  # and every rank holds bit-identical params
        for n, p in outs[0]["fr"].items():
            assert torch.equal(out["fr"][n], p), n


def test_checked_training_loop_replays(misc) -> None:
    """set_to_none=True frees the grads every step; the next forward re-attaches them as
    zeroed views (after the first step, whose fresh grads are cast straight into the
    wire), and the checked backend's replays (pack and unpack) only ever touch the
    reducer's persistent buffers."""
    for out in per_rank(misc, "train-sgd-bf16-checked-none"):
        assert out["replays"] == 2 * TRAIN_STEPS - (0 if out["divides"] else 1)


# ============================================================== unused gradients

def skipped(step: int, rank: int) -> set[str]:
    """Layers SkipModel leaves out: ``sometimes`` on every rank on even steps; ``rank_dep``
    where ``step + rank`` is even (so on some ranks only), and on every rank on step 2."""
    skip = {"sometimes"} if step % 2 == 0 else set()
    if step == 2 or (step + rank) % 2 == 0:
        skip.add("rank_dep")
    return skip


UNUSED_STEPS = 4
UNUSED_CASES = tuple(f"{wire}-{backend}-zero_{zero}"
                     for wire, backend in (("fp32", "eager"), ("fp32", "checked"), ("bf16", "eager"))
                     for zero in ("none", "zeros", "reducer"))


def unused_case(rank: int, world: int, case: str) -> dict:
    wire, backend, zero = case.split("-")
    zero = zero.removeprefix("zero_")
    model = skip_model(SEED)
    ddp = DDP(copy.deepcopy(model), find_unused_parameters=True)
    reducer = fastreduce.FusedReducer(model, wire_dtype=WIRES[wire], backend=backend, unused_grads="zero")
    out: dict[str, list] = {"fr": [], "ddp": [], "scale": []}
    for step in range(UNUSED_STEPS):
        inputs, skip = batch_for(model, rank, step), skipped(step, rank)
        zero_grads(model, zero, reducer)
        ddp.zero_grad(set_to_none=ddp_zero(zero))
        loss_of(model, inputs, skip=skip).backward()
        out["scale"].append(grad_scale(model))
        reducer.reduce()
        loss_of(ddp, inputs, skip=skip).backward()
        out["fr"].append(grads_of(model))
        out["ddp"].append(grads_of(ddp.module))
    return out


def unused_worker(rank: int, world: int) -> dict:
    return {case: guarded(unused_case, rank, world, case) for case in UNUSED_CASES}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def unused(request) -> tuple[int, list[dict]]:
    return request.param, spawn(unused_worker, request.param)


@pytest.mark.parametrize("case", UNUSED_CASES)
def test_unused_zero_matches_ddp_find_unused(unused, case) -> None:
    world, results = unused
    for rank, out in enumerate(per_rank(results, case)):
        for step in range(UNUSED_STEPS):
            assert_grads_close(out["fr"][step], out["ddp"][step], out["scale"][step], case.split("-")[0],
                               f"world {world} rank {rank} step {step}")


def test_param_no_rank_used_keeps_grad_none(unused) -> None:
    """ReducerConfig.unused_grads: with "zero", a parameter no rank produced a gradient for
    keeps grad=None (as with DDP), whichever way the loop zeroes its grads."""
    _, results = unused
    with_grad = sorted({f"{case} step {step}: {name}"
                        for case in UNUSED_CASES for out in per_rank(results, case)
                        for step in range(UNUSED_STEPS) for name in ("never.weight", "never.bias")
                        if out["fr"][step][name] is not None})
    assert with_grad == [], "unused everywhere, yet given a grad:\n" + "\n".join(with_grad)
    for case in UNUSED_CASES:
        for out in per_rank(results, case):
            assert out["fr"][0]["sometimes.weight"] is None  # unused everywhere on the first step


# ============================================================== errors

def unused_error_first_call(rank: int, world: int) -> dict:
    """Every rank lacks the same grad on the first call: a clear error on every rank."""
    model = skip_model(SEED, with_never=False)
    reducer = fastreduce.FusedReducer(model, wire_dtype=torch.float32)
    loss_of(model, batch_for(model, rank, 0), skip={"sometimes"}).backward()
    snap = snapshot(model)
    res = expect_raises(RuntimeError, reducer.reduce)
    return res | {"changed": changed_since(snap, model)}


def unused_error_first_call_one_rank(rank: int, world: int) -> dict:
    """Only rank 1 lacks a grad on the first call: caught by the layout check on every rank."""
    model = skip_model(SEED, with_never=False)
    reducer = fastreduce.FusedReducer(model, wire_dtype=torch.float32)
    loss_of(model, batch_for(model, rank, 0), skip={"rank_dep"} if rank == 1 else ()).backward()
    snap = snapshot(model)
    res = expect_raises(fastreduce.LayoutMismatchError, reducer.reduce)
    return res | {"changed": changed_since(snap, model)}


def unused_error_later_call(rank: int, world: int) -> dict:
    """After a good first call, every rank lacks the same grad: local error, nothing changed."""
    model = skip_model(SEED, with_never=False)
    reducer = fastreduce.FusedReducer(model, wire_dtype=torch.bfloat16)
    loss_of(model, batch_for(model, rank, 0)).backward()
    reducer.reduce()
    model.zero_grad(set_to_none=True)
    loss_of(model, batch_for(model, rank, 1), skip={"sometimes"}).backward()
    snap = snapshot(model)
    res = expect_raises(RuntimeError, reducer.reduce)
    return res | {"changed": changed_since(snap, model)}


def shape_mismatch(rank: int, world: int) -> dict:
    model = ShapeModel(hidden=16 if rank == 0 else 12)
    reducer = fastreduce.FusedReducer(model)
    loss_of(model, batch_for(model, rank, 0)).backward()
    snap = snapshot(model)
    res = expect_raises(fastreduce.LayoutMismatchError, reducer.reduce)
    return res | {"changed": changed_since(snap, model)}


def memory_format_mismatch(rank: int, world: int) -> dict:
    """Same shapes, but rank 1 holds one conv weight in channels_last."""
    model = many_tensor_model(SEED)
    if rank == 1:
        model.conv.to(memory_format=torch.channels_last)
    loss_of(model, batch_for(model, rank, 0)).backward()
    snap = snapshot(model)
    res = expect_raises(fastreduce.LayoutMismatchError, lambda: fastreduce.all_reduce_gradients(model))
    return res | {"changed": changed_since(snap, model)}


def sparse_first_call(rank: int, world: int) -> dict:
    model = SparseEmbeddingModel()
    loss_of(model, batch_for(model, rank, 0)).backward()
    assert model.emb.weight.grad.is_sparse
    snap = snapshot(model)
    res = expect_raises(ValueError, lambda: fastreduce.all_reduce_gradients(model))
    return res | {"changed": changed_since(snap, model)}


def sparse_later_call(rank: int, world: int) -> dict:
    """A sparse grad showing up after the layout is learned: error, nothing touched."""
    torch.manual_seed(SEED)
    model = SparseEmbeddingModel()
    reducer = fastreduce.FusedReducer(model, wire_dtype=torch.float32)
    loss_of(model, batch_for(model, rank, 0)).backward()
    model.emb.weight.grad = model.emb.weight.grad.to_dense()
    reducer.reduce()
    model.zero_grad(set_to_none=True)
    loss_of(model, batch_for(model, rank, 1)).backward()  # (into the re-attached dense view)
    model.emb.weight.grad = model.emb.weight.grad.to_sparse()  # a sparse grad replaces it
    snap = snapshot(model)
    res = expect_raises(ValueError, reducer.reduce)
    return res | {"changed": changed_since(snap, model)}


ERROR_CASES = {
    "unused_error_first_call": unused_error_first_call,
    "unused_error_first_call_one_rank": unused_error_first_call_one_rank,
    "unused_error_later_call": unused_error_later_call,
    "shape_mismatch": shape_mismatch,
    "memory_format_mismatch": memory_format_mismatch,
    "sparse_first_call": sparse_first_call,
    "sparse_later_call": sparse_later_call,
}


def errors_worker(rank: int, world: int) -> dict:
    return {name: guarded(fn, rank, world) for name, fn in ERROR_CASES.items()}


@pytest.fixture(scope="module")
def errors() -> list[dict]:
    return spawn(errors_worker, 2)


# name: (exception, substrings every rank's message must contain)
EXPECTED_ERRORS = {
    "unused_error_first_call": ("RuntimeError", ["'sometimes.weight'", "'sometimes.bias'", "unused_grads='zero'"]),
    "unused_error_first_call_one_rank": ("LayoutMismatchError", ["rank_dep.weight", "(no grad)"]),
    "unused_error_later_call": ("RuntimeError", ["'sometimes.weight'", "unused_grads='zero'"]),
    "shape_mismatch": ("LayoutMismatchError", ["a.weight:(16, 8)", "a.weight:(12, 8)"]),
    "memory_format_mismatch": ("LayoutMismatchError", ["conv.weight:(4, 3, 3, 3):(27, 9, 3, 1)",
                                                       "conv.weight:(4, 3, 3, 3):(27, 1, 9, 3)"]),
    "sparse_first_call": ("ValueError", ["'emb.weight'", "sparse"]),
    "sparse_later_call": ("ValueError", ["'emb.weight'", "sparse"]),
}


@pytest.mark.parametrize("name", list(ERROR_CASES))
def test_error_raised_on_every_rank_and_nothing_changed(errors, name) -> None:
    exc, needles = EXPECTED_ERRORS[name]
    for rank, res in enumerate(per_rank(errors, name)):
        assert res["raised"] == exc, f"rank {rank}: {res['raised']}: {res['message']}"
        for needle in needles:
            assert needle in res["message"], f"rank {rank}: {needle!r} not in {res['message']!r}"
        assert res["elapsed"] < 10.0, f"rank {rank} took {res['elapsed']:.1f}s to fail"
        assert res["changed"] == [], f"rank {rank}: a failed call changed {res['changed']}"


def one_rank_missing_grad(rank: int, world: int) -> None:
    """After a good first call only rank 1 lacks a grad: rank 1 raises, rank 0 is left in
    its collective (a documented limitation); the launcher must still report rank 1's error."""
    model = skip_model(SEED, with_never=False)
    reducer = fastreduce.FusedReducer(model, wire_dtype=torch.float32)
    loss_of(model, batch_for(model, rank, 0)).backward()
    reducer.reduce()
    model.zero_grad(set_to_none=True)
    loss_of(model, batch_for(model, rank, 1), skip={"rank_dep"} if rank == 1 else ()).backward()
    reducer.reduce()


@pytest.mark.timeout(60)
def test_missing_grad_on_one_rank_reports_that_rank() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(one_rank_missing_grad, 2, timeout=30.0)
    text = str(info.value)
    assert "--- rank 1 failed ---" in text
    rank1 = text.split("--- rank 1 failed ---")[1]
    assert "'rank_dep.weight'" in rank1 and "unused_grads='zero'" in rank1


def leaves_the_group(rank: int, world: int, how: str, folder: str) -> None:
    """Rank 1 ends without a result (``how="exits"``: SIGKILL to itself, as the OOM killer, a
    ``kill -9`` or a lost host would end it) while rank 0 waits for it in a barrier; or (``"hangs"``) every
    rank sleeps past the launcher's timeout. Each rank writes its pid to ``folder`` first."""
    import os

    (Path(folder) / f"rank{rank}").write_text(str(os.getpid()))
    if how == "hangs":
        time.sleep(600)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 0 then fails with Gloo's "Connection reset by peer"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["exits", "hangs"])
def test_a_rank_that_dies_or_hangs_is_named_and_every_rank_is_stopped(how: str, tmp_path: Path) -> None:
    """A rank that ends without a result is named, with its exit code, ahead of the error it
    caused in its peer (Gloo's, which names neither); a hang is stopped at the timeout with
    no grace per rank (5 s each before: a 5 s timeout at 2 ranks took 15 s); either way no
    rank process is left running."""
    start = time.monotonic()
    with pytest.raises(RankFailure if how == "exits" else RankTimeout) as info:
        run_ranks(leaves_the_group, 2, how, str(tmp_path), timeout=30.0 if how == "exits" else 5.0)
    took = time.monotonic() - start
    text = str(info.value)
    if how == "exits":
        assert text.startswith(f"rank(s) [1] died without a result (exit code(s) [{-signal.SIGKILL} (SIGKILL)])"), text[:500]
        assert "--- rank 0 failed ---" in text, text[:500]
    else:
        assert text.startswith("ranks [0, 1] did not finish within 5s"), text[:500]
        assert took < 5.0 + 5.0, f"a 5 s timeout took {took:.1f} s"
    pids = [int((tmp_path / f"rank{r}").read_text()) for r in range(2)]
    assert not [pid for pid in pids if _alive(pid)], f"rank processes {pids} left running"


# ============================================================== world of one, bad arguments

def solo_worker(rank: int, world: int) -> dict:
    model = many_tensor_model(SEED)
    loss_of(model, batch_for(model, rank, 0)).backward()
    snap = snapshot(model)
    reducer = fastreduce.FusedReducer(model, wire_dtype=torch.float32)
    reducer.reduce()
    fastreduce.all_reduce_gradients(model)
    bad = {
        "wire_int32": lambda: fastreduce.FusedReducer(model, wire_dtype=torch.int32),
        "backend_unknown": lambda: fastreduce.FusedReducer(model, backend="tpu"),
        "unused_unknown": lambda: fastreduce.FusedReducer(model, unused_grads="ignore"),
        "function_wire_int32": lambda: fastreduce.all_reduce_gradients(model, torch.int32),
        "not_a_module": lambda: fastreduce.FusedReducer(torch.zeros(3)),
    }
    return {"changed": changed_since(snap, model), "calls": reducer.stats.calls,
            "bad": {name: expect_raises((ValueError, TypeError), fn) for name, fn in bad.items()}}


@pytest.fixture(scope="module")
def solo() -> dict:
    (out,) = spawn(solo_worker, 1)
    return out


def test_world_of_one_is_a_no_op(solo) -> None:
    assert solo["changed"] == []
    assert solo["calls"] == 0


@pytest.mark.parametrize("name, exc, needle", [
    ("wire_int32", "ValueError", "wire_dtype"),
    ("backend_unknown", "ValueError", "unknown backend 'tpu'"),
    ("unused_unknown", "ValueError", "unused_grads"),
    ("function_wire_int32", "ValueError", "wire_dtype"),
    ("not_a_module", "TypeError", "torch.nn.Module"),
])
def test_bad_arguments_raise(solo, name, exc, needle) -> None:
    res = solo["bad"][name]
    assert res["raised"] == exc, res["message"]
    assert needle in res["message"]


def test_no_process_group_is_a_clear_error() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_distributed"):
        fastreduce.FusedReducer(torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="init_distributed"):
        fastreduce.all_reduce_gradients(torch.nn.Linear(2, 2))


# ============================================================== graph contract (in process)

def test_checked_backend_fails_replay_after_reallocation() -> None:
    """A captured fn that reads a tensor swapped for a new allocation must fail its replay,
    as a real graph would silently read the old address."""
    backend = CheckedBackend()
    dst = torch.zeros(4)
    src = {"t": torch.ones(4)}
    replay = backend.capture(lambda: dst.copy_(src["t"]))
    assert torch.equal(dst, torch.zeros(4))  # capture records, does not run
    replay()
    assert torch.equal(dst, torch.ones(4)) and backend.replays == 1
    old = src["t"]  # kept alive so the allocator cannot hand out the same address
    src["t"] = torch.full((4,), 2.0)
    assert src["t"].data_ptr() != old.data_ptr()
    with pytest.raises(GraphContractError, match="touches memory the capture did not"):
        replay()
    assert torch.equal(dst, torch.ones(4)) and backend.replays == 1  # checked before writing
    src["t"] = old
    replay()  # the original address is fine again
    assert backend.replays == 2


def test_checked_backend_rejects_allocating_capture() -> None:
    out = torch.zeros(3)
    with pytest.raises(GraphContractError, match="allocates"):
        CheckedBackend().capture(lambda: out.copy_(out + 1))


def test_checked_backend_rejects_different_op_count() -> None:
    buf = torch.zeros(3)
    calls = {"n": 1}

    def fn() -> None:
        for _ in range(calls["n"]):
            buf.add_(1)

    replay = CheckedBackend().capture(fn)
    calls["n"] = 2
    with pytest.raises(GraphContractError):
        replay()


def hook_count_worker(rank: int, world: int) -> list[int]:
    """Post-accumulate-grad hooks per parameter: none while the loop zeroes with
    reducer.zero_grad(), one each from the first zero_grad(set_to_none=True) on."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    reducer = fastreduce.FusedReducer(model, wire_dtype=torch.float32)
    counts = []
    for zero in ("reducer", "reducer", "none", "none"):
        model(torch.randn(3, 4)).sum().backward()
        reducer.reduce()
        zero_grads(model, zero, reducer)
        model(torch.randn(3, 4))  # the forward that re-attaches (after set_to_none)
        counts.append(max(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters()))
        model.zero_grad(set_to_none=False)
    return counts


def test_fused_mode_adds_grad_hooks_only_once_grads_are_set_to_none() -> None:
    for counts in spawn(hook_count_worker, 2):
        assert counts == [0, 0, 1, 1], counts
