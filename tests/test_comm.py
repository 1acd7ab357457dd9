"""The communication layer on real Gloo groups: ``Comm`` against ``dist.all_gather`` of the inputs.

Each spawned group runs every sub-case on both transports (the shared-memory segment
and the process group), at 2, 3 and 4 ranks: averaging reduce-scatter (in place, into
a wider output, with ``fp32_sum``), in-place all-gather, and gossip ``mix`` with the
mixing matrices a decentralized mode uses (uniform, a ring, weighted pairs, identity
rows) in fp32 and with a bf16 wire into an fp32 output.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from fastreduce.comm import get_comm
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
    return {"uniform": torch.full((world, world), 1.0 / world, dtype=torch.float64),
            "ring": ring, "pair": pair, "identity": eye}


def comm_worker(rank: int, world: int, transport: str) -> dict:
    comm = get_comm(None, torch.device("cpu"), transport)
    out: dict = {"shm": None}
    n = comm.shard_multiple * 3
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        torch.manual_seed(100 * rank + 1)
        buf = comm.buffer(n, dtype)
        out["shm"] = comm.shm_of(buf) is not None
        src = torch.randn(n) * (rank + 1)
        # reduce-scatter in place, and into an fp32 output with fp32_sum
        buf.copy_(src)
        expect = _everyone(buf.clone()).double().mean(0)
        chunk = slice(rank * n // world, (rank + 1) * n // world)
        work, then = comm.reduce_scatter(buf)
        work.wait()
        if then is not None:
            then()
        out[f"rs_{name}"] = (buf[chunk].double(), expect[chunk])
        buf.copy_(src)
        wide = torch.zeros(n // world)
        work, then = comm.reduce_scatter(buf, wide, fp32_sum=True)
        work.wait()
        if then is not None:
            then()
        out[f"rs_wide_{name}"] = (wide.double(), expect[chunk])
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
    return out


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


@pytest.mark.parametrize("key", ["rs_fp32", "rs_bf16", "rs_wide_fp32", "rs_wide_bf16"])
def test_reduce_scatter_gives_each_rank_its_chunk_of_the_mean(results, key: str) -> None:
    for got, want in (r[key] for r in results[1]):
        assert_close(got, want, **_tol(key))


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
