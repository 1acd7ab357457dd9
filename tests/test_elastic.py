"""Elastic restarts: fastreduce.checkpoint.Checkpointer in every mode, and torchrun
bringing a job back after a rank is SIGKILLed.

Two kinds of test:

* Checkpointer on spawned Gloo ranks (one group per world size, many sub-cases each):
  train, save, train on (the reference); then fresh objects with other weights and
  other random state load the checkpoint and train the same steps: the parameters must
  equal the reference (optimizer state, mode state, error-feedback residuals, step and
  random generators all feed into them). Uncommitted checkpoints, ``keep``, a
  checkpoint from another model (nothing changed) and other world sizes.
* examples/elastic.py under ``torchrun --max-restarts 3`` per mode: rank 1 SIGKILLed
  at step 13 (checkpoints every 5 steps); the final parameters of every rank must
  equal those of the same training never stopped (the example's ``train()``, every
  mode in one spawned group).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing import assert_close

import fastreduce
from fastreduce.checkpoint import MARKER, Checkpointer, CheckpointMismatchError
from fastreduce.launch import run_ranks

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from elastic import MODES, Job, make_net, train as train_example  # noqa: E402  (examples/elastic.py)
from train import make_model  # noqa: E402
from test_fused import spawn_once  # noqa: E402

SAVE_AT = 5  # steps before the checkpoint
MORE = 4  # steps after it, on both sides
KINDS = MODES + ("reducer",)  # reducer: the fused mode's object form
SPAWN_TIMEOUT = 150.0
EXACT = {"rtol": 0.0, "atol": 1e-6}

pytestmark = pytest.mark.timeout(400)


# ============================================================== helpers run in ranks

class ReducerJob(Job):
    """The fused mode in its object form: ``FusedReducer(error_feedback=True).reduce()``."""

    def __init__(self, model: nn.Module):
        self.kind, self.model, self.net = "reducer", model, model
        self.opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        self.mode = fastreduce.FusedReducer(model, wire_dtype=torch.bfloat16, error_feedback=True)


def make_job(kind: str, model: nn.Module) -> Job:
    return ReducerJob(model) if kind == "reducer" else Job(kind, model)


def fresh(kind: str, rank: int, seed: int) -> Job:
    """A job on a new model: weights from ``seed``, this rank's own random state after."""
    torch.manual_seed(seed)
    model = make_net()
    torch.manual_seed(seed + 1 + rank)
    return make_job(kind, model)


def train(job: Job, steps: int) -> None:
    """Batches from the global generator: a resumed run reproduces them only if the
    checkpoint restored it."""
    dtype = next(job.model.parameters()).dtype
    for _ in range(steps):
        job.step(torch.randn(16, 16).to(dtype), torch.randint(0, 4, (16,)))


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def snapshot(job: Job) -> dict[str, Any]:
    """Parameters and optimizer state (each rank's own), to check a failed load changed nothing."""
    opt = None if job.opt is None else {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in st.items()}
                                        for k, st in job.opt.state_dict()["state"].items()}
    return {"params": params(job.model), "opt": opt}


def guarded(fn: Callable[..., Any], *args: Any) -> dict:
    try:
        return {"ok": fn(*args)}
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # noqa: BLE001 - reported to the parent test
        return {"error": traceback.format_exc()}


def roundtrip(rank: int, root: str, kind: str) -> dict[str, Any]:
    """Reference: SAVE_AT steps, save, MORE steps. Resumed: a fresh job loads, MORE steps."""
    job = fresh(kind, rank, 0)
    ckpt = job.checkpointer(f"{root}/{kind}")
    train(job, SAVE_AT)
    ckpt.save(SAVE_AT)
    train(job, MORE)
    job.settle()
    again = fresh(kind, rank, 100)
    before = params(again.model)
    step = again.checkpointer(f"{root}/{kind}").load_latest()
    train(again, MORE)
    again.settle()
    return {"step": step, "ref": params(job.model), "resumed": params(again.model), "before": before}


def zero_saved_before_fresh(rank: int, root: str) -> dict[str, Any]:
    """A ZeRO checkpoint from before fastreduce saved ``optimizer.fresh`` (the key taken
    out of its DCP metadata, as such a checkpoint has none) loads and resumes exactly."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    job = fresh("zero", rank, 0)
    ckpt = job.checkpointer(f"{root}/zero-before-fresh")
    train(job, SAVE_AT)
    path = ckpt.save(SAVE_AT)
    train(job, MORE)
    job.settle()
    dist.barrier()
    if rank == 0:
        metadata = FileSystemReader(path).read_metadata()
        del metadata.state_dict_metadata["optimizer.fresh"]
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(metadata, f)
    dist.barrier()
    again = fresh("zero", rank, 100)
    step = again.checkpointer(f"{root}/zero-before-fresh").load_latest()
    train(again, MORE)
    again.settle()
    return {"step": step, "ref": params(job.model), "resumed": params(again.model)}


def uncommitted(rank: int, root: str) -> dict[str, Any]:
    """A save whose marker never came (killed before the commit) and a stray partial
    folder are never loaded, and the next save clears them."""
    d = f"{root}/uncommitted"
    job = fresh("fused", rank, 0)
    ckpt = job.checkpointer(d, keep=5)
    train(job, 2)
    ckpt.save(2)
    at_2 = params(job.model)
    train(job, 2)
    ckpt.save(4)
    if rank == 0:
        os.remove(f"{d}/step-00000004/{MARKER}")  # as if killed after writing, before the commit
        os.makedirs(f"{d}/step-00000009")
        Path(f"{d}/step-00000009/__0_0.distcp").write_bytes(b"half a file")
    dist.barrier()
    again = fresh("fused", rank, 100)
    ck2 = again.checkpointer(d, keep=5)
    step = ck2.load_latest()
    loaded = params(again.model)
    ck2.save(3)
    dist.barrier()
    return {"step": step, "at_2": at_2, "loaded": loaded, "steps_after": ck2.steps(),
            "folders_after": sorted(os.listdir(d))}


def keep_two(rank: int, root: str) -> dict[str, Any]:
    d = f"{root}/keep"
    job = fresh("zero", rank, 0)
    ckpt = job.checkpointer(d, keep=2)
    for s in range(1, 5):
        train(job, 1)
        ckpt.save(s)
    dist.barrier()
    return {"steps": ckpt.steps(), "folders": sorted(os.listdir(d))}


def nothing_yet(rank: int, root: str) -> dict[str, Any]:
    job = fresh("fused", rank, 0)
    before = snapshot(job)
    step = job.checkpointer(f"{root}/empty").load_latest()
    return {"step": step, "same": _same(before, snapshot(job))}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    try:
        assert_close(a, b, rtol=0, atol=0)
        return True
    except AssertionError:
        return False


class Renamed(nn.Module):
    """make_net()'s layers under other names."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.1)
        self.body = make_model(dim=16, hidden=32, classes=4, depth=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.drop(x))


OTHERS: dict[str, Callable[[], Job]] = {
    "shape": lambda: Job("fused", nn.Sequential(nn.Dropout(0.1), make_model(dim=16, hidden=24, classes=4, depth=1))),
    "names": lambda: Job("fused", Renamed()),
    "dtype": lambda: Job("fused", make_net().double()),
    "mode": lambda: Job("overlap", make_net()),
    "optimizer": lambda: _sgd_job(),
}
"""Jobs that must refuse the ``fused`` AdamW checkpoint of make_net(), each for one reason."""


def _sgd_job() -> Job:
    job = Job("fused", make_net())
    job.opt = torch.optim.SGD(job.model.parameters(), lr=0.1, momentum=0.9)
    return job


def mismatches(rank: int, root: str) -> dict[str, Any]:
    d = f"{root}/mismatch"
    job = fresh("fused", rank, 0)
    train(job, 2)
    job.checkpointer(d).save(2)
    out = {}
    for why, make in OTHERS.items():
        torch.manual_seed(7)
        other = make()
        train(other, 1)  # optimizer state to keep
        before = snapshot(other)
        try:
            other.checkpointer(d).load_latest()
            out[why] = {"raised": None}
        except CheckpointMismatchError as e:
            out[why] = {"raised": type(e).__name__, "message": str(e), "unchanged": _same(before, snapshot(other))}
    return out


def reducer_state_errors(rank: int, root: str) -> dict[str, str]:
    """FusedReducer.load_state_dict refuses residuals it cannot hold, before the layout exists."""
    torch.manual_seed(0)
    model = make_net()
    residuals = {n: torch.zeros(p.numel()) for n, p in model.named_parameters()}
    out = {}
    for why, reducer, state in [
            ("no error feedback", fastreduce.FusedReducer(model), {"residuals": residuals}),
            ("another size", fastreduce.FusedReducer(model, error_feedback=True),
             {"residuals": {**residuals, "1.0.weight": torch.zeros(3)}}),
            ("not a state", fastreduce.FusedReducer(model, error_feedback=True), {"step": 3})]:
        try:
            reducer.load_state_dict(state)
            out[why] = "no error"
        except ValueError as e:
            out[why] = str(e)
    return out


def whole_state(ckpt: Any) -> dict[str, Any]:
    """Everything a checkpoint of ``ckpt`` would hold on this rank (model, optimizer,
    mode, random generators), copied: ``Checkpointer._state()``, with a ZeRO range's
    rank-local part in place of its checkpoint view."""
    from fastreduce.modes.zero_state import RangeShard

    def copy(x: Any) -> Any:
        if isinstance(x, RangeShard):
            return ["range", x.offset, x.local.clone()]
        if torch.is_tensor(x):
            return x.detach().clone()
        if isinstance(x, dict):
            return {k: copy(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [copy(v) for v in x]
        return x

    return copy(ckpt._state())


def _identical(a: Any, b: Any) -> bool:
    """Bit for bit: tensors equal in dtype, shape and every value; the rest equal."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_identical(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b))
    return a == b


DAMAGE = ("truncate", "remove", "unchecked")  # unchecked: truncated, and the file check skipped (DCP fails)


def damage(folder: str, how: str) -> str:
    """Rank 0: truncate (to half) or remove the largest DCP file of ``folder``; its name."""
    name = max((f for f in os.listdir(folder) if f.endswith(".distcp")),
               key=lambda f: os.path.getsize(os.path.join(folder, f)))
    file = os.path.join(folder, name)
    if how == "remove":
        os.remove(file)
    else:
        os.truncate(file, os.path.getsize(file) // 2)
    return name


def damaged(rank: int, root: str, kind: str, how: str) -> dict[str, Any]:
    """Save at 2 and 4, train one more step; damage step 4. Loading it raises
    CheckpointDamagedError and changes nothing; load_latest() falls back to step 2
    (with a warning) and restores exactly the state saved there."""
    import logging

    import fastreduce.checkpoint as checkpoint

    d = f"{root}/damaged-{kind}-{how}"
    job = fresh(kind, rank, 0)
    ckpt = job.checkpointer(d)
    train(job, 2)
    ckpt.save(2)
    at_2 = whole_state(ckpt)
    train(job, 2)
    ckpt.save(4)
    train(job, 1)
    before = whole_state(ckpt)
    name = damage(f"{d}/step-00000004", how) if rank == 0 else None
    box = [name]
    dist.broadcast_object_list(box, src=0)
    inspect = checkpoint.inspect_folder
    if how == "unchecked":  # let DCP itself meet the damage: the staging must hold
        checkpoint.inspect_folder = lambda path: (inspect(path)[0], [])
    try:
        try:
            ckpt.load(4)
            raised: dict[str, Any] = {"type": None}
        except Exception as err:  # noqa: BLE001 - what is raised is the result
            raised = {"type": type(err).__name__, "message": str(err)}
        after_failed = whole_state(ckpt)
        warnings: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("fastreduce.checkpoint").addHandler(handler)
        try:
            step = ckpt.load_latest()
        finally:
            logging.getLogger("fastreduce.checkpoint").removeHandler(handler)
    finally:
        checkpoint.inspect_folder = inspect
    return {"file": box[0], "raised": raised, "unchanged": _identical(before, after_failed),
            "step": step, "restored": _identical(at_2, whole_state(ckpt)), "warnings": warnings}


def none_readable(rank: int, root: str) -> dict[str, Any]:
    """Every checkpoint damaged: load_latest() raises, naming each, and changes nothing."""
    d = f"{root}/none-readable"
    job = fresh("zero", rank, 0)
    ckpt = job.checkpointer(d)
    for s in (1, 2):
        train(job, 1)
        ckpt.save(s)
    before = whole_state(ckpt)
    if rank == 0:
        damage(f"{d}/step-00000001", "remove")
        with open(f"{d}/step-00000002/{MARKER}", "w") as f:
            f.write('{"format": 1, "mo')  # a marker cut short
    dist.barrier()
    try:
        ckpt.load_latest()
        raised: dict[str, Any] = {"type": None}
    except Exception as err:  # noqa: BLE001
        raised = {"type": type(err).__name__, "message": str(err), "files": getattr(err, "files", None)}
    return {"raised": raised, "unchanged": _identical(before, whole_state(ckpt))}


def _bn_job(kind: str) -> Job:
    """A model with BatchNorm: each rank's running statistics its own (only gradients are averaged)."""
    return Job(kind, nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)))


def buffers_per_rank(rank: int, root: str) -> dict[str, Any]:
    """Fused and ZeRO jobs save with every rank's statistics apart; a fresh job loads its own."""
    out = {}
    for kind in ("fused", "zero"):
        torch.manual_seed(rank)
        job = _bn_job(kind)
        train(job, 2)
        job.checkpointer(f"{root}/buffers-{kind}").save(2)
        torch.manual_seed(50)
        again = _bn_job(kind)
        again.checkpointer(f"{root}/buffers-{kind}").load_latest()
        out[kind] = {"saved": dict(job.model.named_buffers()), "loaded": dict(again.model.named_buffers())}
    return out


def _refusal(make: Callable[[], Checkpointer]) -> dict[str, Any]:
    """Load the latest checkpoint through ``make()``; what it raised and whether anything changed."""
    ckpt = make()
    before = whole_state(ckpt)
    try:
        ckpt.load_latest()
        raised: dict[str, Any] = {"type": None}
    except Exception as err:  # noqa: BLE001
        raised = {"type": type(err).__name__, "message": str(err)}
    return {"raised": raised, "unchanged": _identical(before, whole_state(ckpt))}


def other_settings(rank: int, root: str) -> dict[str, Any]:
    """Checkpoints whose model, mode and optimizer class fit, but not their settings: the
    reducer's error feedback, the optimizer's param groups, ZeRO's AdamW with amsgrad."""
    out = {}
    torch.manual_seed(0)
    job = ReducerJob(make_net())
    train(job, 2)
    job.checkpointer(f"{root}/settings-reducer").save(2)
    other = Job("overlap", make_net())
    other.mode = fastreduce.FusedReducer(other.model, wire_dtype=torch.bfloat16)  # no error feedback
    train(other, 1)
    out["error_feedback"] = _refusal(lambda: Checkpointer(f"{root}/settings-reducer", other.model, other.opt,
                                                          mode=other.mode))
    fused = Job("fused", make_net())
    train(fused, 1)
    fused.checkpointer(f"{root}/settings-groups").save(1)
    split = Job("fused", make_net())
    decay, rest = [p for p in split.model.parameters() if p.dim() > 1], [p for p in split.model.parameters() if p.dim() < 2]
    split.opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=3e-3)
    train(split, 1)
    out["param_groups"] = _refusal(lambda: split.checkpointer(f"{root}/settings-groups"))
    zero = Job("zero", make_net())
    train(zero, 1)
    zero.checkpointer(f"{root}/settings-amsgrad").save(1)
    ams = Job("zero", make_net())
    ams.opt = fastreduce.ZeroOptimizer(ams.model.parameters(), torch.optim.AdamW, lr=3e-3, amsgrad=True,
                                       wire_dtype=torch.bfloat16, module=ams.model)
    train(ams, 1)
    out["amsgrad"] = _refusal(lambda: ams.checkpointer(f"{root}/settings-amsgrad"))
    return out


def rollback(rank: int, root: str) -> dict[str, Any]:
    """Checkpoints at 2 and 4; back to 2, train, save 3: the checkpoint at 4 was of a
    timeline given up, and the latest is 3."""
    d = f"{root}/rollback"
    job = fresh("fused", rank, 0)
    ckpt = job.checkpointer(d, keep=3)
    for s in (2, 4):
        train(job, 2)
        ckpt.save(s)
    ckpt.load(2)
    train(job, 1)
    ckpt.save(3)
    at_3 = params(job.model)
    again = fresh("fused", rank, 100)
    step = again.checkpointer(d, keep=3).load_latest()
    return {"steps": ckpt.steps(), "latest": step, "same": _same(at_3, params(again.model))}


def two_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    out = {f"roundtrip-{k}": guarded(roundtrip, rank, root, k) for k in KINDS}
    out.update({f"damaged-{k}-{how}": guarded(damaged, rank, root, k, how) for k in KINDS for how in DAMAGE})
    out["none-readable"] = guarded(none_readable, rank, root)
    for name, fn in [("uncommitted", uncommitted), ("keep", keep_two), ("nothing", nothing_yet),
                     ("zero-before-fresh", zero_saved_before_fresh),
                     ("mismatch", mismatches), ("saved-at-2", saved_at_2), ("reducer-errors", reducer_state_errors),
                     ("buffers", buffers_per_rank), ("settings", other_settings), ("rollback", rollback)]:
        out[name] = guarded(fn, rank, root)
    return out


def saved_at_2(rank: int, root: str) -> dict[str, Any]:
    """Checkpoints for the 3-rank group: ZeRO with its full state, gossip, fused, overlapped."""
    out = {}
    for kind in ("zero", "gossip", "fused", "overlap"):
        job = fresh(kind, rank, 0)
        train(job, SAVE_AT)
        job.checkpointer(f"{root}/w2-{kind}").save(SAVE_AT)
        job.settle()
        out[kind] = {"params": params(job.model),
                     "opt": job.opt.state_dict() if kind != "gossip" else None}
    return out


def three_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    out = {}
    for kind in ("zero", "fused", "overlap", "gossip"):
        def load(kind: str = kind) -> dict[str, Any]:
            job = fresh(kind, rank, 100)
            step = job.checkpointer(f"{root}/w2-{kind}").load_latest()
            job.settle()
            return {"step": step, "params": params(job.model), "opt": job.opt.state_dict() if job.opt else None}

        def refused(kind: str = kind) -> dict[str, Any]:
            try:
                load(kind)
            except CheckpointMismatchError as e:
                return {"message": str(e)}
            return {"message": None}

        out[kind] = guarded(refused if kind == "gossip" else load)
    return out


# ============================================================== helpers run in the parent

_SPAWNS: dict[str, Any] = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("ckpt"))


def spawn(name: str, fn: Callable[..., Any], world: int, root: str) -> list[dict[str, Any]]:
    """One group per name, run once per module; a failed spawn fails every test asking."""
    return spawn_once(_SPAWNS, name, lambda: run_ranks(fn, world, root, timeout=SPAWN_TIMEOUT))


def unwrap(result: dict) -> Any:
    if "error" in result:
        pytest.fail("sub-case raised inside a rank:\n" + result["error"], pytrace=False)
    return result["ok"]


def at_two(root: str, key: str) -> list[Any]:
    return [unwrap(r[key]) for r in spawn("two", two_ranks, 2, root)]


# ============================================================== Checkpointer

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.cell("loop", "resume", modes=("fused", "overlap", "zero", "gossip", "localsgd", "diloco"))
def test_resume_equals_uninterrupted(root: str, kind: str) -> None:
    """Save, then fresh objects (other weights, other random state) load and train on:
    the same parameters as never stopping, on every rank."""
    results = at_two(root, f"roundtrip-{kind}")
    for rank, r in enumerate(results):
        assert r["step"] == SAVE_AT
        assert not _same({"p": r["before"]}, {"p": r["ref"]}), "the fresh job must start elsewhere"
        assert_close(r["resumed"], r["ref"], **EXACT, msg=lambda m, rank=rank: f"rank {rank}: {m}")
    if kind in ("gossip", "local", "diloco"):  # per-rank parameters: rank 1 did not get rank 0's
        assert not _same({"p": results[0]["ref"]}, {"p": results[1]["ref"]})


def test_zero_checkpoint_saved_before_the_fresh_mark_loads(root: str) -> None:
    """Checkpoints written before ZeroOptimizer saved ``fresh`` load as they did."""
    for rank, r in enumerate(at_two(root, "zero-before-fresh")):
        assert r["step"] == SAVE_AT
        assert_close(r["resumed"], r["ref"], **EXACT, msg=lambda m, rank=rank: f"rank {rank}: {m}")


@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize("kind", KINDS)
def test_damaged_checkpoint_changes_nothing_and_the_one_before_loads(root: str, kind: str, how: str) -> None:
    """A shard file of the newest checkpoint truncated or removed: loading it raises
    CheckpointDamagedError (an Exception, naming the file) on every rank with the whole
    state bit for bit as before; load_latest() warns and resumes from the checkpoint
    before it, exactly. ``unchecked``: the file check is skipped, so DCP's own read
    fails midway, and the staging keeps the job as it was."""
    for rank, r in enumerate(at_two(root, f"damaged-{kind}-{how}")):
        raised = r["raised"]
        assert raised["type"] == "CheckpointDamagedError", (rank, raised)
        assert "step-00000004" in raised["message"] and "Nothing was changed" in raised["message"] \
            if how == "unchecked" else r["file"] in raised["message"], (rank, raised["message"])
        if how != "unchecked":
            assert ("is missing" if how == "remove" else "is truncated") in raised["message"]
        assert r["unchanged"], f"rank {rank}: a failed load changed the state"
        assert r["step"] == 2
        assert r["restored"], f"rank {rank}: load_latest() did not restore the checkpoint of step 2 exactly"
        if rank == 0:
            assert any("step-00000004" in w and "trying the checkpoint before it" in w for w in r["warnings"]), \
                r["warnings"]


def test_no_readable_checkpoint_raises_naming_each(root: str) -> None:
    for r in at_two(root, "none-readable"):
        raised = r["raised"]
        assert raised["type"] == "CheckpointDamagedError", raised
        assert "step-00000001" in raised["message"] and "is missing" in raised["message"]
        assert "step-00000002" in raised["message"] and "fastreduce.json cannot be read" in raised["message"]
        assert "Nothing was loaded" in raised["message"] and len(raised["files"]) == 2
        assert r["unchanged"]


def test_uncommitted_checkpoint_is_never_loaded(root: str) -> None:
    for r in at_two(root, "uncommitted"):
        assert r["step"] == 2
        assert_close(r["loaded"], r["at_2"], rtol=0, atol=0)
        assert r["steps_after"] == [2, 3]
        assert r["folders_after"] == ["step-00000002", "step-00000003"]  # the partial ones removed


def test_keep_prunes_older_checkpoints(root: str) -> None:
    for r in at_two(root, "keep"):
        assert r["steps"] == [3, 4]
        assert r["folders"] == ["step-00000003", "step-00000004"]


def test_no_checkpoint_starts_at_zero(root: str) -> None:
    for r in at_two(root, "nothing"):
        assert r == {"step": 0, "same": True}


def test_reducer_state_refuses_residuals_it_cannot_hold(root: str) -> None:
    for r in at_two(root, "reducer-errors"):
        assert "built without error_feedback=True" in r["no error feedback"]
        assert "the residual saved for '1.0.weight' does not fit this model" in r["another size"]
        assert "not a FusedReducer.state_dict()" in r["not a state"]


EXPECTED = {
    "shape": "its parameter '1.0.weight' is (32, 16) torch.float32, this model's is (24, 16) torch.float32",
    "names": "its parameter #0 is '1.0.weight' (32, 16) torch.float32, this model's is parameter 'body.0.weight'",
    "dtype": "its parameter '1.0.weight' is (32, 16) torch.float32, this model's is (32, 16) torch.float64",
    "mode": "it was saved in mode 'fused', this job runs mode 'overlap'",
    "optimizer": "its optimizer is AdamW, this job's is SGD",
}


@pytest.mark.parametrize("why", sorted(EXPECTED))
def test_checkpoint_from_another_model_raises_and_changes_nothing(root: str, why: str) -> None:
    for r in at_two(root, "mismatch"):
        got = r[why]
        assert got["raised"] == "CheckpointMismatchError", got
        assert EXPECTED[why] in got["message"], got["message"]
        assert "Nothing was loaded" in got["message"]
        assert got["unchanged"]


def test_each_rank_gets_back_its_own_buffers(root: str) -> None:
    """BatchNorm's running statistics differ per rank (the fused modes and ZeRO average
    gradients only): saved once, a load gave each rank a mix of ranks' (DCP picks a writer
    per tensor)."""
    results = at_two(root, "buffers")
    for kind in ("fused", "zero"):
        assert not _same(results[0][kind]["saved"], results[1][kind]["saved"]), "the ranks' statistics must differ"
        for rank, r in enumerate(results):
            assert_close(r[kind]["loaded"], r[kind]["saved"], rtol=0, atol=0,
                         msg=lambda m, rank=rank, kind=kind: f"{kind}, rank {rank}: {m}")


@pytest.mark.parametrize("case", ["error_feedback", "param_groups", "amsgrad"])
def test_a_checkpoint_of_other_settings_raises_naming_them_and_changes_nothing(root: str, case: str) -> None:
    """The model, mode and optimizer class fit, their settings do not: CheckpointMismatchError
    on every rank with the whole state as before (it raised a ValueError after the model,
    optimizer and random generators were set, or called the checkpoint damaged)."""
    cause = {"error_feedback": "error_feedback=True", "param_groups": "parameter groups",
             "amsgrad": "max_exp_avg_sq"}[case]
    for r in at_two(root, "settings"):
        got = r[case]
        assert got["raised"]["type"] == "CheckpointMismatchError", got["raised"]
        assert cause in got["raised"]["message"], got["raised"]["message"]
        assert got["unchanged"]


def test_a_save_after_going_back_drops_the_later_checkpoints(root: str) -> None:
    for r in at_two(root, "rollback"):
        assert r == {"steps": [2, 3], "latest": 3, "same": True}


@pytest.mark.cell("loop", "reshard", modes=("zero",))
def test_zero_loads_onto_another_world_size(root: str) -> None:
    saved = at_two(root, "saved-at-2")[0]["zero"]
    for r in spawn("three", three_ranks, 3, root):
        got = unwrap(r["zero"])
        assert got["step"] == SAVE_AT
        assert_close(got["params"], saved["params"], rtol=0, atol=0)
        assert_close(got["opt"]["state"], saved["opt"]["state"], rtol=0, atol=0)


@pytest.mark.cell("loop", "reshard", modes=("fused", "overlap"))
def test_fused_loads_onto_another_world_size(root: str) -> None:
    for kind in ("fused", "overlap"):
        saved = at_two(root, "saved-at-2")[0][kind]
        for r in spawn("three", three_ranks, 3, root):
            got = unwrap(r[kind])
            assert got["step"] == SAVE_AT
            assert_close(got["params"], saved["params"], rtol=0, atol=0)
            assert_close(got["opt"]["state"], saved["opt"]["state"], rtol=0, atol=0)


def test_per_rank_mode_refuses_another_world_size(root: str) -> None:
    at_two(root, "saved-at-2")
    for r in spawn("three", three_ranks, 3, root):
        msg = unwrap(r["gossip"])["message"]
        assert msg is not None and "per-rank state of 2 ranks" in msg and "resume it on 2 ranks" in msg


# ============================================================== torchrun, a rank killed

KILL_AT, EVERY, STEPS = 13, 5, 16
TORCHRUN_TIMEOUT = 240


def uninterrupted(rank: int, world: int, root: str) -> dict[str, Any]:
    """The reference: examples/elastic.py's training, every mode, never stopped."""
    return {mode: train_example(mode, f"{root}/whole-{mode}", steps=STEPS, every=EVERY) for mode in MODES}


def torchrun(mode: str, directory: Path, out: Path) -> str:
    """examples/elastic.py under torchrun --max-restarts 3, rank 1 SIGKILLed at KILL_AT."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "3", "--monitor-interval", "0.1", str(ROOT / "examples" / "elastic.py"),
           "--mode", mode, "--dir", str(directory), "--out", str(out), "--steps", str(STEPS),
           "--every", str(EVERY), "--kill-rank", "1", "--kill-at-step", str(KILL_AT)]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=TORCHRUN_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun did not finish in {TORCHRUN_TIMEOUT}s:\n{str(e.output)[-4000:]}")
    assert done.returncode == 0, f"torchrun failed ({done.returncode}):\n{done.stdout[-6000:]}"
    return done.stdout


@pytest.mark.parametrize("mode", MODES)
def test_killed_rank_restarts_and_ends_as_uninterrupted(root: str, tmp_path: Path, mode: str) -> None:
    """Rank 1 SIGKILLed at step 13: torchrun restarts the job, which resumes from step 10
    and ends with every rank's parameters equal to an uninterrupted run's."""
    log = torchrun(mode, tmp_path / "ckpt", tmp_path / "out.pt")
    killed = torch.load(tmp_path / "out.pt")["ranks"]
    whole = [r[mode] for r in spawn("whole", uninterrupted, 2, root)]
    assert "exitcode: -9" in log and "local_rank: 1" in log, log[-3000:]
    assert [(r["attempt"], r["resumed_at"]) for r in killed] == [(1, 10), (1, 10)], log[-3000:]
    assert [(r["attempt"], r["resumed_at"]) for r in whole] == [(0, 0), (0, 0)]
    for rank, (a, b) in enumerate(zip(killed, whole)):
        assert_close(a["params"], b["params"], **EXACT, msg=lambda m, rank=rank: f"rank {rank}: {m}")
    if mode in ("gossip", "local", "diloco"):  # per-rank parameters: each rank got its own back
        assert not _same({"p": killed[0]["params"]}, {"p": killed[1]["params"]})
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_a_packed_tree_comes_back_with_its_containers() -> None:
    """What a checkpoint writes per rank (fastreduce.checkpoint_state's DCP entries and pickled
    skeleton) and reads back: a MultiStepLR's milestones stay a Counter (its closed form,
    step(epoch), asks .elements()), a module state keeps its _metadata, tensors their values."""
    import collections
    import pickle

    from fastreduce.checkpoint_state import pack_tree, unpack_tree

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3, 6], gamma=0.1).state_dict()
    module = torch.nn.Linear(2, 2).state_dict()
    tree = {"sched": sched, "module": module, "opt": opt.state_dict()}
    entries = pack_tree(tree, "t")
    back = unpack_tree({k: (v.clone() if torch.is_tensor(v) else v) for k, v in entries.items()}, "t")
    pickle.loads(entries["t/tree"])  # (the skeleton is plain pickle)
    assert type(back["sched"]["milestones"]) is collections.Counter and back["sched"] == sched
    assert back["module"]._metadata == module._metadata
    assert all(torch.equal(back["module"][k], v) for k, v in module.items())
