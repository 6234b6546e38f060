"""Hugging Face Trainer with fastpersist: a tiny GPT-2 built from a config.

    python examples/transformers_trainer.py [OUTPUT_DIR]

Trains 6 steps, checkpointing every 2 (``save_total_limit=2``), through
``FastPersistTrainerMixin``; then a new trainer resumes from the newest
complete checkpoint and trains to step 8. No downloads.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
from fastpersist.integrations.transformers import FastPersistTrainerMixin
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class FastTrainer(FastPersistTrainerMixin, Trainer):
    pass


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="fp-hf-")
    ids = torch.randint(0, 128, (64, 32), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x} for x in ids]

    def run(max_steps: int, resume: bool) -> None:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32))
        args = TrainingArguments(
            output_dir=out,
            max_steps=max_steps,
            save_steps=2,
            save_total_limit=2,
            per_device_train_batch_size=8,
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
        )
        FastTrainer(model=model, args=args, train_dataset=data).train(resume_from_checkpoint=resume or None)

    run(6, resume=False)
    print("checkpoints:", sorted(os.listdir(out)))
    run(8, resume=True)
    print("after resuming:", sorted(os.listdir(out)))


if __name__ == "__main__":
    main()
