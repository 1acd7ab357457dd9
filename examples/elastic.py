"""Elastic training: a job that torchrun restarts after a crash resumes exactly where it was.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 --max-restarts 3 \
        examples/elastic.py --mode zero --dir /tmp/ckpt --kill-rank 1 --kill-at-step 13 --out /tmp/final.pt

Each rank trains a small classifier (with dropout: the random generators matter) in
any mode (``--mode fused|overlap|zero|gossip|local|diloco``, set up as in
``examples/train.py``, the fused and overlapped ones with a bf16 wire and error
feedback), on batches drawn from a generator seeded by (step, rank), so a step's data
does not depend on when the job started. Every ``--every`` steps
``fastreduce.checkpoint.Checkpointer`` saves everything; at start ``load_latest()``
restores the newest complete checkpoint. ``--kill-rank R --kill-at-step S`` SIGKILLs
rank R as it reaches step S, on the first attempt only (``TORCHELASTIC_RESTART_COUNT``
is 0): torchrun stops the other ranks, starts the job again, and it resumes from the
last checkpoint. ``--out`` gets every rank's final parameters, the attempt and the step
each rank resumed from; the run's parameters equal an uninterrupted run's.

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: by default torchrun (2.4 and later) keeps one
store for all attempts, and a restarted rank can read a peer's address left there by
the attempt that died: Gloo then fails "Connection refused" (pytorch#135712). With it
set, every attempt gets a fresh store.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist
from torch import nn

import fastreduce
from fastreduce.checkpoint import Checkpointer
from train import leave, make_data, make_model, params_in_sync  # examples/train.py (the script's folder is on sys.path)

MODES = ("fused", "overlap", "zero", "gossip", "local", "diloco")
WIRE = torch.bfloat16


class Job:
    """One mode's objects (set up as in ``examples/train.py``) and its training step.

    ``net`` is what forward runs (the gossip wrapper, else the model), ``opt`` the
    optimizer the loop steps (``None`` for gossip: its buckets step in backward),
    ``mode`` the mode object for the :class:`Checkpointer` (``None`` for
    ``all_reduce_gradients`` and ZeRO)."""

    def __init__(self, mode: str, model: nn.Module, lr: float = 3e-3):
        adamw = lambda params: torch.optim.AdamW(params, lr=lr)  # noqa: E731
        self.kind, self.model, self.net, self.mode = mode, model, model, None
        self.opt: torch.optim.Optimizer | None = None
        if mode == "fused":  # all_reduce_gradients in step(); its residuals are saved from the model
            self.opt = adamw(model.parameters())
        elif mode == "overlap":
            self.opt = adamw(model.parameters())
            self.mode = fastreduce.FusedReducer(model, wire_dtype=WIRE, overlap=True, error_feedback=True)
        elif mode == "zero":
            self.opt = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=lr, wire_dtype=WIRE,
                                                module=model)
        elif mode == "gossip":
            self.net = self.mode = fastreduce.DecentralizedDataParallel(
                model, lambda named: adamw([p for _, p in named]), topology="one-peer-exp", wire_dtype=WIRE)
        elif mode == "local":
            self.opt = adamw(model.parameters())
            self.mode = fastreduce.LocalSGD(model, self.opt, sync_every=4, warmup_steps=3, wire_dtype=WIRE)
        elif mode == "diloco":
            self.opt = adamw(model.parameters())
            outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
            self.mode = fastreduce.DiLoCo(model, self.opt, outer, sync_every=6, fragments=2, fragment_delay=1,
                                          wire_dtype=WIRE)
        else:
            raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")

    def checkpointer(self, directory: str, keep: int = 2) -> Checkpointer:
        return Checkpointer(directory, self.model, self.opt, mode=self.mode, keep=keep)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        nn.functional.cross_entropy(self.net(x), y).backward()
        if self.opt is None:
            return  # gossip: stepped in backward
        if self.kind == "fused":
            fastreduce.all_reduce_gradients(self.model, WIRE, error_feedback=True)
        elif isinstance(self.mode, fastreduce.FusedReducer):
            self.mode.reduce()
        self.opt.step()
        self.opt.zero_grad()

    def settle(self) -> None:
        """Wait for what is in flight before reading the parameters."""
        if self.kind == "gossip":
            self.net.wait_exchanges()
        elif self.kind == "zero":
            self.opt.wait_params()


def make_net() -> nn.Module:
    """The classifier, behind dropout (so the random generators matter)."""
    return nn.Sequential(nn.Dropout(0.1), make_model(dim=16, hidden=32, classes=4, depth=1))


def train(mode: str, directory: str, *, steps: int = 24, every: int = 5, batch: int = 32, lr: float = 3e-3,
          kill_rank: int = -1, kill_at_step: int = -1) -> dict[str, object]:
    """Train ``steps`` steps in ``mode``, resuming from and saving to ``directory``; return
    this rank's final parameters, the attempt and the step it resumed at."""
    info = fastreduce.init_distributed()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)  # the same initial weights on every rank
    model = make_net().to(info.device)
    torch.manual_seed(1 + info.rank)  # each rank its own dropout masks
    job = Job(mode, model, lr)
    ckpt = job.checkpointer(directory)
    start = ckpt.load_latest()
    print(f"rank {info.rank}: attempt {attempt}, resuming at step {start}", flush=True)

    x, y = make_data(2048, 16, 4)
    x, y = x.to(info.device), y.to(info.device)
    for step in range(start, steps):
        if step == kill_at_step and info.rank == kill_rank and attempt == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        gen = torch.Generator().manual_seed(1000 * step + info.rank)  # this step's batch, whenever it runs
        idx = torch.randint(0, x.shape[0], (batch,), generator=gen).to(info.device)
        job.step(x[idx], y[idx])
        if (step + 1) % every == 0:
            ckpt.save(step + 1)
    job.settle()
    if mode in ("fused", "overlap", "zero") and not params_in_sync(model):
        raise RuntimeError("parameters diverged across ranks")
    return {"params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
            "attempt": attempt, "resumed_at": start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=MODES, default="fused")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=5, help="save a checkpoint every this many steps")
    ap.add_argument("--dir", required=True, help="checkpoint directory")
    ap.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--kill-rank", type=int, default=-1, help="the rank to SIGKILL (first attempt only)")
    ap.add_argument("--kill-at-step", type=int, default=-1, help="the step at which it dies")
    ap.add_argument("--out", help="write every rank's final parameters here (torch.save)")
    args = ap.parse_args()

    mine = train(args.mode, args.dir, steps=args.steps, every=args.every, batch=args.batch, lr=args.lr,
                 kill_rank=args.kill_rank, kill_at_step=args.kill_at_step)
    everyone: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if args.out and dist.get_rank() == 0:
        torch.save({"ranks": everyone, "mode": args.mode, "steps": args.steps}, args.out)
    leave()


if __name__ == "__main__":
    main()
