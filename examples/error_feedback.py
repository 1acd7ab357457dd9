"""Error feedback on a bf16 wire: how far 200 steps drift from the fp32-wire run, with and without.

    torchrun --standalone --nproc-per-node 2 examples/error_feedback.py [--steps 200] [--overlap]

Each rank trains the same small regression MLP (SGD, its own batches of a fixed linear
teacher) three times from the same start, reducing with ``fastreduce.FusedReducer``:
on an fp32 wire (the reference), on a bf16 wire, and on a bf16 wire with
``error_feedback=True`` (each rank carries what its last cast to bf16 rounded away into
the next step). It prints the distance of each bf16 run's final parameters from the
reference's. Runs on CPU (gloo), CUDA and Gaudi, like ``train.py``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import fastreduce
from train import leave  # examples/train.py (the script's folder is on sys.path)


def train(rank: int, wire: torch.dtype, error_feedback: bool, steps: int = 200, overlap: bool = False,
          device: torch.device | str = "cpu") -> torch.Tensor:
    """The parameters, flattened, after ``steps`` SGD steps averaged through ``wire``."""
    torch.manual_seed(0)  # the same start on every rank and in every run
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)).to(device)
    reducer = fastreduce.FusedReducer(model, wire_dtype=wire, error_feedback=error_feedback, overlap=overlap)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    teacher = torch.randn(32, 1, generator=torch.Generator().manual_seed(7)).to(device)
    batches = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    for _ in range(steps):
        x = torch.randn(16, 32, generator=batches).to(device)
        ((model(x) - x @ teacher) ** 2).mean().backward()
        reducer.reduce()
        opt.step()
        opt.zero_grad()
    reducer.close()
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])


def distances(rank: int, steps: int = 200, overlap: bool = False, device: torch.device | str = "cpu") -> dict:
    """``{"bf16": ..., "bf16_error_feedback": ...}``: each run's L2 distance from the fp32-wire run."""
    ref = train(rank, torch.float32, False, steps, overlap, device)
    return {name: float((train(rank, torch.bfloat16, ef, steps, overlap, device) - ref).norm())
            for name, ef in (("bf16", False), ("bf16_error_feedback", True))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--overlap", action="store_true", help="the overlapped mode (buckets during backward)")
    args = ap.parse_args()
    info = fastreduce.init_distributed()
    d = distances(info.rank, args.steps, args.overlap, info.device)
    if info.rank == 0:
        print(f"{info.world_size} ranks, {args.steps} steps, {'overlapped' if args.overlap else 'fused'}: "
              f"distance from the fp32-wire run: bf16 {d['bf16']:.3e}, "
              f"bf16 + error feedback {d['bf16_error_feedback']:.3e}", flush=True)
    leave()


if __name__ == "__main__":
    main()
