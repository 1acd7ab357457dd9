"""Wire and accumulation dtypes against an fp64 reference built with ``dist.all_reduce``.

The error of a low-precision wire is measured, not assumed: each rank draws grads of
a different scale, the reference is the fp64 average of the very same values, and
the relative error (Frobenius norm) of every wire/accumulation choice is compared
with what its number of roundings allows. The overlapped mode (``/overlap``) reduces
the same values, produced by a real backward so that its buckets are launched from the
gradient hooks; with fp32 accumulation its error must stay flat from 2 to 8 ranks
and equal the fused mode's. ``python tests/test_numerics.py`` prints the table.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fastreduce
from fastreduce.comm import complete
from fastreduce.launch import run_ranks

from test_fused import ALLOCATING_OPS, OpRecorder

pytestmark = pytest.mark.timeout(240)

CHOICES = {
    "fp32": dict(wire_dtype=torch.float32),
    "bf16": dict(wire_dtype=torch.bfloat16),
    "bf16+fp32acc": dict(wire_dtype=torch.bfloat16, accumulate_dtype=torch.float32),
    "fp16": dict(wire_dtype=torch.float16),
    "fp16+fp32acc": dict(wire_dtype=torch.float16, accumulate_dtype=torch.float32),
    "bf16/overlap": dict(wire_dtype=torch.bfloat16, overlap=True, bucket_mb=0.001),
    "bf16+fp32acc/overlap": dict(wire_dtype=torch.bfloat16, accumulate_dtype=torch.float32, overlap=True,
                                 bucket_mb=0.001),
}
FLAT = ("bf16", "bf16+fp32acc", "bf16/overlap", "bf16+fp32acc/overlap")  # what 8 ranks measure
# What k roundings are held to: k * UNIT. fp32: its unit roundoff u = 2**-24. bf16 and
# fp16: half theirs (u = 2**-8, 2**-11), a deliberately tight yardstick that the
# norm-wise error of random data still meets (about 0.6 u after two roundings).
UNIT = {"fp32": 2.0**-24, "bf16": 2.0**-9, "fp16": 2.0**-12}


def _backward(model: nn.Module, grads: list[torch.Tensor]) -> None:
    """A backward whose gradients are exactly ``grads`` (d/dp sum(p * g) = g), so the
    overlapped mode's hooks fire as in training."""
    sum((p * g).sum() for p, g in zip(model.parameters(), grads)).backward()


def _errors(rank: int, world: int, names: tuple[str, ...] = tuple(CHOICES)) -> dict[str, dict]:
    out = {}
    for name in names:
        cfg = CHOICES[name]
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(300, 301), nn.Linear(301, 7))  # 4 tensors, odd sizes
        torch.manual_seed(100 + rank)
        grads = [torch.randn_like(p) * (1 + rank) for p in model.parameters()]
        ref = torch.cat([g.double().flatten() for g in grads])
        dist.all_reduce(ref)
        ref /= world
        reducer = fastreduce.FusedReducer(model, **cfg)
        if cfg.get("overlap"):  # the first step learns the backward order; the second is measured
            _backward(model, grads)
            reducer.reduce()
            reducer.zero_grad()
            _backward(model, grads)
            launched = reducer.stats.launched_in_backward
        else:
            for p, g in zip(model.parameters(), grads):
                p.grad = g
        reducer.reduce()
        got = torch.cat([p.grad.double().flatten() for p in model.parameters()])
        allocs = None
        if cfg.get("overlap"):  # a warm launch and wait of every bucket, as from the hooks: no allocation
            launch = reducer._built.schedule.launch
            with OpRecorder() as rec:
                for work in [launch(b, True) for b in range(reducer.num_buckets)]:
                    complete(work)
            allocs = [op for op in rec.ops if op.split(".")[1] in ALLOCATING_OPS or ".new_" in op]
        everyone = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(everyone, got)
        out[name] = {"err": ((got - ref).norm() / ref.norm()).item(),
                     "same_on_all_ranks": all(torch.equal(e, got) for e in everyone),
                     "collectives": reducer.stats.collectives,
                     "plan": repr(reducer._built.plan),
                     "buckets": reducer.num_buckets,
                     "launched_in_backward": reducer.stats.launched_in_backward - launched if cfg.get("overlap")
                     else 0,
                     "result": got, "allocs": allocs}
    return out


def _shm(rec: dict) -> bool:
    return "shared memory" in rec["plan"]


def _fp32acc(name: str) -> bool:
    return "+fp32acc" in name


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def errors(request) -> tuple[int, dict[str, dict]]:
    world = request.param
    return world, run_ranks(_errors, world, timeout=180)[0]


@pytest.fixture(scope="module")
def flat_errors() -> dict[int, dict[str, dict]]:
    """The bf16 choices at 2 and 8 ranks (8 processes: fine on 2 cores, a few seconds)."""
    return {world: run_ranks(_errors, world, FLAT, timeout=180)[0] for world in (2, 8)}


def test_every_choice_is_within_its_rounding_bound(errors):
    world, err = errors
    # Norm-wise error of k roundings of random data stays well under k * u; a sum in
    # the wire dtype rounds up to world - 1 more times on the way (ring or tree). The
    # shared-memory transport always sums in fp32 (or, bf16 at 2 ranks, rounds the
    # exact sum once): two roundings.
    for name, rec in err.items():
        wire = name.split("+")[0].split("/")[0]
        fp32_sum = _fp32acc(name) or wire == "fp32" or _shm(rec)
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


def test_overlap_fp32_accumulation_equals_the_fused_mode(errors):
    world, err = errors
    fused, overlap = err["bf16+fp32acc"], err["bf16+fp32acc/overlap"]
    assert overlap["buckets"] > 1 and overlap["launched_in_backward"] == overlap["buckets"], overlap
    if not _shm(overlap):  # per bucket: all-to-all out, gather back
        assert "fp32 accumulate" in overlap["plan"]
        assert overlap["collectives"] == 2 * 2 * overlap["buckets"], overlap  # two steps
    assert overlap["allocs"] == [], overlap["allocs"]  # the two-phase launch reuses its scratch
    # Each element is summed in fp32 and rounded once, however the buffer is cut into
    # buckets: the very same bits (a chunk's order of ranks follows its owner, but a
    # few bf16 values sum exactly in fp32).
    torch.testing.assert_close(overlap["result"], fused["result"], rtol=0, atol=0)


def test_overlap_fp32_accumulation_error_is_flat_from_2_to_8_ranks(flat_errors):
    two, eight = flat_errors[2], flat_errors[8]
    for name in ("bf16+fp32acc", "bf16+fp32acc/overlap"):
        assert abs(eight[name]["err"] - two[name]["err"]) <= 0.10 * two[name]["err"], (name, two[name], eight[name])
        assert eight[name]["err"] <= 2 * UNIT["bf16"]
    for name in ("bf16", "bf16/overlap"):
        if not _shm(eight[name]):  # a bf16 sum over the process group rounds at every hop
            assert eight[name]["err"] > 1.3 * two[name]["err"], (name, two[name], eight[name])
            assert eight[name]["err"] > 1.3 * eight[f"bf16+fp32acc{name[4:]}"]["err"]


@pytest.mark.parametrize("cfg, message", [
    (dict(accumulate_dtype=torch.bfloat16), "accumulate_dtype must be None or torch.float32"),
])
def test_bad_accumulate_settings_raise(cfg, message):
    with pytest.raises(ValueError, match=message):
        fastreduce.ReducerConfig(**cfg)


if __name__ == "__main__":  # the numerics table: python tests/test_numerics.py [ranks ...]
    import sys

    worlds = [int(w) for w in sys.argv[1:]] or [2, 4, 8]
    rows = {w: run_ranks(_errors, w, timeout=600)[0] for w in worlds}
    print("ranks | " + " | ".join(CHOICES) + " | transport")
    for w, err in rows.items():
        print(f"{w} | " + " | ".join(f"{err[n]['err']:.3g}" for n in CHOICES)
              + f" | {'shared memory' if _shm(err['bf16']) else 'process group'}")
