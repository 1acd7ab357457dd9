"""Quantized wires: how far the averaged gradients are from their exact mean, per format.

    torchrun --standalone --nproc-per-node 4 examples/quantized_wire.py [--steps 20]

Each rank computes the gradients of a small byte-level GPT-2 (transformers, built from a
config) on its own batch, and a ``fastreduce.FusedReducer`` averages them through each
quantized wire (``torch.float8_e4m3fn``, ``torch.float8_e5m2``, ``"int8"``), without and
with ``error_feedback=True``, ``--steps`` times (the same gradients each time). It prints
the relative error (Frobenius norm) of one step's mean and of the sum of all steps' means
against the fp64 mean of the ranks' gradients: the table of docs/numerics.md.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import fastreduce
from fastreduce.bench.common import byte_gpt2
from train import leave  # examples/train.py (the script's folder is on sys.path)

WIRES = {"e4m3": getattr(torch, "float8_e4m3fn", None), "e5m2": getattr(torch, "float8_e5m2", None), "int8": "int8"}


def errors(wire: object, error_feedback: bool, steps: int, rank: int, world: int) -> tuple[float, float]:
    """(one step's relative error, the ``steps``-step sum's) of the mean through ``wire``."""
    model = byte_gpt2(2, 64, 64, seed=0)
    reducer = fastreduce.FusedReducer(model, wire_dtype=wire, error_feedback=error_feedback)
    batch = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(rank))
    first = got_sum = exact_sum = None
    for _ in range(steps):
        model.zero_grad(set_to_none=False)
        model(input_ids=batch, labels=batch).loss.backward()
        mine = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        exact = torch.stack(every).mean(0)
        reducer.reduce()
        got = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
        first = first if first is not None else float((got - exact).norm() / exact.norm())
        got_sum = got if got_sum is None else got_sum + got
        exact_sum = exact if exact_sum is None else exact_sum + exact
    return first, float((got_sum - exact_sum).norm() / exact_sum.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    info = fastreduce.init_distributed()
    for name, wire in WIRES.items():
        if wire is None:
            continue
        one, _ = errors(wire, False, args.steps, info.rank, info.world_size)
        _, summed = errors(wire, True, args.steps, info.rank, info.world_size)
        if info.rank == 0:
            print(f"{name}: one step {one:.2e}; {args.steps}-step sum with error feedback {summed:.2e} "
                  f"({info.world_size} ranks)", flush=True)
    leave()


if __name__ == "__main__":
    main()
