"""Quantized wires of the fused reducer (``wire_dtype=torch.float8_e4m3fn``,
``torch.float8_e5m2`` or ``"int8"``, ``overlap=False``; the overlapped mode's are in
test_quantized_overlap.py) on real Gloo groups, CPU,
against a reference written here from the algorithm of fastreduce/comm/quantized.py:

with the wire buffer of ``n`` fp32 values (every gradient at its layout offset, zeros
in the alignment gaps and the tail padding, ``n`` a multiple of W x 256) cut into W
chunks of ``m = n / W``: every rank's buffer goes through ``BlockQuant(fmt).roundtrip``
viewed as (W, m) rows (the first rounding); the owner of chunk c sums the ranks' round
trips of chunk c in fp32 in ``sum_order(c, W)`` (``acc = q[o0]; acc += q[o1]; ...;
acc /= W``); that mean chunk goes through the round trip once more (the second
rounding); every rank's gradients are the result read back at the layout offsets.
With error feedback each rank adds its residual before the first rounding and keeps
what it rounded away (``e := fl(x + e) - rt(fl(x + e))``), and each owner does the
same for its chunk of the mean (``f := fl(mu + f) - rt(fl(mu + f))``).

Why: the wire is lossy on purpose, so the only way to know it computes the documented
mean (and not, say, a mean with different block boundaries, a different summation
order or one rounding fewer) is to compare bit for bit with that definition. The
codec itself is checked against a from-the-bits reference in tests/test_quant.py; here
``BlockQuant.roundtrip`` is trusted and what is checked is everything around it.

* Bit for bit, 3 steps of ``nn.Sequential(Linear(64, 100), GELU, Linear(100, 10))``
  with a different batch per rank, at 2, 3 and 4 ranks, all three formats, both
  transports ("process_group": encoded exchange + all-gather; "shm": the same
  roundings in place in shared memory): every rank's gradients (and the whole wire
  buffer, gaps and padding included) equal the reference; the transports agree bit
  for bit; every rank holds the same gradients. The layout follows its rule (offsets
  aligned to 32, the wire padded to a multiple of W x 256). ``QuantMean`` driven
  directly on a random buffer (below) is compared bit for bit at 2, 3, 4 and 8 ranks
  (8 Gloo ranks running the model on 2 cores would cost most of the file's time).
  int8 is what pins the block boundaries and, from 3 ranks, the summation order:
  fp8's power-of-two scales make its result nearly independent of both.
* The error bound (at 2, 3, 4 and 8 ranks, on the model's gradients and on
  ``QuantMean`` used directly on a random buffer whose blocks span six decades, with
  an all-zero block and outliers; the random buffers are checked bit for bit too).
  Per block of 256, with ``a_r`` rank r's largest |value| in the block, ``A`` the
  largest |exact mean| there and u = 2^-24, the two roundings give per element::

      |result - exact fp64 mean| <= mean_r R(a_r) + S + R(A + mean_r R(a_r) + S)
      S = 2.5 W u max_r a_r                       (the fp32 sum and division)
      int8:     R(a) = (a / 127) (1/2 + 2^-14)    (half a step of scale a / 127; the
                                                   2^-14 covers the fp32 divide and multiply)
      fp8_e4m3: R(a) = a (2^-4 + 2 * 2^-10 / 448) (1 + 2^-20)
      fp8_e5m2: R(a) = a (2^-3 + 2 * 2^-17 / 57344) (1 + 2^-20)

  fp8: the scale is a power of two in (a / max, 2 a / max], so scaling is exact and a
  normal scaled value is rounded to within 2^-(mantissa bits + 1) of itself (2^-4 for
  e4m3, 2^-3 for e5m2), a subnormal one to within half the smallest subnormal (2^-10,
  2^-17) times the scale; decoding multiplies by the power of two: exact.
* Error feedback, at 2 and 3 ranks, every format, both transports, 20 steps:
  (a) bit for bit against the reference with residuals (applied means and the final
  residuals from ``state_dict()["wire"]``), and nothing is lost: sum_t applied_t ==
  sum_t mean_r(grad_r,t) - mean_r(residual_r) - concat_c(mean_residual of chunk c's
  owner), within T (W + 4) u G, G = twice the largest |gradient| (the fp32 roundings
  of the residual's add, the W-term sum and the owner's add, per step); the residual
  terms themselves are far larger than that. (b) with the same gradients every step,
  the 20-step sum of the applied means is within 1/5 of the error without error
  feedback, and within 2 x one step's error without it.
* Checkpoint: after 3 steps with error feedback, ``state_dict()`` (through torch.save)
  loaded into a fresh reducer before its first ``reduce()`` continues bit for bit with
  the original for 3 more steps (a fresh reducer without it does not); a state with a
  "wire" entry does not load into a reducer without error feedback (``ValueError``); a
  state saved before any ``reduce()``, loaded into a reducer after 3 steps, continues bit
  for bit as a fresh reducer does.
* ``stats.bytes_reduced`` grows by W (m + 4 m / 256) per call; bad settings
  (int4, PowerSGD, unknown names, an int dtype) raise ``ValueError``;
  ``all_reduce_gradients(model, torch.float8_e4m3fn)`` (and the other two) gives the
  reducer's gradients bit for bit.

One spawn per world size (``run_ranks``) computes every case of that size; a case that
raises inside a rank fails only its own tests (``guarded``). The reference and all
assertions run here, in the parent, from what the ranks return (their own gradients
before the reduction: the all-gather of the reference).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fastreduce
from fastreduce.codecs.quant import BlockQuant
from fastreduce.comm import complete, get_comm
from fastreduce.comm.quantized import QuantMean
from fastreduce.comm.shm import sum_order
from fastreduce.launch import run_ranks

from test_fused import saved_and_loaded, case_runner, expect_raises, per_rank
from test_sparseloco import first_diff

pytestmark = pytest.mark.timeout(240)

SEED = 13
BLOCK = 256
ALIGN = 32
STEPS = 3                    # bit-for-bit steps without error feedback
EF_STEPS = 20                # error-feedback steps (invariant, fixed batch)
CKPT_AT = 3                  # steps before the state is saved; as many after
WORLDS = (2, 3, 4, 8)        # QuantMean on a random buffer
MODEL_WORLDS = (2, 3, 4)     # the model through FusedReducer (8 Gloo ranks on 2 cores: too slow)
EF_WORLDS = (2, 3)
TRANSPORTS = ("process_group", "shm")
WIRES: dict[str, Any] = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": "int8"}
SPAWN_TIMEOUT = 180.0
U = 2.0**-24                 # float32's unit roundoff
CPU = torch.device("cpu")


# ============================================================== model and data

def make_model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(64, 100), nn.GELU(), nn.Linear(100, 10))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per rank and step; inputs scaled by rank so the ranks' block scales differ."""
    g = torch.Generator().manual_seed(1000 * step + rank + 3)
    return torch.randn(8, 64, generator=g) * (1.0 + 0.5 * rank), torch.randn(8, 10, generator=g)


def backward(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fresh local gradients (zeroed first); returns copies of them."""
    model.zero_grad(set_to_none=True)
    x, y = data
    ((model(x) - y) ** 2).mean().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def expected_slots(model: nn.Module) -> list[tuple[str, int, int]]:
    """The layout rule: model order, every offset rounded up to a multiple of ALIGN."""
    out, off = [], 0
    for n, p in model.named_parameters():
        out.append((n, off, p.numel()))
        off = -(-(off + p.numel()) // ALIGN) * ALIGN
    return out


def expected_wire_numel(model: nn.Module, world: int) -> int:
    _, off, numel = expected_slots(model)[-1]
    used = -(-(off + numel) // ALIGN) * ALIGN
    return -(-used // (world * BLOCK)) * world * BLOCK


def place(grads: dict[str, torch.Tensor], slots: list[tuple[str, int, int]], n: int) -> torch.Tensor:
    """Gradients at their layout offsets in a zero buffer of ``n`` fp32 values."""
    flat = torch.zeros(n, dtype=torch.float32)
    for name, off, numel in slots:
        flat[off:off + numel] = grads[name].reshape(-1)
    return flat


# ============================================================== the reference

def roundtrip(fmt: str, x: torch.Tensor) -> torch.Tensor:
    return BlockQuant(fmt).roundtrip(x.clone())


def ref_mean(fmt: str, xs: list[torch.Tensor], e: list[torch.Tensor] | None = None,
             f: list[torch.Tensor] | None = None, second: bool = True) -> torch.Tensor:
    """The quantized mean of ``xs`` (one flat fp32 buffer per rank). With ``e`` (per
    rank, n) and ``f`` (per chunk, m), error feedback: both are updated in place.
    ``second=False``: a reduce-scatter's mean (ZeRO), the fp32 sum not rounded again."""
    W, n = len(xs), xs[0].numel()
    m = n // W
    q = []
    for r, x in enumerate(xs):
        v = x if e is None else x + e[r]
        qr = roundtrip(fmt, v.view(W, m)).view(-1)
        if e is not None:
            e[r] = v - qr
        q.append(qr)
    out = torch.empty(n, dtype=torch.float32)
    for c in range(W):
        order = sum_order(c, W)
        acc = q[order[0]][c * m:(c + 1) * m].clone()
        for k in order[1:]:
            acc += q[k][c * m:(c + 1) * m]
        acc /= W
        if not second:
            out[c * m:(c + 1) * m] = acc
            continue
        if f is not None:
            acc = acc + f[c]
        mean = roundtrip(fmt, acc)
        if f is not None:
            f[c] = acc - mean
        out[c * m:(c + 1) * m] = mean
    return out


def rounding_bound(fmt: str, a: torch.Tensor) -> torch.Tensor:
    """R(a): the most one round trip moves a value of a block whose largest |value| is a."""
    if fmt == "int8":
        return a / 127 * (0.5 + 2.0**-14)
    mant, top, half_sub = {"fp8_e4m3": (3, 448.0, 2.0**-10), "fp8_e5m2": (2, 57344.0, 2.0**-17)}[fmt]
    return a * (2.0 ** -(mant + 1) + 2 * half_sub / top) * (1 + 2.0**-20)


def mean_bound(fmt: str, xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the exact fp64 mean, per block of 256 the bound on |result - mean|; see the module docstring)."""
    W = len(xs)
    X = torch.stack(xs).double().view(W, -1, BLOCK)
    a = X.abs().amax(-1)                        # (W, blocks)
    first = rounding_bound(fmt, a).mean(0)
    summing = 2.5 * W * U * a.amax(0)
    exact = X.mean(0)
    A = exact.abs().amax(-1) + first + summing
    return exact.view(-1), first + summing + rounding_bound(fmt, A)


# ============================================================== cases run in the ranks

def reducer_info(reducer: fastreduce.FusedReducer) -> dict:
    built = reducer._built
    plan = built.plan
    return {"slots": [(s.name, s.offset, s.numel) for seg in built.layout.segments for s in seg.slots],
            "segments": len(built.layout.segments), "n": built.buffer.wire.numel(),
            "wire_dtype": built.buffer.wire.dtype, "quant": isinstance(plan, QuantMean),
            "fmt": getattr(getattr(plan, "codec", None), "fmt", None),
            "block": getattr(getattr(plan, "codec", None), "block", None),
            "shm": getattr(plan, "shm", None) is not None}


def exact_case(rank: int, world: int, fmt: str, transport: str) -> dict:
    model = make_model()
    reducer = fastreduce.FusedReducer(model, wire_dtype=WIRES[fmt], transport=transport)
    out: dict[str, Any] = {"x": [], "grads": [], "wire": [], "bytes": []}
    for step in range(STEPS):
        out["x"].append(backward(model, batch(rank, step)))
        reducer.reduce()
        out["grads"].append(grads_of(model))
        out["wire"].append(reducer._built.buffer.wire.clone())
        out["bytes"].append(reducer.stats.bytes_reduced)
    out.update(reducer_info(reducer), calls=reducer.stats.calls)
    reducer.close()
    return out


def random_buffer(rank: int, world: int, n: int) -> torch.Tensor:
    """A shared part plus a per-rank one, per block of 256 a magnitude in 1e-4..1e2;
    block 1 all zero, block 2 holds one large outlier, block 3 cancels across ranks."""
    shared = torch.Generator().manual_seed(SEED)
    mine = torch.Generator().manual_seed(SEED + 1 + rank)
    blocks = n // BLOCK
    scale = 10.0 ** (torch.rand(blocks, 1, generator=shared) * 6 - 4)
    base = torch.randn(blocks, BLOCK, generator=shared)
    x = (base + torch.randn(blocks, BLOCK, generator=mine) * torch.rand(blocks, 1, generator=mine)) * scale
    x[1] = 0.0
    x[2, 17] = 1e3 * (1 + rank)
    x[3] = base[3] * (rank - (world - 1) / 2)
    return x.view(-1).float()


def direct_case(rank: int, world: int, fmt: str, transport: str) -> dict:
    """QuantMean on a buffer of the comm, as the reducer drives it."""
    comm = get_comm(None, CPU, transport)
    n = world * BLOCK * 6
    buf = comm.buffer(n, torch.float32)
    x = random_buffer(rank, world, n)
    buf.copy_(x)
    qm = QuantMean(comm, buf, BlockQuant(fmt), piece_bytes=512)  # 3 pieces of 2 blocks on a process group
    complete(qm.start())
    return {"x": x, "out": buf.clone(), "shm": qm.shm is not None, "wire_bytes": qm.wire_bytes,
            "pieces": len(qm.pieces)}


def ef_case(rank: int, world: int, fmt: str, transport: str) -> dict:
    """20 steps with error feedback, a different batch each step (on a process group in
    pieces of 1 KiB a row: the residuals are kept per piece)."""
    import fastreduce.comm.quantized as quantized

    model = make_model()
    default, quantized.PIECE_BYTES = quantized.PIECE_BYTES, 1024
    try:
        reducer = fastreduce.FusedReducer(model, wire_dtype=WIRES[fmt], transport=transport, error_feedback=True)
        out: dict[str, Any] = {"x": [backward(model, batch(rank, 0))]}
        reducer.reduce()  # built here, in pieces
    finally:
        quantized.PIECE_BYTES = default
    out["grads"] = [grads_of(model)]
    out["pieces"] = len(reducer._built.plan.pieces)
    for step in range(1, EF_STEPS):
        out["x"].append(backward(model, batch(rank, step)))
        reducer.reduce()
        out["grads"].append(grads_of(model))
    state = reducer.state_dict()
    out.update(reducer_info(reducer), residuals=state["residuals"], wire_state=state["wire"])
    reducer.close()
    return out


def fixed_case(rank: int, world: int, fmt: str, transport: str, error_feedback: bool) -> dict:
    """20 steps of the same batch: the sum of the applied means (fp64) and the first one."""
    model = make_model()
    reducer = fastreduce.FusedReducer(model, wire_dtype=WIRES[fmt], transport=transport,
                                      error_feedback=error_feedback)
    data = batch(rank, 0)
    total: dict[str, torch.Tensor] = {}
    first: dict[str, torch.Tensor] = {}
    same_grads = True
    x0 = None
    for step in range(EF_STEPS):
        x = backward(model, data)
        x0 = x0 or x
        same_grads &= all(torch.equal(x[k], x0[k]) for k in x)
        reducer.reduce()
        for n, p in model.named_parameters():
            total[n] = total.get(n, 0) + p.grad.double()
        first = first or grads_of(model)
    reducer.close()
    return {"x": x0, "total": total, "first": first, "same_grads": same_grads}


def ckpt_case(rank: int, world: int, fmt: str, transport: str) -> dict:
    kw = {"wire_dtype": WIRES[fmt], "transport": transport}
    a = make_model()
    ra = fastreduce.FusedReducer(a, error_feedback=True, **kw)
    for step in range(CKPT_AT):
        backward(a, batch(rank, step))
        ra.reduce()
    saved = saved_and_loaded(ra.state_dict())
    b = make_model()
    b.load_state_dict(a.state_dict())
    rb = fastreduce.FusedReducer(b, error_feedback=True, **kw)
    rb.load_state_dict(saved)  # before its first reduce(): held until the layout exists
    c = make_model()
    rc = fastreduce.FusedReducer(c, error_feedback=True, **kw)  # the control: no state loaded
    out: dict[str, Any] = {"a": [], "b": [], "c": [], "saved_keys": sorted(saved),
                           "saved_wire": saved["wire"]}
    for step in range(CKPT_AT, 2 * CKPT_AT):
        for model, reducer, key in ((a, ra, "a"), (b, rb, "b"), (c, rc, "c")):
            backward(model, batch(rank, step))
            reducer.reduce()
            out[key].append(grads_of(model))
    out["state_a"], out["state_b"] = ra.state_dict()["wire"], rb.state_dict()["wire"]
    plain = fastreduce.FusedReducer(make_model(), **kw)
    out["into_plain"] = expect_raises(ValueError, lambda: plain.load_state_dict(saved))
    for r in (ra, rb, rc, plain):
        r.close()
    return out


def fresh_case(rank: int, world: int, fmt: str, transport: str) -> dict:
    """A state saved before any reduce() (its "wire" empty) loaded into a reducer after
    CKPT_AT steps, beside a fresh reducer (the reference): the next steps' gradients."""
    kw = {"wire_dtype": WIRES[fmt], "transport": transport, "error_feedback": True}
    unbuilt = fastreduce.FusedReducer(make_model(), **kw)
    fresh = saved_and_loaded(unbuilt.state_dict())
    a = make_model()
    ra = fastreduce.FusedReducer(a, **kw)
    for step in range(CKPT_AT):
        backward(a, batch(rank, step))
        ra.reduce()
    ra.load_state_dict(fresh)
    c = make_model()
    rc = fastreduce.FusedReducer(c, **kw)
    out: dict[str, Any] = {"a": [], "c": [], "fresh": fresh}
    for step in range(CKPT_AT, 2 * CKPT_AT):
        for model, reducer, key in ((a, ra, "a"), (c, rc, "c")):
            backward(model, batch(rank, step))
            reducer.reduce()
            out[key].append(grads_of(model))
    for r in (unbuilt, ra, rc):
        r.close()
    return out


def function_case(rank: int, world: int, fmt: str, transport: str) -> dict:
    f, g = make_model(), make_model()
    rg = fastreduce.FusedReducer(g, wire_dtype=WIRES[fmt], transport=transport)
    out: dict[str, Any] = {"f": [], "g": []}
    for step in range(STEPS):
        backward(f, batch(rank, step))
        fastreduce.all_reduce_gradients(f, WIRES[fmt], transport=transport)
        backward(g, batch(rank, step))
        rg.reduce()
        out["f"].append(grads_of(f))
        out["g"].append(grads_of(g))
    (rf,) = f.__dict__["_fastreduce_reducers"].values()
    out["info"] = reducer_info(rf)
    rf.close()
    rg.close()
    return out


BAD = {  # name: (settings, what the message must name)
    "int4": ({"wire_dtype": "int4"}, "int4"),
    "int8_powersgd": ({"wire_dtype": "int8", "compression": "powersgd"}, "compression"),
    "bogus": ({"wire_dtype": "bogus"}, "wire_dtype"),
    "int32": ({"wire_dtype": torch.int32}, "wire_dtype"),
}


def bad_case(rank: int, world: int) -> dict:
    out = {}
    for name, (kw, _) in BAD.items():
        kw = dict(kw)
        if kw.get("compression") == "powersgd":
            kw["compression"] = fastreduce.PowerSGD()
        model = make_model()
        out[name] = expect_raises(ValueError, lambda model=model, kw=kw: fastreduce.FusedReducer(model, **kw))
    model = make_model()
    backward(model, batch(rank, 0))
    out["function_int4"] = expect_raises(ValueError, lambda: fastreduce.all_reduce_gradients(model, "int4"))
    return out


def cases(world: int) -> list[tuple]:
    out: list[tuple] = []
    for fmt in WIRES:
        for t in TRANSPORTS:
            out.append(("direct", fmt, t))
            if world in MODEL_WORLDS:
                out.append(("exact", fmt, t))
            if world in EF_WORLDS:
                out.append(("ef", fmt, t))
            if world == 2:
                out += [("fixed", fmt, t, False), ("fixed", fmt, t, True), ("ckpt", fmt, t), ("fresh", fmt, t),
                        ("function", fmt, t)]
    if world == 2:
        out.append(("bad",))
    return out


CASE_FNS = {"exact": exact_case, "direct": direct_case, "ef": ef_case, "fixed": fixed_case,
            "ckpt": ckpt_case, "fresh": fresh_case, "function": function_case, "bad": bad_case}


run = case_runner(__name__, cases, SPAWN_TIMEOUT)
"""One group per world size (started by the first test that asks), every case of it."""


def ids(v: Any) -> str:
    return f"world{v}" if isinstance(v, int) else str(v)


GRID = [(w, f, t) for w in MODEL_WORLDS for f in WIRES for t in TRANSPORTS]
DIRECT_GRID = [(w, f, t) for w in WORLDS for f in WIRES for t in TRANSPORTS]
EF_GRID = [(w, f, t) for w in EF_WORLDS for f in WIRES for t in TRANSPORTS]
W2_GRID = [(f, t) for f in WIRES for t in TRANSPORTS]


def placed(out: dict, key: str) -> list[torch.Tensor]:
    """Each step's gradients under ``key`` at the reducer's layout offsets."""
    return [place(g, out["slots"], out["n"]) for g in out[key]]


# ============================================================== 1. bit for bit

@pytest.mark.parametrize("world,fmt,transport", GRID, ids=ids)
def test_layout_and_plan_follow_the_rules(world: int, fmt: str, transport: str) -> None:
    """One fp32 segment with offsets aligned to 32, the wire padded to a multiple of
    W x 256, and the plan a QuantMean of the format (on shared memory only for shm)."""
    model = make_model()
    for out in per_rank(run(world), ("exact", fmt, transport)):
        assert out["slots"] == expected_slots(model)
        assert out["segments"] == 1 and out["wire_dtype"] == torch.float32
        assert out["n"] == expected_wire_numel(model, world) and out["n"] % (world * BLOCK) == 0
        assert (out["quant"], out["fmt"], out["block"]) == (True, fmt, BLOCK)
        assert out["shm"] == (transport == "shm")


@pytest.mark.parametrize("world,fmt,transport", GRID, ids=ids)
def test_grads_equal_the_reference_bit_for_bit(world: int, fmt: str, transport: str) -> None:
    """At every step every rank's gradients, and its whole wire buffer, equal the
    reference mean of the ranks' placed gradients (torch.equal)."""
    outs = per_rank(run(world), ("exact", fmt, transport))
    slots, n = outs[0]["slots"], outs[0]["n"]
    for step in range(STEPS):
        want = ref_mean(fmt, [place(o["x"][step], slots, n) for o in outs])
        for rank, out in enumerate(outs):
            assert torch.equal(out["wire"][step], want), \
                f"rank {rank} step {step}: wire buffer: {first_diff(out['wire'][step], want)}"
            for name, off, numel in slots:
                got = out["grads"][step][name]
                w = want[off:off + numel].view(got.shape)
                assert torch.equal(got, w), f"rank {rank} step {step} {name}: {first_diff(got.flatten(), w.flatten())}"


@pytest.mark.parametrize("world,fmt,transport", GRID, ids=ids)
def test_every_rank_holds_the_same_grads(world: int, fmt: str, transport: str) -> None:
    """Every rank's gradients are bit-identical to rank 0's at every step."""
    outs = per_rank(run(world), ("exact", fmt, transport))
    for rank, out in enumerate(outs[1:], start=1):
        for step in range(STEPS):
            for name, g in outs[0]["grads"][step].items():
                assert torch.equal(out["grads"][step][name], g), f"rank {rank} step {step} {name}"


@pytest.mark.parametrize("world", WORLDS, ids=ids)
@pytest.mark.parametrize("fmt", list(WIRES))
def test_transports_agree_bit_for_bit(world: int, fmt: str) -> None:
    """The shm and process_group transports give bit-identical results (the model's
    gradients, and QuantMean on a random buffer)."""
    res = run(world)
    if world in MODEL_WORLDS:
        pg, shm = per_rank(res, ("exact", fmt, "process_group")), per_rank(res, ("exact", fmt, "shm"))
        for rank, (a, b) in enumerate(zip(pg, shm)):
            for step in range(STEPS):
                for name, g in a["grads"][step].items():
                    assert torch.equal(b["grads"][step][name], g), f"rank {rank} step {step} {name}"
    pg, shm = per_rank(res, ("direct", fmt, "process_group")), per_rank(res, ("direct", fmt, "shm"))
    for rank, (a, b) in enumerate(zip(pg, shm)):
        assert torch.equal(a["out"], b["out"]), f"rank {rank}: {first_diff(a['out'], b['out'])}"


@pytest.mark.parametrize("world,fmt,transport", DIRECT_GRID, ids=ids)
def test_quant_mean_on_a_random_buffer_equals_the_reference(world: int, fmt: str, transport: str) -> None:
    """QuantMean driven directly on a buffer of blocks of six decades of magnitude (an
    all-zero block, an outlier, a block that cancels) gives the reference bit for bit."""
    outs = per_rank(run(world), ("direct", fmt, transport))
    want = ref_mean(fmt, [o["x"] for o in outs])
    for rank, out in enumerate(outs):
        assert out["shm"] == (transport == "shm")
        assert out["pieces"] == (0 if transport == "shm" else 3)  # pipelined in pieces on a process group
        assert torch.equal(out["out"], want), f"rank {rank}: {first_diff(out['out'], want)}"


# ============================================================== 2. the error bound

def assert_within_bound(fmt: str, xs: list[torch.Tensor], got: torch.Tensor, where: str) -> None:
    exact, bound = mean_bound(fmt, xs)
    err = (got.double() - exact).abs().view(-1, BLOCK).amax(-1)
    over = (err > bound).nonzero().flatten()
    assert not over.numel(), (f"{where}: block {int(over[0])}: error {err[over[0]].item():.3e} > "
                              f"bound {bound[over[0]].item():.3e}")
    assert err.max() > 0, f"{where}: nothing was rounded?"


@pytest.mark.parametrize("world,fmt,transport", GRID, ids=ids)
def test_model_mean_error_within_two_roundings(world: int, fmt: str, transport: str) -> None:
    """Per block, |result - exact fp64 mean| of the model's gradients is within the
    two-rounding bound of the module docstring, at every step, on every rank."""
    outs = per_rank(run(world), ("exact", fmt, transport))
    slots, n = outs[0]["slots"], outs[0]["n"]
    for step in range(STEPS):
        xs = [place(o["x"][step], slots, n) for o in outs]
        for rank, out in enumerate(outs):
            assert_within_bound(fmt, xs, out["wire"][step], f"rank {rank} step {step}")


@pytest.mark.parametrize("world,fmt,transport", DIRECT_GRID, ids=ids)
def test_random_mean_error_within_two_roundings(world: int, fmt: str, transport: str) -> None:
    """Per block, |result - exact fp64 mean| of a random buffer (six decades of block
    magnitudes, outliers, cancellation) is within the two-rounding bound, on every rank."""
    outs = per_rank(run(world), ("direct", fmt, transport))
    for rank, out in enumerate(outs):
        assert_within_bound(fmt, [o["x"] for o in outs], out["out"], f"rank {rank}")


# ============================================================== 3. error feedback

@pytest.mark.parametrize("world,fmt,transport", EF_GRID, ids=ids)
def test_error_feedback_matches_the_reference_bit_for_bit(world: int, fmt: str, transport: str) -> None:
    """With error feedback, 20 steps: every applied mean and the final residuals
    (``state_dict()["wire"]``, the owner's chunk as mean_residual) equal the reference's;
    on a process group the buffer went in pieces (1 KiB a row), each keeping its residuals."""
    outs = per_rank(run(world), ("ef", fmt, transport))
    assert all((o["pieces"] > 1) == (transport == "process_group") for o in outs), [o["pieces"] for o in outs]
    slots, n = outs[0]["slots"], outs[0]["n"]
    m = n // world
    e = [torch.zeros(n) for _ in range(world)]
    f = [torch.zeros(m) for _ in range(world)]
    for step in range(EF_STEPS):
        want = ref_mean(fmt, [place(o["x"][step], slots, n) for o in outs], e, f)
        for rank, out in enumerate(outs):
            got = place(out["grads"][step], slots, n)
            assert torch.equal(got, want), f"rank {rank} step {step}: {first_diff(got, want)}"
    for rank, out in enumerate(outs):
        assert out["residuals"] == {}, "the quantized wire keeps its residuals under 'wire' only"
        st = out["wire_state"]
        assert torch.equal(st["residual"], e[rank]), f"rank {rank} residual: {first_diff(st['residual'], e[rank])}"
        assert torch.equal(st["mean_residual"], f[rank]), \
            f"rank {rank} mean_residual: {first_diff(st['mean_residual'], f[rank])}"


@pytest.mark.parametrize("world,fmt,transport", EF_GRID, ids=ids)
def test_error_feedback_loses_nothing(world: int, fmt: str, transport: str) -> None:
    """sum_t applied_t == sum_t exact mean_t - mean_r(residual_r) - concat(mean residuals),
    within T (W + 4) u G (G = 2 max |gradient|), while the residual terms are > 10x that."""
    outs = per_rank(run(world), ("ef", fmt, transport))
    slots, n = outs[0]["slots"], outs[0]["n"]
    applied = sum(place(g, slots, n).double() for g in outs[0]["grads"])
    xs = [[place(x, slots, n).double() for x in o["x"]] for o in outs]
    exact = sum(sum(x[t] for x in xs) / world for t in range(EF_STEPS))
    residual = sum(o["wire_state"]["residual"].double() for o in outs) / world
    mean_residual = torch.cat([o["wire_state"]["mean_residual"].double() for o in outs])
    G = 2 * max(float(x.abs().max()) for per in xs for x in per)
    tol = EF_STEPS * (world + 4) * U * G
    gap = (applied - (exact - residual - mean_residual)).abs().max().item()
    assert gap <= tol, f"sum of applied means misses the bookkeeping by {gap:.3e} > {tol:.3e}"
    carried = (residual + mean_residual).abs().max().item()
    assert carried > 10 * tol, f"residual terms {carried:.3e} are no larger than the tolerance {tol:.3e}"


@pytest.mark.parametrize("fmt,transport", W2_GRID)
def test_error_feedback_cancels_the_rounding_of_fixed_grads(fmt: str, transport: str) -> None:
    """Same gradients for 20 steps: |sum applied - 20 x exact mean| with error feedback
    is <= 1/5 of it without, and <= 2 x one step's error without error feedback."""
    res = run(2)
    plain = per_rank(res, ("fixed", fmt, transport, False))
    fed = per_rank(res, ("fixed", fmt, transport, True))
    for out in plain + fed:
        assert out["same_grads"]
    names = list(plain[0]["x"])
    exact = {k: sum(o["x"][k].double() for o in plain) / len(plain) for k in names}

    def err(out: dict, key: str, times: int) -> float:
        return max((out[key][k].double() - times * exact[k]).abs().max().item() for k in names)

    one_step = err(plain[0], "first", 1)
    without, with_ef = err(plain[0], "total", EF_STEPS), err(fed[0], "total", EF_STEPS)
    assert one_step > 0
    assert with_ef <= without / 5, f"with error feedback {with_ef:.3e}, without {without:.3e}"
    assert with_ef <= 2 * one_step, f"with error feedback {with_ef:.3e}, one step without {one_step:.3e}"
    for rank, (a, b) in enumerate(zip(plain, fed)):  # every rank applied the same sums
        for k in names:
            assert torch.equal(a["total"][k], plain[0]["total"][k]) and torch.equal(b["total"][k], fed[0]["total"][k])


# ============================================================== 4. checkpoint

@pytest.mark.parametrize("fmt,transport", W2_GRID)
def test_checkpoint_resume_is_bit_for_bit(fmt: str, transport: str) -> None:
    """A fresh reducer that loads the state (saved after 3 steps) before its first
    reduce() gives the original's gradients and residuals bit for bit for 3 more steps;
    one that does not load it differs."""
    for rank, out in enumerate(per_rank(run(2), ("ckpt", fmt, transport))):
        assert out["saved_keys"] == ["residuals", "wire"]
        assert set(out["saved_wire"]) == {"residual", "mean_residual"}
        assert out["saved_wire"]["residual"].abs().max() > 0
        for step, (a, b) in enumerate(zip(out["a"], out["b"])):
            for name in a:
                assert torch.equal(a[name], b[name]), f"rank {rank} step {step} {name}"
        for key in ("residual", "mean_residual"):
            assert torch.equal(out["state_a"][key], out["state_b"][key]), f"rank {rank} {key}"
        assert any(not torch.equal(a[k], c[k]) for a, c in zip(out["a"], out["c"]) for k in a), \
            "the control (no state loaded) gives the same gradients: the test shows nothing"


@pytest.mark.parametrize("fmt,transport", W2_GRID)
def test_a_state_saved_before_the_first_reduce_makes_a_live_reducer_fresh(fmt: str, transport: str) -> None:
    """Its empty "wire" left the live reducer's residuals in place: the next steps differed
    from a fresh reducer's. They are now the same, bit for bit."""
    for rank, out in enumerate(per_rank(run(2), ("fresh", fmt, transport))):
        assert out["fresh"] == {"residuals": {}, "wire": {}}, out["fresh"]
        for step, (a, c) in enumerate(zip(out["a"], out["c"])):
            for name in a:
                assert torch.equal(a[name], c[name]), f"rank {rank} step {CKPT_AT + step} {name}"


@pytest.mark.parametrize("fmt,transport", W2_GRID)
def test_wire_state_needs_error_feedback(fmt: str, transport: str) -> None:
    """A state with a 'wire' entry loaded into a reducer without error feedback raises
    ValueError naming error_feedback."""
    for out in per_rank(run(2), ("ckpt", fmt, transport)):
        got = out["into_plain"]
        assert got["raised"] == "ValueError", got
        assert "error_feedback" in got["message"], got


# ============================================================== 5. bad settings

@pytest.mark.parametrize("name", list(BAD) + ["function_int4"])
def test_bad_settings_raise_value_error(name: str) -> None:
    """int4, compression=, unknown names and non-float dtypes raise a
    ValueError naming the culprit, on every rank."""
    word = BAD[name][1] if name in BAD else "int4"
    for out in per_rank(run(2), ("bad",)):
        got = out[name]
        assert got["raised"] == "ValueError", got
        assert word in got["message"], got


# ============================================================== 6. bytes

@pytest.mark.parametrize("world,fmt,transport", GRID, ids=ids)
def test_bytes_reduced_are_codes_and_scales(world: int, fmt: str, transport: str) -> None:
    """stats.bytes_reduced grows by W (m + 4 m / 256) per call, m = wire length / W."""
    for out in per_rank(run(world), ("exact", fmt, transport)):
        m = out["n"] // world
        per_call = world * (m + 4 * m // BLOCK)
        assert out["bytes"] == [per_call * (k + 1) for k in range(STEPS)]
        assert out["calls"] == STEPS


@pytest.mark.parametrize("world,fmt,transport", DIRECT_GRID, ids=ids)
def test_quant_mean_wire_bytes_are_codes_and_scales(world: int, fmt: str, transport: str) -> None:
    """QuantMean.wire_bytes (what the reducer counts) is W (m + 4 m / 256)."""
    for out in per_rank(run(world), ("direct", fmt, transport)):
        m = BLOCK * 6
        assert out["wire_bytes"] == world * (m + 4 * m // BLOCK)


# ============================================================== 7. the function form

@pytest.mark.parametrize("fmt,transport", W2_GRID)
def test_all_reduce_gradients_equals_the_reducer(fmt: str, transport: str) -> None:
    """all_reduce_gradients(model, wire) gives a FusedReducer's gradients bit for bit,
    through a QuantMean of that format."""
    for rank, out in enumerate(per_rank(run(2), ("function", fmt, transport))):
        assert (out["info"]["quant"], out["info"]["fmt"], out["info"]["shm"]) == (True, fmt, transport == "shm")
        for step, (f, g) in enumerate(zip(out["f"], out["g"])):
            for name in g:
                assert torch.equal(f[name], g[name]), f"rank {rank} step {step} {name}"


# ============================================================== torch.compile

def compiled_case(rank: int, world: int, backend: str) -> dict:
    """Five AdamW steps through an int8 wire with error feedback, on the plain model and on
    torch.compile(model, backend=backend)."""
    out = {}
    for compiled in (False, True):
        m = make_model()
        run = torch.compile(m, backend=backend) if compiled else m
        red = fastreduce.FusedReducer(m, wire_dtype="int8", error_feedback=True)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        for step in range(5):
            x, y = batch(rank, step)
            nn.functional.mse_loss(run(x), y).backward()
            red.reduce()
            opt.step()
            opt.zero_grad()
        out[compiled] = torch.cat([p.detach().flatten() for p in m.parameters()])
    return out


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_model_gives_the_same_parameters(backend: str) -> None:
    """docs/design.md, invariant 7 with a quantized wire: compiled or not, the same parameters (aot_eager:
    bit for bit; inductor's fused kernels round the gradients differently: within 1e-5)."""
    for r in run_ranks(compiled_case, 2, backend, timeout=300):
        if backend == "aot_eager":
            assert torch.equal(r[False], r[True])
        else:
            torch.testing.assert_close(r[True], r[False], rtol=0, atol=1e-5)
