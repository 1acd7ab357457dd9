"""fastreduce.SparseLoCo as ``compression=`` of fastreduce.DiLoCo, against references
written here from the definition (fastreduce/codecs/sparse.py's module docstring):

per rank and fragment at each sync, ``e := decay e + delta`` (delta = anchor - x, fp32);
per chunk of ``chunk`` elements (the flat fragment zero-padded to whole chunks) the
``k`` entries of largest |e| (k = density x chunk rounded to a multiple of 8, at least
8); each kept value v sent as code ``j = round((v / s + 1) (2^bits - 1) / 2)`` clamped
to [0, 2^bits - 1] (s = the chunk's largest |kept|), received as
``(j 2 / (2^bits - 1) - 1) s``; ``e := e - received`` (error feedback); every rank's
payload all-gathered; the mean := the ranks' received chunks summed in rank order,
divided by the world size; DiLoCo's outer optimizer steps with it as grad.

* The codec alone (no process): :class:`~fastreduce.codecs.sparse.SparseState` per rank
  of a simulated world, their payloads copied into each one's gather buffer, against
  :func:`ref_encode` / :func:`ref_mean` (a Python loop over chunks), bit for bit, over
  several encodes (so the accumulator's decay and error feedback are in it); the
  payload size against the docstring's formula; the error-feedback identity
  ``e_T + sum_t decay^(T-t) sent_t = sum_t decay^(T-t) delta_t``.
* DiLoCo + SparseLoCo on 2 Gloo ranks (one spawn, ``main_worker``) against
  :func:`ref_diloco_sparse` (every rank's pseudo-gradient all-gathered on a group of
  the reference's own, every rank's accumulator simulated), on both transports, which
  must agree bit for bit; density 1 / 8 bits / decay 0 against the uncompressed fp32
  DiLoCo within the 8-bit rounding; ``bytes_per_sync``; bad settings.
* Resume: a run saved mid-way (``mode.state_dict()`` with torch.save, and
  ``Checkpointer``) and loaded in new processes (``resume_worker``) goes on bit for bit
  like the uninterrupted one; without its accumulators it does not; a compressed state
  does not load into an uncompressed mode, nor the reverse.

The reference's flat fragment is the mode's (``mode.layout``: every parameter at its
aligned offset in its fragment's segment, the segment padded for the collectives), so
that chunks cut the same values; the reference reads only those offsets from the mode.

Tolerances: the mode and the reference do the same fp32 operations in the same order,
so the codec is compared bit for bit and the parameters within ATOL = 1e-6 (the
brief's bound; they come out identical).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fastreduce
from fastreduce.codecs.sparse import SparseLoCo, SparseState
from fastreduce.launch import run_ranks

from models import batch_for, loss_of, odd_model
from test_fused import expect_raises, guarded, per_rank, spawn_once

SEED = 5
ATOL = 1e-6
SPAWN_TIMEOUT = 150.0
TINY = torch.finfo(torch.float32).tiny
CPU = torch.device("cpu")

pytestmark = pytest.mark.timeout(300)


# ============================================================== the reference codec

def ref_k(density: float, chunk: int) -> int:
    """density x chunk rounded to a multiple of 8, at least 8 (and at most the chunk)."""
    return min(chunk // 8 * 8, max(8, round(density * chunk / 8) * 8))


def ref_payload_bytes(numel: int, density: float, bits: int, chunk: int) -> int:
    """Per chunk: k values of ``bits`` bits, k indices of 12 bits (chunk <= 4096) or 16, one fp32 scale."""
    k = ref_k(density, chunk)
    index_bits = 12 if chunk <= 4096 else 16
    return -(-numel // chunk) * (k * bits // 8 + k * index_bits // 8 + 4)


@torch.no_grad()
def ref_encode(e: torch.Tensor, delta: torch.Tensor, cfg: SparseLoCo) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's encode from the definition: returns (the new accumulator, what was
    sent, dense: the received values at the kept places, zero elsewhere), both of e's
    length. A Python loop over chunks; the padding of the last chunk is zeros."""
    n, C, top = e.numel(), cfg.chunk, (1 << cfg.bits) - 1
    k = ref_k(cfg.density, C)
    e = e * cfg.decay + delta
    chunks = -(-n // C)
    padded = torch.cat([e, e.new_zeros(chunks * C - n)])
    sent = torch.zeros_like(padded)
    for c in range(chunks):
        vals = padded[c * C:(c + 1) * C]
        idx = vals.abs().topk(k).indices
        kept = vals[idx]
        # s = the chunk's largest |kept|; an all-zero chunk (s = 0) would divide by
        # zero: the implementation takes float32's smallest normal there, and so do we
        s = kept.abs().max().clamp_min(TINY)
        j = ((kept / s + 1) * (top / 2)).round().clamp(0, top)
        sent[c * C + idx] = (j * (2 / top) - 1) * s
    sent = sent[:n]
    return e - sent, sent


def ref_mean(sent: list[torch.Tensor]) -> torch.Tensor:
    """Every rank's received values summed in rank order, / world."""
    total = torch.zeros_like(sent[0])
    for s in sent:
        total = total + s
    return total / len(sent)


def new_state(cfg: SparseLoCo, numel: int, world: int, rank: int) -> SparseState:
    return SparseState(cfg, numel, CPU, alloc=lambda n, d: torch.zeros(n, dtype=d), world=world, rank=rank)


def exchange(states: list[SparseState]) -> None:
    """The all-gather, by hand: every rank's payload into every rank's gather buffer."""
    P = states[0].payload
    for st in states:
        for q, other in enumerate(states):
            st.gathered[q * P:(q + 1) * P].copy_(other.mine)


def decoded(st: SparseState) -> torch.Tensor:
    out = torch.full((st.numel,), float("nan"))
    st.decode(out)
    return out


def random_delta(g: torch.Generator, numel: int) -> torch.Tensor:
    """Values of widely varying size (each chunk's scale matters)."""
    return torch.randn(numel, generator=g) * torch.rand(numel, generator=g).mul(6).sub(3).exp()


def first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    bad = (a != b).nonzero().flatten()
    if not bad.numel():
        return "equal"
    i = int(bad[0])
    return f"{bad.numel()} of {a.numel()} differ, first at {i}: {a[i].item()!r} != {b[i].item()!r}"


def run_codec(cfg: SparseLoCo, numel: int, world: int, rounds: int, seed: int,
              deltas: list[list[torch.Tensor]] | None = None) -> None:
    """``rounds`` encodes of ``world`` simulated ranks against the reference: after each,
    every rank's accumulator and every rank's decoded mean, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    states = [new_state(cfg, numel, world, r) for r in range(world)]
    acc = [torch.zeros(numel) for _ in range(world)]
    for t in range(rounds):
        ds = deltas[t] if deltas is not None else [random_delta(g, numel) for _ in range(world)]
        sent = []
        for r, st in enumerate(states):
            st.encode(ds[r].clone())
            acc[r], s = ref_encode(acc[r], ds[r], cfg)
            sent.append(s)
            got = st.state_dict()["acc"]
            assert torch.equal(got, acc[r]), f"round {t} rank {r}: accumulator: {first_diff(got, acc[r])}"
        exchange(states)
        want = ref_mean(sent)
        for r, st in enumerate(states):
            got = decoded(st)
            assert torch.equal(got, want), f"round {t} rank {r}: decoded mean: {first_diff(got, want)}"


# ============================================================== 1. the codec, bit for bit

# (numel, chunk, density): none a multiple of the chunk, the last chunk holding at least k
# values (see test_the_last_chunks_padding_stays_zero for fewer)
GEOMETRIES = {
    "c64-12bit": (1000, 64, 1 / 8),          # 15 chunks + 40, k = 8
    "c4096-12bit": (9000, 4096, 1 / 64),     # the default chunk: indices up to 4095 in 12 bits
    "c5000-16bit": (11111, 5000, 1 / 100),   # k = 48, 16-bit indices
}


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("world", [2, 3])
def test_codec_matches_the_definition_bit_for_bit(geometry: str, bits: int, world: int) -> None:
    numel, chunk, density = GEOMETRIES[geometry]
    cfg = SparseLoCo(density=density, bits=bits, chunk=chunk, decay=0.95)
    assert cfg.k == ref_k(density, chunk)
    run_codec(cfg, numel, world, rounds=3, seed=bits * 10 + world)


def test_codec_16bit_indices_above_32767() -> None:
    cfg = SparseLoCo(density=1 / 500, bits=8, chunk=40000, decay=0.95)  # k = 80, 2 chunks
    run_codec(cfg, 70000, 2, rounds=2, seed=3)


def test_the_last_chunks_padding_stays_zero() -> None:
    # 3 values in the last chunk of 64, k = 8: 5 padding zeros are kept. Round 1 sends
    # [10, .5, .2] as [10, 10/3, 10/3] (2 bits); the residual [0, -2.83, -3.13] is all
    # that is left, so round 2's scale is 3.13 (the padding's -10/3 must not count).
    cfg = SparseLoCo(density=1 / 8, bits=2, chunk=64, decay=1.0)
    d1 = random_delta(torch.Generator().manual_seed(1), 67)
    d1[64:] = torch.tensor([10.0, 0.5, 0.2])
    run_codec(cfg, 67, 1, rounds=2, seed=0, deltas=[[d1], [torch.zeros(67)]])


@pytest.mark.parametrize("numel", [1, 4095, 4096, 4097, 100_000])
def test_payload_size_is_the_docstring_formula(numel: int) -> None:
    default = SparseLoCo()
    assert default.payload_bytes(4096) == 116           # the docstring's figure
    assert default.payload_bytes(numel) == ref_payload_bytes(numel, 1 / 64, 2, 4096)
    for density, bits, chunk in [(1 / 8, 1, 64), (1 / 8, 4, 64), (1 / 100, 8, 5000), (1.0, 8, 64), (1 / 64, 2, 65536)]:
        cfg = SparseLoCo(density=density, bits=bits, chunk=chunk)
        want = ref_payload_bytes(numel, density, bits, chunk)
        assert cfg.payload_bytes(numel) == want, (density, bits, chunk)
        st = new_state(cfg, numel, 3, 1)
        assert st.payload == want and st.mine.numel() == want and st.gathered.numel() == 3 * want
        assert st.gathered.dtype == torch.uint8


# ============================================================== 2. error feedback

@pytest.mark.parametrize("decay", [1.0, 0.9])
@pytest.mark.parametrize("bits", [1, 2, 8])
def test_error_feedback_loses_nothing(decay: float, bits: int) -> None:
    """Over T encodes of one rank: e_T + sum_t decay^(T-t) sent_t == sum_t decay^(T-t)
    delta_t (decay 1: the plain sums), up to fp32 rounding."""
    numel, T = 1000, 6
    cfg = SparseLoCo(density=1 / 8, bits=bits, chunk=64, decay=decay)
    st = new_state(cfg, numel, 1, 0)
    g = torch.Generator().manual_seed(bits)
    sent_sum = torch.zeros(numel, dtype=torch.float64)
    delta_sum = torch.zeros(numel, dtype=torch.float64)
    scale = 0.0
    for _ in range(T):
        d = random_delta(g, numel)
        st.encode(d.clone())
        exchange([st])
        sent = decoded(st)
        # sparse: at most k entries per chunk
        per_chunk = torch.nn.functional.pad(sent != 0, (0, -numel % 64)).view(-1, 64).sum(1)
        assert int(per_chunk.max()) <= cfg.k
        sent_sum = sent_sum * decay + sent.double()
        delta_sum = delta_sum * decay + d.double()
        scale = max(scale, float(d.abs().max()), float(sent.abs().max()))
    acc = st.state_dict()["acc"].double()
    assert acc.abs().max() > 0.01 * scale  # something is held back, not all sent
    torch.testing.assert_close(acc + sent_sum, delta_sum, rtol=0, atol=T * scale * 2.0 ** -18)


# ============================================================== helpers run in ranks

def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def inner_opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(trainable(model), lr=1e-2, weight_decay=0.1)


def outer_sgd1(model: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(trainable(model), lr=1.0)  # no momentum: the accumulator takes its place


def step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, s: int) -> None:
    opt.zero_grad()
    loss_of(model, batch_for(model, rank, s)).backward()
    opt.step()


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range) -> list[dict]:
    traj = []
    for s in steps:
        step(model, opt, rank, s)
        traj.append(params_of(model))
    return traj


def frag_layout(mode: fastreduce.DiLoCo) -> list[tuple[list[tuple[str, int, int]], int]]:
    """Per fragment: its parameters' (name, offset, numel) in its flat fragment, and the
    fragment's length. One dtype here: fragment k is the layout's segment k."""
    segs = mode.layout.segments
    assert len(segs) == len(mode.fragment_names)
    out = []
    for names, seg in zip(mode.fragment_names, segs):
        assert [s.name for s in seg.slots] == list(names)
        out.append(([(s.name, s.offset, s.numel) for s in seg.slots], seg.numel))
    return out


def ref_diloco_sparse(rank: int, world: int, steps: int, H: int, F: int, tau: int, cfg: SparseLoCo,
                      layout: list[tuple[list[tuple[str, int, int]], int]], group: Any) -> dict:
    """DiLoCo (outer SGD lr 1, no momentum, alpha 0) with SparseLoCo from the equations:
    fragment k launched after steps s with (s + tau) % H == ((k + 1) H // F) % H, applied
    tau steps later; at a launch every rank's pseudo-gradient is all-gathered and every
    rank's accumulator stepped here (ref_encode), the mean ref_mean."""
    model = odd_model(SEED)
    inner = inner_opt(model)
    named = dict(model.named_parameters())
    anchor = {n: p.detach().clone() for n, p in named.items()}
    phase = [((k + 1) * H // F) % H for k in range(F)]
    accs = [[torch.zeros(numel) for _ in range(world)] for _, numel in layout]
    pending: dict[int, torch.Tensor] = {}
    traj = []
    for s in range(1, steps + 1):
        step(model, inner, rank, s)
        with torch.no_grad():
            for k, (slots, numel) in enumerate(layout):
                if (s + tau) % H == phase[k]:
                    flat = torch.zeros(numel)
                    for n, at, size in slots:
                        flat[at:at + size] = (anchor[n] - named[n]).reshape(-1)
                    every = [torch.empty_like(flat) for _ in range(world)]
                    dist.all_gather(every, flat, group=group)
                    sent = []
                    for r in range(world):
                        accs[k][r], sr = ref_encode(accs[k][r], every[r], cfg)
                        sent.append(sr)
                    pending[k] = ref_mean(sent)
            for k, (slots, _) in enumerate(layout):
                if s % H == phase[k]:
                    mean = pending.pop(k)
                    for n, at, size in slots:
                        anchor[n] = anchor[n] - 1.0 * mean[at:at + size].view_as(anchor[n])
                        named[n].copy_(anchor[n])
        traj.append(params_of(model))
    return {"traj": traj, "acc": [a[rank] for a in accs]}


# ------------------------------------------------------------------ 3. against the reference

TRANSPORTS = ("shm", "process_group")
# name: (steps, H, fragments, fragment_delay)
CASES = {"F1": (12, 4, 1, 0), "F2-tau1": (12, 4, 2, 1)}
CASE_CFG = SparseLoCo(density=1 / 8, bits=2, chunk=64, decay=0.95)


def case_reference(rank: int, world: int, name: str, ref_group: Any) -> dict:
    steps, H, F, tau = CASES[name]
    out: dict[str, Any] = {}
    for transport in TRANSPORTS:
        model = odd_model(SEED)
        inner = inner_opt(model)
        mode = fastreduce.DiLoCo(model, inner, outer_sgd1(model), H, fragments=F, fragment_delay=tau,
                                 compression=CASE_CFG, transport=transport)
        traj = train(model, inner, rank, range(1, steps + 1))
        state = mode.state_dict()
        out[transport] = {"traj": traj, "syncs": mode.syncs, "layout": frag_layout(mode),
                          "acc": [a["acc"] for a in state["sparse"]]}
        mode.remove()
    ref = ref_diloco_sparse(rank, world, steps, H, F, tau, CASE_CFG, out["shm"]["layout"], ref_group)
    return out | {"ref": ref}


# ------------------------------------------------------------------ 4. density 1, 8 bits, decay 0

def case_dense_8bit(rank: int, world: int) -> dict:
    """The uncompressed fp32 DiLoCo and SparseLoCo(density 1, 8 bits, decay 0), 12 steps,
    H 4; with each rank's pseudo-gradient at every sync (from a step hook registered
    before the mode's, so it sees x before the sync) for the bound."""
    out: dict[str, Any] = {}
    for name, kw in (("fp32", {"wire_dtype": torch.float32}),
                     ("sparse", {"compression": SparseLoCo(density=1.0, bits=8, chunk=64, decay=0.0)})):
        model = odd_model(SEED)
        inner = inner_opt(model)
        anchor = params_of(model)
        deltas: list[float] = []

        done: list[int] = []  # the steps done before this one

        def before_sync(*_: Any, model: nn.Module = model, anchor: dict = anchor, deltas: list = deltas,
                        done: list = done) -> None:
            if len(done) % 4 == 3:  # this step syncs
                deltas.append(max(float((anchor[n] - p).abs().max()) for n, p in model.named_parameters()))

        hook = inner.register_step_post_hook(before_sync)
        mode = fastreduce.DiLoCo(model, inner, outer_sgd1(model), 4, **kw)
        traj = []
        for s in range(1, 13):
            step(model, inner, rank, s)
            done.append(s)
            traj.append(params_of(model))
            if s % 4 == 0:
                anchor.update(params_of(model))
        hook.remove()
        mode.remove()
        out[name] = {"traj": traj, "deltas": deltas}
    return out


# ------------------------------------------------------------------ 6. bad settings

def case_bad_settings(rank: int, world: int) -> dict:
    model = odd_model(SEED)
    inner = inner_opt(model)
    res = {
        "other-type": expect_raises(ValueError, lambda: fastreduce.DiLoCo(
            model, inner, outer_sgd1(model), 4, compression=fastreduce.PowerSGD())),
        "a-dict": expect_raises(ValueError, lambda: fastreduce.DiLoCo(
            model, inner, outer_sgd1(model), 4, compression={"density": 0.1})),
        "accumulate_dtype": expect_raises(ValueError, lambda: fastreduce.DiLoCo(
            model, inner, outer_sgd1(model), 4, compression=SparseLoCo(), accumulate_dtype=torch.float32)),
    }
    # nothing left behind: the optimizer steps with no hook of the failed modes
    res["hooks"] = len(inner._optimizer_step_pre_hooks) + len(inner._optimizer_step_post_hooks)
    return res


# ------------------------------------------------------------------ 7. bytes

def wide_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))


def case_bytes(rank: int, world: int) -> dict:
    out = {}
    for model_name, build in (("odd", odd_model), ("wide", wide_model)):
        for F in (1, 2):
            for what, kw in (("sparse", {"compression": SparseLoCo()}), ("dense-fp32", {"wire_dtype": torch.float32}),
                             ("dense-default", {})):
                model = build(SEED)
                inner = inner_opt(model)
                mode = fastreduce.DiLoCo(model, inner, outer_sgd1(model), 4, fragments=F, **kw)
                entry = {"bytes": mode.bytes_per_sync, "numel": [n for _, n in frag_layout(mode)]}
                if "compression" in kw:
                    entry["acc_numel"] = [a["acc"].numel() for a in mode.state_dict()["sparse"]]
                out[f"{model_name}-F{F}-{what}"] = entry
                mode.remove()
    return out


# ------------------------------------------------------------------ 5. resume

RESUME_STEPS, SAVE_AT, RESUME_H = 16, 7, 4  # F2, tau 1: launches after 1, 3, 5, 7, ...: fragment 1 in flight at 7
RESUME_CFG = SparseLoCo(density=1 / 8, bits=2, chunk=64, decay=0.95)


def build_resume(seed: int, compression: SparseLoCo | None = RESUME_CFG) -> tuple[nn.Module, Any, Any]:
    model = odd_model(seed)
    inner = inner_opt(model)
    kw: dict[str, Any] = {"compression": compression} if compression is not None else {"wire_dtype": torch.float32}
    mode = fastreduce.DiLoCo(model, inner, outer_sgd1(model), RESUME_H, fragments=2, fragment_delay=1, **kw)
    return model, inner, mode


def resume_files(path: str, rank: int) -> dict[str, str]:
    return {w: os.path.join(path, f"rank{rank}-{w}.pt") for w in ("model", "optim", "mode", "plain-mode")}


def case_resume_save(rank: int, world: int, path: str) -> dict:
    model, inner, mode = build_resume(SEED)
    full = train(model, inner, rank, range(1, RESUME_STEPS + 1))
    mode.remove()
    model, inner, mode = build_resume(SEED)
    train(model, inner, rank, range(1, SAVE_AT + 1))
    files = resume_files(path, rank)
    state = mode.state_dict()
    torch.save(model.state_dict(), files["model"])
    torch.save(inner.state_dict(), files["optim"])
    torch.save(state, files["mode"])
    ckpt = fastreduce.checkpoint.Checkpointer(os.path.join(path, "ckpt"), model, mode=mode)
    ckpt.save(SAVE_AT)
    internal = [s.acc[:s.numel].clone() for s in mode._sparse]
    continued = train(model, inner, rank, range(SAVE_AT + 1, RESUME_STEPS + 1))
    mode.remove()
    # an uncompressed mode's state, for the mismatch the other way round
    model, inner, plain = build_resume(SEED, compression=None)
    train(model, inner, rank, range(1, 3))
    torch.save(plain.state_dict(), files["plain-mode"])
    plain.remove()
    return {"full": full, "continued": continued, "sparse": [s["acc"] for s in state["sparse"]],
            "internal": internal, "fragments": len(mode.fragment_names), "in_flight": sorted(state["in_flight"])}


def case_resume_load(rank: int, world: int, path: str, how: str) -> dict:
    model, inner, mode = build_resume(SEED + 1)  # other values: all must come from the files
    files = resume_files(path, rank)
    if how == "checkpointer":
        ckpt = fastreduce.checkpoint.Checkpointer(os.path.join(path, "ckpt"), model, mode=mode)
        assert ckpt.load_latest() == SAVE_AT
    else:
        model.load_state_dict(torch.load(files["model"]))
        inner.load_state_dict(torch.load(files["optim"]))
        state = torch.load(files["mode"])
        if how == "zeroed-accumulators":
            state["sparse"] = [{"acc": torch.zeros_like(s["acc"])} for s in state["sparse"]]
        mode.load_state_dict(state)
    out = train(model, inner, rank, range(SAVE_AT + 1, RESUME_STEPS + 1))
    mode.remove()
    return {"out": out}


def case_resume_mismatch(rank: int, world: int, path: str) -> dict:
    files = resume_files(path, rank)
    res = {}
    model, _, plain = build_resume(SEED, compression=None)
    before = params_of(model)
    res["sparse-into-plain"] = expect_raises(ValueError, lambda: plain.load_state_dict(torch.load(files["mode"])))
    res["sparse-into-plain-unchanged"] = all(torch.equal(p, before[n]) for n, p in params_of(model).items())
    plain.remove()
    model, _, mode = build_resume(SEED)
    before = params_of(model)
    res["plain-into-sparse"] = expect_raises(ValueError, lambda: mode.load_state_dict(torch.load(files["plain-mode"])))
    res["plain-into-sparse-unchanged"] = all(torch.equal(p, before[n]) for n, p in params_of(model).items())
    mode.remove()
    return res


# ------------------------------------------------------------------ the spawns

def main_worker(rank: int, world: int, path: str) -> dict:
    ref_group = dist.new_group(backend="gloo")  # the reference's own collectives
    res: dict[str, Any] = {}
    for name in CASES:
        res["ref/" + name] = guarded(case_reference, rank, world, name, ref_group)
    res["dense_8bit"] = guarded(case_dense_8bit, rank, world)
    res["bad"] = guarded(case_bad_settings, rank, world)
    res["bytes"] = guarded(case_bytes, rank, world)
    res["resume_save"] = guarded(case_resume_save, rank, world, path)
    return res


def resume_worker(rank: int, world: int, path: str) -> dict:
    res = {how: guarded(case_resume_load, rank, world, path, how)
           for how in ("state_dict", "checkpointer", "zeroed-accumulators")}
    res["mismatch"] = guarded(case_resume_mismatch, rank, world, path)
    return res


# ============================================================== fixtures (parent)

_RESULTS: dict[Any, Any] = {}


def spawn(worker: Callable[..., Any], *args: Any) -> list[Any]:
    return run_ranks(worker, 2, *args, timeout=SPAWN_TIMEOUT)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("sparseloco"))


@pytest.fixture(scope="module")
def main(ckpt_dir):
    yield spawn_once(_RESULTS, "main", lambda: spawn(main_worker, ckpt_dir))
    _RESULTS.clear()


@pytest.fixture(scope="module")
def resumed(main, ckpt_dir) -> list[dict]:
    return spawn_once(_RESULTS, "resumed", lambda: spawn(resume_worker, ckpt_dir))


def assert_traj_close(got: list[dict], want: list[dict], where: str, atol: float = ATOL) -> None:
    assert len(got) == len(want), where
    for s, (g, w) in enumerate(zip(got, want), 1):
        assert g.keys() == w.keys(), where
        for n in w:
            torch.testing.assert_close(g[n].double(), w[n].double(), rtol=0, atol=atol,
                                       msg=lambda m, at=f"{where}, after step {s}, {n}": f"{at}:\n{m}")


def traj_equal(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[n], y[n]) for n in x)
                                    for x, y in zip(a, b))


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[n].double() - b[n].double()).abs().max()) for n in a)


# ============================================================== 3. DiLoCo + SparseLoCo

@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("name", list(CASES))
def test_diloco_sparseloco_matches_the_reference(main, name: str, transport: str) -> None:
    steps, H, F, _ = CASES[name]
    for rank, o in enumerate(per_rank(main, "ref/" + name)):
        got, ref = o[transport], o["ref"]
        assert got["syncs"] == steps // H * F
        assert_traj_close(got["traj"], ref["traj"], f"{name} {transport} rank {rank}")
        # the accumulators: at every parameter's place (the rest is the layout's padding)
        for k, (slots, numel) in enumerate(got["layout"]):
            assert got["acc"][k].numel() == numel
            for n, at, size in slots:
                torch.testing.assert_close(got["acc"][k][at:at + size], ref["acc"][k][at:at + size], rtol=0,
                                           atol=ATOL, msg=lambda m, at=f"{name} rank {rank} acc {k} {n}": f"{at}:\n{m}")
        assert any(float(a.abs().max()) > 1e-4 for a in got["acc"])  # error feedback holds something
    if F == 1:  # a sync at the last step: the ranks end alike
        outs = per_rank(main, "ref/" + name)
        assert all(torch.equal(outs[0][transport]["traj"][-1][n], o[transport]["traj"][-1][n])
                   for o in outs[1:] for n in outs[0][transport]["traj"][-1])


@pytest.mark.parametrize("name", list(CASES))
def test_the_two_transports_agree_bit_for_bit(main, name: str) -> None:
    for rank, o in enumerate(per_rank(main, "ref/" + name)):
        assert traj_equal(o["shm"]["traj"], o["process_group"]["traj"]), f"{name} rank {rank}"
        assert all(torch.equal(a, b) for a, b in zip(o["shm"]["acc"], o["process_group"]["acc"]))


# ============================================================== 4. density 1, 8 bits, decay 0

def test_density1_8bit_is_close_to_uncompressed_fp32(main) -> None:
    """Every value sent, rounded to one of 255 steps of 2 s / 255 (s <= max |delta|): the
    mean is off the fp32 mean by at most max |delta| / 255 per sync. At the first sync
    both runs start alike, so that is the bound there; later syncs add theirs, and the
    inner steps between may carry a difference on (a factor 3 of room)."""
    for rank, o in enumerate(per_rank(main, "dense_8bit")):
        fp32, sparse = o["fp32"], o["sparse"]
        assert len(sparse["deltas"]) == 3
        bounds = [d / 255 * (1 + 1e-4) + 2e-7 for d in sparse["deltas"]]
        first = max_diff(sparse["traj"][3], fp32["traj"][3])
        assert 0 < first <= bounds[0], (rank, first, bounds[0])
        last = max_diff(sparse["traj"][-1], fp32["traj"][-1])
        assert last <= 3 * sum(bounds), (rank, last, bounds)


# ============================================================== 5. checkpoints

def test_state_dict_holds_each_fragments_accumulator(main) -> None:
    for rank, o in enumerate(per_rank(main, "resume_save")):
        assert o["fragments"] == 2 and len(o["sparse"]) == 2
        assert o["in_flight"] == [1]  # saved with fragment 1 on the wire
        for k, (saved, internal) in enumerate(zip(o["sparse"], o["internal"])):
            assert saved.dtype == torch.float32 and saved.dim() == 1
            assert torch.equal(saved, internal), (rank, k)
            assert float(saved.abs().max()) > 0, (rank, k)


@pytest.mark.parametrize("how", ["state_dict", "checkpointer"])
def test_resume_in_new_processes_continues_bit_for_bit(main, resumed, how: str) -> None:
    for rank, (saved, loaded) in enumerate(zip(per_rank(main, "resume_save"), per_rank(resumed, how))):
        tail = saved["full"][SAVE_AT:]
        assert traj_equal(saved["continued"], tail), f"saving disturbed the run, rank {rank}"
        assert traj_equal(loaded["out"], tail), f"{how}: rank {rank}: {max_diff(loaded['out'][-1], tail[-1])}"


def test_resume_without_the_accumulators_differs(main, resumed) -> None:
    for saved, loaded in zip(per_rank(main, "resume_save"), per_rank(resumed, "zeroed-accumulators")):
        assert max_diff(loaded["out"][-1], saved["full"][-1]) > 1e-5


def test_state_dicts_with_and_without_compression_do_not_mix(main, resumed) -> None:
    for o in per_rank(resumed, "mismatch"):
        for what in ("sparse-into-plain", "plain-into-sparse"):
            assert o[what]["raised"] == "ValueError", o[what]
            assert "compression" in o[what]["message"], o[what]["message"]
            assert o[what + "-unchanged"]


# ============================================================== 6. bad settings

@pytest.mark.parametrize("kw, word", [
    ({"density": 0}, "density"), ({"density": 0.0}, "density"), ({"density": 1.5}, "density"),
    ({"density": -0.1}, "density"), ({"bits": 3}, "bits"), ({"bits": 0}, "bits"), ({"chunk": 4}, "chunk"),
    ({"chunk": 70000}, "chunk"), ({"chunk": 64.0}, "chunk"), ({"decay": -0.1}, "decay"), ({"decay": 1.5}, "decay"),
])
def test_bad_sparseloco_settings_raise_naming_them(kw: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        SparseLoCo(**kw)


def test_bad_compression_for_diloco_raises(main) -> None:
    for rank, o in enumerate(per_rank(main, "bad")):
        for what, word in (("other-type", "compression"), ("a-dict", "compression"),
                           ("accumulate_dtype", "accumulate_dtype")):
            assert o[what]["raised"] == "ValueError", (rank, what, o[what])
            assert word in o[what]["message"], (rank, what, o[what]["message"])
        assert o["hooks"] == 0


# ============================================================== 7. bytes

def test_bytes_per_sync_is_the_all_gathers_buffer(main) -> None:
    cfg = SparseLoCo()
    for o in per_rank(main, "bytes"):
        for model_name in ("odd", "wide"):
            for F in (1, 2):
                key = f"{model_name}-F{F}"
                sparse, fp32, default = o[key + "-sparse"], o[key + "-dense-fp32"], o[key + "-dense-default"]
                assert len(sparse["numel"]) == F and sparse["acc_numel"] == sparse["numel"]
                assert sparse["bytes"] == 2 * sum(cfg.payload_bytes(n) for n in sparse["numel"]), (key, sparse)
                assert fp32["bytes"] == 4 * sum(fp32["numel"])
                assert sparse["bytes"] * 2 < default["bytes"], (key, sparse, default)  # odd: 512 values, one chunk
                if model_name == "wide":  # 33k values: 9 chunks, 2088 bytes against 133 kB in fp32
                    assert sparse["bytes"] * 50 < fp32["bytes"] and sparse["bytes"] * 25 < default["bytes"]


# ------------------------------------------------------------------ LocalSGD

def localsgd_against_diloco(rank: int, world: int, transport: str) -> dict:
    """LocalSGD(compression=c) is DiLoCo(outer SGD lr 1, compression=c): x := last average
    - mean of the codec's sparse (last average - x); the same bits. And a hierarchy is refused."""
    cfg = SparseLoCo(density=1 / 8, bits=2, chunk=64, decay=0.9)
    out: dict[str, Any] = {}
    for name in ("localsgd", "diloco"):
        model = odd_model(SEED)
        inner = inner_opt(model)
        if name == "localsgd":
            mode = fastreduce.LocalSGD(model, inner, 4, compression=cfg, transport=transport)
        else:
            mode = fastreduce.DiLoCo(model, inner, outer_sgd1(model), 4, compression=cfg, transport=transport)
        out[name] = train(model, inner, rank, range(1, 13))[-1]
        out[name + "_acc"] = [s["acc"] for s in mode.state_dict()["sparse"]]
        mode.remove()
    model = odd_model(SEED)
    with pytest.raises(ValueError, match="hierarchy"):
        fastreduce.LocalSGD(model, inner_opt(model), 4, hierarchy={2: 1}, compression=cfg, transport=transport)
    return out


@pytest.mark.parametrize("transport", ["shm", "process_group"])
def test_localsgd_with_sparseloco_is_diloco_with_outer_sgd_lr1(transport: str) -> None:
    for r in run_ranks(localsgd_against_diloco, 2, transport, timeout=120):
        for n, t in r["localsgd"].items():
            assert torch.equal(t, r["diloco"][n]), n
        assert all(torch.equal(a, b) for a, b in zip(r["localsgd_acc"], r["diloco_acc"]))
        assert any(a.abs().sum() > 0 for a in r["localsgd_acc"])
