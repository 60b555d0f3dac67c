"""A healthy Lightning ``Trainer`` job for tests/gpu/test_real_faults.py (started by torchrun).

A small MLP regression with validation every ``--every`` steps and ``ModelCheckpoint`` saving
every ``--every`` steps, two DataLoader workers. It prints ``ready`` once training has begun and
trains until it is killed. Nothing here knows gpuwatchd.
"""

from __future__ import annotations

import argparse
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1))

    def training_step(self, batch, i):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.global_step == 1:
            print("ready", flush=True)
        return loss

    def validation_step(self, batch, i):  # type: ignore[no-untyped-def]
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def loader(n: int) -> DataLoader:  # type: ignore[type-arg]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 512, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=64, num_workers=2, persistent_workers=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--every", type=int, default=50)
    args = ap.parse_args()
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=args.out, every_n_train_steps=args.every, save_top_k=-1)
    trainer = L.Trainer(
        accelerator="gpu",
        devices=1,
        max_epochs=-1,
        val_check_interval=args.every,
        check_val_every_n_epoch=None,
        limit_val_batches=20,
        callbacks=[ckpt],
        enable_progress_bar=False,
        logger=False,
        default_root_dir=args.out,
    )
    trainer.fit(Net(), loader(64 * 400), loader(64 * 20))


if __name__ == "__main__":
    sys.exit(main())
