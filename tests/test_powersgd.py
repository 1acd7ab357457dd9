"""PowerSGD (``fastreduce.PowerSGD`` as ``compression=``) on real Gloo groups, against
references written here from the specification, not from the implementation.

* full rank (``rank=10**6, min_compression_rate=0``) is the exact mean: 10 SGD steps
  match torch's DDP, fused, overlapped (small buckets) and ``all_reduce_gradients``,
  both transports, 2 and 3 ranks; with error feedback on (every rank's residual is then
  its gradient's distance from the mean, which sums to zero), off, and without warm start;
* below full rank, every reduction matches :class:`Reference`, Algorithm 1 of Vogels et
  al. (2019) with per-rank error feedback and warm start, written per matrix in float64
  from every rank's local gradients (gathered): averaged gradients, the rank's residual
  and the warm-start ``Q`` in ``state_dict()``, which matrices are compressed (the
  ``min_compression_rate`` rule), warm-up, ``seed``, the functional form; buckets of the
  overlapped mode change nothing;
* error feedback loses nothing: sum of applied gradients == sum of mean gradients minus
  the mean of the final residuals;
* ``Checkpointer`` at step 5 and a resume in fresh processes end bit for bit where the
  uninterrupted run ends (state loaded before and after the reducer was built);
* ``stats.bytes_reduced`` counts P, Q and the uncompressed values, nothing more;
* bad settings raise ``ValueError``.

Each module fixture starts one group (``run_ranks``) and runs many sub-cases in it; a
sub-case that raises in a rank fails only its own tests (``guarded``/``unwrap``).
"""

from __future__ import annotations

import copy
import dataclasses
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close

import fastreduce
from fastreduce.launch import run_ranks
from fastreduce.modes.functional import functional_state

from test_fused import expect_raises, guarded, spawn_once

pytestmark = pytest.mark.timeout(180)

SEED = 3
BATCH = 8                       # per rank: local gradients of rank >= 8, so P has full column rank
BUCKET_MB = 4096 / 2**20        # overlap: ~1000 fp32 values per bucket, several buckets
TRANSPORTS = ("shm", "process_group")
TIMEOUT = 120.0
FULL = {"rank": 10**6, "min_compression_rate": 0.0}  # every fp32 matrix at r = min(n, m); the mean
# gradient of 2-3 ranks x 8 samples has rank <= 24, below most r here: P loses column rank too
TOL = 1e-5                      # relative to the scale of the values compressed


# ============================================================== model and data

class PowerNet(nn.Module):
    """Matrices of equal shapes (b, c), wide (a: 24 x 64, e: 16 x 40, g: 5 x 16) and tall
    (d: 40 x 24), a 3-D conv weight (8 x 3 x 3, an 8 x 9 matrix), f (16 x 16: at rank 4
    exactly on the default min_compression_rate, 256 == 2 * 32 * 4, so sent whole, as
    torch's hook sends it), biases, a loose vector, and optionally a bf16 matrix ``low``
    (never compressed)."""

    def __init__(self, bf16: bool = False):
        super().__init__()
        self.conv = nn.Conv1d(3, 8, 3)
        self.a = nn.Linear(64, 24)
        self.b = nn.Linear(24, 24)
        self.c = nn.Linear(24, 24)
        self.d = nn.Linear(24, 40)
        self.e = nn.Linear(40, 16)
        self.f = nn.Linear(16, 16, bias=False)
        self.g = nn.Linear(16, 5, bias=False)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 5))
        self.low = nn.Parameter((torch.randn(5, 5) * 0.3).to(torch.bfloat16)) if bf16 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv(x)).flatten(1)
        h = torch.tanh(self.a(h))
        h = h + torch.tanh(self.b(h))
        h = h + torch.tanh(self.c(h))
        h = torch.tanh(self.d(h))
        h = torch.tanh(self.e(h))
        out = self.g(h + torch.tanh(self.f(h))) * self.scale
        if self.low is not None:
            out = out + (out.to(torch.bfloat16) @ self.low).float()
        return out


def power_net(bf16: bool = False) -> PowerNet:
    torch.manual_seed(SEED)
    return PowerNet(bf16)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank + 11)
    return torch.randn(BATCH, 3, 10, generator=g), torch.randn(BATCH, 5, generator=g)


def loss_of(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = data
    return ((model(x) - y) ** 2).mean()


def compressed_ranks(model: nn.Module, comp: Any) -> dict[str, tuple[int, int, int]]:
    """The spec's rule, torch's (``powerSGD_hook``'s ``_should_compress``): ``{name: (n, m, r)}``
    of the matrices ``comp`` compresses, those whose factors hold more than
    ``min_compression_rate`` times fewer values than the matrix."""
    out = {}
    for name, p in model.named_parameters():
        if p.dtype != torch.float32 or p.dim() < 2:
            continue
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(comp.rank, n, m)
        if comp.min_compression_rate * (n + m) * r < n * m:
            out[name] = (n, m, r)
    return out


def expected_bytes(model: nn.Module, comp: Any) -> int:
    """4 bytes (fp32 wire) per value of every P, every Q and every uncompressed gradient."""
    ranks = compressed_ranks(model, comp)
    values = 0
    for name, p in model.named_parameters():
        if name in ranks:
            n, m, r = ranks[name]
            values += n * r + m * r
        else:
            values += p.numel()
    return 4 * values


# ============================================================== the reference (Algorithm 1)

def gram_schmidt(p: torch.Tensor, eps: float = 1e-30) -> torch.Tensor:
    """Columns in order: each normalized, then its component removed from the later ones."""
    p = p.clone()
    for i in range(p.shape[1]):
        p[:, i] /= p[:, i].norm() + eps
        if i + 1 < p.shape[1]:
            p[:, i + 1:] -= torch.outer(p[:, i], p[:, i] @ p[:, i + 1:])
    return p


class Reference:
    """PowerSGD for every rank at once, per matrix, in float64, from the ranks' local
    gradients: after ``warmup_steps`` exact means, ``M_i = g_i + e_i``; ``P = mean_i(M_i Q)``;
    ``P = GS(P)``; ``Q = mean_i(M_i^T P)``; ``M_hat = P Q^T``; ``e_i = M_i - M_hat``; the
    next step starts from this ``Q`` (warm start), the first from ``initial_q``."""

    def __init__(self, model: nn.Module, comp: Any, world: int, dtype: torch.dtype = torch.float64):
        from fastreduce.codecs.powersgd import initial_q
        assert comp.warm_start, "a cold start draws Q afresh: not reproducible here"
        self.comp, self.world, self.step, self.dtype = comp, world, 0, dtype
        self.ranks = compressed_ranks(model, comp)
        self.shapes = {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
        self.q = {n: initial_q(n, m, r, comp.seed).to(dtype) for n, (_, m, r) in self.ranks.items()}
        self.e = {n: [torch.zeros(nn_, m, dtype=dtype) for _ in range(world)]
                  for n, (nn_, m, _) in self.ranks.items()}

    def load(self, q: dict[str, torch.Tensor], errors: list[dict[str, torch.Tensor]]) -> None:
        """Start the next step from another run's state: its ``Q`` and every rank's residual."""
        for name, (n, m, _) in self.ranks.items():
            if name in q:
                self.q[name] = q[name].to(self.dtype).reshape(m, -1)
            self.e[name] = [e[name].to(self.dtype).reshape(n, m) if name in e else torch.zeros(n, m, dtype=self.dtype)
                            for e in errors]

    def reduce(self, local: list[dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        """``local[i][name]``: rank i's gradient. Returns, per name, ``grad`` (as the
        parameter's dtype), ``scale`` (largest |M_i|) and, if compressed, ``M`` per rank."""
        out = {}
        compress = self.step >= self.comp.warmup_steps
        for name, (shape, dtype) in self.shapes.items():
            gs = [loc[name].to(self.dtype) for loc in local]
            if name not in self.ranks or not compress:
                mean = sum(gs) / self.world
                out[name] = {"grad": mean.to(dtype), "scale": max(float(g.abs().max()) for g in gs)}
                continue
            n, m, r = self.ranks[name]
            ms = [g.reshape(n, m) + (e if self.comp.error_feedback else 0) for g, e in zip(gs, self.e[name])]
            p = gram_schmidt(sum(mi @ self.q[name] for mi in ms) / self.world)
            q = sum(mi.T @ p for mi in ms) / self.world
            m_hat = p @ q.T
            if self.comp.error_feedback:
                self.e[name] = [mi - m_hat for mi in ms]
            self.q[name] = q
            out[name] = {"grad": m_hat.reshape(shape).float(), "scale": max(float(mi.abs().max()) for mi in ms),
                         "error": self.e[name] if self.comp.error_feedback else None, "q": q}
        self.step += 1
        return out


# ============================================================== helpers run in ranks



def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@dataclass(frozen=True)
class Case:
    mode: str                  # "fused" | "overlap" | "function"
    transport: str
    comp: tuple = ()           # PowerSGD keyword arguments, as items
    bf16: bool = False

    @property
    def id(self) -> str:
        comp = ",".join(f"{k}={v}" for k, v in self.comp)
        return f"{self.mode}-{self.transport}-{comp}{'-bf16' if self.bf16 else ''}"

    def powersgd(self) -> Any:
        return fastreduce.PowerSGD(**dict(self.comp))


def reducing(model: nn.Module, case: Case, comp: Any) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """``(reduce, reducer)``: the call after backward, and how to find its reducer."""
    if case.mode == "function":
        def reduce() -> Any:
            return fastreduce.all_reduce_gradients(model, torch.float32, compression=comp, transport=case.transport)

        def reducer() -> Any:
            (r,) = model.__dict__["_fastreduce_reducers"].values()
            return r
        return reduce, reducer
    overlap = case.mode == "overlap"
    r = fastreduce.FusedReducer(model, wire_dtype=torch.float32, compression=comp, transport=case.transport,
                                overlap=overlap, bucket_mb=BUCKET_MB if overlap else None)
    return r.reduce, lambda: r


def compression_state(reducer: Any) -> dict:
    sd = reducer.state_dict()
    st = sd["compression"]
    return {"step": st["step"], "q": {k: v.detach().clone() for k, v in st["q"].items()},
            "error": {k: v.detach().clone() for k, v in st["error"].items()}}


# ============================================================== 1. full rank == DDP

DDP_STEPS = 10


def ddp_case(rank: int, world: int, case: Case) -> dict:
    model = power_net()
    ddp = DDP(copy.deepcopy(model))
    reduce, _ = reducing(model, case, case.powersgd())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dopt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    out: dict[str, list] = {"fr": [], "ddp": [], "scale": []}
    for step in range(DDP_STEPS):
        data = batch(rank, step)
        loss_of(model, data).backward()
        scale = torch.tensor([p.grad.abs().max() for p in model.parameters()])
        dist.all_reduce(scale, op=dist.ReduceOp.MAX)
        reduce()
        loss_of(ddp, data).backward()
        out["fr"].append(grads_of(model))
        out["ddp"].append(grads_of(ddp.module))
        out["scale"].append(dict(zip([n for n, _ in model.named_parameters()], scale.tolist())))
        opt.step(), dopt.step()
        opt.zero_grad(), dopt.zero_grad()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["ddp_params"] = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    return out


def ddp_worker(rank: int, world: int, cases: list[Case]) -> dict:
    return {case.id: guarded(ddp_case, rank, world, case) for case in cases}


def ddp_cases(world: int) -> list[Case]:
    full = tuple(FULL.items())
    cases = [Case(mode, t, full) for mode in ("fused", "overlap") for t in TRANSPORTS]
    if world == 2:
        cases += [Case("function", "shm", full),
                  Case("fused", "shm", full + (("error_feedback", False),)),
                  Case("fused", "process_group", full + (("warm_start", False),)),
                  Case("overlap", "shm", full + (("warm_start", False), ("error_feedback", False)))]
    return cases


_ddp_runs: dict = {}


def ddp_run(world: int) -> list[dict]:
    """One group per world size (started by the first test that asks), its cases' results."""
    return spawn_once(_ddp_runs, world, lambda: run_ranks(ddp_worker, world, ddp_cases(world), timeout=TIMEOUT))


def unwrap(result: dict) -> Any:
    if "error" in result:
        pytest.fail("sub-case raised inside a rank:\n" + result["error"], pytrace=False)
    return result["ok"]


@pytest.mark.parametrize("world,case", [(w, c) for w in (2, 3) for c in ddp_cases(w)],
                         ids=lambda v: f"world{v}" if isinstance(v, int) else v.id)
def test_full_rank_is_the_exact_mean_like_ddp(world: int, case: Case) -> None:
    results = ddp_run(world)
    for rank, res in enumerate(results):
        out = unwrap(res[case.id])
        for step in range(DDP_STEPS):
            for name, want in out["ddp"][step].items():
                assert_close(out["fr"][step][name], want, rtol=TOL, atol=TOL * out["scale"][step][name],
                             msg=lambda m, name=name, step=step: f"rank {rank} step {step} {name}: {m}")
        for name, want in out["ddp_params"].items():
            assert_close(out["params"][name], want, rtol=TOL, atol=TOL,
                         msg=lambda m, name=name: f"rank {rank} parameter {name} after {DDP_STEPS} steps: {m}")
    for res in results[1:]:  # the ranks agree bit for bit
        for name, p in unwrap(res[case.id])["params"].items():
            assert torch.equal(p, unwrap(results[0][case.id])["params"][name]), name


# ============================================================== 2-4, 6, 7. below full rank: the reference

REF_STEPS = 10
R2 = (("rank", 2), ("min_compression_rate", 0.0))
R4 = (("rank", 4),)  # the default min_compression_rate (2.0): some matrices compressed, some not
WARMUP = 3


def reference_cases() -> list[Case]:
    cases = [Case(mode, t, comp, bf16=True) for comp in (R2, R4) for mode in ("fused", "overlap")
             for t in TRANSPORTS]
    cases += [Case("function", t, R2, bf16=True) for t in TRANSPORTS]
    cases += [Case(mode, "shm", R2 + (("warmup_steps", WARMUP),), bf16=True) for mode in ("fused", "overlap")]
    cases += [Case("fused", "process_group", R2 + (("error_feedback", False),), bf16=True),
              Case("overlap", "shm", (("rank", 3), ("min_compression_rate", 0.0), ("seed", 5)), bf16=True)]
    return cases


def reference_case(rank: int, world: int, case: Case) -> dict:
    comp = case.powersgd()
    model = power_net(case.bf16)
    twin = copy.deepcopy(model)  # the local gradients, from the same parameters and data
    chained = Reference(model, comp, world)  # from the first step on, its own state throughout
    onestep = Reference(model, comp, world)  # each step from the state the reducer reports
    reduce, reducer_of = reducing(model, case, comp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    numel = sum(p.numel() for p in model.parameters())
    out: dict[str, Any] = {"steps": [], "compressed": sorted(chained.ranks), "numel": numel,
                           "expected_bytes": expected_bytes(model, comp), "full_bytes": 4 * numel}
    bytes_before, compressed_before, state = 0, 0, None
    for step in range(REF_STEPS):
        data = batch(rank, step)
        twin.load_state_dict(model.state_dict())
        twin.zero_grad()
        loss_of(twin, data).backward()
        local = grads_of(twin)
        gathered: list[dict] = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(gathered, local)
        want = chained.reduce(gathered)
        if state is not None and step > comp.warmup_steps:
            errors: list[dict] = [None] * world  # type: ignore[list-item]
            dist.all_gather_object(errors, state["error"])
            onestep.load(state["q"], errors)
        one = onestep.reduce(gathered)

        loss_of(model, data).backward()
        reduce()
        reducer = reducer_of()
        got = grads_of(model)
        state = compression_state(reducer)
        rec = {"got": got, "exact_mean": {n: (sum(g[n].double() for g in gathered) / world).to(got[n].dtype)
                                          for n in got},
               "chained": {n: w["grad"] for n, w in want.items()},
               "want": {n: w["grad"] for n, w in one.items()}, "scale": {n: w["scale"] for n, w in one.items()},
               "want_error": {n: w["error"][rank] for n, w in one.items() if w.get("error") is not None},
               "want_q": {n: w["q"] for n, w in one.items() if "q" in w},
               "state": state, "local": local,
               "bytes": reducer.stats.bytes_reduced - bytes_before,
               "compressed": reducer.stats.compressed - compressed_before}
        bytes_before, compressed_before = reducer.stats.bytes_reduced, reducer.stats.compressed
        out["steps"].append(rec)
        opt.step()
        opt.zero_grad()
    # error feedback's bookkeeping: the mean over ranks of the final residuals
    errors = {}
    for name in chained.ranks:
        e = state["error"].get(name)
        e = torch.zeros(model.get_parameter(name).shape) if e is None else e.reshape(model.get_parameter(name).shape)
        e = e.double().clone()
        dist.all_reduce(e)
        errors[name] = e / world
    out["mean_final_error"] = errors
    return out


def reference_worker(rank: int, world: int, cases: list[Case]) -> dict:
    return {case.id: guarded(reference_case, rank, world, case) for case in cases}


_ref_runs: dict = {}


@pytest.fixture(scope="module")
def ref_run() -> list[dict]:
    if "run" not in _ref_runs:
        try:
            _ref_runs["run"] = run_ranks(reference_worker, 2, reference_cases(), timeout=TIMEOUT)
        except Exception as e:  # noqa: BLE001
            _ref_runs["run"] = e
    res = _ref_runs["run"]
    if isinstance(res, BaseException):
        pytest.fail(f"the reference group failed: {res}")
    return res


def ref_ids(pred: Callable[[Case], bool] = lambda c: True) -> list[Case]:
    return [c for c in reference_cases() if pred(c)]


def warmup_of(case: Case) -> int:
    return dict(case.comp).get("warmup_steps", 0)


@pytest.mark.parametrize("case", ref_ids(), ids=lambda c: c.id)
def test_grads_match_algorithm_1(ref_run: list[dict], case: Case) -> None:
    """2. (and 4.) every reduction's averaged gradients equal one step of the reference,
    taken from the state the reducer reports after the step before (its ``Q``, every
    rank's residual; ``initial_q`` and zeros at the first compressed step), so that no
    rounding is carried from step to step: within 1e-5 of the values' scale at every step."""
    for rank, res in enumerate(ref_run):
        out = unwrap(res[case.id])
        for step, rec in enumerate(out["steps"]):
            for name, want in rec["want"].items():
                got = rec["got"][name]
                assert got.dtype == want.dtype, f"{name}: {got.dtype} != {want.dtype}"
                if got.dtype == torch.bfloat16:  # averaged exactly, rounded once to bf16
                    assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7 * rec["scale"][name],
                                 msg=lambda m, name=name, step=step: f"rank {rank} step {step} {name}: {m}")
                    continue
                assert_close(got, want, rtol=TOL, atol=TOL * rec["scale"][name],
                             msg=lambda m, name=name, step=step: f"rank {rank} step {step} {name} "
                             f"({'compressed' if name in out['compressed'] else 'exact'}): {m}")


CHAINED_STEPS = 5
CHAINED_TOL = 5e-5  # the first CHAINED_STEPS: fp32 drift reached 1.2e-5 of the scale by step 3 on an AMD EPYC
DRIFT_TOL = 2e-4


@pytest.mark.parametrize("case", ref_ids(), ids=lambda c: c.id)
def test_grads_follow_algorithm_1_from_the_start(ref_run: list[dict], case: Case) -> None:
    """2. the reference run on its own from the first step (initial_q, zero residuals, its
    own warm start): within CHAINED_TOL for the first 5 reductions and DRIFT_TOL after. The warm
    start carries each step's rounding into the next power iteration, where P's small
    columns amplify it: on this model a plain fp32 transcription of the same algorithm
    (``Reference(..., dtype=torch.float32)``) drifts from the float64 one by up to 6.4e-5
    of the scale by step 9 (rank 4: a.weight; rank 2: d.weight 1.3e-5 at step 7); so
    1e-5 over all 10 steps is beyond any fp32 implementation. How early the drift shows depends
    on the CPU's kernels (the same code was within 1e-5 for 5 steps on one host, 1.2e-5 by step 3
    on an AMD EPYC), hence 5e-5 for the first 5; a wrong step (a missing mean, a stale or
    unaveraged Q, another rank's residual) is off by 1e-2 or more."""
    for rank, res in enumerate(ref_run):
        out = unwrap(res[case.id])
        for step, rec in enumerate(out["steps"]):
            tol = CHAINED_TOL if step < CHAINED_STEPS else DRIFT_TOL
            for name, want in rec["chained"].items():
                got = rec["got"][name]
                if got.dtype != torch.float32:
                    continue  # bf16: test_grads_match_algorithm_1
                assert_close(got, want, rtol=tol, atol=tol * rec["scale"][name],
                             msg=lambda m, name=name, step=step: f"rank {rank} step {step} {name}: {m}")


@pytest.mark.parametrize("case", ref_ids(), ids=lambda c: c.id)
def test_state_holds_the_warm_start_q_and_this_ranks_residual(ref_run: list[dict], case: Case) -> None:
    for rank, res in enumerate(ref_run):
        out = unwrap(res[case.id])
        for step, rec in enumerate(out["steps"]):
            st = rec["state"]
            assert isinstance(st["step"], int), st["step"]
            if step < warmup_of(case):
                for name, e in st["error"].items():
                    assert not e.any(), f"step {step} (warm-up) {name}: a residual {e.abs().max()}"
                continue
            assert set(st["q"]) == set(out["compressed"]), (sorted(st["q"]), out["compressed"])
            for name, q in rec["want_q"].items():
                assert tuple(st["q"][name].shape) == tuple(q.shape), (name, st["q"][name].shape, q.shape)
                assert_close(st["q"][name].double(), q, rtol=TOL, atol=TOL * float(q.abs().max()),
                             msg=lambda m, name=name, step=step: f"rank {rank} step {step} Q of {name}: {m}")
            if dict(case.comp).get("error_feedback", True):
                assert set(st["error"]) == set(out["compressed"]), (sorted(st["error"]), out["compressed"])
                for name, e in rec["want_error"].items():
                    got = st["error"][name].double().reshape(e.shape)
                    assert_close(got, e, rtol=TOL, atol=TOL * rec["scale"][name],
                                 msg=lambda m, name=name, step=step: f"rank {rank} step {step} residual of {name}: {m}")
            else:
                assert all(not e.any() for e in st["error"].values()), "error_feedback=False keeps a residual"
        steps = [rec["state"]["step"] for rec in out["steps"]]
        assert steps == sorted(steps) and steps[-1] > steps[0], steps


def test_which_matrices_are_compressed() -> None:
    """The rule, on this file's model (a check of the test's own premise)."""
    model = power_net(bf16=True)
    assert sorted(compressed_ranks(model, fastreduce.PowerSGD(rank=4))) == [
        "a.weight", "b.weight", "c.weight", "d.weight", "e.weight"]  # not conv (8 x 9), f (16 x 16), g (5 x 16)
    assert sorted(compressed_ranks(model, fastreduce.PowerSGD(rank=2, min_compression_rate=0))) == [
        "a.weight", "b.weight", "c.weight", "conv.weight", "d.weight", "e.weight", "f.weight", "g.weight"]


def hook_case(rank: int, world: int) -> dict:
    """torch's ``powerSGD_hook`` (one DDP bucket) beside fastreduce's PowerSGD, rank 4, the default
    min_compression_rate (2), fp32 factors, 2 exact steps, on a 16 x 16 matrix (exactly on the
    rate: 2 (16 + 16) 4 == 256) and a 17 x 16 one (just above: 264 < 272): per step and matrix,
    each one's distance from the exact mean, relative to the mean's largest value."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook

    def net() -> nn.Module:
        torch.manual_seed(SEED)
        return nn.Sequential(nn.Linear(16, 16, bias=False), nn.Tanh(), nn.Linear(16, 17, bias=False))

    model, plain = net(), net()
    ddp = DDP(net())
    ddp.register_comm_hook(hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                              start_powerSGD_iter=2, min_compression_rate=2), hook.powerSGD_hook)
    reducer = fastreduce.FusedReducer(model, wire_dtype=torch.float32,
                                      compression=fastreduce.PowerSGD(rank=4, warmup_steps=2))
    out: list[dict] = []
    for step in range(4):
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(100 * step + rank))
        for m in (model, ddp, plain):
            m.zero_grad()
            m(x).pow(2).mean().backward()
        reducer.reduce()
        dists = {}
        for (name, p), q, mean in zip(model.named_parameters(), ddp.module.parameters(), plain.parameters()):
            exact = mean.grad.clone()
            dist.all_reduce(exact)
            exact /= world
            scale = float(exact.abs().max())
            dists[name] = (float((p.grad - exact).abs().max()) / scale, float((q.grad - exact).abs().max()) / scale)
        out.append(dists)
    return out


def test_a_matrix_exactly_on_the_rate_is_sent_whole_as_torchs_hook_sends_it() -> None:
    """torch compresses only where rate (n + m) r < n m; fastreduce compressed where n m >=
    rate (n + m) r, so a 16 x 16 matrix at rank 4 was a rank-4 approximation where the hook
    sends it whole."""
    for r in run_ranks(hook_case, 2, timeout=TIMEOUT):
        for step, dists in enumerate(r):
            for name, (ours, torchs) in dists.items():
                whole = step < 2 or name == "0.weight"  # the warm-up; 16 x 16 at rank 4
                assert (torchs <= 1e-6) == whole, (step, name, torchs)  # (the hook: the premise)
                assert (ours <= 1e-6) == whole, (step, name, ours, torchs)


def test_overlap_buckets_do_not_change_the_result(ref_run: list[dict]) -> None:
    for comp in (R2, R4):
        for t in TRANSPORTS:
            for rank, res in enumerate(ref_run):
                fused = unwrap(res[Case("fused", t, comp, True).id])
                over = unwrap(res[Case("overlap", t, comp, True).id])
                for step, (a, b) in enumerate(zip(fused["steps"], over["steps"])):
                    tol = TOL if step < CHAINED_STEPS else DRIFT_TOL  # two fp32 runs drift apart
                    for name, g in a["got"].items():
                        assert_close(b["got"][name], g, rtol=tol, atol=tol * a["scale"][name],
                                     msg=lambda m, name=name, step=step: f"{t} {comp} rank {rank} "
                                                                         f"step {step} {name}: {m}")


def test_transports_agree_bit_for_bit(ref_run: list[dict]) -> None:
    """At two ranks both transports average as fl(a + b) / 2 (docs/transport.md): P and Q
    too, so the two runs are the same bits."""
    for comp in (R2, R4):
        for mode in ("fused", "overlap"):
            for res in ref_run:
                a, b = (unwrap(res[Case(mode, t, comp, True).id]) for t in TRANSPORTS)
                for step, (x, y) in enumerate(zip(a["steps"], b["steps"])):
                    for name, g in x["got"].items():
                        assert torch.equal(y["got"][name], g), (f"{mode} {comp} step {step} {name}: "
                                                                f"{float((y['got'][name] - g).abs().max())}")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_all_reduce_gradients_equals_the_reducer(ref_run: list[dict], transport: str) -> None:
    """6. the functional form keeps a PowerSGD reducer on the model: the same gradients."""
    for res in ref_run:
        fn = unwrap(res[Case("function", transport, R2, True).id])
        obj = unwrap(res[Case("fused", transport, R2, True).id])
        for step, (a, b) in enumerate(zip(fn["steps"], obj["steps"])):
            for name, g in b["got"].items():
                assert_close(a["got"][name], g, rtol=1e-6, atol=1e-7 * max(b["scale"][name], 1e-3),
                             msg=lambda m, name=name, step=step: f"step {step} {name}: {m}")


@pytest.mark.parametrize("case", ref_ids(lambda c: dict(c.comp).get("error_feedback", True)),
                         ids=lambda c: c.id)
def test_error_feedback_loses_nothing(ref_run: list[dict], case: Case) -> None:
    """3. sum_t applied_t == sum_t mean_i g_i,t - mean_i e_i,T (per parameter)."""
    for res in ref_run:
        out = unwrap(res[case.id])
        applied = {n: sum(rec["got"][n].double() for rec in out["steps"]) for n in out["steps"][0]["got"]}
        means = {n: sum(rec["exact_mean"][n].double() for rec in out["steps"]) for n in applied}
        for name in applied:
            if out["steps"][0]["got"][name].dtype != torch.float32:
                continue  # bf16: exact means, each rounded to bf16 (test_grads_match_algorithm_1)
            want = means[name] - out["mean_final_error"].get(name, 0.0)
            scale = max(float(want.abs().max()), float(applied[name].abs().max()),
                        max(rec["scale"][name] for rec in out["steps"]))
            assert_close(applied[name], want, rtol=0, atol=TOL * scale,
                         msg=lambda m, name=name: f"{case.id} {name}: {m}")
        assert any(float(e.abs().max()) > 0 for e in out["mean_final_error"].values()), \
            "no residual left below full rank"


@pytest.mark.parametrize("mode", ("fused", "overlap"))
def test_warmup_is_exact_then_compressed(ref_run: list[dict], mode: str) -> None:
    """4. the first warmup_steps reductions are exact means; compression starts after."""
    case = Case(mode, "shm", R2 + (("warmup_steps", WARMUP),), True)
    for res in ref_run:
        out = unwrap(res[case.id])
        for step, rec in enumerate(out["steps"]):
            far = 0.0
            for name, g in rec["got"].items():
                mean = rec["exact_mean"][name]
                if step < WARMUP or name not in out["compressed"]:
                    if g.dtype == torch.float32:
                        assert_close(g, mean, rtol=1e-6, atol=1e-6 * rec["scale"][name],
                                     msg=lambda m, name=name, step=step: f"step {step} {name}: {m}")
                else:
                    far = max(far, float((g - mean).abs().max()) / rec["scale"][name])
            if step < WARMUP:
                assert rec["compressed"] == 0, f"step {step}: stats.compressed counted a warm-up reduction"
                assert rec["bytes"] >= out["full_bytes"], (step, rec["bytes"], out["full_bytes"])
            else:
                assert rec["compressed"] == 1, f"step {step}: stats.compressed {rec['compressed']}"
                assert far > 1e-3, f"step {step}: the rank-2 result is the exact mean ({far}): no compression?"
                assert rec["bytes"] < out["full_bytes"] / 2, (step, rec["bytes"], out["full_bytes"])


@pytest.mark.parametrize("case", ref_ids(lambda c: c.mode != "function"), ids=lambda c: c.id)
def test_bytes_reduced_are_p_q_and_the_uncompressed(ref_run: list[dict], case: Case) -> None:
    """7. per compressed reduction: 4 * (P + uncompressed + Q) values, alignment aside."""
    for res in ref_run:
        out = unwrap(res[case.id])
        exp = out["expected_bytes"]
        for step, rec in enumerate(out["steps"]):
            if step < warmup_of(case):
                continue
            assert exp <= rec["bytes"] <= exp * 1.03 + 1024, \
                f"step {step}: bytes_reduced grew by {rec['bytes']}, expected {exp} (+ alignment)"
            assert rec["bytes"] < 0.5 * out["full_bytes"], (rec["bytes"], out["full_bytes"])


def test_seed_decides_the_initial_q() -> None:
    from fastreduce.codecs.powersgd import initial_q
    a = initial_q("a.weight", 64, 4, 0)
    assert a.shape == (64, 4) and a.dtype == torch.float32
    assert torch.equal(a, initial_q("a.weight", 64, 4, 0))
    assert not torch.equal(a, initial_q("a.weight", 64, 4, 1))
    assert not torch.equal(a, initial_q("b.weight", 64, 4, 0))


# ============================================================== 5. checkpoint resume

CKPT_STEPS, CKPT_AT = 10, 5
CKPT_COMP = {"rank": 2, "min_compression_rate": 0.0}


def ckpt_train(rank: int, mode: str, directory: str, start: int, built_first: bool) -> dict:
    from fastreduce.checkpoint import Checkpointer
    model = power_net()
    overlap = mode == "overlap"
    reducer = fastreduce.FusedReducer(model, wire_dtype=torch.float32, compression=fastreduce.PowerSGD(**CKPT_COMP),
                                      overlap=overlap, bucket_mb=BUCKET_MB if overlap else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = Checkpointer(directory, model, opt, mode=reducer)
    out: dict[str, Any] = {}
    if start:
        if built_first:  # a reduction with junk before the load: the loaded state must replace it
            loss_of(model, batch(rank + 7, 99)).backward()
            reducer.reduce()
            opt.zero_grad()
        out["loaded"] = ckpt.load_latest()
    for step in range(start, CKPT_STEPS):
        loss_of(model, batch(rank, step)).backward()
        reducer.reduce()
        opt.step()
        opt.zero_grad()
        if step + 1 == CKPT_AT and not start:
            ckpt.save(CKPT_AT)
            st = reducer.state_dict()["compression"]
            out["saved_error_norm"] = sum(float(e.norm()) for e in st["error"].values())
            out["saved_q"] = sorted(st["q"])
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def ckpt_mismatch(rank: int, mode: str, directory: str) -> dict:
    """A fresh job with another PowerSGD rank resumes from the checkpoint, its reducer not
    built yet: refused at the load, nothing changed; it then trains from where it was."""
    from fastreduce.checkpoint import CheckpointMismatchError, Checkpointer
    model = power_net()
    reducer = fastreduce.FusedReducer(model, wire_dtype=torch.float32, overlap=mode == "overlap",
                                      bucket_mb=BUCKET_MB if mode == "overlap" else None,
                                      compression=fastreduce.PowerSGD(**{**CKPT_COMP, "rank": 3}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    failed = expect_raises(CheckpointMismatchError, Checkpointer(directory, model, opt, mode=reducer).load_latest)
    unchanged = all(torch.equal(p, before[n]) for n, p in model.named_parameters()) and not opt.state
    loss_of(model, batch(rank, 0)).backward()
    reducer.reduce()
    return {"failed": failed, "unchanged": unchanged, "reduced": reducer.state_dict()["compression"]["step"]}


def ckpt_worker(rank: int, world: int, runs: list[tuple[str, str, int, Any]]) -> dict:
    """Each run: ``(mode, directory, start, built first)``, or ``("mismatch", directory, start, mode)``."""
    return {f"{mode}-{start}-{built}": guarded(ckpt_mismatch, rank, built, d) if mode == "mismatch" else
            guarded(ckpt_train, rank, mode, d, start, built) for mode, d, start, built in runs}


@pytest.mark.parametrize("mode", ("fused", "overlap"))
def test_checkpoint_resume_is_bit_for_bit(tmp_path: Any, mode: str) -> None:
    first = run_ranks(ckpt_worker, 2, [(mode, str(tmp_path / "a"), 0, False)], timeout=TIMEOUT)
    # fresh processes: the state loaded before the reducer is built, and after
    resumed = run_ranks(ckpt_worker, 2, [(mode, str(tmp_path / "a"), CKPT_AT, False),
                                         (mode, str(tmp_path / "a"), CKPT_AT, True),
                                         ("mismatch", str(tmp_path / "a"), CKPT_AT, mode)], timeout=TIMEOUT)
    for rank in range(2):
        whole = unwrap(first[rank][f"{mode}-0-False"])
        assert whole["saved_error_norm"] > 0, "the checkpointed state holds no residual"
        assert whole["saved_q"] == sorted(compressed_ranks(power_net(), fastreduce.PowerSGD(**CKPT_COMP)))
        for built in (False, True):
            res = unwrap(resumed[rank][f"{mode}-{CKPT_AT}-{built}"])
            assert res["loaded"] == CKPT_AT
            for name, p in whole["params"].items():
                diff = float((res["params"][name] - p).abs().max())
                assert diff <= 1e-7, (f"rank {rank} {name} (state loaded {'after' if built else 'before'} "
                                      f"the reducer was built): {diff} from the uninterrupted run")
        # saved at rank 2, resumed at rank 3 before the reducer was built: refused at the load, nothing
        # changed (before, the model and optimizer were loaded and the first reduce() raised)
        other = unwrap(resumed[rank][f"mismatch-{CKPT_AT}-{mode}"])
        assert "PowerSGD q saved for" in other["failed"]["message"], other["failed"]
        assert other["unchanged"] and other["reduced"] == 1, other


def state_dict_roundtrip(rank: int, world: int) -> dict:
    """load_state_dict on a fresh reducer (before its first reduce) continues exactly."""
    comp = fastreduce.PowerSGD(**CKPT_COMP)
    a, b = power_net(), power_net()
    ra = fastreduce.FusedReducer(a, wire_dtype=torch.float32, compression=comp)
    for step in range(3):
        a.zero_grad()
        loss_of(a, batch(rank, step)).backward()
        ra.reduce()
    sd = copy.deepcopy(ra.state_dict())
    rb = fastreduce.FusedReducer(b, wire_dtype=torch.float32, compression=comp)
    rb.load_state_dict(sd)
    same = same_grads_ahead(rank, (a, ra), (b, rb))
    st = rb.state_dict()["compression"]
    return {"same": same, "keys": sorted(st), "steps": (ra.state_dict()["compression"]["step"], st["step"])}


def same_grads_ahead(rank: int, *pairs: tuple[torch.nn.Module, Any]) -> list[bool]:
    """Steps 3 to 5 through each (model, reducer) of two pairs with the same parameters (only
    grads move): whether their averaged gradients are equal at each."""
    same = []
    for step in range(3, 6):
        for m, r in pairs:
            m.zero_grad()
            loss_of(m, batch(rank, step)).backward()
            r.reduce()
        (a, _), (b, _) = pairs
        same.append(all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters())))
    return same


def test_load_state_dict_before_the_first_reduce() -> None:
    for r in run_ranks(state_dict_roundtrip, 2, timeout=TIMEOUT):
        assert r["same"] == [True] * 3, r
        assert {"step", "q", "error"} <= set(r["keys"]), r
        assert r["steps"][0] == r["steps"][1], r


def fresh_state_case(rank: int, world: int) -> dict:
    """A state saved before any reduce() (no "compression" entry) loaded into a reducer after 3
    steps, beside a fresh reducer (the reference): whether the next steps' gradients are the same.
    warmup_steps=1: the step count must be back at 0 too."""
    comp = fastreduce.PowerSGD(**CKPT_COMP, warmup_steps=1)
    out = {}
    for mode in ("fused", "overlap"):
        settings = {"wire_dtype": torch.float32, "compression": comp, "overlap": mode == "overlap",
                    "bucket_mb": BUCKET_MB if mode == "overlap" else None}
        unbuilt = fastreduce.FusedReducer(power_net(), **settings)
        fresh = copy.deepcopy(unbuilt.state_dict())
        a, c = power_net(), power_net()
        ra = fastreduce.FusedReducer(a, **settings)
        for step in range(3):
            a.zero_grad()
            loss_of(a, batch(rank, step)).backward()
            ra.reduce()
        ra.load_state_dict(fresh)
        rc = fastreduce.FusedReducer(c, **settings)
        same = same_grads_ahead(rank, (a, ra), (c, rc))
        for r in (unbuilt, ra, rc):
            r.close()
        out[mode] = {"same": same, "fresh": sorted(fresh)}
    return out


def test_a_state_saved_before_the_first_reduce_makes_a_live_reducer_fresh() -> None:
    """With no "compression" entry, the live reducer kept its Q, residuals and step count."""
    for r in run_ranks(fresh_state_case, 2, timeout=TIMEOUT):
        for mode, out in r.items():
            assert out["fresh"] == ["residuals"], (mode, out)
            assert out["same"] == [True] * 3, (mode, out)


# ============================================================== 8. bad settings

def test_bad_codec_settings_raise_value_error() -> None:
    for kwargs in ({"rank": 0}, {"rank": -3}, {"warmup_steps": -1}, {"min_compression_rate": -0.5}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            fastreduce.PowerSGD(**kwargs)


def test_powersgd_is_a_frozen_hashable_dataclass() -> None:
    c = fastreduce.PowerSGD(rank=4, warmup_steps=2, seed=1)
    twin = fastreduce.PowerSGD(4, warmup_steps=2, seed=1)
    assert c == twin and hash(c) == hash(twin) and len({c, twin}) == 1
    assert c != fastreduce.PowerSGD(4, warmup_steps=2, seed=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.rank = 5  # type: ignore[misc]
    d = fastreduce.PowerSGD()
    assert (d.rank, d.warmup_steps, d.error_feedback, d.warm_start, d.min_compression_rate, d.seed) == (
        4, 0, True, True, 2.0, 0)
    with pytest.raises(TypeError):
        fastreduce.PowerSGD(4, 0)  # everything after rank is keyword-only


def bad_reducer_worker(rank: int, world: int) -> dict:
    model = power_net()
    comp = fastreduce.PowerSGD()
    out = {}
    for key, kwargs in {"accumulate_dtype": {"accumulate_dtype": torch.float32},
                        "error_feedback": {"error_feedback": True},
                        "not_a_codec": {"compression": "powersgd"},
                        "not_a_codec_object": {"compression": object()}}.items():
        kw = {"wire_dtype": torch.float32, "compression": comp, **kwargs}
        try:
            r = fastreduce.FusedReducer(model, **kw)
            model.zero_grad()
            loss_of(model, batch(rank, 0)).backward()
            r.reduce()
            out[key] = ("none", "")
        except ValueError as e:
            out[key] = ("ValueError", str(e))
        except Exception as e:  # noqa: BLE001
            out[key] = (type(e).__name__, traceback.format_exc())
    try:
        fastreduce.all_reduce_gradients(model, torch.float32, compression=comp, accumulate_dtype=torch.float32)
        out["function_accumulate_dtype"] = ("none", "")
    except ValueError as e:
        out["function_accumulate_dtype"] = ("ValueError", str(e))
    except Exception as e:  # noqa: BLE001
        out["function_accumulate_dtype"] = (type(e).__name__, traceback.format_exc())
    return out


def test_bad_reducer_settings_raise_value_error() -> None:
    (out,) = run_ranks(bad_reducer_worker, 1, timeout=60)
    for key, (kind, message) in out.items():
        assert kind == "ValueError", f"{key}: {kind} {message}"
    for key in ("accumulate_dtype", "function_accumulate_dtype"):
        assert "accumulate_dtype" in out[key][1], out[key]
    assert "error_feedback" in out["error_feedback"][1], out["error_feedback"]
    assert "compression" in out["not_a_codec"][1], out["not_a_codec"]


# ============================================================== torch.compile

def compiled_case(rank: int, world: int, overlap: bool) -> dict:
    """The same five steps on the plain model and on torch.compile(model) (aot_eager)."""
    out = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
        run = torch.compile(m, backend="aot_eager") if compiled else m
        red = fastreduce.FusedReducer(run, wire_dtype=torch.float32, overlap=overlap, bucket_mb=0.003,
                                      compression=fastreduce.PowerSGD(2, min_compression_rate=0))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for s in range(5):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + 10 * s + rank))
            run(x).square().mean().backward()
            red.reduce()
            opt.step()
            opt.zero_grad()
        out[compiled] = torch.cat([p.detach().flatten() for p in m.parameters()])
        red.close()
        if compiled:  # all_reduce_gradients on the compiled model: its residuals are the module's
            run(x).square().mean().backward()
            fastreduce.all_reduce_gradients(run, torch.bfloat16, error_feedback=True)
            out["residuals"] = sorted(functional_state(m)["residuals"])
            out["names"] = sorted(n for n, _ in m.named_parameters())
    return out


@pytest.mark.parametrize("overlap", [False, True], ids=["fused", "overlap"])
def test_compiled_model_gives_the_same_parameters(overlap: bool) -> None:
    """docs/design.md, invariant 7: compiled or not, the same result (here bit for bit), the
    reducer built over what the user holds (torch.compile's wrapper names each parameter
    '_orig_mod.<name>': each matrix's first Q, drawn from its name, differed). And
    all_reduce_gradients on the compiled model keeps its residuals where a Checkpointer given
    the module finds them (they were on the wrapper: saved as none)."""
    for r in run_ranks(compiled_case, 2, overlap, timeout=300):
        assert torch.equal(r[False], r[True])
        assert r["residuals"] == r["names"], r["residuals"]
