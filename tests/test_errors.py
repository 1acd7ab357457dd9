"""The error table of docs/errors.md, row by row: every bad input and fault it lists is
produced here (or in the test the row names), on real Gloo ranks, and must raise the
documented exception with the documented words, on every rank, changing nothing.

The table is the source: each row names its modes, the exception, a quoted piece of
the message and a test. :func:`test_every_row_is_backed_by_a_test` checks that the
named test exists and that the quoted words are still in fastreduce's source; the
tests below run the rows whose test is in this file, for each mode the row lists.
"""

from __future__ import annotations

import ast
import functools
import os
import queue
import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fastreduce
from fastreduce.launch import free_port, rank_context, run_ranks

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "errors.md"
MODES = ("fused", "overlap", "all_reduce_gradients", "zero", "gossip", "local", "diloco")


# ============================================================== the table

def table() -> list[dict[str, Any]]:
    """The rows of the table in docs/errors.md (| situation | modes | exception | message | test |)."""
    rows = []
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or cells[0] in ("situation", "") or set(cells[0]) <= {"-", ":", " "}:
            continue
        situation, modes, exc, message, test = cells
        quoted = re.findall(r"`([^`]+)`", message)
        assert quoted, f"row {situation!r}: the message cell quotes no words"
        rows.append({"situation": situation, "modes": [m.strip("` ") for m in modes.split(",")],
                     "exception": exc.strip("` "), "words": quoted, "test": test.strip("` ")})
    return rows


ROWS = {row["situation"]: row for row in table()}


def row(situation: str) -> dict[str, Any]:
    """The row whose situation starts with ``situation``."""
    found = [r for s, r in ROWS.items() if s.startswith(situation)]
    assert len(found) == 1, f"docs/errors.md: {len(found)} rows start with {situation!r}"
    return found[0]


def test_the_table_has_every_row_the_issue_asks_for() -> None:
    wanted = ["no process group", "models differ across ranks", "a parameter on another device",
              "sparse gradients", "non-finite gradients", "the world size changed since the layout was built",
              "reduce() inside no_sync()", "a second backward without no_sync() (overlap)",
              "a checkpoint from another model", "a rank dies"]
    missing = [w for w in wanted if not any(w in s for s in ROWS)]
    assert not missing, f"docs/errors.md has no row for {missing}"


@functools.cache
def _messages() -> list[str]:
    """Every string literal in fastreduce, adjacent literals joined as Python joins them,
    an f-string's fields written ``{...}`` (parsed once per run: every row reads them)."""
    out = []
    for path in (ROOT / "fastreduce").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append(node.value)
            elif isinstance(node, ast.JoinedStr):
                out.append("".join(v.value if isinstance(v, ast.Constant) else "{...}" for v in node.values))
    return out


def _says(words: str, text: str) -> bool:
    """Whether ``text`` holds ``words``, each ``{...}`` in them standing for anything."""
    return re.search(re.escape(words).replace(r"\{\.\.\.\}", ".*?"), text, re.S) is not None


@functools.cache
def _defined_tests(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize("situation", list(ROWS))
def test_every_row_is_backed_by_a_test(situation: str) -> None:
    r = row(situation)
    file, _, name = r["test"].partition("::")
    path = ROOT / file
    assert path.is_file(), f"{situation!r}: {file} does not exist"
    assert name in _defined_tests(path), f"{situation!r}: {file} defines no {name}"
    assert hasattr(fastreduce, r["exception"]) or r["exception"] in ("RuntimeError", "ValueError", "TypeError"), \
        r["exception"]
    messages = _messages()
    for words in r["words"]:  # an f-string's field is written {...} in the table and here
        assert any(_says(words, m) for m in messages), f"{situation!r}: {words!r} is in no message"


# ============================================================== helpers

class TwoLayer(nn.Module):
    """``a`` then ``b``; ``order="ba"`` registers them the other way round."""

    def __init__(self, width: int = 8, dtype: torch.dtype = torch.float32, order: str = "ab", extra: bool = False):
        super().__init__()
        torch.manual_seed(0)
        layers = {"a": nn.Linear(4, width, dtype=dtype), "b": nn.Linear(width, 4, dtype=dtype)}
        for k in order:
            setattr(self, k, layers[k])
        if extra:
            self.c = nn.Linear(4, 4, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b(torch.tanh(self.a(x.to(self.a.weight.dtype))))
        return self.c(y) if hasattr(self, "c") else y


def model_for(variant: str, rank: int) -> nn.Module:
    if rank != 1:
        return TwoLayer()
    return {"shape": lambda: TwoLayer(width=9), "dtype": lambda: TwoLayer(dtype=torch.float64),
            "order": lambda: TwoLayer(order="ba"), "count": lambda: TwoLayer(extra=True),
            "same": TwoLayer}[variant]()


def backward(model: nn.Module, rank: int) -> None:
    g = torch.Generator().manual_seed(rank)
    model(torch.randn(3, 4, generator=g)).square().mean().backward()


def snapshot(model: nn.Module) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    return [(n, p.detach().clone(), None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()]


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    if a.device.type == "meta" or b.device.type == "meta":  # no values: where it lives is all
        return a.device == b.device and a.shape == b.shape
    if a.is_sparse or b.is_sparse:
        return a.is_sparse and b.is_sparse and torch.equal(a.to_dense(), b.to_dense())
    return a.device == b.device and torch.equal(a, b)


def unchanged(before: list, model: nn.Module) -> bool:
    now = snapshot(model)
    return len(before) == len(now) and all(
        a[0] == b[0] and _same(a[1], b[1]) and _same(a[2], b[2]) for a, b in zip(before, now))


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def step_of(mode: str, model: nn.Module) -> tuple[Any, Callable[[], Any]]:
    """Build ``mode`` on ``model``; return it and what a step after backward calls."""
    if mode == "fused":
        r = fastreduce.FusedReducer(model, wire_dtype=torch.float32)
        return r, r.reduce
    if mode == "overlap":
        r = fastreduce.FusedReducer(model, wire_dtype=torch.float32, overlap=True)
        return r, r.reduce
    if mode == "all_reduce_gradients":
        return None, lambda: fastreduce.all_reduce_gradients(model, torch.float32)
    if mode == "zero":
        z = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
        return z, z.step
    if mode == "gossip":
        d = fastreduce.DecentralizedDataParallel(model, lambda ps: torch.optim.SGD(ps, lr=0.1))
        return d, lambda: None
    opt = sgd(model)
    if mode == "local":
        return fastreduce.LocalSGD(model, opt, sync_every=2), opt.step
    if mode == "diloco":
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        return fastreduce.DiLoCo(model, opt, outer, sync_every=2), opt.step
    raise AssertionError(mode)


def attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported to the parent
        return {"raised": type(e).__name__, "message": str(e)}
    return {"raised": None, "message": ""}


# ============================================================== worker (2 ranks)

def bad_input_worker(rank: int, world: int, cases: list[tuple[str, str, str]]) -> dict:
    out = {}
    for situation, mode, variant in cases:
        torch.manual_seed(0)
        if situation in ("models differ across ranks", "a parameter on another device"):
            model = model_for(variant, rank) if variant else TwoLayer()
            if situation == "a parameter on another device":  # trainable, unused by forward
                model.elsewhere = nn.Parameter(torch.zeros(4, device="meta"))
            before, res = _build_and_step(mode, model, rank)
        elif situation == "sparse gradients":
            model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
            _, step = step_of(mode, model)
            before = snapshot(model)

            def sparse_step() -> None:  # ZeroOptimizer's overlapped buckets refuse it in backward
                model(torch.tensor([1, 2 + rank])).sum().backward()
                step()
            res = attempt(sparse_step)
            for p in model.parameters():  # autograd's own sparse grad is not fastreduce's doing
                p.grad = None
        elif situation == "reduce() inside no_sync()":
            model = TwoLayer()
            obj, step = step_of(mode, model)
            backward(model, rank)
            step()  # a first, good step: the layout exists
            if mode == "zero":
                obj.zero_grad()
            with obj.no_sync():
                backward(model, rank)  # accumulating, and then the mistake:
                before = snapshot(model)
                res = attempt(step)
        else:
            raise AssertionError(situation)
        res["unchanged"] = unchanged(before, model)
        out[(situation, mode, variant)] = res
        dist.barrier()
    return out


def _build_and_step(mode: str, model: nn.Module, rank: int) -> tuple[list, dict[str, Any]]:
    """Build ``mode`` (some refuse here), then backward and step (others refuse there);
    return the model as it was right before the call that raised, and what it raised."""
    built: list = []
    before = snapshot(model)
    res = attempt(lambda: built.append(step_of(mode, model)))
    if res["raised"] is None:
        backward(model, rank)
        before = snapshot(model)
        res = attempt(built[0][1])
    return before, res


CASES = ([("models differ across ranks", m, v) for m in MODES for v in ("shape", "dtype", "order", "count")] +
         [("a parameter on another device", m, "") for m in MODES] +
         [("sparse gradients", m, "") for m in ("fused", "overlap", "all_reduce_gradients", "zero")] +
         [("reduce() inside no_sync()", m, "") for m in ("fused", "overlap", "zero")])


@pytest.fixture(scope="module")
def bad_inputs() -> list[dict]:
    return run_ranks(bad_input_worker, 2, CASES, timeout=200)


def _check(results: list[dict], key: tuple[str, str, str]) -> None:
    r = row(key[0])
    assert key[1] in r["modes"] or "every mode" in r["modes"], f"docs/errors.md: {key[0]!r} does not list {key[1]}"
    for rank, out in enumerate(results):
        got = out[key]
        assert got["raised"] == r["exception"], (rank, key, got)
        for words in r["words"]:
            assert _says(words, got["message"]), (rank, key, words, got["message"])
        assert got["unchanged"], (rank, key, "the failed call changed the model's parameters or grads")


@pytest.mark.parametrize("key", [c for c in CASES if c[0] == "models differ across ranks"], ids=str)
def test_models_that_differ_across_ranks(bad_inputs, key) -> None:
    _check(bad_inputs, key)


@pytest.mark.parametrize("key", [c for c in CASES if c[0] == "a parameter on another device"], ids=str)
def test_a_parameter_on_another_device(bad_inputs, key) -> None:
    _check(bad_inputs, key)


@pytest.mark.parametrize("key", [c for c in CASES if c[0] == "sparse gradients"], ids=str)
def test_sparse_gradients(bad_inputs, key) -> None:
    _check(bad_inputs, key)


@pytest.mark.parametrize("key", [c for c in CASES if c[0] == "reduce() inside no_sync()"], ids=str)
def test_reduce_inside_no_sync(bad_inputs, key) -> None:
    _check(bad_inputs, key)


# ============================================================== no process group (this process)

@pytest.mark.parametrize("mode", MODES)
def test_no_process_group(mode: str) -> None:
    assert not dist.is_initialized()
    r = row("no process group")
    model = TwoLayer()
    before = snapshot(model)
    with pytest.raises(RuntimeError) as info:
        _, step = step_of(mode, model)
        step()
    for words in r["words"]:
        assert _says(words, str(info.value)), (words, str(info.value))
    assert unchanged(before, model)


# ============================================================== the group is made again, smaller

def regroup_worker(rank: int, world: int, port: int, mode: str) -> dict:
    """3 ranks build ``mode`` and step; the group is destroyed; ranks 0 and 1 make a new one
    of 2 (rank 2 one of its own) and step again with the old object: a clear error,
    nothing changed; all_reduce_gradients builds a new reducer by itself and is right."""
    model = TwoLayer()
    obj, step = step_of(mode, model)
    backward(model, rank)
    step()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 2:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        return {}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    if mode != "all_reduce_gradients":
        obj.zero_grad()
    backward(model, rank)
    before = snapshot(model)
    res = attempt(step)
    res["unchanged"] = unchanged(before, model)
    if mode == "all_reduce_gradients":
        want = {n: p.grad.clone() for n, p in model.named_parameters()}
        for g in want.values():
            dist.all_reduce(g)
            g /= 2
        ok = all(torch.allclose(p.grad, want[n], atol=1e-7) for n, p in model.named_parameters())
        res["averaged_over_new_group"] = ok
    return res


@pytest.mark.parametrize("mode", ["fused", "overlap", "all_reduce_gradients", "zero"])
def test_the_world_size_changed_since_the_layout_was_built(mode: str) -> None:
    outs = run_ranks(regroup_worker, 3, free_port(), mode, timeout=120)
    r = row("the world size changed since the layout was built")
    for rank, got in enumerate(outs[:2]):
        if mode == "all_reduce_gradients":  # the functional form starts over on the new group
            assert got["raised"] is None, got
            assert got["averaged_over_new_group"], got
            continue
        assert mode in r["modes"]
        assert got["raised"] == r["exception"], (rank, got)
        for words in r["words"]:
            assert _says(words, got["message"]), (rank, words, got["message"])
        assert got["unchanged"], (rank, got)


# ============================================================== a rank alone: the other raised first and left

LONE = [("sparse gradients", "all_reduce_gradients"), ("sparse gradients", "fused"), ("sparse gradients", "overlap"),
        ("sparse gradients", "zero"), ("an unknown transport", "zero"), ("an unknown transport", "gossip"),
        ("more fragments than parameters", "diloco"), ("a parameter on another device", "local")]
LONE_WORDS = {"sparse gradients": "has a sparse gradient", "an unknown transport": "unknown transport",
              "more fragments than parameters": "trainable parameters; a fragment holds whole parameters",
              "a parameter on another device": "the trainable parameters live on several devices"}


def lone_case(situation: str, mode: str, rank: int) -> None:
    """Make the mistake ``situation`` in ``mode``: each one a check that a rank can do alone."""
    if situation == "sparse gradients":
        model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
        if mode == "all_reduce_gradients":  # the issue's call
            model(torch.tensor([1, 2 + rank])).sum().backward()
            fastreduce.all_reduce_gradients(model, torch.float32, False)
        elif mode == "zero":  # the gradients exist when it is built: refused there
            model(torch.tensor([1, 2 + rank])).sum().backward()
            step_of(mode, model)
        else:
            _, step = step_of(mode, model)
            model(torch.tensor([1, 2 + rank])).sum().backward()
            step()
    elif situation == "an unknown transport" and mode == "zero":
        fastreduce.ZeroOptimizer(TwoLayer().parameters(), torch.optim.SGD, lr=0.1, transport="carrier-pigeon")
    elif situation == "an unknown transport":
        os.environ["FASTREDUCE_TRANSPORT"] = "carrier-pigeon"
        try:
            step_of(mode, TwoLayer())
        finally:
            del os.environ["FASTREDUCE_TRANSPORT"]
    elif situation == "more fragments than parameters":  # 4 parameters
        model = TwoLayer()
        outer = torch.optim.SGD(model.parameters(), lr=0.7)
        fastreduce.DiLoCo(model, sgd(model), outer, sync_every=5, fragments=5)
    else:  # LocalSGD with a subgroup to make (hierarchy)
        model = TwoLayer()
        model.elsewhere = nn.Parameter(torch.zeros(4, device="meta"))
        fastreduce.LocalSGD(model, sgd(model), sync_every=2, hierarchy={1: 1})


def lone_worker(rank: int, port: int, ready: Any, go: Any, results: Any) -> None:
    """Rank 0 hosts the store (``init_process_group`` over TCP), makes the first mistake once
    rank 1 is set up, and exits at once; rank 1 waits until that process is gone (``go``),
    then makes every mistake alone."""
    try:
        import torch._dynamo  # noqa: F401 - the modes' first construction imports it (seconds): not timed
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=60))
        if rank == 0:
            ready.wait(60)  # rank 1 is set up: nothing left of the race but the one in question
        else:
            ready.set()
            go.wait(60)  # rank 0 raised, and its process (the store's host) is gone
        for situation, mode in LONE[:1] if rank == 0 else LONE:
            t0 = time.monotonic()
            res = attempt(lambda: lone_case(situation, mode, rank))
            results.put((rank, situation, mode, res, time.monotonic() - t0))
    finally:
        results.close()
        results.join_thread()


def test_a_check_a_rank_can_do_alone_raises_on_every_rank_with_none_waiting_on_another() -> None:
    """docs/design.md, invariant 11: a local error raises on every rank before any rank waits on another.
    Rank 0 (the store's host) raises the sparse gradient of all_reduce_gradients and exits; rank
    1, only then, still raises it, at once, and every other mistake a rank can see alone too
    (before, it hung in the heartbeat's store clone, or failed in a collective with rank 0)."""
    ctx = rank_context()
    results, ready, go = ctx.Queue(), ctx.Event(), ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=lone_worker, args=(r, port, ready, go, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got: dict[tuple[int, str, str], tuple[dict, float]] = {}
    try:
        rank, situation, mode, res, seconds = results.get(timeout=60)
        got[(rank, situation, mode)] = (res, seconds)
        procs[0].join(timeout=30)
        assert procs[0].exitcode is not None, "rank 0 did not exit after raising"
        go.set()
        deadline = time.monotonic() + 20
        while len(got) < 1 + len(LONE):
            rank, situation, mode, res, seconds = results.get(timeout=max(0.1, deadline - time.monotonic()))
            got[(rank, situation, mode)] = (res, seconds)
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.kill()
            p.join()
    assert (0, *LONE[0]) in got, "rank 0 reported nothing"
    for rank, (situation, mode) in [(0, LONE[0])] + [(1, case) for case in LONE]:
        assert (rank, situation, mode) in got, (f"rank {rank} raised nothing for {situation!r} ({mode}) within "
                                                "20 s: it waited on the other rank or the store")
        res, seconds = got[(rank, situation, mode)]
        assert res["raised"] == "ValueError", (rank, situation, mode, res)
        assert LONE_WORDS[situation] in res["message"], (rank, situation, mode, res)
        assert seconds < 3.0, (rank, situation, mode, f"{seconds:.1f} s: it waited on something")
    assert got[(0, *LONE[0])][0] == got[(1, *LONE[0])][0], "the ranks raised different errors"
