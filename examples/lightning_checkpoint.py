"""Lightning with fastpersist: top-k checkpoints written in the background.

    python examples/lightning_checkpoint.py [OUTPUT_DIR]

Trains a tiny model for two epochs with ``FastPersistCheckpointIO`` and a
``ModelCheckpoint`` keeping the 2 newest checkpoints, then resumes from the
newest one for a third epoch.
"""

from __future__ import annotations

import os
import sys
import tempfile

import lightning.pytorch as pl
import torch
from fastpersist.integrations.lightning import FastPersistCheckpointIO


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin()), 32)


def trainer(out: str, epochs: int) -> pl.Trainer:
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=out, every_n_train_steps=4, save_top_k=2, monitor="step", mode="max")
    return pl.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        plugins=[FastPersistCheckpointIO(mode="snapshot")],
        callbacks=[ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="fp-lightning-")
    t = trainer(out, 2)
    t.fit(Tiny())
    files = sorted(os.listdir(out))
    print("checkpoints:", files)
    assert len(files) == 2, files
    newest = t.checkpoint_callback.best_model_path
    trainer(out, 3).fit(Tiny(), ckpt_path=newest)
    print("resumed from", os.path.basename(newest))


if __name__ == "__main__":
    main()
