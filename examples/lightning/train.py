"""A PyTorch Lightning `Trainer` (DDP) that keeps training under elastic changes.

Run it under elasticrun (or torchrun) on any number of nodes, every node with the same
command and the same shared checkpoint folder:

    python -m elasticrun --nnodes=1:4 --nproc-per-node=gpu --rdzv-backend=c10d \
        --rdzv-endpoint=host0:29400 --rdzv-id=lit examples/lightning/train.py \
        --max-steps 300 --checkpoint-dir /shared/lit-ckpt

What makes it elastic (see README.md next to it):
- the Trainer's size comes from the launcher's environment on every start
  (`num_nodes` = WORLD_SIZE / LOCAL_WORLD_SIZE, `devices` = LOCAL_WORLD_SIZE), so a
  restart at another world size builds a matching Trainer;
- `ModelCheckpoint(save_last=True, every_n_train_steps=N)` rewrites `last.ckpt` every
  N steps, written beside it and renamed into place (never half a file, even on a
  shared filesystem), and `fit(ckpt_path="last")` resumes from it on every (re)start;
- the data is a stream drawn per rank, seeded by the rank and the step it resumes
  from, so a new world size needs no re-sharding.

Rank 0 prints one line per step, and where it (re)starts:

    start at step 20: world size 1, restart count 0
    Step #21  Loss: 0.20307  (world size 1)

The data is generated (a noisy linear function), so nothing is downloaded. CPU (gloo)
when there is no GPU, one GPU per process (nccl) when there are.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins import TorchCheckpointIO
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

import elasticrun.worker.callbacks

DIM = 16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-steps", type=int, default=200, help="total optimizer steps")
    p.add_argument("--batch-size", type=int, default=32, help="per-process batch size")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--checkpoint-dir", default="/tmp/elasticrun-lightning-ckpt", help="shared by every node")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (to watch it)")
    return p.parse_args()


class NoisyLinear(IterableDataset):
    """An endless stream of (x, y = x @ w + noise) samples: w is the same everywhere,
    the samples are this rank's own (seeded by the start step and the rank)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.w = torch.randn(DIM, 1, generator=torch.Generator().manual_seed(0))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(self.seed)
        while True:
            x = torch.randn(DIM, generator=g)
            yield x, x @ self.w + 0.01 * torch.randn(1, generator=g)


class Regression(pl.LightningModule):
    def __init__(self, lr: float, batch_size: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> DataLoader:
        # Lightning asks for the data after it has restored the checkpoint, so
        # global_step is the step this (re)start resumes from.
        seed = self.trainer.global_step * 1009 + self.global_rank
        return DataLoader(NoisyLinear(seed), batch_size=self.hparams.batch_size)


class RenamedCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint beside its target, then renames it into place.

    Lightning's own save stages the file in the system's temporary folder and moves it;
    on a shared filesystem (where a multi-node job keeps its checkpoints) that move is a
    copy, and a node killed during it leaves half a last.ckpt that no restart can load.
    A rename within one folder is atomic. (The staging name does not end in .ckpt, so
    `ckpt_path="last"` never picks one a killed writer left behind.)
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        staging = f"{path}.partial-{os.getpid()}"
        super().save_checkpoint(checkpoint, staging, storage_options)
        os.replace(staging, path)


class Report(pl.Callback):
    """Rank 0's lines: where this start resumes, then one line per step."""

    def __init__(self, step_time: float) -> None:
        self.step_time = step_time

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            print(f"start at step {trainer.global_step}: world size {trainer.world_size}, "
                  f"restart count {restarts}", flush=True)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: dict[str, torch.Tensor],
        batch: object, batch_idx: int,
    ) -> None:
        if trainer.is_global_zero:
            loss = outputs["loss"].item()
            print(f"Step #{trainer.global_step}  Loss: {loss:.5f}  (world size {trainer.world_size})", flush=True)
        time.sleep(self.step_time)


def main() -> None:
    args = parse_args()
    # the launcher's environment says how big the job is now; the Trainer must agree
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    checkpoints = ModelCheckpoint(
        dirpath=args.checkpoint_dir,
        every_n_train_steps=args.checkpoint_every,
        save_top_k=0,  # only last.ckpt: elastic resume needs the newest, nothing else
        save_last=True,
        enable_version_counter=False,  # a restart overwrites last.ckpt, not last-v1.ckpt
    )
    trainer = pl.Trainer(
        accelerator="auto",
        devices=local,
        num_nodes=world // local,
        strategy="ddp",
        max_steps=args.max_steps,
        # elasticrun's: each batch is progress (--progress-timeout) and a step for the straggler check
        callbacks=[Report(args.step_time), checkpoints, elasticrun.worker.callbacks.lightning()],
        plugins=[RenamedCheckpointIO()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(args.lr, args.batch_size), ckpt_path="last")
    if trainer.is_global_zero:
        print(f"done at step {trainer.global_step}: world size {trainer.world_size}", flush=True)


if __name__ == "__main__":
    main()
