"""Stress: thousands of steps of a small model through the fused reducer at 2 ranks and the
overlapped one at 4 (``make test-stress``: 10,000; ``make test``, where CI pays for every
second, 250), with everything a training loop varies drawn at random each step:

* gradient accumulation: 1 to 3 micro-batches, all but the last under ``no_sync()``;
* parameters without a gradient: each rank skips a random subset of the model's
  branches in each micro-batch (``unused_grads="zero"``: a grad that some rank has and
  another has not averages with zero; one no rank has stays ``None``);
* how gradients are zeroed: ``optimizer.zero_grad()`` (set to ``None``), with
  ``set_to_none=False``, or ``reducer.zero_grad()``.

The reference is computed in the test process without fastreduce or a process group:
every rank's micro-batches run on one model and their gradients are averaged by hand
(zero for a rank that has none, ``None`` where no rank has one, a zeroed gradient
still present). At every tenth of the SGD-with-momentum steps the parameters must agree
to 1e-5 (fp32 wire). Marked ``slow``; ``make test`` runs it (``FASTREDUCE_STRESS_STEPS``
sets the count).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn

import fastreduce
from fastreduce.launch import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = int(os.environ.get("FASTREDUCE_STRESS_STEPS", "250"))  # make test-stress: 10,000
TOL = 1e-5
BRANCHES = 3
LR = 0.02
MOMENTUM = 0.5  # heavier momentum amplifies float noise: 0.9 drifts to 9e-6 by step 2,000


class Branchy(nn.Module):
    """A trunk and three branches; ``use`` picks the branches a forward runs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(6, 8)
        self.branches = nn.ModuleList(nn.Linear(8, 8) for _ in range(BRANCHES))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use: list[int]) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        for k in use:
            h = h + 0.5 * torch.tanh(self.branches[k](h))
        return self.head(h)


class Draws:
    """The random choices of one run, drawn in the same order by the ranks and by the
    reference: ``shared`` (accumulation window, zeroing style) is the same on every
    rank; each rank has its own branch choices and data."""

    def __init__(self, world: int, knobs: Knobs) -> None:
        self.knobs = knobs
        self.shared = random.Random(1234)
        self.mine = [random.Random(99 + r) for r in range(world)]
        self.data = [torch.Generator().manual_seed(500 + r) for r in range(world)]
        self.w_true = torch.randn(6, 2, generator=torch.Generator().manual_seed(7))

    def window(self) -> int:
        return self.shared.choice(self.knobs.windows)

    def micro_batch(self, rank: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        use = [k for k in range(BRANCHES) if self.mine[rank].random() < self.knobs.use]
        x = torch.randn(4, 6, generator=self.data[rank])
        return use, x, x @ self.w_true

    def style(self) -> str:
        return self.shared.choice(self.knobs.styles)


@dataclass(frozen=True)
class Knobs:
    """What the draws choose from (narrowed only to find the cause of a failure)."""

    windows: tuple[int, ...] = (1, 1, 2, 3)  # micro-batches per step
    styles: tuple[str, ...] = ("none", "zeros", "reducer")  # how gradients are zeroed
    use: float = 0.7  # chance that a rank runs a branch in a micro-batch
    mark: int = max(1, STEPS // 10)  # compare every this many steps


def loss(model: nn.Module, use: list[int], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x, use), y)


def stress_worker(rank: int, world: int, overlap: bool, steps: int, knobs: Knobs = Knobs()) -> dict:
    model = Branchy()
    reducer = fastreduce.FusedReducer(model, wire_dtype=torch.float32, overlap=overlap, unused_grads="zero")
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    draws = Draws(world, knobs)
    styles = dict.fromkeys(knobs.styles, 0)
    windows = dict.fromkeys(knobs.windows, 0)
    skipped = 0
    marks = []
    for step in range(steps):
        micro = draws.window()
        windows[micro] += 1
        for m in range(micro):
            use, x, y = draws.micro_batch(rank)
            skipped += BRANCHES - len(use)
            if m == micro - 1:
                loss(model, use, x, y).backward()
            else:
                with reducer.no_sync():
                    loss(model, use, x, y).backward()
        reducer.reduce()
        opt.step()
        style = draws.style()
        styles[style] += 1
        if style == "none":
            opt.zero_grad(set_to_none=True)
        elif style == "zeros":
            opt.zero_grad(set_to_none=False)
        else:
            reducer.zero_grad()  # zeros in place; a None grad stays None
        if step % knobs.mark == knobs.mark - 1:
            marks.append([p.detach().clone() for p in model.parameters()])
    return {"marks": marks, "styles": styles, "windows": windows, "skipped": skipped,
            "calls": reducer.stats.calls}


def reference(world: int, steps: int, knobs: Knobs = Knobs()) -> list[list[torch.Tensor]]:
    """The same run in one process, without fastreduce or torch.distributed: every rank's
    micro-batches on one model, their gradients averaged by hand (zero for a rank that
    has none, ``None`` where no rank has one), torch's SGD."""
    model = Branchy()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    draws = Draws(world, knobs)
    kept: list[bool] = [False] * len(params)  # a zeroed (not freed) grad is still there
    marks = []
    for step in range(steps):
        micro = draws.window()
        total = [torch.zeros_like(p) for p in params]
        present = list(kept)
        for rank in range(world):
            for p in params:
                p.grad = None
            for _ in range(micro):
                loss(model, *draws.micro_batch(rank)).backward()
            for i, p in enumerate(params):
                if p.grad is not None:
                    total[i] += p.grad
                    present[i] = True
        for p, t, there in zip(params, total, present):
            p.grad = t / world if there else None
        opt.step()
        kept = present if draws.style() != "none" else [False] * len(params)
        if step % knobs.mark == knobs.mark - 1:
            marks.append([p.detach().clone() for p in params])
    return marks


_references: dict[int, list] = {}


# (fused at 4 ranks and overlapped at 2 passed too, through stop 53: left out for CI's time)
@pytest.mark.parametrize("overlap, world", [(False, 2), (True, 4)], ids=["fused-2", "overlap-4"])
def test_thousands_of_random_steps_match_the_reference(world: int, overlap: bool) -> None:
    outs = run_ranks(stress_worker, world, overlap, STEPS, timeout=850)
    if world not in _references:
        _references[world] = reference(world, STEPS)
    want = _references[world]
    worst = 0.0
    for rank, out in enumerate(outs):
        assert out["calls"] == STEPS
        assert all(v > 0 for v in out["styles"].values()) and all(v > 0 for v in out["windows"].values())
        assert out["skipped"] > 0
        for got, ref in zip(out["marks"], want, strict=True):
            worst = max(worst, max((g - r).abs().max().item() for g, r in zip(got, ref)))
        for p, q in zip(out["marks"][-1], outs[0]["marks"][-1]):
            assert torch.equal(p, q), "the ranks' parameters differ"
    scale = max(p.abs().max().item() for p in want[-1])
    print(f"world {world} {'overlap' if overlap else 'fused'}: max |fastreduce - reference| over "
          f"{STEPS} steps {worst:.2e} (parameters up to {scale:.2f})")
    assert worst <= TOL, worst
