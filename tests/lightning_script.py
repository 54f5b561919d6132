"""A tiny LightningModule trained under torchrun with Lightning's "ddp" or acco's "acco" strategy (tests/test_lightning.py).

    torchrun --standalone --nproc_per_node=2 tests/lightning_script.py --strategy acco --out r.json [--ckpt-dir D]
        [--resume-from F] [--max-steps N] [--accumulate 4] [--clip 1.0]

The module is what Lightning's documentation shows: ``training_step`` returns the loss, ``validation_step`` logs
one, ``configure_optimizers`` returns AdamW and a scheduler stepped every update. The data is the same for both
strategies (Lightning shards it over the ranks with its distributed sampler). Rank 0 writes ``--out``: the
held-out loss, the final weights, the learning rate the optimizer held after every update, and how many updates
ran.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl


class Regression(pl.LightningModule):
    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
        self.lrs = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        total = self.trainer.estimated_stepping_batches
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5 * (1 + math.cos(math.pi * min(t, total) / total)))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(n: int, seed: int):
    """``n`` samples of one fixed function (the same for every ``seed``), noisy."""
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(0)) * 0.5
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, torch.tanh(x @ w) + 0.1 * torch.randn(n, 1, generator=g))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="acco")
    p.add_argument("--mode", default="acco")
    p.add_argument("--accumulate", type=int, default=4)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--ckpt-dir", default=None, help="a ModelCheckpoint saving every epoch here")
    p.add_argument("--resume-from", default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    pl.seed_everything(0, workers=True)
    strategy = args.strategy
    if strategy == "acco":
        from acco.integrations.lightning import AccoStrategy

        strategy = AccoStrategy(mode=args.mode)
    callbacks = []
    if args.ckpt_dir:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, save_top_k=-1, every_n_epochs=1))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=args.epochs,
                         max_steps=args.max_steps, accumulate_grad_batches=args.accumulate, gradient_clip_val=args.clip,
                         callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=bool(callbacks), deterministic=True)
    model = Regression()
    train = DataLoader(data(512, 1), batch_size=8, shuffle=True)
    val = DataLoader(data(256, 2), batch_size=64)
    trainer.fit(model, train, val, ckpt_path=args.resume_from)
    result = trainer.validate(model, val, verbose=False)[0]
    if trainer.global_rank == 0:
        with open(args.out, "w") as f:
            json.dump({"val_loss": result["val_loss"], "steps": trainer.global_step, "lrs": model.lrs,
                       "weights": [float(v) for v in torch.cat([q.detach().reshape(-1) for q in model.parameters()])],
                       "clip_after": trainer.gradient_clip_val, "world": int(os.environ.get("WORLD_SIZE", "1"))}, f)
    if args.strategy != "acco":  # Lightning's own strategies leave the group to interpreter exit (pytorch#190489):
        torch.distributed.barrier()  # a clean shutdown for the baseline; strategy="acco" must need no such lines
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
