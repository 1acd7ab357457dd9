"""The shared-memory transport (:mod:`fastreduce.comm.shm`) on real Gloo process groups.

Same structure as test_fused.py, whose helpers it reuses: the module-scoped ``group``
fixture spawns one group per world size (2, 3, 4) and runs every sub-case of that size
in it through ``guarded``; the tests assert on the returned per-rank results, here.

* every world: ShmAllReduce itself (fp32, bf16, fp16; odd slices, FIFO, bounds, errors);
* worlds 2 and 3: the worker's arithmetic allocates nothing and does not grow with size;
* world 2: open() falling back, the transport setting, shm vs process group through a
  FusedReducer (fused and overlapped), two reducers sharing one worker;
* world 4: reducers on two disjoint subgroups.

References are fp64 means from a real ``dist.all_reduce``. Errors are measured per
element against its *scale*, its largest |value| over the ranks (a mean can cancel to
~0). A bf16/fp16 mean may be off by two roundings (packing into the wire, averaging):
2u per unit of scale, u = eps/2 the unit roundoff (2**-8 for bf16, 2**-11 for fp16).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from datetime import timedelta
from typing import Any, NamedTuple
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import fastreduce
import fastreduce.comm.shm
from fastreduce.launch import run_ranks
from fastreduce.comm.shm import ShmAllReduce

from models import batch_for, batchnorm_model, linear_stack, loss_of, many_tensor_model
from test_fused import (ALLOCATING_OPS, SEED, OpRecorder, changed_since, expect_raises, grads_of, guarded,
                        per_rank, reducer_of, snapshot)

SPAWN_TIMEOUT = 90.0  # per spawned group; each finishes in a few seconds
STEPS = 3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
U = {name: torch.finfo(dt).eps / 2 for name, dt in DTYPES.items()}  # unit roundoff
REL_TOL = {"fp32": 1e-6, "bf16": 2.5 * U["bf16"], "fp16": 2.5 * U["fp16"]}  # two roundings, x1.25
REGION_BYTES = 1 << 19  # the direct cases' region: 131072 fp32 elements
BUCKET_MB = 4096 / 2**20  # ~10 buckets of ManyTensorModel's fp32 grads
# (slices or the whole region; the last rank writes late, with no barrier before start)
ROUNDS = (("slices", False), ("slices", True), ("whole", False))

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")]


# ============================================================== helpers run in ranks

def shm_dir(path: str):
    return mock.patch.object(fastreduce.comm.shm, "SHM_DIR", path)


def transport_env(value: str):
    return mock.patch.dict(os.environ, {"FASTREDUCE_TRANSPORT": value})


def leftovers(path: str) -> list[str]:
    return sorted(f for f in os.listdir(path) if f.startswith("fastreduce-")) if os.path.isdir(path) else []


def mean_and_scale(grads: dict[str, torch.Tensor], group=None) -> tuple[dict, dict]:
    """Per tensor: the fp64 mean over ``group`` (a real all-reduce) and the per-element
    largest |value| over its ranks."""
    flat = torch.cat([g.double().flatten() for g in grads.values()])
    mean, scale = flat.clone(), flat.abs()
    dist.all_reduce(mean, group=group)
    dist.all_reduce(scale, op=dist.ReduceOp.MAX, group=group)
    sizes = [g.numel() for g in grads.values()]
    unflat = lambda t: {n: p.view(g.shape) for (n, g), p in zip(grads.items(), t.split(sizes))}  # noqa: E731
    return unflat(mean / dist.get_world_size(group)), unflat(scale)


def local_grads(plain: torch.nn.Module, inputs: tuple) -> dict[str, torch.Tensor]:
    """This rank's own grads of ``inputs``, on a copy of the model no reducer touches."""
    plain.zero_grad(set_to_none=True)
    loss_of(plain, inputs).backward()
    return grads_of(plain)


def slices_for(world: int) -> list[tuple[int, int]]:
    """(offset, numel) at odd offsets with gaps: 1 element, fewer than ranks, 63, a few
    64-element chunks and a remainder, ~1e5."""
    out, off = [], 3
    for n in (1, world - 1, 63, 64 * world + 5, 100_003):
        out.append((off, n))
        off = (off + n + 4) | 1
    return out


def data_for(world: int, name: str, rnd: int, rank: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s values in round ``rnd`` (any rank can regenerate them): random signs,
    |v| in [0.5, 1.5) * 2**[-6, 6] times a per-rank scale 4**(rank - 1)."""
    g = torch.Generator().manual_seed(1000 * world + 100 * rnd + 10 * list(DTYPES).index(name) + rank)
    mag = torch.rand(numel, generator=g, dtype=torch.float64) + 0.5
    mag *= 2.0 ** torch.randint(-6, 7, (numel,), generator=g)
    sign = torch.randint(0, 2, (numel,), generator=g) * 2 - 1
    return (mag * sign * 4.0 ** (rank - 1)).to(DTYPES[name])


def reference_mean(local: list[torch.Tensor], spans: list[tuple[int, int]]) -> torch.Tensor:
    """The documented arithmetic, from every rank's values: at 2 ranks a real Gloo
    all-reduce (sum, then halved: exact), in the wire dtype (fp16 in fp32, which cannot
    overflow); at more, chunk r of each slice (``spans``, cut as the transport cuts it)
    summed in fp32 (or the wire's wider dtype) in ``sum_order`` (ranks r + 1, ..., r: a
    ring's), one rounding per addition, divided once by the world size, then rounded to
    the wire."""
    world, dtype = len(local), local[0].dtype
    if world == 2 and dtype != torch.float16:
        total = local[dist.get_rank()].clone()
        dist.all_reduce(total)
        return total / 2
    out = local[0].clone()
    for o, n in spans:
        edges = fastreduce.comm.shm._bounds(n, world)
        for r in range(world):
            part = slice(o + edges[r], o + edges[r + 1])
            order = fastreduce.comm.shm.sum_order(r, world)
            acc = local[order[0]][part].to(torch.promote_types(dtype, torch.float32))
            for k in order[1:]:
                acc = acc + local[k][part].to(acc.dtype)
            out[part] = (acc / world).to(dtype)
    return out


def start_error(shm: ShmAllReduce, buf: torch.Tensor) -> dict:
    """start(buf), expecting ValueError; a job queued anyway is waited for (every rank
    queued it alike), so the group stays in step."""
    before = shm.started
    try:
        work = shm.start(buf)
    except ValueError as e:
        return {"raised": True, "message": str(e), "queued": shm.started - before}
    work.wait()
    return {"raised": False, "message": "", "queued": shm.started - before}


def direct_case(rank: int, world: int, name: str, private: str) -> dict:
    """ShmAllReduce alone: ROUNDS of fill, start slices back to back, wait, measure; then
    the start()/region() errors. Returns per-round summaries (see the tests)."""
    dtype, u = DTYPES[name], U[name]
    floor = torch.finfo(dtype).smallest_normal * u  # rounding error bound among subnormals
    with shm_dir(private):
        shm = ShmAllReduce.open(None, REGION_BYTES, required=True)
    numel = shm.region_bytes // dtype.itemsize
    region = shm.region(dtype, numel)
    out: dict[str, Any] = {"fresh_zeros": all(int(r.count_nonzero()) == 0 for r in shm.regions), "rounds": []}
    dist.barrier()  # every rank has looked at the fresh regions before anyone writes
    out["left"] = leftovers(private)
    for rnd, (kind, late) in enumerate(ROUNDS):
        local = [data_for(world, name, rnd, k, numel) for k in range(world)]
        if late and rank == world - 1:
            time.sleep(0.2)  # the others start first: only barrier A holds them back
        region.copy_(local[rank])
        seen = None
        if not late:
            dist.barrier()  # every region written: read them all before any reduction
            seen = [torch.equal(shm.regions[k], local[k].view(torch.uint8)) for k in range(world)]
        spans = [(0, numel)] if kind == "whole" else slices_for(world)
        started = shm.started
        works = [shm.start(region[o:o + n]) for o, n in spans]  # back to back, before any wait
        works[-1].wait()
        fifo = all(w.done.is_set() for w in works)
        for w in reversed(works):
            w.wait()
        after = region.clone()  # at once: every rank's pushes must have landed by now
        mean, scale = (d["r"] for d in mean_and_scale({"r": local[rank]}))
        exact = reference_mean(local, spans)
        inside = torch.zeros(numel, dtype=torch.bool)
        ratio, excess = [], []
        for o, n in spans:
            inside[o:o + n] = True
            err, s = (after[o:o + n].double() - mean[o:o + n]).abs(), scale[o:o + n]
            ratio.append((err / s).max().item())
            excess.append(((err - u * mean[o:o + n].abs() - floor) / s).max().item())
        out["rounds"].append({
            "exact": [int((after[o:o + n].view(-1, 1).view(torch.uint8) != exact[o:o + n].view(-1, 1)
                           .view(torch.uint8)).any(1).sum()) for o, n in spans],
            "seen": seen, "queued": shm.started - started, "count": len(spans), "fifo": fifo,
            "ratio": ratio, "excess": excess, "untouched": torch.equal(after[~inside], local[rank][~inside]),
            "digest": hashlib.sha256(after[inside].view(torch.uint8).numpy().tobytes()).hexdigest()})
    mine = shm.regions[rank].view(dtype)  # a window over my region's end
    edge = mine.storage_offset() + mine.numel() - 32
    o, n = slices_for(world)[2]
    out["errors"] = {
        "fresh tensor": start_error(shm, torch.zeros(64, dtype=dtype)),
        "strided view": start_error(shm, region[numel - 200::2]),
        "other rank's region": start_error(shm, shm.regions[(rank + 1) % world].view(dtype)[:64]),
    }
    # Each region is a storage of its own: no view can reach past its edge at all.
    out["straddle"] = expect_raises(RuntimeError, lambda: mine.as_strided((64,), (1,), edge))
    out["strided_started_slice"] = start_error(shm, region[o:o + 2 * n:2])  # ptr, numel of a started one
    out["too_big"] = expect_raises(ValueError, lambda: shm.region(dtype, numel + 1))
    out["region_bytes"] = shm.region_bytes
    return out


def gloo_barrier_case(rank: int, world: int, private: str) -> dict:
    """direct_case for bf16 with the Gloo barriers used where flag barriers are not safe
    (not x86-64): the same results must come out."""
    with mock.patch.object(fastreduce.comm.shm, "FLAG_BARRIERS", False):
        return direct_case(rank, world, "bf16", private)


def op_count_case(rank: int, world: int) -> dict:
    """The ops of ShmWork.reduce() of 1e3 and 1e6 elements, run as the worker runs it:
    on every rank, between two barriers."""
    shm = ShmAllReduce.open(None, 4 << 20, required=True)
    torch.manual_seed(rank)
    traces = {}
    for name in ("fp32", "bf16"):
        region = shm.region(DTYPES[name], 1_000_000).normal_()
        for n in (1000, 1_000_000):
            work = shm.start(region[:n])
            work.wait()  # planned (views, scratch) and run once by the worker
            dist.barrier()  # A
            with OpRecorder() as rec:
                work.reduce()
            dist.barrier()  # B
            traces[(name, n)] = rec.ops
    return traces


def restart_case(rank: int, world: int) -> dict:
    """Rank 0 starts a slice and starts it again before waiting; the others join the first
    job only after that (a barrier), so it cannot have finished yet."""
    shm = ShmAllReduce.open(None, 4096, required=True)
    buf = shm.region(torch.float32, 64).fill_(rank + 1)
    again = None
    if rank == 0:
        first = shm.start(buf)
        again = expect_raises(RuntimeError, lambda: shm.start(buf))
    dist.barrier()
    if rank != 0:
        first = shm.start(buf)
    first.wait()
    extra = torch.tensor([rank == 0 and again["raised"] is None], dtype=torch.int32)
    dist.broadcast(extra, 0)
    if rank != 0 and extra.item():  # rank 0 queued a second job: match it, so nothing hangs
        shm.start(buf).wait()
    return {"again": again, "started": shm.started, "mean": buf.tolist()}


OPEN_CASES = {  # name: (directory, nbytes per rank, required)
    "missing": ("missing", 4096, False), "missing, required": ("missing", 4096, True),
    "private": ("private", 3 * 4096 + 1, False), "tiny, fits": ("tiny", 4096, False),
    "tiny, full": ("tiny", 4 << 20, False), "tiny, full, required": ("tiny", 4 << 20, True),
}


def open_case(rank: int, world: int, path: str | None, nbytes: int, required: bool) -> dict | None:
    if path is None:
        return None  # no tmpfs to test with
    with shm_dir(path):
        if required:
            out = expect_raises(RuntimeError, lambda: ShmAllReduce.open(None, nbytes, required=True))
        else:
            out = {"opened": ShmAllReduce.open(None, nbytes) is not None}
    dist.barrier()  # rank 0 unlinks once every rank has mapped: look when all are out
    out["left"] = leftovers(path)
    dist.barrier()  # and before rank 0 makes the next case's segment in the same directory
    return out


def plan_of(rank: int, **config: Any) -> str:
    model = linear_stack(SEED, 4)
    reducer = fastreduce.FusedReducer(model, wire_dtype=torch.float32, **config)
    loss_of(model, batch_for(model, rank, 0)).backward()
    reducer.reduce()
    return repr(reducer._built.plan)


def transport_case(rank: int, world: int, missing: str) -> dict:
    out = {t: plan_of(rank, transport=t) for t in ("shm", "process_group", "auto")}
    with shm_dir(missing):
        out["auto, no /dev/shm"] = plan_of(rank, transport="auto")
    with transport_env("process_group"):
        out["env process_group"] = plan_of(rank)
        out["env process_group, argument shm"] = plan_of(rank, transport="shm")
    with transport_env("bogus"):
        out["env bogus"] = expect_raises(ValueError, lambda: fastreduce.FusedReducer(linear_stack(SEED, 4)))
    model = linear_stack(SEED, 4)
    loss_of(model, batch_for(model, rank, 0)).backward()
    fastreduce.all_reduce_gradients(model, torch.float32, transport="shm")
    out["function shm"] = repr(reducer_of(model)._built.plan)
    return out


def shm_unavailable_case(rank: int, world: int, missing: str) -> dict:
    """transport='shm' with no SHM_DIR: the first reduce() raises, changing nothing; the
    next one (SHM_DIR back) builds and averages."""
    model, plain = many_tensor_model(SEED), many_tensor_model(SEED)
    reducer = fastreduce.FusedReducer(model, wire_dtype=torch.float32, transport="shm")
    inputs = batch_for(model, rank, 0)
    loss_of(model, inputs).backward()
    snap = snapshot(model)
    with shm_dir(missing):
        out = expect_raises(RuntimeError, reducer.reduce)
    out["changed"] = changed_since(snap, model)
    reducer.reduce()
    out["retry"] = (grads_of(model), *mean_and_scale(local_grads(plain, inputs)), repr(reducer._built.plan))
    return out


class Setup(NamedTuple):
    model: torch.nn.Module
    plain: torch.nn.Module  # a copy no reducer touches: this rank's own grads
    reducer: fastreduce.FusedReducer


def reduce_steps(rank: int, setups: dict[str, Setup], alternate: bool = False) -> dict:
    """STEPS steps of: per reducer, zero_grad and backward; then every reduce() (no
    collective in between, so only barrier A keeps a rank from reading a peer's wire
    before its backward wrote it); then the fp64 references. ``alternate``: odd steps
    take the reducers in reverse order."""
    steps = []
    for step in range(STEPS):
        order = list(setups)[::-1] if alternate and step % 2 else list(setups)
        inputs = {k: batch_for(setups[k].model, rank, step) for k in order}
        for k in order:
            setups[k].reducer.zero_grad()
            loss_of(setups[k].model, inputs[k]).backward()
        for k in order:
            setups[k].reducer.reduce()
        steps.append({k: (grads_of(setups[k].model), *mean_and_scale(local_grads(setups[k].plain, inputs[k])))
                      for k in order})
    reducers = {k: s.reducer for k, s in setups.items()}
    return {"steps": steps, "plans": {k: repr(r._built.plan) for k, r in reducers.items()},
            "buckets": {k: r.num_buckets for k, r in reducers.items()},
            "in_backward": {k: r.stats.launched_in_backward for k, r in reducers.items()}}


def parity_case(rank: int, world: int, wire: str, overlap: bool) -> dict:
    """The same model and data through transport='shm' and 'process_group'."""
    kw = {"wire_dtype": DTYPES[wire], "overlap": overlap, "bucket_mb": BUCKET_MB if overlap else None}
    models = {t: many_tensor_model(SEED) for t in ("shm", "process_group")}
    return reduce_steps(rank, {t: Setup(m, many_tensor_model(SEED), fastreduce.FusedReducer(m, transport=t, **kw))
                               for t, m in models.items()})


def two_reducers_case(rank: int, world: int) -> dict:
    """A fused fp32 reducer and an overlapped bf16 one, both on shm in the world group; the
    overlapped one's buckets are queued during its backward, ahead of the other's job."""
    ma, mb = many_tensor_model(SEED), linear_stack(SEED, 40)
    ra = fastreduce.FusedReducer(ma, wire_dtype=torch.float32, transport="shm")
    rb = fastreduce.FusedReducer(mb, wire_dtype=torch.bfloat16, transport="shm", overlap=True, bucket_mb=256 / 2**20)
    setups = {"a": Setup(ma, many_tensor_model(SEED), ra), "b": Setup(mb, linear_stack(SEED, 40), rb)}
    out = reduce_steps(rank, setups, alternate=True)
    shm = {k: s.reducer._built.plan.shm for k, s in setups.items()}
    out["same_worker"] = shm["a"].channel is shm["b"].channel
    out["started"] = {k: s.started for k, s in shm.items()}
    return out


def _mapped_segments() -> int:
    """Bytes of fastreduce's shared-memory segments this process maps (unlinked ones too)."""
    with open("/proc/self/maps") as f:
        spans = [line.split()[0].split("-") for line in f if "/dev/shm/fastreduce-" in line]
    return sum(int(b, 16) - int(a, 16) for a, b in spans)


def rebuilds_case(rank: int, world: int) -> dict:
    """A reducer on shm rebuilt 6 times (a layer frozen and unfrozen, rebuild() as its error
    says), then closed: the segments mapped, after each step and after close()."""
    import gc

    before = _mapped_segments()
    model = linear_stack(SEED, 8)
    reducer = fastreduce.FusedReducer(model, wire_dtype=torch.float32, transport="shm")
    after: list[int] = []
    for step in range(7):
        if step:
            model.layers[0].requires_grad_(step % 2 == 0)
            reducer.rebuild()
        model.zero_grad(set_to_none=True)  # (a frozen layer's grad would hold the last build's segment)
        loss_of(model, batch_for(model, rank, step)).backward()
        reducer.reduce()
        gc.collect()
        after.append(_mapped_segments() - before)
    reducer.close()
    model.zero_grad(set_to_none=True)  # (the grads were views into the segment)
    del reducer
    gc.collect()
    return {"after_steps": after, "after_close": _mapped_segments() - before}


LOCAL_BUILDS = {  # each mode's buffers from the communication layer: the float buffers' block too
    "localsgd": lambda m, o: fastreduce.LocalSGD(m, o, 2, transport="shm"),  # the parameter blocks
    "diloco": lambda m, o: fastreduce.DiLoCo(m, o, torch.optim.SGD(m.parameters(), lr=0.7), 2,
                                             transport="shm"),  # the wire
    "diloco-sparseloco": lambda m, o: fastreduce.DiLoCo(m, o, torch.optim.SGD(m.parameters(), lr=1.0), 2,
                                                        transport="shm", compression=fastreduce.SparseLoCo()),
}


def local_rebuilds_case(rank: int, world: int) -> dict:
    """LocalSGD and DiLoCo on shm built 4 times over one model (a second run, a trainer's
    second train()), each trained to a sync and closed: the segments mapped while the first
    is open, after each close, and once the model is dropped."""
    import gc

    out = {}
    for kind, build in LOCAL_BUILDS.items():
        before = _mapped_segments()
        model = batchnorm_model(SEED)
        opened, after = 0, []
        for _ in range(4):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            mode = build(model, opt)
            for step in range(2):
                opt.zero_grad(set_to_none=True)
                loss_of(model, batch_for(model, rank, step)).backward()
                opt.step()
            opened = opened or _mapped_segments() - before
            mode.close()
            del mode, opt
            gc.collect()
            after.append(_mapped_segments() - before)
        del model
        gc.collect()
        out[kind] = {"open": opened, "after_close": after, "after_drop": _mapped_segments() - before}
    return out


def subgroup_case(rank: int, world: int) -> list:
    """World 4, a reducer per rank on its pair {0, 2} or {1, 3}, through shm."""
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates both
    model, plain = many_tensor_model(SEED), many_tensor_model(SEED)
    reducer = fastreduce.FusedReducer(model, group=pairs[rank % 2], wire_dtype=torch.float32, transport="shm")
    steps = []
    for step in range(2):
        inputs = batch_for(model, rank, step)
        reducer.zero_grad()
        loss_of(model, inputs).backward()
        reducer.reduce()
        local = local_grads(plain, inputs)
        steps.append((grads_of(model), *mean_and_scale(local, pairs[rank % 2]), mean_and_scale(local)[0],
                      reducer._built.plan.shm.world))
    return steps


PARITY = [(w, m) for w in ("fp32", "bf16") for m in ("fused", "overlap")]


def worker(rank: int, world: int, dirs: dict) -> dict:
    out = {name: guarded(direct_case, rank, world, name, dirs["private"]) for name in DTYPES}
    out["gloo barriers"] = guarded(gloo_barrier_case, rank, world, dirs["private"])
    if world in (2, 3):
        out["ops"] = guarded(op_count_case, rank, world)
    if world == 2:
        for case, (key, nbytes, required) in OPEN_CASES.items():
            out[case] = guarded(open_case, rank, world, dirs[key], nbytes, required)
        out["restart"] = guarded(restart_case, rank, world)
        out["transport"] = guarded(transport_case, rank, world, dirs["missing"])
        out["unavailable"] = guarded(shm_unavailable_case, rank, world, dirs["missing"])
        for wire, mode in PARITY:
            out[f"parity-{wire}-{mode}"] = guarded(parity_case, rank, world, wire, mode == "overlap")
        out["two reducers"] = guarded(two_reducers_case, rank, world)
        out["rebuilds"] = guarded(rebuilds_case, rank, world)
        out["local rebuilds"] = guarded(local_rebuilds_case, rank, world)
    if world == 4:
        out["subgroup"] = guarded(subgroup_case, rank, world)
    return out


# ============================================================== spawning, checks (parent)

@contextlib.contextmanager
def shm_dirs():
    """SHM_DIRs for the ranks: a private directory on /dev/shm (leftovers there are ours),
    one that does not exist, and (root, where mount works) a 1 MB tmpfs, else None."""
    private, tiny = tempfile.mkdtemp(prefix="shm-test-", dir="/dev/shm"), tempfile.mkdtemp(prefix="shm-test-")
    try:
        mount = ["mount", "-t", "tmpfs", "-o", "size=1m", "shm-test", tiny]
        mounted = os.geteuid() == 0 and subprocess.run(mount, capture_output=True).returncode == 0
    except OSError:
        mounted = False
    try:
        yield {"private": private, "missing": os.path.join(private, "missing"), "tiny": tiny if mounted else None}
    finally:
        if mounted:
            subprocess.run(["umount", tiny], check=False)
        shutil.rmtree(private, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(tiny)


@pytest.fixture(scope="module")
def group(request) -> list[dict]:
    """Every rank's results of the one group spawned at world size ``request.param``
    (a failed spawn is cached by pytest and fails that world's tests alike)."""
    with shm_dirs() as dirs:
        return run_ranks(worker, request.param, dirs, timeout=SPAWN_TIMEOUT)


def worlds(*sizes: int):
    return pytest.mark.parametrize("group", sizes, indirect=True, ids=lambda w: f"world{w}")


every_dtype = pytest.mark.parametrize("name", list(DTYPES))


def assert_within(got: dict, ref: dict, scale: dict, rel: float, where: str) -> None:
    """|got - ref| <= rel * scale, elementwise, for every tensor."""
    for name, r in ref.items():
        err, bound = (got[name].double() - r).abs(), rel * scale[name]
        i = int((err - bound).argmax())
        assert (err <= bound).all(), (f"{where}: {name}: |error| {err.flatten()[i]:.3g} > "
                                      f"{bound.flatten()[i]:.3g} at element {i}")


# ============================================================== ShmAllReduce itself

@worlds(2, 3, 4)
@every_dtype
def test_every_rank_sees_every_region(group, name) -> None:
    """A new region is zeros; once the owners have written, every rank reads in regions[k]
    exactly what rank k wrote (one shared segment); no segment file is left behind."""
    for rank, out in enumerate(per_rank(group, name)):
        assert out["fresh_zeros"] and out["left"] == [], rank
        for rnd, res in zip(ROUNDS, out["rounds"]):
            assert res["seen"] in (None, [True] * len(group)), f"rank {rank} {rnd}: {res['seen']}"


@worlds(2, 3, 4)
@every_dtype
def test_average_within_rounding_of_the_fp64_mean(group, name) -> None:
    """Every slice (1 element, fewer than ranks, 63, 64*world+5, ~1e5; again with cached
    jobs and a late writer; the whole region) holds the mean within REL_TOL of its scale."""
    for rank, out in enumerate(per_rank(group, name)):
        for rnd, res in zip(ROUNDS, out["rounds"]):
            assert max(res["ratio"]) <= REL_TOL[name], f"rank {rank} {rnd}: per slice {res['ratio']}"


@worlds(2, 3, 4)
@every_dtype
def test_mean_is_the_ring_order_sum_divided_once(group, name) -> None:
    """Bit for bit the documented arithmetic (:func:`reference_mean`): at 2 ranks what a
    Gloo all-reduce mean gives; at 3 and 4 each chunk's sum in ``sum_order`` (a ring's),
    divided once, whatever the timing (a late writer)."""
    for rank, out in enumerate(per_rank(group, name)):
        for rnd, res in zip(ROUNDS, out["rounds"]):
            assert res["exact"] == [0] * res["count"], f"rank {rank} {rnd}: elements off per slice {res['exact']}"


@worlds(2, 3, 4)
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_low_precision_mean_is_rounded_once(group, name) -> None:
    """bf16/fp16 are summed in fp32 (bf16 at 2 ranks: its one sum rounded once) and rounded once: error <= u * |mean|
    (or half a subnormal step) plus fp32 noise. Summing in the wire dtype rounds more."""
    for rank, out in enumerate(per_rank(group, name)):
        for rnd, res in zip(ROUNDS, out["rounds"]):
            assert max(res["excess"]) <= 8 * 2.0**-24, f"rank {rank} {rnd}: per slice {res['excess']}"


@worlds(2, 3, 4)
@every_dtype
def test_result_is_bit_identical_on_every_rank(group, name) -> None:
    """Each chunk is averaged once, by one rank, and pushed: all ranks hold the same bits."""
    outs = per_rank(group, name)
    for r, out in enumerate(outs[1:], 1):
        for rnd, res, res0 in zip(ROUNDS, out["rounds"], outs[0]["rounds"]):
            assert res["digest"] == res0["digest"], f"rank {r} {rnd}"


@worlds(2, 3, 4)
@every_dtype
def test_jobs_run_in_order_and_touch_only_their_slices(group, name) -> None:
    """Slices started back to back are all done once the last one is (one FIFO worker);
    `started` counts each; elements between the slices keep their values."""
    for rank, out in enumerate(per_rank(group, name)):
        for rnd, res in zip(ROUNDS, out["rounds"]):
            assert res["fifo"] and res["queued"] == res["count"] and res["untouched"], (rank, rnd, res)


@worlds(2, 3, 4)
def test_gloo_barriers_give_the_same_results(group) -> None:
    """With Gloo barriers instead of flag barriers (the non-x86-64 path), bf16 slices and
    the whole region hold the mean, bit-identical on every rank, in FIFO order."""
    outs = per_rank(group, "gloo barriers")
    for rank, out in enumerate(outs):
        for rnd, res, res0 in zip(ROUNDS, out["rounds"], outs[0]["rounds"]):
            assert max(res["ratio"]) <= REL_TOL["bf16"], f"rank {rank} {rnd}: {res['ratio']}"
            assert res["fifo"] and res["untouched"] and res["digest"] == res0["digest"], (rank, rnd)


@worlds(2, 3, 4)
@every_dtype
def test_buffers_outside_the_region_are_rejected(group, name) -> None:
    """start() of a fresh tensor, a strided view, another rank's region or a window over
    the edge raises ValueError naming the region and queues nothing; region() larger than
    the region raises ValueError with its size."""
    for out in per_rank(group, name):
        for case, res in out["errors"].items():
            assert res["raised"] and "region" in res["message"] and res["queued"] == 0, (case, res)
        assert out["straddle"]["raised"] == "RuntimeError", out["straddle"]
        res = out["too_big"]
        assert res["raised"] == "ValueError", res["message"]
        assert f"the region has {out['region_bytes']}" in res["message"]


@worlds(2)
def test_start_rejects_a_strided_view_of_an_already_started_slice(group) -> None:
    """A strided view with the data_ptr and numel of a slice started before is no
    contiguous slice either: start() must raise, not replay that slice's cached job
    (which averages other elements than the view's)."""
    for name in DTYPES:
        for rank, out in enumerate(per_rank(group, name)):
            res = out["strided_started_slice"]
            assert res["raised"] and res["queued"] == 0, (name, rank, res)


@worlds(2)
def test_restarting_a_slice_in_flight_raises(group) -> None:
    """start() of a slice whose job has not finished raises RuntimeError and queues
    nothing; the job in flight still averages (1 and 2 -> 1.5 on both ranks)."""
    r0, r1 = per_rank(group, "restart")
    assert r0["again"]["raised"] == "RuntimeError", r0["again"]["message"]
    assert "already being averaged" in r0["again"]["message"]
    assert r0["started"] == r1["started"] == 1
    assert r0["mean"] == r1["mean"] == [1.5] * 64


@worlds(2, 3)
@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_worker_arithmetic_allocates_nothing_and_does_not_grow(group, name) -> None:
    """ShmWork.reduce() of 1e3 and 1e6 elements dispatches the same ops per piece of
    ``_PIECE`` elements (one piece for 1e3; 1e6 repeats them piece after piece), each a
    view or in place or into a given output (``out=``)."""
    for traces in per_rank(group, "ops"):
        small, large = traces[(name, 1000)], traces[(name, 1_000_000)]
        pieces = len(large) // len(small)
        assert pieces > 1 and large == small * pieces, (small, large)
        assert all(op.startswith("aten.") for op in small), small
        aten = [op.split(".")[1:] for op in small if op != "aten.slice.Tensor"]
        assert [op for op, _ in aten if op in ALLOCATING_OPS or op.startswith("new_")] == [], small
        assert all(op.endswith("_") or overload == "out" for op, overload in aten), small


# ============================================================== open()

@worlds(2)
def test_open_without_the_directory_falls_back_on_every_rank(group) -> None:
    """SHM_DIR missing: None on every rank; with required=True a RuntimeError giving the reason."""
    assert [o["opened"] for o in per_rank(group, "missing")] == [False, False]
    for res in per_rank(group, "missing, required"):
        assert res["raised"] == "RuntimeError", res["message"]
        assert "missing does not exist" in res["message"] and "transport='shm'" in res["message"]


@worlds(2)
def test_open_with_too_little_space_falls_back_on_every_rank(group) -> None:
    """A 1 MB tmpfs: an 8 KB segment fits, an 8 MB one does not (reason: MB free, --shm-size)."""
    if per_rank(group, "tiny, fits")[0] is None:
        pytest.skip("needs root and a working mount to make a 1 MB tmpfs")
    assert [o["opened"] for o in per_rank(group, "tiny, fits")] == [True, True]
    assert [o["opened"] for o in per_rank(group, "tiny, full")] == [False, False]
    for res in per_rank(group, "tiny, full, required"):
        assert res["raised"] == "RuntimeError", res["message"]
        for needle in ("MB free", "needs 8 MB", "--shm-size"):
            assert needle in res["message"], res["message"]


@worlds(2)
def test_open_leaves_no_segment_file(group) -> None:
    """After every open(), mapped or not, no fastreduce-* file is left in SHM_DIR."""
    assert [o["opened"] for o in per_rank(group, "private")] == [True, True]
    for case in OPEN_CASES:
        for out in per_rank(group, case):
            assert out is None or out["left"] == [], case


def _dies_mapping(rank: int, port: int, shm_dir: str, box: Any) -> None:
    """Open a segment over 2 Gloo ranks, rank 1 SIGKILLed as it maps it (as by the OOM killer)."""
    import signal

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=15))
    dying = mock.Mock(side_effect=lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL))
    with mock.patch.object(fastreduce.comm.shm, "SHM_DIR", shm_dir), \
            mock.patch.object(fastreduce.comm.shm.mmap, "mmap", dying) if rank == 1 else contextlib.nullcontext():
        try:
            ShmAllReduce.open(None, 1 << 20, required=True)
            box.put("opened")
        except Exception as err:  # noqa: BLE001 - what rank 0 meets, reported
            box.put(type(err).__name__)


@pytest.mark.timeout(90)
def test_a_rank_killed_as_it_maps_the_segment_leaves_no_file() -> None:
    """Rank 0 made the segment; rank 1 dies before all have mapped it: rank 0's open() fails
    and the file goes with it (it stayed in /dev/shm for good, fully allocated)."""
    import multiprocessing

    from fastreduce.launch import free_port

    ctx, shm_dir = multiprocessing.get_context("spawn"), tempfile.mkdtemp(prefix="shm-test-", dir="/dev/shm")
    box, ranks = ctx.Queue(), []
    try:
        port = free_port()
        ranks = [ctx.Process(target=_dies_mapping, args=(r, port, shm_dir, box)) for r in range(2)]
        for p in ranks:
            p.start()
        assert box.get(timeout=60) == "RuntimeError"
        assert ranks[1].join(10) is None and ranks[1].exitcode == -9
        assert os.listdir(shm_dir) == []
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
        shutil.rmtree(shm_dir, ignore_errors=True)


# ============================================================== through a FusedReducer

@worlds(2)
@pytest.mark.parametrize("case, shm", [
    ("shm", True), ("process_group", False), ("auto", True), ("auto, no /dev/shm", False),
    ("env process_group", False), ("env process_group, argument shm", True), ("function shm", True)])
def test_transport_selects_the_plan(group, case, shm) -> None:
    """transport= (else $FASTREDUCE_TRANSPORT) decides whether the reducer averages through
    shared memory; 'auto' uses it on CPU and falls back to the group without /dev/shm."""
    for out in per_rank(group, "transport"):
        assert ("shared memory" in out[case]) == shm, out[case]


def test_invalid_transport_raises() -> None:
    """An unknown transport is rejected when the config is built, listing the choices."""
    with pytest.raises(ValueError, match="unknown transport 'bogus'.*process_group"):
        fastreduce.ReducerConfig(transport="bogus")


@worlds(2)
def test_invalid_transport_env_raises_naming_it(group) -> None:
    """An unknown $FASTREDUCE_TRANSPORT fails FusedReducer() with a message naming the variable."""
    for out in per_rank(group, "transport"):
        res = out["env bogus"]
        assert res["raised"] == "ValueError" and "FASTREDUCE_TRANSPORT" in res["message"], res


@worlds(2)
def test_shm_required_but_unavailable_raises_and_changes_nothing(group) -> None:
    """transport='shm' without SHM_DIR: the first reduce() raises RuntimeError on every rank
    and leaves params and grads as they were; once SHM_DIR is back, reduce() averages."""
    for rank, out in enumerate(per_rank(group, "unavailable")):
        assert out["raised"] == "RuntimeError", out["message"]
        assert "does not exist" in out["message"] and out["changed"] == [], out
        got, ref, scale, plan = out["retry"]
        assert "shared memory" in plan
        assert_within(got, ref, scale, REL_TOL["fp32"], f"rank {rank} retry")


@worlds(2)
@pytest.mark.parametrize("wire, mode", PARITY)
def test_shm_and_process_group_give_the_same_grads(group, wire, mode) -> None:
    """Over STEPS steps: shm within REL_TOL of the fp64 mean, and both transports within the
    wire's rounding of each other (4u for bf16: each side is two roundings off)."""
    pair_tol = 0.0 if wire == "fp32" else 5 * U["bf16"]  # fp32: fl(a + b) / 2 on both, bit for bit
    for rank, out in enumerate(per_rank(group, f"parity-{wire}-{mode}")):
        assert "shared memory" in out["plans"]["shm"] and "shared memory" not in out["plans"]["process_group"]
        if mode == "overlap":
            assert out["buckets"]["shm"] > 2 and out["in_backward"]["shm"] > 0, out
        for step, s in enumerate(out["steps"]):
            (got, ref, scale), (gloo, _, _) = s["shm"], s["process_group"]
            assert_within(got, ref, scale, REL_TOL[wire], f"rank {rank} step {step}: shm vs fp64")
            assert_within(got, gloo, scale, pair_tol, f"rank {rank} step {step}: shm vs gloo")


@worlds(2)
def test_two_reducers_share_the_worker_and_stay_correct(group) -> None:
    """Two reducers (fused fp32, overlapped bf16) queue jobs on one worker, interleaved and
    in alternating order; each still gets its own model's mean at every step."""
    tol = {"a": REL_TOL["fp32"], "b": REL_TOL["bf16"]}
    for rank, out in enumerate(per_rank(group, "two reducers")):
        assert out["same_worker"] and out["buckets"]["b"] > 1 and out["in_backward"]["b"] > 0, out
        assert out["started"] == {"a": STEPS, "b": STEPS * out["buckets"]["b"]}
        for step, s in enumerate(out["steps"]):
            for k, (got, ref, scale) in s.items():
                assert_within(got, ref, scale, tol[k], f"rank {rank} step {step} reducer {k}")


@worlds(2)
def test_a_rebuilt_reducer_keeps_no_segment_of_its_old_builds(group) -> None:
    """Each build's segment goes with the build (a rebuild; the reducer closed and dropped):
    they stayed mapped, one per build, for the group's life."""
    for out in per_rank(group, "rebuilds"):
        one = out["after_steps"][0]
        assert one > 0 and out["after_steps"] == [one] * 7, out
        assert out["after_close"] == 0, out


@worlds(2)
def test_a_local_mode_built_again_keeps_no_segment_of_its_old_builds(group) -> None:
    """LocalSGD's parameter blocks, DiLoCo's wire, SparseLoCo's gather buffer and the float
    buffers' block stayed mapped, a set per build, for the group's life. LocalSGD's
    parameters view their last build's segment until the model is dropped."""
    for out in per_rank(group, "local rebuilds"):
        for kind, o in out.items():
            assert o["open"] > 0 and o["after_close"] == [o["after_close"][0]] * 4, (kind, o)
            assert o["after_drop"] == 0, (kind, o)


@worlds(4)
def test_subgroups_average_over_their_own_ranks(group) -> None:
    """Pairs {0, 2} and {1, 3} of a world of 4: each rank holds its pair's mean (not the world's)."""
    for rank, steps in enumerate(per_rank(group, "subgroup")):
        for step, (got, ref, scale, world_mean, shm_world) in enumerate(steps):
            assert shm_world == 2
            assert_within(got, ref, scale, REL_TOL["fp32"], f"rank {rank} step {step}")
            assert any(not torch.allclose(got[n], world_mean[n].float()) for n in got)


# ============================================================== flag barriers, one process

def _header(pids: list[int]) -> torch.Tensor:
    """A barrier header as open() leaves it: per rank, count 0, its pid, its pid namespace."""
    header = torch.zeros(fastreduce.comm.shm._header_bytes(len(pids)), dtype=torch.uint8)
    lines = header.view(torch.int64).view(-1, 8)
    for k, pid in enumerate(pids):
        lines[k, 1], lines[k, 2] = pid, fastreduce.comm.shm.pid_namespace()
    return header


def test_flag_barrier_raises_soon_when_a_rank_has_exited() -> None:
    """Rank 0 waits for rank 1, whose process has exited: an error naming rank 1 within a
    few seconds, not a wait until the (here 60 s) timeout."""
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: the pid names no process now
    barrier = fastreduce.comm.shm.FlagBarrier(_header([os.getpid(), gone.pid]), 0, 2, timeout=60.0)
    t0 = time.monotonic()
    with pytest.raises(fastreduce.RankLostError, match=r"rank 1 \(pid \d+ on host .*was lost.*exited") as err:
        barrier()
    assert time.monotonic() - t0 < 10
    assert err.value.ranks == [1]
    with pytest.raises(fastreduce.RankLostError):  # and at once from then on
        barrier()


def test_flag_barrier_times_out_on_a_live_rank_that_never_arrives() -> None:
    """Rank 1 is alive (this very process) but never arrives: the timeout, with a message."""
    barrier = fastreduce.comm.shm.FlagBarrier(_header([os.getpid(), os.getpid()]), 0, 2, timeout=0.5)
    with pytest.raises(RuntimeError, match="did not reach the shared-memory barrier within 0.5 s"):
        barrier()


def test_flag_barrier_passes_once_every_rank_has_arrived() -> None:
    """Counts at or past this barrier's number let it through at once."""
    header = _header([os.getpid(), os.getpid()])
    barrier = fastreduce.comm.shm.FlagBarrier(header, 0, 2, timeout=5.0)
    header.view(torch.int64).view(-1, 8)[1, 0] = 2  # rank 1 is already one barrier ahead
    barrier()
    barrier()
    assert barrier.count == 2 and int(barrier.flags[0]) == 2


def test_flag_barrier_raises_when_a_rank_reports_failure() -> None:
    """A rank whose job failed marks its count; a rank waiting for it raises at once."""
    header = _header([os.getpid(), os.getpid()])
    peer = fastreduce.comm.shm.FlagBarrier(header, 1, 2, timeout=5.0)
    barrier = fastreduce.comm.shm.FlagBarrier(header, 0, 2, timeout=5.0)
    peer.fail()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\].*failed"):
        barrier()
    with pytest.raises(RuntimeError, match="earlier shared-memory all-reduce failed"):
        peer()  # the failed rank never signals a count again
    assert int(header.view(torch.int64)[8]) == -1


# ============================================================== who is named lost

def _earlier_groups_barrier(rank: int, world: int, port: int) -> dict:
    """A barrier of this group (its rank 1's process exited) fails after the next group
    (a Membership's next epoch, on a store of its own) started its heartbeat."""
    from fastreduce import faults, faults_heartbeat

    faults.start_heartbeat()
    header = _header([os.getpid(), _dead_pid()])  # this rank's own segment: its rank 1 is gone
    old = fastreduce.comm.shm.FlagBarrier(header, 0, 2, timeout=30.0)
    dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    faults.start_heartbeat()
    try:
        old()
        raised = None
    except fastreduce.RankLostError as err:
        raised = err.ranks
    lost = sorted(faults_heartbeat.heartbeat_now().lost)
    t = torch.ones(1)
    faults.all_reduce_watched(t)  # a known loss of this group would abandon it at once
    return {"raised": raised, "lost": lost, "sum": t.item()}


def test_a_loss_in_an_earlier_groups_segment_is_not_noted_in_the_next_groups_heartbeat() -> None:
    """The earlier group's barrier names its own lost rank, and only to its caller: the next
    group's heartbeat knows of no loss (it did, and gossip under a Membership named a live
    member lost, since rank 1 of the old group is a live rank of the new one), and the
    next group's collective runs."""
    from fastreduce.launch import free_port

    for out in run_ranks(_earlier_groups_barrier, 2, free_port(), timeout=SPAWN_TIMEOUT):
        assert out == {"raised": [1], "lost": [], "sum": 2.0}, out



def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()  # reaped: the pid no longer exists
    return proc.pid


@pytest.mark.parametrize("survivor_told", [True, False], ids=["survivor-told", "nobody-told"])
def test_a_survivor_that_raised_and_exited_is_not_named_lost(survivor_told: bool) -> None:
    """Three ranks, rank 1 killed. Rank 2 found it first, raised and exited (a survivor
    that reports and leaves, as a test's rank or a torchrun worker does); rank 0, slower,
    finds both processes gone. With rank 2's word in the segment it names rank 1 alone
    (the race seen under load: "ranks 1, 2 of 3 were lost"); without a word, every
    exited rank is named, as before."""
    from fastreduce.comm.shm import LINE, FlagBarrier, pid_namespace
    from fastreduce.faults import RankLostError

    world = 3
    header = torch.zeros(world * LINE // 8, dtype=torch.int64)
    lines = header.view(world, LINE // 8)
    for k, pid in enumerate((os.getpid(), _dead_pid(), _dead_pid())):
        lines[k, 1], lines[k, 2] = pid, pid_namespace()
    lines[2, 0] = -1  # rank 2 failed ...
    if survivor_told:
        lines[2, 3] = 1 << 1  # ... because rank 1 exited
    barrier = FlagBarrier(header.view(torch.uint8), 0, world, timeout=10.0, ranks=[0, 1, 2])
    with pytest.raises(RankLostError) as e:
        barrier()
    assert e.value.ranks == ([1] if survivor_told else [1, 2]), str(e.value)
    assert int(lines[0, 3]) == (0b10 if survivor_told else 0b110), "rank 0's own word for the others"
