"""A member of a fault-tolerant job as a user writes one (docs/faults.md): a plain process, the
coordinator from ``FASTREDUCE_COORDINATOR``, the fused reducer (or ``zero``: ``ZeroOptimizer``
with ``redundant=True``, the mode and the optimizer in one).

    python -m fastreduce.bench.user.member STEPS [MODE] [OUT]

The job's size comes from ``FASTREDUCE_WORLD_SIZE`` (default 3), its floor from
``FASTREDUCE_MIN_RANKS`` (default 2), the member's name from ``FASTREDUCE_MEMBER`` where set;
``FASTREDUCE_SPARE=1`` makes it a warm spare (it waits until a member is missing, and exits
0 where the job ends without needing it).
It prints ``step N world W`` as it commits and its parameters' digest at the end; with
``OUT``, it also keeps ``OUT/<member>.json`` current (its step, world, losses counted,
digest and Slurm step id). A pause of 50 ms a step stands in for a real model's work. It is
``fastreduce bench exits``' membership script and the one the Slurm and Kubernetes recipes
start (examples/slurm, examples/kubernetes): put your own training script in its place."""

import hashlib
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch

import fastreduce


def digest(model: torch.nn.Module) -> str:
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(params.numpy().tobytes()).hexdigest()[:16]


def main() -> None:
    steps, mode = int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "fused"
    out = Path(sys.argv[3]) if len(sys.argv) > 3 else None
    name = os.environ.get("FASTREDUCE_MEMBER")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    m = fastreduce.Membership(world_size=int(os.environ.get("FASTREDUCE_WORLD_SIZE", "3")),
                              min_ranks=int(os.environ.get("FASTREDUCE_MIN_RANKS", "2")), tag=mode, member=name,
                              spare=os.environ.get("FASTREDUCE_SPARE") == "1")
    if mode == "zero":
        m.join({"model": model}, lambda: fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2,
                                                                  module=model, redundant=True))
    else:
        m.join({"model": model, "optimizer": opt}, lambda: fastreduce.FusedReducer(model))
    if m.left:  # a spare the job ended without needing: it exits 0
        print("spare: the job ended without needing it", flush=True)
        m.close()
        return
    facts = {"member": name or f"{socket.gethostname()}-{os.getpid()}", "step_id": os.environ.get("SLURM_STEP_ID")}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    while m.step < steps and not m.left:  # (left: asked to by the straggler policy)
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1000 * m.step + m.rank))
        torch.nn.functional.mse_loss(model(x).squeeze(-1), x.sum(1).sin()).backward()
        stepper = m.mode if mode == "zero" else opt
        if m.commit(stepper.step):
            print(f"step {m.step} world {m.world}", flush=True)
        stepper.zero_grad()
        if out is not None:
            facts.update(step=m.step, world=m.world, losses=m.counters.losses, digest=digest(model))
            part = out / f"{facts['member']}.json.part"
            part.write_text(json.dumps(facts))
            part.replace(out / f"{facts['member']}.json")
        time.sleep(0.05)
    print("digest", digest(model), flush=True)
    m.close()  # (the last member to close tells a spare still waiting that the job is over)


if __name__ == "__main__":
    main()
