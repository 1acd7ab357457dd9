"""Hugging Face Trainer fine-tuning through fastreduce: ``FastReduceTrainer`` in place of ``Trainer``.

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py                  # bf16 wire, fused
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --overlap        # reduce during backward
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --wire fp32      # exactly DDP's average

Each rank trains a small GPT-2 built from a config (no download) on its shard of a
synthetic corpus (arithmetic progressions of token ids mod 256: learnable, so the loss
falls), with gradient accumulation and clipping. ``FastReduceTrainer`` keeps the model
out of DDP, broadcasts rank 0's weights once and averages the gradients with fastreduce
at the end of each accumulation window, before the Trainer clips and steps; the rest
(progress bar, logging, evaluation, the learning-rate schedule) is the stock Trainer.
At the end every rank checks that it holds rank 0's exact parameters. Needs the ``hf``
extra: ``pip install 'fastreduce[hf]'``.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from transformers.utils import logging as hf_logging

import fastreduce
from fastreduce.integrations.transformers import FastReduceTrainer
# examples/train.py (the script's folder is on sys.path)
from train import DTYPES, integration_parser, leave, params_in_sync


class Progressions(Dataset):
    """``n`` sequences ``(start + stride * j) % 256``: a causal LM can learn to continue them."""

    def __init__(self, n: int, length: int = 32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, 256, (n, 1), generator=g)
        stride = torch.randint(1, 8, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(length)) % 256

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train_and_check(model: GPT2LMHeadModel, info: fastreduce.DistInfo, args: argparse.Namespace,
                    output_dir: str) -> bool:
    """Train with ``FastReduceTrainer``, evaluate, print the figures on rank 0; True where every
    rank holds rank 0's exact parameters."""
    training_args = TrainingArguments(
        output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=args.batch, gradient_accumulation_steps=args.accum,
        learning_rate=3e-3, warmup_steps=max(1, args.steps // 10), max_grad_norm=1.0,
        logging_steps=max(1, args.steps // 6), save_strategy="no", report_to="none",
        use_cpu=info.device.type == "cpu", seed=0, dataloader_num_workers=0,
        disable_tqdm=False)  # the progress bar, though transformers logs only errors here
    trainer = FastReduceTrainer(
        model=model, args=training_args,
        train_dataset=Progressions(2048), eval_dataset=Progressions(64, seed=1),
        fastreduce_config=dict(wire_dtype=DTYPES[args.wire], overlap=args.overlap))
    trainer.train()
    metrics = trainer.evaluate()

    in_sync = params_in_sync(model)
    stats = trainer.fastreduce_reducer.stats if trainer.fastreduce_reducer else None
    if trainer.is_world_process_zero():
        print(f"eval loss {metrics['eval_loss']:.3f}; fastreduce: {stats.calls if stats else 0} reductions, "
              f"{stats.wait_seconds if stats else 0.0:.2f}s waited", flush=True)
        print(f"{info.world_size} ranks, wire {args.wire}, {'overlapped' if args.overlap else 'fused'}: "
              f"parameters identical on all ranks: {in_sync}", flush=True)
    return in_sync


def main() -> None:
    ap = integration_parser(__doc__)
    ap.add_argument("--output-dir", default=None, help="Trainer output directory (default: a temporary one)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # fastreduce's one-line summary
    hf_logging.set_verbosity_error()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    # The process group and device as fastreduce picks them (HPU, CUDA, else CPU); the
    # Trainer then finds the group initialized.
    info = fastreduce.init_distributed()
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)  # any rank's weights would do: rank 0's are broadcast
    # The Trainer wants an output folder even with nothing to save: a temporary one, removed
    # at the end, unless one is given.
    with tempfile.TemporaryDirectory(prefix="fastreduce-hf-") as scratch:
        in_sync = train_and_check(model, info, args, args.output_dir or scratch)
    leave(in_sync)


if __name__ == "__main__":
    main()
