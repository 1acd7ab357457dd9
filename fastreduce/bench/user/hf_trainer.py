"""A user's HF Trainer script in a fastreduce mode: a tiny Llama from a config, random tokens,
``save_steps``; ``torchrun --standalone --nproc-per-node 2 hf_trainer.py MODE OUTPUT_DIR``."""

import sys

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from fastreduce.integrations.transformers import FastReduceTrainer


class Tokens(Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, 128, (n, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    mode, output_dir = sys.argv[1], sys.argv[2]
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=output_dir, max_steps=16, per_device_train_batch_size=4, save_steps=8,
                             logging_steps=4, report_to="none", use_cpu=True, disable_tqdm=True)
    settings = {"sync_every": 4} if mode in ("localsgd", "diloco") else None  # the local modes need their period
    FastReduceTrainer(model=LlamaForCausalLM(config), args=args, train_dataset=Tokens(256),
                      fastreduce_mode=mode, fastreduce_config=settings).train()


if __name__ == "__main__":
    main()
