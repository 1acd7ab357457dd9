"""One survivor and a member lost again and again (``tests/test_loss_loop.py``): the survivor
(:func:`survivor`) trains through ``losses`` losses, each a new process (:func:`flapper`) that
joins, trains a few steps and is killed mid-step, and records its open file descriptors and
threads (the OS's: Gloo's and torch's native ones too) at each loss."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from keep_training import HEARTBEAT, die, make_model  # noqa: E402

STEPS_JOINED = 3
"""Steps a flapper commits before it dies in the next one."""


def _resources() -> tuple[int, int, int]:
    """(open file descriptors, the OS's threads, Python's threads) of this process."""
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task")), threading.active_count()


def _membership(coordinator: str, timeout_s: float) -> Any:
    os.environ.update(FASTREDUCE_HEARTBEAT_S=HEARTBEAT, FASTREDUCE_TRANSPORT="process_group")
    import fastreduce

    torch.set_num_threads(1)
    model = make_model(16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    m = fastreduce.Membership(coordinator, world_size=2, min_ranks=1, timeout_s=timeout_s, wait_s=60,
                              poll_s=0.05)
    m.join({"model": model, "optimizer": opt}, lambda: fastreduce.FusedReducer(model, wire_dtype=torch.float32))
    return m, model, opt


def _step(m: Any, model: Any, opt: Any, dies: bool = False) -> None:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1000 * m.step + m.rank))
    torch.nn.functional.mse_loss(model(x).squeeze(-1), x.sum(1).sin()).backward()
    if dies:
        die()
    m.commit(opt.step)
    opt.zero_grad()


def survivor(coordinator: str, out: str, losses: int, timeout_s: float) -> None:
    """Train until ``losses`` members were lost; save ``[(losses, world, fds, os threads, threads)]``
    taken at the first step after each loss (and at the start, and at the end), and the step reached."""
    facts: dict[str, Any] = {"samples": []}
    try:
        m, model, opt = _membership(coordinator, timeout_s)
        seen = -1
        (Path(out) / "survivor.joined").touch()
        while m.counters.losses < losses:
            if m.counters.losses != seen:  # a loss behind it (the next member in, or not yet)
                seen = m.counters.losses
                facts["samples"].append((seen, m.world, *_resources()))
            _step(m, model, opt)
            time.sleep(0.005)
        facts["samples"].append((m.counters.losses, m.world, *_resources()))
        facts.update(step=m.step, counters=vars(m.counters))
        m.close()
    except BaseException:  # noqa: BLE001 - reported by the test
        import traceback

        facts["error"] = traceback.format_exc()
    torch.save(facts, Path(out) / "survivor.pt")


def flapper(coordinator: str, timeout_s: float) -> None:
    """Join, commit :data:`STEPS_JOINED` steps, die mid-step (SIGKILL to itself)."""
    m, model, opt = _membership(coordinator, timeout_s)
    joined = m.step
    while True:
        _step(m, model, opt, dies=m.step >= joined + STEPS_JOINED)
