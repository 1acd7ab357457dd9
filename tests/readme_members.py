"""The README's ``Membership`` block as one member of a job: ``python tests/readme_members.py
OUT INDEX`` runs the block verbatim (``$FASTREDUCE_COORDINATOR`` names the coordinator) and
writes what it reached to ``OUT/member<INDEX>.json``; tests/test_readme.py starts ``MEMBERS``
of them and checks them against :func:`membership_reference_error`."""

from __future__ import annotations

import builtins
import json
import sys
from pathlib import Path
from typing import Any

from readme_pages import ASSUMED, snippets


def flat_params(model: Any) -> Any:
    import torch

    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


MEMBERS, MEMBER_STEPS, MEMBER_LR = 4, 4, 0.1


def member_model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)  # every member starts from the same weights
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def member_batch(rank: int, world: int, step: int) -> tuple[Any, Any]:
    """Member ``rank``'s share of step ``step``'s batch (the same for any ``world`` here)."""
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def membership_reference_error(params: list[float]) -> tuple[float, float]:
    """How far ``params`` are from SGD on the members' fp32 mean gradient, and how far
    that moved from the start (largest element of each)."""
    import torch

    model = member_model()
    start = flat_params(model)
    opt = torch.optim.SGD(model.parameters(), lr=MEMBER_LR)
    for step in range(MEMBER_STEPS):
        grads = []
        for rank in range(MEMBERS):
            model.zero_grad()
            x, y = member_batch(rank, MEMBERS, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = torch.stack(gs).mean(0)
        opt.step()
    want = flat_params(model)
    return (torch.tensor(params) - want).abs().max().item(), (want - start).abs().max().item()


def member(out: Path, index: int) -> None:
    """One member of the job: the README's block run verbatim, then what it reached."""
    import torch

    torch.set_num_threads(1)
    model = member_model()
    ns = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=MEMBER_LR),
          "loss_fn": torch.nn.functional.mse_loss, "batch_for": member_batch, "steps": MEMBER_STEPS}
    assert set(ns) == ASSUMED["membership"], (sorted(ns), sorted(ASSUMED["membership"]))
    path, first, text = snippets()["membership"]
    ns = {"__name__": "__main__", "__builtins__": builtins, **ns}
    exec(compile("\n" * (first - 1) + text, str(path), "exec"), ns)
    m = ns["m"]
    (out / f"member{index}.json").write_text(json.dumps(
        {"rank": m.rank, "step": m.step, "params": flat_params(model).tolist()}))


if __name__ == "__main__":
    member(Path(sys.argv[1]), int(sys.argv[2]))
