"""Hugging Face Accelerate training loop with fastreduce instead of DDP.

    torchrun --standalone --nproc-per-node 2 examples/accelerate_train.py              # bf16 wire, fused
    torchrun --standalone --nproc-per-node 2 examples/accelerate_train.py --overlap    # reduce during backward
    torchrun --standalone --nproc-per-node 2 examples/accelerate_train.py --mode zero  # or localsgd, diloco
    accelerate launch --num_processes 2 examples/accelerate_train.py                   # the same, by accelerate

The recipe: ``accelerator.prepare_model(model, evaluation_mode=True)`` places the model
and applies mixed precision and ``torch.compile`` but does not wrap it in DDP;
``broadcast_parameters`` gives every rank rank 0's weights (DDP's job at wrap time); a
``fastreduce.FusedReducer`` averages the gradients at the end of each accumulation
window, before clipping; the optimizer and the data loader are prepared as usual. Each
rank trains a small GPT-2 built from a config (no download) on its shard of a synthetic
corpus and checks at the end that it holds rank 0's exact parameters. Needs the ``hf``
extra: ``pip install 'fastreduce[hf]'``.

``--mode`` runs any mode through the trainers' registry
(:func:`fastreduce.integrations.modes.make_mode`): ``mode.build(model, optimizer)`` returns
the optimizer to step (ZeRO's sharded twin; the others the optimizer given), the loop
calls ``mode.no_sync()`` / ``mode.after_backward()`` around backward, clips through
``mode.clip_grad_norm_`` where the mode holds the gradients its own way (ZeRO), and
``mode.finish()`` at the end (LocalSGD and DiLoCo: a last sync; ZeRO: the last gather).
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

import fastreduce
from fastreduce.integrations.modes import MODES, make_mode
from fastreduce.integrations.transformers import broadcast_parameters
from hf_trainer import Progressions  # examples/hf_trainer.py
from train import DTYPES, integration_parser, leave, params_in_sync  # examples/train.py


def main() -> None:
    ap = integration_parser(__doc__)
    ap.add_argument("--mode", choices=sorted(MODES), default=None, help="a fastreduce mode (default: fused, or "
                    "overlap with --overlap)")
    args = ap.parse_args()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    # The process group and device as fastreduce picks them (HPU, CUDA, else CPU; a world
    # of one without torchrun); Accelerate runs CPU processes together only when told cpu=True.
    info = fastreduce.init_distributed()
    accelerator = Accelerator(gradient_accumulation_steps=args.accum, cpu=info.device.type == "cpu")
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(accelerator.process_index)  # ranks differ here on purpose: rank 0's weights win
    model = GPT2LMHeadModel(config)

    # --- the recipe: no DDP, rank 0's weights everywhere, a mode on the model and optimizer
    model = accelerator.prepare_model(model, evaluation_mode=True)
    broadcast_parameters(model)
    settings = {"localsgd": {"sync_every": 4}, "diloco": {"sync_every": 4}}.get(args.mode, {})
    if args.mode in (None, "fused", "overlap", "zero"):
        settings["wire_dtype"] = DTYPES[args.wire]
    mode = make_mode(args.mode or ("overlap" if args.overlap else "fused"), settings)
    optimizer = mode.build(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    loader = DataLoader(Progressions(2048), batch_size=args.batch, shuffle=True)
    optimizer, loader = accelerator.prepare(optimizer, loader)  # shards the data per rank

    model.train()
    step, t0 = 0, time.perf_counter()
    while step < args.steps:
        for batch in loader:
            with accelerator.accumulate(model):  # sets accelerator.sync_gradients
                with contextlib.nullcontext() if accelerator.sync_gradients else mode.no_sync():
                    loss = model(**batch).loss
                    accelerator.backward(loss)  # divides by the accumulation steps
                if accelerator.sync_gradients:
                    mode.after_backward()       # fused, overlap: average over the ranks; then clip and step
                    if mode.clip_grad_norm_(1.0) is None:
                        accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            if step % max(1, args.steps // 6) == 0 or step == args.steps:
                avg = accelerator.reduce(loss.detach(), reduction="mean")
                accelerator.print(f"step {step:4d}  loss {avg.item():.4f}")
            if step == args.steps:
                break
    elapsed = time.perf_counter() - t0

    mode.finish()
    in_sync = params_in_sync(model)
    figures = ", ".join(f"{k.split('/')[1]} {v:g}" for k, v in mode.figures(step).items())
    accelerator.print(f"{accelerator.num_processes} ranks on {accelerator.device}, wire {args.wire}, mode "
                      f"{mode.name}: {args.steps} steps in {elapsed:.1f}s ({figures}); "
                      f"parameters identical on all ranks: {in_sync}")
    leave(in_sync)


if __name__ == "__main__":
    main()
