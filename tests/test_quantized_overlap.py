"""Quantized wires of the overlapped reducer (``FusedReducer(model, overlap=True,
wire_dtype=torch.float8_e4m3fn | torch.float8_e5m2 | "int8")``; the fused mode's are in
test_quantized_wire.py) on real Gloo groups, CPU, against a reference written here from
the algorithm of fastreduce/comm/quantized.py (``QuantMeans``: a ``QuantMean`` per
bucket) and fastreduce/modes/overlap.py (``quant_launcher``):

every bucket is one layout segment of its own, an fp32 wire slice of ``n`` values
(every gradient at its slot offset, zeros in the alignment gaps and the tail padding,
``n`` a multiple of W x 256), cut into W chunks of ``m = n / W``. Per bucket, on its
own: every rank's slice goes through ``BlockQuant(fmt).roundtrip`` viewed as (W, m)
rows (the first rounding); the owner of chunk c sums the ranks' round trips of chunk c
in fp32 in ``sum_order(c, W)`` (``acc = q[o0]; acc += q[o1]; ...; acc /= W``); the
mean chunk goes through the round trip once more (the second rounding); every rank's
gradients are the result read back at the slot offsets (cast back to the parameter's
dtype for a bfloat16 one, whose gradient went into the fp32 wire upcast). With error
feedback each rank adds its residual of that bucket before the first rounding and
keeps what it rounded away (``e := fl(x + e) - rt(fl(x + e))``), and each chunk's owner
does the same for its chunk of that bucket's mean (``f := fl(mu + f) - rt(fl(mu + f))``).
``state_dict()["wire"]`` holds every bucket's two residuals end to end in bucket
order: the buckets are launched in backward order and the layout (hence the wire
buffer) is laid out in backward order too, so that is the wire buffer's order.

Why: the buckets change what is rounded together (a block never spans two buckets, and
each bucket is padded on its own), the exchanges start from gradient hooks during
backward and one bucket's sum runs while the next one's exchange is in flight; none of
that may change a bit of the documented per-bucket mean. The codec is checked in
tests/test_quant.py; ``BlockQuant.roundtrip`` is trusted here.

The reference's inputs, each rank's own gradients, are taken with ``torch.autograd.grad``
on the same model and batch before the real backward: once the reducer is built, the
real backward's hooks start the exchange, and with error feedback (or on shared memory,
where the first rounding happens in place) ``param.grad`` is no longer the local
gradient by the time the backward returns. At step 0 (no exchange starts in backward:
the first step learns the order) the two are checked to be equal.

* Bit for bit, 3 steps of 6 x ``Linear(128, 128)`` (GELU between) with ``bucket_mb=0.1``
  (3 buckets of 2 layers, padded each), a different batch per rank and step (inputs
  scaled by 1 + rank so the block scales differ), at 2 and 3 ranks, all three formats,
  both transports ("process_group": encoded exchange + all-gather; "shm": the same
  roundings in place in shared memory): every rank's gradients and its whole wire
  buffer equal the reference; the transports agree bit for bit; every rank holds the
  same gradients; the first step launches nothing in backward, later ones every bucket.
* Mixed dtypes: one of the Linears in bfloat16, int8 wire, 2 and 3 ranks, both
  transports: the bf16 gradients are reduced upcast in their own bucket and cast back.
* Error feedback, 2 ranks, int8 and fp8_e4m3, both transports, 10 steps: bit for bit
  with the residuals, and the final residuals are ``state_dict()["wire"]``'s.
* Checkpoint: after 3 steps with error feedback, ``state_dict()`` (through torch.save)
  loaded into a fresh overlapped reducer before its first ``reduce()`` continues bit for
  bit for 3 more steps (a fresh reducer without it does not). The fused reducer's state
  (one padded segment) does not fit the overlapped one's (one padding per bucket):
  ``ValueError``, both ways, nothing changed; loaded into a fresh overlapped reducer it
  is held (its buckets do not exist yet) and the ``ValueError`` comes from the first
  ``reduce()``.
* ``stats.bytes_reduced`` grows by sum over buckets of W (m + 4 m / 256) per call.
* ``torch.compile(model, backend="aot_eager")``, 5 AdamW steps through the overlapped
  int8 wire with error feedback: plain and compiled, every step's reduced gradients equal
  the reference over that run's own buckets, and the ranks agree; and docs/design.md, invariant 7:
  the compiled run's parameters are the plain run's, bit for bit. (Compiled whole, the
  backward is one node whose gradients arrive in another order; a quantized mean depends
  on what is rounded together, so the quantized overlapped mode lays its buckets out in
  reverse model order, not in the learned backward order: the same buckets either way.)

One spawn per world size (``run_ranks``) computes every case of that size; a case that
raises inside a rank fails only its own tests (``guarded``). The reference and all
assertions run here, in the parent, from what the ranks return.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fastreduce
from fastreduce.codecs.quant import BlockQuant
from fastreduce.comm.quantized import QuantMeans

from test_quantized_wire import ref_mean
from test_sparseloco import first_diff
from test_fused import saved_and_loaded, case_runner, expect_raises, per_rank

pytestmark = pytest.mark.timeout(240)

SEED = 29
BLOCK = 256
LAYERS, WIDTH = 6, 128
BUCKET_MB = 0.1              # 26214 fp32 values: buckets of 2 Linear(128, 128)
STEPS = 3                    # bit-for-bit steps without error feedback
EF_STEPS = 10
CKPT_AT = 3                  # steps before the state is saved; as many after
COMPILED_STEPS = 5
WORLDS = (2, 3)
TRANSPORTS = ("process_group", "shm")
WIRES: dict[str, Any] = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": "int8"}
EF_FORMATS = ("int8", "fp8_e4m3")
BF16_LAYER = 2               # index (in the Sequential) of the Linear kept in bfloat16
SPAWN_TIMEOUT = 200.0


# ============================================================== model and data

class Cast(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


def make_model(mixed: bool = False) -> nn.Sequential:
    """6 x Linear(128, 128) with GELU between; ``mixed``: the third Linear in bfloat16
    (its input cast to bf16, its output back to fp32)."""
    torch.manual_seed(SEED)
    mods: list[nn.Module] = []
    for k in range(LAYERS):
        lin = nn.Linear(WIDTH, WIDTH)
        if mixed and k == BF16_LAYER:
            mods += [Cast(torch.bfloat16), lin.to(torch.bfloat16), Cast(torch.float32)]
        else:
            mods.append(lin)
        if k + 1 < LAYERS:
            mods.append(nn.GELU())
    return nn.Sequential(*mods)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per rank and step; inputs scaled by 1 + rank so the ranks' block scales differ."""
    g = torch.Generator().manual_seed(1000 * step + rank + 7)
    return torch.randn(16, WIDTH, generator=g) * (1.0 + rank), torch.randn(16, WIDTH, generator=g)


def loss_of(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = data
    return ((model(x) - y) ** 2).mean()


def local_grads(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor],
                fwd: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """This rank's own gradients, without touching ``param.grad`` (no hook fires); the
    forward through ``fwd`` (a compiled ``model``) if given."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss_of(fwd or model, data), [p for _, p in named])
    return {n: g.detach().clone() for (n, _), g in zip(named, grads)}


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def step_once(model: nn.Module, reducer: fastreduce.FusedReducer, data: tuple[torch.Tensor, torch.Tensor]
              ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(local gradients, ``param.grad`` right after backward, the reduced gradients)."""
    model.zero_grad(set_to_none=True)
    x = local_grads(model, data)
    loss_of(model, data).backward()
    after_backward = grads_of(model)
    reducer.reduce()
    return x, after_backward, grads_of(model)


def segments_of(reducer: fastreduce.FusedReducer) -> list[tuple[str, list[tuple[str, int, int]], int]]:
    """Per layout segment (= bucket): its dtype, its slots (name, offset, numel), its numel."""
    return [(str(seg.dtype), [(s.name, s.offset, s.numel) for s in seg.slots], seg.numel)
            for seg in reducer.layout.segments]


def plan_info(reducer: fastreduce.FusedReducer) -> dict:
    plan = reducer._built.plan
    means = plan.means if isinstance(plan, QuantMeans) else []
    return {"quant_means": isinstance(plan, QuantMeans), "means": len(means),
            "fmts": [m.codec.fmt for m in means], "shm": [m.shm is not None for m in means],
            "mean_numel": [m.buf.numel() for m in means],
            "wire_numel": reducer._built.buffer.wire.numel(), "wire_dtype": reducer._built.buffer.wire.dtype,
            "num_buckets": reducer.num_buckets}


# ============================================================== cases run in the ranks

def exact_case(rank: int, world: int, fmt: str, transport: str, mixed: bool) -> dict:
    model = make_model(mixed)
    reducer = fastreduce.FusedReducer(model, wire_dtype=WIRES[fmt], overlap=True, bucket_mb=BUCKET_MB,
                                      transport=transport)
    out: dict[str, Any] = {"x": [], "grads": [], "wire": [], "bytes": [], "launched": []}
    for step in range(STEPS):
        x, after, g = step_once(model, reducer, batch(rank, step))
        if step == 0:
            out["after_backward0"] = after
        out["x"].append(x)
        out["grads"].append(g)
        out["wire"].append(reducer._built.buffer.wire.clone())
        out["bytes"].append(reducer.stats.bytes_reduced)
        out["launched"].append(reducer.stats.launched_in_backward)
    out.update(plan_info(reducer), segments=segments_of(reducer), calls=reducer.stats.calls)
    reducer.close()
    return out


def ef_case(rank: int, world: int, fmt: str, transport: str) -> dict:
    model = make_model()
    reducer = fastreduce.FusedReducer(model, wire_dtype=WIRES[fmt], overlap=True, bucket_mb=BUCKET_MB,
                                      transport=transport, error_feedback=True)
    out: dict[str, Any] = {"x": [], "grads": [], "wire": []}
    for step in range(EF_STEPS):
        x, _, g = step_once(model, reducer, batch(rank, step))
        out["x"].append(x)
        out["grads"].append(g)
        out["wire"].append(reducer._built.buffer.wire.clone())
    state = reducer.state_dict()
    out.update(plan_info(reducer), segments=segments_of(reducer), residuals=state["residuals"],
               wire_state=state["wire"])
    reducer.close()
    return out


def ckpt_case(rank: int, world: int, fmt: str, transport: str) -> dict:
    kw = {"wire_dtype": WIRES[fmt], "transport": transport, "overlap": True, "bucket_mb": BUCKET_MB,
          "error_feedback": True}
    a = make_model()
    ra = fastreduce.FusedReducer(a, **kw)
    for step in range(CKPT_AT):
        step_once(a, ra, batch(rank, step))
    saved = saved_and_loaded(ra.state_dict())
    b = make_model()
    b.load_state_dict(a.state_dict())
    rb = fastreduce.FusedReducer(b, **kw)
    rb.load_state_dict(saved)  # before its first reduce(): held until the layout exists
    c = make_model()
    c.load_state_dict(a.state_dict())
    rc = fastreduce.FusedReducer(c, **kw)  # the control: no state loaded
    out: dict[str, Any] = {"a": [], "b": [], "c": [], "saved_keys": sorted(saved), "saved_wire": saved["wire"]}
    # Buckets laid out otherwise, as many values in all (another bucket_mb): each rank's chunk of each
    # bucket would be other elements. Into ra (built, in the saved buckets), which must stay as it is.
    moved = {k: v + torch.tensor([64, -64] + [0] * (len(v) - 2)) if k.endswith(".buckets") else v
             for k, v in saved["wire"].items()}
    out["d_sizes"] = [saved["wire"]["residual.buckets"].tolist(), moved["residual.buckets"].tolist()]
    before = ra.state_dict()["wire"]
    out["d"] = expect_raises(ValueError, lambda: ra.load_state_dict({**saved, "wire": moved}))
    out["d_unchanged"] = all(torch.equal(v, ra.state_dict()["wire"][k]) for k, v in before.items())
    for step in range(CKPT_AT, 2 * CKPT_AT):
        for model, reducer, key in ((a, ra, "a"), (b, rb, "b"), (c, rc, "c")):
            out[key].append(step_once(model, reducer, batch(rank, step))[2])
    out["state_a"], out["state_b"] = ra.state_dict()["wire"], rb.state_dict()["wire"]
    for r in (ra, rb, rc):
        r.close()
    return out


def cross_case(rank: int, world: int, transport: str) -> dict:
    """The fused reducer's state into an overlapped one (built, and fresh), and back."""
    kw = {"wire_dtype": "int8", "transport": transport, "error_feedback": True}
    okw = {**kw, "overlap": True, "bucket_mb": BUCKET_MB}
    out: dict[str, Any] = {}
    fm, om = make_model(), make_model()
    fused = fastreduce.FusedReducer(fm, **kw)
    over = fastreduce.FusedReducer(om, **okw)
    for step in range(2):
        step_once(fm, fused, batch(rank, step))
        step_once(om, over, batch(rank, step))
    fstate, ostate = fused.state_dict(), over.state_dict()
    out["sizes"] = {"fused": {k: v.numel() for k, v in fstate["wire"].items()},
                    "overlap": {k: v.numel() for k, v in ostate["wire"].items()}}
    before = over.state_dict()["wire"]
    out["into_built_overlap"] = expect_raises(ValueError, lambda: over.load_state_dict(fstate))
    after = over.state_dict()["wire"]
    out["built_unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    out["into_built_fused"] = expect_raises(ValueError, lambda: fused.load_state_dict(ostate))
    # a fresh overlapped reducer: its buckets do not exist before its first reduce()
    nm = make_model()
    fresh = fastreduce.FusedReducer(nm, **okw)
    out["into_fresh_overlap_load"] = expect_raises(ValueError, lambda: fresh.load_state_dict(fstate))
    out["into_fresh_overlap_reduce"] = None
    if out["into_fresh_overlap_load"]["raised"] is None:  # held: then it must raise at the first reduce()
        def first_reduce() -> None:
            nm.zero_grad(set_to_none=True)
            loss_of(nm, batch(rank, 0)).backward()
            fresh.reduce()
        out["into_fresh_overlap_reduce"] = expect_raises(ValueError, first_reduce)
        # the failed first reduce() left nothing half-built: a retry (state dropped) reduces
        hooks = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in nm.parameters())
        out["hooks_after_failure"] = hooks - len(list(nm.parameters()))  # less a fresh reducer's step-1 timer
        out["retry"] = expect_raises(ValueError, first_reduce)
        out["retry_grads"] = torch.cat([p.grad.flatten() for p in nm.parameters()])
    for r in (fused, over, fresh):
        r.close()
    return out


def compiled_case(rank: int, world: int) -> dict:
    """Five AdamW steps through the overlapped int8 wire with error feedback, on the plain
    model and on torch.compile(model, backend="aot_eager"): per step the local gradients
    (through the compiled module too) and the reduced ones; the layout; the parameters."""
    out: dict[str, Any] = {}
    for compiled in (False, True):
        m = make_model()
        fwd = torch.compile(m, backend="aot_eager") if compiled else m
        red = fastreduce.FusedReducer(m, wire_dtype="int8", overlap=True, bucket_mb=BUCKET_MB, error_feedback=True)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        xs, gs = [], []
        for step in range(COMPILED_STEPS):
            data = batch(rank, step)
            xs.append(local_grads(m, data, fwd))
            loss_of(fwd, data).backward()
            red.reduce()
            gs.append(grads_of(m))
            opt.step()
            opt.zero_grad()
        out[compiled] = {"params": torch.cat([p.detach().flatten() for p in m.parameters()]), "x": xs,
                         "grads": gs, "segments": segments_of(red), "num_buckets": red.num_buckets,
                         "launched": red.stats.launched_in_backward}
        red.close()
    return out


def empty_case(rank: int, world: int, transport: str) -> dict:
    """Zero-size parameters: an fp32 one left alone at the end of the (reversed) model order, after
    the run before it closed, and a bf16 one, the only bf16 parameter. The fp32 one joins the run
    before it (no empty bucket); the bf16 one's bucket is empty and sends nothing."""
    torch.manual_seed(SEED)
    model = nn.ParameterList([nn.Parameter(torch.zeros(0, 16)), nn.Parameter(torch.zeros(0, 4, dtype=torch.bfloat16)),
                              nn.Parameter(torch.randn(300)), nn.Parameter(torch.randn(600))])
    reducer = fastreduce.FusedReducer(model, wire_dtype="int8", overlap=True, bucket_mb=0.001, transport=transport)
    worst = 0.0
    for step in range(3):
        model.zero_grad(set_to_none=True)
        sum((p.float() * (rank + 1 + step)).sum() for p in model).backward()
        reducer.reduce()
        worst = max(worst, *(float((p.grad - (1.5 + step)).abs().max()) for p in model[2:]))
    out = {"worst": worst, "segments": segments_of(reducer), "empty_grads": [tuple(p.grad.shape) for p in model[:2]]}
    reducer.close()
    return out


def cases(world: int) -> list[tuple]:
    out: list[tuple] = []
    for t in TRANSPORTS:
        out += [("exact", fmt, t, False) for fmt in WIRES]
        out.append(("exact", "int8", t, True))
        if world == 2:
            out += [("ef", fmt, t) for fmt in EF_FORMATS]
            out += [("ckpt", fmt, t) for fmt in EF_FORMATS]
            out.append(("cross", t))
            out.append(("empty", t))
    if world == 2:
        out.append(("compiled",))
    return out


CASE_FNS = {"exact": exact_case, "ef": ef_case, "ckpt": ckpt_case, "cross": cross_case, "compiled": compiled_case,
            "empty": empty_case}


run = case_runner(__name__, cases, SPAWN_TIMEOUT)
"""One group per world size (started by the first test that asks), every case of it."""


# ============================================================== the reference

def place(grads: dict[str, torch.Tensor], slots: list[tuple[str, int, int]], n: int) -> torch.Tensor:
    """One bucket's gradients (upcast to fp32) at their slot offsets in ``n`` zeros."""
    flat = torch.zeros(n, dtype=torch.float32)
    for name, off, numel in slots:
        flat[off:off + numel] = grads[name].reshape(-1).float()
    return flat


class Reference:
    """Every bucket's mean, step after step (with error feedback: keeping the residuals)."""

    def __init__(self, fmt: str, segments: list, world: int, error_feedback: bool = False):
        self.fmt, self.segments, self.world = fmt, segments, world
        self.e = [[torch.zeros(n) for _ in range(world)] for _, _, n in segments] if error_feedback else None
        self.f = [[torch.zeros(n // world) for _ in range(world)] for _, _, n in segments] \
            if error_feedback else None

    def step(self, xs: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The whole wire buffer (segments end to end) and every gradient, in its dtype."""
        wires, grads = [], {}
        for b, (dtype, slots, n) in enumerate(self.segments):
            mean = ref_mean(self.fmt, [place(x, slots, n) for x in xs],
                               None if self.e is None else self.e[b], None if self.f is None else self.f[b])
            wires.append(mean)
            for name, off, numel in slots:
                grads[name] = mean[off:off + numel].to(getattr(torch, dtype.removeprefix("torch.")))
        return torch.cat(wires), grads

    def residual(self, rank: int) -> torch.Tensor:
        assert self.e is not None
        return torch.cat([e[rank] for e in self.e])

    def mean_residual(self, rank: int) -> torch.Tensor:
        assert self.f is not None
        return torch.cat([f[rank] for f in self.f])


def assert_grads_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    assert got.keys() == want.keys(), where
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype, f"{where} {name}: dtype {g.dtype} != {w.dtype}"
        w = w.view(g.shape)
        assert torch.equal(g, w), f"{where} {name}: {first_diff(g.float(), w.float())}"


def assert_wire_equal(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    """The whole wire buffer: every bucket's mean, gaps and padding included."""
    assert got.shape == want.shape, f"{where}: wire {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(got, want), f"{where}: wire {first_diff(got, want)}"


def ids(v: Any) -> str:
    return f"world{v}" if isinstance(v, int) else str(v)


GRID = [(w, f, t) for w in WORLDS for f in WIRES for t in TRANSPORTS]
MIXED_GRID = [(w, t) for w in WORLDS for t in TRANSPORTS]
EF_GRID = [(f, t) for f in EF_FORMATS for t in TRANSPORTS]


# ============================================================== 1. bit for bit

@pytest.mark.parametrize("world,fmt,transport", GRID, ids=ids)
def test_buckets_and_plan(world: int, fmt: str, transport: str) -> None:
    """At least 3 buckets, each one fp32 layout segment padded to a multiple of W x 256
    and one QuantMean of the format (on shared memory only for shm) over exactly it; the
    segments tile the wire buffer; the reference's inputs are the gradients backward makes."""
    for rank, out in enumerate(per_rank(run(world), ("exact", fmt, transport, False))):
        segs = out["segments"]
        assert out["num_buckets"] >= 3 and out["num_buckets"] == len(segs), (out["num_buckets"], len(segs))
        assert out["quant_means"] and out["means"] == out["num_buckets"]
        assert out["fmts"] == [fmt] * out["means"] and out["shm"] == [transport == "shm"] * out["means"]
        assert out["wire_dtype"] == torch.float32
        assert [n for _, _, n in segs] == out["mean_numel"], "a bucket's QuantMean is not over its segment"
        assert all(n % (world * BLOCK) == 0 for _, _, n in segs), [n for _, _, n in segs]
        assert sum(n for _, _, n in segs) == out["wire_numel"]
        names = {name for _, slots, _ in segs for name, _, _ in slots}
        assert names == set(out["x"][0]) and sum(len(s) for _, s, _ in segs) == len(names)
        assert_grads_equal(out["after_backward0"], out["x"][0], f"rank {rank}: autograd.grad vs backward")


@pytest.mark.parametrize("world,fmt,transport", GRID, ids=ids)
def test_grads_equal_the_reference_bit_for_bit(world: int, fmt: str, transport: str) -> None:
    """At every step every rank's gradients, and its whole wire buffer (gaps and padding
    included), equal the per-bucket reference (torch.equal)."""
    outs = per_rank(run(world), ("exact", fmt, transport, False))
    ref = Reference(fmt, outs[0]["segments"], world)
    for step in range(STEPS):
        wire, grads = ref.step([o["x"][step] for o in outs])
        for rank, out in enumerate(outs):
            assert_wire_equal(out["wire"][step], wire, f"rank {rank} step {step}")
            assert_grads_equal(out["grads"][step], grads, f"rank {rank} step {step}")


@pytest.mark.parametrize("world,fmt,transport", GRID, ids=ids)
def test_every_rank_holds_the_same_grads(world: int, fmt: str, transport: str) -> None:
    outs = per_rank(run(world), ("exact", fmt, transport, False))
    for rank, out in enumerate(outs[1:], start=1):
        for step in range(STEPS):
            assert_grads_equal(out["grads"][step], outs[0]["grads"][step], f"rank {rank} vs 0 step {step}")


@pytest.mark.parametrize("world", WORLDS, ids=ids)
@pytest.mark.parametrize("fmt", list(WIRES) + ["int8_bf16"])
def test_transports_agree_bit_for_bit(world: int, fmt: str) -> None:
    """shm and process_group give bit-identical gradients at every step (and the bf16 model)."""
    mixed = fmt == "int8_bf16"
    fmt = "int8" if mixed else fmt
    res = run(world)
    pg = per_rank(res, ("exact", fmt, "process_group", mixed))
    shm = per_rank(res, ("exact", fmt, "shm", mixed))
    for rank, (a, b) in enumerate(zip(pg, shm)):
        for step in range(STEPS):
            assert_grads_equal(b["grads"][step], a["grads"][step], f"rank {rank} step {step} shm vs process_group")


@pytest.mark.parametrize("world,fmt,transport", GRID, ids=ids)
def test_exchanges_start_in_backward(world: int, fmt: str, transport: str) -> None:
    """Step 0 learns the backward order and launches everything at reduce(); from step 1
    every bucket's exchange starts from a gradient hook (stats.launched_in_backward)."""
    for out in per_rank(run(world), ("exact", fmt, transport, False)):
        nb = out["num_buckets"]
        assert out["launched"][0] == 0, out["launched"]
        assert out["launched"][1] > 0, out["launched"]
        assert out["launched"] == [nb * k for k in range(STEPS)], (out["launched"], nb)


# ============================================================== 2. mixed dtypes

@pytest.mark.parametrize("world,transport", MIXED_GRID, ids=ids)
def test_bf16_params_reduce_upcast_bit_for_bit(world: int, transport: str) -> None:
    """A bfloat16 Linear among fp32 ones, int8 wire: its gradients go into the fp32 wire
    upcast (a bucket of their own), are reduced as the reference says and cast back."""
    outs = per_rank(run(world), ("exact", "int8", transport, True))
    segs = outs[0]["segments"]
    bf16 = [f"{BF16_LAYER * 2 + 1}.weight", f"{BF16_LAYER * 2 + 1}.bias"]  # Cast, Linear after 2 x (Linear, GELU)
    dtypes = {n: g.dtype for n, g in outs[0]["x"][0].items()}
    assert all(dtypes[n] == torch.bfloat16 for n in bf16), dtypes
    bf16_segs = [s for s in segs if s[0] == "torch.bfloat16"]
    assert len(bf16_segs) == 1 and sorted(n for n, _, _ in bf16_segs[0][1]) == sorted(bf16), segs
    assert outs[0]["num_buckets"] >= 3 and outs[0]["means"] == len(segs)
    ref = Reference("int8", segs, world)
    for step in range(STEPS):
        wire, grads = ref.step([o["x"][step] for o in outs])
        for rank, out in enumerate(outs):
            assert_wire_equal(out["wire"][step], wire, f"rank {rank} step {step}")
            assert_grads_equal(out["grads"][step], grads, f"rank {rank} step {step}")


# ============================================================== 3. error feedback

@pytest.mark.parametrize("fmt,transport", EF_GRID)
def test_error_feedback_matches_the_reference_bit_for_bit(fmt: str, transport: str) -> None:
    """10 steps with error feedback, 2 ranks: every reduced gradient and wire buffer equals
    the reference's; the final residuals equal ``state_dict()["wire"]`` (every bucket's
    per-rank residual end to end, and every bucket's owned chunk of the mean's)."""
    outs = per_rank(run(2), ("ef", fmt, transport))
    ref = Reference(fmt, outs[0]["segments"], 2, error_feedback=True)
    for step in range(EF_STEPS):
        wire, grads = ref.step([o["x"][step] for o in outs])
        for rank, out in enumerate(outs):
            assert_wire_equal(out["wire"][step], wire, f"rank {rank} step {step}")
            assert_grads_equal(out["grads"][step], grads, f"rank {rank} step {step}")
    for rank, out in enumerate(outs):
        assert out["residuals"] == {}, "the quantized wire keeps its residuals under 'wire' only"
        st = out["wire_state"]
        assert set(st) == {"residual", "mean_residual", "residual.buckets", "mean_residual.buckets"}
        for key in ("residual", "mean_residual"):  # per bucket, how many of its values
            sizes = st[f"{key}.buckets"].tolist()
            assert len(sizes) == len(out["segments"]) and sum(sizes) == st[key].numel(), (rank, key, sizes)
        e, f = ref.residual(rank), ref.mean_residual(rank)
        assert st["residual"].shape == e.shape and st["mean_residual"].shape == f.shape
        assert e.abs().max() > 0 and f.abs().max() > 0
        assert torch.equal(st["residual"], e), f"rank {rank} residual: {first_diff(st['residual'], e)}"
        assert torch.equal(st["mean_residual"], f), f"rank {rank} mean_residual: {first_diff(st['mean_residual'], f)}"


# ============================================================== 4. checkpoint

@pytest.mark.parametrize("fmt,transport", EF_GRID)
def test_checkpoint_resume_is_bit_for_bit(fmt: str, transport: str) -> None:
    """A fresh overlapped reducer that loads the state (saved after 3 steps, through
    torch.save) before its first reduce() gives the original's gradients and residuals
    bit for bit for 3 more steps; one that does not load it differs. A state whose buckets
    hold as many values in all, but laid out otherwise, is refused, changing nothing."""
    for rank, out in enumerate(per_rank(run(2), ("ckpt", fmt, transport))):
        assert out["saved_keys"] == ["residuals", "wire"]
        assert set(out["saved_wire"]) == {"residual", "mean_residual", "residual.buckets", "mean_residual.buckets"}
        assert out["saved_wire"]["residual"].abs().max() > 0 and out["saved_wire"]["mean_residual"].abs().max() > 0
        for step, (a, b) in enumerate(zip(out["a"], out["b"])):
            assert_grads_equal(b, a, f"rank {rank} step {CKPT_AT + step} resumed vs original")
        for key in ("residual", "mean_residual"):
            assert torch.equal(out["state_a"][key], out["state_b"][key]), f"rank {rank} {key}"
        assert any(not torch.equal(a[k], c[k]) for a, c in zip(out["a"], out["c"]) for k in a), \
            "the control (no state loaded) gives the same gradients: the test shows nothing"
        # Saved in other buckets of as many values in all: refused, nothing changed (before, loaded
        # with each rank's chunk of the mean's residual on other elements).
        sizes, saved = out["d_sizes"]
        assert sum(sizes) == sum(saved) and sizes != saved, out["d_sizes"]  # else the test shows nothing
        assert out["d"]["raised"] == "ValueError" and "bucket_mb" in out["d"]["message"], (rank, out["d"])
        assert out["d_unchanged"], rank


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_fused_state_does_not_fit_the_overlapped_reducer(transport: str) -> None:
    """The fused reducer pads one segment, the overlapped one each bucket: the residual
    sizes differ, and loading one's state into the other (built) raises ValueError and
    changes nothing; into a fresh overlapped reducer it raises ValueError (at the load,
    or, held until the buckets exist, at the first reduce())."""
    for rank, out in enumerate(per_rank(run(2), ("cross", transport))):
        sizes = out["sizes"]
        assert sizes["fused"]["residual"] != sizes["overlap"]["residual"], sizes  # else the test shows nothing
        for key in ("into_built_overlap", "into_built_fused"):
            assert out[key]["raised"] == "ValueError", (rank, key, out[key])
            assert "resume on the same world size" in out[key]["message"], (rank, key, out[key])
        assert out["built_unchanged"]
        load, first = out["into_fresh_overlap_load"], out["into_fresh_overlap_reduce"]
        raised = load if load["raised"] is not None else first
        assert raised["raised"] == "ValueError", (rank, load, first)
        if first is not None:  # held, then refused at the first reduce(): nothing half-built is left
            assert "dropped" in first["message"], first
            assert out["hooks_after_failure"] == 0, out["hooks_after_failure"]
            assert out["retry"]["raised"] is None, out["retry"]
    if first is not None:  # the retry averaged: every rank holds the same gradients
        grads = [o["retry_grads"] for o in per_rank(run(2), ("cross", transport))]
        assert all(torch.equal(g, grads[0]) for g in grads)


# ============================================================== 5. bytes

@pytest.mark.parametrize("world,fmt,transport", GRID, ids=ids)
def test_bytes_reduced_are_codes_and_scales_per_bucket(world: int, fmt: str, transport: str) -> None:
    """stats.bytes_reduced grows per call by sum over buckets of W (m + 4 m / 256),
    m = the bucket's numel / W (8-bit codes, one fp32 scale per 256)."""
    for out in per_rank(run(world), ("exact", fmt, transport, False)):
        ms = [n // world for _, _, n in out["segments"]]
        assert all(BlockQuant(fmt).row_bytes(m) == m + 4 * m // BLOCK for m in ms)
        per_call = sum(world * (m + 4 * m // BLOCK) for m in ms)
        assert out["bytes"] == [per_call * (k + 1) for k in range(STEPS)], (out["bytes"], per_call)
        assert out["calls"] == STEPS


# ============================================================== 6. torch.compile

def test_compiled_model_matches_the_reference_bit_for_bit() -> None:
    """5 AdamW steps, overlapped int8 wire with error feedback, plain and compiled
    (aot_eager): at every step every rank's reduced gradients equal the reference (with
    residuals) over that run's own buckets, the exchanges start in backward, and the
    ranks end with the same parameters."""
    outs = per_rank(run(2), ("compiled",))
    for compiled in (False, True):
        runs = [o[compiled] for o in outs]
        ref = Reference("int8", runs[0]["segments"], 2, error_feedback=True)
        for step in range(COMPILED_STEPS):
            _, grads = ref.step([r["x"][step] for r in runs])
            for rank, r in enumerate(runs):
                assert r["segments"] == runs[0]["segments"]
                assert_grads_equal(r["grads"][step], grads, f"compiled={compiled} rank {rank} step {step}")
        for rank, r in enumerate(runs):
            assert r["num_buckets"] >= 3 and r["launched"] > 0, (compiled, rank, r["num_buckets"], r["launched"])
            assert torch.equal(r["params"], runs[0]["params"]), f"compiled={compiled} rank {rank} vs 0"


def test_compiled_model_gives_the_same_parameters() -> None:
    """docs/design.md, invariant 7: 5 AdamW steps, overlapped int8 wire with error feedback:
    compiled (aot_eager) or not, bit-identical parameters on every rank."""
    for rank, out in enumerate(per_rank(run(2), ("compiled",))):
        a, b = out[False]["params"], out[True]["params"]
        assert torch.equal(b, a), (f"rank {rank}: {first_diff(b, a)}; buckets plain "
                                   f"{[[n for n, _, _ in s] for _, s, _ in out[False]['segments']]}, compiled "
                                   f"{[[n for n, _, _ in s] for _, s, _ in out[True]['segments']]}")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_zero_size_parameters_make_no_empty_bucket(transport: str) -> None:
    """A zero-size parameter never makes a bucket of its own where its dtype has others (an empty
    segment crashed the codec on every rank); alone in its dtype, its empty bucket sends nothing."""
    for out in per_rank(run(2), ("empty", transport)):
        assert out["worst"] < 2e-2, out["worst"]
        assert out["empty_grads"] == [(0, 16), (0, 4)]
        sizes = {dtype: [n for d, _, n in out["segments"] if d == dtype] for dtype, _, _ in out["segments"]}
        assert 0 not in sizes["torch.float32"] and sizes["torch.bfloat16"] == [0], out["segments"]
        slots = [[name for name, _, _ in s] for _, s, _ in out["segments"]]
        assert ["2", "0"] in slots, slots  # (the reversed model order: 3, 2, 1, 0)
