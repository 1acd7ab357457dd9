"""Quantized wires of the local-update modes (``DiLoCo`` and ``LocalSGD`` with
``wire_dtype=torch.float8_e4m3fn``, ``torch.float8_e5m2``, ``"int8"`` or ``"int4"``,
with and without ``error_feedback``) on real Gloo groups, CPU, against a reference
written here from the algorithm of fastreduce/comm/quantized.py and the modes' rules:

at a sync of fragment k, each rank's pseudo-gradient ``anchor - x`` (fp32, elementwise)
is placed in an fp32 buffer of ``n_k`` values laid out like the fragment's layout
segment (parameters in model order, every offset rounded up to a multiple of 32, zeros
in the gaps and in the tail padding up to a multiple of W x 256); with the buffer cut
into W chunks of ``m = n_k / W``, every rank's buffer goes through
``BlockQuant(fmt).roundtrip`` viewed as (W, m) rows; the owner of chunk c sums the
ranks' round trips of chunk c in fp32 in ``sum_order(c, W)`` (``acc = q[o0].clone();
acc += q[o1]; ...; acc /= W``) and that mean chunk goes through the round trip again.
With error feedback each rank adds its residual first and keeps what it rounded away
(``e := fl(x + e) - rt(fl(x + e))``), each owner likewise for its chunk of the mean
(``f := fl(mu + f) - rt(fl(mu + f))``). Then:

* DiLoCo with an outer ``SGD(lr=1.0)`` (no momentum) steps the anchor by
  ``p.add_(grad, alpha=-1.0)`` with the mean as grad, and every rank's parameters of
  the fragment become that new anchor: ``anchor.add(mean, alpha=-1.0)``;
* LocalSGD: ``x := anchor - mean`` (``torch.sub``), ``anchor := x``.

Why: the wire is lossy on purpose, so the only way to know that a local-update mode
computes the documented mean of the documented pseudo-gradient (and not, say, a mean of
``x - anchor``, one with other block boundaries or padding, another summation order, a
rounding fewer, or residuals that are lost across syncs or fragments) is to compare bit
for bit with that definition. ``BlockQuant.roundtrip`` is trusted (tests/test_quant.py
checks it from the bits); tests/test_quantized_wire.py checks the same ``QuantMean`` in
the fused reducer; here what is checked is the modes around it.

* DiLoCo bit for bit: ``Linear(16, 40), Tanh, Linear(40, 8)`` with a batch per rank and
  step, inner ``SGD(lr=0.1)``, H = 4, 3 syncs, at 2 and 3 ranks, every format, both
  transports, error feedback on and off (and 2 fragments for int4 with and int8
  without error feedback): at every sync step every rank's parameters and the whole
  fragment wire (gaps and padding included) equal the reference; between syncs the
  mode leaves the parameters alone; every rank holds the same parameters after a sync
  (one fragment); the transports agree bit for bit; the final residuals
  (``state_dict()["wire_residuals"]``) equal the reference's. The layout follows its
  rule. int8 and int4 pin the block boundaries and, at 3 ranks, the summation order.
  With error feedback on a process group the wire goes in pieces of 128 bytes a row
  (pipelined, residuals kept per piece); without, whole.
* LocalSGD bit for bit (int8 with error feedback at 2 and 3 ranks, int4 without at 2),
  both transports, the same way.
* Checkpoint: DiLoCo int4 with error feedback, ``state_dict()`` after 2 syncs through
  torch.save/load into a fresh DiLoCo (another model init, its inner optimizer's state
  loaded) continues bit for bit with the original for 2 more syncs, residuals included;
  the same state with its residuals zeroed does not (so the residuals are what is
  checked). A state saved without error feedback does not load into a mode with it,
  nor the reverse (``ValueError`` naming error_feedback).
* Bytes: ``bytes_per_sync`` is sum_k W x (m_k bits / 8 + 4 m_k / 256) (codes and one
  fp32 scale per 256 values); int4 moves at least 7.5x fewer bytes than an fp32 wire
  on a model large enough that the W x 256 padding does not count (~100k values).
* Bad settings raise ``ValueError`` naming the problem, in both modes.
* Nothing is lost with error feedback (int4, 2 ranks, both transports): with fixed
  per-rank gradients and an outer ``SGD(lr=0)`` the anchor never moves, so every sync
  averages the same pseudo-gradients; over 20 syncs the sum of the means the outer
  optimizer receives misses 20 x the exact mean by at most 1/5 of what it misses
  without error feedback (and by at most 2 x one sync's error without it), and it
  equals ``20 exact - mean_r(residual_r) - concat(mean residuals)`` up to fp32 roundoff.

One spawn per world size (``run_ranks``) computes every case of that size and returns
raw data (a case that raises inside a rank fails only its own tests: ``guarded``); the
reference and every assertion run here, in the parent.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_quantized_wire import ref_mean
from test_sparseloco import first_diff
from test_fused import saved_and_loaded, case_runner, expect_raises, per_rank
from torch import nn

import fastreduce

pytestmark = pytest.mark.timeout(300)

SEED = 11
BLOCK = 256
ALIGN = 32
H = 4                        # sync_every
SYNCS = 3                    # syncs per fragment in the bit-for-bit cases
CKPT_SYNCS = 2               # syncs before the checkpoint; as many after
FIXED_SYNCS = 20             # error feedback: the same pseudo-gradient every sync
INNER_LR = 0.1
WORLDS = (2, 3)
TRANSPORTS = ("process_group", "shm")
WIRES: dict[str, Any] = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
                         "int8": "int8", "int4": "int4"}
BITS = {"fp8_e4m3": 8, "fp8_e5m2": 8, "int8": 8, "int4": 4}
FRAGMENT_CASES = (("int4", True), ("int8", False))      # DiLoCo with 2 fragments: (format, error feedback)
LOCAL_CASES = {2: (("int8", True), ("int4", False)), 3: (("int8", True),)}
SPAWN_TIMEOUT = 240.0
U = 2.0**-24


# ============================================================== models and data

def make_model(seed: int = SEED) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 40), nn.Tanh(), nn.Linear(40, 8))


def wide_model() -> nn.Module:
    """~100k values: the W x 256 padding is under 1% of the wire."""
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(128, 512), nn.Tanh(), nn.Linear(512, 64))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per rank and step; inputs scaled by rank so the ranks' block scales differ."""
    g = torch.Generator().manual_seed(1000 * step + rank + 5)
    return torch.randn(8, 16, generator=g) * (1.0 + 0.5 * rank), torch.randn(8, 8, generator=g)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def inner_step(model: nn.Module, inner: torch.optim.Optimizer, rank: int, step: int) -> None:
    inner.zero_grad(set_to_none=True)
    x, y = batch(rank, step)
    ((model(x) - y) ** 2).mean().backward()
    inner.step()


def expected_layout(model: nn.Module, fragments: list[list[str]], world: int) -> list[tuple[list, int]]:
    """Per fragment (all fp32: one segment): its slots ``(name, offset, numel)`` by the
    layout rule (model order, offsets rounded up to 32) and its padded length."""
    params = dict(model.named_parameters())
    out = []
    for names in fragments:
        slots, off = [], 0
        for n in names:
            slots.append((n, off, params[n].numel()))
            off = -(-(off + params[n].numel()) // ALIGN) * ALIGN
        out.append((slots, -(-off // (world * BLOCK)) * world * BLOCK))
    return out


def place(values: dict[str, torch.Tensor], slots: list, n: int) -> torch.Tensor:
    flat = torch.zeros(n, dtype=torch.float32)
    for name, off, numel in slots:
        flat[off:off + numel] = values[name].reshape(-1)
    return flat


# ============================================================== the reference

def reference(kind: str, fmt: str, ef: bool, outs: list[dict], num_fragments: int) -> dict:
    """Replay the ranks' syncs from their parameters just before each sync: per sync
    step the expected parameters (every rank alike) and wire; the final residuals."""
    world = len(outs)
    layout = expected_layout(make_model(), outs[0]["fragments"], world)
    apply_at = [((k + 1) * H // num_fragments) % H for k in range(num_fragments)]
    anchor = dict(outs[0]["init"])
    e = [[torch.zeros(n) for _ in range(world)] for _, n in layout]
    f = [[torch.zeros(n // world) for _ in range(world)] for _, n in layout]
    syncs: dict[int, dict] = {}
    for s in range(1, len(outs[0]["pre"]) + 1):
        for k, t in enumerate(apply_at):
            if s % H != t:
                continue
            slots, n = layout[k]
            bufs = [place({name: anchor[name] - o["pre"][s - 1][name] for name, _, _ in slots}, slots, n)
                    for o in outs]
            mean = ref_mean(fmt, bufs, e[k] if ef else None, f[k] if ef else None)
            for name, off, numel in slots:
                g = mean[off:off + numel].view(anchor[name].shape)
                if kind == "diloco":  # the outer SGD(lr=1.0): p.add_(grad, alpha=-lr) on the anchor
                    anchor[name] = anchor[name].add(g, alpha=-1.0)
                else:                 # LocalSGD: x := anchor - mean
                    anchor[name] = torch.sub(anchor[name], g)
            syncs[s] = {"fragment": k, "wire": mean, "params": {name: anchor[name] for name, _, _ in slots}}
    return {"layout": layout, "syncs": syncs, "e": e, "f": f}


# ============================================================== cases run in the ranks

def mode_info(mode: Any) -> dict:
    return {"segments": [(seg.numel, [(s.name, s.offset, s.numel) for s in seg.slots])
                         for seg in mode.layout.segments],
            "frag_segments": [list(r) for r in mode._frag_segments],
            "fragments": mode.fragment_names, "bytes": mode.bytes_per_sync,
            "quant": [(q.codec.fmt, q.codec.block, q.shm is not None) for q in mode._quant_means],
            "pieces": [len(q.pieces) for q in mode._quant_means]}


def trajectory_case(rank: int, world: int, kind: str, fmt: str, transport: str, ef: bool,
                    fragments: int = 1) -> dict:
    """H x SYNCS inner steps; per step the parameters just before the mode's step hook
    ("pre": a post-hook registered before the mode's runs first), after the step
    ("post"), and the fragment wire (what the last sync averaged). With error feedback,
    on a process group, each QuantMean goes in pieces of 128 bytes a row (pipelined:
    the residuals are kept per piece)."""
    from fastreduce.comm import quantized

    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    pre: list[dict] = []
    inner.register_step_post_hook(lambda *_: pre.append(snapshot(model)))
    kw = {"wire_dtype": WIRES[fmt], "error_feedback": ef, "transport": transport}
    default, quantized.PIECE_BYTES = quantized.PIECE_BYTES, 128 if ef else quantized.PIECE_BYTES
    try:
        if kind == "diloco":
            outer = torch.optim.SGD(model.parameters(), lr=1.0)
            mode = fastreduce.DiLoCo(model, inner, outer, H, fragments=fragments, **kw)
        else:
            mode = fastreduce.LocalSGD(model, inner, H, **kw)
    finally:
        quantized.PIECE_BYTES = default
    out: dict[str, Any] = {"init": snapshot(model), "pre": pre, "post": [], "wire": []}
    for step in range(H * SYNCS):
        inner_step(model, inner, rank, step)
        out["post"].append(snapshot(model))
        out["wire"].append([w.clone() for w in mode._frag_wire])
    out.update(mode_info(mode))
    out["residuals"] = mode.state_dict().get("wire_residuals")
    mode.remove()
    return out


def build_ckpt(seed: int, transport: str, ef: bool) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    model = make_model(seed)
    inner = torch.optim.SGD(model.parameters(), lr=INNER_LR, momentum=0.9)  # an inner state to carry
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    mode = fastreduce.DiLoCo(model, inner, outer, H, wire_dtype="int4", error_feedback=ef, transport=transport)
    return model, inner, mode


def ckpt_case(rank: int, world: int, transport: str) -> dict:
    """int4 with error feedback: save after CKPT_SYNCS syncs, resume in a fresh mode
    (another init: every value must come from the state), run both CKPT_SYNCS more."""
    a, ia, ma = build_ckpt(SEED, transport, True)
    for step in range(H * CKPT_SYNCS):
        inner_step(a, ia, rank, step)
    saved = saved_and_loaded({"mode": ma.state_dict(), "inner": ia.state_dict()})
    runs: dict[str, Any] = {"a": (a, ia, ma)}
    for name, zero in (("b", False), ("c", True)):  # c: the residuals zeroed, the control
        m, i, d = build_ckpt(SEED + 1, transport, True)
        state = saved_and_loaded(saved)
        if zero:
            state["mode"]["wire_residuals"] = [{k: torch.zeros_like(t) for k, t in r.items()}
                                               for r in state["mode"]["wire_residuals"]]
        i.load_state_dict(state["inner"])
        d.load_state_dict(state["mode"])
        runs[name] = (m, i, d)
    out: dict[str, Any] = {"saved_keys": sorted(saved["mode"]), "saved_residuals": saved["mode"]["wire_residuals"],
                           "loaded_equal": all(torch.equal(p, q) for p, q in zip(runs["b"][0].parameters(),
                                                                                  a.parameters()))}
    for name, (m, i, d) in runs.items():
        traj = []
        for step in range(H * CKPT_SYNCS, 2 * H * CKPT_SYNCS):
            inner_step(m, i, rank, step)
            traj.append(snapshot(m))
        out[name] = traj
        out[name + "_residuals"] = d.state_dict()["wire_residuals"]
        out[name + "_syncs"] = d.syncs
        d.remove()
    # With and without error feedback: neither state loads into the other mode.
    _, _, plain = build_ckpt(SEED, transport, False)
    plain_state = saved_and_loaded(plain.state_dict())
    _, _, fed = build_ckpt(SEED, transport, True)
    out["plain_into_ef"] = expect_raises(ValueError, lambda: fed.load_state_dict(plain_state))
    out["ef_into_plain"] = expect_raises(ValueError, lambda: plain.load_state_dict(saved["mode"]))
    return out


def live_load_case(rank: int, world: int, transport: str) -> dict:
    """int8 with error feedback, 2 fragments, fragment_delay=1: the state saved after step 5
    loaded after step 7, fragment 1 on the wire, into the same mode, and into a fresh one
    (another init: every value from the state); both then run 8 more steps."""
    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        model = make_model(seed)
        inner = torch.optim.SGD(model.parameters(), lr=INNER_LR, momentum=0.9)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        return model, inner, fastreduce.DiLoCo(model, inner, outer, H, fragments=2, fragment_delay=1,
                                               wire_dtype="int8", error_feedback=True, transport=transport)

    (a, ia, ma), (b, ib, mb) = build(SEED), build(SEED + 1)
    for step in range(5):
        inner_step(a, ia, rank, step)
    saved = saved_and_loaded({"mode": ma.state_dict(), "inner": ia.state_dict()})
    for step in range(5, 7):
        inner_step(a, ia, rank, step)
    out: dict[str, Any] = {"in_flight": sorted(k for k, v in ma._in_flight.items() if v != (None, None))}
    for inner, mode in ((ia, ma), (ib, mb)):
        state = saved_and_loaded(saved)
        inner.load_state_dict(state["inner"])
        mode.load_state_dict(state["mode"])
    out["residuals"] = [{k: torch.equal(t, r[k]) for k, t in q.state_dict().items()}
                        for q, r in zip(ma._quant_means, saved["mode"]["wire_residuals"])]
    out["same"] = []
    for step in range(5, 13):
        inner_step(a, ia, rank, step)
        inner_step(b, ib, rank, step)
        out["same"].append(all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters())))
    out["same_residuals"] = all(torch.equal(x[k], y[k]) for x, y in zip(ma.state_dict()["wire_residuals"],
                                                                       mb.state_dict()["wire_residuals"]) for k in x)
    ma.remove()
    mb.remove()
    return out


def bytes_case(rank: int, world: int) -> dict:
    """bytes_per_sync (and the layout) of the wide model with every wire, 1 and 2 fragments."""
    out = {}
    for wire in [*WIRES, "fp32"]:
        for fragments in (1, 2):
            model = wide_model()
            inner = torch.optim.SGD(model.parameters(), lr=INNER_LR)
            outer = torch.optim.SGD(model.parameters(), lr=1.0)
            w = torch.float32 if wire == "fp32" else WIRES[wire]
            mode = fastreduce.DiLoCo(model, inner, outer, H, fragments=fragments, wire_dtype=w,
                                     transport="process_group")
            out[("diloco", wire, fragments)] = mode_info(mode)
            mode.remove()
    model = wide_model()
    mode = fastreduce.LocalSGD(model, torch.optim.SGD(model.parameters(), lr=INNER_LR), H, wire_dtype="int4",
                               transport="process_group")
    out[("localsgd", "int4", 1)] = mode_info(mode)
    mode.remove()
    return out


BAD = {  # name: (settings, words the message must hold)
    "ef_bf16": ({"wire_dtype": torch.bfloat16, "error_feedback": True}, ("error_feedback",)),
    "quant_sparseloco": ({"wire_dtype": "int8", "compression": "sparseloco"}, ("compression",)),
    "bogus": ({"wire_dtype": "bogus"}, ("wire_dtype", "bogus")),
    "torch_int8": ({"wire_dtype": torch.int8}, ("wire_dtype", "torch.int8")),
}


def bad_case(rank: int, world: int) -> dict:
    out = {}
    for name, (kw, _) in BAD.items():
        for kind in ("diloco", "localsgd"):
            kw = dict(kw)
            if kw.get("compression") == "sparseloco":
                kw["compression"] = fastreduce.SparseLoCo()
            model = make_model()
            inner = torch.optim.SGD(model.parameters(), lr=INNER_LR)
            if kind == "diloco":
                outer = torch.optim.SGD(model.parameters(), lr=1.0)
                build = lambda model=model, inner=inner, outer=outer, kw=kw: fastreduce.DiLoCo(
                    model, inner, outer, H, **kw).remove()
            else:
                build = lambda model=model, inner=inner, kw=kw: fastreduce.LocalSGD(
                    model, inner, H, **kw).remove()
            out[(kind, name)] = expect_raises(ValueError, build)
    return out


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps, at every step, a copy of the gradient it is given, by name."""

    def __init__(self, model: nn.Module, **kw: Any):
        super().__init__(model.parameters(), **kw)
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.seen: list[dict[str, torch.Tensor]] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        self.seen.append({self.names[id(p)]: p.grad.clone() for g in self.param_groups for p in g["params"]
                          if p.grad is not None})
        return super().step(closure)


def fixed_grads(rank: int) -> dict[str, torch.Tensor]:
    """Fixed per-rank gradients, per parameter a magnitude and per rank a scale."""
    g = torch.Generator().manual_seed(77 + rank)
    out = {}
    for k, (n, p) in enumerate(make_model().named_parameters()):
        out[n] = torch.randn(p.shape, generator=g) * (10.0 ** (k - 2)) * (1.0 + rank)
    return out


def fixed_case(rank: int, world: int, fmt: str, transport: str, ef: bool) -> dict:
    """DiLoCo with an outer SGD(lr=0): the anchor never moves, and the inner steps (the
    same gradients every step) bring x to the same place before every sync, so every
    sync averages the same pseudo-gradients. Returns the means the outer optimizer got."""
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    pre: list[dict] = []
    inner.register_step_post_hook(lambda *_: pre.append(snapshot(model)))
    outer = RecordingSGD(model, lr=0.0)
    mode = fastreduce.DiLoCo(model, inner, outer, H, wire_dtype=WIRES[fmt], error_feedback=ef, transport=transport)
    init = snapshot(model)
    grads = fixed_grads(rank)
    for _ in range(H * FIXED_SYNCS):
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        inner.step()
    deltas = [{n: init[n] - x[n] for n in init} for x in pre[H - 1::H]]
    out = {"delta": deltas[0], "same_delta": all(torch.equal(d[n], deltas[0][n]) for d in deltas for n in init),
           "seen": outer.seen, "anchor_kept": all(torch.equal(p.detach(), init[n]) for n, p in model.named_parameters()),
           "residuals": mode.state_dict().get("wire_residuals"), "fragments": mode.fragment_names}
    mode.remove()
    return out


def cases(world: int) -> list[tuple]:
    out: list[tuple] = []
    for fmt in WIRES:
        for t in TRANSPORTS:
            for ef in (False, True):
                out.append(("traj", "diloco", fmt, t, ef, 1))
    for fmt, ef in FRAGMENT_CASES:
        for t in TRANSPORTS:
            out.append(("traj", "diloco", fmt, t, ef, 2))
    for fmt, ef in LOCAL_CASES[world]:
        for t in TRANSPORTS:
            out.append(("traj", "localsgd", fmt, t, ef))
    out.append(("bytes",))
    if world == 2:
        for t in TRANSPORTS:
            out.append(("ckpt", t))
            out.append(("live_load", t))
            for ef in (False, True):
                out.append(("fixed", "int4", t, ef))
        out.append(("bad",))
    return out


CASE_FNS = {"traj": trajectory_case, "ckpt": ckpt_case, "live_load": live_load_case, "bytes": bytes_case,
            "fixed": fixed_case, "bad": bad_case}


run = case_runner(__name__, cases, SPAWN_TIMEOUT)
"""One group per world size (started by the first test that asks), every case of it."""


def ids(v: Any) -> str:
    if isinstance(v, bool):
        return "ef" if v else "plain"
    return f"world{v}" if isinstance(v, int) else str(v)


DILOCO_GRID = [pytest.param(w, f, t, ef, F, id=f"world{w}-{f}-{t}-{'ef' if ef else 'plain'}-F{F}")
               for w in WORLDS for f, t, ef, F in
               [(f, t, ef, 1) for f in WIRES for t in TRANSPORTS for ef in (False, True)]
               + [(f, t, ef, 2) for f, ef in FRAGMENT_CASES for t in TRANSPORTS]]
LOCAL_GRID = [(w, f, t, ef) for w in WORLDS for f, ef in LOCAL_CASES[w] for t in TRANSPORTS]


# ============================================================== checks in the parent

def check_layout(outs: list[dict], world: int, num_fragments: int) -> None:
    """The mode's layout is the rule's: one fp32 segment per fragment, offsets aligned to
    32, each padded to a multiple of W x 256; a QuantMean per fragment."""
    want = expected_layout(make_model(), outs[0]["fragments"], world)
    for rank, out in enumerate(outs):
        assert len(out["fragments"]) == num_fragments
        assert [n for frag in out["fragments"] for n in frag] == [n for n, _ in make_model().named_parameters()]
        assert out["frag_segments"] == [[k] for k in range(num_fragments)], out["frag_segments"]
        assert out["segments"] == [(n, slots) for slots, n in want], f"rank {rank}: {out['segments']}"
        assert all(n % (world * BLOCK) == 0 for n, _ in out["segments"])
        assert [w.numel() for w in out["wire"][0]] == [n for _, n in want]


def expected_pieces(fmt: str, out: dict, world: int, transport: str, ef: bool) -> list[int]:
    """Per fragment: none on shared memory; one on a process group, or with error
    feedback (pieces of 128 bytes a row) min(8, row bytes // 128, blocks a chunk)."""
    if transport == "shm":
        return [0] * len(out["segments"])
    ms = [n // world for n, _ in out["segments"]]
    return [max(1, min(8, row_bytes(fmt, m) // 128, m // BLOCK)) if ef else 1 for m in ms]


def check_trajectory(kind: str, fmt: str, ef: bool, outs: list[dict], num_fragments: int) -> dict:
    """Every rank's parameters after every step and the wire after every sync equal
    the reference; the final residuals too. Returns the reference."""
    ref = reference(kind, fmt, ef, outs, num_fragments)
    steps = len(outs[0]["post"])
    assert sorted(ref["syncs"]) == [s for s in range(1, steps + 1)
                                    if any(s % H == ((k + 1) * H // num_fragments) % H
                                           for k in range(num_fragments))]
    assert len(ref["syncs"]) == SYNCS * num_fragments
    for rank, out in enumerate(outs):
        assert len(out["pre"]) == steps, "the recording hook did not run once per inner step"
        for s in range(1, steps + 1):
            sync = ref["syncs"].get(s)
            post, pre = out["post"][s - 1], out["pre"][s - 1]
            for name in post:
                want = sync["params"][name] if sync and name in sync["params"] else pre[name]
                assert torch.equal(post[name], want), \
                    f"rank {rank} step {s} {name} ({'sync' if sync and name in sync['params'] else 'no sync'}): " \
                    f"{first_diff(post[name], want)}"
            if sync:
                got = out["wire"][s - 1][sync["fragment"]]
                assert torch.equal(got, sync["wire"]), f"rank {rank} step {s} wire: {first_diff(got, sync['wire'])}"
        if ef:
            assert out["residuals"] is not None and len(out["residuals"]) == num_fragments
            for k, st in enumerate(out["residuals"]):
                assert torch.equal(st["residual"], ref["e"][k][rank]), \
                    f"rank {rank} fragment {k} residual: {first_diff(st['residual'], ref['e'][k][rank])}"
                assert torch.equal(st["mean_residual"], ref["f"][k][rank]), \
                    f"rank {rank} fragment {k} mean_residual: {first_diff(st['mean_residual'], ref['f'][k][rank])}"
                assert st["residual"].abs().max() > 0
        else:
            assert out["residuals"] is None
    return ref


# ============================================================== 1. DiLoCo bit for bit

@pytest.mark.parametrize("world,fmt,transport,ef,fragments", DILOCO_GRID)
def test_diloco_layout_follows_the_rule(world: int, fmt: str, transport: str, ef: bool, fragments: int) -> None:
    """One fp32 segment per fragment, offsets aligned to 32, padded to a multiple of
    W x 256; one QuantMean per fragment, of the format, on shared memory only for shm
    (on a process group with error feedback, the first fragment's in several pieces)."""
    outs = per_rank(run(world), ("traj", "diloco", fmt, transport, ef, fragments))
    check_layout(outs, world, fragments)
    for out in outs:
        assert out["quant"] == [(fmt, BLOCK, transport == "shm")] * fragments
        assert out["pieces"] == expected_pieces(fmt, out, world, transport, ef), out["pieces"]
    if transport == "process_group" and ef and world == 2:
        assert outs[0]["pieces"][0] > 1  # the pipelined path is the one checked bit for bit


@pytest.mark.parametrize("world,fmt,transport,ef,fragments", DILOCO_GRID)
def test_diloco_equals_the_reference_bit_for_bit(world: int, fmt: str, transport: str, ef: bool,
                                                 fragments: int) -> None:
    """At every sync every rank's parameters are ``anchor.add(quantized mean(anchor -
    x_r), alpha=-1)`` and the fragment wire the quantized mean (gaps and padding
    included), bit for bit; between syncs nothing changes; the final residuals match."""
    outs = per_rank(run(world), ("traj", "diloco", fmt, transport, ef, fragments))
    ref = check_trajectory("diloco", fmt, ef, outs, fragments)
    # the test shows something: the wire rounded the mean (it is not the exact fp32 mean)
    s = min(ref["syncs"])
    slots, n = ref["layout"][ref["syncs"][s]["fragment"]]
    init = outs[0]["init"]
    exact = sum(place({k: init[k] - o["pre"][s - 1][k] for k, _, _ in slots}, slots, n).double() for o in outs) / world
    assert not torch.equal(ref["syncs"][s]["wire"].double(), exact)


@pytest.mark.parametrize("world", WORLDS, ids=ids)
@pytest.mark.parametrize("fmt", list(WIRES))
@pytest.mark.parametrize("ef", (False, True), ids=ids)
def test_diloco_ranks_hold_the_same_params_after_a_sync(world: int, fmt: str, ef: bool) -> None:
    """One fragment: after every sync every rank's parameters equal rank 0's, bit for bit
    (and before the first sync they differ: each rank trained on its own data)."""
    for transport in TRANSPORTS:
        outs = per_rank(run(world), ("traj", "diloco", fmt, transport, ef, 1))
        for s in range(H, H * SYNCS + 1, H):
            for rank, out in enumerate(outs[1:], start=1):
                for name, p in outs[0]["post"][s - 1].items():
                    assert torch.equal(out["post"][s - 1][name], p), f"{transport} rank {rank} step {s} {name}"
        assert any(not torch.equal(outs[1]["pre"][H - 1][k], outs[0]["pre"][H - 1][k]) for k in outs[0]["init"])


@pytest.mark.parametrize("world", WORLDS, ids=ids)
@pytest.mark.parametrize("fmt", list(WIRES))
def test_diloco_transports_agree_bit_for_bit(world: int, fmt: str) -> None:
    """shm and process_group give bit-identical parameters, wires and residuals at every
    step (error feedback on and off, 1 and 2 fragments)."""
    res = run(world)
    keys = [(ef, 1) for ef in (False, True)] + [(ef, 2) for f, ef in FRAGMENT_CASES if f == fmt]
    for ef, fragments in keys:
        pg = per_rank(res, ("traj", "diloco", fmt, "process_group", ef, fragments))
        shm = per_rank(res, ("traj", "diloco", fmt, "shm", ef, fragments))
        for rank, (a, b) in enumerate(zip(pg, shm)):
            where = f"ef={ef} fragments={fragments} rank {rank}"
            for s, (x, y) in enumerate(zip(a["post"], b["post"]), start=1):
                for name in x:
                    assert torch.equal(x[name], y[name]), f"{where} step {s} {name}"
            for s, (x, y) in enumerate(zip(a["wire"], b["wire"]), start=1):
                assert all(torch.equal(u, v) for u, v in zip(x, y)), f"{where} step {s} wire"
            if ef:
                for u, v in zip(a["residuals"], b["residuals"]):
                    assert all(torch.equal(u[k], v[k]) for k in u), f"{where} residuals"


# ============================================================== 2. LocalSGD bit for bit

@pytest.mark.parametrize("world,fmt,transport,ef", LOCAL_GRID, ids=ids)
def test_localsgd_equals_the_reference_bit_for_bit(world: int, fmt: str, transport: str, ef: bool) -> None:
    """At every sync every rank's parameters are ``last average - quantized mean(last
    average - x_r)`` (torch.sub) and the wire the quantized mean, bit for bit; between
    syncs nothing changes; every rank holds the same parameters; the residuals match."""
    outs = per_rank(run(world), ("traj", "localsgd", fmt, transport, ef))
    check_layout(outs, world, 1)
    assert all(o["quant"] == [(fmt, BLOCK, transport == "shm")] for o in outs)
    assert all(o["pieces"] == expected_pieces(fmt, o, world, transport, ef) for o in outs)
    check_trajectory("localsgd", fmt, ef, outs, 1)
    for s in range(H, H * SYNCS + 1, H):
        for out in outs[1:]:
            assert all(torch.equal(out["post"][s - 1][k], v) for k, v in outs[0]["post"][s - 1].items())


@pytest.mark.parametrize("world,fmt,ef", sorted({(w, f, ef) for w, f, _, ef in LOCAL_GRID}), ids=ids)
def test_localsgd_transports_agree_bit_for_bit(world: int, fmt: str, ef: bool) -> None:
    res = run(world)
    pg = per_rank(res, ("traj", "localsgd", fmt, "process_group", ef))
    shm = per_rank(res, ("traj", "localsgd", fmt, "shm", ef))
    for rank, (a, b) in enumerate(zip(pg, shm)):
        for s, (x, y) in enumerate(zip(a["post"], b["post"]), start=1):
            assert all(torch.equal(x[k], y[k]) for k in x), f"rank {rank} step {s}"


# ============================================================== 3. checkpoint

@pytest.mark.parametrize("transport", TRANSPORTS)
def test_diloco_resume_with_error_feedback_is_bit_for_bit(transport: str) -> None:
    """int4 with error feedback: a fresh DiLoCo (another init) that loads the state saved
    after 2 syncs (through torch.save) continues bit for bit with the original for 2
    more syncs, residuals included; with the saved residuals zeroed it does not."""
    for rank, out in enumerate(per_rank(run(2), ("ckpt", transport))):
        assert "wire_residuals" in out["saved_keys"]
        assert len(out["saved_residuals"]) == 1 and set(out["saved_residuals"][0]) == {"residual", "mean_residual"}
        assert out["saved_residuals"][0]["residual"].abs().max() > 0
        assert out["loaded_equal"], "the resumed model does not hold the saved parameters"
        assert out["a_syncs"] == out["b_syncs"] == 2 * CKPT_SYNCS
        for step, (x, y) in enumerate(zip(out["a"], out["b"])):
            for name in x:
                assert torch.equal(x[name], y[name]), f"rank {rank} step {step} {name}: {first_diff(x[name], y[name])}"
        for key in ("residual", "mean_residual"):
            assert torch.equal(out["a_residuals"][0][key], out["b_residuals"][0][key]), f"rank {rank} {key}"
        assert any(not torch.equal(x[k], z[k]) for x, z in zip(out["a"], out["c"]) for k in x), \
            "zeroing the saved residuals changes nothing: the test shows nothing about them"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_state_loaded_with_a_fragment_on_the_wire_keeps_its_residuals(transport: str) -> None:
    """A live DiLoCo (int8, error feedback) loads a state while a fragment is on the wire:
    the residuals are the saved ones, and the next 8 steps equal a fresh mode's that loaded
    the same state, bit for bit. The fragment's completion wrote its owner's mean residual
    over the loaded one."""
    for rank, out in enumerate(per_rank(run(2), ("live_load", transport))):
        assert out["in_flight"] == [1], out  # the load met a fragment on the wire
        assert out["residuals"] == [{"residual": True, "mean_residual": True}] * 2, (rank, out["residuals"])
        assert out["same"] == [True] * 8 and out["same_residuals"], (rank, out)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("what", ["plain_into_ef", "ef_into_plain"])
def test_residual_state_needs_the_same_error_feedback(transport: str, what: str) -> None:
    """A state saved without error feedback does not load into a mode with it, nor the
    reverse: ValueError naming error_feedback, on every rank."""
    for out in per_rank(run(2), ("ckpt", transport)):
        got = out[what]
        assert got["raised"] == "ValueError", got
        assert "error_feedback" in got["message"], got


# ============================================================== 4. bytes

def row_bytes(fmt: str, m: int) -> int:
    return m * BITS[fmt] // 8 + 4 * (m // BLOCK)


@pytest.mark.parametrize("world", WORLDS, ids=ids)
@pytest.mark.parametrize("fmt", list(WIRES))
def test_bytes_per_sync_are_codes_and_scales(world: int, fmt: str) -> None:
    """bytes_per_sync = sum over fragments of W x (m bits / 8 + 4 m / 256), m = n_k / W,
    for the wide model (1 and 2 fragments) and the small one (every trajectory case)."""
    res = run(world)
    for out in per_rank(res, ("bytes",)):
        for fragments in (1, 2):
            info = out[("diloco", fmt, fragments)]
            layout = expected_layout(wide_model(), info["fragments"], world)
            assert info["segments"] == [(n, slots) for slots, n in layout]
            assert info["bytes"] == sum(world * row_bytes(fmt, n // world) for _, n in layout), (fragments, info)
        for transport in TRANSPORTS:
            for ef in (False, True):
                info = unwrap_one(res, ("traj", "diloco", fmt, transport, ef, 1))
                assert info["bytes"] == sum(world * row_bytes(fmt, n // world) for n, _ in info["segments"])


def unwrap_one(res: list[dict], key: tuple) -> dict:
    return per_rank(res, key)[0]


@pytest.mark.parametrize("world", WORLDS, ids=ids)
def test_int4_moves_at_least_7_5x_fewer_bytes_than_fp32(world: int) -> None:
    """On the wide model, DiLoCo's and LocalSGD's int4 bytes_per_sync are at most 1/7.5
    of an fp32 wire's (which carries at least 4 bytes a value)."""
    numel = sum(p.numel() for p in wide_model().parameters())
    for out in per_rank(run(world), ("bytes",)):
        for fragments in (1, 2):
            fp32 = out[("diloco", "fp32", fragments)]["bytes"]
            assert fp32 >= 4 * numel
            for kind in ("diloco", "localsgd"):
                if (kind, "int4", fragments) in out:
                    int4 = out[(kind, "int4", fragments)]["bytes"]
                    assert int4 * 7.5 <= fp32, f"{kind} fragments={fragments}: int4 {int4} vs fp32 {fp32}"


# ============================================================== 5. bad settings

@pytest.mark.parametrize("kind", ["diloco", "localsgd"])
@pytest.mark.parametrize("name", list(BAD))
def test_bad_settings_raise_value_error(kind: str, name: str) -> None:
    """error_feedback with a bf16 wire, a quantized wire with compression=SparseLoCo(),
    an unknown wire name and an int dtype raise a ValueError naming it, on every rank."""
    for out in per_rank(run(2), ("bad",)):
        got = out[(kind, name)]
        assert got["raised"] == "ValueError", got
        for word in BAD[name][1]:
            assert word in got["message"], got


# ============================================================== 6. error feedback loses nothing

@pytest.mark.parametrize("transport", TRANSPORTS)
def test_error_feedback_loses_nothing_over_20_syncs(transport: str) -> None:
    """int4, 2 ranks, the same pseudo-gradients every sync (outer lr 0): over 20 syncs
    |sum of the means the outer optimizer got - 20 x exact mean| with error feedback is
    <= 1/5 of it without, and <= 2 x one sync's error without; and the sum equals
    20 exact - mean_r(residual_r) - concat(mean residuals) within 20 (W + 4) u G."""
    res = run(2)
    plain = per_rank(res, ("fixed", "int4", transport, False))
    fed = per_rank(res, ("fixed", "int4", transport, True))
    world = len(plain)
    for out in plain + fed:
        assert out["same_delta"], "the pseudo-gradients changed between syncs"
        assert out["anchor_kept"], "the outer SGD(lr=0) moved the parameters"
        assert len(out["seen"]) == FIXED_SYNCS
    for a, b in zip(plain, fed):  # the same inputs with and without error feedback
        assert all(torch.equal(a["delta"][k], b["delta"][k]) for k in a["delta"])
    names = list(plain[0]["delta"])
    exact = {k: sum(o["delta"][k].double() for o in plain) / world for k in names}

    def total(out: dict) -> dict[str, torch.Tensor]:
        return {k: sum(seen[k].double() for seen in out["seen"]) for k in names}

    def err(got: dict[str, torch.Tensor], times: int) -> float:
        return max((got[k] - times * exact[k]).abs().max().item() for k in names)

    one_sync = err({k: plain[0]["seen"][0][k].double() for k in names}, 1)
    without, with_ef = err(total(plain[0]), FIXED_SYNCS), err(total(fed[0]), FIXED_SYNCS)
    assert one_sync > 0
    assert with_ef <= without / 5, f"with error feedback {with_ef:.3e}, without {without:.3e}"
    assert with_ef <= 2 * one_sync, f"with error feedback {with_ef:.3e}, one sync without {one_sync:.3e}"
    for out in (plain[1], fed[1]):  # every rank got the same means
        for s, seen in enumerate(out["seen"]):
            ref = (plain[0] if out is plain[1] else fed[0])["seen"][s]
            assert all(torch.equal(seen[k], ref[k]) for k in names), f"sync {s}"
    # the bookkeeping: what is missing is exactly what the residuals hold
    (slots, n), = expected_layout(make_model(), fed[0]["fragments"], world)
    summed = total(fed[0])
    got, want = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for k, off, numel in slots:
        got[off:off + numel] = summed[k].reshape(-1)
        want[off:off + numel] = FIXED_SYNCS * exact[k].reshape(-1)
    residual = sum(o["residuals"][0]["residual"].double() for o in fed) / world
    mean_residual = torch.cat([o["residuals"][0]["mean_residual"].double() for o in fed])
    G = 2 * max(o["delta"][k].abs().max().item() for o in fed for k in names)
    tol = FIXED_SYNCS * (world + 4) * U * G
    gap = (got - (want - residual - mean_residual)).abs().max().item()
    assert gap <= tol, f"the sum of the means misses the bookkeeping by {gap:.3e} > {tol:.3e}"
    assert (residual + mean_residual).abs().max().item() > 10 * tol
