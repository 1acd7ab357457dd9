"""The overlapped mode (``FusedReducer(..., overlap=True)``) on real Gloo process groups.

Same structure as test_fused.py, whose helpers it reuses: a module-scoped fixture spawns
one group per world size and runs every sub-case in it (each through ``guarded``, so a
broken sub-case fails its own tests only); the tests assert on the returned per-rank
results, here in the parent.

* worlds 2 and 3: DDP parity (fp32 / bf16 wire, 1 and 4 micro-steps, three ways of
  zeroing), a mixed-dtype model, parameters without a gradient, a changed backward order;
* world 2 only: no_sync, a second backward, when each bucket launches, op counts,
  profiler ranges, rebuild(), training;
* world 1: overlap=True is a no-op.

In overlap mode the all-reduces start during backward, so a rank must not read its own
grads between backward and finish(): gradient scales (for the tolerances) and manual
references are computed on a plain local copy of the model, which is never updated.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close

import fastreduce
import fastreduce.backends
from fastreduce.compat import gloo_has_avg
from fastreduce.layout import ALIGN

from models import (batch_for, branch_model, linear_stack, loss_of, many_tensor_model,
                    mixed_dtype_model, skip_model)
from test_fused import (SEED, WIRES, OpRecorder, assert_grads_close, assert_steps_identical_on_ranks,
                        assert_steps_match_ddp, changed_since, ddp_zero,
                        expect_raises, grad_scale, grads_are_views, grads_of, guarded,
                        make_optimizer, per_rank, skipped, snapshot, spawn, zero_grads)

STEPS = 3
ACCUM = 4
# ManyTensorModel has ~39 KB of fp32 grads: 4 KB buckets give ~10 buckets (~5 on a bf16
# wire). The small models (a few KB) get 256-byte buckets: a few parameters each.
BUCKET_MB = 4096 / 2**20
SMALL_BUCKET_MB = 256 / 2**20
SPAWN_TIMEOUT = 120.0  # per spawned group; each finishes in seconds when the machine is idle

pytestmark = pytest.mark.timeout(240)


# ============================================================== helpers run in ranks

Micro = list[tuple[tuple, dict]]  # one accumulation window: (inputs, forward kwargs) per micro-step


def run_window(model: torch.nn.Module, micro: Micro, no_sync: Callable[[], Any]) -> None:
    """Backward over every micro-step of ``micro``, all but the last under ``no_sync()``."""
    for i, (inputs, kwargs) in enumerate(micro):
        with no_sync() if i + 1 < len(micro) else contextlib.nullcontext():
            loss_of(model, inputs, **kwargs).backward()


def local_grads(plain: torch.nn.Module, micro: Micro) -> None:
    """This rank's own accumulated grads of ``micro``, on a copy no reducer touches."""
    plain.zero_grad(set_to_none=True)
    run_window(plain, micro, contextlib.nullcontext)


def window(model: torch.nn.Module, rank: int, step: int, accum: int,
           kwargs: Callable[[int], dict] = lambda k: {}) -> Micro:
    """Micro-step ``k`` of the run gets ``batch_for(model, rank, k)`` and ``kwargs(k)``."""
    return [(batch_for(model, rank, k), kwargs(k)) for k in range(step * accum, (step + 1) * accum)]


class ReadyOrder:
    """Names of ``model``'s parameters in the order their grads became ready in backward."""

    def __init__(self, model: torch.nn.Module):
        self.names: list[str] = []
        self.handles = [p.register_post_accumulate_grad_hook(lambda _, n=n: self.names.append(n))
                        for n, p in model.named_parameters()]

    def take(self) -> list[str]:
        """The order since the last call, each name once (accumulation repeats them)."""
        names, self.names = self.names, []
        return list(dict.fromkeys(names))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class LogRecords(logging.Handler):
    """fastreduce's log records inside a rank (pytest's caplog cannot reach a child process)."""

    def __init__(self, name: str = "fastreduce"):
        super().__init__(logging.DEBUG)
        self.logger = logging.getLogger(name)
        self.records: list[tuple[str, str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.name, record.levelname, record.getMessage()))

    def __enter__(self) -> LogRecords:
        self.old_level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.old_level)


def hook_counts(model: torch.nn.Module) -> list[int]:
    """Post-accumulate-grad hooks registered on each parameter."""
    return [len(p._post_accumulate_grad_hooks or ()) for p in model.parameters()]


def overlapped(model: torch.nn.Module, wire: str, bucket_mb: float, **config: Any) -> fastreduce.FusedReducer:
    return fastreduce.FusedReducer(model, wire_dtype=WIRES[wire], overlap=True, bucket_mb=bucket_mb, **config)


def shm_started(reducer: fastreduce.FusedReducer) -> int | None:
    """Shared-memory jobs the reducer has queued so far, or None on the process group's
    transport. Those jobs run on a worker thread, which an OpRecorder does not see, so
    this is the launch witness where the recorder's c10d ops are not."""
    shm = reducer._built.plan.shm if reducer._built else None
    return None if shm is None else shm.started


def launches(reducer: fastreduce.FusedReducer, rec: OpRecorder, shm_before: int | None) -> int:
    """Collectives started inside ``rec``'s window, whatever the transport."""
    now = shm_started(reducer)
    if now is not None:
        return now - (shm_before or 0)
    return rec.ops.count("c10d.allreduce_.default")


# ============================================================== parity with DDP (worlds 2, 3)

@dataclass(frozen=True)
class Case:
    wire: str
    accum: int  # micro-steps per optimizer step; all but the last under no_sync
    zero: str   # "none" | "zeros" | "reducer" (see test_fused.zero_grads)

    @property
    def id(self) -> str:
        return f"{self.wire}-accum{self.accum}-zero_{self.zero}"


PARITY_CASES = tuple(Case(w, a, z) for w in WIRES for a in (1, ACCUM) for z in ("none", "zeros", "reducer"))


def parity_case(rank: int, world: int, case: Case) -> dict:
    model = many_tensor_model(SEED)
    plain = copy.deepcopy(model)
    ddp = DDP(copy.deepcopy(model))
    order = ReadyOrder(model)
    # The checked backend fails any unpack replay that would touch memory other than the
    # reducer's persistent buffers.
    reducer = overlapped(model, case.wire, BUCKET_MB, backend="checked")
    out: dict[str, Any] = {"fr": [], "ddp": [], "scale": [], "views": [], "in_backward": []}
    for step in range(STEPS):
        micro = window(model, rank, step, case.accum)
        local_grads(plain, micro)
        out["scale"].append(grad_scale(plain))
        zero_grads(model, case.zero, reducer)
        run_window(model, micro, reducer.no_sync)
        if step == 0:
            out["ready_order"] = order.take()
            order.remove()
        reducer.finish()
        ddp.zero_grad(set_to_none=ddp_zero(case.zero))
        run_window(ddp, micro, ddp.no_sync)
        out["fr"].append(grads_of(model))
        out["ddp"].append(grads_of(ddp.module))
        out["views"].append(grads_are_views(reducer))
        out["in_backward"].append(reducer.stats.launched_in_backward)
    st = reducer.stats
    out["stats"] = (st.calls, st.collectives, st.bytes_reduced)
    out["wire_bytes"] = reducer.layout.numel * WIRES[case.wire].itemsize
    out["num_buckets"] = reducer.num_buckets
    out["layout_names"] = reducer.layout.names
    return out


MIXED_STEPS = 3


def mixed_dtype_case(rank: int, world: int, wire: str) -> dict:
    """fp32 + bf16 parameters vs a hand-written dist.all_reduce average, 2 micro-steps per
    step, zeroing alternately with set_to_none=True and False."""
    model = mixed_dtype_model(SEED)
    plain = copy.deepcopy(model)
    reducer = overlapped(model, wire, SMALL_BUCKET_MB, backend="checked")
    out: dict[str, Any] = {"fr": [], "ref": [], "scale": []}
    for step in range(MIXED_STEPS):
        micro = window(model, rank, step, 2)
        local_grads(plain, micro)
        ref = {}
        for n, p in plain.named_parameters():
            g = p.grad.to(torch.float32, copy=True)
            dist.all_reduce(g)
            ref[n] = (g / world).to(p.dtype)
        out["scale"].append(grad_scale(plain))
        model.zero_grad(set_to_none=step % 2 == 0)
        run_window(model, micro, reducer.no_sync)
        reducer.finish()
        out["fr"].append(grads_of(model))
        out["ref"].append(ref)
    out["dtypes"] = {n: p.grad.dtype for n, p in model.named_parameters()}
    out["segments"] = [seg.dtype for seg in reducer.layout.segments]
    out["num_buckets"] = reducer.num_buckets
    out["in_backward"] = reducer.stats.launched_in_backward
    return out


# ---------------------------------------------------------------- parameters without a grad

SKIP_STEPS = 5
SKIP_CASES = (Case("fp32", 1, "none"), Case("fp32", 1, "zeros"), Case("fp32", 1, "reducer"),
              Case("bf16", 1, "none"), Case("fp32", 2, "none"), Case("fp32", 2, "reducer"))
LATE = "launched at finish()"   # overlap.py's note that some buckets waited for finish()
NO_GRAD = "got no gradient"     # fused.py's warning about parameters without a grad


def skip_case(rank: int, world: int, case: Case) -> dict:
    """SkipModel, whose forward leaves layers out (some on every rank, some on some ranks,
    ``never`` always): test_fused.skipped() decides per micro-step and rank."""
    fastreduce.backends.eager._warned.clear()  # warn_once remembers per process: start each case afresh
    model = skip_model(SEED)
    plain = copy.deepcopy(model)
    ddp = DDP(copy.deepcopy(model), find_unused_parameters=True)
    out: dict[str, Any] = {"fr": [], "ddp": [], "scale": []}
    with LogRecords() as logs:
        reducer = overlapped(model, case.wire, SMALL_BUCKET_MB, unused_grads="zero")
        for step in range(SKIP_STEPS):
            micro = window(model, rank, step, case.accum, lambda k: {"skip": skipped(k, rank)})
            local_grads(plain, micro)
            out["scale"].append(grad_scale(plain))
            zero_grads(model, case.zero, reducer)
            run_window(model, micro, reducer.no_sync)
            reducer.finish()
            ddp.zero_grad(set_to_none=ddp_zero(case.zero))
            run_window(ddp, micro, ddp.no_sync)
            out["fr"].append(grads_of(model))
            out["ddp"].append(grads_of(ddp.module))
    out["messages"] = logs.records
    out["num_buckets"] = reducer.num_buckets
    out["in_backward"] = reducer.stats.launched_in_backward
    return out


# ---------------------------------------------------------------- changed backward order

FLIP_STEPS = 4


def flipped(step: int, rank: int) -> bool:
    """BranchModel's order: as learned on step 0, flipped everywhere on odd steps, and on
    step 2 flipped on rank 1 only (ranks disagree on the order within one step)."""
    return step % 2 == 1 or (step == 2 and rank == 1)


def branch_step(out: dict[str, Any], micro: Micro, model: torch.nn.Module, plain: torch.nn.Module,
                ddp: DDP, order: ReadyOrder, reducer: fastreduce.FusedReducer) -> None:
    """One BranchModel step through fastreduce and DDP; appends grads, scale and order."""
    local_grads(plain, micro)
    out["scale"].append(grad_scale(plain))
    zero_grads(model, "reducer", reducer)
    run_window(model, micro, reducer.no_sync)
    out["orders"].append(order.take())
    reducer.finish()
    ddp.zero_grad(set_to_none=False)
    run_window(ddp, micro, ddp.no_sync)
    out["fr"].append(grads_of(model))
    out["ddp"].append(grads_of(ddp.module))


def flip_case(rank: int, world: int, wire: str) -> dict:
    model = branch_model(SEED)
    plain = copy.deepcopy(model)
    ddp = DDP(copy.deepcopy(model))
    order = ReadyOrder(model)
    reducer = overlapped(model, wire, SMALL_BUCKET_MB)
    out: dict[str, Any] = {"fr": [], "ddp": [], "scale": [], "orders": []}
    for step in range(FLIP_STEPS):
        micro = window(model, rank, step, 1, lambda k: {"flip": flipped(k, rank)})
        branch_step(out, micro, model, plain, ddp, order, reducer)
    out["layout_names"] = reducer.layout.names
    out["num_buckets"] = reducer.num_buckets
    out["in_backward"] = reducer.stats.launched_in_backward
    return out


# ============================================================== one mechanism each (world 2)

def warm_up(model: torch.nn.Module, reducer: fastreduce.FusedReducer, rank: int, steps: int = 2) -> None:
    """Learn the order (first step) and run warm steps; grads stay views."""
    for step in range(steps):
        reducer.zero_grad()
        loss_of(model, batch_for(model, rank, step)).backward()
        reducer.finish()


def stats_tuple(reducer: fastreduce.FusedReducer) -> tuple:
    st = reducer.stats
    return (st.calls, st.collectives, st.bytes_reduced, st.launched_in_backward)


def no_sync_case(rank: int, world: int) -> dict:
    model = many_tensor_model(SEED)
    plain = copy.deepcopy(model)
    reducer = overlapped(model, "fp32", BUCKET_MB)
    warm_up(model, reducer, rank)
    micro = [batch_for(model, rank, 10 + i) for i in range(3)]
    reducer.zero_grad()
    before = stats_tuple(reducer)
    quiet, synced = OpRecorder(), OpRecorder()
    shm0 = shm_started(reducer)
    with quiet:
        with reducer.no_sync():
            for inputs in micro[:2]:
                loss_of(model, inputs).backward()
            inside = expect_raises(RuntimeError, reducer.reduce)  # an error: it would average nothing
    after_no_sync = stats_tuple(reducer)
    quiet_launches, shm1 = launches(reducer, quiet, shm0), shm_started(reducer)
    plain.zero_grad(set_to_none=True)
    for inputs in micro[:2]:
        loss_of(plain, inputs).backward()
    untouched = [n for (n, p), q in zip(model.named_parameters(), plain.parameters())
                 if not torch.equal(p.grad, q.grad)]
    with synced:
        loss_of(model, micro[2]).backward()
        reducer.finish()
    synced_launches = launches(reducer, synced, shm1)
    after = stats_tuple(reducer)
    loss_of(plain, micro[2]).backward()
    ref = {}
    for n, p in plain.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        ref[n] = g / world
    return {"before": before, "after_no_sync": after_no_sync, "after": after,
            "quiet_launches": quiet_launches, "synced_launches": synced_launches,
            "quiet_c10d": [op for op in quiet.ops if op.startswith("c10d.")],
            "synced_c10d": Counter(op for op in synced.ops if op.startswith("c10d.")),
            "not_local": untouched, "num_buckets": reducer.num_buckets, "shm": shm0 is not None,
            "inside": inside,
            "fr": grads_of(model), "ref": ref, "scale": grad_scale(plain)}


def second_backward_case(rank: int, world: int) -> dict:
    """A second backward in one step, outside no_sync: a clear error (raised by a hook,
    from inside autograd), and the reducer still works after finish()."""
    model = many_tensor_model(SEED)
    reducer = overlapped(model, "fp32", BUCKET_MB)
    warm_up(model, reducer, rank)
    reducer.zero_grad()
    loss_of(model, batch_for(model, rank, 2)).backward()
    res = expect_raises(RuntimeError, lambda: loss_of(model, batch_for(model, rank, 3)).backward())
    reducer.finish()  # waits for the buckets the first backward launched
    warm_up(model, reducer, rank, steps=1)
    return res | {"calls": reducer.stats.calls}


def missing_grad_case(rank: int, world: int) -> dict:
    """A step where a layer got no gradient on every rank (unused_grads="error", the
    default): reduce() raises naming it, and the steps after it average as DDP does (the
    schedule was left mid-step: every later backward failed, "a second gradient")."""
    model = skip_model(SEED, with_never=False)
    ddp = DDP(copy.deepcopy(model))
    reducer = overlapped(model, "fp32", SMALL_BUCKET_MB)
    out: dict[str, Any] = {"fr": [], "ddp": []}
    for step in range(5):
        micro = window(model, rank, step, 1, lambda k: {"skip": {"sometimes"} if k == 2 else set()})
        zero_grads(model, "none", reducer)
        run_window(model, micro, reducer.no_sync)
        if step == 2:
            out["raised"] = expect_raises(RuntimeError, reducer.reduce)
            continue
        reducer.reduce()
        ddp.zero_grad(set_to_none=True)
        run_window(ddp, micro, ddp.no_sync)
        out["fr"].append(grads_of(model))
        out["ddp"].append(grads_of(ddp.module))
    return out


TIMING_MODELS = {"many": (many_tensor_model, BUCKET_MB), "mixed": (mixed_dtype_model, SMALL_BUCKET_MB)}
TIMING_CASES = tuple(f"{m}-{w}" for m in TIMING_MODELS for w in WIRES)


def launch_timing_case(rank: int, world: int, case: str) -> dict:
    """When each grad becomes ready in a warm step (same order as the learned one), how
    many all-reduces have started: read by a hook registered after the reducer's, so it
    runs right after the reducer's hook for the same parameter."""
    model_name, wire = case.split("-")
    make, bucket_mb = TIMING_MODELS[model_name]
    model = make(SEED)
    reducer = overlapped(model, wire, bucket_mb)
    warm_up(model, reducer, rank, steps=1)  # learns the order, installs the reducer's hooks
    names = {p: n for n, p in model.named_parameters()}
    seen: list[tuple[str, int]] = []
    rec = OpRecorder()
    shm0 = shm_started(reducer)
    handles = [p.register_post_accumulate_grad_hook(
        lambda q: seen.append((names[q], launches(reducer, rec, shm0))))
        for p in model.parameters()]
    reducer.zero_grad()
    loss = loss_of(model, batch_for(model, rank, 1))
    with rec:
        loss.backward()
    reducer.finish()
    for h in handles:
        h.remove()
    layout_names = reducer.layout.names
    return {"seen": seen, "num_buckets": reducer.num_buckets,
            "buckets": [[layout_names[i] for i in b.slots] for b in reducer._built.schedule.buckets]}


OPS_BUCKETS = 4
OPS_TENSORS = (50, 500)
OPS_ZEROS = ("reducer", "none")


def traced_step(model: torch.nn.Module, rank: int, zero: str,
                reducer: fastreduce.FusedReducer | None) -> Counter:
    """Ops dispatched by backward (+ finish) of the third step; the first two warm up."""
    for step in range(3):
        zero_grads(model, zero, reducer)
        loss = loss_of(model, batch_for(model, rank, step))
        with OpRecorder() if step == 2 else contextlib.nullcontext() as rec:
            loss.backward()
            if reducer is not None:
                reducer.finish()
    return Counter(rec.ops)


def op_count_case(rank: int, world: int) -> dict:
    """Per (wire, zero mode, tensors): the ops fastreduce adds to a warm backward + finish,
    i.e. the ops of the step minus those of the same backward on a model without reducer.
    bucket_mb is chosen so both stacks get OPS_BUCKETS buckets."""
    out = {}
    for wire in WIRES:
        for zero in OPS_ZEROS:
            for tensors in OPS_TENSORS:
                wire_bytes = tensors * ALIGN * WIRES[wire].itemsize  # Linear(4, 4): every tensor pads to ALIGN
                model = linear_stack(SEED, tensors)
                reducer = overlapped(model, wire, wire_bytes / OPS_BUCKETS / 2**20)
                with_reducer = traced_step(model, rank, zero, reducer)
                # set_to_none grads come back as zeroed views at forward: backward then
                # accumulates in place, as the bare model does after zero_grad(set_to_none=False)
                bare = traced_step(linear_stack(SEED, tensors), rank, "zeros" if zero == "none" else zero, None)
                out[(wire, zero, tensors)] = {"added": with_reducer - bare, "dropped": bare - with_reducer,
                                              "shm": shm_started(reducer) is not None,
                                              "num_buckets": reducer.num_buckets,
                                              "in_backward": reducer.stats.launched_in_backward}
    return out


def profiler_case(rank: int, world: int) -> dict:
    model = linear_stack(SEED, 20)
    reducer = overlapped(model, "bf16", SMALL_BUCKET_MB)
    warm_up(model, reducer, rank)
    reducer.zero_grad()
    loss = loss_of(model, batch_for(model, rank, 5))
    # The shared-memory transport packs, averages and unpacks on its worker thread:
    # a profile shows that thread's ranges when asked to record every thread.
    try:
        config = torch.profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # older torch: only this thread's ranges are recorded
        config = None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                experimental_config=config) as prof:
        with OpRecorder() as on:
            loss.backward()
            reducer.finish()
    names = Counter(e.name for e in prof.events() if e.name.startswith("fastreduce::"))
    reducer.zero_grad()
    loss = loss_of(model, batch_for(model, rank, 6))
    shm0 = shm_started(reducer)
    with OpRecorder() as off:
        loss.backward()
        reducer.finish()
    launched_off = launches(reducer, off, shm0)
    return {"names": dict(names), "num_buckets": reducer.num_buckets, "shm": shm0 is not None,
            "all_threads": config is not None,
            "profiler_ops_on": [op for op in on.ops if op.startswith("profiler.")],
            "profiler_ops_off": [op for op in off.ops if op.startswith("profiler.")],
            "launched_off": launched_off}


REBUILD_STEPS = 3  # before and after the rebuild


def rebuild_case(rank: int, world: int) -> dict:
    """BranchModel in one order for REBUILD_STEPS steps, then rebuild() and the other order."""
    model = branch_model(SEED)
    plain = copy.deepcopy(model)
    ddp = DDP(copy.deepcopy(model))
    order = ReadyOrder(model)
    reducer = overlapped(model, "fp32", SMALL_BUCKET_MB)
    out: dict[str, Any] = {"fr": [], "ddp": [], "scale": [], "orders": []}
    for step in range(2 * REBUILD_STEPS):
        if step == REBUILD_STEPS:
            out["before"] = {"layout_names": reducer.layout.names, "num_buckets": reducer.num_buckets,
                             "in_backward": reducer.stats.launched_in_backward}
            reducer.rebuild()
        micro = window(model, rank, step, 1, lambda k: {"flip": k >= REBUILD_STEPS})
        branch_step(out, micro, model, plain, ddp, order, reducer)
    out["after"] = {"layout_names": reducer.layout.names, "num_buckets": reducer.num_buckets,
                    "in_backward": reducer.stats.launched_in_backward, "calls": reducer.stats.calls}
    out["hooks"] = hook_counts(model)  # ReadyOrder's + the reducer's
    order.remove()
    return out


def rebuild_first_case(rank: int, world: int) -> dict:
    """rebuild() before the first reduce: afterwards each parameter holds one hook, the schedule's."""
    model = many_tensor_model(SEED)
    reducer = overlapped(model, "fp32", BUCKET_MB)
    reducer.rebuild()
    warm_up(model, reducer, rank, steps=3)
    return {"hooks": hook_counts(model), "in_backward": reducer.stats.launched_in_backward,
            "num_buckets": reducer.num_buckets}


def frozen_after_build_case(rank: int, world: int) -> dict:
    """Layers frozen after the reducer was built, before the first backward (as a fine-tuning
    script does): the order the first step records is mapped onto the parameters trainable
    then, the frozen ones left out, and every step averages the rest."""
    model = many_tensor_model(SEED)
    plain = copy.deepcopy(model)  # (the overlapped grads are averaged in place as backward runs)
    reducer = overlapped(model, "fp32", SMALL_BUCKET_MB)
    for m in (model, plain):
        m.conv.requires_grad_(False)
        m.norms[0].requires_grad_(False)
    worst = 0.0
    for step in range(3):
        for m in (model, plain):
            m.zero_grad(set_to_none=True)
            loss_of(m, batch_for(m, rank, step)).backward()
        reducer.reduce()
        for (n, p), q in zip(model.named_parameters(), plain.parameters()):
            if p.requires_grad:
                dist.all_reduce(q.grad)
                worst = max(worst, float((p.grad - q.grad / world).abs().max()))
    return {"worst": worst, "layout": reducer.layout.names, "in_backward": reducer.stats.launched_in_backward,
            "num_buckets": reducer.num_buckets,
            "frozen_grads": [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]}


TRAIN_STEPS = 5
TRAIN_CASES = {"reducer-accum1": ("reducer", 1), "none-accum2": ("none", 2)}  # zero mode, micro-steps


def train_case(rank: int, world: int, name: str) -> dict:
    """TRAIN_STEPS AdamW steps, overlapped fp32 wire vs DDP, from the same start."""
    zero, accum = TRAIN_CASES[name]
    model = many_tensor_model(SEED)
    ddp = DDP(copy.deepcopy(model))
    reducer = overlapped(model, "fp32", BUCKET_MB)
    opt, ddp_opt = make_optimizer("adamw", model), make_optimizer("adamw", ddp)
    for step in range(TRAIN_STEPS):
        micro = window(model, rank, step, accum)
        zero_grads(model, zero, reducer)
        run_window(model, micro, reducer.no_sync)
        reducer.finish()
        opt.step()
        ddp_opt.zero_grad(set_to_none=ddp_zero(zero))
        run_window(ddp, micro, ddp.no_sync)
        ddp_opt.step()
    return {"fr": {n: p.detach().clone() for n, p in model.named_parameters()},
            "ddp": {n: p.detach().clone() for n, p in ddp.module.named_parameters()},
            "in_backward": reducer.stats.launched_in_backward, "num_buckets": reducer.num_buckets}


# ============================================================== workers and fixtures

def overlap_worker(rank: int, world: int) -> dict:
    out = {f"parity-{c.id}": guarded(parity_case, rank, world, c) for c in PARITY_CASES}
    out.update({f"mixed-{w}": guarded(mixed_dtype_case, rank, world, w) for w in WIRES})
    out.update({f"skip-{c.id}": guarded(skip_case, rank, world, c) for c in SKIP_CASES})
    out.update({f"flip-{w}": guarded(flip_case, rank, world, w) for w in WIRES})
    if world == 2:  # one mechanism each: one world is enough
        out["no_sync"] = guarded(no_sync_case, rank, world)
        out["second_backward"] = guarded(second_backward_case, rank, world)
        out["missing_grad"] = guarded(missing_grad_case, rank, world)
        out["ops"] = guarded(op_count_case, rank, world)
        out.update({f"timing-{c}": guarded(launch_timing_case, rank, world, c) for c in TIMING_CASES})
        out["profiler"] = guarded(profiler_case, rank, world)
        out["rebuild"] = guarded(rebuild_case, rank, world)
        out["rebuild_first"] = guarded(rebuild_first_case, rank, world)
        out["frozen_after_build"] = guarded(frozen_after_build_case, rank, world)
        out.update({f"train-{n}": guarded(train_case, rank, world, n) for n in TRAIN_CASES})
    return out


@pytest.fixture(scope="module")
def groups() -> Callable[[int], list[dict]]:
    """Spawns each world's group once, on first use."""
    cache: dict[int, list[dict]] = {}

    def get(world: int) -> list[dict]:
        if world not in cache:
            cache[world] = spawn(overlap_worker, world, timeout=SPAWN_TIMEOUT)
        return cache[world]

    return get


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def worlds(request, groups) -> tuple[int, list[dict]]:
    return request.param, groups(request.param)


@pytest.fixture(scope="module")
def w2(groups) -> list[dict]:
    return groups(2)


# ============================================================== 1. parity with DDP

@pytest.mark.parametrize("case", PARITY_CASES, ids=lambda c: c.id)
def test_grads_match_ddp(worlds, case: Case) -> None:
    """fp32 wire to 1e-6 relative, bf16 within its rounding (test_fused.TOL), with and
    without accumulation (DDP uses its own no_sync), however grads are zeroed."""
    world, results = worlds
    assert_steps_match_ddp(per_rank(results, f"parity-{case.id}"), world, case.wire, STEPS)


@pytest.mark.parametrize("case", PARITY_CASES, ids=lambda c: c.id)
def test_every_rank_holds_the_same_grads(worlds, case: Case) -> None:
    _, results = worlds
    assert_steps_identical_on_ranks(per_rank(results, f"parity-{case.id}"), STEPS)


@pytest.mark.parametrize("case", PARITY_CASES, ids=lambda c: c.id)
def test_buckets_launch_during_backward_after_first_step(worlds, case: Case) -> None:
    """The first step learns the order and reduces everything at finish(); on every later
    step each of the (several) buckets starts from a hook during backward."""
    _, results = worlds
    for out in per_rank(results, f"parity-{case.id}"):
        nb = out["num_buckets"]
        assert nb > 1
        assert out["in_backward"] == [step * nb for step in range(STEPS)]


@pytest.mark.parametrize("case", PARITY_CASES, ids=lambda c: c.id)
def test_one_reduction_per_accumulation_window(worlds, case: Case) -> None:
    """Micro-steps under no_sync communicate nothing: one call, one collective per bucket
    and the wire buffer's bytes once per step, whatever the number of micro-steps."""
    _, results = worlds
    for out in per_rank(results, f"parity-{case.id}"):
        nb = out["num_buckets"]
        assert out["stats"] == (STEPS, STEPS * nb, STEPS * out["wire_bytes"])


def test_buffer_laid_out_in_backward_order(worlds) -> None:
    """Every rank lays the buffer out in rank 0's first-step backward order, and after
    every finish() each grad is a view of that buffer."""
    _, results = worlds
    for case in PARITY_CASES:
        outs = per_rank(results, f"parity-{case.id}")
        for rank, out in enumerate(outs):
            assert list(out["layout_names"]) == outs[0]["ready_order"], f"{case.id} rank {rank}"
            assert out["views"] == [True] * STEPS, f"{case.id} rank {rank}"


@pytest.mark.parametrize("wire", list(WIRES))
def test_mixed_dtype_model_matches_manual_all_reduce(worlds, wire) -> None:
    world, results = worlds
    for rank, out in enumerate(per_rank(results, f"mixed-{wire}")):
        assert out["dtypes"]["mid.0.weight"] == torch.bfloat16  # grads keep their own dtypes
        assert out["dtypes"]["inp.weight"] == torch.float32
        assert set(out["segments"]) == {torch.bfloat16, torch.float32}
        assert out["num_buckets"] > 2
        assert out["in_backward"] == (MIXED_STEPS - 1) * out["num_buckets"]
        for step in range(MIXED_STEPS):
            for name, want in out["ref"][step].items():
                # fp32 only where both the grad and the wire are fp32.
                tol = "fp32" if want.dtype == torch.float32 and wire == "fp32" else "bf16"
                assert_grads_close({name: out["fr"][step][name]}, {name: want}, out["scale"][step],
                                   tol, f"world {world} rank {rank} step {step}")


# ============================================================== 3. parameters without a grad

@pytest.mark.parametrize("case", SKIP_CASES, ids=lambda c: c.id)
def test_unused_params_match_ddp_find_unused(worlds, case: Case) -> None:
    """unused_grads="zero": a missing grad counts as zero, as with DDP's
    find_unused_parameters=True, including grad=None where no rank produced one. The group
    finishing at all shows nothing hung."""
    world, results = worlds
    for rank, out in enumerate(per_rank(results, f"skip-{case.id}")):
        for step in range(SKIP_STEPS):
            assert_grads_close(out["fr"][step], out["ddp"][step], out["scale"][step], case.wire,
                               f"world {world} rank {rank} step {step}")


def test_param_no_rank_used_keeps_grad_none(worlds) -> None:
    _, results = worlds
    for case in SKIP_CASES:
        for rank, out in enumerate(per_rank(results, f"skip-{case.id}")):
            for step in range(SKIP_STEPS):
                for name in ("never.weight", "never.bias"):
                    assert out["fr"][step][name] is None, f"{case.id} rank {rank} step {step}: {name}"
            if case.accum == 1:  # skipped everywhere on step 0
                assert out["fr"][0]["sometimes.weight"] is None, case.id


def test_unused_params_delay_buckets_to_finish(worlds) -> None:
    """The bucket holding a parameter without a grad (``never`` always) cannot launch from a
    hook, nor can the buckets after it: they are launched at finish()."""
    _, results = worlds
    for case in SKIP_CASES:
        for rank, out in enumerate(per_rank(results, f"skip-{case.id}")):
            nb = out["num_buckets"]
            assert nb > 2, case.id
            assert 0 < out["in_backward"] < (SKIP_STEPS - 1) * nb, f"{case.id} rank {rank}"


def test_late_buckets_logged_once(worlds) -> None:
    """Buckets waiting for finish() on every warm step: one clear message per rank."""
    _, results = worlds
    for case in SKIP_CASES:
        for rank, out in enumerate(per_rank(results, f"skip-{case.id}")):
            late = [msg for _, _, msg in out["messages"] if LATE in msg]
            assert len(late) == 1, f"{case.id} rank {rank}: {late}"
            assert "unused parameters or a changed backward order" in late[0]


def test_missing_grad_warning_logged_once(worlds) -> None:
    """Parameters without a grad are reported once per rank ("log once"), not once per
    bucket that holds some, nor again whenever their number or first name changes."""
    _, results = worlds
    for case in SKIP_CASES:
        for rank, out in enumerate(per_rank(results, f"skip-{case.id}")):
            warned = [msg for _, _, msg in out["messages"] if NO_GRAD in msg]
            assert len(warned) == 1, f"{case.id} rank {rank}: {len(warned)} warnings:\n" + "\n".join(warned)


# ============================================================== 4. changed backward order

@pytest.mark.parametrize("wire", list(WIRES))
def test_changed_backward_order_matches_ddp(worlds, wire) -> None:
    world, results = worlds
    for rank, out in enumerate(per_rank(results, f"flip-{wire}")):
        for step in range(FLIP_STEPS):
            assert_grads_close(out["fr"][step], out["ddp"][step], out["scale"][step], wire,
                               f"world {world} rank {rank} step {step}")


@pytest.mark.parametrize("wire", list(WIRES))
def test_changed_backward_order_still_launches_in_backward(worlds, wire) -> None:
    """The flipped steps really deliver grads in another order (and on step 2 the ranks
    disagree); launches stay in bucket order, so they are only delayed, and since every
    grad arrives during backward every bucket still starts there."""
    _, results = worlds
    outs = per_rank(results, f"flip-{wire}")
    for rank, out in enumerate(outs):
        orders = out["orders"]
        assert sorted(orders[0]) == sorted(orders[1]) and orders[0] != orders[1]
        for step in range(FLIP_STEPS):
            assert orders[step] == (orders[1] if flipped(step, rank) else orders[0]), f"rank {rank} step {step}"
        assert list(out["layout_names"]) == outs[0]["orders"][0]
        assert out["num_buckets"] > 2
        assert out["in_backward"] == (FLIP_STEPS - 1) * out["num_buckets"]


@pytest.mark.parametrize("case", TIMING_CASES)
def test_each_bucket_launches_when_its_last_grad_is_ready(w2, case) -> None:
    """In a warm step whose backward order is the learned one, right after each grad is
    ready exactly the buckets whose grads are all ready have started: none waits for a
    bucket whose grads come later, across dtype segments too (mixed-dtype model)."""
    for rank, out in enumerate(per_rank(w2, f"timing-{case}")):
        order = [name for name, _ in out["seen"]]
        pos = {name: k for k, name in enumerate(order)}
        assert sorted(order) == sorted(n for b in out["buckets"] for n in b)
        ready_at = [max(pos[n] for n in b) for b in out["buckets"]]  # when each bucket is complete
        got = [launched for _, launched in out["seen"]]
        want = [sum(r <= k for r in ready_at) for k in range(len(order))]
        assert got == want, (f"rank {rank}: buckets (launch order) become complete at backward "
                             f"positions {ready_at}; all-reduces started after each grad: {got}, "
                             f"expected {want}")


# ============================================================== 2. no_sync

def test_no_sync_communicates_nothing(w2) -> None:
    for rank, out in enumerate(per_rank(w2, "no_sync")):
        assert out["quiet_c10d"] == []  # no collective from the hooks or the refused reduce()
        assert out["inside"]["raised"] == "RuntimeError", out["inside"]
        assert "inside no_sync()" in out["inside"]["message"], out["inside"]
        assert out["quiet_launches"] == 0
        assert out["after_no_sync"] == out["before"]
        assert out["not_local"] == []  # grads are this rank's own accumulated sums, bit for bit
        nb = out["num_buckets"]
        assert nb > 1
        assert out["synced_launches"] == nb
        assert out["synced_c10d"] == (Counter() if out["shm"] else Counter({"c10d.allreduce_.default": nb}))
        calls, collectives, nbytes, in_backward = out["before"]
        assert out["after"][:2] == (calls + 1, collectives + nb)
        assert out["after"][3] == in_backward + nb
        assert_grads_close(out["fr"], out["ref"], out["scale"], "fp32", f"rank {rank}")


# ============================================================== 5. second backward

def test_second_backward_without_no_sync_raises(w2) -> None:
    for rank, out in enumerate(per_rank(w2, "second_backward")):
        assert out["raised"] == "RuntimeError", out["message"]
        assert "no_sync" in out["message"] and "second gradient" in out["message"], out["message"]
        assert out["calls"] == 4  # two warm-up steps, the failed one, one more afterwards


def test_a_step_missing_a_gradient_raises_and_the_next_ones_average(w2) -> None:
    for rank, out in enumerate(per_rank(w2, "missing_grad")):
        assert out["raised"]["raised"] == "RuntimeError", out["raised"]
        assert "'sometimes.weight'" in out["raised"]["message"], out["raised"]["message"]
        assert len(out["fr"]) == 4
        assert_close(out["fr"], out["ddp"], rtol=0, atol=1e-6, msg=lambda m, rank=rank: f"rank {rank}: {m}")


# ============================================================== 6. hook cost

@pytest.mark.parametrize("zero", OPS_ZEROS)
@pytest.mark.parametrize("wire", list(WIRES))
def test_added_ops_do_not_grow_with_parameters(w2, wire, zero) -> None:
    """What fastreduce adds to a warm backward + finish is per bucket (cast in, adopt
    re-allocated grads, collective, cast back), never per parameter."""
    for traces in per_rank(w2, "ops"):
        small, large = (traces[(wire, zero, n)] for n in OPS_TENSORS)
        for t in (small, large):
            assert t["num_buckets"] == OPS_BUCKETS
            assert t["in_backward"] == 2 * OPS_BUCKETS  # the traced step overlapped too
            assert t["dropped"] == Counter()  # the reducer changes nothing in backward itself
            # the shared-memory transport's collectives run on its worker thread, unseen here
            assert t["added"]["c10d.allreduce_.default"] == (0 if t["shm"] else OPS_BUCKETS)
            assert sum(t["added"].values()) <= 4 * OPS_BUCKETS, t["added"]
        assert small["added"] == large["added"]


def test_fp32_wire_step_adds_only_the_collectives(w2) -> None:
    """fp32 grads on an fp32 wire with grads kept as views (reducer.zero_grad()): each
    bucket *is* its slice of the wire buffer, so a step adds the collectives and nothing
    else, as in fused mode (test_fused: no op at all besides the collective); where Gloo
    has no AVG, a divide per bucket too."""
    for traces in per_rank(w2, "ops"):
        for tensors in OPS_TENSORS:
            t = traces[("fp32", "reducer", tensors)]
            want = Counter() if t["shm"] else Counter({"c10d.allreduce_.default": OPS_BUCKETS})
            if not t["shm"] and not gloo_has_avg():  # torch < 2.8: Gloo has no AVG, divide first
                want["aten.div_.Tensor"] = OPS_BUCKETS
            assert t["added"] == want, t["added"]


# ============================================================== 7. profiler

def test_profiler_ranges_recorded_under_a_profiler(w2) -> None:
    for out in per_rank(w2, "profiler"):
        names, nb = out["names"], out["num_buckets"]
        assert nb > 1
        assert names.get("fastreduce::all_reduce") == nb, names
        if out["shm"] and not out["all_threads"]:
            pytest.skip("this torch cannot profile the shared-memory worker thread")
        assert names.get("fastreduce::pack") == nb, names  # bf16 wire: one cast in per bucket
        assert names.get("fastreduce::wait") == 1, names
        assert names.get("fastreduce::unpack") == nb, names  # each bucket unpacked once it lands
        # the shared-memory averaging, one per bucket on the worker thread
        assert names.get("fastreduce::shm_average") == (nb if out["shm"] else None), names


def test_no_record_function_without_a_profiler(w2) -> None:
    for out in per_rank(w2, "profiler"):
        assert out["profiler_ops_on"], "the recorder should see record_function's ops"
        assert out["profiler_ops_off"] == []
        assert out["launched_off"] == out["num_buckets"]  # the traced step did reduce


# ============================================================== 8. rebuild, bad bucket_mb, world 1

def test_rebuild_relearns_order_and_keeps_parity(w2) -> None:
    outs = per_rank(w2, "rebuild")
    for rank, out in enumerate(outs):
        before, after, orders = out["before"], out["after"], out["orders"]
        assert orders[0] != orders[REBUILD_STEPS]
        assert list(before["layout_names"]) == outs[0]["orders"][0]
        assert list(after["layout_names"]) == outs[0]["orders"][REBUILD_STEPS]
        assert after["calls"] == 2 * REBUILD_STEPS
        for step in range(2 * REBUILD_STEPS):
            assert_grads_close(out["fr"][step], out["ddp"][step], out["scale"][step], "fp32",
                               f"rank {rank} step {step}")
        assert out["hooks"] == [2] * len(out["hooks"])  # ReadyOrder's and the new schedule's


def test_launched_in_backward_counts_across_rebuild(w2) -> None:
    """ReducerStats are running totals (calls, collectives, bytes keep counting across
    rebuild()); launched_in_backward must not fall back when rebuild() starts a new schedule.
    Before: REBUILD_STEPS - 1 warm steps; after: the same again (first step learns)."""
    for out in per_rank(w2, "rebuild"):
        before, after = out["before"], out["after"]
        assert before["in_backward"] == (REBUILD_STEPS - 1) * before["num_buckets"]
        want = before["in_backward"] + (REBUILD_STEPS - 1) * after["num_buckets"]
        assert after["in_backward"] == want, f"{after['in_backward']} != {want}"


def test_rebuild_before_first_reduce_leaves_one_hook_per_param(w2) -> None:
    """No order recorder may stay registered (its list would grow on every backward)."""
    for out in per_rank(w2, "rebuild_first"):
        assert out["in_backward"] == 2 * out["num_buckets"]
        assert out["hooks"] == [1] * len(out["hooks"]), Counter(out["hooks"])


def test_layers_frozen_after_building_before_the_first_backward_are_left_out(w2) -> None:
    for out in per_rank(w2, "frozen_after_build"):
        assert out["worst"] < 1e-6, out["worst"]
        assert not any(n.startswith(("conv.", "norms.0.")) for n in out["layout"]), out["layout"]
        assert out["frozen_grads"] == []
        assert out["num_buckets"] > 1 and out["in_backward"] == 2 * out["num_buckets"]


def solo_worker(rank: int, world: int) -> dict:
    model = many_tensor_model(SEED)
    reducer = overlapped(model, "fp32", BUCKET_MB)
    hooks = hook_counts(model)
    loss_of(model, batch_for(model, rank, 0)).backward()
    loss_of(model, batch_for(model, rank, 1)).backward()  # no hook to object either
    snap = snapshot(model)
    with reducer.no_sync():
        inside = expect_raises(RuntimeError, reducer.reduce)  # a mistake at any world size
    reducer.finish()
    changed = changed_since(snap, model)
    reducer.zero_grad()
    bad = {mb: expect_raises(ValueError, lambda mb=mb: overlapped(model, "fp32", mb)) for mb in (0, -1.0)}
    return {"hooks": hooks, "changed": changed, "calls": reducer.stats.calls,
            "num_buckets": reducer.num_buckets, "zeroed": all(not p.grad.any() for p in model.parameters()),
            "bad": bad, "inside": inside}


@pytest.fixture(scope="module")
def solo() -> dict:
    (out,) = spawn(solo_worker, 1, timeout=SPAWN_TIMEOUT)
    return out


def test_world_of_one_is_a_no_op_without_hooks(solo) -> None:
    assert solo["hooks"] == [0] * len(solo["hooks"])
    assert solo["changed"] == []
    assert solo["calls"] == 0 and solo["num_buckets"] == 0
    assert solo["zeroed"]  # zero_grad() before any reduce still zeroes every grad
    assert solo["inside"]["raised"] == "RuntimeError" and "inside no_sync()" in solo["inside"]["message"]


@pytest.mark.parametrize("mb", [0, -1.0])
def test_bucket_mb_must_be_positive(solo, mb) -> None:
    res = solo["bad"][mb]
    assert res["raised"] == "ValueError", res["message"]
    assert "bucket_mb" in res["message"]
    with pytest.raises(ValueError, match="bucket_mb"):  # the config alone, no process group
        fastreduce.ReducerConfig(overlap=True, bucket_mb=mb)


# ============================================================== 9. training

@pytest.mark.parametrize("name", list(TRAIN_CASES))
@pytest.mark.cell("loop", "train", modes=("overlap",))
def test_training_matches_ddp(w2, name) -> None:
    outs = per_rank(w2, f"train-{name}")
    for out in outs:
        assert out["in_backward"] == (TRAIN_STEPS - 1) * out["num_buckets"]
        for n, want in out["ddp"].items():
            assert_close(out["fr"][n], want, rtol=1e-6, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    for out in outs[1:]:  # and every rank holds bit-identical params
        for n, p in outs[0]["fr"].items():
            assert torch.equal(out["fr"][n], p), n
