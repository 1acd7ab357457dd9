"""fastreduce.DecentralizedDataParallel (decentralized / gossip SGD with overlapped
communication, after decent-dp) on real Gloo process groups.

Same structure as test_zero.py: module-scoped fixtures spawn one group per world size
(``run_ranks``) and run every sub-case in it, each through ``guarded`` so a broken
sub-case fails its own tests only; the tests assert on the returned per-rank results here,
in the parent. No transport is hard-coded (``FASTREDUCE_TRANSPORT`` picks it).

The algorithm under test, with x_r rank r's parameters, G_r(k) the gradient of rank r's
loss at step k, computed at the parameters the k-th forward saw (``snap_r(k)``), and
W_t = ``topology.mixing(t)``:

* step 0: the backward traces the order; as it ends every bucket's optimizer steps on
  G(0) and the first exchange (round 0) of the updated parameters starts:
  ``snap(1) = snap(0) - lr G(0)``;
* step k >= 1: when a bucket's grads are ready its parameters become the mixed result of
  the previous exchange, then the optimizer steps with G(k) (computed before the mix):
  ``x_r(after k) = sum_j W_{k-1}[r, j] snap_j(k) - lr G_r(k)`` (plain SGD), and the exchange
  of round k starts.

The reference grads are computed independently, inside a forward pre-hook on the wrapped
model, with ``torch.func.functional_call`` on an untouched copy of the model at the
parameters the forward is about to use; the hook also snapshots those parameters. The
tests then check

* the mean over ranks evolves as plain SGD on the mean gradient (true for any doubly
  stochastic topology and any ordering of the mixes): ``mean_r snap_r(k+1) =
  mean_r snap_r(k) - lr mean_r G_r(k)``;
* the exact per-rank recursion above (the documented algorithm: which round's matrix,
  which parameters are mixed);
* lr = 0 with ranks perturbed after construction: the parameters after i backwards are
  ``W_{i-2} ... W_0`` applied to the perturbations, an exact average once
  ``consensus_rounds(N)`` mixes of ``one-peer-exp`` were applied (complete: after one);
* ``global_avg``, ``consensus_distance``, ``no_sync`` / ``set_accumulate_grad``,
  ``state_dict`` resume in a new group of processes, shared / frozen parameters, ``group=``,
  errors.

Tolerances (fp32): every comparison is against values recomputed from the ranks' own
snapshots (no long reference trajectories), so errors are a few fp32 ulps of |x| <= ~5.
"""

from __future__ import annotations

import copy
import gc
import os
import threading
import time
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

import fastreduce
from fastreduce.comm import get_comm
from fastreduce.launch import run_ranks
from fastreduce.modes.topology import consensus_rounds, make_topology

from models import batch_for, batchnorm_model, frozen_backbone_model, odd_model, skip_model, twice_model
from test_fused import expect_raises, guarded, spawn_once

SEED = 11
LR = 0.1
STEPS = 6          # trajectory steps before the global average
EXTRA = 2          # steps after it
SMALL_BUCKET_MB = 0.0002   # ~210 bytes: OddModel's 1292 bytes of fp32 params span several buckets
ATOL = 1e-6
RTOL = 1e-5
SPAWN_TIMEOUT = 120.0
EVAL_AT = 3        # an eval-mode, no_grad forward before this step's training forward

pytestmark = pytest.mark.timeout(300)

MODELS: dict[str, Callable[[int], nn.Module]] = {
    "odd": odd_model, "twice": twice_model, "frozen": frozen_backbone_model, "bn": batchnorm_model,
}

CLIP = 0.05          # below the bucket grad norms of OddModel: clipping is active
SCHED_GAMMA, SCHED_EVERY = 0.5, 3   # StepLR(step_size=3, gamma=0.5), one per bucket

# (topology, local_world_size, bucket_mb, model, grad_clip_norm, StepLR) per world size
TRAJ_CASES: dict[int, list[tuple[str, int | None, float | None, str, float, bool]]] = {
    2: [("complete", None, None, "odd", 0.0, False), ("ring", None, None, "odd", 0.0, False),
        ("complete", None, SMALL_BUCKET_MB, "odd", 0.0, False), ("ring", None, SMALL_BUCKET_MB, "twice", 0.0, False),
        ("one-peer-exp", None, None, "frozen", 0.0, False)],
    3: [("complete", None, None, "odd", 0.0, False), ("ring", None, SMALL_BUCKET_MB, "odd", 0.0, False),
        ("one-peer-exp", None, SMALL_BUCKET_MB, "odd", 0.0, False), ("complete", None, None, "twice", 0.0, False),
        ("ring", None, SMALL_BUCKET_MB, "odd", CLIP, True)],
    4: [("one-peer-exp", None, SMALL_BUCKET_MB, "odd", 0.0, False), ("alternating-exp-ring", 2, None, "odd", 0.0, False)],
    5: [("one-peer-exp", None, None, "odd", 0.0, False)],
}
CONSENSUS_CASES: dict[int, list[tuple[str, int | None]]] = {
    2: [("complete", None), ("ring", None), ("one-peer-exp", None)],
    3: [("complete", None), ("ring", None), ("one-peer-exp", None)],
    4: [("one-peer-exp", None), ("ring", None), ("alternating-exp-ring", 2)],
    5: [("one-peer-exp", None)],
}
BN_CASES = {2: ["ring"], 3: ["one-peer-exp"]}
NO_SYNC_CASES = {2: ["ring"], 3: ["one-peer-exp"]}
RESUME_CASES = {2: "ring", 3: "one-peer-exp"}
GROUP_RANKS = (1, 3)   # a 2-rank group= inside the 4-rank world


def spawn(worker: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    return run_ranks(worker, world, *args, timeout=SPAWN_TIMEOUT)


def traj_key(topology: str, lws: int | None, bucket_mb: float | None, model: str, clip: float = 0.0,
             sched: bool = False) -> str:
    return (f"{topology}-lws{lws}-{'small' if bucket_mb else 'default'}-{model}"
            + (f"-clip{clip}" if clip else "") + ("-steplr" if sched else ""))


# ============================================================== helpers run in ranks



def out_loss(out: torch.Tensor) -> torch.Tensor:
    return ((out.float() - 0.5) ** 2).mean()


def sum_loss(out: torch.Tensor) -> torch.Tensor:
    """Summed over the batch: the loss of a concatenated batch is the sum of its parts'."""
    return ((out.float() - 0.5) ** 2).sum()


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def buffers_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def make_ddp(model: nn.Module, topology: str = "complete", *, lr: float = LR, momentum: float = 0.0,
             sched: bool = False, names: list | None = None, **kw: Any) -> Any:
    def optim_fn(named: list) -> torch.optim.Optimizer:
        if names is not None:
            names.append([n for n, _ in named])
        return torch.optim.SGD([p for _, p in named], lr=lr, momentum=momentum)

    sched_fn = ((lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=SCHED_EVERY, gamma=SCHED_GAMMA))
                if sched else None)
    return fastreduce.DecentralizedDataParallel(model, optim_fn, sched_fn, topology, **kw)


class Recorder:
    """Forward pre-hook: snapshot the parameters the forward sees and the local gradient
    of ``out_loss`` at them, computed on an untouched copy of the model."""

    def __init__(self, model: nn.Module):
        self.ref = copy.deepcopy(model)
        self.snaps: list[dict[str, torch.Tensor]] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if not (torch.is_grad_enabled() and module.training):
            return   # an evaluation forward: no step
        snap = params_of(module)
        self.snaps.append(snap)
        with torch.enable_grad():
            leaves = {n: t.clone().requires_grad_(p.requires_grad)
                      for (n, t), p in zip(snap.items(), module.parameters())}
            buffers = {n: b.detach().clone() for n, b in module.named_buffers()}
            loss = out_loss(functional_call(self.ref, {**leaves, **buffers}, tuple(a.detach() for a in args)))
            trainable = [n for n, t in leaves.items() if t.requires_grad]
            gs = torch.autograd.grad(loss, [leaves[n] for n in trainable])
        self.grads.append(dict(zip(trainable, (g.detach() for g in gs))))


def case_traj(rank: int, world: int, topology: str, lws: int | None, bucket_mb: float | None,
              model_name: str, clip: float, sched: bool) -> dict:
    model = MODELS[model_name](SEED + 100 * rank)   # rank-dependent: construction must broadcast rank 0's
    rec = Recorder(model)   # before the wrapper: its copy carries none of the wrapper's hooks
    names: list[list[str]] = []
    ddp = make_ddp(model, topology, names=names, bucket_mb=bucket_mb, local_world_size=lws, sched=sched,
                   grad_clip_norm=clip)
    init = params_of(model)
    for k in range(STEPS):
        if k == EVAL_AT:   # evaluating between steps changes nothing
            ddp.eval()
            with torch.no_grad():
                ddp(*batch_for(model, rank, 999))
            ddp.train()
        out_loss(ddp(*batch_for(model, rank, k))).backward()
    final_local = params_of(model)
    cd = ddp.consensus_distance()
    ddp.global_avg()
    avg = params_of(model)
    for k in range(STEPS, STEPS + EXTRA):
        out_loss(ddp(*batch_for(model, rank, k))).backward()
    final2 = params_of(model)
    ddp.global_avg()
    avg2 = params_of(model)
    rec.handle.remove()
    return {"init": init, "snaps": rec.snaps, "grads": rec.grads, "final_local": final_local, "cd": cd,
            "avg": avg, "final2": final2, "avg2": avg2, "names": names,
            "trainable": [n for n, p in model.named_parameters() if p.requires_grad],
            "module_api": ([id(t) for t in ddp.parameters()] == [id(t) for t in model.parameters()]
                           and [id(t) for t in ddp.buffers()] == [id(t) for t in model.buffers()])}


def case_consensus(rank: int, world: int, topology: str, lws: int | None,
                   wire_dtype: torch.dtype | None = None) -> dict:
    """lr = 0, every parameter shifted by +rank after construction: only the mixing moves them."""
    model = odd_model(SEED)
    ddp = make_ddp(model, topology, lr=0.0, bucket_mb=SMALL_BUCKET_MB, local_world_size=lws,
                   wire_dtype=wire_dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(float(rank))
    steps = consensus_rounds(world) + 2 if topology == "one-peer-exp" else 4
    after, cds = [], []
    for k in range(steps):
        out_loss(ddp(*batch_for(model, rank, k))).backward()
        after.append(params_of(model))
        cds.append(ddp.consensus_distance())
    ddp.global_avg()
    return {"after": after, "cd": cds, "avg": params_of(model)}


def case_unknown_topology(rank: int, world: int) -> dict:
    return expect_raises(ValueError, lambda: make_ddp(odd_model(SEED), "no-such-topology"))


def case_bad_bucket_mb(rank: int, world: int) -> dict:
    """Per bad value, what was raised and the hooks left (inf was an OverflowError after the
    hooks were on: the next mode built on the model failed in them at its first backward)."""
    out = {}
    for bad in (-1.0, float("inf")):
        model = odd_model(SEED)
        out[bad] = expect_raises(ValueError, lambda m=model, b=bad: make_ddp(m, bucket_mb=b))
        out[bad]["hooks_left"] = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    return out


def case_bn(rank: int, world: int, topology: str) -> dict:
    model = batchnorm_model(SEED)
    with torch.no_grad():
        model.bn.running_mean.add_(float(rank + 1))   # construction must broadcast rank 0's buffers
    ddp = make_ddp(model, topology)
    buffers_init = buffers_of(model)
    for k in range(3):
        out_loss(ddp(*batch_for(model, rank, k))).backward()
    before = (params_of(model), buffers_of(model))
    ddp.global_avg()
    after = (params_of(model), buffers_of(model))
    return {"buffers_init": buffers_init, "before": before, "after": after}


def case_no_sync(rank: int, world: int, topology: str) -> dict:
    """Three micro-batches per step: two accumulated (no_sync / set_accumulate_grad) + one,
    against one backward of the summed loss of their concatenation. ``late``: no_sync only
    from step 2 on (the first two steps, which trace and build, without accumulation)."""
    out = {}
    for mode in ("summed", "ctx", "flag", "late"):
        model = odd_model(SEED)
        ddp = make_ddp(model, topology, lr=0.02)
        for k in range(4):
            mbs = [batch_for(model, rank, 10 * k + i)[0] for i in range(3)]
            if mode == "summed" or (mode == "late" and k < 2):
                sum_loss(ddp(torch.cat(mbs))).backward()
            elif mode in ("ctx", "late"):
                with ddp.no_sync():
                    sum_loss(ddp(mbs[0])).backward()
                    sum_loss(ddp(mbs[1])).backward()
                sum_loss(ddp(mbs[2])).backward()
            else:
                ddp.set_accumulate_grad(True)
                sum_loss(ddp(mbs[0])).backward()
                sum_loss(ddp(mbs[1])).backward()
                ddp.set_accumulate_grad(False)
                sum_loss(ddp(mbs[2])).backward()
        out[mode] = params_of(model)
        ddp.global_avg()
    return out


def resume_ddp(model: nn.Module, topology: str) -> Any:
    return make_ddp(model, topology, lr=0.05, momentum=0.9, sched=True, bucket_mb=SMALL_BUCKET_MB)


def train(ddp: Any, model: nn.Module, rank: int, steps: range) -> None:
    for k in steps:
        out_loss(ddp(*batch_for(model, rank, k))).backward()


def case_resume_save(rank: int, world: int, topology: str, path: str) -> dict:
    model = odd_model(SEED)
    ddp = resume_ddp(model, topology)
    train(ddp, model, rank, range(10))
    full = params_of(model)
    ddp.global_avg()
    model = odd_model(SEED)
    ddp = resume_ddp(model, topology)
    train(ddp, model, rank, range(5))
    torch.save(ddp.state_dict(), f"{path}/rank{rank}.pt")
    half = params_of(model)
    ddp.global_avg()
    return {"full": full, "half": half}


def resume_worker(rank: int, world: int, topology: str, path: str) -> dict:
    def run() -> dict:
        model = odd_model(SEED + 1)   # other values: everything must come from the file
        ddp = resume_ddp(model, topology)
        ddp.load_state_dict(torch.load(f"{path}/rank{rank}.pt", weights_only=False))
        loaded = params_of(model)
        train(ddp, model, rank, range(5, 10))
        out = params_of(model)
        ddp.global_avg()
        return {"loaded": loaded, "out": out}
    return guarded(run)


def case_group(rank: int, world: int) -> dict | None:
    group = dist.new_group(list(GROUP_RANKS))
    if rank not in GROUP_RANKS:
        return None
    model = odd_model(SEED + rank)
    ddp = make_ddp(model, "complete", lr=0.0, group=group)
    init = params_of(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(float(rank))
    after = []
    for k in range(3):
        out_loss(ddp(*batch_for(model, rank, k))).backward()
        after.append(params_of(model))
    ddp.global_avg()
    return {"init": init, "after": after, "avg": params_of(model)}


def case_zero_grad(rank: int, world: int) -> dict:
    """The same 4 steps without ``model.zero_grad()``, with it after each backward (a
    trainer's order) and with it before each forward (the usual loop's), on a model whose
    parameters all get gradients and on one with a layer no forward uses (its one bucket
    is never complete during the backward): every step is taken as its backward ends, so
    the zeroing loses nothing."""
    out = {}
    for name, make in (("odd", MODELS["odd"]), ("unused", skip_model)):
        for zero in ("none", "after", "before"):
            model = make(SEED + 100 * rank)
            ddp = make_ddp(model, "ring")
            for k in range(4):
                if zero == "before":
                    model.zero_grad()
                out_loss(ddp(*batch_for(model, rank, k))).backward()
                if zero == "after":
                    model.zero_grad()
            ddp.close()
            out[name, zero] = params_of(model)
        out[name, "init"] = params_of(make(SEED))
    return out


class _Stall:
    """A job on the shared-memory worker that only sleeps: the jobs queued after it start late."""

    after, error = None, None

    def __init__(self, seconds: float):
        self.before = lambda: time.sleep(seconds)
        self.done = threading.Event()

    def barrier(self) -> None:
        pass

    def reduce(self) -> None:
        pass


def case_averaged_in_flight(rank: int, world: int) -> dict:
    """The trainers' evaluation on the ranks' mean (``TrainerMode.averaged``) right after a
    backward, its exchange in flight: the run goes on as if nothing had been evaluated.
    On shared memory rank 1's worker starts that exchange a second late, so without a
    wait rank 0 (evaluating longer) would still hold the mean in the block its peer reads."""
    from fastreduce.integrations.modes import make_mode

    out = {}
    for evaluate in (False, True):
        model = MODELS["odd"](SEED + 100 * rank)
        mode = make_mode("gossip", {"topology": "ring"})
        mode.build(model, torch.optim.SGD(model.parameters(), lr=LR))
        net = mode.module_to_call(model)
        for k in range(4):
            if evaluate and k == 2 and rank == 1 and net.comm.shms:
                net.comm.shms[0].channel.put(_Stall(1.0))
            out_loss(net(*batch_for(model, rank, k))).backward()
            if evaluate and k == 2:
                with mode.averaged(model):
                    time.sleep(1.5 if rank == 0 else 0.0)
        mode.close()
        out[evaluate] = params_of(model)
    return out


def case_evaluate_on_the_mean(rank: int, world: int) -> dict:
    """docs/gossip.md's evaluation: ``global_avg()``, evaluate (and save), ``revert_global_avg()``,
    train on. The state saves on the mean and after the revert; the revert puts back this rank's
    own parameters exactly; a revert with no average before it is a clear error, and so is a
    state saved before a mode's first step loaded into one that has stepped (nothing loaded)."""
    model = odd_model(SEED + rank)
    ddp = make_ddp(model, "ring")
    train(ddp, model, rank, range(3))
    own = params_of(model)
    ddp.global_avg()
    on_mean = {k: v for k, v in ddp.state_dict().items() if k != "buckets"}
    averaged = params_of(model)
    ddp.revert_global_avg()
    reverted, saved = params_of(model), ddp.state_dict()
    try:
        ddp.revert_global_avg()
        again = ""
    except RuntimeError as err:
        again = str(err)
    train(ddp, model, rank, range(3, 5))
    fresh_model = odd_model(SEED + rank)
    fresh = make_ddp(fresh_model, "ring")
    unbuilt = fresh.state_dict()  # saved before its first step
    fresh.close()
    before = params_of(model)
    try:
        ddp.load_state_dict(unbuilt)
        refused = ""
    except ValueError as err:
        refused = str(err)
    return {"own": own, "averaged": averaged, "reverted": reverted, "again": again, "refused": refused,
            "kept": all(torch.equal(t, params_of(model)[n]) for n, t in before.items()),
            "saved_keys": sorted(saved), "mean_keys": sorted(on_mean), "trained": params_of(model)}


def case_load_in_flight(rank: int, world: int) -> dict:
    """A checkpoint of step 1 loaded right after step 2's backward, its exchange in flight:
    the run from there is the same whether that exchange was quick or (on shared memory)
    started by rank 1's worker a second late, after the load (whose late mix would then
    land in the loaded state)."""
    import copy

    out = {}
    for stall in (False, True):
        model = MODELS["odd"](SEED + 100 * rank)
        net = make_ddp(model, "ring", momentum=0.9)
        for k in range(5):
            if stall and k == 2 and rank == 1 and net.comm.shms:
                net.comm.shms[0].channel.put(_Stall(1.0))
            out_loss(net(*batch_for(model, rank, k))).backward()
            if k == 1:
                saved = copy.deepcopy(net.state_dict())
            if k == 2:
                net.load_state_dict(saved)
        net.close()
        out[stall] = params_of(model)
    return out


def case_eval_mode(rank: int, world: int) -> dict:
    """The same 5 steps with the model in ``train()`` and in ``eval()`` (a fine-tuning with
    BatchNorm frozen): OddModel's forward is the same in both, so the runs must be too,
    one-peer-exp's rounds (a matrix per round) included."""
    out = {}
    for training in (True, False):
        model = MODELS["odd"](SEED + 100 * rank)
        ddp = make_ddp(model, "one-peer-exp")
        ddp.train(training)
        for k in range(5):
            out_loss(ddp(*batch_for(model, rank, k))).backward()
        out[training] = {"rounds": ddp.step, "params": params_of(model)}
        ddp.close()
    return out


def case_scaler_unused(rank: int, world: int) -> dict:
    """A GradScaler (its scale a power of two: scaling and unscaling are exact) and a layer
    no forward uses, in buckets of its own (the last ones): the same 4 steps with and
    without the scaler, on torch's loop (``foreach=False``) and on the fused kernel."""
    out = {}
    for kernel, kw in (("loop", {"foreach": False}), ("fused", {})):
        for scaled in (False, True):
            model = skip_model(SEED)
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) if scaled else None
            ddp = fastreduce.DecentralizedDataParallel(
                model, lambda named, kw=kw: torch.optim.SGD([p for _, p in named], lr=LR, momentum=0.9, **kw),
                topology="ring", scaler=scaler, bucket_mb=SMALL_BUCKET_MB)
            for k in range(4):
                loss = out_loss(ddp(*batch_for(model, rank, k)))
                (loss if scaler is None else scaler.scale(loss)).backward()
            ddp.close()
            out[kernel, scaled] = {
                "params": params_of(model), "scale": None if scaler is None else float(scaler.get_scale()),
                "empty": [all(p.grad is None for g in o.param_groups for p in g["params"]) for o in ddp._optims]}
    return out


def shm_maps() -> int:
    """This process's mappings of files in /dev/shm (a shared-memory segment is one)."""
    with open("/proc/self/maps") as f:
        return sum("/dev/shm/" in line for line in f)


def case_release(rank: int, world: int) -> dict:
    """A mode's communication blocks over its life (on shared memory: a segment each): a
    rebuild by ``load_state_dict`` (a state laid out in other buckets) gives back the
    last layout's, ``close()`` all of them, and the parameters leave them, so that with
    the mode dropped and its model kept nothing stays mapped."""
    gc.collect()
    comm = get_comm(None, torch.device("cpu"))
    base, maps = len(comm.shms), shm_maps()
    other = make_ddp(batchnorm_model(SEED), "ring", bucket_mb=SMALL_BUCKET_MB)
    train(other, other.module, rank, range(2))
    state = other.state_dict()
    other.close()
    del other
    model = batchnorm_model(SEED)
    ddp = make_ddp(model, "ring")
    train(ddp, model, rank, range(2))
    trained = len(comm.shms)
    ddp.load_state_dict(state)
    loaded = len(comm.shms)
    del state  # (its model entries view the other mode's parameter block)
    train(ddp, model, rank, range(2, 4))
    ddp.close()
    closed = {"params": params_of(model), "kept": len(comm.shms)}
    del ddp
    gc.collect()
    return {"base": base, "trained": trained, "loaded": loaded, "closed": closed, "maps": (maps, shm_maps()),
            "params": params_of(model), "shm": comm.wants_shm}


def case_buffer_dtypes(rank: int, world: int) -> dict:
    """Float buffers of two dtypes (BatchNorm's float32 statistics, a float64 buffer), each
    rank's own after construction (momentum 0: a forward leaves the statistics alone), mixed
    by ``complete``: each buffer before the first mix, and after two steps."""
    model = batchnorm_model(SEED)
    model.bn.momentum = 0.0
    model.register_buffer("f64", torch.zeros(7, dtype=torch.float64))
    ddp = make_ddp(model, "complete")
    g = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():
        for b in (model.bn.running_mean, model.bn.running_var, model.f64):
            b.copy_(torch.rand(b.shape, generator=g, dtype=torch.float64) + 0.5)
    own = buffers_of(model)
    train(ddp, model, rank, range(2))
    ddp.wait_exchanges()
    return {"own": own, "mixed": buffers_of(model)}


def case_split_mix(rank: int, world: int) -> dict:
    """lr = 0, ``complete``, each rank's parameters shifted by its own amount after
    construction: the block the first step sent, the block its exchange mixed into, and
    the ranks that split that exchange (reads the private ``_flats``, ``_mixed`` and
    ``_exchanges``: the first exchange's work)."""
    model = odd_model(SEED)
    ddp = make_ddp(model, "complete", lr=0.0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.37 * (rank + 1))
    train(ddp, model, rank, range(1))
    work = ddp._exchanges[0][0]
    sent = ddp._flats[0].clone()
    ddp.wait_exchanges()
    return {"shm": ddp.comm.shm_of(ddp._flats[0]) is not None, "split": tuple(getattr(work, "share", ())),
            "sent": sent, "mixed": ddp._mixed[0].clone()}


def case_unfrozen(rank: int, world: int) -> dict:
    """Gradual unfreezing: the backbone frozen when the mode was built (in no bucket), then
    unfrozen after a step. The next forward (which closes the step) must raise on every rank
    and change nothing; closed and built again, the mode steps the backbone too."""
    model = frozen_backbone_model(SEED)
    ddp = make_ddp(model)
    train(ddp, model, rank, range(1))
    model.backbone.requires_grad_(True)
    before = params_of(model)
    raised = expect_raises(RuntimeError, lambda: train(ddp, model, rank, range(1, 2)))
    unchanged = params_of(model)
    ddp.close()
    ddp = make_ddp(model)
    train(ddp, model, rank, range(2, 4))
    ddp.wait_exchanges()
    after = params_of(model)
    ddp.close()
    return {"raised": raised, "before": before, "unchanged": unchanged, "after": after}


def world_worker(rank: int, world: int, path: str) -> dict:
    res: dict[str, Any] = {}
    if world == 2:
        res["unknown_topology"] = guarded(case_unknown_topology, rank, world)
        res["zero_grad"] = guarded(case_zero_grad, rank, world)
        res["averaged_in_flight"] = guarded(case_averaged_in_flight, rank, world)
        res["load_in_flight"] = guarded(case_load_in_flight, rank, world)
        res["evaluate_on_the_mean"] = guarded(case_evaluate_on_the_mean, rank, world)
        res["bad_bucket_mb"] = guarded(case_bad_bucket_mb, rank, world)
        res["scaler_unused"] = guarded(case_scaler_unused, rank, world)
        res["release"] = guarded(case_release, rank, world)
        res["buffer_dtypes"] = guarded(case_buffer_dtypes, rank, world)
        res["split_mix"] = guarded(case_split_mix, rank, world)
        res["unfrozen"] = guarded(case_unfrozen, rank, world)
    if world == 3:
        res["eval_mode"] = guarded(case_eval_mode, rank, world)
    for case in TRAJ_CASES.get(world, []):
        res["traj/" + traj_key(*case)] = guarded(case_traj, rank, world, *case)
    for topology, lws in CONSENSUS_CASES.get(world, []):
        res[f"consensus/{topology}"] = guarded(case_consensus, rank, world, topology, lws)
    if world == 2:
        res["consensus_bf16"] = guarded(case_consensus, rank, world, "complete", None, torch.bfloat16)
    for topology in BN_CASES.get(world, []):
        res[f"bn/{topology}"] = guarded(case_bn, rank, world, topology)
    for topology in NO_SYNC_CASES.get(world, []):
        res[f"no_sync/{topology}"] = guarded(case_no_sync, rank, world, topology)
    if world in RESUME_CASES:
        res["resume_save"] = guarded(case_resume_save, rank, world, RESUME_CASES[world], path)
    if world == 4:   # last: a wrong group would hang the others' world collectives
        res["group"] = guarded(case_group, rank, world)
    return res


# ============================================================== fixtures and helpers (parent)

@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("decentralized_ckpt"))


_RESULTS: dict[int, list[dict] | BaseException] = {}


@pytest.fixture(scope="module")
def worlds(ckpt_dir):
    """``worlds(N)``: the per-rank results of world N's spawn, run once (a failed spawn is
    reported by every test that needs it, not retried by each)."""
    def start(world: int) -> list[dict]:
        path = f"{ckpt_dir}/w{world}"
        os.makedirs(path, exist_ok=True)
        return spawn(world_worker, world, path)

    yield lambda world: spawn_once(_RESULTS, world, lambda: start(world))
    _RESULTS.clear()


def ok(results: list[dict], key: str) -> list[Any]:
    """The per-rank results of sub-case ``key``; fails the test with the first rank's error."""
    outs = []
    for rank, res in enumerate(results):
        r = res[key]
        if "error" in r:
            pytest.fail(f"rank {rank} failed in {key}:\n{r['error']}")
        outs.append(r["ok"])
    return outs


def mean_of(dicts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {n: torch.stack([d[n].double() for d in dicts]).mean(0) for n in dicts[0]}


def close(actual: torch.Tensor, expected: torch.Tensor, msg: str, atol: float = ATOL, rtol: float = RTOL) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol, msg=lambda m: f"{msg}\n{m}")


def flat(d: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([d[n].double().reshape(-1) for n in names])


def consensus_distance(per_rank: list[dict[str, torch.Tensor]], names: list[str]) -> float:
    xs = [flat(d, names) for d in per_rank]
    m = torch.stack(xs).mean(0)
    return float(torch.stack([(x - m).norm() / m.norm() for x in xs]).mean())


ALL_TRAJ = [(w, c) for w, cs in TRAJ_CASES.items() for c in cs]
ALL_CONSENSUS = [(w, c) for w, cs in CONSENSUS_CASES.items() for c in cs]


def tid(v: Any) -> str:
    w, c = v
    return f"world{w}-" + (traj_key(*c) if len(c) == 6 else "-".join(str(x) for x in c))


# ============================================================== trajectory tests

@pytest.mark.parametrize("wc", ALL_TRAJ, ids=tid)
def test_construction_broadcasts_rank0_parameters(worlds, wc) -> None:
    world, case = wc
    outs = ok(worlds(world), "traj/" + traj_key(*case))
    expected = params_of(MODELS[case[3]](SEED))
    for rank, o in enumerate(outs):
        for n, t in expected.items():
            assert torch.equal(o["init"][n], t), f"rank {rank}: {n} is not rank 0's after construction"


@pytest.mark.parametrize("wc", ALL_TRAJ, ids=tid)
def test_optim_fn_gets_every_trainable_parameter_once(worlds, wc) -> None:
    world, case = wc
    outs = ok(worlds(world), "traj/" + traj_key(*case))
    for rank, o in enumerate(outs):
        got = [n for bucket in o["names"] for n in bucket]
        assert sorted(got) == sorted(o["trainable"]), f"rank {rank}: optimizers got {o['names']}"
        assert all(o["names"]), f"rank {rank}: an empty bucket: {o['names']}"
        assert o["module_api"], f"rank {rank}: the wrapper's parameters()/buffers() are not the model's"
        if case[2] == SMALL_BUCKET_MB and case[3] == "odd":
            assert len(o["names"]) > 1, f"rank {rank}: bucket_mb={case[2]} gave one bucket"


def step_of(o: dict, k: int, case: tuple) -> dict[str, torch.Tensor]:
    """What plain SGD subtracts at step k on one rank: lr_k * the gradient, clipped per bucket
    (``clip_grad_norm_`` over the bucket's grads, as decent-dp) when the case clips."""
    clip, sched = case[4], case[5]
    lr = LR * (SCHED_GAMMA ** (k // SCHED_EVERY) if sched else 1.0)
    g = {n: t.double() for n, t in o["grads"][k].items()}
    if clip:
        for bucket in o["names"]:
            norm = torch.cat([g[n].reshape(-1) for n in bucket]).norm()
            coef = min(1.0, clip / (float(norm) + 1e-6))
            for n in bucket:
                g[n] = g[n] * coef
    return {n: lr * t for n, t in g.items()}


def _next_params(o: dict, k: int) -> dict:
    """The parameters after step k's backward (before any later forward)."""
    if k == STEPS - 1:
        return o["final_local"]
    if k == STEPS + EXTRA - 1:
        return o["final2"]
    return o["snaps"][k + 1]


@pytest.mark.parametrize("wc", ALL_TRAJ, ids=tid)
@pytest.mark.cell("loop", "train", modes=("gossip",))
def test_mean_over_ranks_follows_sgd_on_the_mean_gradient(worlds, wc) -> None:
    """mean_r x_r(after step k) == mean_r snap_r(k) - lr * mean_r G_r(k), every step,
    global averages included: any doubly stochastic mixing preserves the mean.
    (Assumes that by the time step k's backward returns, its gradient has been applied:
    the first step's at the second forward, the others in their backward.)"""
    world, case = wc
    outs = ok(worlds(world), "traj/" + traj_key(*case))
    assert all(len(o["snaps"]) == STEPS + EXTRA for o in outs), "the forward pre-hook did not run once per step"
    for k in range(STEPS + EXTRA):
        before = mean_of([o["snaps"][k] for o in outs])
        update = mean_of([step_of(o, k, case) for o in outs])
        after = mean_of([_next_params(o, k) for o in outs])
        for n in update:
            close(after[n], before[n] - update[n], f"step {k}: mean of {n}")


@pytest.mark.parametrize("wc", ALL_TRAJ, ids=tid)
def test_each_rank_follows_the_documented_recursion(worlds, wc) -> None:
    """snap(1) = snap(0) - lr G(0); for k >= 1 x_r(after k) = sum_j W_{k-1}[r, j] snap_j(k) - lr G_r(k)."""
    world, case = wc
    topology, lws = case[0], case[1]
    topo = make_topology(topology, world, lws)
    outs = ok(worlds(world), "traj/" + traj_key(*case))
    for k in range(STEPS):
        w = torch.eye(world, dtype=torch.float64) if k == 0 else topo.mixing(k - 1)
        for r, o in enumerate(outs):
            for n, u in step_of(o, k, case).items():
                mixed = sum(w[r, j] * outs[j]["snaps"][k][n].double() for j in range(world))
                close(_next_params(o, k)[n], mixed - u,
                      f"rank {r}, step {k} ({topology}, round {k - 1}): {n}")


@pytest.mark.parametrize("wc", ALL_TRAJ, ids=tid)
def test_frozen_parameters_never_change(worlds, wc) -> None:
    world, case = wc
    outs = ok(worlds(world), "traj/" + traj_key(*case))
    for rank, o in enumerate(outs):
        frozen = [n for n in o["init"] if n not in o["trainable"]]
        assert (case[3] == "frozen") == bool(frozen)
        for n in frozen:
            for what in ("final_local", "avg", "final2", "avg2"):
                assert torch.equal(o[what][n], o["init"][n]), f"rank {rank}: frozen {n} changed ({what})"


@pytest.mark.parametrize("wc", ALL_TRAJ, ids=tid)
def test_global_avg_gives_every_rank_the_exact_mean(worlds, wc) -> None:
    world, case = wc
    outs = ok(worlds(world), "traj/" + traj_key(*case))
    trainable = outs[0]["trainable"]   # frozen ones: test_construction_broadcasts_rank0_parameters
    for before, after in (("final_local", "avg"), ("final2", "avg2")):
        mean = mean_of([o[before] for o in outs])
        for n, m in mean.items():
            if n not in trainable:
                continue
            for rank, o in enumerate(outs):
                close(o[after][n], m, f"rank {rank}: {n} after global_avg ({after})")
                assert torch.equal(o[after][n], outs[0][after][n]), f"rank {rank}: {n} differs from rank 0's"
    for rank, o in enumerate(outs):   # the next forward sees the averaged parameters
        for n, t in o["avg"].items():
            assert torch.equal(o["snaps"][STEPS][n], t), f"rank {rank}: {n} changed between global_avg and forward"


def test_a_rank_evaluates_on_the_mean_saves_and_trains_on_its_own_again(worlds) -> None:
    outs = ok(worlds(2), "evaluate_on_the_mean")
    mean = mean_of([o["own"] for o in outs])
    for rank, o in enumerate(outs):
        for n, t in o["own"].items():
            close(o["averaged"][n], mean[n], f"rank {rank}: {n} after global_avg")
            assert torch.equal(o["reverted"][n], t), f"rank {rank}: {n} not its own after revert_global_avg"
        assert not all(torch.equal(o["trained"][n], t) for n, t in o["own"].items()), "it did not train on"
        assert o["saved_keys"] and o["mean_keys"], o
        assert "needs a global_avg() before it" in o["again"], o["again"]
        assert "saved before the mode's first step" in o["refused"] and o["kept"], o["refused"]
    assert not all(torch.equal(outs[0]["own"][n], outs[1]["own"][n]) for n in outs[0]["own"]), \
        "the ranks agreed before the average: the test shows nothing"


@pytest.mark.parametrize("wc", ALL_TRAJ, ids=tid)
def test_consensus_distance_is_the_mean_relative_distance(worlds, wc) -> None:
    world, case = wc
    outs = ok(worlds(world), "traj/" + traj_key(*case))
    cds = [o["cd"] for o in outs]
    assert all(isinstance(c, float) for c in cds), cds
    assert len(set(cds)) == 1, f"consensus_distance differs across ranks: {cds}"
    expected = consensus_distance([o["final_local"] for o in outs], outs[0]["trainable"])
    assert cds[0] == pytest.approx(expected, rel=1e-4, abs=1e-7)
    if case[0] != "complete":
        assert cds[0] > 1e-6, "ranks should disagree before global_avg on an inexact topology"


def test_clipping_case_clips_and_schedules(worlds) -> None:
    """The clip + StepLR case really exercises both (else its recursion test proves little)."""
    case = ("ring", None, SMALL_BUCKET_MB, "odd", CLIP, True)
    outs = ok(worlds(3), "traj/" + traj_key(*case))
    assert STEPS > SCHED_EVERY
    coefs = []
    for o in outs:
        for k in range(STEPS):
            for bucket in o["names"]:
                norm = torch.cat([o["grads"][k][n].reshape(-1) for n in bucket]).norm()
                coefs.append(CLIP / (float(norm) + 1e-6))
    assert min(coefs) < 0.5 and len(outs[0]["names"]) > 1, coefs


def test_zero_grad_between_steps_loses_no_step(worlds) -> None:
    """``zero_grad()`` between steps, after the backward or before the forward, ends where
    the run without it ends, bit for bit: no step's gradients, the first one's included,
    are lost, also where a layer no forward uses keeps the bucket from completing during
    the backward."""
    for rank, o in enumerate(ok(worlds(2), "zero_grad")):
        for model, last in (("odd", "c.weight"), ("unused", "out.weight")):
            kept = o[model, "none"]
            assert not torch.equal(kept[last], o[model, "init"][last]), f"{model} did not train"
            for zero in ("after", "before"):
                for n, p in kept.items():
                    got = o[model, zero][n]
                    assert torch.equal(got, p), (rank, model, zero, n, float((got - p).abs().max()))


def test_a_model_trained_in_eval_mode_steps_as_in_train_mode(worlds) -> None:
    """A forward with grad enabled closes the step whatever the module's ``training``: 3
    ranks of one-peer-exp held in ``eval()`` take every round's matrix, bit for bit as in
    ``train()`` (and do not raise at the third backward)."""
    for rank, o in enumerate(ok(worlds(3), "eval_mode")):
        assert o[False]["rounds"] == o[True]["rounds"] == 4, (rank, o[False]["rounds"], o[True]["rounds"])
        for n, p in o[True]["params"].items():
            assert torch.equal(o[False]["params"][n], p), (rank, n, float((o[False]["params"][n] - p).abs().max()))


def test_an_evaluation_on_the_mean_waits_for_the_exchange_in_flight(worlds) -> None:
    """The Trainer's and Lightning's evaluation on the ranks' mean, between a backward and
    the next forward, leaves every rank's run bit for bit as without it (an exchange still
    reading the parameter block would have sent the mean: 1% off in the Trainer's gradient
    norms five steps on)."""
    for rank, o in enumerate(ok(worlds(2), "averaged_in_flight")):
        for n, p in o[False].items():
            assert torch.equal(o[True][n], p), (rank, n, float((o[True][n] - p).abs().max()))


def test_a_load_waits_for_the_exchange_in_flight(worlds) -> None:
    """load_state_dict mid-run, an exchange in flight: bit for bit the run where it was done."""
    for rank, o in enumerate(ok(worlds(2), "load_in_flight")):
        for n, p in o[False].items():
            assert torch.equal(o[True][n], p), (rank, n, float((o[True][n] - p).abs().max()))


def test_parameter_used_twice_trains(worlds) -> None:
    """decent-dp asserts on a parameter used twice in one backward; here it just works
    (its grad is complete when its hook fires): the recursion tests above cover it too."""
    outs = ok(worlds(2), "traj/" + traj_key("ring", None, SMALL_BUCKET_MB, "twice", 0.0, False))
    assert not torch.equal(outs[0]["avg2"]["shared.weight"], outs[0]["init"]["shared.weight"])


# ============================================================== consensus (lr = 0)

@pytest.mark.parametrize("wc", ALL_CONSENSUS, ids=tid)
def test_lr0_parameters_are_the_mixing_products(worlds, wc) -> None:
    """After i backwards (i >= 1), i - 1 mixes were applied: x_r = base + (W_{i-2}...W_0 v)[r]
    with v = (0, 1, ..., N-1) the shifts given after construction."""
    world, (topology, lws) = wc
    topo = make_topology(topology, world, lws)
    outs = ok(worlds(world), f"consensus/{topology}")
    base = params_of(odd_model(SEED))
    v = torch.arange(world, dtype=torch.float64)
    for i in range(len(outs[0]["after"])):
        if i >= 1:
            v = topo.mixing(i - 1) @ v
        for r, o in enumerate(outs):
            for n, b in base.items():
                close(o["after"][i][n], b.double() + v[r],
                      f"rank {r} after backward {i} ({i} mixes, expected shift {float(v[r]):.6f}): {n}")


@pytest.mark.parametrize("wc", ALL_CONSENSUS, ids=tid)
def test_lr0_consensus_distance_and_exact_average(worlds, wc) -> None:
    world, (topology, lws) = wc
    outs = ok(worlds(world), f"consensus/{topology}")
    names = list(outs[0]["avg"])
    base = params_of(odd_model(SEED))
    mean = {n: b.double() + (world - 1) / 2 for n, b in base.items()}
    exact_after = {"complete": 1, "one-peer-exp": consensus_rounds(world),
                   "alternating-exp-ring": make_topology(topology, world, lws).period}.get(topology)
    if topology == "ring" and world <= 3:
        exact_after = 1   # N <= 3: the ring is the complete graph
    for i in range(len(outs[0]["after"])):
        cds = [o["cd"][i] for o in outs]
        assert len(set(cds)) == 1, f"backward {i}: consensus_distance differs across ranks: {cds}"
        assert cds[0] == pytest.approx(consensus_distance([o["after"][i] for o in outs], names), rel=1e-4, abs=1e-7)
        if exact_after is not None and i >= exact_after:
            assert cds[0] < 1e-6, f"backward {i}: not an exact average after {i} mixes: {cds[0]}"
            for r, o in enumerate(outs):
                for n, m in mean.items():
                    close(o["after"][i][n], m, f"rank {r}, backward {i}: {n} is not the initial mean")
        elif i == 0 or exact_after is not None:
            assert cds[0] > 1e-3, f"backward {i}: consensus before {exact_after} mixes?"
    for r, o in enumerate(outs):
        for n, m in mean.items():
            close(o["avg"][n], m, f"rank {r}: {n} after global_avg")


def test_bf16_wire_mixes_to_the_mean_within_bf16_rounding(worlds) -> None:
    """wire_dtype=bf16, complete, lr = 0: after the first mix every rank holds the mean of the
    initial parameters up to bf16 rounding of what was sent (|x| < 2: 2^-8 * 2)."""
    outs = ok(worlds(2), "consensus_bf16")
    base = params_of(odd_model(SEED))
    for r, o in enumerate(outs):
        for n, b in base.items():
            close(o["after"][0][n], b.double() + r, f"rank {r}: {n} before any mix")
            for i in range(1, len(o["after"])):
                close(o["after"][i][n], b.double() + 0.5, f"rank {r}, backward {i}: {n}", atol=1e-2, rtol=0)
        assert o["cd"][-1] < 1e-2


# ============================================================== buffers, no_sync, errors

@pytest.mark.parametrize("wc", [(w, (t,)) for w, ts in BN_CASES.items() for t in ts], ids=tid)
def test_global_avg_averages_params_and_float_buffers(worlds, wc) -> None:
    world, (topology,) = wc
    outs = ok(worlds(world), f"bn/{topology}")
    for rank, o in enumerate(outs):
        assert torch.equal(o["buffers_init"]["bn.running_mean"], torch.ones(16)), \
            f"rank {rank}: construction did not broadcast rank 0's buffers"
    assert not torch.equal(outs[0]["before"][1]["bn.running_mean"], outs[1]["before"][1]["bn.running_mean"])
    for i, what in ((0, "parameter"), (1, "buffer")):
        for n in outs[0]["before"][i]:
            values = [o["before"][i][n] for o in outs]
            for rank, o in enumerate(outs):
                got = o["after"][i][n]
                assert torch.equal(got, outs[0]["after"][i][n]), f"rank {rank}: {what} {n} differs from rank 0's"
                if got.is_floating_point():
                    close(got, torch.stack([v.double() for v in values]).mean(0), f"rank {rank}: {what} {n}")
                else:
                    assert torch.equal(got, values[rank]), f"rank {rank}: integer buffer {n} changed"


@pytest.mark.parametrize("wc", [(w, (t,)) for w, ts in NO_SYNC_CASES.items() for t in ts], ids=tid)
@pytest.mark.parametrize("mode", ["ctx", "flag", "late"])
def test_accumulation_matches_one_backward_of_the_summed_loss(worlds, wc, mode) -> None:
    """``ctx`` / ``flag`` accumulate from the very first step: the step-0 backward under
    no_sync must not count as the traced step, and the build at step 1's first forward must
    happen even under no_sync (decent-dp: ``_trace_fn`` ignores accumulating backwards, the
    lazy init runs at the second step's first forward whatever the flag)."""
    world, (topology,) = wc
    outs = ok(worlds(world), f"no_sync/{topology}")
    for rank, o in enumerate(outs):
        for n, t in o["summed"].items():
            close(o[mode][n], t, f"rank {rank}: {n} ({mode})")


def test_unknown_topology_raises_value_error(worlds) -> None:
    for rank, r in enumerate(ok(worlds(2), "unknown_topology")):
        assert r["raised"] == "ValueError", f"rank {rank}: {r}"


def test_bad_bucket_mb_is_refused_before_anything_is_built(worlds) -> None:
    for rank, out in enumerate(ok(worlds(2), "bad_bucket_mb")):
        for bad, r in out.items():
            assert r["raised"] == "ValueError" and "bucket_mb must be a positive" in r["message"], r
            assert r["hooks_left"] == 0, f"rank {rank}, bucket_mb={bad}: the refused mode left gradient hooks"


def test_no_process_group_raises() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError):
        make_ddp(odd_model(SEED), "complete")


def test_group_of_two_ranks(worlds) -> None:
    outs = ok(worlds(4), "group")
    base = params_of(odd_model(SEED + GROUP_RANKS[0]))   # the group's first rank is its source
    shift = sum(GROUP_RANKS) / len(GROUP_RANKS)
    for rank in range(4):
        if rank not in GROUP_RANKS:
            assert outs[rank] is None
            continue
        o = outs[rank]
        for n, b in base.items():
            assert torch.equal(o["init"][n], b), f"rank {rank}: {n} is not the group's first rank's"
            close(o["after"][0][n], b.double() + rank, f"rank {rank}: {n} before any mix")
            for i in (1, 2):
                close(o["after"][i][n], b.double() + shift, f"rank {rank}, backward {i}: {n}")
            close(o["avg"][n], b.double() + shift, f"rank {rank}: {n} after global_avg")


# ============================================================== resume

@pytest.mark.parametrize("world", sorted(RESUME_CASES))
def test_state_dict_resume_in_new_processes_continues_the_run(worlds, ckpt_dir, world) -> None:
    """momentum SGD + StepLR: 5 steps, state_dict() per rank to a file; new processes build
    a fresh model (other values) and DDP, load it, train steps 5..9: the same parameters
    as 10 uninterrupted steps."""
    saved = ok(worlds(world), "resume_save")
    path = f"{ckpt_dir}/w{world}"
    resumed = spawn(resume_worker, world, RESUME_CASES[world], path)
    for rank, (s, r) in enumerate(zip(saved, resumed)):
        if "error" in r:
            pytest.fail(f"rank {rank} failed resuming:\n{r['error']}")
        r = r["ok"]
        for n, t in s["half"].items():
            assert torch.equal(r["loaded"][n], t), f"rank {rank}: {n} not restored by load_state_dict"
        for n, t in s["full"].items():
            close(r["out"][n], t, f"rank {rank}: {n} after resume vs uninterrupted")


# ============================================================== one-peer-exp at 6 to 8 ranks

def exact_consensus_worker(rank: int, world: int) -> dict:
    from fastreduce.modes.topology import consensus_rounds
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    ddp = fastreduce.DecentralizedDataParallel(model, lambda named: torch.optim.SGD([p for _, p in named], lr=0.0),
                                               topology="one-peer-exp")
    with torch.no_grad():
        for p in ddp.parameters():
            p.add_(float(rank))  # lr = 0: only the mixing moves the ranks, towards base + (N - 1) / 2
    base = [p.detach().clone() - rank for p in ddp.parameters()]
    dists = []
    for step in range(consensus_rounds(world) + 1):  # after i backwards, i - 1 mixes are applied
        ddp(torch.ones(1, 3)).sum().backward()
        dists.append(ddp.consensus_distance())
    err = max((p - (b + (world - 1) / 2)).abs().max().item() for p, b in zip(ddp.parameters(), base))
    return {"dists": dists, "err": err, "rounds": consensus_rounds(world)}


@pytest.mark.parametrize("world", [6, 7, 8])
def test_one_peer_exp_reaches_the_exact_mean_after_its_period(world: int) -> None:
    """N = 8: log2 N = 3 mixes; N = 6 and 7: the finite schedule's 5 and 6 (2 to 5 ranks:
    the trajectory tests above)."""
    outs = run_ranks(exact_consensus_worker, world, timeout=240, threads=1)
    for rank, o in enumerate(outs):
        assert o["rounds"] == {6: 5, 7: 6, 8: 3}[world]
        assert o["dists"][-2] > 1e-3, f"rank {rank}: consensus one mix early? {o['dists']}"
        assert o["dists"][-1] < 1e-6 and o["err"] < 1e-6, (rank, o)


# ============================================================== float buffers mixed every step

def buffer_mix_worker(rank: int, world: int, mode: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=0.0))  # forward leaves the stats alone
    ddp = fastreduce.DecentralizedDataParallel(model, lambda named: torch.optim.SGD([p for _, p in named], lr=0.1),
                                               topology="complete", buffers=mode)
    with torch.no_grad():
        model[1].running_mean.add_(float(rank))  # after construction: the ranks' statistics differ
    for _ in range(3):
        ddp(torch.randn(5, 3)).sum().backward()
    return {"mean": model[1].running_mean.clone(), "batches": int(model[1].num_batches_tracked)}


@pytest.mark.parametrize("mode", ["mix", "local"])
def test_float_buffers_are_mixed_with_the_parameters(mode: str) -> None:
    outs = run_ranks(buffer_mix_worker, 3, mode, timeout=120)
    for rank, o in enumerate(outs):
        assert o["batches"] == 3  # integer buffers are never mixed
        want = torch.full((4,), 1.0) if mode == "mix" else torch.full((4,), float(rank))
        torch.testing.assert_close(o["mean"], want, rtol=0, atol=1e-6)


# ============================================================== defaults: one bucket, torch's fused kernel

def defaults_worker(rank: int, world: int) -> dict:
    """The same 4 steps under each optimizer choice (AdamW as users write it; the loop
    asked for; fused asked for) and bucket size, from the same start and batches."""
    out: dict[str, Any] = {}
    for name, kw, bucket_mb in (("plain", {}, "auto"), ("loop", {"foreach": False}, "auto"),
                                ("fused", {"fused": True}, "auto"), ("plain-small", {}, SMALL_BUCKET_MB)):
        model = odd_model(SEED)
        ddp = fastreduce.DecentralizedDataParallel(
            model, lambda named, kw=kw: torch.optim.AdamW([p for _, p in named], lr=1e-2, **kw),
            topology="ring", bucket_mb=bucket_mb)
        for k in range(4):
            out_loss(ddp(*batch_for(model, rank, k))).backward()
        ddp.wait_exchanges()
        out[name] = {"params": params_of(model), "buckets": ddp.num_buckets,
                     "fused": [g["fused"] for o in ddp._optims for g in o.param_groups],
                     "sizing": None if ddp.sizing is None else ddp.sizing.describe(),
                     "grads_kept": all(p.grad is not None for p in model.parameters())}
    return out


def test_defaults_one_bucket_and_torchs_fused_kernel() -> None:
    """``bucket_mb="auto"`` is one bucket (and says so); an AdamW built with no
    implementation chosen steps on torch's fused kernel, as if ``fused=True`` had been
    passed (bit for bit), within rounding of torch's loop; ``foreach=False`` keeps the
    loop; the gradients stay allocated (zeroed in place) between steps."""
    for rank, o in enumerate(run_ranks(defaults_worker, 2, timeout=SPAWN_TIMEOUT)):
        assert o["plain"]["buckets"] == o["loop"]["buckets"] == 1 and o["plain-small"]["buckets"] > 1
        assert o["plain"]["sizing"].startswith("bucket_mb='auto': one bucket (a bucket's exchange")
        assert o["plain-small"]["sizing"] is None
        assert set(o["plain"]["fused"]) == set(o["plain-small"]["fused"]) == {True}
        assert o["loop"]["fused"] == [None]
        assert o["plain"]["grads_kept"]
        for n, t in o["plain"]["params"].items():
            assert torch.equal(t, o["fused"]["params"][n]), f"rank {rank}: {n}: the upgrade is not fused=True"
            close(t, o["loop"]["params"][n], f"rank {rank}: {n}: fused against torch's loop")
            close(t, o["plain-small"]["params"][n], f"rank {rank}: {n}: one bucket against several")
            assert not torch.equal(t, odd_model(SEED).state_dict()[n]), f"{n} did not train"


def scaler_worker(rank: int, world: int) -> dict:
    """A GradScaler with AdamW as users write it (the fused kernel, which unscales and skips
    on inf itself) against torch's loop (``foreach=False``): step 2 of rank 0 overflows."""
    out: dict[str, Any] = {}
    for name, kw in (("plain", {}), ("loop", {"foreach": False})):
        model = odd_model(SEED)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1000)
        ddp = fastreduce.DecentralizedDataParallel(
            model, lambda named, kw=kw: torch.optim.AdamW([p for _, p in named], lr=1e-2, **kw),
            topology="ring", scaler=scaler)
        for k in range(4):
            loss = out_loss(ddp(*batch_for(model, rank, k)))
            if k == 2 and rank == 0:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
        ddp.wait_exchanges()
        out[name] = {"params": params_of(model), "scale": float(scaler.get_scale()),
                     "fused": ddp._optims[0].param_groups[0]["fused"]}
    return out


def test_a_layer_unfrozen_after_building_raises_until_the_mode_is_built_again(worlds) -> None:
    """In no bucket, it would silently never be stepped nor mixed."""
    for rank, o in enumerate(ok(worlds(2), "unfrozen")):
        r = o["raised"]
        assert r["raised"] == "RuntimeError", f"rank {rank}: raised {r['raised']}: {r['message']}"
        for words in ("'backbone.0.weight'", "frozen when DecentralizedDataParallel was built", "close()"):
            assert words in r["message"], f"rank {rank}: {words!r} not in {r['message']!r}"
        for n, p in o["before"].items():
            assert torch.equal(o["unchanged"][n], p), f"rank {rank}: the failed forward changed {n}"
            if n.startswith("backbone."):
                assert not torch.equal(o["after"][n], p), f"rank {rank}: {n} not trained after the rebuild"


def test_close_and_a_rebuild_give_the_shared_memory_back(worlds) -> None:
    """Shared memory: training maps segments (the two parameter blocks, the float buffers'),
    a rebuild by load_state_dict takes as many as it gives back, and after close() (the
    parameters moved out, their values kept) and the mode dropped, the model kept,
    every segment the mode took is unmapped (on other transports: no segment at all)."""
    for rank, o in enumerate(ok(worlds(2), "release")):
        assert o["trained"] == o["base"] + (3 if o["shm"] else 0), (rank, o["base"], o["trained"])
        assert o["loaded"] == o["trained"], (rank, o["trained"], o["loaded"])
        assert o["closed"]["kept"] == o["base"], (rank, o["base"], o["closed"]["kept"])
        assert o["maps"][1] == o["maps"][0], (rank, o["maps"])
        for n, p in o["closed"]["params"].items():
            assert torch.equal(o["params"][n], p), (rank, n)


def test_float_buffers_are_mixed_in_their_own_dtype(worlds) -> None:
    """A mean is a mean: with ``complete`` over 2 ranks every float buffer becomes
    ``(a + b) / 2`` computed in its own dtype, bit for bit, a float64 buffer's too (mixed
    in float32 it was off by float32's rounding); the integer counter is left alone."""
    outs = ok(worlds(2), "buffer_dtypes")
    for rank, o in enumerate(outs):
        for n, mine in o["own"].items():
            got = o["mixed"][n]
            if not mine.is_floating_point():
                assert torch.equal(got, mine + 2), (rank, n)  # two forwards counted, never mixed
                continue
            want = (outs[0]["own"][n] + outs[1]["own"][n]) * 0.5
            assert got.dtype == want.dtype and torch.equal(got, want), (rank, n, float((got - want).abs().max()))


def test_a_uniform_shared_memory_mix_is_split_between_its_ranks(worlds) -> None:
    """docs/gossip.md: on shared memory, ranks whose rows are one mean (``complete``'s) split
    the mix, each summing a chunk and writing it into every member's output block (a
    segment other than the parameters'); the result is the mean of what the ranks sent,
    bit for bit: ``(a + b) / 2`` (on other transports: the mean alone)."""
    outs = ok(worlds(2), "split_mix")
    want = (outs[0]["sent"] + outs[1]["sent"]) * 0.5
    for rank, o in enumerate(outs):
        assert o["split"] == ((0, 1) if o["shm"] else ()), (rank, o["shm"], o["split"])
        assert torch.equal(o["mixed"], want), (rank, float((o["mixed"] - want).abs().max()))


def test_a_scaler_skips_a_bucket_without_gradients(worlds) -> None:
    """A bucket no gradient reached is not stepped (the scaler would raise: no inf check
    recorded), as torch.optim skips a None gradient; the others step as without the
    scaler, bit for bit, and the scaler updates once per step, the last bucket's
    emptiness notwithstanding: four steps with growth_interval=2 double the scale twice."""
    for rank, o in enumerate(ok(worlds(2), "scaler_unused")):
        for kernel in ("loop", "fused"):
            scaled, plain = o[kernel, True], o[kernel, False]
            assert scaled["empty"][-1] and not all(scaled["empty"]), scaled["empty"]
            assert scaled["scale"] == 2.0**12, (rank, kernel, scaled["scale"])
            for n, p in plain["params"].items():
                got = scaled["params"][n]
                assert torch.equal(got, p), (rank, kernel, n, float((got - p).abs().max()))


def test_scaler_with_the_fused_kernel_matches_torchs_loop() -> None:
    for rank, o in enumerate(run_ranks(scaler_worker, 2, timeout=SPAWN_TIMEOUT)):
        assert o["plain"]["fused"] is True and o["loop"]["fused"] is None
        assert o["plain"]["scale"] == o["loop"]["scale"] == (2.0**3 if rank == 0 else 2.0**4)
        for n, t in o["plain"]["params"].items():
            assert torch.isfinite(t).all(), f"rank {rank}: {n} took the overflowing step"
            close(t, o["loop"]["params"][n], f"rank {rank}: {n}: fused against torch's loop, with a scaler")


def test_a_bucket_optimizer_sgd_with_momentum_keeps_torchs_default_kernel() -> None:
    """torch's fused SGD cannot step a list where some parameters have a momentum buffer and
    others not yet (a parameter first used at a later step: TypeError, torch 2.13), so the
    buckets' optimizers take it for Adam and AdamW, not for SGD with momentum; that one
    steps a parameter first used late as torch's default does."""
    from fastreduce.optim_kernels import prefer_fused

    params = [nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))]
    ref = [nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))]
    opt, plain = (torch.optim.SGD(ps, lr=0.1, momentum=0.9) for ps in (params, ref))
    assert not prefer_fused(opt)
    for used in ([0], [0, 1], [0, 1]):
        for ps, o in ((params, opt), (ref, plain)):
            for i in used:
                ps[i].grad = torch.full((4,), float(i + 1))
            o.step()
    assert all(torch.equal(a, b) for a, b in zip(params, ref))
    assert prefer_fused(torch.optim.AdamW([nn.Parameter(torch.ones(4))], lr=0.1))
