"""One member of a fault-tolerant job, as a cluster manager starts it: a plain process (Slurm: a
job step of its own, examples/slurm/membership.sbatch; Kubernetes: a pod of an indexed Job,
examples/kubernetes/fastreduce-job.yaml). ``python member.py STEPS OUT``: it trains a small
model through ``fastreduce.Membership`` (the coordinator from ``FASTREDUCE_COORDINATOR``, the
job's size from ``FASTREDUCE_WORLD_SIZE``, its name from ``FASTREDUCE_MEMBER`` where set),
writes the step it reached, its Slurm step id and its parameters' digest to
``OUT/<member>.json`` as it goes, and exits 0 once the job reached STEPS. A member started
while the job runs (a pod restarted in place) joins it with the job's state. Put your own
training loop in its place."""

import hashlib
import json
import os
import socket
import sys
from pathlib import Path

import torch

import fastreduce


def main() -> None:
    steps, out = int(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    name, world = os.environ.get("FASTREDUCE_MEMBER"), int(os.environ["FASTREDUCE_WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)  # one initial model (a joiner gets the job's state anyway)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    m = fastreduce.Membership(world_size=world, min_ranks=max(1, world // 2), member=name)
    m.join({"model": model, "optimizer": opt}, lambda: fastreduce.FusedReducer(model))
    name = name or f"{socket.gethostname()}-{os.getpid()}"
    facts = {"member": name, "step_id": os.environ.get("SLURM_STEP_ID"), "job": os.environ.get("SLURM_JOB_ID")}
    while m.step < steps:
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 * m.step + m.rank))
        torch.nn.functional.mse_loss(model(x).squeeze(-1), x.sum(1).sin()).backward()
        m.commit(opt.step)
        opt.zero_grad()
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        facts.update(step=m.step, world=m.world, losses=m.counters.losses,
                     digest=hashlib.sha256(params.numpy().tobytes()).hexdigest()[:16])
        (out / f"{name}.json.part").write_text(json.dumps(facts))
        (out / f"{name}.json.part").replace(out / f"{name}.json")
    m.close()


if __name__ == "__main__":
    main()
