"""The communication layer on real Gloo groups: ``Comm`` against ``dist.all_gather`` of the inputs.

Each spawned group runs every sub-case on both transports (the shared-memory segment
and the process group), at 2, 3 and 4 ranks: averaging reduce-scatter (in place, into
a wider output, with ``fp32_sum``), in-place all-gather, and gossip ``mix`` with the
mixing matrices a decentralized mode uses (uniform, a ring, weighted pairs, identity
rows) in fp32 and with a bf16 wire into an fp32 output.
"""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

import fastreduce.comm.ring as ring
import fastreduce.comm.shm as shm_mod
from fastreduce.comm import Comm, get_comm
from fastreduce.comm.collectives import exchange_ops
from fastreduce.exit_quiet import quiet_backends
from fastreduce.launch import run_ranks

WORLDS = (2, 3, 4)
TRANSPORTS = ("shm", "process_group")

pytestmark = pytest.mark.timeout(240)


def _everyone(x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x``, stacked in rank order (the reference)."""
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x.contiguous())
    return torch.stack(out)


def _matrices(world: int) -> dict[str, torch.Tensor]:
    eye = torch.eye(world, dtype=torch.float64)
    ring = torch.zeros(world, world, dtype=torch.float64)
    for r in range(world):
        for j in {(r - 1) % world, r, (r + 1) % world}:
            ring[r, j] = 1.0 / len({(r - 1) % world, r, (r + 1) % world})
    pair = eye.clone()  # ranks 0 and 1 mix with weights 0.7 / 0.3; the rest keep their own
    pair[0, 0] = pair[1, 1] = 0.7
    pair[0, 1] = pair[1, 0] = 0.3
    pairs = eye.clone()  # one-peer-exp's kind of round: ranks 0-1 (and 2-3) average, a lone rank keeps its own
    for a in range(0, world - 1, 2):
        pairs[a:a + 2, a:a + 2] = 0.5
    return {"uniform": torch.full((world, world), 1.0 / world, dtype=torch.float64),
            "ring": ring, "pair": pair, "identity": eye, "pairs": pairs}


def _rank_order_mean(sent: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """A uniform row's mix as the transports promise it: the sources summed in fp32 in
    rank order, one rounding per addition, then scaled once (by 1/m for m a power of
    two, divided by m otherwise)."""
    members = [j for j in range(len(row)) if row[j] != 0]
    acc = sent[members[0]].float().clone()
    for j in members[1:]:
        acc += sent[j].float()
    m = len(members)
    return acc * (1.0 / m) if m & (m - 1) == 0 else acc / m


def _in_sum_order(rows: torch.Tensor, rank: int) -> torch.Tensor:
    """Chunk ``rank``'s mean as every transport promises it: the ranks' rows summed in fp32
    in ``sum_order`` (rank + 1, ..., rank: a ring's), one rounding per addition, then
    divided once."""
    order = shm_mod.sum_order(rank, len(rows))
    acc = rows[order[0]].float().clone()
    for k in order[1:]:
        acc += rows[k].float()
    return acc / len(rows)


def comm_worker(rank: int, world: int, transport: str) -> dict:
    comm = get_comm(None, torch.device("cpu"), transport)
    out: dict = {"shm": None}
    n = comm.shard_multiple * 3
    shared = comm.buffer(n, torch.float32)
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        torch.manual_seed(100 * rank + 1)
        buf = comm.buffer(n, dtype)
        out["shm"] = comm.shm_of(buf) is not None
        src = torch.randn(n) * (rank + 1)
        # reduce-scatter in place, and into an fp32 output with fp32_sum
        buf.copy_(src)
        expect = _everyone(buf.clone()).double().mean(0)
        chunk = slice(rank * n // world, (rank + 1) * n // world)
        exact = _in_sum_order(_everyone(buf.clone())[:, chunk], rank)
        work, then = comm.reduce_scatter(buf)
        out[f"rs_{name}_kind"] = type(work).__name__
        work.wait()
        if then is not None:
            then()
        out[f"rs_{name}"] = (buf[chunk].double(), expect[chunk])
        out[f"rs_{name}_exact"] = (buf[chunk].clone(), exact.to(dtype))
        buf.copy_(src)
        wide = torch.zeros(n // world)
        work, then = comm.reduce_scatter(buf, wide, fp32_sum=True)
        out[f"rs_wide_{name}_kind"] = type(work).__name__
        work.wait()
        if then is not None:
            then()
        out[f"rs_wide_{name}"] = (wide.double(), expect[chunk])
        out[f"rs_wide_{name}_exact"] = (wide.clone(), exact)
        # both again with a rider (a few counts summed over the ranks in the same messages):
        # where the transport carries one, the buffer's result bit for bit the same
        mine, total = torch.arange(1.0, 6.0) * (rank + 1), comm.buffer(5, torch.float32).fill_(float("nan"))
        out["carries_riders"] = comm.carries_riders(buf)
        # (and the ring's messages cut in pieces of 3 elements: the rider behind the last)
        for key, into, piece_bytes in ((f"rider_{name}", None, None), (f"rider_wide_{name}", torch.zeros(n // world), None),
                                       (f"rider_pieces_{name}", None, 3 * buf.element_size())):
            buf.copy_(src)
            total.fill_(float("nan"))
            if piece_bytes is not None:
                ring.__dict__["RING_PIECE_BYTES"], piece_bytes = piece_bytes, ring.RING_PIECE_BYTES
            try:
                work, then = comm.reduce_scatter(buf, into, fp32_sum=into is not None, rider=(mine, total))
            except ValueError as e:
                out[key] = str(e)
                continue
            finally:
                if piece_bytes is not None:
                    ring.__dict__["RING_PIECE_BYTES"] = piece_bytes
            work.wait()
            if then is not None:
                then()
            got = buf[chunk] if into is None else into
            alone = out[f"rs_wide_{name}_exact" if into is not None else f"rs_{name}_exact"][0]
            out[key] = (got.clone(), alone, total.clone(), torch.arange(1.0, 6.0) * world * (world + 1) / 2)
        # all-gather in place: chunk k of every rank's buffer from rank k
        buf.copy_(src)
        mine = buf[chunk].clone()
        work, then = comm.all_gather(buf)
        work.wait()
        out[f"ag_{name}"] = (buf.clone(), _everyone(mine).reshape(-1))
        # gossip mixing into a private fp32 output
        for mname, matrix in _matrices(world).items():
            buf.copy_(src)
            sent = _everyone(buf.clone()).double()
            mixed = torch.empty(n)
            work, then = comm.mix(buf, mixed, matrix)
            work.wait()
            if then is not None:
                then()
            out[f"mix_{mname}_{name}"] = (mixed.double(), (matrix[rank].unsqueeze(1) * sent).sum(0))
        # the same into an output of the communication layer's own (the gossip mode's
        # mixed blocks): on shared memory a uniform clique splits the sum, each rank
        # writing its chunk into every member's output, in pieces (made small here). The
        # weighted pair comes first: its launch has no clique on ranks 0 and 1 but one of
        # one on the others, and the cliques of the later launches on the same buffers
        # must still be split alike by every member
        shm_mod.__dict__["_PIECE"], piece = 100, shm_mod._PIECE
        try:
            for mname in ("pair", "uniform", "pairs"):
                matrix = _matrices(world)[mname]
                buf.copy_(src)
                sent = _everyone(buf.clone())
                shared.fill_(float("nan"))
                work, then = comm.mix(buf, shared, matrix)
                work.wait()
                if then is not None:
                    then()
                want = _rank_order_mean(sent, matrix[rank]) if mname != "pair" else \
                    (matrix[rank].unsqueeze(1) * sent.double()).sum(0).float()
                out[f"shared_{mname}_{name}"] = (shared.clone(), want)
        finally:
            shm_mod.__dict__["_PIECE"] = piece
    # a bf16 buffer averaged with fp32 sums (Fp32Accumulate: exchange, sum, all-gather),
    # counting the calls to Gloo's all-to-all it makes (none: point to point on CPU)
    torch.manual_seed(7 + rank)
    wire = torch.empty(n, dtype=torch.bfloat16)
    wire.copy_(torch.randn(n) * (rank + 1))
    every = _everyone(wire.clone())
    want = torch.cat([_in_sum_order(every[:, k * n // world:(k + 1) * n // world], k) for k in range(world)])
    a2a_calls = []
    real_a2a = dist.all_to_all_single
    dist.all_to_all_single = lambda *a, **k: (a2a_calls.append(1), real_a2a(*a, **k))[1]
    try:
        plan = comm.plan(torch.bfloat16, torch.float32, wire)
        work, then = comm.all_reduce(wire, plan)
        work.wait()
        if then is not None:
            then()
    finally:
        dist.all_to_all_single = real_a2a
    out["fp32_accumulate"] = (wire.clone(), want.bfloat16(), plan.fp32_accumulate, len(a2a_calls))
    # Gloo's point to point moves host memory only: CUDA tensors (tests/gpu) must take its
    # all-to-all and all-gather. Comm allocates nothing when built, so no GPU is needed here.
    on_gpu = Comm(None, torch.device("cuda"), "process_group")
    out["point_to_point"] = {"cpu": (comm.by_exchange, comm.gather_by_exchange),
                             "cuda": (on_gpu.by_exchange, on_gpu.gather_by_exchange)}
    # the posting order of an exchange: every receive first
    peers = [j for j in range(world) if j != rank]
    sends = {j: torch.arange(10.0) + 100 * rank + j for j in peers}
    recvs = {j: torch.full((10,), float("nan")) for j in peers}
    ops = exchange_ops(sends, recvs, None, lambda j: j, rank, world)
    out["p2p_order"] = [(op.op.__name__, op.peer, op.tensor.numel()) for op in ops]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    out["p2p_got"] = {j: (recvs[j], torch.arange(10.0) + 100 * j + rank) for j in peers}
    out["let_go"] = _groups_let_go(world, transport)
    return out


GROUP_ROUNDS = 3


def _groups_let_go(world: int, transport: str) -> tuple[int, list[tuple[bool, int, int, int]]]:
    """Rounds of a new group used through the Comm layer (its Comm, a cached plan, the
    reduce-scatter: at 3+ ranks over Gloo the ring's thread, on shared memory the
    channel's), then destroyed and let go of by its user: the count of fastreduce's
    threads before, and per round whether the group was freed, and this process's
    descriptors, OS threads and fastreduce threads after it."""
    ours = ("fastreduce-ring", "fastreduce-shm")
    before = sum(t.name in ours for t in threading.enumerate())  # the default group's
    rounds = []
    for _ in range(GROUP_ROUNDS):
        group = dist.new_group(list(range(world)))
        gone = weakref.ref(group)
        comm = get_comm(group, torch.device("cpu"), transport)
        buf = comm.buffer(comm.shard_multiple, torch.float32)
        for work, then in (comm.all_reduce(buf, comm.plan(torch.float32)), comm.reduce_scatter(buf)):
            work.wait()
            if then is not None:
                then()
        del comm, buf, work, then
        dist.barrier()
        quiet_backends()  # (what fastreduce.shutdown() ends with before a destroy: exit_quiet's note)
        dist.destroy_process_group(group)
        del group
        gc.collect()
        deadline = time.monotonic() + 10  # a thread let go of ends after its queue
        while sum(t.name in ours for t in threading.enumerate()) > before and time.monotonic() < deadline:
            time.sleep(0.01)
        rounds.append((gone() is None, len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task")),
                       sum(t.name in ours for t in threading.enumerate())))
    return before, rounds


@pytest.fixture(scope="module", params=[(w, t) for w in WORLDS for t in TRANSPORTS], ids=lambda p: f"w{p[0]}-{p[1]}")
def results(request) -> tuple[str, list[dict]]:
    world, transport = request.param
    return transport, run_ranks(comm_worker, world, transport, timeout=180)


def _tol(key: str) -> dict:
    # bf16 inputs are exact in the fp32 reference; one rounding to bf16 where the output is bf16
    return {"rtol": 1e-2, "atol": 1e-2} if key.startswith(("rs_bf16", "ag_bf16")) else {"rtol": 1e-5, "atol": 1e-5}


def test_transport_is_the_one_asked_for(results) -> None:
    transport, per_rank = results
    assert all(r["shm"] == (transport == "shm") for r in per_rank)


def test_gloo_goes_point_to_point_with_cpu_tensors_only(results) -> None:
    transport, per_rank = results
    for r in per_rank:
        assert r["point_to_point"]["cuda"] == (False, False)
        if transport == "process_group":
            assert r["point_to_point"]["cpu"] == (True, len(per_rank) == 2)


@pytest.mark.parametrize("key", ["rs_fp32", "rs_bf16", "rs_wide_fp32", "rs_wide_bf16"])
def test_reduce_scatter_gives_each_rank_its_chunk_of_the_mean(results, key: str) -> None:
    for got, want in (r[key] for r in results[1]):
        assert_close(got, want, **_tol(key))


@pytest.mark.parametrize("key", ["rs_fp32", "rs_wide_fp32", "rs_wide_bf16"])
def test_reduce_scatter_sums_in_one_order_on_every_transport(results, key: str) -> None:
    """Bit for bit the fp32 sum in ``sum_order`` (a ring's): the shared-memory transport,
    the direct exchange and the ring give the same result."""
    for got, want in (r[f"{key}_exact"] for r in results[1]):
        assert torch.equal(got, want), (got - want).abs().max()


def test_reduce_scatter_goes_around_a_ring_over_gloo_beyond_two_ranks(results) -> None:
    """An fp32 reduce-scatter over Gloo (CPU) at more than two ranks is a ring: one flow
    per link direction; into a wider output, and at two ranks, the direct exchange."""
    transport, per_rank = results
    ring = transport == "process_group" and len(per_rank) > 2
    for r in per_rank:
        assert (r["rs_fp32_kind"] == "RingReduceScatter") == ring
        assert r["rs_wide_fp32_kind"] == r["rs_fp32_kind"]
        assert r["rs_bf16_kind"] != "RingReduceScatter" and r["rs_wide_bf16_kind"] != "RingReduceScatter"


@pytest.mark.parametrize("key", ["rider_fp32", "rider_wide_fp32", "rider_pieces_fp32", "rider_bf16", "rider_wide_bf16"])
def test_a_rider_is_summed_in_the_reduce_scatters_own_messages(results, key: str) -> None:
    """``reduce_scatter(rider=(mine, total))`` (ZeroOptimizer's unused-parameter flags):
    over Gloo, around the ring (behind the last of its pieces, however many) and in the
    direct exchange, and on shared memory between the buffer's own barriers, ``total`` is
    every rank's ``mine`` summed and the buffer's result is bit for bit the one without a
    rider."""
    transport, per_rank = results
    for r in per_rank:
        assert r["carries_riders"]
        got, alone, total, want = r[key]
        assert torch.equal(got, alone) and torch.equal(total, want), (total, want)


@pytest.mark.parametrize("key", ["ag_fp32", "ag_bf16"])
def test_all_gather_assembles_every_ranks_chunk(results, key: str) -> None:
    for got, want in (r[key] for r in results[1]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("matrix", ["uniform", "ring", "pair", "identity"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_mix_applies_this_ranks_row(results, matrix: str, dtype: str) -> None:
    for got, want in (r[f"mix_{matrix}_{dtype}"] for r in results[1]):
        # the sent blocks are exact in the reference; the mix sums them in fp32
        assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("matrix", ["uniform", "pairs"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_uniform_mix_is_the_rank_order_sum_bit_for_bit(results, matrix: str, dtype: str) -> None:
    """Ranks whose rows are one mean (all of them, or pairs) get that mean bit for bit,
    whoever computed which piece of it. (On the process group a uniform matrix is Gloo's
    all-reduce, whose order over more than two ranks is its own: close there.)"""
    transport, per_rank = results
    for got, want in (r[f"shared_{matrix}_{dtype}"] for r in per_rank):
        if transport == "process_group" and matrix == "uniform" and len(per_rank) > 2:
            assert_close(got, want, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_weighted_mix_into_a_shared_output(results, dtype: str) -> None:
    for got, want in (r[f"shared_pair_{dtype}"] for r in results[1]):
        assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fp32_accumulation_sums_in_order_and_goes_point_to_point(results) -> None:
    """A bf16 wire summed in fp32 (``accumulate_dtype=torch.float32``) on a process group:
    each chunk summed in ``sum_order`` and rounded once, bit for bit, and on Gloo with CPU
    tensors without Gloo's all-to-all, which took 1.7x as long over a 100 Mbit/s link
    (its stall on "ready to receive" notes; the exchange posts every receive first)."""
    transport, per_rank = results
    for got, want, accumulated, a2a_calls in (r["fp32_accumulate"] for r in per_rank):
        assert_close(got, want, rtol=0, atol=0)
        if transport == "process_group":
            assert accumulated and a2a_calls == 0


def test_point_to_point_posts_every_receive_before_any_send(results) -> None:
    """Gloo holds a send until the receiver's note that its receive is posted, and the
    note queues behind whatever the receiver has already sent: receives posted among or
    after sends stalled ZeRO's phases over a 100 Mbit/s link by up to 55%
    (``exchange_ops``' docstring). Messages go whole, in ring order: the k-th receive from
    rank - k, the k-th send to rank + k (in rank order every rank sent to the lowest first)."""
    _, per_rank = results
    world = len(per_rank)
    for rank, r in enumerate(per_rank):
        kinds = [k for k, _, _ in r["p2p_order"]]
        froms = [((rank - k) % world, 10) for k in range(1, world)]
        tos = [((rank + k) % world, 10) for k in range(1, world)]
        assert kinds == ["irecv"] * len(froms) + ["isend"] * len(tos)
        assert [(p, n) for _, p, n in r["p2p_order"]] == froms + tos
        for j, (got, want) in r["p2p_got"].items():
            assert_close(got, want, rtol=0, atol=0)


def test_a_group_its_user_let_go_of_is_freed_and_its_threads_end(results) -> None:
    """A group used through the Comm layer, then destroyed and let go of by its user, is
    freed (get_comm's cache, keyed by the group, held a Comm and plans that held it: every
    group a mode was given lived on with its sockets and threads, about 5 descriptors a
    round at 2 ranks), and the thread the layer ran for it ends (the ring's over Gloo at 3+
    ranks, the shared-memory channel's: one more for good per group, a Membership's every
    epoch). Descriptors and threads flat over rounds of a new group each."""
    _, per_rank = results
    for rank, r in enumerate(per_rank):
        before, rounds = r["let_go"]
        assert all(freed for freed, *_ in rounds), f"rank {rank}: groups kept alive: {rounds}"
        assert [ours for *_, ours in rounds] == [before] * GROUP_ROUNDS, f"rank {rank}: threads left: {rounds}"
        # (the OS's threads only shown: one that just ended can still be listed a moment)
        assert rounds[-1][1] <= rounds[0][1], f"rank {rank}: (freed, fds, OS threads, ours) {rounds}"
