"""Quantized wires of the gossip mode (``DecentralizedDataParallel(...,
wire_dtype=torch.float8_e4m3fn / torch.float8_e5m2 / "int8", error_feedback=...)``) on
real Gloo groups, CPU, against a reference written here from the algorithm of
``QuantMix`` (fastreduce/comm/quantized.py, CHOCO-SGD with per-edge public copies):

per round t with ``W = make_topology("one-peer-exp", world).mixing(t)`` and, per rank r,
``x`` its flat parameter block (the bucket's ``n`` values, alignment gaps included; the
copies padded with zeros to ``P``, a multiple of 256; ``rt`` = ``BlockQuant(fmt).roundtrip``
of the padded vector viewed as one row)::

    error feedback (public copies, zero at first; the sender's c[r->p] and the
    receiver's c[r->p] are two copies, updated alike):
        for each out-peer p (W[p, r] != 0, p != r):  d = rt(x - c[r->p]); c[r->p] += d; send d
        for each in-peer q  (W[r, q] != 0, q != r):  c[q->r] += the d received
        acc = x.clone(); for q ascending: acc += W[r, q] c[q->r][:n]
                         for p ascending: acc -= W[p, r] c[r->p][:n]
    without it:
        acc = x.clone(); acc *= W[r, r]; for q ascending: acc += W[r, q] rt(x_q)[:n]

all in fp32 with the same torch ops, so the comparison is bit for bit (torch.equal).

Why: the wire is lossy on purpose, so "it trains" says little. What the issue asks of it
is that the ranks still reach consensus through an 8-bit wire (error feedback), where
sending the quantized parameters themselves stalls at the format's error; that the mean
over ranks is kept; and that a checkpoint carries the public copies. Rounds: with lr = 0
every step is a pure mix; the parameters after step k's backward (and
``wait_exchanges()``) hold rounds 0..k-1 (round k-1's mix is applied in step k's
backward, see fastreduce/modes/gossip.py), so R rounds take R + 1 steps. The ranks'
starting parameters are made distinct after the wrapper broadcast rank 0's.

* Consensus, fp8 e4m3, one-peer-exp, 30 rounds at 4 and 8 ranks: the spread (max over
  ranks of ||x_r - mean||, relative to the start; computed here from the returned
  parameters) falls below 1e-3 with error feedback; without it, it is still above 1e-3
  after 30 rounds and no longer falling (the last 10 rounds within a factor 2). The
  mean over ranks moves less than 1e-6 (relative) with error feedback (and more than
  that without: the check can see a drift). ``consensus_distance()`` agrees with the
  parameters.
* Bit for bit, 6 rounds at 3 and 4 ranks (3: the merge round's 1/3 and 2/3 weights and
  a rank idle in some rounds), every format, error feedback on and off: every rank's
  flat block after every round equals the reference's (which is not the exact mix).
  This reads the private ``net._flats`` (the bucket's parameter block) and
  ``net._names`` to place the parameters in the block; the parameters are checked to be
  views of it at those offsets, the gaps zero.
* Checkpoint, fp8 e4m3 with error feedback, 4 ranks: ``state_dict()`` after 3 steps
  (through torch.save) loaded into a fresh wrapper continues bit for bit for 3 more
  steps (and the copies end equal); the same state with its public copies emptied
  (so they start at zero) does not. The copies saved are per edge: ``"a->b"`` for every
  peer of the period, both directions. A quantized state does not load into a
  plain-wire wrapper, nor a plain state into a quantized one (``ValueError``, nothing
  changed).
* Bad settings (int4, unknown names, integer dtypes) raise ``ValueError`` naming them.
* Bytes: one message is ``BlockQuant(fmt).row_bytes(P)`` = P + 4 P / 256 (private
  ``net._qmix``), what is actually sent, about a quarter of the fp32 block.

One spawn per world size (``run_ranks``) computes every case of that size; a case that
raises inside a rank fails only its own tests (``guarded``). References and assertions
run here, in the parent.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fastreduce
from fastreduce.codecs.quant import BlockQuant
from fastreduce.modes.topology import make_topology

from test_fused import saved_and_loaded, case_runner, expect_raises, per_rank

pytestmark = pytest.mark.timeout(300)

SEED = 0
BLOCK = 256
TOPOLOGY = "one-peer-exp"
WIRES: dict[str, Any] = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": "int8"}
CONSENSUS_ROUNDS = 30
CONSENSUS_WORLDS = (4, 8)
BIT_ROUNDS = 6
BIT_WORLDS = (3, 4)
CKPT_WORLD = 4
CKPT_AT = 3                  # steps before the state is saved; as many after
SPAWN_TIMEOUT = 180.0


# ============================================================== helpers run in ranks

def make_model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


def sgd0(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for _, p in named], lr=0.0)  # every step a pure mix


def make_net(wire: Any, error_feedback: bool = True) -> tuple[fastreduce.DecentralizedDataParallel, nn.Module]:
    model = make_model()
    net = fastreduce.DecentralizedDataParallel(model, sgd0, topology=TOPOLOGY, wire_dtype=wire,
                                               error_feedback=error_feedback)
    return net, model


@torch.no_grad()
def perturb(model: nn.Module, rank: int) -> None:
    """Distinct starting parameters per rank (the wrapper broadcast rank 0's), with
    rank-dependent magnitudes so the ranks' block scales differ."""
    g = torch.Generator().manual_seed(100 + rank)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=g) * (1.0 + 0.25 * rank))


X = torch.randn(4, 64, generator=torch.Generator().manual_seed(7))


def step(net: fastreduce.DecentralizedDataParallel) -> None:
    """One step (forward + backward), then wait for the exchange it launched."""
    net(X).sum().backward()
    net.wait_exchanges()


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def consensus_case(rank: int, world: int, fmt: str, ef: bool) -> dict:
    net, model = make_net(WIRES[fmt], ef)
    perturb(model, rank)
    out: dict[str, Any] = {"params": [], "cd": []}
    for _ in range(CONSENSUS_ROUNDS + 1):
        step(net)
        out["params"].append(params_of(model))
        out["cd"].append(net.consensus_distance())
    return out


def layout_of(net: fastreduce.DecentralizedDataParallel, model: nn.Module) -> dict:
    """The bucket's block (private ``net._flats``, ``net._names``): its length, the slot
    names in order, and where each parameter's storage sits in it."""
    flat = net._flats[0]
    params = dict(model.named_parameters())
    offsets = {name: (params[name].data_ptr() - flat.data_ptr()) // flat.element_size() for name in net._names}
    return {"buckets": net.num_buckets, "n": flat.numel(), "names": list(net._names), "offsets": offsets,
            "shares_storage": all(params[name].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                                  for name in net._names)}


def bit_case(rank: int, world: int, fmt: str, ef: bool) -> dict:
    net, model = make_net(WIRES[fmt], ef)
    perturb(model, rank)
    out: dict[str, Any] = {"flats": [], "params": []}
    for k in range(BIT_ROUNDS + 1):
        step(net)
        if k == 0:
            out["layout"] = layout_of(net, model)
        out["flats"].append(net._flats[0].detach().clone())
        out["params"].append(params_of(model))
    qmix = net._qmix[0]  # private: the bucket's QuantMix
    out["bytes"] = {"wire_bytes": qmix.wire_bytes, "padded": qmix.padded,
                    "sent": sorted(t.numel() for t in qmix.sent.values()),
                    "got": sorted(t.numel() for t in qmix.got.values())}
    return out


def ckpt_case(rank: int, world: int) -> dict:
    fp8 = WIRES["fp8_e4m3"]
    a_net, a = make_net(fp8)
    perturb(a, rank)
    for _ in range(CKPT_AT):
        step(a_net)
    saved = saved_and_loaded(a_net.state_dict())
    b_net, b = make_net(fp8)
    b_net.load_state_dict(saved)
    control = dict(saved, public_copies=[{} for _ in saved["public_copies"]])  # copies back to zero
    c_net, c = make_net(fp8)
    c_net.load_state_dict(control)
    out: dict[str, Any] = {"saved_keys": sorted(saved), "copies": saved["public_copies"],
                           "steps": (a_net.step, b_net.step, c_net.step), "a": [], "b": [], "c": []}
    for _ in range(CKPT_AT):
        for net, model, key in ((a_net, a, "a"), (b_net, b, "b"), (c_net, c, "c")):
            step(net)
            out[key].append(params_of(model))
    out["final_copies"] = (a_net.state_dict()["public_copies"], b_net.state_dict()["public_copies"])

    # a quantized state into a plain-wire wrapper, and the other way round
    p_net, p = make_net(None)
    before = params_of(p)
    out["into_plain"] = expect_raises(ValueError, lambda: p_net.load_state_dict(saved))
    out["plain_after"] = {"same": all(torch.equal(before[k], v) for k, v in params_of(p).items()),
                          "step": p_net.step, "buckets": p_net.num_buckets}
    step(p_net)
    plain_state = p_net.state_dict()
    q_net, q = make_net(fp8)
    before = params_of(q)
    out["into_quantized"] = expect_raises(ValueError, lambda: q_net.load_state_dict(plain_state))
    out["quantized_after"] = {"same": all(torch.equal(before[k], v) for k, v in params_of(q).items()),
                              "step": q_net.step, "buckets": q_net.num_buckets}
    return out


BAD = {  # name: (wire_dtype, what the message must name)
    "int4": ("int4", "int4"),
    "bogus": ("bogus", "bogus"),
    "int32": (torch.int32, "torch.int32"),
    "torch_int8": (torch.int8, "torch.int8"),
}


def bad_case(rank: int, world: int) -> dict:
    return {name: expect_raises(ValueError, lambda wire=wire: make_net(wire)) for name, (wire, _) in BAD.items()}


def cases(world: int) -> list[tuple]:
    out: list[tuple] = []
    if world in CONSENSUS_WORLDS:
        out += [("consensus", "fp8_e4m3", True), ("consensus", "fp8_e4m3", False)]
    if world in BIT_WORLDS:
        out += [("bit", fmt, ef) for fmt in WIRES for ef in (True, False)]
    if world == CKPT_WORLD:
        out += [("ckpt",), ("bad",)]
    return out


CASE_FNS = {"consensus": consensus_case, "bit": bit_case, "ckpt": ckpt_case, "bad": bad_case}


run = case_runner(__name__, cases, SPAWN_TIMEOUT)
"""One group per world size (started by the first test that asks), every case of it."""


def ids(v: Any) -> str:
    if isinstance(v, bool):
        return "ef" if v else "no_ef"
    return f"world{v}" if isinstance(v, int) else str(v)


# ============================================================== the reference (parent)

def roundtrip(fmt: str, x: torch.Tensor) -> torch.Tensor:
    """What a receiver sees of the padded vector ``x``, encoded as one row."""
    return BlockQuant(fmt).roundtrip(x.view(1, -1)).view(-1)


def reference_rounds(fmt: str, starts: list[torch.Tensor], rounds: int, ef: bool) -> list[list[torch.Tensor]]:
    """``[round][rank]`` flat blocks from the documented algorithm (module doc)."""
    world, n = len(starts), starts[0].numel()
    padded = -(-n // BLOCK) * BLOCK
    topo = make_topology(TOPOLOGY, world)
    sender: dict[tuple[int, int], torch.Tensor] = {}    # c[a->b] as a keeps it
    receiver: dict[tuple[int, int], torch.Tensor] = {}  # c[a->b] as b keeps it
    xs = [x.clone() for x in starts]
    out = [[x.clone() for x in xs]]
    for t in range(rounds):
        W = topo.mixing(t)
        sent: dict[tuple[int, int], torch.Tensor] = {}
        for r in range(world):
            col = W[:, r].tolist()
            x = torch.zeros(padded)
            x[:n] = xs[r]
            for p in range(world):
                if p == r or col[p] == 0.0:
                    continue
                if ef:
                    c = sender.setdefault((r, p), torch.zeros(padded))
                    d = roundtrip(fmt, x - c)
                    c.add_(d)
                    sent[(r, p)] = d
                else:
                    sent[(r, p)] = roundtrip(fmt, x)
        new = []
        for r in range(world):
            row, col = W[r].tolist(), W[:, r].tolist()
            ins = [q for q in range(world) if q != r and row[q] != 0.0]
            outs = [p for p in range(world) if p != r and col[p] != 0.0]
            acc = xs[r].clone()
            if ef:
                for q in ins:
                    c = receiver.setdefault((q, r), torch.zeros(padded))
                    c.add_(sent[(q, r)])
                    acc.add_(c[:n], alpha=row[q])
                for p in outs:
                    acc.sub_(sender[(r, p)][:n], alpha=col[p])
            else:
                acc.mul_(row[r])
                for q in ins:
                    acc.add_(sent[(q, r)][:n], alpha=row[q])
            new.append(acc)
        xs = new
        out.append([x.clone() for x in xs])
    return out


def exact_rounds(starts: list[torch.Tensor], rounds: int) -> list[list[torch.Tensor]]:
    """The unquantized mix, in float64: what the quantized wire approximates."""
    topo = make_topology(TOPOLOGY, len(starts))
    xs = torch.stack([x.double() for x in starts])
    out = [list(xs)]
    for t in range(rounds):
        xs = topo.mixing(t) @ xs
        out.append(list(xs))
    return out


def placed(params: dict[str, torch.Tensor], layout: dict) -> torch.Tensor:
    """The parameters at the layout's offsets in a zero block of its length."""
    flat = torch.zeros(layout["n"])
    for name in layout["names"]:
        o = layout["offsets"][name]
        flat[o:o + params[name].numel()] = params[name].reshape(-1)
    return flat


def stacked(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([params[k].reshape(-1).double() for k in sorted(params)])


def spreads(outs: list[dict]) -> tuple[list[float], list[float], list[torch.Tensor]]:
    """Per round: max over ranks of ||x_r - mean|| relative to the start; mean over
    ranks of ||x_r - mean|| / ||mean|| (what consensus_distance() computes); the mean."""
    rounds = len(outs[0]["params"])
    spread, cd, means = [], [], []
    for k in range(rounds):
        xs = torch.stack([stacked(o["params"][k]) for o in outs])
        mean = xs.mean(0)
        dist = (xs - mean).norm(dim=1)
        spread.append(float(dist.max()))
        cd.append(float((dist / mean.norm()).mean()))
        means.append(mean)
    return [s / spread[0] for s in spread], cd, means


# ============================================================== 1. consensus

@pytest.mark.parametrize("world", CONSENSUS_WORLDS, ids=ids)
def test_error_feedback_reaches_consensus(world: int) -> None:
    """fp8 e4m3 with error feedback: the spread falls below 1e-3 of the start within 30
    rounds, on every rank's parameters."""
    spread, _, _ = spreads(per_rank(run(world), ("consensus", "fp8_e4m3", True)))
    assert spread[0] == 1.0
    hit = [k for k, s in enumerate(spread) if s < 1e-3]
    assert hit, f"spread after each round: {['%.1e' % s for s in spread]}"
    assert spread[-1] < 1e-3, f"spread after {CONSENSUS_ROUNDS} rounds: {spread[-1]:.2e}"


@pytest.mark.parametrize("world", CONSENSUS_WORLDS, ids=ids)
def test_without_error_feedback_consensus_stalls(world: int) -> None:
    """Sending the quantized parameters themselves: the spread is still above 1e-3 after
    30 rounds and has stopped falling (the last 10 rounds within a factor 2)."""
    spread, _, _ = spreads(per_rank(run(world), ("consensus", "fp8_e4m3", False)))
    last = spread[-10:]
    assert spread[-1] > 1e-3, f"spread after {CONSENSUS_ROUNDS} rounds: {spread[-1]:.2e}"
    assert max(last) <= 2 * min(last), f"last 10 rounds: {['%.2e' % s for s in last]}"
    fed, _, _ = spreads(per_rank(run(world), ("consensus", "fp8_e4m3", True)))
    assert spread[-1] > 100 * fed[-1], (spread[-1], fed[-1])


@pytest.mark.parametrize("world", CONSENSUS_WORLDS, ids=ids)
def test_error_feedback_keeps_the_mean(world: int) -> None:
    """With error feedback the mean over ranks moves by less than 1e-6 (relative) over
    30 rounds (without it, by more: the measure sees a drift)."""
    drift = {}
    for ef in (True, False):
        _, _, means = spreads(per_rank(run(world), ("consensus", "fp8_e4m3", ef)))
        drift[ef] = max(float((m - means[0]).norm() / means[0].norm()) for m in means)
    assert drift[True] < 1e-6, drift
    assert drift[False] > 1e-6, drift


@pytest.mark.parametrize("world", CONSENSUS_WORLDS, ids=ids)
@pytest.mark.parametrize("ef", (True, False), ids=ids)
def test_consensus_distance_matches_the_parameters(world: int, ef: bool) -> None:
    """consensus_distance() (the same on every rank) is the mean over ranks of
    ||x_r - mean|| / ||mean|| of the parameters the ranks hold."""
    outs = per_rank(run(world), ("consensus", "fp8_e4m3", ef))
    _, cd, _ = spreads(outs)
    for rank, out in enumerate(outs):
        assert out["cd"] == outs[0]["cd"], f"rank {rank}"
    for k, (got, want) in enumerate(zip(outs[0]["cd"], cd)):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-12), f"round {k}"


# ============================================================== 2. bit for bit

BIT_GRID = [(w, f, ef) for w in BIT_WORLDS for f in WIRES for ef in (True, False)]


@pytest.mark.parametrize("world,fmt,ef", BIT_GRID, ids=ids)
def test_parameters_are_views_of_one_bucket(world: int, fmt: str, ef: bool) -> None:
    """The model is one bucket; every parameter is its block at the slot's offset (no
    overlap), the gaps zero, after every round."""
    for rank, out in enumerate(per_rank(run(world), ("bit", fmt, ef))):
        lay = out["layout"]
        assert lay["buckets"] == 1
        assert lay["shares_storage"]
        assert sorted(lay["names"]) == sorted(out["params"][0])
        ends = sorted((lay["offsets"][k], lay["offsets"][k] + out["params"][0][k].numel()) for k in lay["names"])
        assert ends[0][0] >= 0 and ends[-1][1] <= lay["n"]
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:])), ends
        for k, (flat, params) in enumerate(zip(out["flats"], out["params"])):
            assert torch.equal(placed(params, lay), flat), f"rank {rank} after round {k}"


@pytest.mark.parametrize("world,fmt,ef", BIT_GRID, ids=ids)
def test_rounds_equal_the_reference_bit_for_bit(world: int, fmt: str, ef: bool) -> None:
    """Every rank's block after each of 6 rounds equals the reference (module doc),
    computed from the ranks' starting blocks; which is not the exact mix (the wire
    rounds)."""
    outs = per_rank(run(world), ("bit", fmt, ef))
    starts = [placed(o["params"][0], o["layout"]) for o in outs]
    ref = reference_rounds(fmt, starts, BIT_ROUNDS, ef)
    for k in range(BIT_ROUNDS + 1):
        for rank, out in enumerate(outs):
            got, want = out["flats"][k], ref[k][rank]
            assert torch.equal(got, want), (f"rank {rank} after round {k}: {int((got != want).sum())} of "
                                            f"{got.numel()} differ, max |diff| {(got - want).abs().max():.3e}")
    exact = exact_rounds(starts, BIT_ROUNDS)
    assert any(not torch.equal(ref[k][r].double(), exact[k][r]) for k in range(1, BIT_ROUNDS + 1)
               for r in range(world)), "the reference is the exact mix: the test shows nothing"


# ============================================================== 3. checkpoint

def ckpt_outs() -> list[dict]:
    return per_rank(run(CKPT_WORLD), ("ckpt",))


def test_checkpoint_resume_is_bit_for_bit() -> None:
    """A fresh wrapper that loads the state saved after 3 steps gives the original's
    parameters bit for bit for 3 more steps, and ends with the same public copies; the
    same state with the copies at zero gives other parameters."""
    for rank, out in enumerate(ckpt_outs()):
        assert "public_copies" in out["saved_keys"]
        assert out["steps"][0] == out["steps"][1] == out["steps"][2] == CKPT_AT
        for k, (a, b) in enumerate(zip(out["a"], out["b"])):
            for name in a:
                assert torch.equal(a[name], b[name]), f"rank {rank} step {k} {name}"
        fa, fb = out["final_copies"]
        assert len(fa) == len(fb) == 1
        assert sorted(fa[0]) == sorted(fb[0])
        for key in fa[0]:
            assert torch.equal(fa[0][key], fb[0][key]), f"rank {rank} copy {key}"
        assert any(not torch.equal(a[n], c[n]) for a, c in zip(out["a"], out["c"]) for n in a), \
            f"rank {rank}: zero public copies give the same parameters: the test shows nothing"


def test_public_copies_are_per_edge() -> None:
    """The saved copies are keyed "a->b", one per peer of the period in each direction
    (4 ranks, hypercube: r xor 1 and r xor 2), padded to whole blocks, and not zero."""
    for rank, out in enumerate(ckpt_outs()):
        (copies,) = out["copies"]
        peers = (rank ^ 1, rank ^ 2)
        assert set(copies) == {f"{rank}->{p}" for p in peers} | {f"{p}->{rank}" for p in peers}, sorted(copies)
        for key, c in copies.items():
            assert c.dtype == torch.float32 and c.numel() % BLOCK == 0, key
            assert c.abs().max() > 0, key


@pytest.mark.parametrize("direction", ("into_plain", "into_quantized"))
def test_state_needs_the_same_wire(direction: str) -> None:
    """A state with public copies does not load into a plain-wire wrapper, nor a plain
    one into a quantized wrapper: ValueError naming wire_dtype, nothing changed (the
    parameters, the round, no buckets built)."""
    after = "plain_after" if direction == "into_plain" else "quantized_after"
    for out in ckpt_outs():
        got = out[direction]
        assert got["raised"] == "ValueError", got
        assert "wire_dtype" in got["message"], got
        assert out[after] == {"same": True, "step": 0, "buckets": 0}, out[after]


# ============================================================== 4. bad settings

@pytest.mark.parametrize("name", list(BAD))
def test_bad_settings_raise_value_error(name: str) -> None:
    """int4, an unknown name and integer dtypes raise a ValueError naming them, on every
    rank."""
    for out in per_rank(run(CKPT_WORLD), ("bad",)):
        got = out[name]
        assert got["raised"] == "ValueError", got
        assert BAD[name][1] in got["message"], got


# ============================================================== 5. bytes

@pytest.mark.parametrize("world,fmt", [(w, f) for w in BIT_WORLDS for f in WIRES], ids=ids)
def test_wire_bytes_are_codes_and_scales(world: int, fmt: str) -> None:
    """One message is row_bytes(P) = P + 4 P / 256 bytes (P: the block padded to 256s),
    what is sent to and received from each peer, about a quarter of the fp32 block."""
    for rank, out in enumerate(per_rank(run(world), ("bit", fmt, True))):
        n, b = out["layout"]["n"], out["bytes"]
        padded = -(-n // BLOCK) * BLOCK
        assert b["padded"] == padded
        assert b["wire_bytes"] == BlockQuant(fmt).row_bytes(padded) == padded + 4 * padded // BLOCK
        assert b["sent"] and b["got"], f"rank {rank} exchanged nothing"
        assert set(b["sent"]) == set(b["got"]) == {b["wire_bytes"]}, b
        ratio = b["wire_bytes"] / (4 * n)
        assert 0.25 < ratio < 0.27, ratio
