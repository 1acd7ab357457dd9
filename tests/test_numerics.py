"""Wire and accumulation dtypes against an fp64 reference built with ``dist.all_reduce``.

The error of a low-precision wire is measured, not assumed: each rank draws grads of
a different scale, the reference is the fp64 average of the very same values, and
the relative error (Frobenius norm) of every wire/accumulation choice is compared
with what its number of roundings allows.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fastreduce
from fastreduce.launch import run_ranks

pytestmark = pytest.mark.timeout(240)

CHOICES = {
    "fp32": dict(wire_dtype=torch.float32),
    "bf16": dict(wire_dtype=torch.bfloat16),
    "bf16+fp32acc": dict(wire_dtype=torch.bfloat16, accumulate_dtype=torch.float32),
    "fp16": dict(wire_dtype=torch.float16),
    "fp16+fp32acc": dict(wire_dtype=torch.float16, accumulate_dtype=torch.float32),
}
# What k roundings are held to: k * UNIT. fp32: its unit roundoff u = 2**-24. bf16 and
# fp16: half theirs (u = 2**-8, 2**-11), a deliberately tight yardstick that the
# norm-wise error of random data still meets (about 0.6 u after two roundings).
UNIT = {"fp32": 2.0**-24, "bf16": 2.0**-9, "fp16": 2.0**-12}


def _errors(rank: int, world: int) -> dict[str, dict]:
    out = {}
    for name, cfg in CHOICES.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(300, 301), nn.Linear(301, 7))  # 4 tensors, odd sizes
        torch.manual_seed(100 + rank)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * (1 + rank)
        ref = torch.cat([p.grad.double().flatten() for p in model.parameters()])
        dist.all_reduce(ref)
        ref /= world
        reducer = fastreduce.FusedReducer(model, **cfg)
        reducer.reduce()
        got = torch.cat([p.grad.double().flatten() for p in model.parameters()])
        everyone = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(everyone, got)
        out[name] = {"err": ((got - ref).norm() / ref.norm()).item(),
                     "same_on_all_ranks": all(torch.equal(e, got) for e in everyone),
                     "collectives": reducer.stats.collectives,
                     "plan": repr(reducer._built.plan)}
    return out


def _shm(rec: dict) -> bool:
    return "shared memory" in rec["plan"]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def errors(request) -> tuple[int, dict[str, dict]]:
    world = request.param
    return world, run_ranks(_errors, world, timeout=180)[0]


def test_every_choice_is_within_its_rounding_bound(errors):
    world, err = errors
    # Norm-wise error of k roundings of random data stays well under k * u; a sum in
    # the wire dtype rounds up to world - 1 more times on the way (ring or tree). The
    # shared-memory transport always sums in fp32 (or, bf16 at 2 ranks, rounds the
    # exact sum once): two roundings.
    for name, rec in err.items():
        wire = name.split("+")[0]
        fp32_sum = name.endswith("fp32acc") or wire == "fp32" or _shm(rec)
        roundings = 2 if fp32_sum else world + 1
        assert rec["err"] <= roundings * UNIT[wire], (name, rec)


def test_fp32_accumulation_rounds_twice_at_any_world_size(errors):
    world, err = errors
    for wire in ("bf16", "fp16"):
        acc = err[f"{wire}+fp32acc"]
        assert acc["err"] <= 2 * UNIT[wire]
        if _shm(acc):  # one shared-memory job, summing in fp32 by itself
            assert acc["collectives"] == 1
        else:
            assert "fp32 accumulate" in acc["plan"]
            assert acc["collectives"] == 2  # all-to-all out, all-gather back: ring all-reduce bytes
        if world > 2:  # a wire-dtype sum rounds more often; fp32 accumulation must not be worse
            assert acc["err"] <= err[wire]["err"] * 1.05


def test_results_are_bitwise_identical_on_all_ranks(errors):
    _, err = errors
    assert all(rec["same_on_all_ranks"] for rec in err.values()), err


def test_fp32_wire_is_exact_to_fp32_rounding(errors):
    _, err = errors
    assert err["fp32"]["err"] < 1e-6


@pytest.mark.parametrize("cfg, message", [
    (dict(accumulate_dtype=torch.bfloat16), "accumulate_dtype must be None or torch.float32"),
    (dict(accumulate_dtype=torch.float32, overlap=True), "fused mode only"),
])
def test_bad_accumulate_settings_raise(cfg, message):
    with pytest.raises(ValueError, match=message):
        fastreduce.ReducerConfig(**cfg)
