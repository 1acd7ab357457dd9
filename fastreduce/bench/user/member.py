"""A member of a fault-tolerant job as a user writes one (docs/faults.md): plain processes,
``FASTREDUCE_COORDINATOR`` set, the fused reducer (or ``zero``: ``ZeroOptimizer`` with
``redundant=True``, the mode and the optimizer in one); ``python member.py STEPS [MODE]``. It
prints ``step N`` as it commits and its parameters' digest at the end."""

import hashlib
import sys
import time

import torch

import fastreduce


def main() -> None:
    steps, mode = int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "fused"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    m = fastreduce.Membership(world_size=3, min_ranks=2, tag=mode)
    if mode == "zero":
        m.join({"model": model}, lambda: fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2,
                                                                  module=model, redundant=True))
    else:
        m.join({"model": model, "optimizer": opt}, lambda: fastreduce.FusedReducer(model))
    while m.step < steps:
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1000 * m.step + m.rank))
        torch.nn.functional.mse_loss(model(x).squeeze(-1), x.sum(1).sin()).backward()
        stepper = m.mode if mode == "zero" else opt
        if m.commit(stepper.step):
            print(f"step {m.step} world {m.world}", flush=True)
        stepper.zero_grad()
        time.sleep(0.05)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    print("digest", hashlib.sha256(params.numpy().tobytes()).hexdigest()[:16], flush=True)


if __name__ == "__main__":
    main()
