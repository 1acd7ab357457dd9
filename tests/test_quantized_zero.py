"""ZeRO's quantized reduce-scatter (``ZeroOptimizer(..., wire_dtype=torch.float8_e4m3fn,
torch.float8_e5m2 or "int8", error_feedback=...)``) on real Gloo groups, CPU, against a
reference written here from the algorithm of fastreduce/comm/quantized.py (scatter mode):

per bucket (a layout segment: ``opt.layout.segments``, each padded to a multiple of
W x 256 values, every gradient at its slot offset, zeros in the gaps) viewed as W
rows of ``m`` values: every rank's buffer plus its residual goes through
``BlockQuant(fmt).roundtrip`` (one rounding; with error feedback the residual becomes
``fl(x + e) - rt(fl(x + e))``), and the owner of chunk c sums the ranks' round trips of
chunk c in fp32 in ``sum_order(c, W)`` and divides by W: that is its shard's gradient.
Nothing else is rounded: the shard steps in fp32 and the parameters are all-gathered in
their own dtype (fp32 here), so with SGD(lr=1) every parameter after a step must equal,
bit for bit, ``before - mean``.

* Bit for bit, 3 steps, 3 buckets, every format, both transports, overlapped (buckets
  launched from backward hooks, each bucket's sum advanced after the next one's launch)
  and not, at 2 and 3 ranks; the residual (``wire_state_dict()``) equals the reference's.
* ``gather_dtype=torch.bfloat16``: the parameters are the fp32 masters (stepped with the
  same means) rounded to bf16, alike on every rank.
* ``Checkpointer`` on disk keeps the residual: saved after 2 steps, loaded into a fresh
  job (same world size), 2 more steps equal the uninterrupted run bit for bit.
* Bad settings raise ``ValueError`` naming the problem: int4, error feedback without a
  quantized wire, a residual loaded into an optimizer without one.

The local gradients for the reference come from an untouched twin model on the same
data: in the overlapped mode a bucket's shard gradient is summed into place during
backward, so the model's own ``.grad`` is not the local gradient after ``backward()``.
"""

from __future__ import annotations

import copy
import os
import tempfile
from typing import Any

import pytest
import torch
from torch import nn

import fastreduce
from fastreduce.checkpoint import Checkpointer
from fastreduce.launch import run_ranks

from test_fused import expect_raises, guarded, per_rank
from test_quantized_wire import ref_mean

pytestmark = pytest.mark.timeout(240)

STEPS = 3
WIRES: dict[str, Any] = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": "int8"}
TRANSPORTS = ("process_group", "shm")
SPAWN_TIMEOUT = 180.0


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])


def data(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 64, generator=g) * (1.0 + rank)


def run_steps(model: nn.Module, opt: Any, steps: range) -> list[tuple[dict, dict, dict]]:
    """Per step: the local gradients (from a twin), parameters before and after."""
    import torch.distributed as dist
    rank = dist.get_rank()
    twin = copy.deepcopy(model)
    out = []
    for step in steps:
        x = data(rank, step)
        twin.load_state_dict(model.state_dict())
        twin.zero_grad(set_to_none=True)
        twin(x).square().mean().backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        model(x).square().mean().backward()
        opt.step()
        opt.wait_params()
        opt.zero_grad()
        out.append(({n: p.grad.clone() for n, p in twin.named_parameters()}, before,
                    {n: p.detach().clone() for n, p in model.named_parameters()}))
    return out


def segments_of(model: nn.Module, opt: Any) -> list[tuple[list[tuple[str, int, int]], int]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [([(names[id(s.param)], s.offset, s.numel) for s in seg.slots], seg.numel) for seg in opt.layout.segments]


def build(model: nn.Module, fmt: str, transport: str, overlap: bool, ef: bool = True, **kw: Any) -> Any:
    return fastreduce.ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=1.0, wire_dtype=WIRES[fmt],
                                    bucket_mb=0.02, transport=transport, error_feedback=ef, overlap=overlap,
                                    module=model, **kw)


def _rank(rank: int, world: int, ckpt_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fmt in WIRES:
        for transport in TRANSPORTS:
            for overlap in (True, False):
                def case(fmt=fmt, transport=transport, overlap=overlap) -> dict[str, Any]:
                    model = make_model()
                    opt = build(model, fmt, transport, overlap)
                    steps = run_steps(model, opt, range(STEPS))
                    return {"steps": steps, "segments": segments_of(model, opt), "buckets": opt.num_buckets,
                            "residual": opt.wire_state_dict()["residual"]}
                out[f"{fmt}/{transport}/{overlap}"] = guarded(case)
    for transport in TRANSPORTS:
        def gathered(transport=transport) -> dict[str, Any]:  # the parameters all-gathered in bf16
            model = make_model()
            opt = build(model, "int8", transport, True, gather_dtype=torch.bfloat16)
            steps = run_steps(model, opt, range(STEPS))
            return {"steps": steps, "segments": segments_of(model, opt), "buckets": opt.num_buckets,
                    "residual": opt.wire_state_dict()["residual"]}
        out[f"gather/{transport}"] = guarded(gathered)
    if world == 2:
        def checkpoint() -> dict[str, Any]:
            whole = make_model()
            opt = build(whole, "int8", "process_group", True)
            straight = run_steps(whole, opt, range(4))
            first = make_model()
            opt = build(first, "int8", "process_group", True)
            run_steps(first, opt, range(2))
            Checkpointer(os.path.join(ckpt_dir, "ckpt"), first, opt).save(2)
            resumed = make_model()
            opt = build(resumed, "int8", "process_group", True)
            start = Checkpointer(os.path.join(ckpt_dir, "ckpt"), resumed, opt).load_latest()
            after = run_steps(resumed, opt, range(start, 4))
            return {"start": start, "straight": [s[2] for s in straight[2:]], "resumed": [s[2] for s in after]}
        out["checkpoint"] = guarded(checkpoint)

        def bad() -> dict[str, Any]:
            model = make_model()
            plain = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=1.0)
            return {
                "int4": expect_raises(ValueError, lambda: fastreduce.ZeroOptimizer(
                    make_model().parameters(), torch.optim.SGD, lr=1.0, wire_dtype="int4")),
                "ef_without_quant": expect_raises(ValueError, lambda: fastreduce.ZeroOptimizer(
                    make_model().parameters(), torch.optim.SGD, lr=1.0, wire_dtype=torch.bfloat16,
                    error_feedback=True)),
                "load_into_plain": expect_raises(ValueError, lambda: plain.load_wire_state_dict(
                    {"residual": torch.zeros(4)})),
                "gather_fp8": expect_raises(ValueError, lambda: fastreduce.ZeroOptimizer(
                    make_model().parameters(), torch.optim.SGD, lr=1.0, gather_dtype=torch.float8_e4m3fn)),
            }
        out["bad"] = guarded(bad)
    return out


_CACHE: dict[int, list[Any]] = {}


def run(world: int) -> list[Any]:
    if world not in _CACHE:
        with tempfile.TemporaryDirectory() as d:
            _CACHE[world] = run_ranks(_rank, world, d, timeout=SPAWN_TIMEOUT)
    return _CACHE[world]


def reference(results: list[dict[str, Any]], fmt: str) -> tuple[list[dict[str, torch.Tensor]], list[torch.Tensor]]:
    """Per step, every parameter's expected shard gradient (the whole mean); final residuals."""
    world = len(results)
    segments = results[0]["segments"]
    residual = [[torch.zeros(n) for _, n in segments] for _ in range(world)]
    means = []
    for step in range(STEPS):
        mean_of: dict[str, torch.Tensor] = {}
        for s, (slots, n) in enumerate(segments):
            bufs = []
            for r in range(world):
                buf = torch.zeros(n)
                for name, off, k in slots:
                    buf[off:off + k] = results[r]["steps"][step][0][name].flatten()
                bufs.append(buf)
            e = [residual[r][s] for r in range(world)]
            mean = ref_mean(fmt, bufs, e, second=False)  # one rounding: the owner's fp32 sum is the shard's
            for r in range(world):
                residual[r][s] = e[r]
            for name, off, k in slots:
                mean_of[name] = mean[off:off + k]
        means.append(mean_of)
    return means, [torch.cat(r) for r in residual]


CASES = [(w, f, t, o) for w in (2, 3) for f in WIRES for t in TRANSPORTS for o in (True, False)]


@pytest.mark.parametrize(("world", "fmt", "transport", "overlap"), CASES,
                         ids=[f"{w}ranks-{f}-{t}-{'overlap' if o else 'at_step'}" for w, f, t, o in CASES])
def test_matches_the_reference_bit_for_bit(world: int, fmt: str, transport: str, overlap: bool) -> None:
    """Every parameter after each SGD(lr=1) step is ``before - mean`` with the mean of the
    reference, on every rank; the residual is the reference's; several buckets."""
    results = per_rank(run(world), f"{fmt}/{transport}/{overlap}")
    assert results[0]["buckets"] >= 3
    means, residuals = reference(results, fmt)
    for r, res in enumerate(results):
        for step, (_, before, after) in enumerate(res["steps"]):
            for name, got in after.items():
                want = before[name].flatten().add(means[step][name], alpha=-1.0)
                diff = (got.flatten() - want).abs().max().item()
                assert torch.equal(got.flatten(), want), f"rank {r} step {step} {name}: off by {diff}"
        assert torch.equal(res["residual"], residuals[r]), f"rank {r}: residual differs"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_parameters_gathered_in_bf16(world: int, transport: str) -> None:
    """``gather_dtype=torch.bfloat16``: the fp32 masters step with the quantized mean as
    above (SGD(lr=1): master - mean), and every rank's parameters are the masters rounded
    to bf16, on every rank alike (the owner's own chunk too)."""
    results = per_rank(run(world), f"gather/{transport}")
    means, residuals = reference(results, "int8")
    master = {name: p.flatten().clone() for name, p in results[0]["steps"][0][1].items()}  # the fp32 start
    for step in range(STEPS):
        for name in master:
            master[name] = master[name].add(means[step][name], alpha=-1.0)
        for r, res in enumerate(results):
            for name, got in res["steps"][step][2].items():
                want = master[name].to(torch.bfloat16).float()
                assert torch.equal(got.flatten(), want), f"rank {r} step {step} {name}"
    assert any(not torch.equal(master[n], master[n].to(torch.bfloat16).float()) for n in master)  # rounded
    for r, res in enumerate(results):
        assert torch.equal(res["residual"], residuals[r])


def test_the_quantized_wire_is_lossy() -> None:
    """The premise: the quantized mean differs from the exact fp32 mean (else the test
    above would not tell a quantized reduce-scatter from a plain one)."""
    results = per_rank(run(2), "int8/process_group/True")
    step0 = [r["steps"][0][0] for r in results]
    means, _ = reference(results, "int8")
    name = next(iter(step0[0]))
    exact = (step0[0][name] + step0[1][name]).flatten() / 2
    assert not torch.equal(means[0][name], exact)
    assert torch.allclose(means[0][name], exact, rtol=0, atol=exact.abs().max().item() / 50)


def test_checkpointer_keeps_the_residual() -> None:
    """Saved on disk after 2 steps, loaded into a fresh job: steps 3 and 4 equal the
    uninterrupted run's bit for bit."""
    for got in per_rank(run(2), "checkpoint"):
        assert got["start"] == 2
        for want, have in zip(got["straight"], got["resumed"]):
            for name in want:
                assert torch.equal(want[name], have[name]), name


@pytest.mark.parametrize(("name", "word"), [("int4", "int4"), ("ef_without_quant", "quantized"),
                                            ("load_into_plain", "quantized"), ("gather_fp8", "gather_dtype")])
def test_bad_settings_raise(name: str, word: str) -> None:
    for out in per_rank(run(2), "bad"):
        got = out[name]
        assert got["raised"] == "ValueError", got
        assert word in got["message"], got
