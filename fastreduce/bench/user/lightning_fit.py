"""A user's Lightning script in a fastreduce strategy: ``torchrun --standalone --nproc-per-node 2
lightning_fit.py MODE OUTPUT_DIR`` (a checkpoint every 8 steps)."""

import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import fastreduce  # noqa: F401 - fastreduce's strategy names
from fastreduce.integrations.lightning import FastReduceStrategy


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def training_step(self, batch: list, _index: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    mode, output_dir = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8)
    # a mode by name; the local modes need their period, so they take the strategy object
    strategy = {"fused": "fastreduce", "localsgd": FastReduceStrategy("localsgd", sync_every=4),
                "diloco": FastReduceStrategy("diloco", sync_every=4)}.get(mode, f"fastreduce_{mode}")
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=16, default_root_dir=output_dir,
                        logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[ModelCheckpoint(dirpath=output_dir, every_n_train_steps=8)])
    trainer.fit(Regression(), data)


if __name__ == "__main__":
    main()
