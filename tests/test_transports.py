"""Both transports give the same bits: every mode that averages, 2 real Gloo ranks.

Each rank trains the same model from the same seed twice per mode, once with
``transport="shm"`` (the default for CPU ranks on one host) and once with
``transport="process_group"`` (Gloo), 10 AdamW steps, an fp32 wire, and the two runs'
parameters must be equal bit for bit. Over two ranks an average is ``fl(a + b) / 2``
on both: Gloo sums then halves (exactly), and the shared-memory transport sums in rank
order and divides once (:func:`fastreduce.comm.shm.weighted_sum`). A second rounding
anywhere (a ``lerp`` on one side, a rescale) shows up within a step or two and grows
(a transport that rounded twice was 1.2e-4 apart after 10 steps of a trainer).

The run on each transport is checked to have used it (jobs on the shared-memory
worker, or none), so a fallback cannot pass for agreement.
"""

from __future__ import annotations

import os
from typing import Any, Callable
from unittest import mock

import pytest
import torch
from torch import nn

import fastreduce
import fastreduce.comm.comm
from fastreduce.launch import run_ranks

from models import batch_for, loss_of, many_tensor_model, stepper

STEPS = 10
SEED = 3
BUCKET_MB = 20_000 / 2**20  # several buckets of the model below
TRANSPORTS = ("shm", "process_group")
pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")]


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def shm_jobs() -> int:
    """Collectives queued on shared memory so far, over every communication layer."""
    return sum(s.started for per_pg in fastreduce.comm.comm._comms.values()
               for comm in per_pg.values() for s in comm.shms)


# Each mode: (model, transport) -> (the module to call, step after backward, finish after the last step).
Mode = Callable[[nn.Module, str], tuple[nn.Module, Callable[[], None], Callable[[], None]]]


def fused(model: nn.Module, transport: str, overlap: bool = False):
    reducer = fastreduce.FusedReducer(model, wire_dtype=torch.float32, overlap=overlap,
                                      bucket_mb=BUCKET_MB if overlap else None, transport=transport)
    opt = adamw(model.parameters())
    return model, stepper(opt, reducer.reduce), lambda: None


def zero(model: nn.Module, transport: str):
    opt = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, module=model, lr=1e-2,
                                   weight_decay=0.1, bucket_mb=BUCKET_MB, transport=transport)
    return model, stepper(opt), opt.state_dict  # the state dict waits for the last all-gather


def localsgd(model: nn.Module, transport: str):
    opt = adamw(model.parameters())
    fastreduce.LocalSGD(model, opt, sync_every=2, transport=transport)
    return model, stepper(opt), lambda: None


def diloco(model: nn.Module, transport: str):
    opt = adamw(model.parameters())
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    fastreduce.DiLoCo(model, opt, outer, sync_every=2, wire_dtype=torch.float32, transport=transport)
    return model, stepper(opt), lambda: None


def gossip(model: nn.Module, transport: str):
    with mock.patch.dict(os.environ, {"FASTREDUCE_TRANSPORT": transport}):  # it takes the default
        ddp = fastreduce.DecentralizedDataParallel(model, adamw, topology="complete", bucket_mb=BUCKET_MB)
    return ddp, lambda: None, ddp.wait_exchanges


MODES: dict[str, Mode] = {
    "fused": fused,
    "overlapped": lambda m, t: fused(m, t, overlap=True),
    "zero": zero,
    "localsgd": localsgd,
    "diloco": diloco,
    "gossip": gossip,
}


def train(rank: int, mode: str, transport: str) -> dict[str, Any]:
    model = many_tensor_model(SEED)
    before = shm_jobs()
    call, step, finish = MODES[mode](model, transport)
    for s in range(STEPS):
        loss_of(call, batch_for(model, rank, s)).backward()
        step()
    finish()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "shm_jobs": shm_jobs() - before}


def worker(rank: int, world: int) -> dict[str, Any]:
    return {mode: {t: train(rank, mode, t) for t in TRANSPORTS} for mode in MODES}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(worker, 2, timeout=240)  # a failing mode fails them all: see its traceback


@pytest.mark.parametrize("mode", list(MODES))
def test_shm_and_process_group_are_bit_identical(results, mode) -> None:
    for rank, out in enumerate(results):
        runs = out[mode]
        assert runs["shm"]["shm_jobs"] >= STEPS // 2 - 1 and runs["process_group"]["shm_jobs"] == 0, \
            (rank, {t: r["shm_jobs"] for t, r in runs.items()})
        shm, pg = runs["shm"]["params"], runs["process_group"]["params"]
        off = {n: (shm[n] - pg[n]).abs().max().item() for n in shm if not torch.equal(shm[n], pg[n])}
        assert not off, f"rank {rank}: {len(off)} of {len(shm)} tensors differ, the most by {max(off.values()):.3g}"
        start = many_tensor_model(SEED)
        assert any(not torch.equal(p, shm[n]) for n, p in start.named_parameters()), "nothing trained"
