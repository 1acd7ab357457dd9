"""Non-finite gradients (``ReducerConfig.nonfinite``) on real Gloo groups: one rank's NaN or
inf reaches every rank's average, so every rank raises (``raise``, naming the parameter)
or returns ``False`` from ``reduce()`` (``skip``) alike; ``ignore`` leaves the non-finite
average as it is. Fused and overlapped, bf16 and fp32 wires, and an fp32 gradient that
only overflows the fp16 wire. No transport is hard-coded."""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fastreduce
from fastreduce.launch import run_ranks

from test_fused import expect_raises, guarded, per_rank
from test_local import same_state

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


def alone_worker(rank: int, world: int) -> dict:
    """One rank (a Membership down to one member, LocalSGD's warm-up): a NaN gradient."""
    out: dict[str, Any] = {}
    for mode in ("skip", "raise", "ignore"):
        model = nn.Linear(2, 1)
        reducer = fastreduce.FusedReducer(model, nonfinite=mode)
        model(torch.ones(1, 2)).sum().backward()
        model.weight.grad[0, 0] = math.nan
        try:
            out[mode] = reducer.reduce(), reducer.stats.nonfinite
        except fastreduce.NonFiniteGradError as err:
            out[mode] = str(err)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    local = fastreduce.LocalSGD(model, opt, sync_every=2, warmup_steps=2, nonfinite="skip")
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(1, 2)).sum().backward()
    model.weight.grad[0, 0] = math.nan
    opt.step()
    out["warmup"] = all(torch.equal(a, p) for a, p in zip(before, model.parameters())), local.skipped_steps
    return out


def test_one_rank_checks_its_gradients_as_a_group_checks_their_average() -> None:
    """FusedReducer at world size 1 returned True without a look: nonfinite="skip" stepped a
    NaN (so did LocalSGD's warm-up) and "raise" raised nothing."""
    out = run_ranks(alone_worker, 1, timeout=120)[0]
    assert out["skip"] == (False, 1), out
    assert "the gradients hold inf or NaN, first in parameter 'weight'" in out["raise"], out
    assert out["ignore"] == (True, 0), out
    assert out["warmup"] == (True, 1), out  # the step skipped: the parameters as they were


def test_bad_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="nonfinite must be"):
        fastreduce.ReducerConfig(nonfinite="warn")


# ====================================================================== the other modes
#
# ZeroOptimizer, DecentralizedDataParallel, LocalSGD and DiLoCo under nonfinite="raise" /
# "skip" / "ignore", one NaN or inf injected on rank 1 (into a gradient, through a tensor
# hook; or, at a sync, into a parameter, through an optimizer step hook registered before
# the mode's). Each run is compared with a reference loop written here that skips that
# step (plain torch.optim on dist.all_reduce'd gradients for ZeRO; the same gossip run
# with that rank's optimizer step made a no-op; local SGD / DiLoCo from their equations),
# on a process group of its own so that its collectives never meet the mode's.

STEPS = 6
SYNC_STEP = 3  # "sync" cases: rank 1's parameter goes bad right before this step's sync (H = 2)
BAD_VALUE = {"nan": math.nan, "inf": math.inf}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _x(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * step + rank))


def _spoil(model: nn.Module, rank: int, step: int, bad: str) -> Any:
    """Rank 1's gradient of ``2.weight`` at ``BAD_STEP`` holds one bad value."""
    if rank != 1 or step != BAD_STEP:
        return None

    def spoil(g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        g[0, 0] = BAD_VALUE[bad]
        return g
    return model[2].weight.register_hook(spoil)


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def _opt_state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t.clone() for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _gap(model: nn.Module, ref: list[torch.Tensor]) -> float:
    """Largest difference from the reference (NaN in the same places counts as equal)."""
    worst = 0.0
    for p, r in zip(_params(model), ref):
        if not torch.equal(torch.isnan(p), torch.isnan(r)):
            return math.inf
        worst = max(worst, float((p.nan_to_num() - r.nan_to_num()).abs().max()))
    return worst


def _ref_mean(tensors: list[torch.Tensor], group: Any) -> None:
    for t in tensors:
        dist.all_reduce(t, group=group)
        t.div_(dist.get_world_size(group))


def case_zero(rank: int, world: int, mode: str, bad: str, ref_group: Any) -> dict:
    model = _model()
    ref = copy.deepcopy(model)
    opt = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=0.05, module=model,
                                   wire_dtype=torch.float32, nonfinite=mode)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    out: dict = {"skipped": []}
    for step in range(STEPS):
        x = _x(rank, step)
        handle = _spoil(model, rank, step, bad)
        model(x).pow(2).mean().backward()
        if handle is not None:
            handle.remove()
        if step == BAD_STEP:
            opt.wait_params()
            before = (_params(model), opt.state_dict())
        if step == BAD_STEP and mode == "raise":
            out["error"] = expect_raises(fastreduce.NonFiniteGradError, opt.step)
        else:
            opt.step()
            out["skipped"].append(opt.last_step_skipped)
        if step == BAD_STEP:
            opt.wait_params()
            out["unchanged"] = _same(before[0], _params(model)) and same_state(before[1], opt.state_dict())
            out["finite_after"] = _finite(model)
        opt.zero_grad()
        if step != BAD_STEP:  # the reference skips the bad step: plain AdamW on averaged grads
            ref_opt.zero_grad()
            ref(x).pow(2).mean().backward()
            _ref_mean([p.grad for p in ref.parameters()], ref_group)
            ref_opt.step()
    opt.wait_params()
    out["gap"] = _gap(model, _params(ref))
    out["counted"] = opt.skipped_steps
    return out


def _gossip(rank: int, mode: str, bad: str | None, noop_at_bad: bool) -> dict:
    """Gossip training; ``noop_at_bad``: rank 1's optimizers do nothing at ``BAD_STEP``
    (the reference: that step skipped by hand, with finite gradients)."""
    model = _model()
    ddp = fastreduce.DecentralizedDataParallel(
        model, lambda named: torch.optim.SGD([p for _, p in named], lr=0.1, momentum=0.9),
        topology="complete", nonfinite=mode)
    out: dict = {}
    for step in range(STEPS):
        handle = _spoil(model, rank, step, bad) if bad else None
        loss = ddp(_x(rank, step)).pow(2).mean()
        noop = noop_at_bad and rank == 1 and step == BAD_STEP
        if noop:
            for o in ddp._optims:
                o.step = lambda *_a, **_k: None
        if step == BAD_STEP:
            before = [t for o in ddp._optims for t in _opt_state(o)]
        if step == BAD_STEP and mode == "raise":
            out["error"] = expect_raises(fastreduce.NonFiniteGradError, loss.backward)
        else:
            loss.backward()
        if noop:
            for o in ddp._optims:
                del o.step
        if handle is not None:
            handle.remove()
        if step == BAD_STEP:
            out["state_unchanged"] = _same(before, [t for o in ddp._optims for t in _opt_state(o)])
    ddp.wait_exchanges()
    out["params"] = _params(model)
    out["state"] = [t for o in ddp._optims for t in _opt_state(o)]
    out["finite_end"] = _finite(model)
    out["counted"] = ddp.skipped_steps
    return out


def case_gossip(rank: int, world: int, mode: str, bad: str, ref_group: Any) -> dict:
    got = _gossip(rank, mode, bad, False)
    ref = _gossip(rank, "ignore", None, True)
    got["same_as_ref"] = _same(got.pop("params"), ref["params"]) and _same(got.pop("state"), ref["state"])
    return got


def _corrupt_before_sync(model: nn.Module, opt: torch.optim.Optimizer, rank: int, bad: str) -> Callable:
    """An inner-optimizer post-hook, registered before the mode's: rank 1's parameter goes
    bad after its step ``SYNC_STEP`` and before that step's sync."""
    count = [0]

    def corrupt(*_: Any) -> None:
        if rank == 1 and count[0] == SYNC_STEP:
            with torch.no_grad():
                model[2].weight[0, 0] = BAD_VALUE[bad]
        count[0] += 1
    return opt.register_step_post_hook(corrupt)


def case_local(rank: int, world: int, mode: str, bad: str, kind: str, ref_group: Any) -> dict:
    """``kind``: ``inner`` (a gradient, a local step), ``warmup`` (a gradient, an averaged
    warm-up step), ``sync`` (a parameter, before the sync); LocalSGD or DiLoCo (``diloco*``)."""
    diloco = kind.startswith("diloco")
    where = kind.removeprefix("diloco-")
    warmup = 4 if where == "warmup" else 0
    model = _model()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    if where == "sync":
        _corrupt_before_sync(model, opt, rank, bad)
    if diloco:
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9)
        mode_ = fastreduce.DiLoCo(model, opt, outer, sync_every=2, wire_dtype=torch.float32, nonfinite=mode)
    else:
        mode_ = fastreduce.LocalSGD(model, opt, sync_every=2, warmup_steps=warmup, nonfinite=mode)
    anchor, buf = _params(ref), None  # the DiLoCo reference's last synced params and outer momentum
    bad_step = SYNC_STEP if where == "sync" else BAD_STEP
    out: dict = {"errors": []}
    count = 0  # the reference's step count (a warm-up step that raised is not counted, as in the mode)
    # LocalSGD's skipped sync leaves rank 1 its own, bad, parameters: its next steps would
    # all be skipped, so that run ends with the sync; DiLoCo's returns every rank to the anchor.
    for step in range(SYNC_STEP + 1 if kind == "sync" else STEPS):
        x = _x(rank, step)
        opt.zero_grad()
        handle = _spoil(model, rank, step, bad) if where != "sync" else None
        model(x).pow(2).mean().backward()
        if handle is not None:
            handle.remove()
        if step == bad_step:
            before = (_params(model), _opt_state(opt), _opt_state(outer) if diloco else [])
        if step == bad_step and mode == "raise":
            out["errors"].append(expect_raises(fastreduce.NonFiniteGradError, opt.step))
        else:
            opt.step()
        if step == bad_step:
            # a skipped inner step (no sync after it) leaves parameters and inner state alone;
            # a skipped sync leaves the outer optimizer's state alone
            out["inner_unchanged"] = _same(before[0], _params(model)) and _same(before[1], _opt_state(opt))
            out["outer_unchanged"] = _same(before[2], _opt_state(outer) if diloco else [])
        # the reference: the same steps, the bad one skipped where the mode skips it
        if where == "warmup" and mode == "raise" and step == BAD_STEP:
            continue  # raised on every rank before the step: nothing happened, nothing counted
        ref_opt.zero_grad()
        ref(x).pow(2).mean().backward()
        if count < warmup:
            _ref_mean([p.grad for p in ref.parameters()], ref_group)
        skip_inner = step == BAD_STEP and (where == "warmup" or (where == "inner" and rank == 1))
        if not skip_inner:
            ref_opt.step()
        if where == "sync" and rank == 1 and step == SYNC_STEP:
            with torch.no_grad():
                ref[2].weight[0, 0] = BAD_VALUE[bad]
        count += 1
        if count > warmup and (count - warmup) % 2 == 0:
            with torch.no_grad():
                x_ref = list(ref.parameters())
                skip_sync = where == "sync" and step == SYNC_STEP
                if diloco:
                    delta = [a - p for a, p in zip(anchor, x_ref)]
                    _ref_mean(delta, ref_group)
                    if not skip_sync:  # outer SGD with momentum: b = g, then b = mu b + g
                        buf = delta if buf is None else [0.9 * b + g for b, g in zip(buf, delta)]
                        anchor = [a - 0.7 * b for a, b in zip(anchor, buf)]
                    for p, a in zip(x_ref, anchor):
                        p.copy_(a)
                elif not skip_sync:
                    _ref_mean(x_ref, ref_group)
    out["gap"] = _gap(model, _params(ref))
    out["finite_end"] = _finite(model)
    out["counted"] = (mode_.skipped_steps, mode_.skipped_syncs)
    return out


MODE_CASES = ([("zero", m, b) for m in ("raise", "skip", "ignore") for b in ("nan", "inf")]
              + [("gossip", m, "nan") for m in ("raise", "skip", "ignore")]
              + [(k, m, "nan") for k in ("inner", "warmup", "sync", "diloco-inner", "diloco-sync")
                 for m in ("raise", "skip", "ignore")])


def modes_worker(rank: int, world: int) -> dict:
    ref_group = dist.new_group(backend="gloo")
    out = {}
    for kind, mode, bad in MODE_CASES:
        if kind == "zero":
            out[(kind, mode, bad)] = guarded(case_zero, rank, world, mode, bad, ref_group)
        elif kind == "gossip":
            out[(kind, mode, bad)] = guarded(case_gossip, rank, world, mode, bad, ref_group)
        else:
            out[(kind, mode, bad)] = guarded(case_local, rank, world, mode, bad, kind, ref_group)
    return out


@pytest.fixture(scope="module")
def mode_results() -> list[dict]:
    return run_ranks(modes_worker, 2, timeout=240)


@pytest.mark.parametrize("mode,bad", [c[1:] for c in MODE_CASES if c[0] == "zero"],
                         ids=["-".join(c[1:]) for c in MODE_CASES if c[0] == "zero"])
def test_zero_decides_alike_on_every_rank(mode_results, mode: str, bad: str) -> None:
    for rank, out in enumerate(per_rank(mode_results, ("zero", mode, bad))):
        if mode == "ignore":
            assert out["finite_after"] is False and out["counted"] == 0, (rank, out)
            continue
        # every rank: nothing stepped at the bad step, and training goes on like a
        # reference that skipped it
        assert out["unchanged"] and out["finite_after"], (rank, out)
        assert out["gap"] < 1e-5, (rank, out)
        if mode == "raise":
            assert out["error"]["raised"] == "NonFiniteGradError", (rank, out)
            assert "'2.weight'" in out["error"]["message"], out["error"]["message"]
            assert out["skipped"] == [False] * (STEPS - 1) and out["counted"] == 0, (rank, out)
        else:
            assert out["skipped"] == [s == BAD_STEP for s in range(STEPS)] and out["counted"] == 1, (rank, out)


@pytest.mark.parametrize("mode", ["raise", "skip", "ignore"])
def test_gossip_skips_on_the_rank_that_holds_the_bad_gradient(mode_results, mode: str) -> None:
    outs = per_rank(mode_results, ("gossip", mode, "nan"))
    if mode == "ignore":  # rank 1's NaN reaches rank 0 through the mixing
        assert [o["finite_end"] for o in outs] == [False, False] and outs[1]["counted"] == 0, outs
        return
    for rank, out in enumerate(outs):
        # params and optimizer state as in a run where rank 1's step was made a no-op by hand
        assert out["same_as_ref"] and out["finite_end"], (rank, out)
        assert out["counted"] == (1 if rank == 1 else 0), (rank, out)
    assert outs[1]["state_unchanged"] and not outs[0]["state_unchanged"], outs  # only rank 1 skipped
    if mode == "raise":  # only the rank whose gradient was bad: gradients never leave it
        assert outs[0]["error"]["raised"] is None, outs[0]
        assert outs[1]["error"]["raised"] == "NonFiniteGradError", outs[1]
        assert "'2.weight'" in outs[1]["error"]["message"] and "rank 1" in outs[1]["error"]["message"]


LOCAL_KINDS = ("inner", "warmup", "sync", "diloco-inner", "diloco-sync")


@pytest.mark.parametrize("kind", LOCAL_KINDS)
@pytest.mark.parametrize("mode", ["raise", "skip", "ignore"])
def test_local_modes_skip_a_step_and_match_a_reference_that_skipped_it(mode_results, kind: str, mode: str) -> None:
    outs = per_rank(mode_results, (kind, mode, "nan"))
    where = kind.removeprefix("diloco-")
    if mode == "ignore":  # the NaN is averaged into every rank's parameters
        assert [o["finite_end"] for o in outs] == [False, False], outs
        assert all(o["counted"] == (0, 0) for o in outs), outs
        return
    for rank, out in enumerate(outs):
        assert out["gap"] < 1e-6, (rank, out)
        if where == "sync":  # every rank holds the same average: every rank skips the sync
            assert out["counted"] == (0, 1) and out["outer_unchanged"], (rank, out)
        elif where == "warmup":  # the averaged gradients: every rank skips (or raises before) the step
            assert out["counted"] == ((1, 0) if mode == "skip" else (0, 0)) and out["inner_unchanged"], (rank, out)
        else:  # a local step: only rank 1 skips it
            assert out["counted"] == ((1, 0) if rank == 1 else (0, 0)), (rank, out)
            assert out["inner_unchanged"] or rank == 0, (rank, out)
    if mode == "raise":
        raisers = [r for r, o in enumerate(outs) if o["errors"] and o["errors"][0]["raised"] == "NonFiniteGradError"]
        assert raisers == ([1] if where == "inner" else [0, 1]), outs
        for r in raisers:
            assert "'2.weight'" in outs[r]["errors"][0]["message"], outs[r]["errors"][0]["message"]


def test_finite_check_flags_every_dtype_and_leaves_the_bits_alone() -> None:
    """The shared check (GradScaler's kernel at scale 1): inf and NaN found in any tensor
    of any float dtype, values (-0.0, subnormals, NaN payloads aside) bit-identical."""
    from fastreduce.grads import FiniteCheck

    check = FiniteCheck(torch.device("cpu"))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        good = [torch.tensor([0.0, -0.0, 1e-40, -3.5, 65504.0]).to(dtype), torch.randn(1000).to(dtype)]
        before = [t.clone() for t in good]
        assert check(good) and all(torch.equal(a.view(torch.int8), b.view(torch.int8)) for a, b in zip(good, before))
        for bad in (math.nan, math.inf, -math.inf):
            spoiled = [good[0], good[1].clone()]
            spoiled[1][7] = bad
            assert not check(spoiled), (dtype, bad)
        assert check(good), dtype  # the flag is reset by each check


@pytest.mark.parametrize("build", ["zero", "gossip", "local", "diloco"])
def test_every_mode_refuses_a_bad_setting_before_anything_else(build: str) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    make = {"zero": lambda: fastreduce.ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, nonfinite="warn"),
            "gossip": lambda: fastreduce.DecentralizedDataParallel(model, lambda named: opt, nonfinite="warn"),
            "local": lambda: fastreduce.LocalSGD(model, opt, sync_every=2, nonfinite="warn"),
            "diloco": lambda: fastreduce.DiLoCo(model, opt, torch.optim.SGD(model.parameters(), lr=0.7), 2,
                                                nonfinite="warn")}[build]
    before = _params(model)
    with pytest.raises(ValueError, match="nonfinite must be 'ignore', 'raise' or 'skip', got 'warn'"):
        make()
    assert _same(before, _params(model))


# ====================================================================== state kept between steps
#
# A reducer that keeps state between steps (the wire cast's or a quantized wire's
# error-feedback residuals; PowerSGD's Q, residuals and step count) skips (or raises at) a
# step with one rank's NaN, beside a reducer of the same settings that never sees that step:
# every later step gives the same gradients, bit for bit (the state is as before the bad step).

RANK2 = {"rank": 2, "min_compression_rate": 0}
STATEFUL = {"bf16-ef": {"wire_dtype": torch.bfloat16, "error_feedback": True},
            "int8-ef": {"wire_dtype": "int8", "error_feedback": True},
            "powersgd": {"compression": fastreduce.PowerSGD(**RANK2)},
            "powersgd-noef": {"compression": fastreduce.PowerSGD(**RANK2, error_feedback=False)},
            # compressing from the step after the bad one, if a skipped step is not counted
            "powersgd-warmup": {"compression": fastreduce.PowerSGD(**RANK2, warmup_steps=BAD_STEP + 1)}}
STATE_CASES = [(n, m, o) for n in STATEFUL for m in ("skip", "raise") for o in (False, True)]


def stateful_case(rank: int, world: int, name: str, mode: str, overlap: bool) -> dict:
    settings = dict(STATEFUL[name], overlap=overlap, bucket_mb=0.0002 if overlap else None)
    if "compression" in settings:
        settings["wire_dtype"] = torch.float32
    model, ref = _model(), _model()
    reducer = fastreduce.FusedReducer(model, nonfinite=mode, **settings)
    ref_reducer = fastreduce.FusedReducer(ref, **settings)  # the reference: never sees the bad step
    out: dict = {"verdicts": [], "same": []}
    for step in range(STEPS):
        x = _x(rank, step)
        model.zero_grad()
        handle = _spoil(model, rank, step, "nan")
        model(x).pow(2).mean().backward()
        if handle is not None:
            handle.remove()
        if step == BAD_STEP and mode == "raise":
            out["error"] = expect_raises(fastreduce.NonFiniteGradError, reducer.reduce)
        else:
            out["verdicts"].append(reducer.reduce())
        if step == BAD_STEP:
            continue
        ref.zero_grad()
        ref(x).pow(2).mean().backward()
        ref_reducer.reduce()
        out["same"].append(all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())))
    return out


# Under the default nonfinite="ignore" a GradScaler decides: one rank's overflow makes every
# rank skip that step, as under DDP, and only that step. A block codec spreads the inf over
# its block, the wire's padding and alignment gaps too; kept there (or in an error-feedback
# residual as inf - inf), it made every later mean NaN: the scaler skipped every step after.
SCALER_WIRES = {"bf16-ef": {"wire_dtype": torch.bfloat16, "error_feedback": True},
                "int8": {"wire_dtype": "int8"}, "int8-ef": {"wire_dtype": "int8", "error_feedback": True},
                "fp8": {"wire_dtype": torch.float8_e4m3fn}}
SCALER_CASES = [(n, o, t) for n in SCALER_WIRES for o in (False, True) for t in ("shm", "process_group")]


def scaler_skips(rank: int, model: nn.Module, reduce: Callable[[], Any], forward: nn.Module | None = None) -> list[bool]:
    """Which steps a GradScaler (SGD) skipped, rank 1's gradient overflowing at BAD_STEP
    (``forward``: what runs the model, DDP's wrapper)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    skipped = []
    for step in range(STEPS):
        handle = model.weight.register_hook(lambda g: g.index_fill(1, torch.tensor([0]), math.inf)) \
            if rank == 1 and step == BAD_STEP else None  # (in the block the wire's padding is in)
        scaler.scale((forward or model)(_x(rank, step)).pow(2).mean()).backward()
        if handle is not None:
            handle.remove()
        reduce()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        skipped.append(scaler.get_scale() < before)
    return skipped


def scaler_case(rank: int, world: int, name: str, overlap: bool, transport: str, ref_group: Any) -> dict:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    ref = copy.deepcopy(model)
    reducer = fastreduce.FusedReducer(model, **SCALER_WIRES[name], overlap=overlap, transport=transport,
                                      bucket_mb=0.0002 if overlap else None)
    ddp = nn.parallel.DistributedDataParallel(ref, process_group=ref_group)
    return {"skipped": scaler_skips(rank, model, reducer.reduce), "ddp": scaler_skips(rank, ref, lambda: None, ddp)}


def stateful_worker(rank: int, world: int) -> dict:
    ref_group = dist.new_group(backend="gloo")
    out = {c: guarded(stateful_case, rank, world, *c) for c in STATE_CASES}
    out.update({("scaler", *c): guarded(scaler_case, rank, world, *c, ref_group) for c in SCALER_CASES})
    return out


@pytest.fixture(scope="module")
def stateful_results() -> list[dict]:
    return run_ranks(stateful_worker, 2, timeout=240)


@pytest.mark.parametrize("name,mode,overlap", STATE_CASES,
                         ids=[f"{n}-{m}-{'overlap' if o else 'fused'}" for n, m, o in STATE_CASES])
def test_a_skipped_step_leaves_the_state_as_before_it(stateful_results, name: str, mode: str, overlap: bool) -> None:
    """The residuals and PowerSGD's Q were updated before the verdict: one NaN poisoned them,
    and every later step was skipped too."""
    for rank, out in enumerate(per_rank(stateful_results, (name, mode, overlap))):
        if mode == "raise":
            assert out["error"]["raised"] == "NonFiniteGradError", (rank, out)
            assert out["verdicts"] == [True] * (STEPS - 1), (rank, out)
        else:
            assert out["verdicts"] == [s != BAD_STEP for s in range(STEPS)], (rank, out)
        assert out["same"] == [True] * (STEPS - 1), (rank, out)  # as a run that never saw the step


@pytest.mark.parametrize("name,overlap,transport", SCALER_CASES,
                         ids=[f"{n}-{'overlap' if o else 'fused'}-{t}" for n, o, t in SCALER_CASES])
def test_a_grad_scaler_skips_the_overflow_step_and_only_it_as_under_ddp(stateful_results, name: str, overlap: bool,
                                                                        transport: str) -> None:
    for rank, out in enumerate(per_rank(stateful_results, ("scaler", name, overlap, transport))):
        assert out["ddp"] == [s == BAD_STEP for s in range(STEPS)], (rank, out)  # (the reference's)
        assert out["skipped"] == out["ddp"], (rank, out)



# ====================================================================== a local mode's state kept between syncs
#
# LocalSGD and DiLoCo with state between syncs (a quantized wire's error-feedback residuals,
# SparseLoCo's accumulator) skip (or raise at) a sync whose average holds rank 1's inf, beside
# a mode of the same settings that never sees the steps since the last sync: every rank
# returns to the last synced parameters, and every later step gives the same parameters and
# state, bit for bit (the state is as after the last sync that stood).

SYNC_STATEFUL = {"int8-ef": {"wire_dtype": "int8", "error_feedback": True},
                 "sparseloco": {"compression": fastreduce.SparseLoCo()}}
SYNC_STATE_CASES = [(k, n, m) for k in ("diloco", "localsgd") for n in SYNC_STATEFUL for m in ("skip", "raise")]
SYNC_STATE_STEPS = 8  # syncs after steps 1, 3, 5, 7; the one after SYNC_STEP (3) sees the inf


def sync_state_case(rank: int, world: int, kind: str, name: str, mode: str) -> dict:
    def build(model: nn.Module, nonfinite: str, spoil: bool) -> tuple[torch.optim.Optimizer, Any]:
        inner = torch.optim.SGD(model.parameters(), lr=0.1)  # no state: the skipped steps leave none behind
        if spoil:  # (its post-hook before the mode's)
            _corrupt_before_sync(model, inner, rank, "inf")
        if kind == "diloco":
            outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9)
            return inner, fastreduce.DiLoCo(model, inner, outer, 2, nonfinite=nonfinite, **SYNC_STATEFUL[name])
        return inner, fastreduce.LocalSGD(model, inner, 2, nonfinite=nonfinite, **SYNC_STATEFUL[name])

    def state(m: Any) -> dict:
        return {k: v for k, v in m.state_dict().items() if k in ("params", "anchor", "wire_residuals", "sparse")}

    model, ref = _model(), _model()
    opt, local = build(model, mode, True)
    ref_opt, ref_local = build(ref, "ignore", False)  # the reference: never sees the steps before the bad sync
    out: dict = {"same": []}
    for step in range(SYNC_STATE_STEPS):
        x = _x(rank, step)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        if step == SYNC_STEP and mode == "raise":
            out["error"] = expect_raises(fastreduce.NonFiniteGradError, opt.step)
        else:
            opt.step()
        if step in (SYNC_STEP - 1, SYNC_STEP):
            continue
        ref_opt.zero_grad()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
        out["same"].append(_same(_params(model), _params(ref)))
    out["same_state"] = same_state(state(local), state(ref_local))
    out["counted"] = (local.skipped_syncs, local.syncs)
    local.close()
    ref_local.close()
    return out


def sync_state_worker(rank: int, world: int) -> dict:
    return {c: guarded(sync_state_case, rank, world, *c) for c in SYNC_STATE_CASES}


@pytest.fixture(scope="module")
def sync_state_results() -> list[dict]:
    return run_ranks(sync_state_worker, 2, timeout=240)


@pytest.mark.parametrize("kind,name,mode", SYNC_STATE_CASES, ids=["-".join(c) for c in SYNC_STATE_CASES])
def test_a_skipped_sync_leaves_the_codecs_state_as_before_it(sync_state_results, kind: str, name: str,
                                                              mode: str) -> None:
    """The residuals and accumulators took the inf before the verdict: every later sync was
    skipped too, and the ranks never averaged again."""
    for rank, out in enumerate(per_rank(sync_state_results, (kind, name, mode))):
        if mode == "raise":
            assert out["error"]["raised"] == "NonFiniteGradError", (rank, out)
        assert out["counted"] == (1, 3), (rank, out)
        assert out["same"] == [True] * (SYNC_STATE_STEPS - 2) and out["same_state"], (rank, out)

