"""``bucket_mb="auto"`` (fastreduce/sizing.py): the model's choice against hand-worked
cases, and the overlapped mode on real 2-rank Gloo groups: the sizes agreed by every
rank, one bucket on shared memory, the re-lay after the refresh, the average still
``dist.all_reduce``'s mean throughout."""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fastreduce
from fastreduce import sizing
from fastreduce.launch import run_ranks
from fastreduce.optim_kernels import fused_if_possible
from fastreduce.sizing import MB, Link, Sizing, choose

pytestmark = pytest.mark.timeout(300)
STEPS = 12  # the refresh comes after AutoSizer.REFRESH_AFTER (8) steps


# ============================================================== the model, by hand

def test_two_buckets_beat_one_where_the_hand_count_says() -> None:
    """2 MB of gradients over a 100 ms backward, 10 ms + 10 MB/s a collective.
    One bucket: ready at 100 ms, on the wire 10 + 200 ms: 210 ms left after backward.
    Two of 1 MB: the first ready at 50 ms, done at 160; the second ready at 100, starts
    at 160, done at 270: 170 ms left. The grid's other pairs are one of these two."""
    out = choose(2 * MB, 0.1, Link(0.01, 10 * MB))
    assert (out.bucket_mb, out.first_bucket_mb, out.buckets) == (1.0, 1.0, 2)
    assert out.exposed_s == pytest.approx(0.17)
    one = choose(2 * MB, 0.0, Link(0.01, 10 * MB))  # no backward to hide under: one launch
    assert (one.buckets, one.exposed_s) == (1, pytest.approx(0.21))


def test_slow_link_starts_early_in_buckets_no_longer_than_the_backward_allows() -> None:
    """100 Mbit/s (12.5 MB/s), 8.4 MB, a 60 ms backward: the wire is the step, and the model
    counts a small first bucket and any layout after it within 2% of each other. Every
    bucket is longer on the wire than the backward (1 MB: 84 ms), so the smallest win:
    one large message no longer paces the step (the rule measured in the module doc)."""
    out = choose(int(8.4 * MB), 0.06, Link(3e-4, 12.5e6))
    assert (out.first_bucket_mb, out.bucket_mb) == (1.0, 1.0), out
    single = 3e-4 + 8.4 * MB / 12.5e6
    assert out.exposed_s < single - 0.04  # most of the backward hidden
    assert "100 ms" not in out.why and "60 ms" in out.why


def test_the_fewest_buckets_that_each_fit_in_a_backward() -> None:
    """1 Gbit/s-like (140 MB/s, 4 ms a launch), 8 MB, a 40 ms backward: of the layouts within
    2% of the cheapest, the fewest whose buckets each take at most the backward on the wire
    (4 MB: 34 ms); the smallest-first rule of slow links does not apply here."""
    link = Link(4e-3, 140 * MB)
    out = choose(8 * MB, 0.04, link)
    assert link.seconds(out.bucket_mb * MB) <= 0.04 and out.buckets == 3, out
    assert (out.bucket_mb, out.first_bucket_mb) == (4.0, 2.0), out


def test_fast_link_with_a_long_backward_leaves_only_a_small_last_bucket() -> None:
    out = choose(64 * MB, 1.0, Link(1e-4, 10e9))
    assert out.buckets > 1 and out.exposed_s < 1e-3, out


def test_shared_memory_is_one_bucket() -> None:
    out = sizing.shared_memory(8 * MB)
    assert out.buckets == 1 and "shared memory" in out.describe()


@pytest.mark.parametrize("bad", [0, -1, "big", True, float("nan"), float("inf")])
def test_bad_bucket_mb_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="bucket_mb must be a positive (finite )?number of megabytes or 'auto'"):
        fastreduce.ReducerConfig(overlap=True, bucket_mb=bad)


# ============================================================== real groups

def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])


def twin_error(model: nn.Module, twin: nn.Module, x: torch.Tensor, world: int) -> float:
    """The largest difference of ``model``'s averaged grads from ``twin``'s through
    ``dist.all_reduce`` on the same input."""
    twin(x).square().mean().backward()
    for p in twin.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    return max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), twin.parameters()))


def train(rank: int, world: int, transport: str, slow_rank: int | None = None,
          force: str | None = None, bucket_mb: float | str = "auto") -> dict[str, Any]:
    """STEPS overlapped steps (fp32 wire); each step's averaged grads against the mean
    of a twin model's grads through dist.all_reduce. ``slow_rank`` sleeps 30 ms in its
    backward (its backward time is the one agreed); ``force`` makes the refresh choose
    a bucket per layer ("relay") or one bucket ("one")."""
    model, twin = make_model(), make_model()
    if slow_rank == rank:
        model[3].weight.register_hook(lambda g: time.sleep(0.03) or g)
    choices: list[Sizing] = []
    real_choose = sizing.choose

    def choose(wire_bytes: int, backward_s: float, link: Link) -> Sizing:
        out = real_choose(wire_bytes, backward_s, link)
        if force == "relay" and choices:  # the refresh: a bucket per 256 KB layer
            out = Sizing(0.2, 0.2, 8, "forced by the test", link, backward_s, 0.0)
        elif force == "one" and choices:
            out = Sizing(wire_bytes / 2**20, wire_bytes / 2**20, 1, "forced by the test", link, backward_s, 0.0)
        choices.append(out)
        return out

    probes = []
    real_probe = sizing.probe_link

    def probe_link(group: Any, device: torch.device) -> Link:
        probes.append(real_probe(group, device))
        return probes[-1]

    with mock.patch.object(sizing, "choose", choose), mock.patch.object(sizing, "probe_link", probe_link):
        reducer = fastreduce.FusedReducer(model, overlap=True, wire_dtype=torch.float32, transport=transport,
                                          bucket_mb=bucket_mb)
        errors, buckets, launched = [], [], []
        for step in range(STEPS + 2):
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(32, 256, generator=g)
            model(x).square().mean().backward()
            reducer.reduce()
            errors.append(twin_error(model, twin, x, world))
            buckets.append(reducer.num_buckets)
            launched.append(reducer.stats.launched_in_backward)
            model.zero_grad(set_to_none=False)
            twin.zero_grad(set_to_none=True)
    s = reducer.stats.sizing
    return {"errors": errors, "buckets": buckets, "launched": launched, "sizing": None if s is None else (s.bucket_mb, s.first_bucket_mb,
            s.buckets, s.backward_s, s.link), "why": s and s.why, "choices": len(choices), "probes": len(probes)}


def test_process_group_sizes_are_agreed_and_the_mean_is_exact() -> None:
    ranks = run_ranks(train, 2, "process_group", 1)
    assert ranks[0]["sizing"] == ranks[1]["sizing"], "the ranks chose different buckets"
    assert ranks[0]["buckets"] == ranks[1]["buckets"]
    backward_s = ranks[0]["sizing"][3]
    assert backward_s >= 0.03, f"the agreed backward ({backward_s}) is not the slow rank's"
    assert "MB/s per all-reduce" in ranks[0]["why"]
    assert ranks[0]["choices"] == 2  # at the build and at the refresh, never again
    assert ranks[0]["probes"] == ranks[1]["probes"] == 2  # the link too: the first probe reads the first step's costs
    for out in ranks:
        assert max(out["errors"]) <= 1e-6, out["errors"]


def test_shared_memory_takes_one_bucket() -> None:
    """One bucket, run as the fused mode's collective after backward: nothing launched
    from a gradient hook (overlap on shared memory takes from the backward what it hides)."""
    for out in run_ranks(train, 2, "shm"):
        assert out["buckets"][1:] == [1] * (STEPS + 1)
        assert "shared memory" in out["why"] and out["choices"] == out["probes"] == 0
        assert out["launched"] == [0] * (STEPS + 2), out["launched"]
        assert max(out["errors"]) <= 1e-6


def test_one_bucket_chosen_again_is_sent_as_the_fused_collective() -> None:
    """A refresh that chooses one bucket over a process group: the mode builds again and
    sends it after backward as the fused mode does (no bucket launched in backward from
    then on); every step's mean is exact."""
    for out in run_ranks(train, 2, "process_group", None, "one"):
        assert out["sizing"][2] == 1 and out["buckets"][-3:] == [1, 1, 1]
        launched = out["launched"]
        assert launched[-1] == launched[-4], launched  # the last steps launched nothing in backward
        assert max(out["errors"]) <= 1e-6, out["errors"]


def test_the_refresh_lays_the_buckets_out_again() -> None:
    """A refresh that chooses other sizes: the next step learns the layout again (no
    overlap in it), the steps after use the new buckets; every step's mean is exact."""
    for out in run_ranks(train, 2, "process_group", None, "relay"):
        assert out["buckets"][-1] == 8 and out["buckets"][1] != 8, out["buckets"]
        assert out["sizing"][:2] == (0.2, 0.2)
        assert max(out["errors"]) <= 1e-6, out["errors"]


def test_a_given_bucket_mb_is_kept() -> None:
    for out in run_ranks(train, 2, "process_group", None, None, 0.2):
        assert out["sizing"] is None and out["choices"] == 0
        assert out["buckets"][1:] == [8] * (STEPS + 1)


# ============================================================== ZeRO: chosen when built

WIDE_LAYERS = 16  # 16 x Linear(256, 256): 4.1 MB of fp32 gradients, two of ZeRO's 2 MB buckets on shared memory


def zero_sizing(rank: int, world: int, transport: str, bucket_mb: float | str) -> dict[str, Any]:
    model = make_model()
    opt = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, transport=transport,
                                   bucket_mb=bucket_mb)
    s = opt.sizing
    out = {"sizing": None if s is None else (s.bucket_mb, s.first_bucket_mb, s.buckets, s.link),
           "why": s and s.describe(), "buckets": opt.num_buckets}
    if bucket_mb == "auto":
        out["wide"] = zero_wide(rank, world, transport)
        out["wide_module"] = zero_wide(rank, world, transport, module=True)
    return out


def zero_wide(rank: int, world: int, transport: str, module: bool = False) -> dict[str, Any]:
    """ZeRO at its defaults on a model wider than one shared-memory bucket, three steps
    (``zero_grad()``: fresh gradients each backward) against a twin's AdamW (the same kernel
    as the shard's) on its gradients averaged through ``dist.all_reduce``; ``module``: built
    with ``module=model`` (the gradients re-attached as views before each forward)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(WIDE_LAYERS)])
    twin = copy.deepcopy(model)
    opt = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, transport=transport,
                                   module=model if module else None)
    params = list(twin.parameters())
    ref = torch.optim.AdamW(params, lr=1e-3, **fused_if_possible(torch.optim.AdamW, params, {}))
    equal = []
    for step in range(3):
        x = torch.randn(32, 256, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        opt.wait_params()
        twin(x).square().mean().backward()
        for p in twin.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        ref.step()
        ref.zero_grad()
        equal.append(all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters())))
    s = opt.sizing
    return {"buckets": opt.num_buckets, "modelled": s and s.buckets, "why": s and s.describe(), "equal": equal}


@pytest.fixture(scope="module", params=["shm", "process_group"])
def zero_auto(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    """ZeRO at ``bucket_mb="auto"`` on 2 ranks of each transport (one spawn each)."""
    return request.param, run_ranks(zero_sizing, 2, request.param, "auto")


def test_zero_sizes_its_buckets_when_built(zero_auto: tuple[str, list[dict[str, Any]]]) -> None:
    transport, ranks = zero_auto
    assert ranks[0] == ranks[1], "the ranks chose different buckets"
    if transport == "shm":  # make_model's 2.1 MB: under 1.5 of ZeRO's buckets there
        assert ranks[0]["buckets"] == 1 and "shared memory" in ranks[0]["why"]
    else:
        assert "MB/s per all-reduce" in ranks[0]["why"] and ranks[0]["sizing"][2] >= 1
    for out in run_ranks(zero_sizing, 2, transport, 0.2):  # a number is kept: a bucket per 256 KB layer
        assert out["sizing"] is None and out["buckets"] == 8


def wide_runs(zero_auto: tuple[str, list[dict[str, Any]]], key: str) -> tuple[str, list[dict[str, Any]]]:
    """The transport and each rank's ``key`` run of :func:`zero_wide`, the ranks' choices agreed."""
    transport, ranks = zero_auto
    wide = [r[key] for r in ranks]
    assert wide[0]["buckets"] == wide[1]["buckets"] and wide[0]["why"] == wide[1]["why"]
    return transport, wide


def test_zero_cuts_a_wide_model_on_shared_memory_and_steps_as_the_reference(
        zero_auto: tuple[str, list[dict[str, Any]]]) -> None:
    """Without ``module=``, ZeRO's "auto" on shared memory is not one bucket: 4.1 MB of
    gradients go in 2 MB buckets (so that the ones ``zero_grad()`` set to None are freed
    during backward, not page-faulted in again every step; fastreduce/modes/zero_config.py),
    and the parameters stay bit for bit those of AdamW on the ``dist.all_reduce`` mean."""
    transport, wide = wide_runs(zero_auto, "wide")
    if transport == "shm":
        assert wide[0]["buckets"] == wide[0]["modelled"] == 2, wide[0]
        assert "buckets of 2 MB" in wide[0]["why"] and "shared memory" in wide[0]["why"], wide[0]["why"]
    for out in wide:
        assert out["equal"] == [True] * 3, out


def test_zero_with_module_keeps_one_bucket_on_shared_memory_and_steps_as_the_reference(
        zero_auto: tuple[str, list[dict[str, Any]]]) -> None:
    """With ``module=`` the gradients ``zero_grad()`` set to None come back as views of the
    flat buffer before each forward, so backward allocates none and "auto" on shared memory
    is one bucket (one reduce-scatter and one all-gather), still bit for bit AdamW on the
    ``dist.all_reduce`` mean; over a process group the link's probe decides, as without it."""
    transport, wide = wide_runs(zero_auto, "wide_module")
    if transport == "shm":
        assert wide[0]["buckets"] == wide[0]["modelled"] == 1, wide[0]
        assert "module=" in wide[0]["why"] and "shared memory" in wide[0]["why"], wide[0]["why"]
    else:  # the link's probe decides, as without module=
        assert "MB/s per all-reduce" in wide[0]["why"], wide[0]["why"]
    for out in wide:
        assert out["equal"] == [True] * 3, out


def test_first_bucket_has_its_own_limit() -> None:
    from fastreduce.layout import bucket_runs
    named = [(str(k), nn.Parameter(torch.zeros(100))) for k in range(6)]
    assert bucket_runs(named, [0] * 6, 300) == [[0, 1, 2], [3, 4, 5]]
    assert bucket_runs(named, [0] * 6, 300, first_limit=100) == [[0], [1, 2, 3], [4, 5]]


def test_zero_size_parameters_make_no_bucket_of_their_own() -> None:
    """They join the next run of their dtype, or the one before them when left over at the end;
    alone in their dtype they stay one (tests/test_quantized_overlap.py runs that)."""
    from fastreduce.layout import bucket_runs
    sizes = [300, 0, 0, 300, 0]
    named = [(str(k), nn.Parameter(torch.zeros(n))) for k, n in enumerate(sizes)]
    assert bucket_runs(named, [0] * 5, 300) == [[0], [1, 2, 3, 4]]
    assert bucket_runs(named, [0] * 5, 0) == [[0], [1, 2, 3, 4]]  # (a limit of 0: one run per parameter)
    named.append(("5", nn.Parameter(torch.zeros(0, dtype=torch.bfloat16))))
    assert bucket_runs(named, [0] * 6, 300) == [[0], [1, 2, 3, 4], [5]]


# ============================================================== compiled

def compiled_steps(rank: int, world: int, segment: bool) -> dict[str, Any]:
    """``torch.compile(model)`` and the overlapped mode, STEPS + 2 steps: over the process
    group (``segment=True``), or at ``transport="auto"`` on CPU ranks whose shared-memory
    segment does not open, as on several hosts (``ShmAllReduce.open`` answers that on
    every rank; the averaging is the process group's, for real): that first step runs
    uncut, expecting shared memory, and its compiled backward hands every gradient over
    at its end. Each step's mean is checked against ``dist.all_reduce``'s of an eager
    twin; the last step records the order the gradients arrived in."""
    from fastreduce import compiling
    from fastreduce.comm.shm import ShmAllReduce

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])  # 8 MB: pieces of several buckets at Gloo's 6
    twin = copy.deepcopy(model)
    run = torch.compile(model, backend="aot_eager")
    walls, errors, cut, arrived = [], [], [], []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(arrived.append)
    no_segment = mock.patch.object(ShmAllReduce, "open", classmethod(lambda cls, *a, **k: None))
    with no_segment if not segment else contextlib.nullcontext():
        reducer = fastreduce.FusedReducer(run, overlap=True, wire_dtype=torch.float32,
                                          transport="process_group" if segment else "auto")
        for step in range(STEPS + 2):
            x = torch.randn(128, 512, generator=torch.Generator().manual_seed(100 * step + rank))
            loss = run(x).square().mean()
            arrived.clear()
            t0 = time.perf_counter()
            loss.backward()
            walls.append(time.perf_counter() - t0)
            reducer.reduce()
            cut.append(id(reducer) in compiling._CUT.owners)
            errors.append(twin_error(model, twin, x, world))
            model.zero_grad(set_to_none=False)
            twin.zero_grad(set_to_none=True)
    schedule = reducer._built.schedule
    slot = {id(p): i for i, p in enumerate(schedule.layout.params)}
    s = reducer.stats.sizing
    return {"cut": cut, "errors": errors, "backward_s": s.backward_s, "wall_s": sorted(walls)[len(walls) // 2],
            "why": s.why, "refreshed": reducer._sizer.refreshed, "buckets": len(schedule.buckets),
            "arrival": [schedule.bucket_of[slot[id(p)]] for p in arrived]}


@pytest.mark.parametrize("segment", [True, False], ids=["process_group", "no_segment"])
def test_compiled_buckets_follow_the_compiled_pieces(segment: bool) -> None:
    """Each bucket holds the gradients of consecutive compiled pieces: in the last step
    the gradients arrive bucket after bucket (the layout was learned again on a step of
    the pieces the choice cut; laid out in an earlier cut's order, a bucket mixed pieces
    and waited for the last, and the buckets launched together at the end). Without a
    segment the graphs stay cut from the first choice on, whatever it was, so the refresh
    measured a backward that handed its gradients over as it ran (it read ~0, every
    step: one bucket, no overlap, for good)."""
    for out in run_ranks(compiled_steps, 2, segment):
        assert out["refreshed"] and "MB/s per all-reduce" in out["why"]
        assert max(out["errors"]) <= 1e-6, out["errors"]
        assert out["arrival"] == sorted(out["arrival"]), out["arrival"]
        if not segment:
            assert all(out["cut"][:sizing.AutoSizer.REFRESH_AFTER]), out["cut"]  # until the refresh lays out again
            assert out["backward_s"] >= 0.1 * out["wall_s"], (out["backward_s"], out["wall_s"])  # ~1% when uncut
