"""A healthy Hugging Face ``Trainer`` job for tests/gpu/test_real_faults.py (started by torchrun).

GPT-2's shape at a small size (built from a config: the device has no network), a random token
dataset, evaluation and a checkpoint every ``--every`` steps, two DataLoader workers. It prints
``ready`` once training has begun and trains until it is killed. Nothing here knows gpuwatchd.
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int, length: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


class SayReady(TrainerCallback):  # type: ignore[misc]
    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == 1:
            print("ready", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--every", type=int, default=40)
    args = ap.parse_args()
    cfg = GPT2Config(n_layer=4, n_head=8, n_embd=512, n_positions=256, vocab_size=8192)
    model = GPT2LMHeadModel(cfg)
    targs = TrainingArguments(
        output_dir=args.out,
        max_steps=10**6,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        eval_strategy="steps",
        eval_steps=args.every,
        save_strategy="steps",
        save_steps=args.every,
        save_total_limit=2,
        logging_steps=args.every,
        dataloader_num_workers=2,
        report_to=[],
        bf16=True,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=Tokens(4096, 128, cfg.vocab_size),
        eval_dataset=Tokens(256, 128, cfg.vocab_size),
        callbacks=[SayReady()],
    )
    trainer.train()


if __name__ == "__main__":
    sys.exit(main())
