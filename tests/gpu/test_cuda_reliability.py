"""The reliability features with CUDA tensors: two ranks on one GPU over Gloo.

What it shows (each against a reference computed in the same ranks):

* ``nonfinite``: an inf planted in rank 1's gradient of ``2.weight`` at step ``BAD``.
  Fused, overlapped and ZeRO: ``raise`` raises ``NonFiniteGradError`` on every rank with
  parameters and optimizer state bit for bit as before, ``skip`` skips that step on every
  rank; LocalSGD's inner step (a rank-local verdict): only rank 1 raises or skips. Either
  way training then matches plain AdamW/SGD on ``dist.all_reduce``-d gradients (LocalSGD:
  periodic parameter averages) that skipped the step.
* ``Checkpointer`` (fused mode and ZeRO): a load restores the state saved, bit for bit and
  on the device it was saved from; a truncated ``.distcp`` shard of the newest checkpoint
  makes ``load(step)`` raise ``CheckpointDamagedError`` with nothing changed, and
  ``load_latest()`` warn and resume from the checkpoint before it, exactly.
* ``Join``: the fused mode with rank 1 two batches short equals torch DDP under ``Join``.

``FASTREDUCE_GPU_TESTS_DEVICE=cpu`` runs the same file on CPU tensors (to check the test
itself where there is no GPU); otherwise it needs CUDA and is skipped without it.
"""

from __future__ import annotations

import logging
import math
import os
import traceback
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join

import fastreduce
import fastreduce.optim_kernels
from fastreduce.launch import run_ranks
from fastreduce.modes.zero_state import RangeShard

DEVICE = os.environ.get("FASTREDUCE_GPU_TESTS_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (FASTREDUCE_GPU_TESTS_DEVICE=cpu runs it on CPU)")

BAD, STEPS, LR = 2, 5, 1e-2  # rank 1's gradient holds an inf at step BAD (0-based) of STEPS
JOIN_COUNTS = [5, 3]  # batches per rank under Join


def _setup() -> torch.device:
    if DEVICE == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device(DEVICE)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4)).to(torch.device(DEVICE))


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * step + rank))
    return model(x.to(torch.device(DEVICE))).pow(2).mean()


def _backward(model: nn.Module, rank: int, step: int) -> None:
    """Backward; rank 1's ``2.weight`` gradient at step ``BAD`` gets an inf (before any hook sends it)."""
    def spoil(g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        g[0, 0] = math.inf
        return g
    handle = model[2].weight.register_hook(spoil) if (rank, step) == (1, BAD) else None
    _loss(model, rank, step).backward()
    if handle is not None:
        handle.remove()


def _copy(x: Any) -> Any:
    if isinstance(x, RangeShard):  # a ZeRO range: its rank-local part
        return ["range", x.offset, x.local.detach().clone()]
    if torch.is_tensor(x):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_copy(v) for v in x]
    return x


def _identical(a: Any, b: Any) -> bool:
    """Bit for bit, tensors on the same device with the same dtype."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (torch.is_tensor(a) and torch.is_tensor(b) and (a.dtype, a.device) == (b.dtype, b.device)
                and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_identical(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b))
    return a == b


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def _mean_(tensors: Any, group: Any) -> None:
    for t in tensors:
        dist.all_reduce(t, group=group)
        t.div_(dist.get_world_size(group))


def guarded(fn: Callable[..., Any], *args: Any) -> dict:
    try:
        return {"ok": fn(*args)}
    except BaseException:  # noqa: BLE001 - reported to the parent (DCP's CheckpointException is a BaseException)
        return {"error": traceback.format_exc()}


def unwrap(results: list[dict], key: Any) -> list[Any]:
    for rank, r in enumerate(results):
        if "error" in r[key]:
            pytest.fail(f"rank {rank}, case {key}:\n{r[key]['error']}", pytrace=False)
    return [r[key]["ok"] for r in results]


# ====================================================================== non-finite gradients

def case_nonfinite(rank: int, kind: str, mode: str, ref_group: Any) -> dict:
    """``kind``: fused, overlap, zero (every rank decides) or local (LocalSGD's inner step,
    rank 1 alone). The reference: the same steps, the bad one skipped where the mode skips it."""
    model, ref = _model(), _model()
    reducer = None
    if kind == "zero":
        opt = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, module=model,
                                       wire_dtype=torch.float32, bucket_mb=0.002, nonfinite=mode)
        kernel = fastreduce.optim_kernels.fused_if_possible(torch.optim.AdamW, list(ref.parameters()), {})
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, **kernel)  # the kernel ZeRO steps with
    elif kind == "local":
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
        local = fastreduce.LocalSGD(model, opt, sync_every=2, nonfinite=mode)
    else:
        reducer = fastreduce.FusedReducer(model, wire_dtype=torch.float32, overlap=kind == "overlap",
                                          bucket_mb=0.002 if kind == "overlap" else None, nonfinite=mode)
        opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=LR) for m in (model, ref))
    out: dict = {"stepped": [], "error": None}
    for step in range(STEPS):
        _backward(model, rank, step)
        if step == BAD:
            if kind == "zero":
                opt.wait_params()
            before = _copy([_params(model), opt.state_dict()])
        try:
            if reducer is not None:
                ok = reducer.reduce()  # skip: False on every rank
                if ok:
                    opt.step()
            else:
                opt.step()
                ok = not getattr(opt, "last_step_skipped", False)
            out["stepped"].append(ok)
        except fastreduce.NonFiniteGradError as err:
            out["stepped"].append(None)
            out["error"] = (step, str(err))
        if step == BAD:
            if kind == "zero":
                opt.wait_params()
            out["unchanged"] = _identical(before, _copy([_params(model), opt.state_dict()]))
        opt.zero_grad()
        skipped = step == BAD and (kind != "local" or rank == 1)
        ref_opt.zero_grad()
        _loss(ref, rank, step).backward()
        if kind != "local":
            _mean_([p.grad for p in ref.parameters()], ref_group)
        if not skipped:
            ref_opt.step()
        if kind == "local" and (step + 1) % 2 == 0:
            with torch.no_grad():
                _mean_(list(ref.parameters()), ref_group)
    if kind == "zero":
        opt.wait_params()  # the last all-gather
    out["gap"] = _gap(_params(model), _params(ref))
    out["counted"] = opt.skipped_steps if kind == "zero" else local.skipped_steps if kind == "local" \
        else reducer.stats.nonfinite
    out["device"] = str(next(model.parameters()).device)
    return out


NONFINITE = [(k, m) for k in ("fused", "overlap", "zero", "local") for m in ("raise", "skip")]


def nonfinite_worker(rank: int, world: int) -> dict:
    _setup()
    ref_group = dist.new_group(backend="gloo")  # the references' collectives never meet the modes'
    return {c: guarded(case_nonfinite, rank, *c, ref_group) for c in NONFINITE}


@pytest.fixture(scope="module")
def nonfinite() -> list[dict]:
    return run_ranks(nonfinite_worker, 2, timeout=120)


@pytest.mark.parametrize("kind,mode", NONFINITE, ids=["-".join(c) for c in NONFINITE])
def test_nonfinite_gradient_on_device(nonfinite, kind: str, mode: str) -> None:
    outs = unwrap(nonfinite, (kind, mode))
    deciders = [1] if kind == "local" else [0, 1]  # LocalSGD's inner step: rank 1's own verdict
    for rank, out in enumerate(outs):
        assert out["device"].startswith(DEVICE), out
        assert out["gap"] < 1e-6, (rank, out)  # as the reference that skipped the bad step
        decided = rank in deciders
        assert out["unchanged"] is decided, (rank, out)  # parameters and optimizer state
        # counted: the reducer's stats.nonfinite and LocalSGD's skipped_steps count a raise too
        assert out["counted"] == (1 if decided and (mode, kind) != ("raise", "zero") else 0), (rank, out)
        # at BAD: None where it raised, False where reduce() / last_step_skipped said skip
        # (LocalSGD's step() returns as usual when it skips)
        verdict = None if mode == "raise" else kind == "local"
        assert out["stepped"] == [verdict if decided and s == BAD else True for s in range(STEPS)], (rank, out)
        if mode == "raise" and decided:
            assert out["error"][0] == BAD and "'2.weight'" in out["error"][1], (rank, out)
        else:
            assert out["error"] is None, (rank, out)


# ====================================================================== Checkpointer

def _leaves(x: Any) -> Any:
    if torch.is_tensor(x):
        yield x
    elif isinstance(x, (dict, list)):
        for v in x.values() if isinstance(x, dict) else x:
            yield from _leaves(v)


def case_checkpoint(rank: int, kind: str, root: str) -> dict:
    model, d = _model(), f"{root}/{kind}"
    if kind == "zero":
        opt = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, module=model,
                                       wire_dtype=torch.float32, bucket_mb=0.002)
        ckpt = fastreduce.checkpoint.Checkpointer(d, model, opt)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        reducer = fastreduce.FusedReducer(model, wire_dtype=torch.float32)
        ckpt = fastreduce.checkpoint.Checkpointer(d, model, opt, mode=reducer)

    def train(*steps: int) -> None:
        for s in steps:
            _loss(model, rank, s).backward()
            if kind != "zero":
                reducer.reduce()
            opt.step()
            opt.zero_grad()

    def state() -> dict:  # everything a checkpoint holds on this rank, copied
        return _copy(ckpt._state())

    out: dict = {}
    train(0, 1)
    ckpt.save(2)
    at_2 = state()
    train(2, 3)
    ckpt.save(4)
    at_4 = state()
    train(4)
    out["moved"] = not _identical(at_4, state())  # so that the load below has something to undo
    out["load"] = ckpt.load(4)
    after = state()
    out["restored_4"] = _identical(at_4, after)
    out["devices"] = {t.device.type for k, v in after.items() if k == "model" or k.startswith("optimizer")
                      for t in _leaves(v) if t.numel() > 1}  # the model's and optimizer's (step counters aside)
    train(4)
    before = state()
    if rank == 0:  # truncate the largest shard file of the newest checkpoint
        folder = f"{d}/step-00000004"
        name = max((f for f in os.listdir(folder) if f.endswith(".distcp")),
                   key=lambda f: os.path.getsize(os.path.join(folder, f)))
        os.truncate(os.path.join(folder, name), os.path.getsize(os.path.join(folder, name)) // 2)
    dist.barrier()
    try:
        ckpt.load(4)
        out["raised"] = None
    except fastreduce.CheckpointDamagedError as err:
        out["raised"] = str(err)
    out["unchanged"] = _identical(before, state())
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("fastreduce.checkpoint").addHandler(handler)
    try:
        out["latest"] = ckpt.load_latest()
    finally:
        logging.getLogger("fastreduce.checkpoint").removeHandler(handler)
    out["warnings"], out["restored_2"] = warnings, _identical(at_2, state())
    train(2, 3)  # from step 2 again: where the run first was at step 4
    resumed = state()
    out["resumed_gap"] = _gap(list(resumed["model"].values()), list(at_4["model"].values()))
    return out


def checkpoint_worker(rank: int, world: int, root: str) -> dict:
    _setup()
    return {k: guarded(case_checkpoint, rank, k, root) for k in ("fused", "zero")}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(checkpoint_worker, 2, str(tmp_path_factory.mktemp("ckpt")), timeout=120)


@pytest.mark.parametrize("kind", ["fused", "zero"])
def test_checkpoint_on_device(checkpoints, kind: str) -> None:
    for rank, out in enumerate(unwrap(checkpoints, kind)):
        assert out["moved"] and out["load"] == 4, (rank, out)
        assert out["restored_4"], f"rank {rank}: load(4) did not restore the state saved at 4 bit for bit"
        assert out["devices"] == {DEVICE}, (rank, out["devices"])  # still on the device, not moved to CPU
        assert out["raised"] is not None and "is truncated" in out["raised"], (rank, out["raised"])
        assert out["unchanged"], f"rank {rank}: the failed load(4) changed the state"
        assert out["latest"] == 2 and out["restored_2"], (rank, out)
        assert out["resumed_gap"] <= 1e-6, (rank, out["resumed_gap"])  # steps 2, 3 again reach step 4's
        if rank == 0:
            assert any("step-00000004" in w and "trying the checkpoint before it" in w for w in out["warnings"]), \
                out["warnings"]


# ====================================================================== Join

def join_worker(rank: int, world: int) -> dict:
    """Both divisors; parameters returned on the CPU (CUDA tensors would travel by IPC)."""
    _setup()
    out = {}
    for divide in (False, True):
        model, theirs = _model(), _model()
        reducer = fastreduce.FusedReducer(model, wire_dtype=torch.float32)
        ddp = nn.parallel.DistributedDataParallel(theirs, device_ids=[0] if DEVICE == "cuda" else None)
        for joinable, m in ((reducer, model), (ddp, ddp)):
            opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
            with Join([joinable], divide_by_initial_world_size=divide):
                for s in range(JOIN_COUNTS[rank]):
                    _loss(m, rank, s).backward()
                    if joinable is reducer:
                        reducer.reduce()
                    opt.step()
                    opt.zero_grad()
        out[divide] = {"ours": [p.cpu() for p in _params(model)], "ddp": [p.cpu() for p in _params(theirs)],
                       "device": str(next(model.parameters()).device)}
    return out


@pytest.fixture(scope="module")
def joined() -> list[dict]:
    return run_ranks(join_worker, 2, timeout=120)


@pytest.mark.parametrize("divide", [False, True], ids=["active", "initial_world"])
def test_join_uneven_inputs_on_device_matches_ddp(joined, divide: bool) -> None:
    outs = [r[divide] for r in joined]
    for rank, out in enumerate(outs):
        assert out["device"].startswith(DEVICE), out
        assert _gap(out["ours"], out["ddp"]) < 1e-6, (rank, _gap(out["ours"], out["ddp"]))
        assert _gap(out["ours"], outs[0]["ours"]) == 0.0, rank  # every rank ends alike
