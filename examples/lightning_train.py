"""Lightning training with fastreduce averaging the gradients: ``FastReduceStrategy``.

    torchrun --standalone --nproc-per-node 2 examples/lightning_train.py                  # bf16 wire
    torchrun --standalone --nproc-per-node 2 examples/lightning_train.py --wire fp32 --overlap
    python examples/lightning_train.py      # the same; Lightning starts the second process itself

A LightningModule classifier trains on a synthetic data set that Lightning shards per
rank (its DistributedSampler), with gradient accumulation and gradient clipping, under
``Trainer(strategy=FastReduceStrategy(...))``: Lightning's DDP strategy without the DDP
wrapper, the gradients averaged by ``fastreduce.FusedReducer`` after the last backward
of each accumulation window (``--overlap``: during it), before clipping. At the end
every rank checks that it holds bit-identical parameters. Runs on CPU (gloo) by
default; ``--accelerator gpu`` for CUDA (nccl).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn as nn
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from fastreduce.integrations.lightning import FastReduceStrategy
from train import leave, make_data, params_in_sync  # examples/train.py (the script's folder is on sys.path)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class Classifier(LightningModule):
    """An MLP classifier; nothing in it knows about fastreduce."""

    def __init__(self, dim: int = 32, hidden: int = 128, classes: int = 8, depth: int = 4, lr: float = 3e-3):
        super().__init__()
        self.lr = lr
        layers: list[nn.Module] = [nn.Linear(dim, hidden), nn.GELU()]
        for _ in range(depth):
            layers += [nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.GELU()]
        self.net = nn.Sequential(*layers, nn.Linear(hidden, classes))
        self.loss_fn = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.log("loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps")
    ap.add_argument("--batch", type=int, default=32, help="per-rank micro-batch size")
    ap.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--wire", choices=sorted(DTYPES), default="bf16", help="dtype on the wire")
    ap.add_argument("--overlap", action="store_true", help="reduce buckets during backward")
    ap.add_argument("--accelerator", default="cpu")
    ap.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 2)),
                    help="processes on this host (under torchrun: its --nproc-per-node)")
    args = ap.parse_args()
    if args.accelerator == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.devices))

    torch.manual_seed(0)
    model = Classifier()
    strategy = FastReduceStrategy(wire_dtype=DTYPES[args.wire], overlap=args.overlap)
    trainer = Trainer(accelerator=args.accelerator, devices=args.devices, strategy=strategy,
                      max_steps=args.steps, accumulate_grad_batches=args.accumulate, gradient_clip_val=1.0,
                      logger=False, enable_checkpointing=False, enable_model_summary=False,
                      log_every_n_steps=10)
    data = TensorDataset(*make_data(4096, 32, 8))
    t0 = time.perf_counter()
    trainer.fit(model, DataLoader(data, batch_size=args.batch, shuffle=True))
    elapsed = time.perf_counter() - t0

    model.eval()
    device = trainer.strategy.root_device
    x, y = data.tensors
    with torch.no_grad():
        acc = (model(x.to(device)).argmax(dim=1) == y.to(device)).float().mean()
    in_sync = params_in_sync(model)
    stats = strategy.reducer.stats
    if trainer.is_global_zero:
        print(f"{trainer.world_size} ranks on {device} ({strategy.process_group_backend}), fastreduce "
              f"{'overlapped' if args.overlap else 'fused'}, wire {args.wire}: {trainer.global_step} steps "
              f"({args.accumulate} micro-batches each) in {elapsed:.1f}s, {stats.calls} reduces"
              f"{f' ({stats.launched_in_backward} buckets started in backward)' if args.overlap else ''}, "
              f"train accuracy {acc.item():.1%}, parameters identical on all ranks: {in_sync}", flush=True)
    leave(in_sync)


if __name__ == "__main__":
    main()
