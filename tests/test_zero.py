"""fastreduce.ZeroOptimizer (ZeRO-2: sharded optimizer state, reduce-scattered grads) on
real Gloo process groups, against real torch.

Same structure as test_overlap.py: module-scoped fixtures spawn one group per world size
(``run_ranks``) and run every sub-case in it, each through ``guarded`` so a broken
sub-case fails its own tests only; the tests assert on the returned per-rank results here,
in the parent.

The reference is always plain torch on a copy of the model: each rank's grads averaged
with ``dist.all_reduce`` (on a process group of the test's own, so the reference's
collectives never interleave with the optimizer's), ``torch.nn.utils.clip_grad_norm_``
on those averaged grads, and the plain ``torch.optim`` class. The ZeroOptimizer run and
the reference run of a sub-case are separate loops over the same inputs.

* worlds 2 and 3: 20-step parity (clipped by the global norm) for AdamW / SGD, param
  groups, LR schedulers and hand-made hyperparameter changes, overlap on and off,
  several buckets, forward-hook waits (``module=``), tied parameters; optimizer-state
  memory; (world 3) a 2-rank ``group=``;
* world 2: bf16 / fp16 / mixed parameters with fp32 master weights, ``no_sync``
  accumulation, GradScaler with an inf on one rank, ``step(closure)``, 1-rank subgroups,
  the API surface; errors (each must change nothing);
* world 1: exactly the plain optimizer;
* checkpoints: torch.distributed.checkpoint saved at 3 ranks and resumed at 2 (fp32 and
  bf16); the torch.optim-format ``state_dict()`` into a plain AdamW (parent process), and
  a plain AdamW's and a 3-rank run's into a ZeroOptimizer.

Tensors passed to ``run_ranks`` reach the ranks through shared memory (torch.multiprocessing):
a rank that loads one into an optimizer works on a private copy, or every rank (and the
parent) would step the same "step" counters.

Tolerances (fp32): the two sides average the same per-rank grads but sum them in a
different order (reduce-scatter vs all_reduce, flat shards vs per-tensor), and the
clipping norm is a sum of squares in a different order, so they differ by a few fp32
ulps per step; AdamW / SGD steps do not amplify that, and after 20 steps the parameters
agree to rtol=1e-5, atol=1e-6.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing import assert_close

import fastreduce
from fastreduce.launch import run_ranks

from models import (OddModel, ShapeModel, SparseEmbeddingModel, batch_for, loss_of, many_tensor_model,
                    mixed_dtype_model, odd_model)
from test_fused import expect_raises, guarded, per_rank, unwrap

SEED = 7
STEPS = 20
CLIP = 0.5
# Scales the shared test loss so that the averaged grad norm of OddModel starts above CLIP
# and falls below it as training goes on: clipping is active on some steps, not all.
LOSS_SCALE = 2.0
RTOL, ATOL = 1e-5, 1e-6
SMALL_BUCKET_MB = 0.0002   # ~210 bytes: OddModel's 1292 bytes of fp32 grads span 3+ buckets
MANY_BLOCKS = 6  # ManyTensorModel(6): 34 tensors, 3076 parameters (tied, channels_last, transposed)
MANY_BUCKET_MB = 2048 / 2**20  # its ~12 KB of fp32 grads: ~6 buckets
OPT_CLASSES = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD, "rprop": torch.optim.Rprop}
HPARAMS = {"adamw": {"lr": 1e-2, "weight_decay": 0.1}, "sgd": {"lr": 0.05, "momentum": 0.9}, "rprop": {"lr": 1e-2}}
SPAWN_TIMEOUT = 150.0  # per spawned group; each finishes in seconds on an idle machine

pytestmark = pytest.mark.timeout(300)


def spawn(worker: Callable[..., Any], world: int, *args: Any, timeout: float = SPAWN_TIMEOUT) -> list[Any]:
    return run_ranks(worker, world, *args, timeout=timeout)


# ============================================================== helpers run in ranks



def loss_fn(model: nn.Module, inputs: tuple) -> torch.Tensor:
    return loss_of(model, inputs) * LOSS_SCALE


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def average_grads(model: nn.Module, world: int, group: Any) -> None:
    """The reference's data-parallel average: sum over ranks (one all_reduce of all grads,
    flattened), divided by the world."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(world)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def snapshot(model: nn.Module) -> list[tuple]:
    return [(n, p.grad, None if p.grad is None else p.grad.detach().clone(), p.detach().clone())
            for n, p in model.named_parameters()]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_sparse or b.is_sparse:
        return a.is_sparse == b.is_sparse and torch.equal(a.to_dense(), b.to_dense())
    return torch.equal(a, b)


def changed_since(snap: list[tuple], model: nn.Module, grads: bool = True) -> list[str]:
    """Names whose data, or (with ``grads``) grad object or value, differ from ``snap``."""
    params = dict(model.named_parameters())
    bad = []
    for name, grad, grad_copy, data in snap:
        p = params[name]
        same_grad = p.grad is grad and (grad is None or same(p.grad, grad_copy))
        if (grads and not same_grad) or not torch.equal(p.detach(), data):
            bad.append(name)
    return bad


def hook_counts(model: nn.Module) -> list[int]:
    """Hooks on each parameter and module: a failed construction must leave none behind."""
    per_param = [len(getattr(p, "_post_accumulate_grad_hooks", None) or ()) + len(p._backward_hooks or ())
                 for p in model.parameters()]
    per_module = [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]
    return per_param + per_module


def zero_opt(params: Any, opt_name: str = "adamw", **kwargs: Any) -> fastreduce.ZeroOptimizer:
    hp = dict(HPARAMS[opt_name])
    hp.update(kwargs.pop("hparams", {}))
    return fastreduce.ZeroOptimizer(params, OPT_CLASSES[opt_name], **kwargs, **hp)


def state_nbytes(state: Any) -> int:
    """Bytes of every tensor in an optimizer's ``state`` (nested containers included)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_nbytes(v) for v in state)
    return 0


# ============================================================== parity (worlds 2, 3)

@dataclass(frozen=True)
class Case:
    name: str
    model: str = "odd"        # "odd": OddModel (323 params) | "many": ManyTensorModel (tied, channels_last, transposed)
    opt: str = "adamw"
    groups: bool = False      # two param groups with different lr and weight_decay
    sched: str | None = None  # None | "step" (StepLR) | "lambda" (LambdaLR); plus a hand-made change at TWEAK_STEP
    overlap: bool = True
    bucket_mb: float | None = None
    module: bool = False      # ZeroOptimizer(module=model): all-gather waited in forward pre-hooks
    set_to_none: bool = True  # zero_grad(set_to_none=...) on both sides
    max_norm: float = CLIP
    norm_type: float = 2.0


PARITY_CASES = (
    Case("adamw"),
    Case("adamw-no_overlap", overlap=False),
    Case("adamw-buckets", bucket_mb=SMALL_BUCKET_MB),
    Case("adamw-buckets-no_overlap", overlap=False, bucket_mb=SMALL_BUCKET_MB),
    Case("adamw-module", bucket_mb=SMALL_BUCKET_MB, module=True),
    Case("adamw-module-no_overlap", overlap=False, module=True),
    Case("adamw-zero_grad_keep", set_to_none=False, bucket_mb=SMALL_BUCKET_MB),
    Case("adamw-clip_inf_norm", max_norm=0.1, norm_type=math.inf),
    Case("sgd", opt="sgd"),
    Case("sgd-buckets-no_overlap", opt="sgd", overlap=False, bucket_mb=SMALL_BUCKET_MB),
    Case("groups", groups=True),
    Case("groups-buckets-no_overlap", groups=True, overlap=False, bucket_mb=SMALL_BUCKET_MB),
    Case("steplr", sched="step", bucket_mb=SMALL_BUCKET_MB),
    Case("groups-lambdalr", groups=True, sched="lambda"),
    Case("groups-lambdalr-no_overlap", groups=True, sched="lambda", overlap=False),
    Case("tied", model="many", bucket_mb=MANY_BUCKET_MB),
    Case("tied-no_overlap", model="many", overlap=False),
    Case("tied-module", model="many", bucket_mb=MANY_BUCKET_MB, module=True, set_to_none=False),
)
TWEAK_STEP = 10


def build_model(kind: str) -> nn.Module:
    return odd_model(SEED) if kind == "odd" else many_tensor_model(SEED, blocks=MANY_BLOCKS)


def groups_of(model: nn.Module, case: Case) -> Any:
    if not case.groups:
        return model.parameters()
    named = list(model.named_parameters())
    first = [p for n, p in named if n.startswith(("a.", "scale"))]
    rest = [p for n, p in named if not n.startswith(("a.", "scale"))]
    return [{"params": first, "lr": 2e-2, "weight_decay": 0.0},
            {"params": rest, "lr": 5e-3, "weight_decay": 0.1}]


def lr_decay(step: int) -> float:
    return 1.0 / (1.0 + 0.1 * step)


def make_sched(case: Case, opt: torch.optim.Optimizer) -> Any:
    if case.sched == "step":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    if case.sched == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda=lr_decay)
    return None


def tweak(case: Case, opt: torch.optim.Optimizer, step: int) -> None:
    """The user changes hyperparameters by hand mid-run (with a scheduler, on both sides)."""
    if case.sched and step == TWEAK_STEP:
        opt.param_groups[0]["lr"] *= 0.5
        opt.param_groups[-1]["weight_decay"] = 0.02


def parity_ref(rank: int, world: int, case: Case, group: Any) -> dict:
    model = build_model(case.model)
    opt = OPT_CLASSES[case.opt](groups_of(model, case), **HPARAMS[case.opt])
    sched = make_sched(case, opt)
    params, norms = [], []
    for step in range(STEPS):
        tweak(case, opt, step)
        loss_fn(model, batch_for(model, rank, step)).backward()
        average_grads(model, world, group)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), case.max_norm, case.norm_type)))
        opt.step()
        opt.zero_grad(set_to_none=case.set_to_none)
        if sched is not None:
            sched.step()
        params.append(params_of(model))
    return {"params": params, "norms": norms, "lrs": [g["lr"] for g in opt.param_groups]}


def parity_zero(rank: int, world: int, case: Case) -> dict:
    model = build_model(case.model)
    opt = zero_opt(groups_of(model, case), case.opt, overlap=case.overlap, bucket_mb=case.bucket_mb,
                   module=model if case.module else None)
    sched = make_sched(case, opt)
    params, norms, gathered = [], [], []
    bucket_at = {s.params.data_ptr(): b for b, s in enumerate(opt.shards)}
    gather = opt.comm.all_gather  # watched (the real collective runs): which bucket goes out when
    opt.comm.all_gather = lambda buf: (gathered.append(bucket_at[buf.data_ptr()]), gather(buf))[1]
    try:
        run_zero_steps(rank, case, model, opt, sched, params, norms)
    finally:
        del opt.comm.all_gather
    return {"params": params, "norms": norms, "lrs": [g["lr"] for g in opt.param_groups],
            "num_buckets": getattr(opt, "num_buckets", None), "gathered": gathered[:opt.num_buckets]}


def run_zero_steps(rank: int, case: Case, model: nn.Module, opt: fastreduce.ZeroOptimizer, sched: Any,
                   params: list, norms: list) -> None:
    for step in range(STEPS):
        tweak(case, opt, step)
        loss = loss_fn(model, batch_for(model, rank, step))
        if case.module and step > 0:
            # With module= the all-gather of the last step is only promised done before
            # the next forward: read the parameters it produced once that forward ran.
            params.append(params_of(model))
        loss.backward()
        norm = opt.clip_grad_norm_(case.max_norm, case.norm_type)
        assert isinstance(norm, torch.Tensor), type(norm)
        norms.append(float(norm))
        opt.step()
        opt.zero_grad(set_to_none=case.set_to_none)
        if sched is not None:
            sched.step()
        if not case.module:
            params.append(params_of(model))  # without module=, step() waits at its end
    if case.module:
        with torch.no_grad():
            model(*batch_for(model, rank, STEPS))
        params.append(params_of(model))


def memory_case(rank: int, world: int) -> dict:
    """Optimizer state per rank against a plain AdamW's, on a ~100k-parameter model."""
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(255, 257), nn.Tanh(), nn.Linear(257, 131))
    plain_model = copy.deepcopy(model)
    numel = sum(p.numel() for p in model.parameters())
    opt = zero_opt(model.parameters(), bucket_mb=1.0)  # 1 MB > the model's ~0.4 MB: one bucket
    x = torch.randn(8, 255, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    opt.step()
    plain = torch.optim.AdamW(plain_model.parameters(), **HPARAMS["adamw"])
    plain_model(x).square().mean().backward()
    plain.step()
    state_bytes = getattr(opt, "state_bytes", None)
    return {"numel": numel, "plain_bytes": state_nbytes(plain.state),
            "zero_bytes": None if state_bytes is None else int(state_bytes()),
            "num_buckets": getattr(opt, "num_buckets", None),
            "estimated_buckets": math.ceil(numel * 4 / 2**20)}


SUBGROUP_STEPS = 8


def subgroup_case(rank: int, world: int) -> dict | None:
    """group=: the first and the last rank form the optimizer's group; the others (at world 3:
    rank 1) take no part. At world 2 that group is an explicit group of the whole world."""
    members = [0, world - 1]
    zero_group = dist.new_group(members, backend="gloo")  # every rank creates every group
    ref_group = dist.new_group(members, backend="gloo")
    if rank not in members:
        return None
    me, n = members.index(rank), len(members)
    model = odd_model(SEED)
    ref = copy.deepcopy(model)
    opt = zero_opt(model.parameters(), group=zero_group, bucket_mb=SMALL_BUCKET_MB)
    zero = []
    for step in range(SUBGROUP_STEPS):
        loss_fn(model, batch_for(model, me, step)).backward()
        opt.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
        zero.append(params_of(model))
    ref_opt = torch.optim.AdamW(ref.parameters(), **HPARAMS["adamw"])
    refs = []
    for step in range(SUBGROUP_STEPS):
        loss_fn(ref, batch_for(ref, me, step)).backward()
        average_grads(ref, n, ref_group)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        ref_opt.zero_grad()
        refs.append(params_of(ref))
    return {"zero": zero, "ref": refs}


MIRROR_STEPS = 6


def flat_state(inner: Any, b: int) -> dict[str, torch.Tensor]:
    """Chunk ``b``'s optimizer state, laid out flat, and its pieces' scalars (``table``)."""
    flats, table = inner.pack(b)
    return {**flats, "table": table}


def mirror_case(rank: int, world: int) -> dict:
    """``redundant=True`` and ``redundant=2``: the same run as without (bit for bit), rank r's
    j-th copy (of rank r - j's shard, all on one host) equal to that shard after clipped steps,
    what the ranks hold moved (:func:`~fastreduce.modes.zero_mirror.reshard`) into a fresh
    optimizer of the same bucketing or another equal to ``state_dict()`` (the parameters with it,
    where they are marked stale), and a shard whose every holder is gone named."""
    from fastreduce.modes import zero_mirror

    runs, opts = {}, {}
    for redundant in (False, True, 2):
        model = odd_model(SEED)
        opt = zero_opt(model.parameters(), module=model, bucket_mb=SMALL_BUCKET_MB, redundant=redundant)
        for step in range(MIRROR_STEPS):
            loss_fn(model, batch_for(model, rank, step)).backward()
            opt.clip_grad_norm_(CLIP)
            opt.step()
            opt.zero_grad()
        opt.wait_params()
        runs[redundant], opts[redundant] = params_of(model), opt
    out = {"same_run": all(torch.equal(runs[k][n], runs[False][n]) for k in (True, 2) for n in runs[False])}
    for redundant in (True, 2):
        out[str(redundant)] = _copies_case(opts[redundant], redundant, rank, world, zero_mirror)
    return out


def copies_equal(o: Any, rank: int, world: int, copies: int, buckets: int) -> bool:
    """Whether ``o`` holds ``copies`` copies and its j-th, of rank r - j's shard (one host),
    equals that shard: master and flat state of each of its (at least ``buckets``) buckets
    (collective: every rank's shards gathered)."""
    every: list[Any] = [None] * world
    dist.all_gather_object(every, [(s.master.clone(), flat_state(o.inner, b)) for b, s in enumerate(o.shards)])
    return len(o.mirrors) == copies and all(
        m.k == (rank - m.j) % world and len(every[m.k]) == len(m.masters) >= buckets and all(
            torch.equal(a, x) and a_st.keys() == (b_st := flat_state(m.inner, b)).keys()
            and all(torch.equal(a_st[key], b_st[key]) for key in a_st)
            for b, ((a, a_st), x) in enumerate(zip(every[m.k], m.masters)))
        for m in o.mirrors)


def _copies_case(opt: Any, redundant: Any, rank: int, world: int, zero_mirror: Any) -> dict:
    """:func:`mirror_case`'s checks of one ``redundant=``."""
    copies = min(int(redundant), world - 1)
    want = opt.state_dict()
    params = [p for pg in opt.param_groups for p in pg["params"]]

    def moved_stale(bucket_mb: float | None) -> bool:
        """Into a fresh optimizer whose model started elsewhere, the parameters marked stale:
        its state and its parameters (all-gathered from the masters moved) equal."""
        fresh_model = odd_model(SEED + 1)
        fresh = zero_opt(fresh_model.parameters(), module=fresh_model, redundant=redundant, bucket_mb=bucket_mb)
        pieces = zero_mirror.held(opt)
        pieces["stale"] = True
        zero_mirror.reshard(fresh, pieces)
        got = fresh.state_dict()
        return all(torch.equal(got["state"][i][k], v) for i, st in want["state"].items() for k, v in st.items()) \
            and all(torch.equal(a, b.detach()) for a, b in zip(params_of(fresh_model).values(), params))

    joined_equal = moved_stale(SMALL_BUCKET_MB)  # the same bucketing
    loaded_equal = moved_stale(None)  # another bucketing
    other_model = odd_model(SEED + 1)  # point to point, each rank its own pieces, into another bucketing
    other = zero_opt(other_model.parameters(), module=other_model, redundant=redundant)
    other_model.load_state_dict(dict(zip(params_of(other_model), params)))  # (its parameters: current)
    zero_mirror.reshard(other, zero_mirror.held(opt))
    moved = other.state_dict()
    resharded_equal = all(torch.equal(moved["state"][i][k], v) for i, st in want["state"].items() for k, v in st.items())
    resharded_equal &= copies_equal(other, rank, world, copies, 1)
    held = zero_mirror.held(opt)  # old rank 1 and the ranks holding its copies all lost
    held["chunks"] = {c: v for c, v in held["chunks"].items() if not c.endswith("/1")}
    try:
        zero_mirror.reshard(other, held)
        lost = None
    except zero_mirror.ShardsLost as err:
        lost = str(err)
    def mixed(newer: Any, drop: str | None = None) -> bool | str:
        """Rank 0 took its shards in a new epoch's layout (``newer``'s, epoch 2), the others
        not (epoch 1: ``opt``'s; a loss between): moved into a fresh optimizer, its state
        equal; ``drop``: the chunks so named lost on every rank (the error's words)."""
        fresh_model = odd_model(SEED + 1)
        fresh = zero_opt(fresh_model.parameters(), module=fresh_model, redundant=redundant, bucket_mb=SMALL_BUCKET_MB)
        fresh_model.load_state_dict(dict(zip(params_of(fresh_model), params)))
        held = zero_mirror.held(newer if rank == 0 else opt)
        held["layout"] = 2 if rank == 0 else 1
        held["chunks"] = {c: v for c, v in held["chunks"].items() if drop is None or not c.endswith(drop)}
        try:
            zero_mirror.reshard(fresh, held)
        except zero_mirror.ShardsLost as err:
            return str(err)
        got = fresh.state_dict()
        return all(torch.equal(got["state"][i][k], v) for i, st in want["state"].items() for k, v in st.items()) \
            and copies_equal(fresh, rank, world, copies, 1)

    return {"copies_equal": copies_equal(opt, rank, world, copies, 2), "joined_equal": joined_equal, "loaded_equal": loaded_equal,
            "resharded_equal": resharded_equal, "lost": lost, "mixed_other": mixed(other), "mixed_same": mixed(opt),
            "mixed_lost": mixed(opt, "/1")}


class ExpertsModel(nn.Module):
    """A mixture-of-experts layer whose router is the step: expert 2 gets no token on 2
    steps of 3 (on every rank), and on one step of 6 only on rank 1; expert 3 none before
    step 5 (its state made at its first gradient), then on every other step."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.experts = nn.ModuleList(nn.Linear(10, 10) for _ in range(4))
        self.out = nn.Linear(10, 1)

    @staticmethod
    def routed(step: int, rank: int) -> list[int]:
        out = [0, 1]
        if step % 3 == 0 and (step % 6 == 0 or rank == 1):
            out.append(2)
        if step >= 5 and step % 2:
            out.append(3)
        return out

    def forward(self, x: torch.Tensor, step: int, rank: int) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(sum(self.experts[e](h) for e in self.routed(step, rank)))


MOE_STEPS = 20
MOE_WIRES = {"fp32": None, "fp32-redundant": None, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def moe_loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
    return nn.functional.mse_loss(model(x, step, rank), y)


def moe_steps(model: nn.Module, opt: fastreduce.ZeroOptimizer, rank: int) -> Any:
    """``MOE_STEPS`` steps of ``opt`` over :class:`ExpertsModel`: each step's index and the
    parameters after it (gathered)."""
    for step in range(MOE_STEPS):
        moe_loss(model, step, rank).backward()
        opt.step()
        opt.zero_grad()
        opt.wait_params()
        yield step, params_of(model)


def moe_reference(world: int, make: Callable[[Any], torch.optim.Optimizer]) -> tuple[torch.optim.Optimizer, list]:
    """``make``'s torch optimizer over :class:`ExpertsModel` on the mean gradient of every
    rank's batch (all run here), ``MOE_STEPS`` steps: the optimizer and the parameters after each."""
    torch.manual_seed(SEED)
    ref = ExpertsModel()
    ref_opt = make(ref.parameters())
    refs = []
    for step in range(MOE_STEPS):
        for r in range(world):
            (moe_loss(ref, step, r) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        refs.append(params_of(ref))
    return ref_opt, refs

def moe_case(rank: int, world: int) -> dict:
    """ZeroOptimizer over :class:`ExpertsModel` (AdamW, weight_decay=0.1) against
    ``torch.optim.AdamW`` on the mean gradient (every rank's batch run here; a parameter
    no rank's backward reached has no gradient, one reached on some rank the mean with
    zeros): per wire, the parameters after every step and the final state dicts; and
    whether expert 2's parameters and moments were untouched at each step it had no
    gradient anywhere, as torch leaves them."""
    ref_opt, refs = moe_reference(world, lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1))
    out: dict[str, Any] = {"ref": refs, "ref_state": ref_opt.state_dict()}
    for wire, dtype in MOE_WIRES.items():
        torch.manual_seed(SEED)
        model = ExpertsModel()
        opt = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                                       module=model, wire_dtype=dtype, redundant=wire.endswith("redundant"),
                                       bucket_mb=SMALL_BUCKET_MB)
        expert2 = [i for i, (n, _) in enumerate(model.named_parameters()) if n.startswith("experts.2.")]
        runs, untouched, before = [], [], None
        for step, params in moe_steps(model, opt, rank):
            runs.append(params)
            if step == 3 and wire == "fp32-redundant":  # expert 3 not stepped yet: it has no state
                out["unstepped"] = moe_moved(opt, model)
            if dtype is not None:
                sd = opt.state_dict()["state"]
                now = {i: {k: v.clone() for k, v in sd[i].items()} for i in expert2 if i in sd}
                if not any(2 in ExpertsModel.routed(step, r) for r in range(world)):
                    untouched.append(now.keys() == before.keys() and all(
                        torch.equal(now[i][k], before[i][k]) for i in now for k in now[i]))
                before = now
        out[wire] = {"runs": runs, "state": opt.state_dict(), "untouched": untouched}
        opt.close()
    return out


def moe_moved(opt: fastreduce.ZeroOptimizer, model: nn.Module) -> dict:
    """``opt``'s state (expert 3 never stepped) moved into optimizers of other buckets:
    through :func:`~fastreduce.modes.zero_mirror.reshard` (a Membership's new epoch) and
    through ``torch.distributed.checkpoint`` on disk; each one's ``state_dict()`` against
    ``opt``'s (which has no state for expert 3, as torch.optim has none)."""
    import shutil
    import tempfile

    import torch.distributed.checkpoint as dcp
    from fastreduce.modes import zero_mirror

    want = opt.state_dict()["state"]
    expert3 = {i for i, (n, _) in enumerate(model.named_parameters()) if n.startswith("experts.3.")}

    def same(got: dict) -> bool:
        return got.keys() == want.keys() and all(
            got[i].keys() == st.keys() and all(torch.equal(got[i][k], v) for k, v in st.items())
            for i, st in want.items())

    def other() -> fastreduce.ZeroOptimizer:  # over a copy of the model: one bucket, another layout than opt's
        return fastreduce.ZeroOptimizer(copy.deepcopy(model).parameters(), torch.optim.AdamW, lr=1e-2,
                                        weight_decay=0.1, redundant=True)
    resharded = other()
    zero_mirror.reshard(resharded, zero_mirror.held(opt))
    box = [tempfile.mkdtemp(prefix="fastreduce-moe-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    dcp.save(opt.sharded_state_dict(), checkpoint_id=box[0])  # expert 3's state a template (fresh)
    loaded = other()
    sd = loaded.sharded_state_dict()
    dcp.load(sd, checkpoint_id=box[0])
    loaded.load_sharded_state_dict(sd)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(box[0])
    got = {"resharded": same(resharded.state_dict()["state"]), "loaded": same(loaded.state_dict()["state"])}
    resharded.close()
    loaded.close()
    return {"expert3_unstepped": not expert3 & want.keys(), **got, "fresh": sorted(sd["fresh"]) == sorted(expert3)}


def parity_worker(rank: int, world: int) -> dict:
    ref_group = dist.new_group(backend="gloo")
    out: dict[str, Any] = {}
    for case in PARITY_CASES:
        out[f"{case.name}/ref"] = guarded(parity_ref, rank, world, case, ref_group)
        out[f"{case.name}/zero"] = guarded(parity_zero, rank, world, case)
    out["memory"] = guarded(memory_case, rank, world)
    out["subgroup"] = guarded(subgroup_case, rank, world)
    out["mirror"] = guarded(mirror_case, rank, world)
    out["moe"] = guarded(moe_case, rank, world)
    return out


# ============================================================== helpers run in the parent





def assert_params_close(got: dict, want: dict, where: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    assert got.keys() == want.keys(), where
    for name, w in want.items():
        assert got[name].dtype == w.dtype and got[name].shape == w.shape, f"{where}: {name}"
        assert_close(got[name], w, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{where}: {name}: {m}")


def assert_runs_close(got: list[dict], want: list[dict], where: str, first_step: int = 0, **tol: float) -> None:
    assert len(got) == len(want), f"{where}: {len(got)} steps recorded, want {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert_params_close(g, w, f"{where} after step {first_step + i}", **tol)


def assert_identical_on_ranks(runs: list[list[dict]], where: str) -> None:
    for rank, run in enumerate(runs[1:], 1):
        for step, (p, p0) in enumerate(zip(run, runs[0])):
            for name in p0:
                assert torch.equal(p[name], p0[name]), f"{where}: rank {rank} differs from rank 0 at step {step}: {name}"


# ============================================================== parity tests

def test_odd_model_parameter_count_divides_by_none_of_2_3_32() -> None:
    numel = sum(p.numel() for p in odd_model(SEED).parameters())
    assert numel == OddModel.NUMEL
    assert all(numel % k for k in (2, 3, 32)), numel


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def parity(request) -> tuple[int, list[dict]]:
    return request.param, spawn(parity_worker, request.param)


@pytest.mark.parametrize("case", PARITY_CASES, ids=lambda c: c.name)
def test_reference_is_deterministic_and_clips(parity, case: Case) -> None:
    """The reference itself: identical on all ranks, and clipping at CLIP is exercised."""
    world, results = parity
    refs = per_rank(results, f"{case.name}/ref")
    assert_identical_on_ranks([r["params"] for r in refs], f"world {world} reference")
    norms = refs[0]["norms"]
    assert any(n > case.max_norm for n in norms), norms
    if case.model == "odd":
        assert any(n < case.max_norm for n in norms), norms


@pytest.mark.parametrize("case", PARITY_CASES, ids=lambda c: c.name)
@pytest.mark.cell("loop", "train", modes=("zero",))
def test_params_match_reference(parity, case: Case) -> None:
    world, results = parity
    refs = per_rank(results, f"{case.name}/ref")
    zeros = per_rank(results, f"{case.name}/zero")
    for rank, (ref, zero) in enumerate(zip(refs, zeros)):
        assert_runs_close(zero["params"], ref["params"], f"world {world} rank {rank} {case.name}")
        assert zero["lrs"] == pytest.approx(ref["lrs"], rel=1e-12)


def test_redundant_keeps_each_shard_on_the_next_ranks_and_the_pieces_join(parity) -> None:
    """``redundant=True`` (what fastreduce.Membership needs) and ``redundant=2``: the run is
    the same as without; rank r's j-th copy, of rank r - j's shard (one host), equals it
    (masters and AdamW state, bit for bit, after clipped steps over several buckets), 2 copies
    on 3 ranks (every rank holding every shard), 1 on 2 (as many as there are other ranks); the
    ranks' pieces go point to point (each rank receiving its shard and its copies only) into an
    optimizer bucketed the same or otherwise, equal to ``state_dict()`` (stale parameters
    mended from the masters), its copies equal too; a shard lost with every holder is named
    on every rank; pieces laid out in two epochs (a loss while the shards moved: rank 0's in
    another bucketing, or the same) move as one, each range once, and where a range is lost
    in both, every rank says so."""
    world, results = parity
    for rank, got in enumerate(per_rank(results, "mirror")):
        assert got["same_run"], (world, rank)
        for k in ("True", "2"):
            c = got[k]
            assert c["copies_equal"], (world, rank, k, c)
            assert c["joined_equal"] and c["loaded_equal"] and c["resharded_equal"], (world, rank, k, c)
            assert c["lost"] is not None and "old rank(s) [1]" in c["lost"], c["lost"]
            assert c["mixed_other"] is True and c["mixed_same"] is True, (world, rank, k, c)
            assert "laid out in epochs 1, 2" in str(c["mixed_lost"]), c["mixed_lost"]


@pytest.mark.parametrize("wire", MOE_WIRES)
def test_parameters_without_gradient_are_skipped_as_torch_optim_skips_them(parity, wire: str) -> None:
    """A mixture of experts whose router skips an expert on every rank at some steps:
    ZeroOptimizer steps it as torch.optim.AdamW(weight_decay=0.1) does on the mean
    gradient: not at all where no rank gave it a gradient (no decay, no moment update, its
    step count held), and an expert first routed at step 5 starts its state there. fp32
    wire (plain and redundant=True): every parameter after each of 20 steps and the final
    state (moments, step counts) within 1e-6. bf16 and fp8 wires (rounded gradients):
    the skipped expert's parameters and moments bit-identical to the step before, at
    every step it had no gradient, and every step count torch's. After step 3 (expert 3
    without state) the state moves into other bucketings, by a Membership's reshard and by
    DCP on disk (the save making expert 3 a template that the next step drops), unchanged."""
    world, results = parity
    for rank, got in enumerate(per_rank(results, "moe")):
        ref_state = got["ref_state"]["state"]
        mine = got[wire]
        assert mine["state"]["state"].keys() == ref_state.keys()
        for i, st in ref_state.items():
            assert float(mine["state"]["state"][i]["step"]) == float(st["step"]), (wire, rank, i)
        assert got["unstepped"] == {"expert3_unstepped": True, "resharded": True, "loaded": True, "fresh": True}
        if MOE_WIRES[wire] is None:
            assert_runs_close(mine["runs"], got["ref"], f"{wire} world {world} rank {rank}", rtol=0, atol=1e-6)
            for i, st in ref_state.items():
                for k in ("exp_avg", "exp_avg_sq"):
                    assert_close(mine["state"]["state"][i][k], st[k], rtol=0, atol=1e-6)
        else:
            assert len(mine["untouched"]) == 13 and all(mine["untouched"]), (wire, rank, mine["untouched"])


@pytest.mark.parametrize("case", PARITY_CASES, ids=lambda c: c.name)
def test_clip_grad_norm_returns_the_averaged_grads_norm(parity, case: Case) -> None:
    world, results = parity
    refs = per_rank(results, f"{case.name}/ref")
    zeros = per_rank(results, f"{case.name}/zero")
    for rank, (ref, zero) in enumerate(zip(refs, zeros)):
        assert zero["norms"] == pytest.approx(ref["norms"], rel=1e-5, abs=1e-7), f"world {world} rank {rank}"


@pytest.mark.parametrize("case", PARITY_CASES, ids=lambda c: c.name)
def test_every_rank_holds_the_same_params(parity, case: Case) -> None:
    world, results = parity
    zeros = per_rank(results, f"{case.name}/zero")
    assert_identical_on_ranks([z["params"] for z in zeros], f"world {world} {case.name}")


@pytest.mark.parametrize("case", [c for c in PARITY_CASES if c.bucket_mb], ids=lambda c: c.name)
def test_parameters_are_gathered_first_layers_first(parity, case: Case) -> None:
    """The buckets are in backward order; the all-gathers go out last bucket first, the
    order the next forward reads them (a transport that moves them in launch order, as
    Gloo's point-to-point does, then lands what the forward waits for first)."""
    world, results = parity
    for rank, zero in enumerate(per_rank(results, f"{case.name}/zero")):
        assert zero["gathered"] == list(range(zero["num_buckets"]))[::-1], f"world {world} rank {rank}"


@pytest.mark.parametrize("case", [c for c in PARITY_CASES if c.bucket_mb], ids=lambda c: c.name)
def test_small_bucket_mb_gives_several_buckets(parity, case: Case) -> None:
    """The premise of the small-bucket cases (num_buckets is not in the spec: skipped without it)."""
    world, results = parity
    n = per_rank(results, f"{case.name}/zero")[0]["num_buckets"]
    if n is None:
        pytest.skip("ZeroOptimizer has no num_buckets")
    assert n >= 3, n


def test_group_of_the_first_and_last_rank(parity) -> None:
    world, results = parity
    outs = per_rank(results, "subgroup")
    assert all(o is None for o in outs[1:-1])
    for rank in (0, world - 1):
        assert_runs_close(outs[rank]["zero"], outs[rank]["ref"], f"rank {rank}")
    assert_identical_on_ranks([outs[0]["zero"], outs[-1]["zero"]], "subgroup")


def test_optimizer_state_is_sharded(parity) -> None:
    """Per rank at most 1/N of a plain AdamW's state, plus one alignment pad per bucket
    (2 fp32 states x 64 elements x N ranks per bucket, generously)."""
    world, results = parity
    outs = per_rank(results, "memory")
    if outs[0]["zero_bytes"] is None:
        pytest.skip("ZeroOptimizer has no state_bytes(): per-rank state size not observable")
    for rank, out in enumerate(outs):
        buckets = out["num_buckets"] or out["estimated_buckets"] + 1
        bound = out["plain_bytes"] / world + 2 * 4 * 64 * world * buckets
        assert out["plain_bytes"] >= 2 * 4 * out["numel"]
        assert 0 < out["zero_bytes"] <= bound, (f"world {world} rank {rank}: {out['zero_bytes']} bytes of state, "
                                                f"plain AdamW {out['plain_bytes']}, bound {bound:.0f}")


# ============================================================== world 2: one mechanism each

LOW_CASES = {"bf16": ("odd_bf16", 1e-2), "bf16-small_lr": ("odd_bf16", 1e-4), "mixed": ("mixed", 1e-2),
             "fp16": ("odd_fp16", 1e-2)}


def low_model(kind: str) -> nn.Module:
    """OddModel in bf16 or fp16, or MixedDtypeModel (fp32 layers around a bf16 middle)."""
    if kind == "mixed":
        return mixed_dtype_model(SEED)
    return odd_model(SEED).to(torch.bfloat16 if kind == "odd_bf16" else torch.float16)


def bf16_case(rank: int, world: int, kind: str, lr: float, group: Any) -> dict:
    """bf16 parameters; the reference keeps fp32 master copies, updates them with AdamW on
    the fp32 average of the ranks' grads, and copies them back to the bf16 params."""
    model = low_model(kind)
    ref = copy.deepcopy(model)
    init = params_of(model)
    hp = {"lr": lr, "weight_decay": 0.1}
    opt = zero_opt(model.parameters(), hparams=hp)
    zero = []
    for step in range(STEPS):
        loss_fn(model, batch_for(model, rank, step)).backward()
        opt.step()
        opt.zero_grad()
        zero.append(params_of(model))
    master = [p.detach().float().clone().requires_grad_(True) for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(master, **hp)
    refs = []
    for step in range(STEPS):
        loss_fn(ref, batch_for(ref, rank, step)).backward()
        for m, p in zip(master, ref.parameters()):
            g = p.grad.float()
            dist.all_reduce(g, group=group)
            m.grad = g / world
            p.grad = None
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            for m, p in zip(master, ref.parameters()):
                p.copy_(m)
        refs.append(params_of(ref))
    return {"init": init, "zero": zero, "ref": refs}


NO_SYNC_STEPS = 5


def no_sync_case(rank: int, world: int, overlap: bool, group: Any) -> dict:
    """Two micro-batches per step, the first under no_sync(); clipped at CLIP."""
    model = odd_model(SEED)
    ref = copy.deepcopy(model)
    opt = zero_opt(model.parameters(), overlap=overlap, bucket_mb=SMALL_BUCKET_MB)
    zero, zero_norms, launched = [], [], []
    for step in range(NO_SYNC_STEPS):
        opt.hold_launches(step == 1)  # (a Membership's first step of an epoch: no launch before step())
        with opt.no_sync():
            loss_fn(model, batch_for(model, rank, 2 * step)).backward()
        loss_fn(model, batch_for(model, rank, 2 * step + 1)).backward()
        launched.append(opt._schedule.next if opt._schedule is not None else 0)  # buckets launched in backward
        zero_norms.append(float(opt.clip_grad_norm_(CLIP)))
        opt.step()
        opt.zero_grad()
        zero.append(params_of(model))
    ref_opt = torch.optim.AdamW(ref.parameters(), **HPARAMS["adamw"])
    refs, ref_norms = [], []
    for step in range(NO_SYNC_STEPS):
        loss_fn(ref, batch_for(ref, rank, 2 * step)).backward()
        loss_fn(ref, batch_for(ref, rank, 2 * step + 1)).backward()
        average_grads(ref, world, group)
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)))
        ref_opt.step()
        ref_opt.zero_grad()
        refs.append(params_of(ref))
    return {"zero": zero, "ref": refs, "zero_norms": zero_norms, "ref_norms": ref_norms, "launched": launched}


SCALER_STEPS = 6
INIT_SCALE = 2.0**10
# name: (overlap, the step whose loss is inf, on which rank only); the spec's case is step 2
# on rank 1; "first_step" skips the very first step (no optimizer state exists yet).
SCALER_CASES = {"overlap": (True, 2, 1), "no_overlap": (False, 2, 1), "first_step": (True, 0, 0)}


def make_scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=3)


def scaler_case(rank: int, world: int, name: str, group: Any) -> dict:
    overlap, inf_step, inf_rank = SCALER_CASES[name]
    try:
        make_scaler()
    except Exception:  # noqa: BLE001
        return {"unusable": traceback.format_exc()}
    model = odd_model(SEED)
    ref = copy.deepcopy(model)
    init = params_of(model)

    def scaled_loss(m: nn.Module, step: int) -> torch.Tensor:
        loss = loss_fn(m, batch_for(m, rank, step))
        return loss * math.inf if (step == inf_step and rank == inf_rank) else loss

    scaler = make_scaler()
    opt = zero_opt(model.parameters(), overlap=overlap, bucket_mb=SMALL_BUCKET_MB, scaler=scaler)
    zero, zero_scales = [], []
    for step in range(SCALER_STEPS):
        scaler.scale(scaled_loss(model, step)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        zero.append(params_of(model))
        zero_scales.append(scaler.get_scale())
    ref_scaler = make_scaler()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HPARAMS["adamw"])
    refs, ref_scales = [], []
    for step in range(SCALER_STEPS):
        ref_scaler.scale(scaled_loss(ref, step)).backward()
        average_grads(ref, world, group)  # an inf / nan on one rank reaches every rank's sum
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
        refs.append(params_of(ref))
        ref_scales.append(ref_scaler.get_scale())
    return {"init": init, "zero": zero, "zero_scales": zero_scales, "ref": refs, "ref_scales": ref_scales}


def singleton_group_case(rank: int, world: int, opt_name: str) -> dict:
    """Each rank alone in a 1-rank subgroup: the ZeroOptimizer is exactly the plain one."""
    groups = [dist.new_group([r], backend="gloo") for r in range(world)]  # every rank creates every group
    model = odd_model(SEED)
    ref = copy.deepcopy(model)
    opt = zero_opt(model.parameters(), opt_name, group=groups[rank], bucket_mb=SMALL_BUCKET_MB)
    plain = OPT_CLASSES[opt_name](ref.parameters(), **HPARAMS[opt_name])
    zero, refs = [], []
    for step in range(STEPS):
        loss_fn(model, batch_for(model, rank, step)).backward()
        opt.step()
        opt.zero_grad()
        zero.append(params_of(model))
        loss_fn(ref, batch_for(ref, rank, step)).backward()
        plain.step()
        plain.zero_grad()
        refs.append(params_of(ref))
    return {"zero": zero, "ref": refs}


CLOSURE_STEPS = 5


def closure_case(rank: int, world: int, group: Any) -> dict:
    """step(closure): the closure zeroes the grads, runs forward and backward and returns the
    loss, which step() returns."""
    model = odd_model(SEED)
    ref = copy.deepcopy(model)
    opt = zero_opt(model.parameters(), bucket_mb=SMALL_BUCKET_MB)
    zero, zero_losses = [], []
    for step in range(CLOSURE_STEPS):
        def closure(step: int = step) -> torch.Tensor:
            opt.zero_grad()
            loss = loss_fn(model, batch_for(model, rank, step))
            loss.backward()
            return loss
        zero_losses.append(float(opt.step(closure)))
        zero.append(params_of(model))
    ref_opt = torch.optim.AdamW(ref.parameters(), **HPARAMS["adamw"])
    refs, ref_losses = [], []
    for step in range(CLOSURE_STEPS):
        def ref_closure(step: int = step) -> torch.Tensor:
            ref_opt.zero_grad()
            loss = loss_fn(ref, batch_for(ref, rank, step))
            loss.backward()
            average_grads(ref, world, group)
            return loss
        ref_losses.append(float(ref_opt.step(ref_closure)))
        refs.append(params_of(ref))
    return {"zero": zero, "ref": refs, "zero_losses": zero_losses, "ref_losses": ref_losses}


def commit_point_case(rank: int, world: int, group: Any) -> dict:
    """``with opt.commit_point(fn)``: fn runs once a step, after the reduce-scatter and before
    any shard steps; a raise there changes nothing and the next step is whole (against the
    reference: the raised step's gradients are not applied)."""
    model = odd_model(SEED)
    ref = copy.deepcopy(model)
    opt = zero_opt(model.parameters(), bucket_mb=SMALL_BUCKET_MB)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HPARAMS["adamw"])
    seen: list[dict] = []

    class Refused(Exception):
        pass

    def refuse() -> None:
        raise Refused

    out: dict[str, Any] = {"nested": ""}
    for step in range(3):
        loss_fn(model, batch_for(model, rank, step)).backward()
        if step == 1:  # refused: nothing stepped; the reference skips this step too
            before, state = params_of(model), copy.deepcopy(opt.state_dict())
            with opt.commit_point(refuse):
                try:
                    opt.step()
                except Refused:
                    out["raised"] = True
            out["unchanged"] = all(torch.equal(before[n], p) for n, p in model.named_parameters())
            after = opt.state_dict()
            out["state_unchanged"] = all(torch.equal(state["state"][i][k], after["state"][i][k])
                                         for i in state["state"] for k in state["state"][i])
        else:
            with opt.commit_point(lambda: seen.append(params_of(model))):
                try:
                    with opt.commit_point(lambda: None):
                        pass
                except RuntimeError as err:
                    out["nested"] = str(err)
                opt.step()
            loss_fn(ref, batch_for(ref, rank, step)).backward()
            average_grads(ref, world, group)
            ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    out.update(seen=len(seen), ref=params_of(ref), zero=params_of(model))
    return out


def stepped_after_close_case(rank: int, world: int) -> dict:
    """A ZeroOptimizer stepped after close() (which takes its forward waits off): the step
    waits for its own all-gather, so the next forward reads every rank's shard, as an open
    one's does (it returned with the gather in flight and nothing waited: stale parameters)."""
    runs = {}
    for closing in (False, True):
        model = odd_model(SEED)
        opt = zero_opt(model.parameters(), module=model)
        for step in range(3):
            if closing and step == 2:
                opt.close()
            loss_fn(model, batch_for(model, rank, step)).backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            loss_of(model, batch_for(model, rank, 3))  # (an open one's forward waits for the gather here)
        runs[closing] = (params_of(model), opt.params_stale)
    return {"same": all(torch.equal(runs[True][0][n], t) for n, t in runs[False][0].items()),
            "stale": runs[True][1]}


def built_again_case(rank: int, world: int) -> dict:
    """A second ZeroOptimizer built over a model's parameters while the first is still open
    (a new optimizer, as one replaces a torch.optim one): the first is closed by the second
    (its hooks raised at the next backward: the parameters were the second's views), and
    training goes on exactly as where the user closed it first. It warns only where the first
    was still open (a closed one let its parameters go: a Membership builds one per epoch)."""
    runs, warned = {}, {}
    for closing in (False, True):
        model = odd_model(SEED)
        first = zero_opt(model.parameters(), module=model)
        loss_fn(model, batch_for(model, rank, 0)).backward()
        first.step()
        first.zero_grad()
        if closing:
            first.close()
        with _warnings_of("fastreduce.modes.zero_grads") as said:
            again = zero_opt(model.parameters(), module=model)
        warned[closing] = sum("took over parameters an earlier one still held" in m for m in said)
        again.load_state_dict(first.state_dict())
        for step in range(1, 3):
            loss_fn(model, batch_for(model, rank, step)).backward()
            again.step()
            again.zero_grad()
        again.wait_params()
        runs[closing] = params_of(model)
    return {"same": all(torch.equal(runs[True][n], t) for n, t in runs[False].items()), "warned": warned}


@contextlib.contextmanager
def _warnings_of(logger: str) -> Iterator[list[str]]:
    """The messages ``logger`` logs at WARNING or above within the block."""
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger(logger).addHandler(handler)
    try:
        yield said
    finally:
        logging.getLogger(logger).removeHandler(handler)


def fp16_bf16_case(rank: int, world: int) -> dict:
    """The default wire (None) on fp16 and bf16 parameters, neither of which holds the other: an fp32
    reduce-scatter, so a bf16 gradient beyond fp16's range is stepped on as torch steps on its mean."""
    params = [nn.Parameter(torch.ones(64, dtype=torch.float16)), nn.Parameter(torch.ones(64, dtype=torch.bfloat16))]
    ref = [nn.Parameter(p.detach().clone()) for p in params]
    opt = fastreduce.ZeroOptimizer(params, torch.optim.SGD, lr=1e-5)
    ref_opt = torch.optim.SGD(ref, lr=1e-5)
    for p, q, scale in zip(params, ref, (1 + 2.0**-10, 1e5)):
        p.grad = torch.full_like(p, scale * (rank + 1))
        g = p.grad.float()
        dist.all_reduce(g)
        q.grad = (g / world).to(q.dtype)
    opt.step()
    opt.wait_params()
    ref_opt.step()
    opt.close()
    return {"got": [p.detach().clone() for p in params], "want": [q.detach().clone() for q in ref]}


def api_case(rank: int, world: int) -> dict:
    model = odd_model(SEED)
    params = list(model.parameters())
    opt = fastreduce.ZeroOptimizer([{"params": params[:2]}, {"params": params[2:], "lr": 1e-3}],
                                   torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    # Groups against registration order: torch.optim's index follows param_groups.
    swapped_model = odd_model(SEED)
    sp = list(swapped_model.parameters())
    order = [sp[2:], sp[:2]]
    swapped = fastreduce.ZeroOptimizer([{"params": sp[2:]}, {"params": sp[:2], "lr": 1e-3}],
                                       torch.optim.AdamW, lr=1e-2, bucket_mb=SMALL_BUCKET_MB)
    loss_fn(swapped_model, batch_for(swapped_model, rank, 0)).backward()
    swapped.step()
    sd = swapped.state_dict()
    other = odd_model(SEED)
    default = fastreduce.ZeroOptimizer(other.parameters(), lr=1e-2)  # optimizer_class defaults to AdamW
    # Each group's params a generator (read once; the device probe must not take the first)
    gm = odd_model(SEED)
    owners = [m for m in gm.modules() if any(True for _ in m.parameters(recurse=False))]
    generated = fastreduce.ZeroOptimizer([{"params": m.parameters(recurse=False)} for m in owners],
                                         torch.optim.AdamW, lr=1e-2)
    before = [p.detach().clone() for p in gm.parameters()]
    loss_fn(gm, batch_for(gm, rank, 0)).backward()
    generated.step()
    generated.wait_params()
    return {
        "generated_groups": [len(g["params"]) for g in generated.param_groups],
        "generated_want": [len(list(m.parameters(recurse=False))) for m in owners],
        "generated_stepped": [not torch.equal(b, p) for b, p in zip(before, gm.parameters())],
        "sd_group_params": [g["params"] for g in sd["param_groups"]],
        "sd_group_lrs": [g["lr"] for g in sd["param_groups"]],
        "sd_shapes": {i: tuple(st["exp_avg"].shape) for i, st in sd["state"].items()},
        "want_shapes": {i: tuple(p.shape) for i, p in enumerate(order[0] + order[1])},
        "is_optimizer": isinstance(opt, torch.optim.Optimizer),
        "groups": len(opt.param_groups),
        "same_params": [all(a is b for a, b in zip(g["params"], want)) and len(g["params"]) == len(want)
                        for g, want in zip(opt.param_groups, (params[:2], params[2:]))],
        "lrs": [g["lr"] for g in opt.param_groups],
        "weight_decays": [g["weight_decay"] for g in opt.param_groups],
        "betas": [tuple(g["betas"]) for g in opt.param_groups],
        "default_group_keys": sorted(default.param_groups[0]),
        "default_weight_decay": default.param_groups[0]["weight_decay"],
        "default_same_params": all(a is b for a, b in zip(default.param_groups[0]["params"], other.parameters())),
    }


def moe_sgd_case(rank: int, world: int) -> dict:
    """SGD with momentum over :class:`ExpertsModel` (expert 3 first routed at step 5, after
    the other parameters have momentum buffers) against ``torch.optim.SGD`` (its default
    implementation) on the mean gradient, every rank's batch run here; ZeRO's shard takes
    torch's fused SGD at 2 ranks, which cannot step buffers and no buffers in one list.
    Small buckets: each rank holds pieces of expert 3 and of the others (copies too)."""
    ref_opt, refs = moe_reference(world, lambda ps: torch.optim.SGD(ps, **HPARAMS["sgd"]))
    torch.manual_seed(SEED)
    model = ExpertsModel()
    opt = zero_opt(model.parameters(), "sgd", module=model, bucket_mb=SMALL_BUCKET_MB, redundant=True)
    runs = [params for _, params in moe_steps(model, opt, rank)]
    out = {"ref": refs, "ref_state": ref_opt.state_dict(), "runs": runs, "state": opt.state_dict(),
           "fused": [g.get("fused") for g in opt.inner.param_groups]}
    plain = torch.optim.SGD(copy.deepcopy(model).parameters(), **HPARAMS["sgd"])
    plain.load_state_dict(out["state"])  # the kernel chosen for the shards is not the user's: not saved
    out["loaded_fused"] = [g.get("fused") for g in plain.param_groups]
    opt.close()
    return out


ROUND_TRIPS = {"bf16": None, "gather_bf16": torch.bfloat16}  # bf16 parameters | fp32 ones gathered in bf16
PLAIN_STEPS = 5


def plain_round_trip_case(rank: int, world: int, kind: str) -> dict:
    """ZeRO's ``state_dict()`` (fp32 masters in it) into a plain ``torch.optim.AdamW`` that
    steps PLAIN_STEPS times on the mean gradient (every rank's batch run here), its parameters
    and ``state_dict()`` (the masters still as loaded) back into the ZeroOptimizer, then one
    more step of each: the masters after the load as each rank sees them, the parameters
    after that step."""
    model = odd_model(SEED)
    if kind == "bf16":
        model = model.to(torch.bfloat16)
    opt = zero_opt(model.parameters(), gather_dtype=ROUND_TRIPS[kind], hparams={"weight_decay": 0.0})
    for step in range(3):
        loss_fn(model, batch_for(model, rank, step)).backward()
        opt.step()
        opt.zero_grad()
    twin = copy.deepcopy(model)
    plain = torch.optim.AdamW(twin.parameters(), lr=HPARAMS["adamw"]["lr"], weight_decay=0.0)
    plain.load_state_dict(copy.deepcopy(opt.state_dict()))

    def plain_step(step: int) -> None:
        for r in range(world):
            (loss_fn(twin, batch_for(twin, r, step)) / world).backward()
        plain.step()
        plain.zero_grad()

    for step in range(3, 3 + PLAIN_STEPS):
        plain_step(step)
    model.load_state_dict(twin.state_dict())
    opt.load_state_dict(copy.deepcopy(plain.state_dict()))
    masters = [st["fastreduce_master"] for _, st in sorted(opt.state_dict()["state"].items())]
    loaded = params_of(model)
    step = 3 + PLAIN_STEPS
    loss_fn(model, batch_for(model, rank, step)).backward()
    opt.step()
    opt.zero_grad()
    plain_step(step)
    return {"masters": masters, "loaded": loaded, "zero": params_of(model),
            "plain": params_of(twin)}


def unstepped_export_case(rank: int, world: int) -> dict:
    """bf16 :class:`ExpertsModel` (expert 3 first routed at step 5): ZeroOptimizer and
    ``torch.optim.AdamW`` (on the mean gradient, every rank's batch run here) 3 steps each,
    then ZeRO's ``state_dict()`` into a plain AdamW over ZeRO's parameters, which steps on
    to step 8 (expert 3's first gradients): each one's state keys per parameter, and the
    step counts the plain AdamW reaches."""
    def loss(m: nn.Module, step: int, r: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * step + r)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
        return nn.functional.mse_loss(m(x.bfloat16(), step, r).float(), y)

    def plain_steps(m: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            for r in range(world):
                (loss(m, step, r) / world).backward()
            opt.step()
            opt.zero_grad()

    torch.manual_seed(SEED)
    model = ExpertsModel().to(torch.bfloat16)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    plain_steps(ref, ref_opt, range(3))
    ref_keys = {i: sorted(st) for i, st in ref_opt.state_dict()["state"].items()}
    opt = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, bucket_mb=SMALL_BUCKET_MB)
    for step in range(3):
        loss(model, step, rank).backward()
        opt.step()
        opt.zero_grad()
    sd = copy.deepcopy(opt.state_dict())
    opt.close()  # its hooks off: the plain AdamW takes its parameters on
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plain.load_state_dict(sd)
    plain_steps(model, plain, range(3, 8))
    plain_steps(ref, ref_opt, range(3, 8))
    return {"keys": {i: sorted(st) for i, st in sd["state"].items()}, "ref_keys": ref_keys,
            "steps": {i: float(st["step"]) for i, st in plain.state_dict()["state"].items()},
            "ref_steps": {i: float(st["step"]) for i, st in ref_opt.state_dict()["state"].items()}}


def group_keys_case(rank: int, world: int) -> dict:
    """Adam with ``amsgrad=True`` in one param group only (its state alone keeps
    ``max_exp_avg_sq``), ``redundant=True``, each group's bucket on both ranks: 5 steps
    against ``torch.optim.Adam`` on the mean gradient (every rank's batch run here), then its
    state every way out and in: ``state_dict()``; torch's state loaded into a fresh
    ZeroOptimizer (its copies pulled), and into one built without amsgrad (the loaded
    groups' hyperparameters hold, as torch.optim's load takes them), stepped once more
    beside torch's; ``sharded_state_dict()`` through DCP on disk into
    another; a Membership's :func:`~fastreduce.modes.zero_mirror.reshard` into another."""
    import shutil
    import tempfile

    import torch.distributed.checkpoint as dcp
    from fastreduce.modes import zero_mirror

    def groups(m: nn.Module, amsgrad: bool = True) -> list[dict]:
        ps = list(m.parameters())
        return [{"params": ps[:3], "amsgrad": amsgrad}, {"params": ps[3:], "lr": 2e-2}]

    model = odd_model(SEED)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(groups(ref), lr=1e-2)
    opt = fastreduce.ZeroOptimizer(groups(model), torch.optim.Adam, lr=1e-2, redundant=True)
    runs, refs = [], []
    for step in range(5):
        loss_fn(model, batch_for(model, rank, step)).backward()
        opt.step()
        opt.zero_grad()
        runs.append(params_of(model))
        for r in range(world):
            (loss_fn(ref, batch_for(ref, r, step)) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        refs.append(params_of(ref))
    out: dict[str, Any] = {"runs": runs, "refs": refs, "want": copy.deepcopy(ref_opt.state_dict()),
                           "state": opt.state_dict()}

    def other(amsgrad: bool = True, twin: nn.Module | None = None) -> fastreduce.ZeroOptimizer:
        """Over a copy of the model (or ``twin``), in other buckets than opt's."""
        return fastreduce.ZeroOptimizer(groups(copy.deepcopy(model) if twin is None else twin, amsgrad),
                                        torch.optim.Adam, lr=1e-2, bucket_mb=SMALL_BUCKET_MB, redundant=True)
    loaded = other()
    loaded.load_state_dict(copy.deepcopy(out["want"]))
    out["loaded"], out["loaded_copies"] = loaded.state_dict(), copies_equal(loaded, rank, world, 1, 1)
    twin = copy.deepcopy(ref)  # built without amsgrad: the loaded groups' hyperparameters say which keys
    unlike = other(amsgrad=False, twin=twin)
    unlike.load_state_dict(copy.deepcopy(out["want"]))
    out["unlike"], out["unlike_copies"] = unlike.state_dict(), copies_equal(unlike, rank, world, 1, 1)
    loss_fn(twin, batch_for(twin, rank, 5)).backward()
    unlike.step()
    for r in range(world):
        (loss_fn(ref, batch_for(ref, r, 5)) / world).backward()
    ref_opt.step()
    out["unlike_step"], out["ref_step"] = params_of(twin), params_of(ref)
    box = [tempfile.mkdtemp(prefix="fastreduce-keys-") if rank == 0 else None]
    dist.broadcast_object_list(box)
    dcp.save(opt.sharded_state_dict(), checkpoint_id=box[0])
    from_disk = other()
    sd = from_disk.sharded_state_dict()
    dcp.load(sd, checkpoint_id=box[0])
    from_disk.load_sharded_state_dict(sd)
    out["dcp"], out["dcp_copies"] = from_disk.state_dict(), copies_equal(from_disk, rank, world, 1, 1)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(box[0])
    moved = other()
    zero_mirror.reshard(moved, zero_mirror.held(opt))
    out["resharded"], out["resharded_copies"] = moved.state_dict(), copies_equal(moved, rank, world, 1, 1)
    for o in (opt, loaded, unlike, from_disk, moved):
        o.close()
    return out


def momentum_later_case(rank: int, world: int) -> dict:
    """SGD built with ``lr`` alone (momentum 0) under ``OneCycleLR``, which sets a momentum
    before the first step (its ``cycle_momentum``, on by default), ``redundant=True``: 3
    steps beside ``torch.optim.SGD`` on the mean gradient; its ``state_dict()``, resumed in
    a fresh ZeroOptimizer and stepped twice more beside torch's; a Membership's
    :func:`~fastreduce.modes.zero_mirror.reshard` into another."""
    from fastreduce.modes import zero_mirror

    def sched(o: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=10)

    def step(m: nn.Module, o: torch.optim.Optimizer, s: Any, at: int, ref: bool = False) -> None:
        for r in (range(world) if ref else [rank]):
            (loss_fn(m, batch_for(m, r, at)) / (world if ref else 1)).backward()
        o.step()
        o.zero_grad()
        s.step()

    model = odd_model(SEED)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    opt = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=0.05, redundant=True)
    ref_sched, opt_sched = sched(ref_opt), sched(opt)
    for at in range(3):
        step(ref, ref_opt, ref_sched, at, ref=True)
        step(model, opt, opt_sched, at)
    out: dict[str, Any] = {"want": copy.deepcopy(ref_opt.state_dict()), "state": opt.state_dict()}
    moved = fastreduce.ZeroOptimizer(copy.deepcopy(model).parameters(), torch.optim.SGD, lr=0.05,
                                     bucket_mb=SMALL_BUCKET_MB, redundant=True)
    zero_mirror.reshard(moved, zero_mirror.held(opt))
    out["resharded"] = moved.state_dict()
    twin = copy.deepcopy(model)
    resumed = fastreduce.ZeroOptimizer(twin.parameters(), torch.optim.SGD, lr=0.05)
    resumed_sched = sched(resumed)
    resumed.load_state_dict(out["state"])
    resumed_sched.load_state_dict(opt_sched.state_dict())
    for at in range(3, 5):
        step(ref, ref_opt, ref_sched, at, ref=True)
        step(twin, resumed, resumed_sched, at)
    out["resumed"], out["ref"] = params_of(twin), params_of(ref)
    for o in (opt, moved, resumed):
        o.close()
    return out


def empty_param_dcp_case(rank: int, world: int) -> dict:
    """A model with a parameter of 0 elements beside others, AdamW stepped twice; its
    ``sharded_state_dict()`` saved through DCP and loaded into another ZeroOptimizer."""
    import shutil
    import tempfile

    import torch.distributed.checkpoint as dcp

    def make() -> tuple[nn.Module, fastreduce.ZeroOptimizer]:
        m = odd_model(SEED)
        m.register_parameter("empty", nn.Parameter(torch.zeros(0, 4)))
        return m, fastreduce.ZeroOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-2)

    model, opt = make()
    for step in range(2):
        (loss_fn(model, batch_for(model, rank, step)) + model.empty.sum()).backward()
        opt.step()
        opt.zero_grad()
    box = [tempfile.mkdtemp(prefix="fastreduce-empty-") if rank == 0 else None]
    dist.broadcast_object_list(box)
    dcp.save(opt.sharded_state_dict(), checkpoint_id=box[0])
    _, other = make()
    sd = other.sharded_state_dict()
    dcp.load(sd, checkpoint_id=box[0])
    other.load_sharded_state_dict(sd)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(box[0])
    out = {"state": opt.state_dict(), "loaded": other.state_dict()}
    opt.close()
    other.close()
    return out


def stepped_twice_case(rank: int, world: int, overlap: bool) -> dict:
    """``step()`` twice on one backward (and ``clip_grad_norm_()`` after a step): refused on
    every rank, nothing changed; a step after ``zero_grad()`` (the optimizer's, or the
    model's in place) and no backward steps zero gradients, as torch's does (1e-6)."""
    model = odd_model(SEED)
    ref = copy.deepcopy(model)
    opt = zero_opt(model.parameters(), bucket_mb=SMALL_BUCKET_MB, overlap=overlap)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HPARAMS["adamw"])
    loss_fn(model, batch_for(model, rank, 0)).backward()
    opt.step()
    out: dict[str, Any] = {}
    def accumulated() -> None:  # a backward onto the spent gradients, no zero_grad() between
        loss_fn(model, batch_for(model, rank, 2)).backward()
        opt.step()

    for what, call in (("step", opt.step), ("clip", lambda: opt.clip_grad_norm_(1.0)), ("accumulated", accumulated)):
        opt.wait_params()
        before, state = params_of(model), copy.deepcopy(opt.state_dict())
        try:
            call()
        except RuntimeError as err:
            out[what] = str(err)
        after = opt.state_dict()
        out[f"{what}_unchanged"] = all(torch.equal(before[n], p) for n, p in model.named_parameters()) and all(
            torch.equal(state["state"][i][k], after["state"][i][k]) for i in state["state"] for k in state["state"][i])
    opt.zero_grad(set_to_none=False)
    opt.step()  # zero gradients: weight decay and the moments move, as torch's
    model.zero_grad(set_to_none=False)  # (the model's zero_grad, in place: the buffer zeroed all the same)
    loss_fn(model, batch_for(model, rank, 1)).backward()
    opt.step()
    model.zero_grad(set_to_none=False)
    opt.step()
    for r in range(world):
        (loss_fn(ref, batch_for(ref, r, 0)) / world).backward()
    ref_opt.step()
    ref_opt.zero_grad(set_to_none=False)
    ref_opt.step()
    for r in range(world):
        (loss_fn(ref, batch_for(ref, r, 1)) / world).backward()
    ref_opt.step()
    ref_opt.zero_grad(set_to_none=False)
    ref_opt.step()
    out["zero"], out["ref"] = params_of(model), params_of(ref)
    opt.close()
    return out


def misc_worker(rank: int, world: int) -> dict:
    ref_group = dist.new_group(backend="gloo")
    out = {name: guarded(bf16_case, rank, world, kind, lr, ref_group) for name, (kind, lr) in LOW_CASES.items()}
    for overlap in (True, False):
        out[f"no_sync-overlap_{overlap}"] = guarded(no_sync_case, rank, world, overlap, ref_group)
    for opt_name in OPT_CLASSES:
        out[f"singleton-{opt_name}"] = guarded(singleton_group_case, rank, world, opt_name)
    for name in SCALER_CASES:
        out[f"scaler-{name}"] = guarded(scaler_case, rank, world, name, ref_group)
    out["closure"] = guarded(closure_case, rank, world, ref_group)
    out["commit_point"] = guarded(commit_point_case, rank, world, ref_group)
    out["api"] = guarded(api_case, rank, world)
    out["fp16_bf16"] = guarded(fp16_bf16_case, rank, world)
    out["stepped_after_close"] = guarded(stepped_after_close_case, rank, world)
    out["built_again"] = guarded(built_again_case, rank, world)
    out["moe_sgd"] = guarded(moe_sgd_case, rank, world)
    out["unstepped_export"] = guarded(unstepped_export_case, rank, world)
    out["group_keys"] = guarded(group_keys_case, rank, world)
    out["momentum_later"] = guarded(momentum_later_case, rank, world)
    out["empty_param_dcp"] = guarded(empty_param_dcp_case, rank, world)
    for overlap in (True, False):
        out[f"stepped_twice-{overlap}"] = guarded(stepped_twice_case, rank, world, overlap)
    for kind in ROUND_TRIPS:
        out[f"round_trip-{kind}"] = guarded(plain_round_trip_case, rank, world, kind)
    return out


@pytest.fixture(scope="module")
def misc() -> list[dict]:
    return spawn(misc_worker, 2)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |x| (8 significant bits)."""
    x = x.float().abs().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(x)) - 7)


@pytest.mark.parametrize("kind", ["bf16", "mixed", "fp16"])
def test_bf16_params_match_fp32_master_reference(misc, kind) -> None:
    """Within bf16 rounding. The two sides may differ by the rounding of the averaged grad
    (the ZeroOptimizer may average on a bf16 wire); once a bf16 parameter differs by an ulp,
    the next bf16 forward/backward differs too, so differences grow a little over the 20
    steps: hence rtol=1.6e-2 (4 bf16 ulps) and atol of 1% of the tensor's largest value.
    ``mixed``: fp32 and bf16 parameters in one optimizer (fp32 ones fed by bf16 activations)."""
    for rank, out in enumerate(per_rank(misc, kind)):
        for step, (z, r) in enumerate(zip(out["zero"], out["ref"])):
            for name, want in r.items():
                got = z[name]
                assert got.dtype == want.dtype == out["init"][name].dtype, f"{name}: {got.dtype}"
                atol = 1e-2 * want.float().abs().max().item()
                assert_close(got.float(), want.float(), rtol=1.6e-2, atol=atol,
                             msg=lambda m, name=name, step=step: f"rank {rank} step {step} {name}: {m}")


def test_bf16_master_weights_keep_updates_below_a_bf16_ulp(misc) -> None:
    """With lr=1e-4 each AdamW update of a parameter of magnitude >= 0.125 is below half a
    bf16 ulp there: updating the bf16 parameters directly would round every update away.
    The fp32 master weights accumulate them, and the parameters move as the reference's do."""
    for rank, out in enumerate(per_rank(misc, "bf16-small_lr")):
        moved_ref = moved_zero = considered = 0
        for name, init in out["init"].items():
            mask = init.float().abs() >= 0.125
            considered += int(mask.sum())
            moved_ref += int(((out["ref"][-1][name] != init) & mask).sum())
            moved_zero += int(((out["zero"][-1][name] != init) & mask).sum())
            # These elements' updates are tiny: the two sides' master weights stay far closer
            # than a bf16 ulp, so their bf16 parameters are at most one rounding apart.
            diff = (out["zero"][-1][name].float() - out["ref"][-1][name].float()).abs()[mask]
            ulp = bf16_ulp(out["ref"][-1][name])[mask]
            assert (diff <= ulp).all(), f"rank {rank} {name}: {int((diff > ulp).sum())} elements over 1 ulp apart"
        assert moved_ref >= 0.3 * considered, (moved_ref, considered)  # the reference does move them
        assert moved_zero >= 0.9 * moved_ref, f"rank {rank}: {moved_zero} moved, reference {moved_ref}"


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
def test_no_sync_accumulation_matches_summed_grads(misc, overlap) -> None:
    outs = per_rank(misc, f"no_sync-overlap_{overlap}")
    for rank, out in enumerate(outs):
        assert_runs_close(out["zero"], out["ref"], f"rank {rank}")
        assert out["zero_norms"] == pytest.approx(out["ref_norms"], rel=1e-5, abs=1e-7)
        # held launches stay held through no_sync(): none from the backward hooks at step 1
        assert out["launched"][1] == 0 and (not overlap or out["launched"][2] > 0), out["launched"]
    assert_identical_on_ranks([o["zero"] for o in outs], "no_sync")


def test_no_wire_dtype_steps_fp16_with_bf16_on_an_fp32_wire(misc) -> None:
    for out in per_rank(misc, "fp16_bf16"):  # (bf16 parameters step on fp32 masters: within a bf16 ulp)
        for got, want in zip(out["got"], out["want"]):
            assert got.dtype == want.dtype
            assert_close(got, want, rtol=2.0**-7, atol=0)


def test_a_second_optimizer_over_the_parameters_closes_the_first(misc) -> None:
    for out in per_rank(misc, "built_again"):
        assert out == {"same": True, "warned": {False: 1, True: 0}}, out


def test_a_step_after_close_leaves_no_parameter_stale(misc) -> None:
    for out in per_rank(misc, "stepped_after_close"):
        assert out == {"same": True, "stale": False}, out


def scaler_outs(misc: list[dict], name: str) -> list[dict]:
    outs = per_rank(misc, f"scaler-{name}")
    if "unusable" in outs[0]:
        pytest.skip("torch.amp.GradScaler('cpu') is unusable in this torch:\n" + outs[0]["unusable"])
    return outs


@pytest.mark.parametrize("name", list(SCALER_CASES))
def test_grad_scaler_inf_on_one_rank_skips_the_step_everywhere(misc, name) -> None:
    _, inf_step, _ = SCALER_CASES[name]
    outs = scaler_outs(misc, name)
    for rank, out in enumerate(outs):
        for side in ("ref", "zero"):
            before = out[side][inf_step - 1] if inf_step else out["init"]
            after = out[side][inf_step]
            for n in before:
                assert torch.equal(before[n], after[n]), f"rank {rank} {side}: step {inf_step} changed {n}"
            nxt = out[side][inf_step + 1]  # and the next step does update
            assert any(not torch.equal(nxt[n], after[n]) for n in after), f"rank {rank} {side}: no update"
    scales = [out["zero_scales"] for out in outs]
    assert all(s == scales[0] for s in scales), scales
    assert scales[0] == outs[0]["ref_scales"], (scales[0], outs[0]["ref_scales"])
    prev = scales[0][inf_step - 1] if inf_step else INIT_SCALE
    assert scales[0][inf_step] == prev * 0.5  # backed off after the inf


@pytest.mark.parametrize("name", list(SCALER_CASES))
def test_grad_scaler_steps_match_reference(misc, name) -> None:
    outs = scaler_outs(misc, name)
    for rank, out in enumerate(outs):
        assert_runs_close(out["zero"], out["ref"], f"rank {rank}")
    assert_identical_on_ranks([o["zero"] for o in outs], "scaler")


def test_step_with_closure(misc) -> None:
    outs = per_rank(misc, "closure")
    for rank, out in enumerate(outs):
        assert out["zero_losses"] == pytest.approx(out["ref_losses"], rel=1e-5, abs=1e-7)
        assert_runs_close(out["zero"], out["ref"], f"rank {rank}")


def test_commit_point_runs_before_the_shards_step_and_a_raise_there_changes_nothing(misc) -> None:
    for rank, out in enumerate(per_rank(misc, "commit_point")):
        assert out["seen"] == 2, "the commit point ran once a step"
        assert out["raised"] and out["unchanged"] and out["state_unchanged"], f"rank {rank}"
        assert "do not nest" in out["nested"]
        assert_params_close(out["zero"], out["ref"], f"rank {rank}, the steps around a refused one")


@pytest.mark.parametrize("opt_name", list(OPT_CLASSES))
def test_one_rank_subgroup_is_exactly_the_plain_optimizer(misc, opt_name) -> None:
    for rank, out in enumerate(per_rank(misc, f"singleton-{opt_name}")):
        for step, (z, r) in enumerate(zip(out["zero"], out["ref"])):
            for name in r:
                assert torch.equal(z[name], r[name]), f"rank {rank} step {step} {name}"


def test_sgd_momentum_steps_a_parameter_first_used_late_as_torch_sgd(misc) -> None:
    """An expert first routed at step 5, when the other parameters have momentum buffers:
    ZeroOptimizer(SGD, momentum=0.9) on torch's fused kernel (its pieces without a buffer
    stepped apart from those with one) steps as torch.optim.SGD on the mean gradient, every
    parameter after each of 20 steps and the momentum buffers within 1e-6. That kernel is
    the shards' own: ``state_dict()``'s param groups hold the user's choice (none), as
    torch's; before, ``fused=True``, which a plain SGD loading it took, then failed to step
    parameters with and without a momentum buffer together."""
    for rank, got in enumerate(per_rank(misc, "moe_sgd")):
        assert got["fused"] == [True], got["fused"]
        want = [g.get("fused") for g in got["ref_state"]["param_groups"]]
        assert [g.get("fused") for g in got["state"]["param_groups"]] == want == got["loaded_fused"], rank
        assert_runs_close(got["runs"], got["ref"], f"rank {rank}", rtol=0, atol=1e-6)
        ref_state, state = got["ref_state"]["state"], got["state"]["state"]
        assert state.keys() == ref_state.keys()
        for i, st in ref_state.items():
            assert_close(state[i]["momentum_buffer"], st["momentum_buffer"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", list(ROUND_TRIPS))
def test_a_plain_optimizer_round_trip_resumes_from_its_parameters(misc, kind: str) -> None:
    """ZeRO's state into a plain AdamW, which steps the parameters and keeps the masters as
    loaded, and back: each master loaded rounds to its parameter (a stale one is not taken;
    with gather_dtype the fp32 parameter the plain AdamW left is the master), and the next step lands where the plain AdamW's own next step does, within a
    bf16 rounding of the result (the plain AdamW over bf16 parameters computes in bf16)."""
    for rank, got in enumerate(per_rank(misc, f"round_trip-{kind}")):
        for master, (name, p) in zip(got["masters"], got["loaded"].items()):
            assert torch.equal(master.to(p.dtype), p), f"rank {rank}: {name}'s master is stale"
        for name, want in got["plain"].items():
            tol = bf16_ulp(want) + (0.02 * HPARAMS["adamw"]["lr"] if kind == "bf16" else 0.0)
            diff = (got["zero"][name].float() - want.float()).abs()
            assert (diff <= tol).all(), f"rank {rank} {name}: {diff.max():.3g} from the plain AdamW's step"


def test_a_bf16_state_dict_with_a_parameter_never_stepped_loads_into_plain_adamw(misc) -> None:
    """bf16 parameters, an expert not routed yet: ZeRO's ``state_dict()`` has a state for the
    parameters torch.optim.AdamW has one for (its keys and ``fastreduce_master``), none for
    the expert, so a plain AdamW loads it and steps on through the expert's first gradients
    to the step counts of an AdamW that ran from the start."""
    for rank, got in enumerate(per_rank(misc, "unstepped_export")):
        assert got["keys"] == {i: sorted([*k, "fastreduce_master"]) for i, k in got["ref_keys"].items()}, rank
        assert got["steps"] == got["ref_steps"], rank


def test_param_groups_with_different_state_keys_save_load_and_copy_as_torch_adam(misc) -> None:
    """Adam with amsgrad in one param group only: ZeroOptimizer steps as torch.optim.Adam
    (1e-6), its ``state_dict()`` has torch's keys per parameter (``max_exp_avg_sq`` in the
    amsgrad group alone) and values (1e-6); torch's state loaded (also into a ZeroOptimizer
    built without amsgrad, which then steps as torch's), the DCP round trip and a reshard
    give back that state bit for bit, and every copy (``redundant=True``) equals its shard."""
    for rank, got in enumerate(per_rank(misc, "group_keys")):
        assert_runs_close(got["runs"], got["refs"], f"rank {rank}", rtol=0, atol=1e-6)
        want, state = got["want"]["state"], got["state"]["state"]
        assert {i: sorted(st) for i, st in state.items()} == {i: sorted(st) for i, st in want.items()}, rank
        for i, st in want.items():
            for k, v in st.items():
                assert_close(state[i][k], v, rtol=0, atol=1e-6, msg=lambda m, i=i, k=k: f"rank {rank} [{i}][{k}]: {m}")
        assert_state_dicts_equal(got["loaded"], got["want"], f"rank {rank} loaded")
        assert_state_dicts_equal(got["unlike"], got["want"], f"rank {rank} loaded into one without amsgrad")
        assert_params_close(got["unlike_step"], got["ref_step"], f"rank {rank} the step after", rtol=0, atol=1e-6)
        assert_state_dicts_equal(got["dcp"], got["state"], f"rank {rank} dcp")
        assert_state_dicts_equal(got["resharded"], got["state"], f"rank {rank} resharded")
        assert all(got[f"{k}_copies"] for k in ("loaded", "unlike", "dcp", "resharded")), rank


def test_a_momentum_a_scheduler_sets_after_construction_is_kept_in_the_state_as_torch_sgd_keeps_it(misc) -> None:
    """SGD built without momentum, ``OneCycleLR`` cycling it: the momentum buffers are in
    ``state_dict()`` as in torch's (keys per parameter, values 1e-6) and in a reshard, and the
    state resumed steps on as torch's that never stopped (1e-6). Before, the state keys were
    those of the hyperparameters at construction: the buffers were left out, and the resumed
    run was 4.8e-2 off."""
    for rank, got in enumerate(per_rank(misc, "momentum_later")):
        want, state = got["want"]["state"], got["state"]["state"]
        assert {i: sorted(st) for i, st in state.items()} == {i: sorted(st) for i, st in want.items()}, rank
        for i, st in want.items():
            assert_close(state[i]["momentum_buffer"], st["momentum_buffer"], rtol=0, atol=1e-6)
            assert torch.equal(got["resharded"]["state"][i]["momentum_buffer"], state[i]["momentum_buffer"]), (rank, i)
        assert_params_close(got["resumed"], got["ref"], f"rank {rank} resumed", rtol=0, atol=1e-6)


def test_a_parameter_of_no_elements_goes_through_a_sharded_checkpoint(misc) -> None:
    """DCP's save and load of ``sharded_state_dict()`` with a parameter of 0 elements: the
    state loaded equals the state saved. Before, no rank wrote that parameter's ranges and
    every rank's load raised that the checkpoint lacked them."""
    for rank, got in enumerate(per_rank(misc, "empty_param_dcp")):
        assert_state_dicts_equal(got["loaded"], got["state"], f"rank {rank}")


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
def test_a_second_step_on_one_backward_is_refused_and_one_after_zero_grad_steps_zeros(misc, overlap) -> None:
    """torch.optim steps the same gradients twice; ZeroOptimizer's first step spent them
    (its reduce-scatter left each rank its own shard's mean), so a second step, or a clip,
    with no backward in between raises on every rank, changing nothing, as does a backward
    accumulated onto them (no zero_grad() between). Before, it reduce-scattered the spent
    buffer again and stepped that (5e-2 off torch's second step; 2e-2 accumulated)."""
    for rank, got in enumerate(per_rank(misc, f"stepped_twice-{overlap}")):
        for what in ("step", "clip", "accumulated"):
            want = "accumulated onto the last step's" if what == "accumulated" else "no backward since the last step"
            assert want in got.get(what, ""), (rank, what, got.get(what))
            assert got[f"{what}_unchanged"], (rank, what)
        assert_params_close(got["zero"], got["ref"], f"rank {rank} a step on zeroed gradients", rtol=0, atol=1e-6)


def test_api_surface(misc) -> None:
    for out in per_rank(misc, "api"):
        assert out["is_optimizer"]
        assert out["groups"] == 2
        assert out["same_params"] == [True, True]  # param_groups hold the model's own parameters
        assert out["lrs"] == [1e-2, 1e-3]
        assert out["weight_decays"] == [0.1, 0.1]
        assert out["betas"] == [(0.9, 0.999)] * 2
        assert {"lr", "betas", "eps", "weight_decay", "params"} <= set(out["default_group_keys"])
        assert out["default_weight_decay"] == 0.01  # AdamW's own default
        assert out["default_same_params"]
        assert out["generated_groups"] == out["generated_want"]  # a group's generator read once, all of it
        assert all(out["generated_stepped"]), out["generated_stepped"]
        # state_dict(): int index in param_groups order, each group's index list
        assert out["sd_group_params"] == [list(range(5)), [5, 6]]
        assert out["sd_group_lrs"] == [1e-2, 1e-3]
        assert out["sd_shapes"] == out["want_shapes"]


# ============================================================== world 1

SOLO_CASES = tuple(f"{opt}-{ov}-{clip}" for opt in OPT_CLASSES for ov in ("overlap", "no_overlap")
                   for clip in ("noclip", "clip"))


def solo_case(rank: int, world: int, name: str) -> dict:
    opt_name, overlap, clip = name.split("-")
    model = odd_model(SEED)
    ref = copy.deepcopy(model)
    opt = zero_opt(model.parameters(), opt_name, overlap=overlap == "overlap", bucket_mb=SMALL_BUCKET_MB)
    plain = OPT_CLASSES[opt_name](ref.parameters(), **HPARAMS[opt_name])
    zero, refs = [], []
    for step in range(STEPS):
        loss_fn(model, batch_for(model, rank, step)).backward()
        if clip == "clip":
            opt.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
        zero.append(params_of(model))
    for step in range(STEPS):
        loss_fn(ref, batch_for(ref, rank, step)).backward()
        if clip == "clip":
            torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        plain.step()
        plain.zero_grad()
        refs.append(params_of(ref))
    return {"zero": zero, "ref": refs, "groups": [{k: v for k, v in g.items() if k != "params"}
                                                  for g in opt.param_groups]}


def solo_worker(rank: int, world: int) -> dict:
    return {name: guarded(solo_case, rank, world, name) for name in SOLO_CASES}


@pytest.fixture(scope="module")
def solo() -> dict:
    (out,) = spawn(solo_worker, 1)
    return out


@pytest.mark.parametrize("name", SOLO_CASES)
def test_world_of_one_is_the_plain_optimizer(solo, name) -> None:
    out = unwrap(solo[name])
    if name.endswith("-noclip"):
        # Nothing to average: every element sees the very same arithmetic as the plain
        # optimizer built with the same arguments (torch's default implementation).
        for step, (z, r) in enumerate(zip(out["zero"], out["ref"])):
            for n in r:
                assert torch.equal(z[n], r[n]), (f"step {step} {n}: max diff {(z[n] - r[n]).abs().max():.3g}; "
                                                 f"ZeroOptimizer's param group: {out['groups'][0]}")
    else:
        # The clipping norm may sum its squares in another order: a few ulps.
        assert_runs_close(out["zero"], out["ref"], name)


# ============================================================== errors (world 2, parent)

def construction_error(make_params: Callable[[nn.Module], Any], exc: type, **kwargs: Any) -> Callable:
    """A construction that must fail: grads exist beforehand and must survive untouched,
    and no hook may be left behind."""

    def case(rank: int, world: int) -> dict:
        model = odd_model(SEED)
        loss_fn(model, batch_for(model, rank, 0)).backward()
        snap, hooks = snapshot(model), hook_counts(model)
        res = expect_raises(exc, lambda: fastreduce.ZeroOptimizer(make_params(model), **kwargs))
        return res | {"changed": changed_since(snap, model), "hooks_left": hook_counts(model) != hooks}

    return case


def _meta_mixed(model: nn.Module) -> list:
    return list(model.parameters()) + [nn.Parameter(torch.empty(3, 4, device="meta"))]


def _own_params(model: nn.Module) -> Any:
    return model.parameters()


def _listed_twice(model: nn.Module) -> list:
    """Tied weights listed once per module: ``list(encoder.parameters()) + list(decoder.parameters())``."""
    params = list(model.parameters())
    return params + params[:1]


def listed_twice_case(rank: int, world: int) -> dict:
    return construction_error(_listed_twice, ValueError)(rank, world)


def meta_mixed_case(rank: int, world: int) -> dict:
    return construction_error(_meta_mixed, ValueError)(rank, world)


def lbfgs_case(rank: int, world: int) -> dict:
    return construction_error(_own_params, ValueError, optimizer_class=torch.optim.LBFGS)(rank, world)


def failing_run(rank: int, world: int, model: nn.Module, exc: type, grads_first: bool = True,
                **kwargs: Any) -> dict:
    """Grads from a first backward (``grads_first``), then construct + (if that succeeds)
    backward + step. An error at construction must leave params and grads as they were; a
    later one (the grads were legitimately recomputed) must still leave the params untouched."""
    if grads_first:
        loss_of(model, batch_for(model, rank, 0)).backward()
    snap, hooks = snapshot(model), hook_counts(model)
    where = ["construct"]

    def run() -> None:
        opt = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, **kwargs)
        where[0] = "backward"
        opt.zero_grad()
        loss_of(model, batch_for(model, rank, 1)).backward()
        where[0] = "step"
        opt.step()
        where[0] = "no error"

    res = expect_raises(exc, run)
    at_construct = where[0] == "construct"
    return res | {"where": where[0], "changed": changed_since(snap, model, grads=at_construct),
                  "hooks_left": at_construct and hook_counts(model) != hooks}


def layout_case(rank: int, world: int) -> dict:
    torch.manual_seed(SEED)
    return failing_run(rank, world, ShapeModel(hidden=16 if rank == 0 else 12), fastreduce.LayoutMismatchError)


def sparse_case(rank: int, world: int, overlap: bool, grads_first: bool = True) -> dict:
    """``grads_first=False``: the optimizer is built before any grad exists, so the sparse
    grad first shows up in backward (overlap: in its hooks) or at step()."""
    torch.manual_seed(SEED)
    return failing_run(rank, world, SparseEmbeddingModel(), ValueError, grads_first, overlap=overlap)


def bad_state_dict_case(rank: int, world: int, kind: str) -> dict:
    """load_state_dict of a state dict whose shapes do not fit: ValueError, and the
    optimizer's state, the params and the grads are as before."""
    model = odd_model(SEED)
    opt = zero_opt(model.parameters(), bucket_mb=SMALL_BUCKET_MB)
    loss_fn(model, batch_for(model, rank, 0)).backward()
    opt.step()
    opt.zero_grad()
    good = opt.state_dict()
    if kind == "wrong_shape":
        bad = copy.deepcopy(good)
        bad["state"][2]["exp_avg"] = torch.zeros(3, 3)
    else:  # the state dict of another model (different parameter shapes)
        torch.manual_seed(SEED)
        other = ShapeModel(hidden=12)
        plain = torch.optim.AdamW(other.parameters(), **HPARAMS["adamw"])
        loss_of(other, batch_for(other, rank, 0)).backward()
        plain.step()
        bad = plain.state_dict()
    # Grads set by hand, not by a backward: with overlap=True a backward starts reducing
    # them at once, and they are not the test's to read until step().
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    snap = snapshot(model)
    res = expect_raises(ValueError, lambda: opt.load_state_dict(bad))
    after = opt.state_dict()
    state_same = (after["param_groups"] == good["param_groups"] and after["state"].keys() == good["state"].keys()
                  and all(torch.equal(torch.as_tensor(after["state"][i][k]), torch.as_tensor(v))
                          for i, s in good["state"].items() for k, v in s.items()))
    return res | {"changed": changed_since(snap, model), "state_same": state_same}


def replaced_case(rank: int, world: int, how: str, overlap: bool) -> dict:
    """Parameters replaced (``assign``: ``load_state_dict(assign=True)``) or given new storage
    (``moved``: ``p.data = ...``, as ``model.to()`` does) after the optimizer was built: its
    shards would step the flat buffers and the model would never see it. ``step()`` (overlap:
    backward's first bucket) raises, the parameters as they were; an optimizer built again
    takes the old one's state_dict() and steps."""
    model = odd_model(SEED)
    opt = zero_opt(model.parameters(), module=model, overlap=overlap)
    loss_fn(model, batch_for(model, rank, 0)).backward()
    opt.step()
    opt.wait_params()  # (the all-gather into the parameters is done before they are copied)
    opt.zero_grad()
    if how == "assign":
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    else:
        last = list(model.parameters())[-1]
        last.data = last.data.clone()
    snap = snapshot(model)

    def run() -> None:
        loss_fn(model, batch_for(model, rank, 1)).backward()
        opt.step()

    res = expect_raises(RuntimeError, run)
    changed = changed_since(snap, model, grads=False)
    opt.close()  # (its hooks off the parameters)
    again = zero_opt(model.parameters(), module=model, overlap=overlap)
    again.load_state_dict(opt.state_dict())
    again.zero_grad()
    loss_fn(model, batch_for(model, rank, 1)).backward()
    again.step()
    return res | {"changed": changed, "stepped": changed_since(snap, model, grads=False) != []}


ERROR_CASES: dict[str, tuple[Callable[..., dict], tuple, str, list[str]]] = {
    # name: (case, extra args, exception, words its message must contain (case-insensitive))
    "lbfgs": (lbfgs_case, (), "ValueError", ["element-wise"]),
    "meta_and_cpu": (meta_mixed_case, (), "ValueError", []),
    "layout_mismatch": (layout_case, (), "LayoutMismatchError", []),
    "state_dict_wrong_shape": (bad_state_dict_case, ("wrong_shape",), "ValueError", []),
    "state_dict_other_model": (bad_state_dict_case, ("other_model",), "ValueError", []),
    **{f"replaced_{how}-{'overlap' if o else 'no_overlap'}": (replaced_case, (how, o), "RuntimeError",
                                                               ["changed", "ZeroOptimizer again"])
       for how in ("assign", "moved") for o in (False, True)},
    # A parameter listed twice: refused on both ranks (it was a KeyError on rank 0 only,
    # while rank 1 went on into a collective).
    "param_listed_twice": (listed_twice_case, (), "ValueError", ["twice", "param_groups[0][0]"]),
    # Last: an error raised from inside backward (overlap=True) is the likeliest to leave
    # something pending in the group.
    "sparse-no_overlap": (sparse_case, (False,), "ValueError", ["sparse"]),
    "sparse-overlap": (sparse_case, (True,), "ValueError", ["sparse"]),
    "sparse_in_backward-no_overlap": (sparse_case, (False, False), "ValueError", ["sparse"]),
    "sparse_in_backward-overlap": (sparse_case, (True, False), "ValueError", ["sparse"]),
}


def errors_worker(rank: int, world: int) -> dict:
    return {name: guarded(fn, rank, world, *args) for name, (fn, args, _, _) in ERROR_CASES.items()}


@pytest.fixture(scope="module")
def errors() -> list[dict]:
    return spawn(errors_worker, 2, timeout=90.0)


@pytest.mark.parametrize("name", list(ERROR_CASES))
def test_error_raised_on_every_rank_and_nothing_changed(errors, name) -> None:
    _, _, exc, words = ERROR_CASES[name]
    for rank, res in enumerate(per_rank(errors, name)):
        assert res["raised"] == exc, f"rank {rank}: raised {res['raised']}: {res['message']}"
        for word in words:
            assert word.lower() in res["message"].lower(), f"rank {rank}: {word!r} not in {res['message']!r}"
        assert res["changed"] == [], f"rank {rank}: the failed call changed {res['changed']} ({res.get('where')})"
        assert not res.get("hooks_left"), f"rank {rank}: a failed construction left hooks behind"
        if "state_same" in res:
            assert res["state_same"], f"rank {rank}: a failed load_state_dict changed the optimizer state"
        if "stepped" in res:
            assert res["stepped"], f"rank {rank}: the optimizer built again left the parameters as they were"


def test_no_process_group_raises() -> None:
    if dist.is_available() and dist.is_initialized():
        pytest.skip("this process has a default process group")
    model = odd_model(SEED)
    loss_fn(model, batch_for(model, 0, 0)).backward()
    snap, hooks = snapshot(model), hook_counts(model)
    with pytest.raises(RuntimeError, match=r"(?i)process group|init_process_group|initiali[sz]"):
        fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    assert changed_since(snap, model) == []
    assert hook_counts(model) == hooks


# ============================================================== checkpoints
# Data that does not depend on the world size: at every step a fixed global batch of
# GLOBAL_BATCH samples, of which each of N ranks takes an equal slice. The loss is a mean,
# so the averaged grad equals the grad of the whole batch at any N, up to rounding (the
# sums run in a different order at 1, 2 and 3 ranks: bitwise equality across world sizes is
# impossible, hence rtol=1e-5, atol=1e-6). The uninterrupted reference is a plain AdamW on
# one process over the whole global batch.

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 6
SAVE_AT = 3        # steps before the checkpoint
RESUME_STEPS = 5   # steps after it
EXPORT_STEPS = 3   # steps a state_dict()-loaded optimizer continues for


def global_batch(step: int) -> tuple:
    g = torch.Generator().manual_seed(5000 + step)
    return (torch.randn(GLOBAL_BATCH, 7, generator=g),)


def rank_batch(step: int, rank: int, world: int) -> tuple:
    n = GLOBAL_BATCH // world
    return (global_batch(step)[0][rank * n:(rank + 1) * n],)


def zero_steps(model: nn.Module, opt: Any, rank: int, world: int, steps: range) -> list[dict]:
    out = []
    for step in steps:
        loss_fn(model, rank_batch(step, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        out.append(params_of(model))
    return out


def plain_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[dict]:
    out = []
    for step in steps:
        loss_fn(model, global_batch(step)).backward()
        opt.step()
        opt.zero_grad()
        out.append(params_of(model))
    return out


def plain_reference() -> dict:
    """Uninterrupted single-process run, with its params and state_dict after SAVE_AT steps."""
    model = odd_model(SEED)
    opt = torch.optim.AdamW(model.parameters(), **HPARAMS["adamw"])
    params = plain_steps(model, opt, range(SAVE_AT))
    sd = copy.deepcopy(opt.state_dict())
    params += plain_steps(model, opt, range(SAVE_AT, SAVE_AT + RESUME_STEPS))
    return {"params": params, "sd": sd}


def ckpt_model(kind: str, seed: int = SEED) -> nn.Module:
    model = odd_model(seed)
    return model.to(torch.bfloat16) if kind == "bf16" else model


def dcp_save_case(rank: int, world: int, d: str, kind: str) -> dict:
    """SAVE_AT steps at this world size, then the optimizer through torch.distributed.checkpoint
    into ``d/dcp-<kind>`` and the model (rank 0) into ``d/model-<kind>.pt``."""
    import torch.distributed.checkpoint as dcp

    model = ckpt_model(kind)
    opt = zero_opt(model.parameters(), bucket_mb=SMALL_BUCKET_MB)
    params = zero_steps(model, opt, rank, world, range(SAVE_AT))
    dcp.save(opt.sharded_state_dict(), checkpoint_id=f"{d}/dcp-{kind}")
    if rank == 0:
        torch.save(model.state_dict(), f"{d}/model-{kind}.pt")
    exported = copy.deepcopy(opt.state_dict())  # collective; the torch.optim format
    return {"params": params, "sd": exported}


def load_plain_case(rank: int, world: int, model_params: dict, sd: dict, start: int, steps: int) -> dict:
    """A torch.optim-format state dict (a plain AdamW's, or another world size's export)
    loaded into a fresh ZeroOptimizer (other buckets than the saving run's) over a model
    holding the matching parameters."""
    # Tensors passed to run_ranks live in shared memory, seen by every rank (and the
    # parent): load a private copy, since torch.optim's load_state_dict may keep the
    # given tensors (e.g. "step") and update them in place.
    sd = copy.deepcopy(sd)
    model = odd_model(SEED + 1)
    model.load_state_dict(model_params)
    opt = zero_opt(model.parameters())
    opt.load_state_dict(sd)
    after_load = copy.deepcopy(opt.state_dict())
    return {"params": zero_steps(model, opt, rank, world, range(start, start + steps)), "sd_after_load": after_load}


def fresh_checkpoint_case(rank: int, world: int, d: str, opt_name: str) -> dict:
    """A checkpoint of a new optimizer (saved before its first step, as a job may do at
    step 0): the save changes nothing, and a resume from it trains as a new optimizer.
    The save makes the shard's state by a step at lr=0; AdamW would count it (its first
    update 0.74x as large) and Rprop start its step sizes at 0, unless it is dropped."""
    import torch.distributed.checkpoint as dcp

    path = f"{d}/fresh-{opt_name}"
    ref_model = odd_model(SEED)
    want = zero_steps(ref_model, zero_opt(ref_model.parameters(), opt_name, bucket_mb=SMALL_BUCKET_MB), rank,
                      world, range(3))
    model = odd_model(SEED)
    opt = zero_opt(model.parameters(), opt_name, bucket_mb=SMALL_BUCKET_MB)
    dcp.save(opt.sharded_state_dict(), checkpoint_id=path)
    exported = copy.deepcopy(opt.state_dict())  # the torch.optim format: no state yet
    saved_then = zero_steps(model, opt, rank, world, range(3))
    model.load_state_dict(odd_model(SEED).state_dict())  # back to the start, from the checkpoint
    sd = opt.sharded_state_dict()
    dcp.load(sd, checkpoint_id=path)
    opt.load_sharded_state_dict(sd)
    resumed = zero_steps(model, opt, rank, world, range(3))
    return {"want": want, "saved_then": saved_then, "resumed": resumed, "exported_state": exported["state"]}


def ckpt_save_worker(rank: int, world: int, d: str, ref: dict) -> dict:
    return {**{f"fresh-{o}": guarded(fresh_checkpoint_case, rank, world, d, o) for o in ("adamw", "rprop")},
            "dcp_save": guarded(dcp_save_case, rank, world, d, "fp32"),
            "dcp_save-bf16": guarded(dcp_save_case, rank, world, d, "bf16"),
            "from_plain": guarded(load_plain_case, rank, world, ref["params"][SAVE_AT - 1], ref["sd"],
                                  SAVE_AT, EXPORT_STEPS)}


def dcp_load_case(rank: int, world: int, d: str, kind: str, model_first: bool) -> dict:
    """A fresh model and ZeroOptimizer (other initial values, other buckets than the saving
    run) resumed from ``dcp_save_case``'s files; ``model_first``: the model's parameters
    are loaded before the optimizer is built, else after."""
    import torch.distributed.checkpoint as dcp

    model = ckpt_model(kind, SEED + 1)  # other initial values: everything must come from the checkpoint
    if model_first:
        model.load_state_dict(torch.load(f"{d}/model-{kind}.pt"))
    opt = zero_opt(model.parameters())
    if not model_first:
        model.load_state_dict(torch.load(f"{d}/model-{kind}.pt"))
    sd = opt.sharded_state_dict()
    dcp.load(sd, checkpoint_id=f"{d}/dcp-{kind}")
    opt.load_sharded_state_dict(sd)
    after_load = copy.deepcopy(opt.state_dict())
    steps = RESUME_STEPS if kind == "fp32" else 1
    return {"params": zero_steps(model, opt, rank, world, range(SAVE_AT, SAVE_AT + steps)), "sd_after_load": after_load}


def export_case(rank: int, world: int) -> dict:
    model = odd_model(SEED)
    opt = zero_opt(model.parameters(), bucket_mb=SMALL_BUCKET_MB)
    params = zero_steps(model, opt, rank, world, range(SAVE_AT))
    sd = copy.deepcopy(opt.state_dict())
    params += zero_steps(model, opt, rank, world, range(SAVE_AT, SAVE_AT + EXPORT_STEPS))
    return {"params": params, "sd": sd}


DCP_LOADS = {"dcp_load": ("fp32", True), "dcp_load-model_after": ("fp32", False), "dcp_load-bf16": ("bf16", True)}


def ckpt_load_worker(rank: int, world: int, d: str, saved3: dict | None) -> dict:
    out = {name: guarded(dcp_load_case, rank, world, d, kind, first) for name, (kind, first) in DCP_LOADS.items()}
    out["export"] = guarded(export_case, rank, world)
    if saved3 is not None:
        out["from_world3"] = guarded(load_plain_case, rank, world, saved3["params"][SAVE_AT - 1], saved3["sd"],
                                     SAVE_AT, RESUME_STEPS)
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> dict:
    d = str(tmp_path_factory.mktemp("zero_ckpt"))
    ref = plain_reference()
    saved = spawn(ckpt_save_worker, 3, d, ref)
    saved3 = saved[0]["dcp_save"].get("ok")
    loaded = spawn(ckpt_load_worker, 2, d, saved3)
    return {"ref": ref, "saved": saved, "loaded": loaded}


@pytest.mark.parametrize("opt_name", ["adamw", "rprop"])
def test_checkpoint_before_the_first_step_changes_nothing(ckpt, opt_name: str) -> None:
    for rank, out in enumerate(per_rank(ckpt["saved"], f"fresh-{opt_name}")):
        assert out["exported_state"] == {}, f"rank {rank}: a new optimizer exported state"
        for what in ("saved_then", "resumed"):
            for step, (got, want) in enumerate(zip(out[what], out["want"])):
                for name in want:
                    assert torch.equal(got[name], want[name]), f"rank {rank} {what} step {step}: {name} differs"


def assert_state_dicts_equal(got: dict, want: dict, where: str) -> None:
    """Same per-parameter state, bitwise (moving state between shards rounds nothing), and
    the same hyperparameters."""
    assert sorted(got["state"]) == sorted(want["state"]), f"{where}: {sorted(got['state'])}"
    for i, w in want["state"].items():
        g = got["state"][i]
        assert set(g) == set(w), f"{where}: state[{i}] keys {sorted(g)} != {sorted(w)}"
        for k, v in w.items():
            if torch.is_tensor(v) and v.dim() > 0:
                assert g[k].dtype == v.dtype and torch.equal(g[k], v), f"{where}: state[{i}][{k!r}] differs"
            else:
                assert float(g[k]) == float(v), f"{where}: state[{i}][{k!r}]: {g[k]} != {v}"
    assert [gr["params"] for gr in got["param_groups"]] == [gr["params"] for gr in want["param_groups"]], where
    for gr, w in zip(got["param_groups"], want["param_groups"]):
        for k in ("lr", "betas", "eps", "weight_decay"):
            assert gr[k] == w[k], f"{where}: param group {k}: {gr[k]} != {w[k]}"


@pytest.mark.parametrize("name", list(DCP_LOADS))
def test_dcp_roundtrip_from_3_to_2_ranks_keeps_the_state(ckpt, name) -> None:
    """opt.state_dict() right after the 2-rank load equals the 3-rank run's at the save
    (with bf16 parameters, whatever fp32 master weights it reports included)."""
    kind, _ = DCP_LOADS[name]
    want = per_rank(ckpt["saved"], "dcp_save" if kind == "fp32" else "dcp_save-bf16")[0]["sd"]
    for rank, out in enumerate(per_rank(ckpt["loaded"], name)):
        assert_state_dicts_equal(out["sd_after_load"], want, f"rank {rank}")


def test_dcp_bf16_resume_continues_like_the_saving_run(ckpt) -> None:
    """bf16 parameters: after the resume (2 ranks) one step lands within bf16 rounding of
    where the uninterrupted single-process reference with fp32 masters lands."""
    saved = per_rank(ckpt["saved"], "dcp_save-bf16")
    outs = per_rank(ckpt["loaded"], "dcp_load-bf16")
    assert_identical_on_ranks([o["params"] for o in outs], "bf16 resumed")
    for rank, out in enumerate(outs):
        for name, p in out["params"][0].items():
            assert p.dtype == torch.bfloat16
            before = saved[0]["params"][SAVE_AT - 1][name].float()
            # one AdamW step of lr=1e-2 moves an element by at most ~lr (plus a bf16 rounding)
            assert_close(p.float(), before, rtol=2**-7, atol=2e-2, msg=lambda m, name=name: f"rank {rank} {name}: {m}")


@pytest.mark.parametrize("name", ["from_plain", "from_world3"])
def test_state_dict_load_roundtrip(ckpt, name) -> None:
    """What load_state_dict took is what state_dict() gives back, at another world size
    and bucket layout."""
    if name == "from_plain":
        results, want = ckpt["saved"], ckpt["ref"]["sd"]
    else:
        if "from_world3" not in ckpt["loaded"][0]:
            pytest.fail("the 3-rank run did not produce a state dict (see test_state_dict_is_torch_optim_format)")
        results, want = ckpt["loaded"], per_rank(ckpt["saved"], "dcp_save")[0]["sd"]
    for rank, out in enumerate(per_rank(results, name)):
        assert_state_dicts_equal(out["sd_after_load"], want, f"rank {rank}")


def test_world_independent_data_gives_the_same_run_at_3_ranks(ckpt) -> None:
    """The premise of the checkpoint tests: 3 ranks on slices == 1 process on the batch."""
    want = ckpt["ref"]["params"][:SAVE_AT]
    for rank, out in enumerate(per_rank(ckpt["saved"], "dcp_save")):
        assert_runs_close(out["params"], want, f"rank {rank}")


@pytest.mark.parametrize("name", ["dcp_load", "dcp_load-model_after"])
@pytest.mark.cell("loop", "reshard", modes=("zero",))
def test_dcp_checkpoint_saved_at_3_ranks_resumes_at_2(ckpt, name) -> None:
    want = ckpt["ref"]["params"][SAVE_AT:]
    outs = per_rank(ckpt["loaded"], name)
    for rank, out in enumerate(outs):
        assert_runs_close(out["params"], want, f"rank {rank}", first_step=SAVE_AT)
    assert_identical_on_ranks([o["params"] for o in outs], "resumed")


def assert_torch_optim_format(sd: dict, like: dict, where: str) -> None:
    """torch.optim's own per-parameter format, with the values of ``like`` (a plain
    AdamW's state dict at the same point of the same run)."""
    assert set(sd) == {"state", "param_groups"}, f"{where}: keys {sorted(sd)}"
    assert sorted(sd["state"]) == sorted(like["state"]) == list(range(7)), f"{where}: {sorted(sd['state'])}"
    assert [g["params"] for g in sd["param_groups"]] == [g["params"] for g in like["param_groups"]], where
    for g, w in zip(sd["param_groups"], like["param_groups"]):
        for k in ("lr", "weight_decay", "betas", "eps"):
            assert g[k] == w[k], f"{where}: param group {k}: {g[k]} != {w[k]}"
    for i, s in like["state"].items():
        assert set(sd["state"][i]) >= {"step", "exp_avg", "exp_avg_sq"}, f"{where}: state[{i}] {sorted(sd['state'][i])}"
        assert float(sd["state"][i]["step"]) == float(s["step"]), f"{where}: state[{i}]['step']"
        for k in ("exp_avg", "exp_avg_sq"):
            got = sd["state"][i][k]
            assert got.shape == s[k].shape and got.dtype == s[k].dtype, f"{where}: state[{i}][{k!r}] {got.shape}"
            assert_close(got, s[k], rtol=1e-5, atol=1e-7, msg=lambda m, i=i, k=k: f"{where}: state[{i}][{k!r}]: {m}")


def test_state_dict_is_torch_optim_format(ckpt) -> None:
    like = ckpt["ref"]["sd"]
    for world, results, key in ((3, ckpt["saved"], "dcp_save"), (2, ckpt["loaded"], "export")):
        outs = per_rank(results, key)
        for rank, out in enumerate(outs):
            assert_torch_optim_format(out["sd"], like, f"world {world} rank {rank}")


def test_state_dict_at_2_ranks_loads_into_plain_adamw(ckpt) -> None:
    """The 2-rank export loaded into a plain AdamW (this process, no group) continues as
    the ZeroOptimizer itself did."""
    out = per_rank(ckpt["loaded"], "export")[0]
    model = odd_model(SEED + 1)
    model.load_state_dict(out["params"][SAVE_AT - 1])
    opt = torch.optim.AdamW(model.parameters(), **HPARAMS["adamw"])
    opt.load_state_dict(copy.deepcopy(out["sd"]))  # torch.optim may keep (and step) the given tensors
    got = plain_steps(model, opt, range(SAVE_AT, SAVE_AT + EXPORT_STEPS))
    assert_runs_close(got, out["params"][SAVE_AT:], "plain AdamW vs ZeroOptimizer", first_step=SAVE_AT)


def test_plain_adamw_state_dict_loads_at_3_ranks(ckpt) -> None:
    want = ckpt["ref"]["params"][SAVE_AT:SAVE_AT + EXPORT_STEPS]
    for rank, out in enumerate(per_rank(ckpt["saved"], "from_plain")):
        assert_runs_close(out["params"], want, f"rank {rank}", first_step=SAVE_AT)


def test_state_dict_from_3_ranks_loads_at_2(ckpt) -> None:
    if "from_world3" not in ckpt["loaded"][0]:
        pytest.fail("the 3-rank run did not produce a state dict (see test_state_dict_is_torch_optim_format)")
    want = ckpt["ref"]["params"][SAVE_AT:]
    for rank, out in enumerate(per_rank(ckpt["loaded"], "from_world3")):
        assert_runs_close(out["params"], want, f"rank {rank}", first_step=SAVE_AT)


# ============================================================== gradients as persistent views (module=)

VIEW_STEPS = 4
VIEW_BUCKETS = {"auto": None, "buckets": 0.002}  # one bucket on shared memory | ~3 of this model's 14 KB


class BlocksWithHead(nn.Module):
    """3 x (Linear 32 + LayerNorm) and a head its forward never reads (an unused parameter)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.body = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(32, 32), nn.LayerNorm(32))])
        self.unused = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def view_batch(step: int, micro: int, rank: int) -> torch.Tensor:
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(1000 * step + 10 * micro + rank))


def views_case(rank: int, world: int, set_to_none: bool, bucket_mb: float | None, group: Any) -> dict:
    """ZeRO with ``module=`` zeroed by ``zero_grad(set_to_none=...)``, two micro-batches a step
    (the first under ``no_sync()``), against AdamW (the shard's kernel) on the ``dist.all_reduce``
    mean of a twin's gradients; what ``param.grad`` is at each point of the step."""
    from fastreduce.optim_kernels import fused_if_possible
    model = BlocksWithHead()
    twin = copy.deepcopy(model)
    opt = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                                   module=model, bucket_mb=bucket_mb)
    views = dict(zip(map(id, opt.layout.params), opt.buffer.views))
    used = [p for n, p in model.named_parameters() if not n.startswith("unused")]
    seen: dict[str, list[bool]] = {k: [] for k in ("none_after_zero_grad", "none_after_eval", "views_after_forward",
                                                   "views_after_backward", "unused_none", "zeroed_views")}
    for step in range(VIEW_STEPS):
        with opt.no_sync():
            model(view_batch(step, 0, rank)).square().mean().backward()
        seen["unused_none"].append(model.unused.weight.grad is None and model.unused.bias.grad is None)
        out = model(view_batch(step, 1, rank))
        seen["views_after_forward"].append(all(p.grad is views[id(p)] for p in used))
        out.square().mean().backward()
        seen["views_after_backward"].append(all(p.grad is views[id(p)] for p in used))
        seen["unused_none"].append(model.unused.weight.grad is None and model.unused.bias.grad is None)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        if set_to_none:
            seen["none_after_zero_grad"].append(all(p.grad is None for p in model.parameters()))
            with torch.no_grad():  # an evaluation: no backward follows, the grads stay None
                model(view_batch(step, 2, rank))
            seen["none_after_eval"].append(all(p.grad is None for p in model.parameters()))
        else:
            seen["zeroed_views"].append(all(p.grad is views[id(p)] and not p.grad.any() for p in used))
    opt.wait_params()
    ref_used = [p for n, p in twin.named_parameters() if not n.startswith("unused")]
    ref = torch.optim.AdamW(ref_used, lr=1e-2, weight_decay=0.1,
                            **fused_if_possible(torch.optim.AdamW, ref_used, {}))
    for step in range(VIEW_STEPS):
        for micro in (0, 1):
            twin(view_batch(step, micro, rank)).square().mean().backward()
        for p in ref_used:
            dist.all_reduce(p.grad, group=group)
            p.grad /= world
        ref.step()
        ref.zero_grad(set_to_none=set_to_none)
    equal = [n for (n, p), q in zip(model.named_parameters(), twin.parameters())
             if not n.startswith("unused") and not torch.equal(p, q)]
    return {"seen": seen, "differ": equal, "preattached": opt.grad_stats.preattached,
            "buckets": opt.num_buckets, "shm": bool(opt.comm.shms)}


def views_worker(rank: int, world: int) -> dict:
    group = dist.new_group(backend="gloo")
    return {f"{'none' if none else 'in_place'}-{name}": guarded(views_case, rank, world, none, mb, group)
            for none in (True, False) for name, mb in VIEW_BUCKETS.items()}


@pytest.fixture(scope="module")
def views() -> list[dict]:
    return spawn(views_worker, 2)


@pytest.mark.parametrize("bucket", list(VIEW_BUCKETS))
@pytest.mark.parametrize("zeroing", ["none", "in_place"])
def test_module_keeps_grads_as_views_and_steps_as_adamw(views, zeroing: str, bucket: str) -> None:
    """With ``module=`` backward always accumulates into the flat buffer: after
    ``zero_grad()`` (set_to_none) every ``param.grad`` is ``None`` (an evaluation forward
    under ``no_grad`` leaves it so) until a forward re-attaches it as its zeroed view; an
    unused parameter's is ``None`` after each backward; zeroed in place they stay views.
    Both step bit for bit as AdamW on the ``dist.all_reduce`` mean, ``no_sync()`` included."""
    outs = per_rank(views, f"{zeroing}-{bucket}")
    for rank, out in enumerate(outs):
        seen = out["seen"]
        for key in ("views_after_forward", "views_after_backward", "unused_none"):
            assert seen[key] and all(seen[key]), (rank, key, seen[key])
        if zeroing == "none":
            assert all(seen["none_after_zero_grad"]) and all(seen["none_after_eval"]), (rank, seen)
            assert out["preattached"] > 0, out
        else:
            assert all(seen["zeroed_views"]), (rank, seen)
        assert out["differ"] == [], f"rank {rank}: {out['differ']} differ from AdamW's"
        if bucket == "buckets":
            assert out["buckets"] >= 2, out
        elif out["shm"]:
            assert out["buckets"] == 1, out


@pytest.mark.parametrize("hosts, ranks, copies", [(1, 4, 1), (1, 5, 3), (8, 2, 2), (8, 2, 1), (3, 3, 2), (4, 2, 5)])
def test_copies_go_to_other_hosts_first(hosts: int, ranks: int, copies: int) -> None:
    """:class:`~fastreduce.modes.zero_mirror.Placement` (no process): each rank holds ``copies``
    copies (at most every other rank's shard) and each shard has that many, its holders
    distinct; on one host the j-th copy of rank d's shard is rank d + j's; over hosts of
    ``ranks`` ranks each (a host's ranks numbered together, as launchers number them, or taken
    in turn), a shard and its copies sit on as many hosts as there are holders, so no shard is
    lost with a whole host, nor with any ``copies`` ranks lost at once (every choice tried)."""
    from itertools import combinations

    from fastreduce.modes.zero_mirror import Placement

    world = hosts * ranks
    k = min(copies, world - 1)
    for names in ([f"h{r // ranks}" for r in range(world)], [f"h{r % hosts}" for r in range(world)]):
        pl = Placement(names, copies)
        holders = {d: [d] + [pl.holder(d, j) for j in range(1, k + 1)] for d in range(world)}
        assert pl.copies == k and all(len(set(h)) == k + 1 for h in holders.values())
        for r in range(world):  # held() is holder()'s inverse
            assert sum(pl.holder(d, j) == r for d in range(world) for j in range(1, k + 1)) == k
            assert len(pl.held(r)) == k and all(pl.holder(d, j) == r for j, d in enumerate(pl.held(r), 1))
        if hosts == 1:
            assert all(pl.holder(d, j) == (d + j) % world for d in range(world) for j in range(1, k + 1))
        else:
            assert all(len({names[r] for r in h}) == min(k + 1, hosts) for h in holders.values()), holders
            for host in set(names):  # a whole host lost at once
                gone = {r for r in range(world) if names[r] == host}
                assert all(set(h) - gone for h in holders.values()), (host, holders)
        for gone in combinations(range(world), k):  # any k ranks lost at once
            assert all(set(h) - set(gone) for h in holders.values()), gone


def _spread(ring: list[str], k: int) -> tuple[int, bool]:
    """A cyclic order's hosts ``ring`` (the j-th copy of a shard on the j-th rank after its
    owner's): how many of every shard's copies, the first ones, sit on hosts other than its
    owner's and each other's (the fewest over the shards), and whether every shard keeps a
    holder off its owner's host (a whole host lost at once loses none)."""
    n, fewest, kept = len(ring), k, True
    for p in range(n):
        seen = [ring[p]]
        for j in range(1, k + 1):
            if ring[(p + j) % n] in seen:
                fewest = min(fewest, j - 1)
                break
            seen.append(ring[(p + j) % n])
        kept = kept and any(ring[(p + j) % n] != ring[p] for j in range(1, k + 1))
    return fewest, kept


def test_copies_are_spread_over_uneven_hosts_as_well_as_any_placement_can() -> None:
    """:class:`~fastreduce.modes.zero_mirror.Placement` over every layout of up to 7 ranks on
    hosts of any sizes (as a job's hosts become after losses: 2+2+2 then 2+1+1), the ranks
    numbered host by host (the smallest host first) or taken in turn, and every count of
    copies: as many of each shard's copies on other hosts than its owner's and each other's,
    and a holder of every shard off its owner's host wherever any cyclic order has them
    (every one tried). That is, as docs/zero.md says: every copy on hosts apart wherever no
    host holds more than n/(k + 1) of the n ranks, the first copy on another host wherever
    none holds more than half, a holder off the owner's host wherever none holds more than
    k/(k + 1). ([A, A, B, C] with one copy put rank 1's on rank 0, on its host, before.)"""
    from itertools import permutations

    from fastreduce.modes.zero_mirror import Placement

    def sizes(n: int, most: int) -> Any:  # every way to split n ranks into hosts, the largest first
        if n == 0:
            yield []
        for c in range(min(n, most), 0, -1):
            for rest in sizes(n - c, c):
                yield [c, *rest]

    for n in range(2, 8):
        for split in sizes(n, n):
            names = [f"h{i}" for i, c in enumerate(split) for _ in range(c)]
            rings = {p for p in permutations(names) if p[0] == "h0"}  # (every cyclic order, turned to start at h0)
            tall = split[0]
            for k in range(1, n):
                spreads = [_spread(list(r), k) for r in rings]
                fewest, kept = max(f for f, _ in spreads), any(h for _, h in spreads)
                assert (fewest == k) == ((k + 1) * tall <= n) and (fewest >= 1) == (2 * tall <= n), (split, k)
                assert kept == (tall <= k * (n - tall)), (split, k)
                for hosts in (names[::-1], [names[i] for i in sorted(range(n), key=lambda i: i % len(split))]):
                    pl = Placement(hosts, k)
                    holders = {d: [d] + [pl.holder(d, j) for j in range(1, k + 1)] for d in range(n)}
                    assert sorted(pl.order) == list(range(n)) and all(len(set(h)) == k + 1 for h in holders.values())
                    assert all(pl.holder(d, j) == r for r in range(n) for j, d in enumerate(pl.held(r), 1))
                    assert _spread([hosts[r] for r in pl.order], k) == (fewest, kept), (hosts, k, pl.order)
