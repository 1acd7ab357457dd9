"""Non-finite gradients (``ReducerConfig.nonfinite``) on real Gloo groups: one rank's NaN or
inf reaches every rank's average, so every rank raises (``raise``, naming the parameter)
or returns ``False`` from ``reduce()`` (``skip``) alike; ``ignore`` leaves the non-finite
average as it is. Fused and overlapped, bf16 and fp32 wires, and an fp32 gradient that
only overflows the fp16 wire. No transport is hard-coded."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fastreduce
from fastreduce.launch import run_ranks

from test_fused import expect_raises, guarded, per_rank

pytestmark = pytest.mark.timeout(300)

BAD_STEP = 2
CASES = [(mode, wire, bad) for mode in ("raise", "skip", "ignore") for wire in ("bf16", "fp32")
         for bad in ("nan", "inf")] + [("skip", "fp16", "overflow")]
WIRES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def case(rank: int, world: int, mode: str, wire: str, bad: str, overlap: bool) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    reducer = fastreduce.FusedReducer(model, wire_dtype=WIRES[wire], nonfinite=mode, overlap=overlap,
                                      bucket_mb=0.0002 if overlap else None)
    out: dict = {"verdicts": [], "finite_after": []}
    value = {"nan": math.nan, "inf": math.inf, "overflow": 1e6}[bad]

    def spoil(g: torch.Tensor) -> torch.Tensor:  # in backward, before the overlapped hooks send it
        g = g.clone()
        g[0, 0] = value
        return g

    for step in range(4):
        model.zero_grad()
        handle = model[2].weight.register_hook(spoil) if step == BAD_STEP and rank == 1 else None
        model(torch.randn(4, 8)).pow(2).mean().backward()
        if handle is not None:  # one rank's gradient went bad
            handle.remove()
        if step == BAD_STEP and mode == "raise":
            out["error"] = expect_raises(fastreduce.NonFiniteGradError, reducer.reduce)
            continue
        out["verdicts"].append(reducer.reduce())
        out["finite_after"].append(all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
    out["counted"] = reducer.stats.nonfinite
    return out


def worker(rank: int, world: int, overlap: bool) -> dict:
    return {c: guarded(case, rank, world, *c, overlap) for c in CASES}


@pytest.fixture(scope="module", params=[False, True], ids=["fused", "overlap"])
def results(request) -> list[dict]:
    return run_ranks(worker, 2, request.param, timeout=240)


@pytest.mark.parametrize("mode,wire,bad", CASES, ids=["-".join(c) for c in CASES])
def test_every_rank_decides_alike(results, mode: str, wire: str, bad: str) -> None:
    for rank, out in enumerate(per_rank(results, (mode, wire, bad))):
        if mode == "raise":
            assert out["error"]["raised"] == "NonFiniteGradError", (rank, out)
            assert "'2.weight'" in out["error"]["message"], out["error"]["message"]
            assert out["verdicts"] == [True] * 3 and out["counted"] == 1, (rank, out)
        elif mode == "skip":
            assert out["verdicts"] == [True, True, False, True], (rank, out)
            assert out["finite_after"][BAD_STEP] is False and out["counted"] == 1, (rank, out)
        else:
            assert out["verdicts"] == [True] * 4 and out["counted"] == 0, (rank, out)
            assert out["finite_after"][BAD_STEP] is False, (rank, out)  # left as it is


def test_bad_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="nonfinite must be"):
        fastreduce.ReducerConfig(nonfinite="warn")
