"""fastreduce.LocalSGD and fastreduce.DiLoCo (local-update modes: periodic, post-local and
hierarchical model averaging; DiLoCo with an outer optimizer and streaming fragments) on
real Gloo process groups, against real torch and references written here.

Same structure as test_decentralized.py / test_zero.py: module-scoped fixtures spawn one
group per world size (``run_ranks``) and run every sub-case in it, each through
``guarded`` so a broken sub-case fails its own tests only; the tests assert on the
returned per-rank results here, in the parent. A second world-2 spawn (``resumed``) loads
the checkpoints the first one wrote. No transport is hard-coded: CI reruns this file with
``FASTREDUCE_TRANSPORT=process_group``.

Every sub-case trains with each rank's own inputs (``batch_for(model, rank, step)``) and
records the parameters and buffers after every optimizer step; the reference is a
separate loop over the same inputs, on a process group of its own (``ref_group``) so
that its collectives never interleave with the mode's:

* torch DDP (``DistributedDataParallel``) for ``LocalSGD(sync_every=1)``: averaging the
  parameters after each SGD-with-momentum step equals averaging the gradients before it
  (the update is linear in the grads, and the mean of the ranks' momentum buffers is
  DDP's buffer);
* ``ref_local``: each rank steps on its own copy; after steps warmup + H, warmup + 2H, ...
  its parameters (and float buffers with ``buffers="average"``) are averaged with
  ``dist.all_reduce`` / world; during the warm-up the gradients are averaged before each
  step (DDP-style) and the float buffers after it;
* torch's own ``HierarchicalModelAverager`` (world 4, groups of 2), with its counter
  aligned (``averager.step = 1`` before the first call, see the spec);
* ``ref_diloco``: DiLoCo written from the update equations (anchor; pseudo-gradient
  anchor - local, all_reduce'd / world when launched, tau steps before it is applied;
  outer SGD / Nesterov momentum by hand, torch.optim's conventions: b = g at a
  parameter's first outer step, then b = mu b + g, update g + mu b; x := alpha x + (1 -
  alpha) theta), over the fragments the mode reports in ``fragment_names``.

Then: bf16 wires against the fp32 references within a bound derived from the
pseudo-gradients' size; resume in new processes (LocalSGD with warm-up, fp32 and bf16
wire; DiLoCo with a fragment in flight) against uninterrupted runs; ``backup_device``;
errors (each must change nothing and leave no hook); the broadcast of rank 0's
parameters with its warning; ``group=`` (world 4, a 2-rank subgroup).

Tolerances (fp32): the mode and its reference average the same values but may sum them
in another order (and DiLoCo computes anchor - mean(anchor - x) instead of mean(x)), a few
fp32 ulps per averaging of |x| <~ 2; SGD/AdamW steps over 12-20 steps do not amplify that:
atol 1e-6, rtol 0.
"""

from __future__ import annotations

import copy
import gc
import itertools
import os
import threading
import time
import warnings
from collections import OrderedDict
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import HierarchicalModelAverager

import fastreduce
from fastreduce.comm import Fp32Accumulate
from fastreduce.launch import run_ranks

from models import batch_for, batchnorm_model, frozen_backbone_model, loss_of, odd_model
from test_fused import expect_raises, guarded, per_rank, spawn_once, unwrap

SEED = 5
ATOL = 1e-6
SPAWN_TIMEOUT = 150.0
BF16_EPS = 2.0 ** -8   # bf16 has 8 significant bits: round-to-nearest is within 2^-9 relative
ODD_NUMEL = 323        # OddModel's parameter count
GROUP_RANKS = (1, 3)   # a 2-rank group= inside the 4-rank world

pytestmark = pytest.mark.timeout(300)

MODELS: dict[str, Callable[[int], nn.Module]] = {
    "odd": odd_model, "bn": batchnorm_model, "frozen": frozen_backbone_model,
}
INNER = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}
NESTEROV = (0.7, 0.9, True)     # outer SGD: lr, momentum, nesterov
HEAVY_BALL = (0.5, 0.9, False)
PLAIN_AVG = (1.0, 0.0, False)   # outer SGD(lr=1): x := mean of the ranks' x


def spawn(worker: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    return run_ranks(worker, world, *args, timeout=SPAWN_TIMEOUT)


# ============================================================== helpers run in ranks

def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def float_buffers(model: nn.Module) -> list[torch.Tensor]:
    return [b for b in model.buffers() if b.is_floating_point()]


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers (int ones too), cloned."""
    return {n: t.detach().clone() for n, t in itertools.chain(model.named_parameters(), model.named_buffers())}


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def inner_opt(model: nn.Module, name: str) -> torch.optim.Optimizer:
    cls, hp = INNER[name]
    return cls(trainable(model), **hp)


def outer_sgd(model: nn.Module, outer: tuple[float, float, bool]) -> torch.optim.SGD:
    lr, mu, nesterov = outer
    return torch.optim.SGD(trainable(model), lr=lr, momentum=mu, nesterov=nesterov)


def step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, s: int,
         before: Callable[[], None] | None = None) -> None:
    opt.zero_grad()
    loss_of(model, batch_for(model, rank, s)).backward()
    if before is not None:
        before()
    opt.step()


@torch.no_grad()
def all_mean_(tensors: list[torch.Tensor], group: Any) -> None:
    """The references' exact mean: all_reduce (sum) per tensor, then / group size."""
    n = dist.get_world_size(group)
    for t in tensors:
        dist.all_reduce(t, group=group)
        t.div_(n)


def ref_local(rank: int, model: nn.Module, opt: torch.optim.Optimizer, steps: int, H: int, group: Any,
              warmup: int = 0, buffers: str = "average") -> dict:
    """Plain periodic averaging (post-local SGD with ``warmup``)."""
    params = trainable(model)
    traj, pre = [], []
    for s in range(1, steps + 1):
        warm = s <= warmup
        step(model, opt, rank, s, (lambda: all_mean_([p.grad for p in params], group)) if warm else None)
        pre.append(state_of(model))
        if warm:
            if buffers == "average":
                all_mean_(float_buffers(model), group)
        elif (s - warmup) % H == 0:
            all_mean_(params, group)
            if buffers == "average":
                all_mean_(float_buffers(model), group)
        traj.append(state_of(model))
    return {"traj": traj, "pre": pre}


def ref_diloco(rank: int, model: nn.Module, inner: torch.optim.Optimizer, steps: int, H: int, group: Any,
               frags: list[list[str]], outer: tuple[float, float, bool], tau: int = 0, alpha: float = 0.0,
               wire: torch.dtype = torch.float32) -> dict:
    """DiLoCo / Streaming DiLoCo from the update equations (nothing from torch.optim for the
    outer step). Fragment k is applied after steps s with s % H == ((k + 1) H // F) % H and
    launched (its pseudo-gradient averaged) after step s - tau. A low-precision ``wire``:
    each rank's Delta rounded to it, summed exactly (two ranks), the mean rounded to it."""
    lr, mu, nesterov = outer
    F = len(frags)
    named = dict(model.named_parameters())
    anchor = {n: named[n].detach().clone() for f in frags for n in f}
    phase = [((k + 1) * H // F) % H for k in range(F)]
    mom: dict[str, torch.Tensor] = {}
    pending: dict[int, list[torch.Tensor]] = {}
    traj, launches, applies = [], [], []
    for s in range(1, steps + 1):
        step(model, inner, rank, s)
        with torch.no_grad():
            for k in range(F):
                if (s + tau) % H == phase[k]:   # launch: Delta = anchor - x, averaged
                    delta = [(anchor[n] - named[n]).to(wire).float() for n in frags[k]]
                    all_mean_(delta, group)
                    delta = [d.to(wire).float() for d in delta]
                    pending[k] = delta
                    launches.append((s, k))
            for k in range(F):
                if s % H == phase[k]:           # apply tau steps later
                    for n, g in zip(frags[k], pending.pop(k)):
                        if mu:
                            b = mom[n] = g.clone() if n not in mom else mom[n].mul_(mu).add_(g)
                            update = g + mu * b if nesterov else b
                        else:
                            update = g
                        anchor[n] = anchor[n] - lr * update
                        named[n].copy_(alpha * named[n] + (1 - alpha) * anchor[n])
                    applies.append((s, k))
            if s % H == 0:
                all_mean_(float_buffers(model), group)
        traj.append(state_of(model))
    return {"traj": traj, "launches": launches, "applies": applies}


def train_mode(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range,
               grads_at: tuple[int, ...] = ()) -> dict:
    """Drive a mode through ``opt.step()``; at the steps in ``grads_at``, also check that
    the grads after the step are the ones before it (DiLoCo restores the inner grads) and
    every parameter is still where it was (DiLoCo's outer step points parameters at the
    anchor's storage for the call, and back)."""
    traj, grads_kept = [], []
    for s in steps:
        opt.zero_grad()
        loss_of(model, batch_for(model, rank, s)).backward()
        before = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        where = {n: (p.data_ptr(), p.stride()) for n, p in model.named_parameters()}
        opt.step()
        if s in grads_at:
            after = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            grads_kept.append(after.keys() == before.keys()
                              and all(torch.equal(after[n], g) for n, g in before.items())
                              and all((p.data_ptr(), p.stride()) == where[n] for n, p in model.named_parameters()))
        traj.append(state_of(model))
    return {"traj": traj, "grads_kept": grads_kept}


def counters(mode: Any) -> dict:
    return {"steps": mode.steps, "syncs": mode.syncs, "bytes_per_sync": mode.bytes_per_sync,
            "fragment_names": [list(f) for f in mode.fragment_names]}


# ------------------------------------------------------------------ LocalSGD sub-cases

# name: (world, model, inner optimizer, steps, sync_every, warmup_steps, buffers)
PERIODIC: dict[str, tuple[int, str, str, int, int, int, str]] = {
    "odd-sgd-H4": (2, "odd", "sgd", 12, 4, 0, "average"),
    "odd-adamw-H3": (2, "odd", "adamw", 10, 3, 0, "average"),
    "bn-sgd-H4-average": (2, "bn", "sgd", 12, 4, 0, "average"),
    "bn-sgd-H4-local": (2, "bn", "sgd", 12, 4, 0, "local"),
    "odd-adamw-H4-warmup3": (2, "odd", "adamw", 15, 4, 3, "average"),
    "bn-sgd-H4-warmup3": (2, "bn", "sgd", 13, 4, 3, "average"),
    "frozen-sgd-H2": (2, "frozen", "sgd", 8, 2, 0, "average"),
    "w4-odd-sgd-H4": (4, "odd", "sgd", 12, 4, 0, "average"),
}


def hooks_on(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> int:
    """The hooks on ``model``'s modules and parameters (and ``opt``'s step hooks): torch's
    registries, read."""
    count = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    count += sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())
    if opt is not None:
        count += len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)
    return count


def case_periodic(rank: int, world: int, name: str, ref_group: Any) -> dict:
    _, model_name, opt_name, steps, H, warmup, buffers = PERIODIC[name]
    model = MODELS[model_name](SEED)
    opt = inner_opt(model, opt_name)
    unhooked, model_unhooked = hooks_on(model, opt), hooks_on(model)
    mode = fastreduce.LocalSGD(model, opt, H, warmup_steps=warmup, buffers=buffers)
    fr = train_mode(model, opt, rank, range(1, steps + 1))
    out = {"fr": fr["traj"], **counters(mode), "model_hooks_after_warmup": hooks_on(model) - model_unhooked}
    mode.remove()
    out["hooks_left"] = hooks_on(model, opt) - unhooked
    model = MODELS[model_name](SEED)
    ref = ref_local(rank, model, inner_opt(model, opt_name), steps, H, ref_group, warmup, buffers)
    return out | {"ref": ref["traj"], "ref_pre": ref["pre"]}


def case_ddp(rank: int, world: int, ref_group: Any) -> dict:
    """LocalSGD(sync_every=1) against torch DDP, both SGD(lr 0.05, momentum 0.9), 20 steps."""
    model = odd_model(SEED)
    opt = inner_opt(model, "sgd")
    mode = fastreduce.LocalSGD(model, opt, 1)
    fr = train_mode(model, opt, rank, range(1, 21))["traj"]
    mode.remove()
    ref_model = odd_model(SEED)
    ddp = nn.parallel.DistributedDataParallel(ref_model, process_group=ref_group)
    ref_opt = inner_opt(ddp, "sgd")
    ref = []
    for s in range(1, 21):
        ref_opt.zero_grad()
        loss_of(ddp, batch_for(ref_model, rank, s)).backward()
        ref_opt.step()
        ref.append(state_of(ref_model))
    return {"fr": fr, "ref": ref}


def case_sync_remove(rank: int, world: int, ref_group: Any) -> dict:
    """H=4, 10 steps (mid-period), sync(), remove(), 4 more steps: local only."""
    model = odd_model(SEED)
    opt = inner_opt(model, "sgd")
    mode = fastreduce.LocalSGD(model, opt, 4)
    train_mode(model, opt, rank, range(1, 11))
    before = params_of(model)
    mode.sync()
    synced = params_of(model)
    mode.remove()
    hooks = opt_hook_counts(opt)
    after = train_mode(model, opt, rank, range(11, 15))["traj"]
    model = odd_model(SEED)
    ref_opt = inner_opt(model, "sgd")
    ref_local(rank, model, ref_opt, 10, 4, ref_group)
    ref_before = params_of(model)
    all_mean_(trainable(model), ref_group)
    ref_synced = params_of(model)
    ref_after = []
    for s in range(11, 15):
        step(model, ref_opt, rank, s)
        ref_after.append(state_of(model))
    return {"before": before, "synced": synced, "after": after, "hooks_after_remove": hooks,
            "ref_before": ref_before, "ref_synced": ref_synced, "ref_after": ref_after}


def case_diloco_sync(rank: int, world: int) -> dict:
    """DiLoCo F=2, H=4, tau=1, alpha=0.5, outer SGD lr=1, fp32 wire: 5 steps (fragment 0 on
    the wire since step 5), then sync(): an outer step of both fragments without alpha."""
    model = odd_model(SEED)
    opt = inner_opt(model, "sgd")
    mode = fastreduce.DiLoCo(model, opt, torch.optim.SGD(trainable(model), lr=1.0), 4, fragments=2,
                             fragment_delay=1, fragment_alpha=0.5, wire_dtype=torch.float32)
    train_mode(model, opt, rank, range(1, 6))
    before, syncs = params_of(model), mode.syncs
    mode.sync()
    return {"before": before, "after": params_of(model), "steps": mode.steps, "syncs": mode.syncs - syncs}


HIERARCHIES = {"full": {2: 2, 4: 4}, "no-world-entry": {2: 2}}
HIER_STEPS = 10


def case_hierarchy(rank: int, world: int, hierarchy_name: str) -> dict:
    model = odd_model(SEED)
    opt = inner_opt(model, "sgd")
    mode = fastreduce.LocalSGD(model, opt, 4, hierarchy=HIERARCHIES[hierarchy_name])
    fr = train_mode(model, opt, rank, range(1, HIER_STEPS + 1))["traj"]
    out = {"fr": fr, "steps": mode.steps}
    mode.remove()
    return out


def case_hierarchy_rebuilt(rank: int, world: int) -> dict:
    """LocalSGD(hierarchy=) built, trained, closed and dropped again and again: this
    process's descriptors and Python threads after each build (the threads once any that
    is ending has ended, waited for up to 2 s: a worker let go as what it served was
    collected ends on its own time, and CI once counted one such, 6, 6 then 7)."""
    counts = []
    for _ in range(3):
        model = odd_model(SEED)
        opt = inner_opt(model, "sgd")
        mode = fastreduce.LocalSGD(model, opt, 2, hierarchy={1: 2})
        train_mode(model, opt, rank, range(1, 5))
        mode.close()
        del mode, model, opt
        gc.collect()
        deadline = time.monotonic() + 2.0
        while counts and threading.active_count() > counts[0][1] and time.monotonic() < deadline:
            time.sleep(0.02)  # (a thread kept per build never ends: still counted)
        counts.append((len(os.listdir("/proc/self/fd")), threading.active_count()))
    return {"counts": counts, "threads": sorted(t.name for t in threading.enumerate())}


def case_torch_hierarchy(rank: int, world: int) -> dict:
    """torch's HierarchicalModelAverager({2: 2, 4: 4}) after each step, counter aligned."""
    model = odd_model(SEED)
    opt = inner_opt(model, "sgd")
    averager = HierarchicalModelAverager(OrderedDict([(2, 2), (4, 4)]), warmup_steps=0)
    averager.step = 1
    traj = []
    for s in range(1, HIER_STEPS + 1):
        step(model, opt, rank, s)
        averager.average_parameters(model.parameters())
        traj.append(state_of(model))
    return {"ref": traj}


def case_bf16_local(rank: int, world: int, ref_group: Any) -> dict:
    model = odd_model(SEED)
    opt = inner_opt(model, "sgd")
    mode = fastreduce.LocalSGD(model, opt, 4, wire_dtype=torch.bfloat16)
    fr = train_mode(model, opt, rank, range(1, 13))["traj"]
    out = {"fr": fr, **counters(mode)}
    mode.remove()
    model = odd_model(SEED)
    ref = ref_local(rank, model, inner_opt(model, "sgd"), 12, 4, ref_group)
    return out | {"ref": ref["traj"], "ref_pre": ref["pre"]}


# ------------------------------------------------------------------ DiLoCo sub-cases

# name: (world, model, inner, steps, H, fragments, delay, alpha, outer, wire, extra kwargs)
DILOCO: dict[str, tuple] = {
    "lr1-fp32": (2, "odd", "sgd", 12, 4, 1, 0, 0.0, PLAIN_AVG, torch.float32, {}),
    "lr1-bf16": (2, "odd", "sgd", 12, 4, 1, 0, 0.0, PLAIN_AVG, None, {}),   # None: the default wire
    "nesterov-F1": (2, "odd", "adamw", 16, 4, 1, 0, 0.0, NESTEROV, torch.float32, {}),
    "F2-tau0-heavyball": (2, "odd", "adamw", 12, 4, 2, 0, 0.0, HEAVY_BALL, torch.float32, {}),
    "F2-tau1-a0": (2, "odd", "adamw", 12, 4, 2, 1, 0.0, NESTEROV, torch.float32, {}),
    "F2-tau1-a0.5": (2, "odd", "adamw", 12, 4, 2, 1, 0.5, NESTEROV, torch.float32, {}),
    "F2-tau1-a0.5-cpu": (2, "odd", "adamw", 12, 4, 2, 1, 0.5, NESTEROV, torch.float32, {"backup_device": "cpu"}),
    "F3-H6-tau1-a0": (2, "odd", "adamw", 12, 6, 3, 1, 0.0, NESTEROV, torch.float32, {}),
    "F3-H6-tau1-a0.5": (2, "odd", "sgd", 12, 6, 3, 1, 0.5, HEAVY_BALL, torch.float32, {}),
    "F3-H6-tau0-a0.5": (2, "odd", "adamw", 12, 6, 3, 0, 0.5, NESTEROV, torch.float32, {}),
    "frozen-F2-tau1": (2, "frozen", "adamw", 12, 4, 2, 1, 0.5, NESTEROV, torch.float32, {}),
    "bn-F2-tau1": (2, "bn", "sgd", 12, 4, 2, 1, 0.0, NESTEROV, torch.float32, {}),
    "w4-F2-tau1-a0.5": (4, "odd", "adamw", 12, 4, 2, 1, 0.5, NESTEROV, torch.float32, {}),
    # a bf16 wire summed in fp32: on a process group two collectives, the second issued
    # ceil(tau / 2) steps after the launch (the reference rounds as the wire does)
    "F2-H8-tau3-bf16acc": (2, "odd", "adamw", 16, 8, 2, 3, 0.5, NESTEROV, torch.bfloat16,
                           {"accumulate_dtype": torch.float32}),
}


def diloco_kwargs(F: int, tau: int, alpha: float, wire: torch.dtype | None, extra: dict) -> dict:
    kw = dict(fragments=F, fragment_delay=tau, fragment_alpha=alpha, **extra)
    if wire is not None:
        kw["wire_dtype"] = wire
    return kw


def case_diloco(rank: int, world: int, name: str, ref_group: Any) -> dict:
    _, model_name, opt_name, steps, H, F, tau, alpha, outer, wire, extra = DILOCO[name]
    model = MODELS[model_name](SEED)
    inner = inner_opt(model, opt_name)
    mode = fastreduce.DiLoCo(model, inner, outer_sgd(model, outer), H, **diloco_kwargs(F, tau, alpha, wire, extra))
    phases: list[tuple[int, int, str]] = []   # (step, fragment, what is on the wire after it)

    def record(*_: Any) -> None:
        for k, (work, _then) in mode._in_flight.items():
            if isinstance(work, Fp32Accumulate):
                phases.append((mode.steps, k, "all-to-all" if work.first is not None else
                               "gather" if work.second is not None else "done"))

    hook = inner.register_step_post_hook(record)   # after the mode's own step hook
    fr = train_mode(model, inner, rank, range(1, steps + 1), grads_at=tuple(range(1, steps + 1)))
    hook.remove()
    c = counters(mode)
    out = {"fr": fr["traj"], "grads_kept": fr["grads_kept"], **c, "phases": phases,
           "two_phase": mode._plan.fp32_accumulate,
           "communicates": [s for s in range(1, steps + 1) if mode.communicates_at(s)],
           "trainable": [n for n, p in model.named_parameters() if p.requires_grad],
           "numel": {n: p.numel() for n, p in model.named_parameters()}}
    mode.remove()
    model = MODELS[model_name](SEED)
    ref = ref_diloco(rank, model, inner_opt(model, opt_name), steps, H, ref_group, c["fragment_names"], outer,
                     tau, alpha, wire)
    return out | {"ref": ref["traj"], "applies": ref["applies"], "launches": ref["launches"]}


# ------------------------------------------------------------------ resume

# name: (kind, inner, sync_every, steps, save after step, mode kwargs)
RESUME: dict[str, tuple[str, str, int, int, int, dict]] = {
    "local-warmup": ("local", "adamw", 4, 15, 9, {"warmup_steps": 3}),
    "local-in-warmup": ("local", "adamw", 4, 10, 2, {"warmup_steps": 3}),
    "local-warmup-bf16": ("local", "sgd", 4, 15, 9, {"warmup_steps": 3, "wire_dtype": torch.bfloat16}),
    # launches after 1, 3, 5, ...; applies after 2, 4, 6, ...: saved with fragment 0 in flight
    "diloco-fragments": ("diloco", "adamw", 4, 12, 5,
                         {"fragments": 2, "fragment_delay": 1, "fragment_alpha": 0.5}),
    "diloco-fragments-fp32": ("diloco", "sgd", 4, 12, 7,
                              {"fragments": 2, "fragment_delay": 1, "wire_dtype": torch.float32}),
}


def build_resume(name: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    kind, opt_name, H, _, _, kw = RESUME[name]
    model = odd_model(seed)
    inner = inner_opt(model, opt_name)
    if kind == "local":
        mode = fastreduce.LocalSGD(model, inner, H, **kw)
    else:
        mode = fastreduce.DiLoCo(model, inner, outer_sgd(model, NESTEROV), H, **kw)
    return model, inner, mode


def resume_files(path: str, name: str, rank: int) -> dict[str, str]:
    return {what: os.path.join(path, f"{name}-rank{rank}-{what}.pt") for what in ("model", "optim", "mode")}


def case_resume_save(rank: int, world: int, name: str, path: str) -> dict:
    _, _, _, steps, save_at, _ = RESUME[name]
    model, inner, mode = build_resume(name, SEED)
    full = train_mode(model, inner, rank, range(1, steps + 1))["traj"][-1]
    mode.remove()
    model, inner, mode = build_resume(name, SEED)
    train_mode(model, inner, rank, range(1, save_at + 1))
    files = resume_files(path, name, rank)
    torch.save(model.state_dict(), files["model"])
    torch.save(inner.state_dict(), files["optim"])
    torch.save(mode.state_dict(), files["mode"])
    at_save = state_of(model)
    # Saving must not disturb the run: the saving run goes on to the end like the full one.
    continued = train_mode(model, inner, rank, range(save_at + 1, steps + 1))["traj"][-1]
    mode.remove()
    return {"full": full, "at_save": at_save, "continued": continued}


def case_resume_load(rank: int, world: int, name: str, path: str, load_mode: bool) -> dict:
    _, _, _, steps, save_at, _ = RESUME[name]
    model, inner, mode = build_resume(name, SEED + 1)   # other values: all must come from the files
    files = resume_files(path, name, rank)
    model.load_state_dict(torch.load(files["model"]))
    inner.load_state_dict(torch.load(files["optim"]))
    if load_mode:
        mode.load_state_dict(torch.load(files["mode"]))
    loaded, steps_loaded = state_of(model), mode.steps
    out = train_mode(model, inner, rank, range(save_at + 1, steps + 1))["traj"][-1]
    mode.remove()
    return {"loaded": loaded, "steps_loaded": steps_loaded, "out": out}


def case_resume_outer_groups(rank: int, world: int, path: str) -> dict:
    """The saved "diloco-fragments" state loaded into a DiLoCo whose outer optimizer holds the
    parameters in 2 groups (the saved one in 1), 3 steps into its run (a fragment on the
    wire); beside it an identical mode that never sees the call. Both then train on."""
    _, opt_name, H, steps, _, kw = RESUME["diloco-fragments"]
    state = torch.load(resume_files(path, "diloco-fragments", rank)["mode"])
    out: dict[str, Any] = {}
    trajs = []
    for attempt in (True, False):
        model = odd_model(SEED + 1)
        inner = inner_opt(model, opt_name)
        params = trainable(model)
        outer = torch.optim.SGD([{"params": params[:1]}, {"params": params[1:]}], lr=0.7, momentum=0.9)
        mode = fastreduce.DiLoCo(model, inner, outer, H, **kw)
        train_mode(model, inner, rank, range(1, 4))
        if attempt:
            out["load"] = expect_raises(ValueError, lambda: mode.load_state_dict(state))
            out["steps"] = mode.steps
        trajs.append(train_mode(model, inner, rank, range(4, steps + 1))["traj"])
        mode.remove()
    out["same"] = [same_state(a, b) for a, b in zip(*trajs)]
    return out


def case_resume_other_delay(rank: int, world: int, path: str) -> dict:
    """The saved "diloco-fragments" state (fragment_delay=1, fragment 0 on the wire) loaded
    into a DiLoCo built with fragment_delay=0, and into one built with sync_every=8."""
    _, opt_name, H, _, _, kw = RESUME["diloco-fragments"]
    state = torch.load(resume_files(path, "diloco-fragments", rank)["mode"])
    out: dict[str, Any] = {"in_flight": bool(state["in_flight"] or state.get("to_send"))}
    for what, (h, delay) in {"delay": (H, 0), "sync_every": (2 * H, 1)}.items():
        model = odd_model(SEED + 1)
        inner = inner_opt(model, opt_name)
        mode = fastreduce.DiLoCo(model, inner, outer_sgd(model, NESTEROV), h, **{**kw, "fragment_delay": delay})
        out[what] = expect_raises(ValueError, lambda: mode.load_state_dict(state))
        out[f"{what}_steps"] = mode.steps
        mode.remove()
    return out


def resume_worker(rank: int, world: int, path: str) -> dict:
    res = {}
    for name in RESUME:
        res[name] = guarded(case_resume_load, rank, world, name, path, True)
        res[name + "/without-mode-state"] = guarded(case_resume_load, rank, world, name, path, False)
    res["outer-groups"] = guarded(case_resume_outer_groups, rank, world, path)
    res["other-delay"] = guarded(case_resume_other_delay, rank, world, path)
    return res


# ------------------------------------------------------------------ warnings (rank 0's broadcast)

def case_warn(rank: int, world: int, kind: str, differ: bool) -> dict:
    """Ranks with different (``differ``) or identical initial params. DiLoCo trains H=4 steps
    at inner lr 0: the params stay rank 0's only if the anchor is rank 0's too."""
    model = odd_model(SEED + (rank if differ else 0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if kind == "local":
            opt = inner_opt(model, "sgd")
            mode = fastreduce.LocalSGD(model, opt, 4)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.0)
            mode = fastreduce.DiLoCo(model, opt, outer_sgd(model, NESTEROV), 4)
    constructed = params_of(model)
    after = train_mode(model, opt, rank, range(1, 5))["traj"][-1] if kind == "diloco" else None
    mode.remove()
    return {"warnings": [(w.category.__name__, str(w.message)) for w in caught],
            "constructed": constructed, "after": after}


def case_strided(rank: int, world: int) -> dict:
    """Ranks differing in a frozen parameter that is a column slice of a wider table and a
    buffer that is every other element of a longer one (neither contiguous): after
    LocalSGD's construction each holds rank 0's values, as DDP's construction gives."""
    model = odd_model(SEED)
    table = torch.arange(32.0).view(4, 8) * (rank + 1)
    model.frozen = nn.Parameter(table[:, :4], requires_grad=False)
    model.register_buffer("strided", (torch.arange(16.0) * (rank + 1))[::2])
    mode = fastreduce.LocalSGD(model, inner_opt(model, "sgd"), 4)
    mode.remove()
    return {"frozen": model.frozen.detach().clone(), "strided": model.strided.clone()}


# ------------------------------------------------------------------ errors

def snapshot(model: nn.Module) -> list[tuple]:
    return [(n, p.grad, None if p.grad is None else p.grad.detach().clone(), p.detach().clone())
            for n, p in model.named_parameters()]


def changed_since(snap: list[tuple], model: nn.Module) -> list[str]:
    params = dict(model.named_parameters())
    bad = []
    for name, grad, grad_copy, data in snap:
        p = params[name]
        same_grad = p.grad is grad and (grad is None or torch.equal(p.grad, grad_copy))
        if not same_grad or not torch.equal(p.detach(), data):
            bad.append(name)
    return bad


def opt_hook_counts(opt: torch.optim.Optimizer) -> list[int]:
    import torch.optim.optimizer as optim_mod
    own = [len(v) for k, v in sorted(vars(opt).items()) if k.startswith("_optimizer_") and isinstance(v, dict)]
    return own + [len(optim_mod._global_optimizer_pre_hooks), len(optim_mod._global_optimizer_post_hooks)]


def hook_counts(model: nn.Module, opt: torch.optim.Optimizer) -> list[int]:
    """Hooks on each parameter, module and the optimizer (its own and torch's global ones)."""
    per_param = [len(getattr(p, "_post_accumulate_grad_hooks", None) or ()) + len(p._backward_hooks or ())
                 for p in model.parameters()]
    per_module = [len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks)
                  + len(m._backward_pre_hooks) + len(m._state_dict_hooks) + len(m._load_state_dict_pre_hooks)
                  for m in model.modules()]
    return per_param + per_module + opt_hook_counts(opt)


def same_state(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b


def _extra_param() -> nn.Parameter:
    return nn.Parameter(torch.zeros(3))


def _inner_plain(model: nn.Module) -> torch.optim.Optimizer:
    return inner_opt(model, "sgd")


def _inner_foreign(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(trainable(model) + [_extra_param()], lr=0.05, momentum=0.9)


BF16 = torch.bfloat16


def _local(*args: Any, **kw: Any) -> Callable:
    return lambda model, opt: fastreduce.LocalSGD(model, opt, *args, **kw)


def _diloco(*args: Any, outer: Callable[[nn.Module, Any], Any] | None = None, **kw: Any) -> Callable:
    def make(model: nn.Module, opt: torch.optim.Optimizer) -> Any:
        out = outer(model, opt) if outer is not None else outer_sgd(model, NESTEROV)
        return fastreduce.DiLoCo(model, opt, out, *args, **kw)
    return make


# name: (world, model, inner optimizer, construction, exception, words its message must contain)
ERRORS: dict[str, tuple[int, str, Callable, Callable, str, list[str]]] = {
    "local-sync_every-0": (2, "odd", _inner_plain, _local(0), "ValueError", ["sync_every"]),
    "local-sync_every-negative": (2, "odd", _inner_plain, _local(-3), "ValueError", ["sync_every"]),
    # (beyond the spec's list, the issue's "bad input with clear errors")
    "local-warmup-negative": (2, "odd", _inner_plain, _local(4, warmup_steps=-1), "ValueError", ["warmup"]),
    "local-buffers": (2, "odd", _inner_plain, _local(4, buffers="mean"), "ValueError", ["buffers"]),
    "local-inner-foreign-param": (2, "odd", _inner_foreign, _local(4), "ValueError", ["model"]),
    "diloco-sync_every-0": (2, "odd", _inner_plain, _diloco(0), "ValueError", ["sync_every"]),
    "diloco-fragments-0": (2, "odd", _inner_plain, _diloco(4, fragments=0), "ValueError", ["fragments"]),
    "diloco-fragments-more-than-params": (2, "odd", _inner_plain, _diloco(8, fragments=8), "ValueError",
                                          ["fragments"]),
    "diloco-fragments-do-not-divide-H": (2, "odd", _inner_plain, _diloco(4, fragments=3), "ValueError",
                                         ["fragments"]),
    "diloco-delay-negative": (2, "odd", _inner_plain, _diloco(4, fragment_delay=-1), "ValueError",
                              ["fragment_delay"]),
    "diloco-delay-H/F": (2, "odd", _inner_plain, _diloco(4, fragments=2, fragment_delay=2), "ValueError",
                         ["fragment_delay"]),
    "diloco-delay-H": (2, "odd", _inner_plain, _diloco(4, fragment_delay=4), "ValueError", ["fragment_delay"]),
    "diloco-alpha-negative": (2, "odd", _inner_plain, _diloco(4, fragment_alpha=-0.1), "ValueError",
                              ["alpha"]),
    "diloco-alpha-above-1": (2, "odd", _inner_plain, _diloco(4, fragment_alpha=1.5), "ValueError", ["alpha"]),
    "diloco-outer-subset": (2, "odd", _inner_plain,
                            _diloco(4, outer=lambda m, o: torch.optim.SGD(trainable(m)[:-1], lr=0.7)),
                            "ValueError", ["outer"]),
    "diloco-outer-extra-param": (2, "odd", _inner_plain,
                                 _diloco(4, outer=lambda m, o: torch.optim.SGD(trainable(m) + [_extra_param()],
                                                                               lr=0.7)),
                                 "ValueError", ["outer"]),
    "diloco-outer-holds-frozen": (2, "frozen", _inner_plain,
                                  _diloco(4, outer=lambda m, o: torch.optim.SGD(m.parameters(), lr=0.7)),
                                  "ValueError", ["outer"]),
    "diloco-outer-is-inner": (2, "odd", _inner_plain, _diloco(4, outer=lambda m, o: o), "ValueError", ["outer"]),
    "diloco-inner-foreign-param": (2, "odd", _inner_foreign, _diloco(4), "ValueError", ["model"]),
    "diloco-buffers": (2, "odd", _inner_plain, _diloco(4, buffers="none"), "ValueError", ["buffers"]),
    # world 4: hierarchy problems
    "hierarchy-size-does-not-divide-world": (4, "odd", _inner_plain, _local(4, hierarchy={2: 3, 4: 4}),
                                             "ValueError", ["hierarchy"]),
    "hierarchy-size-above-world": (4, "odd", _inner_plain, _local(4, hierarchy={2: 8}), "ValueError",
                                   ["hierarchy"]),
    "hierarchy-world-period-not-sync_every": (4, "odd", _inner_plain, _local(8, hierarchy={2: 2, 4: 4}),
                                              "ValueError", ["hierarchy"]),
    "hierarchy-size-shrinks-with-period": (4, "odd", _inner_plain, _local(2, hierarchy={2: 4, 4: 2}),
                                           "ValueError", ["hierarchy"]),
    "hierarchy-period-0": (4, "odd", _inner_plain, _local(4, hierarchy={0: 2, 4: 4}), "ValueError",
                           ["hierarchy"]),
    "hierarchy-with-wire_dtype": (4, "odd", _inner_plain, _local(4, hierarchy={2: 2, 4: 4}, wire_dtype=BF16),
                                  "ValueError", ["hierarchy"]),
}


def case_error(rank: int, world: int, name: str) -> dict:
    """Ranks with different params (a broadcast before the check would show), optimizer
    state and grads present; the failed construction must change none of them and leave no
    hook: 4 more steps equal plain local steps on a copy taken before it."""
    _, model_name, make_inner, construct, _, _ = ERRORS[name]
    model = MODELS[model_name](SEED + rank)
    inner = make_inner(model)
    step(model, inner, rank, 100)
    loss_of(model, batch_for(model, rank, 101)).backward()
    ref_model, ref_inner = copy.deepcopy((model, inner))
    snap, hooks, sd = snapshot(model), hook_counts(model, inner), copy.deepcopy(inner.state_dict())
    res = expect_raises(Exception, lambda: construct(model, inner))
    res |= {"changed": changed_since(snap, model), "hooks_left": hook_counts(model, inner) != hooks,
            "optim_same": same_state(inner.state_dict(), sd)}
    for s in range(1, 5):
        step(model, inner, rank, s)
        step(ref_model, ref_inner, rank, s)
    res["plain_after"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))
    return res


UNFROZEN = ("local", "local-warmup", "diloco")


def case_unfrozen(rank: int, world: int, kind: str) -> dict:
    """Gradual unfreezing: the backbone frozen when the mode was built, unfrozen and given to
    the optimizer after step 1. At step 2, which syncs (``sync_every=2``; in the warm-up every
    step averages), the step, ``sync()`` and ``average_warmup_grads()`` must raise on every
    rank and change nothing; the documented way (requires_grad as it was, ``sync()``,
    ``close()``, unfreeze, build again) then averages the backbone too, with no warning
    that the ranks differed."""
    model = frozen_backbone_model(SEED + rank)
    inner = inner_opt(model, "sgd")

    def build() -> Any:
        if kind == "diloco":
            return fastreduce.DiLoCo(model, inner, outer_sgd(model, NESTEROV), 2, wire_dtype=torch.float32)
        return fastreduce.LocalSGD(model, inner, 2, warmup_steps=2 if kind == "local-warmup" else 0)

    mode = build()
    step(model, inner, rank, 1)
    model.backbone.requires_grad_(True)
    inner.add_param_group({"params": list(model.backbone.parameters())})
    inner.zero_grad()
    loss_of(model, batch_for(model, rank, 2)).backward()
    snap, sd = snapshot(model), copy.deepcopy(inner.state_dict())
    calls = {"step": inner.step, "sync": mode.sync}
    if kind == "local-warmup":
        calls["average_warmup_grads"] = mode.average_warmup_grads
    res: dict[str, Any] = {call: expect_raises(RuntimeError, fn) for call, fn in calls.items()}
    res |= {"changed": changed_since(snap, model), "optim_same": same_state(inner.state_dict(), sd),
            "steps": mode.steps}
    model.backbone.requires_grad_(False)
    mode.sync()
    mode.close()
    model.backbone.requires_grad_(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mode = build()
    res["warned"] = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    before = params_of(model)
    for s in (3, 4):  # the new mode's second step syncs
        step(model, inner, rank, s)
    res |= {"before": before, "after": params_of(model)}
    mode.close()
    return res


# ------------------------------------------------------------------ group= (world 4)

def case_group(rank: int, world: int, kind: str, group: Any, ref_group: Any) -> dict | None:
    """The mode on ranks GROUP_RANKS only, from different initial params (the group's first
    rank's are broadcast); the reference runs from those on its own subgroup."""
    if rank not in GROUP_RANKS:
        return None
    model = odd_model(SEED + rank)
    inner = inner_opt(model, "adamw")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if kind == "local":
            mode = fastreduce.LocalSGD(model, inner, 4, group=group)
        else:
            mode = fastreduce.DiLoCo(model, inner, outer_sgd(model, NESTEROV), 4, group=group, fragments=2,
                                     fragment_delay=1, fragment_alpha=0.5, wire_dtype=torch.float32)
    frags = [list(f) for f in mode.fragment_names]
    init = params_of(model)
    fr = train_mode(model, inner, rank, range(1, 13))["traj"]
    mode.remove()
    model = odd_model(SEED + GROUP_RANKS[0])
    ref_inner = inner_opt(model, "adamw")
    if kind == "local":
        ref = ref_local(rank, model, ref_inner, 12, 4, ref_group)
    else:
        ref = ref_diloco(rank, model, ref_inner, 12, 4, ref_group, frags, NESTEROV, tau=1, alpha=0.5)
    return {"fr": fr, "ref": ref["traj"], "init": init,
            "warned": any(issubclass(w.category, UserWarning) for w in caught)}


# ------------------------------------------------------------------ the spawned worlds

def world_worker(rank: int, world: int, path: str) -> dict:
    ref_group = dist.new_group(backend="gloo")   # the references' own collectives
    res: dict[str, Any] = {}
    if world == 2:
        res["ddp"] = guarded(case_ddp, rank, world, ref_group)
        res["sync_remove"] = guarded(case_sync_remove, rank, world, ref_group)
        res["diloco_sync"] = guarded(case_diloco_sync, rank, world)
        res["bf16_local"] = guarded(case_bf16_local, rank, world, ref_group)
    for name, spec in PERIODIC.items():
        if spec[0] == world:
            res["periodic/" + name] = guarded(case_periodic, rank, world, name, ref_group)
    for name, spec in DILOCO.items():
        if spec[0] == world:
            res["diloco/" + name] = guarded(case_diloco, rank, world, name, ref_group)
    if world == 4:
        for name in HIERARCHIES:
            res["hierarchy/" + name] = guarded(case_hierarchy, rank, world, name)
        res["torch_hierarchy"] = guarded(case_torch_hierarchy, rank, world)
        res["hierarchy_rebuilt"] = guarded(case_hierarchy_rebuilt, rank, world)
    if world == 2:
        for name in RESUME:
            res["resume_save/" + name] = guarded(case_resume_save, rank, world, name, path)
        for kind in ("local", "diloco"):
            for differ in (True, False):
                res[f"warn/{kind}-{'differ' if differ else 'same'}"] = guarded(case_warn, rank, world, kind, differ)
        res["strided"] = guarded(case_strided, rank, world)
        for kind in UNFROZEN:
            res["unfrozen/" + kind] = guarded(case_unfrozen, rank, world, kind)
    for name, spec in ERRORS.items():
        if spec[0] == world:
            res["error/" + name] = guarded(case_error, rank, world, name)
    if world == 4:   # last: a wrong group would hang the others' world collectives
        group = dist.new_group(list(GROUP_RANKS))   # every rank creates every group
        sub_ref = dist.new_group(list(GROUP_RANKS))
        for kind in ("local", "diloco"):
            res["group/" + kind] = guarded(case_group, rank, world, kind, group, sub_ref)
    return res


# ============================================================== fixtures and helpers (parent)

@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("local_ckpt"))


_RESULTS: dict[Any, Any] = {}


@pytest.fixture(scope="module")
def worlds(ckpt_dir):
    """``worlds(N)``: the per-rank results of world N's spawn, run once (a failed spawn is
    reported by every test that needs it, not retried by each)."""
    yield lambda world: spawn_once(_RESULTS, world, lambda: spawn(world_worker, world, ckpt_dir))
    _RESULTS.clear()


@pytest.fixture(scope="module")
def resumed(worlds, ckpt_dir) -> list[dict]:
    """A second world-2 spawn (new processes, new group) loading what world 2 saved."""
    worlds(2)
    return spawn_once(_RESULTS, "resumed", lambda: spawn(resume_worker, 2, ckpt_dir))


def close(actual: torch.Tensor, expected: torch.Tensor, msg: str, atol: float = ATOL, rtol: float = 0.0) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol,
                               msg=lambda m: f"{msg}\n{m}")


def assert_state_close(got: dict, want: dict, where: str, atol: float = ATOL) -> None:
    """Float tensors to ``atol``, integer buffers exactly."""
    assert got.keys() == want.keys(), where
    for n, w in want.items():
        if w.is_floating_point():
            close(got[n], w, f"{where}: {n}", atol=atol)
        else:
            assert torch.equal(got[n], w), f"{where}: integer buffer {n}: {got[n]} != {w}"


def assert_traj_close(got: list[dict], want: list[dict], where: str, atol: float = ATOL) -> None:
    assert len(got) == len(want), where
    for s, (g, w) in enumerate(zip(got, want), 1):
        assert_state_close(g, w, f"{where}, after step {s}", atol=atol)


def max_diff(a: dict, b: dict) -> float:
    """Largest difference over the float tensors both hold."""
    return max(float((a[n].double() - b[n].double()).abs().max()) for n in a.keys() & b.keys()
               if a[n].is_floating_point())


def assert_wire_bytes(got: int | list[int], itemsize: int) -> None:
    """``bytes_per_sync``: OddModel's numel x the wire's itemsize, plus at most the
    communication layer's alignment padding (equal cache-line chunks per rank: < 1024 elements)."""
    total = sum(got) if isinstance(got, list) else got
    assert ODD_NUMEL * itemsize <= total < (ODD_NUMEL + 1024) * itemsize and total % itemsize == 0, got


def identical(states: list[dict]) -> bool:
    return all(torch.equal(s[n], states[0][n]) for s in states[1:] for n in states[0])


# ============================================================== LocalSGD

def test_sync_every_1_matches_torch_ddp(worlds) -> None:
    outs = per_rank(worlds(2), "ddp")
    for rank, o in enumerate(outs):
        assert_traj_close(o["fr"], o["ref"], f"rank {rank}: LocalSGD(1) vs DDP")
    for s in range(20):
        assert identical([o["fr"][s] for o in outs]), f"after step {s + 1}: the ranks' parameters differ"
    assert max_diff(outs[0]["fr"][-1], params_of(odd_model(SEED))) > 1e-2, "the run did not train"


@pytest.mark.parametrize("name", list(PERIODIC))
@pytest.mark.cell("loop", "train", modes=("localsgd",))
def test_periodic_averaging_matches_reference_loop(worlds, name) -> None:
    world, model_name, _, steps, H, warmup, buffers = PERIODIC[name]
    outs = per_rank(worlds(world), "periodic/" + name)
    for rank, o in enumerate(outs):
        assert_traj_close(o["fr"], o["ref"], f"{name}, rank {rank}")
        assert o["steps"] == steps
        assert o["syncs"] == (steps - warmup) // H, f"rank {rank}: syncs {o['syncs']}"
    model = MODELS[model_name](SEED)
    averaged = [n for n, p in model.named_parameters() if p.requires_grad]
    if buffers == "average":
        averaged += [n for n, b in model.named_buffers() if b.is_floating_point()]
    for s in range(1, steps + 1):
        if s <= warmup or (s - warmup) % H == 0:   # every rank holds the same averaged values
            for n in averaged:
                assert all(torch.equal(o["fr"][s - 1][n], outs[0]["fr"][s - 1][n]) for o in outs), \
                    f"{name}: after step {s} (averaged) the ranks' {n} differ"
        else:   # the reference itself: ranks apart mid-period (else the test proves little)
            assert max_diff(outs[0]["ref"][s - 1], outs[1]["ref"][s - 1]) > 1e-5, (name, s)


@pytest.mark.parametrize("name", [n for n, c in PERIODIC.items() if c[5] > 0])
def test_the_warm_up_leaves_no_hook_on_the_model_and_close_none_anywhere(worlds, name) -> None:
    """Past the warm-up (every step reduced as DDP does), the model keeps none of its
    reducer's hooks (their work grew with every later step); after close(), nothing is left."""
    for rank, o in enumerate(per_rank(worlds(PERIODIC[name][0]), "periodic/" + name)):
        assert o["model_hooks_after_warmup"] == 0, (rank, o["model_hooks_after_warmup"])
        assert o["hooks_left"] == 0, (rank, o["hooks_left"])


def test_buffers_local_are_left_alone_and_average_are_averaged(worlds) -> None:
    """Reference sanity and the mode: with buffers="local" the running stats stay apart after
    a sync; with "average" they are equal; num_batches_tracked is never averaged."""
    local = per_rank(worlds(2), "periodic/bn-sgd-H4-local")
    avg = per_rank(worlds(2), "periodic/bn-sgd-H4-average")
    for s in (4, 8, 12):
        assert not torch.equal(local[0]["fr"][s - 1]["bn.running_mean"], local[1]["fr"][s - 1]["bn.running_mean"])
        assert torch.equal(avg[0]["fr"][s - 1]["bn.running_mean"], avg[1]["fr"][s - 1]["bn.running_mean"])
        for o in local + avg:
            assert int(o["fr"][s - 1]["bn.num_batches_tracked"]) == s


def test_sync_averages_now_and_remove_stops_syncing(worlds) -> None:
    outs = per_rank(worlds(2), "sync_remove")
    assert max_diff(outs[0]["ref_before"], outs[1]["ref_before"]) > 1e-5   # mid-period: ranks apart
    for rank, o in enumerate(outs):
        assert_state_close(o["before"], o["ref_before"], f"rank {rank}: before sync()")
        assert_state_close(o["synced"], o["ref_synced"], f"rank {rank}: after sync()")
        assert all(c == 0 for c in o["hooks_after_remove"]), f"rank {rank}: hooks left after remove(): {o}"
        assert_traj_close(o["after"], o["ref_after"], f"rank {rank}: local steps after remove()")
    assert identical([o["synced"] for o in outs])


def test_diloco_sync_steps_every_fragment_now_without_alpha(worlds) -> None:
    outs = per_rank(worlds(2), "diloco_sync")
    assert max_diff(outs[0]["before"], outs[1]["before"]) > 1e-5   # ranks apart before
    mean = {k: (outs[0]["before"][k] + outs[1]["before"][k]) / 2 for k in outs[0]["before"]}
    for rank, o in enumerate(outs):  # outer SGD lr=1: the global parameters are the mean
        assert_state_close(o["after"], mean, f"rank {rank}: after DiLoCo.sync()")
        assert o["steps"] == 5 and o["syncs"] == 2, o   # the one on the wire, then the other
    assert identical([o["after"] for o in outs])


@pytest.mark.parametrize("hierarchy", list(HIERARCHIES))
def test_hierarchy_matches_torch_hierarchical_model_averager(worlds, hierarchy) -> None:
    res = worlds(4)
    fr = per_rank(res, "hierarchy/" + hierarchy)
    ref = per_rank(res, "torch_hierarchy")
    for rank in range(4):
        assert_traj_close(fr[rank]["fr"], ref[rank]["ref"], f"hierarchy {HIERARCHIES[hierarchy]}, rank {rank}")
        assert fr[rank]["steps"] == HIER_STEPS
    # the reference really has two levels: after step 2 the pairs agree, the world does not
    at2 = [r["ref"][1] for r in ref]
    assert identical(at2[:2]) and identical(at2[2:]) and not identical(at2)
    assert identical([r["ref"][3] for r in ref])


def test_hierarchy_rebuilt_again_and_again_keeps_its_descriptors_and_threads(worlds) -> None:
    """Each LocalSGD(hierarchy=) made its level's subgroups anew, and torch keeps a group
    until it is destroyed: every build kept one more for the process's life, with its
    sockets (about 5 descriptors at 2 ranks) and, on shared memory, a thread. The subgroups
    are made once per group now, for every build."""
    for rank, r in enumerate(per_rank(worlds(4), "hierarchy_rebuilt")):
        counts = r["counts"]
        assert counts[-1][0] <= counts[0][0] and counts[-1][1] <= counts[0][1], \
            f"rank {rank}: (descriptors, threads) after each build: {counts}; threads at the end: {r['threads']}"


def test_bf16_wire_is_close_to_fp32_and_keeps_fp32_params(worlds) -> None:
    """Bound: at a sync each rank's pseudo-gradient Delta = x - x_synced goes over the wire
    in bf16 (relative rounding <= 2^-9, and <= 2^-9 more if the sum is kept in bf16), so
    one averaging is off by at most 2^-8 max|Delta|; the errors add up over the syncs and
    the few SGD steps between them barely move them (x2 margin)."""
    outs = per_rank(worlds(2), "bf16_local")
    ref_pre = [o["ref_pre"] for o in outs]
    ref = [o["ref"] for o in outs]
    tol, synced = 0.0, params_of(odd_model(SEED))
    for s in (4, 8, 12):
        delta = max(max_diff(pre[s - 1], synced) for pre in ref_pre)
        tol += 2 * BF16_EPS * delta
        synced = ref[0][s - 1]
        for rank, o in enumerate(outs):
            assert_state_close(o["fr"][s - 1], ref[rank][s - 1], f"rank {rank}, after step {s} (bf16 wire)", atol=tol)
        assert identical([o["fr"][s - 1] for o in outs]), f"after step {s}: ranks differ"
    assert tol < 0.05, tol
    final = outs[0]["fr"][-1]
    assert max_diff(final, ref[0][-1]) > 0, "bit-identical to the fp32 run: was the wire bf16 at all?"
    flat = torch.cat([t.reshape(-1) for t in final.values()])
    on_grid = float((flat == flat.bfloat16().float()).double().mean())
    assert on_grid < 0.05, f"{on_grid:.0%} of the averaged params are bf16 values: rounded to bf16?"
    assert_wire_bytes(outs[0]["bytes_per_sync"], 2)
    assert_wire_bytes(per_rank(worlds(2), "periodic/odd-sgd-H4")[0]["bytes_per_sync"], 4)
    assert outs[0]["fragment_names"] == [[n for n, _ in odd_model(SEED).named_parameters()]]


# ============================================================== DiLoCo

def test_diloco_outer_sgd_lr1_fp32_equals_localsgd(worlds) -> None:
    res = worlds(2)
    dl = per_rank(res, "diloco/lr1-fp32")
    ls = per_rank(res, "periodic/odd-sgd-H4")
    for rank in range(2):
        assert_traj_close(dl[rank]["fr"], ls[rank]["fr"], f"rank {rank}: DiLoCo(lr 1) vs LocalSGD(4)")
        assert_traj_close(dl[rank]["fr"], ls[rank]["ref"], f"rank {rank}: DiLoCo(lr 1) vs the reference loop")
    assert_wire_bytes(dl[0]["bytes_per_sync"], 4)


def test_diloco_default_bf16_wire_is_close_to_localsgd(worlds) -> None:
    """Same bound as the LocalSGD bf16 test, with Delta = anchor - x."""
    res = worlds(2)
    dl = per_rank(res, "diloco/lr1-bf16")
    ls = per_rank(res, "periodic/odd-sgd-H4")
    tol, anchor = 0.0, params_of(odd_model(SEED))
    for s in (4, 8, 12):
        tol += 2 * BF16_EPS * max(max_diff(o["ref_pre"][s - 1], anchor) for o in ls)
        anchor = ls[0]["ref"][s - 1]
        for rank in range(2):
            assert_state_close(dl[rank]["fr"][s - 1], ls[rank]["ref"][s - 1], f"rank {rank} after step {s}", atol=tol)
    assert max_diff(dl[0]["fr"][-1], ls[0]["ref"][-1]) > 0, "bit-identical to fp32: was the default wire bf16?"
    assert_wire_bytes(dl[0]["bytes_per_sync"], 2)


@pytest.mark.parametrize("name", [n for n, spec in DILOCO.items() if spec[9] is not None])   # bf16: below
@pytest.mark.cell("loop", "train", modes=("diloco",))
def test_diloco_matches_reference_from_the_equations(worlds, name) -> None:
    world, model_name, _, steps, H, F, tau, alpha, outer, wire, _ = DILOCO[name]
    outs = per_rank(worlds(world), "diloco/" + name)
    for rank, o in enumerate(outs):
        assert_traj_close(o["fr"], o["ref"], f"{name}, rank {rank}")
        assert o["steps"] == steps and o["syncs"] == len(o["applies"]), (o["steps"], o["syncs"], o["applies"])
    # the schedule the reference ran: every fragment applied, each tau steps after its launch
    applies, launches = outs[0]["applies"], outs[0]["launches"]
    assert {k for _, k in applies} == set(range(F))
    assert [(s - tau, k) for s, k in applies] == [x for x in launches if x[0] + tau <= steps]
    assert max_diff(outs[0]["fr"][-1], params_of(MODELS[model_name](SEED))) > 1e-2, "the run did not train"


def test_diloco_issues_the_second_collective_halfway_through_the_delay(worlds) -> None:
    """bf16 wire summed in fp32 (all-to-all, fp32 sum, gather), tau = 3: the gather goes
    out 2 steps after the launch, not at the apply (where it would be waited for)."""
    name = "F2-H8-tau3-bf16acc"
    for rank, o in enumerate(per_rank(worlds(2), "diloco/" + name)):
        if not o["two_phase"]:   # shared memory: one job, summed in fp32 anyway
            assert o["phases"] == [], o["phases"]
            continue
        launches = o["launches"]   # (step, fragment), per the reference's schedule
        want = [(s + d, k, "all-to-all" if d < 2 else "gather") for s, k in launches for d in range(3)
                if s + d <= DILOCO[name][3]]
        assert o["phases"] == want, f"rank {rank}: {o['phases']} != {want}"


def test_diloco_says_it_communicates_where_the_second_collective_waits_on_the_first(worlds) -> None:
    """communicates_at() (where a Membership puts its commit vote) holds every step that
    runs a collective and no other: the launches, the applies, every H-th step (the float
    buffers) and, for the two-collective average, the step that waits for the all-to-all
    and issues the gather, which it left out (a peer lost there raised out of a step with
    no vote and no guard)."""
    name = "F2-H8-tau3-bf16acc"
    steps, H, tau = DILOCO[name][3], DILOCO[name][4], DILOCO[name][6]
    for rank, o in enumerate(per_rank(worlds(2), "diloco/" + name)):
        launched = {s for s, _ in o["launches"]}
        waits = {s + (tau + 1) // 2 for s in launched} if o["two_phase"] else set()
        want = launched | {s for s, _ in o["applies"]} | waits | set(range(H, steps + 1, H))
        assert o["communicates"] == sorted(s for s in want if s <= steps), f"rank {rank}: {o['communicates']}"
        if o["two_phase"]:
            assert {s for s, _, what in o["phases"] if what == "gather"} - launched <= set(o["communicates"]), o


@pytest.mark.parametrize("name", list(DILOCO))
def test_fragment_names_partition_the_trainable_params_in_order(worlds, name) -> None:
    world, F = DILOCO[name][0], DILOCO[name][5]
    outs = per_rank(worlds(world), "diloco/" + name)
    frags = outs[0]["fragment_names"]
    assert len(frags) == F and all(frags), frags
    assert [n for f in frags for n in f] == outs[0]["trainable"], frags
    assert all(o["fragment_names"] == frags for o in outs)


def test_diloco_restores_the_inner_grads_after_an_outer_step(worlds) -> None:
    for name in ("nesterov-F1", "F2-tau1-a0.5"):
        for rank, o in enumerate(per_rank(worlds(2), "diloco/" + name)):
            assert o["grads_kept"] and all(o["grads_kept"]), f"{name}, rank {rank}: grads or parameter storage changed by step()"


def test_backup_device_cpu_gives_the_same_run(worlds) -> None:
    res = worlds(2)
    cpu = per_rank(res, "diloco/F2-tau1-a0.5-cpu")
    default = per_rank(res, "diloco/F2-tau1-a0.5")
    for rank in range(2):
        for s, (a, b) in enumerate(zip(cpu[rank]["fr"], default[rank]["fr"]), 1):
            assert identical([a, b]), f"rank {rank}, after step {s}: backup_device='cpu' changed the run"


# ============================================================== resume

@pytest.mark.parametrize("name", list(RESUME))
def test_resume_in_new_processes_ends_like_the_uninterrupted_run(worlds, resumed, name) -> None:
    _, _, _, steps, save_at, _ = RESUME[name]
    saved = per_rank(worlds(2), "resume_save/" + name)
    loaded = per_rank(resumed, name)
    for rank, (s, r) in enumerate(zip(saved, loaded)):
        assert_state_close(s["continued"], s["full"], f"{name}, rank {rank}: the saving run (state_dict() disturbed it?)")
        assert identical([r["loaded"], s["at_save"]]), f"{name}, rank {rank}: not restored by load_state_dict"
        assert r["steps_loaded"] == save_at, f"{name}, rank {rank}: steps {r['steps_loaded']} after load"
        assert_state_close(r["out"], s["full"], f"{name}, rank {rank}: resumed vs uninterrupted")
    if name != "local-in-warmup":   # ranks apart at the save: a mid-period checkpoint
        assert max_diff(saved[0]["at_save"], saved[1]["at_save"]) > 1e-5


@pytest.mark.parametrize("name", list(RESUME))
def test_resume_without_the_modes_state_differs(worlds, resumed, name) -> None:
    """Sanity of the test above: the mode's state matters (counter, anchor, in-flight)."""
    saved = per_rank(worlds(2), "resume_save/" + name)
    bare = per_rank(resumed, name + "/without-mode-state")
    assert max(max_diff(b["out"], s["full"]) for s, b in zip(saved, bare)) > 1e-4


def test_a_diloco_state_its_outer_optimizer_cannot_take_changes_nothing(worlds, resumed) -> None:
    """The outer optimizer's load raised after the mode's own state was in: the parameters,
    anchor, step count and fragment on the wire were the saved ones. Now the call raises
    first, and the mode trains on as an identical one that never saw it, bit for bit."""
    for rank, out in enumerate(per_rank(resumed, "outer-groups")):
        assert out["load"]["raised"] == "ValueError", (rank, out["load"])
        assert "parameter groups" in out["load"]["message"], out["load"]["message"]
        assert out["steps"] == 3 and out["same"] == [True] * len(out["same"]), (rank, out)


def test_a_diloco_state_with_a_fragment_on_the_wire_needs_the_schedule_it_was_saved_with(worlds, resumed) -> None:
    """Its fragment is due at the step that sync_every and fragment_delay set: loaded into a
    mode with another, it was taken, and landed with the mode's own launch of it at that
    step (two outer steps of one fragment in one inner step). Now refused, nothing changed."""
    for rank, out in enumerate(per_rank(resumed, "other-delay")):
        assert out["in_flight"], "the saved state has no fragment on the wire: the test shows nothing"
        for what in ("delay", "sync_every"):
            assert out[what]["raised"] == "ValueError" and "fragment on the wire" in out[what]["message"], \
                (rank, what, out[what])
            assert out[f"{what}_steps"] == 0, (rank, what)


# ============================================================== errors

@pytest.mark.parametrize("name", list(ERRORS))
def test_error_is_raised_before_anything_changes(worlds, name) -> None:
    world, _, _, _, exc, words = ERRORS[name]
    for rank, res in enumerate(per_rank(worlds(world), "error/" + name)):
        assert res["raised"] == exc, f"rank {rank}: raised {res['raised']}: {res['message']}"
        for word in words:
            assert word.lower() in res["message"].lower(), f"rank {rank}: {word!r} not in {res['message']!r}"
        assert res["changed"] == [], f"rank {rank}: the failed construction changed {res['changed']}"
        assert res["optim_same"], f"rank {rank}: the failed construction changed the optimizer's state"
        assert not res["hooks_left"], f"rank {rank}: the failed construction left hooks behind"
        assert res["plain_after"], f"rank {rank}: optimizer.step() after the failure is not a plain local step"


@pytest.mark.parametrize("kind", UNFROZEN)
def test_a_layer_unfrozen_after_building_raises_at_the_sync_until_the_mode_is_built_again(worlds, kind) -> None:
    """Trained on every rank but never averaged, it would silently differ across ranks."""
    outs = per_rank(worlds(2), "unfrozen/" + kind)
    mode = "DiLoCo" if kind == "diloco" else "LocalSGD"
    for rank, o in enumerate(outs):
        for call in ("step", "sync") + (("average_warmup_grads",) if kind == "local-warmup" else ()):
            r = o[call]
            assert r["raised"] == "RuntimeError", f"rank {rank}: {call}: raised {r['raised']}: {r['message']}"
            for words in ("'backbone.0.weight'", "'backbone.2.bias'", f"frozen when {mode} was built", "close()"):
                assert words in r["message"], f"rank {rank}: {call}: {words!r} not in {r['message']!r}"
        assert o["changed"] == [] and o["optim_same"] and o["steps"] == 1, (rank, o["changed"], o["steps"])
        assert o["warned"] == [], f"rank {rank}: sync() before close() left the ranks apart: {o['warned']}"
        for n, p in o["after"].items():
            assert not torch.equal(p, o["before"][n]), f"rank {rank}: {n} did not train after the rebuild"
            assert torch.equal(p, outs[0]["after"][n]), f"rank {rank}: {n} differs from rank 0's after a sync"


@pytest.mark.parametrize("kind", ["local", "diloco"])
def test_no_process_group_raises_runtime_error(kind) -> None:
    if dist.is_available() and dist.is_initialized():
        pytest.skip("this process has a default process group")
    model = odd_model(SEED)
    inner = inner_opt(model, "sgd")
    loss_of(model, batch_for(model, 0, 0)).backward()
    snap, hooks = snapshot(model), hook_counts(model, inner)
    with pytest.raises(RuntimeError, match=r"(?i)process group|init_process_group|initiali[sz]"):
        if kind == "local":
            fastreduce.LocalSGD(model, inner, 4)
        else:
            fastreduce.DiLoCo(model, inner, outer_sgd(model, NESTEROV), 4)
    assert changed_since(snap, model) == []
    assert hook_counts(model, inner) == hooks


# ============================================================== rank 0's broadcast

@pytest.mark.parametrize("kind", ["local", "diloco"])
def test_differing_ranks_get_rank0_params_and_a_warning(worlds, kind) -> None:
    rank0 = params_of(odd_model(SEED))
    for rank, o in enumerate(per_rank(worlds(2), f"warn/{kind}-differ")):
        user = [m for c, m in o["warnings"] if c == "UserWarning"]
        assert user, f"rank {rank}: no UserWarning: {o['warnings']}"
        assert any(w in m.lower() for m in user for w in ("broadcast", "differ", "rank 0")), user
        assert identical([o["constructed"], rank0]), f"rank {rank}: params after construction are not rank 0's"
        if kind == "diloco":   # inner lr 0: nothing moves if the anchor is rank 0's params too
            assert identical([o["after"], rank0]), f"rank {rank}: the anchor is not rank 0's params"


def test_strided_frozen_params_and_buffers_get_rank0_values(worlds) -> None:
    want = {"frozen": torch.arange(32.0).view(4, 8)[:, :4], "strided": torch.arange(16.0)[::2]}
    for rank, o in enumerate(per_rank(worlds(2), "strided")):  # (rank 1 got rank 0's memory as it lay, before)
        assert identical([o, want]), f"rank {rank}: {o} against rank 0's {want}"


@pytest.mark.parametrize("kind", ["local", "diloco"])
def test_identical_ranks_get_no_warning(worlds, kind) -> None:
    rank0 = params_of(odd_model(SEED))
    for rank, o in enumerate(per_rank(worlds(2), f"warn/{kind}-same")):
        assert not [w for w in o["warnings"] if w[0] == "UserWarning"], f"rank {rank}: {o['warnings']}"
        assert identical([o["constructed"], rank0])


# ============================================================== group= and world 4

@pytest.mark.parametrize("kind", ["local", "diloco"])
def test_group_of_two_ranks_in_a_world_of_four(worlds, kind) -> None:
    outs = [unwrap(r["group/" + kind]) for r in worlds(4)]
    first = params_of(odd_model(SEED + GROUP_RANKS[0]))
    for rank, o in enumerate(outs):
        if rank not in GROUP_RANKS:
            assert o is None
            continue
        assert identical([o["init"], first]), f"rank {rank}: not the group's first rank's params"
        assert o["warned"], f"rank {rank}: ranks differed and no warning"
        assert_traj_close(o["fr"], o["ref"], f"group {GROUP_RANKS}, {kind}, rank {rank}")


def warmup_again_worker(rank: int, world: int) -> dict:
    """A LocalSGD past its warm-up loads a state saved in it (a Membership's kept state after
    a loss, a checkpoint loaded into the running mode): its next steps are warm-up steps again,
    gradients averaged, and nonfinite="skip" still judges the average (every rank alike)."""
    from fastreduce.nested import clone_state

    def steps(model: nn.Module, opt: torch.optim.Optimizer, n: int, seed: int) -> None:
        for i in range(n):
            opt.zero_grad()
            g = torch.Generator().manual_seed(seed + 10 * i + rank)
            model(torch.randn(4, 8, generator=g)).sum().backward()
            if seed == 900 and i == 0 and rank == 1:
                model[0].weight.grad[0, 0] = float("nan")  # one rank's: the average is not finite
            opt.step()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mode = fastreduce.LocalSGD(model, opt, sync_every=100, warmup_steps=4, nonfinite="skip")
    steps(model, opt, 2, 0)
    saved, saved_opt = clone_state(mode.state_dict()), clone_state(opt.state_dict())
    steps(model, opt, 4, 50)  # past the warm-up
    mode.load_state_dict(saved)
    opt.load_state_dict(saved_opt)
    steps(model, opt, 2, 900)  # warm-up steps 3 and 4: the first skipped on both ranks
    v = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.zeros_like(v) for _ in range(world)]
    dist.all_gather(every, v)
    mode.close()
    return {"apart": float((every[0] - every[1]).abs().max()), "skipped": mode.skipped_steps,
            "finite": bool(torch.isfinite(v).all())}


def test_a_mode_past_its_warm_up_loads_a_state_in_it_and_warms_up_again() -> None:
    for out in run_ranks(warmup_again_worker, 2, timeout=120):
        assert out["finite"] and out["skipped"] == 1, out
        assert out["apart"] == 0.0, out  # averaged steps from the same parameters: the ranks agree


def trainer_warmup_worker(rank: int, world: int) -> dict:
    """The trainers' order with LocalSGD's warm-up (backward, the mode's after_backward, the
    trainer's clipping, the step) against DDP's: clip(mean g), every warm-up step."""
    from fastreduce.integrations.modes import make_mode

    def batch(step: int) -> torch.Tensor:
        return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    mode = make_mode("localsgd", {"sync_every": 4, "warmup_steps": 3})
    opt = mode.build(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        model(batch(step)).pow(2).sum().backward()
        mode.after_backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        ref(batch(step)).pow(2).sum().backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
    mode.close()
    return {"gap": max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))}


def test_a_trainers_clipping_sees_the_warm_ups_average_as_ddps_does() -> None:
    for out in run_ranks(trainer_warmup_worker, 2, timeout=120):
        assert out["gap"] <= 1e-6, out


def skipped_warmup_step_worker(rank: int, world: int, ref_group: Any) -> dict:
    """The trainers' order in LocalSGD's warm-up (backward, average_warmup_grads, clipping)
    with a GradScaler, which skips the step whose average holds rank 0's inf, against DDP's
    order on a copy (every backward's gradients averaged, the same step skipped); with and
    without nonfinite="skip" (whose verdict on the average is the step's too)."""
    out = {}
    for nonfinite in ("ignore", "skip"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
        ref = copy.deepcopy(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        local = fastreduce.LocalSGD(model, opt, sync_every=4, warmup_steps=10, nonfinite=nonfinite)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

        def ref_average() -> None:
            all_mean_([p.grad for p in ref.parameters()], ref_group)

        scales = []
        for m, o, average in ((model, opt, local.average_warmup_grads), (ref, ref_opt, ref_average)):
            scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
            for step in range(5):
                x = torch.randn(8, 8, generator=torch.Generator().manual_seed(100 * step + rank))
                scaler.scale(m(x).pow(2).mean()).backward()
                if step == 2 and rank == 0:
                    m[0].weight.grad[0, 0] = float("inf")  # an fp16-style overflow on one rank
                average()
                scaler.unscale_(o)
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                scaler.step(o)  # skipped at step 2 on every rank: the average holds the inf
                scaler.update()
                o.zero_grad()
            scales.append(scaler.get_scale())
        v = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        every = [torch.zeros_like(v) for _ in range(world)]
        dist.all_gather(every, v)
        local.close()
        out[nonfinite] = {"apart": float((every[0] - every[1]).abs().max()), "steps": local.steps,
                          "skipped": local.skipped_steps, "scales": scales,
                          "gap": max(float((p - q).detach().abs().max())
                                     for p, q in zip(model.parameters(), ref.parameters()))}
    return out


SCALED_OVERFLOWS = {"local": {(1, 1), (1, 4), (0, 6)}, "diloco": {(1, 1), (0, 4)}}  # (rank, step): an inf


def scaled_plain_loop(rank: int, kind: str, nonfinite: str, unscale: bool, ref_group: Any) -> dict:
    """The plain loop (``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``,
    with ``unscale``: ``scaler.unscale_(opt)`` before the step) under LocalSGD (warm-up 3,
    sync every 2) or DiLoCo (fp32 wire, outer SGD lr 0.7, sync every 2), one rank's
    gradients overflowing at chosen steps (in the warm-up and after it), against torch's
    optimizer on a copy with its own scaler: in the warm-up each rank's gradients unscaled
    by its own scale, averaged, the step skipped on every rank if the average holds an inf;
    after it (and in DiLoCo) the scaler's own skip on the rank that overflowed, and every
    rank (one that skipped too) averaging at the same counts."""
    W, H, steps, lr_out = (3, 2, 9, None) if kind == "local" else (0, 2, 6, 0.7)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    if kind == "local":
        mode = fastreduce.LocalSGD(model, opt, sync_every=H, warmup_steps=W, nonfinite=nonfinite)
    else:
        mode = fastreduce.DiLoCo(model, opt, torch.optim.SGD(model.parameters(), lr=lr_out), sync_every=H,
                                 wire_dtype=torch.float32, nonfinite=nonfinite)
    anchor = [p.detach().clone() for p in ref.parameters()]
    got: dict[str, list] = {"gap": [], "scales": [], "ref_scales": []}
    scaler, ref_scaler = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=3) for _ in range(2))
    for s in range(1, steps + 1):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(100 * s + rank))
        for m, sc in ((model, scaler), (ref, ref_scaler)):
            sc.scale(m(x).pow(2).mean()).backward()
            if (rank, s) in SCALED_OVERFLOWS[kind]:
                m[0].weight.grad[0, 0] = float("inf")  # an fp16-style overflow on this rank only
        if unscale:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        with torch.no_grad():
            if s <= W:  # the reference's warm-up: own scale off, then the average decides for all
                ref_scaler.unscale_(ref_opt)
                all_mean_([p.grad for p in ref.parameters()], ref_group)
                if all(bool(torch.isfinite(p.grad).all()) for p in ref.parameters()):
                    ref_opt.step()
            else:
                ref_scaler.step(ref_opt)  # skipped on this rank alone where it overflowed
            ref_scaler.update()
            ref_opt.zero_grad()
            if s > W and (s - W) % H == 0:
                if lr_out is None:
                    all_mean_(list(ref.parameters()), ref_group)
                else:  # DiLoCo: x := anchor - lr * mean(anchor - x); anchor := x
                    deltas = [a - p for a, p in zip(anchor, ref.parameters())]
                    all_mean_(deltas, ref_group)
                    for p, a, d in zip(ref.parameters(), anchor, deltas):
                        p.copy_(a - lr_out * d)
                        a.copy_(p)
        got["gap"].append(max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(),
                                                                                   ref.parameters())))
        got["scales"].append(scaler.get_scale())
        got["ref_scales"].append(ref_scaler.get_scale())
    v = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.zeros_like(v) for _ in range(2)]
    dist.all_gather(every, v)
    mode.close()
    return {**got, "apart": float((every[0] - every[1]).abs().max()), "steps": mode.steps, "syncs": mode.syncs,
            "skipped": mode.skipped_steps, "finite": bool(torch.isfinite(v).all()),
            "marked": getattr(opt, "_step_supports_amp_scaling", False)}


def scaled_sparse_grads(rank: int, ref_group: Any) -> dict:
    """The plain loop under a GradScaler with an embedding's sparse gradients (the mode
    unscales their values, as the scaler does), rank 1 overflowing at step 1: LocalSGD
    against torch's SGD with its own scaler and the parameters averaged every 2 steps."""
    torch.manual_seed(0)
    model = nn.Embedding(10, 4, sparse=True)
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    mode = fastreduce.LocalSGD(model, opt, sync_every=2)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 4) for _ in range(2)]
    for s in range(1, 5):
        idx = torch.tensor([rank, s, 2 * s + rank, rank])
        for m, o, sc in ((model, opt, scalers[0]), (ref, ref_opt, scalers[1])):
            sc.scale(m(idx).pow(2).sum()).backward()
            if (rank, s) == (1, 1):
                m.weight.grad = m.weight.grad.coalesce()
                m.weight.grad.values()[0, 0] = float("inf")
            sc.step(o)
            sc.update()
            o.zero_grad()
        if s % 2 == 0:
            all_mean_(list(ref.parameters()), ref_group)
    mode.close()
    return {"gap": float((model.weight - ref.weight).detach().abs().max()), "steps": mode.steps,
            "skipped": mode.skipped_steps, "scales": [sc.get_scale() for sc in scalers]}


SCALED_CASES = [("local", "ignore", False), ("local", "skip", False), ("local", "ignore", True),
                ("diloco", "ignore", False)]


def scaler_worker(rank: int, world: int) -> dict:
    """A GradScaler driving LocalSGD and DiLoCo: the trainers' order in the warm-up, and the
    plain loop with one rank overflowing in the warm-up and after it (SCALED_CASES)."""
    ref_group = dist.new_group(backend="gloo")
    out = {"trainer": guarded(skipped_warmup_step_worker, rank, world, ref_group)}
    for case in SCALED_CASES:
        out["/".join(map(str, case))] = guarded(scaled_plain_loop, rank, *case, ref_group)
    out["sparse"] = guarded(scaled_sparse_grads, rank, ref_group)
    return out


def scaled(key: str) -> list[dict]:
    """Every rank's result of the ``scaler_worker`` sub-case ``key``."""
    ranks = spawn_once(_RESULTS, "scaler", lambda: run_ranks(scaler_worker, 2, timeout=150))
    return [unwrap(r[key]) for r in ranks]


def test_a_warm_up_step_skipped_after_its_average_leaves_the_next_one_averaged() -> None:
    """The mark that the step's average was done outlived the skipped step: the next step
    averaged nothing, and the ranks' parameters parted in the warm-up. The scaler's skip
    still counts as a step (skipped), as nonfinite="skip"'s does, and the scales stay equal
    (the scaler checks the average)."""
    for out in scaled("trainer"):
        for nonfinite, o in out.items():
            assert o["apart"] == 0.0 and o["gap"] <= ATOL, (nonfinite, o)
            assert o["steps"] == 5 and o["skipped"] == 1, (nonfinite, o)
            assert o["scales"][0] == o["scales"][1] == 0.5, (nonfinite, o)  # one backoff, on every rank


@pytest.mark.parametrize("case", ["/".join(map(str, c)) for c in SCALED_CASES])
def test_a_grad_scaler_skip_on_one_rank_keeps_the_syncs_matched(case: str) -> None:
    """The plain loop under a GradScaler, one rank overflowing: the scaler calls step() on
    every rank (the count and the syncs go on there; its update is skipped), against torch's
    optimizer and scaler per rank with dist averaging. Before, the scaler skipped step() on
    the rank that overflowed: its count fell behind and the next collective hung."""
    kind = case.split("/")[0]
    outs = scaled(case)
    for rank, o in enumerate(outs):
        assert max(o["gap"]) <= ATOL, (rank, o)
        assert o["scales"] == o["ref_scales"], (rank, o)  # each rank's scaler: its own gradients' overflows
        assert o["finite"] and o["apart"] == 0.0 and not o["marked"], (rank, o)  # (close() took the mark off)
        assert o["skipped"] == sum(r == rank or s <= (3 if kind == "local" else 0)
                                   for r, s in SCALED_OVERFLOWS[kind]), (rank, o)
    assert [o["steps"] for o in outs] == [9 if kind == "local" else 6] * 2, outs
    assert [o["syncs"] for o in outs] == [3] * 2, outs


def test_a_grad_scaler_unscales_sparse_gradients_as_its_own_step_does() -> None:
    for rank, o in enumerate(scaled("sparse")):
        assert o["gap"] <= ATOL and o["steps"] == 4 and o["skipped"] == rank, (rank, o)
        assert o["scales"][0] == o["scales"][1] == 2.0 ** (4 - rank), (rank, o)


def closed_twice_worker(rank: int, world: int) -> dict:
    """close(drain=False) (a peer lost: the work in flight dropped), then close() again (a
    trainer's teardown after a Membership's epoch change): the second does nothing; it waited
    for the dropped work, and gossip's finished a step (a collective) over the group."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = fastreduce.DiLoCo(model, inner, torch.optim.SGD(model.parameters(), lr=0.7), sync_every=4,
                               fragments=2, fragment_delay=1)
    for _ in range(3):
        model(torch.randn(3, 4)).sum().backward()
        inner.step()
        inner.zero_grad()
    diloco.close(drain=False)
    in_flight = sorted(k for k, v in diloco._in_flight.items() if v != (None, None))
    diloco.close()
    kept = sorted(k for k, v in diloco._in_flight.items() if v != (None, None))
    gossip = fastreduce.DecentralizedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)),
                                                  lambda named: torch.optim.SGD([p for _, p in named], lr=0.1))
    for _ in range(3):
        gossip(torch.randn(3, 4)).sum().backward()
    gossip.close(drain=False)
    at = gossip.step
    gossip.close()
    return {"in_flight": in_flight, "kept": kept, "rounds": gossip.step - at}


def test_a_mode_closed_without_draining_stays_closed() -> None:
    for out in run_ranks(closed_twice_worker, 2, timeout=120):
        assert out["in_flight"] and out["kept"] == out["in_flight"] and out["rounds"] == 0, out


class _TwoBuffers(nn.Module):
    """A linear layer and a float32 and a float64 buffer, each set per rank."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.register_buffer("b32", torch.zeros(3))
        self.register_buffer("b64", torch.zeros(3, dtype=torch.float64))


def _buffers_in_their_dtype(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = _TwoBuffers()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mode = fastreduce.LocalSGD(model, opt, sync_every=1, warmup_steps=0, buffers="average")
    g = torch.Generator().manual_seed(100 + rank)  # (after the mode: it starts every rank from rank 0's)
    model.b32.copy_(torch.rand(3, generator=g))
    model.b64.copy_(torch.rand(3, generator=g, dtype=torch.float64) / 3)
    mine = {n: b.clone() for n, b in model.named_buffers()}
    theirs = {n: b.clone() for n, b in model.named_buffers()}
    for t in theirs.values():
        dist.all_reduce(t)
    model.lin(torch.ones(2, 4)).sum().backward()
    opt.step()
    mode.close()
    return {"got": dict(model.named_buffers()), "mean": {n: t / world for n, t in theirs.items()}, "mine": mine}


def test_float_buffers_are_averaged_in_their_own_dtype() -> None:
    """A float64 buffer's mean is a float64 mean (it went through one float32 block: 1e-8 off)."""
    for r in run_ranks(_buffers_in_their_dtype, 2, timeout=120):
        assert r["got"]["b64"].dtype == torch.float64
        for n in ("b32", "b64"):
            assert not torch.equal(r["got"][n], r["mine"][n])
            torch.testing.assert_close(r["got"][n], r["mean"][n], rtol=0, atol=0)
