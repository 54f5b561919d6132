"""Lightning's own demo transformer, trained with strategy="ddp" or "acco": the one-line change, as a new user makes it.

    python examples/lightning/train.py --strategy ddp
    python examples/lightning/train.py --strategy acco

The module is ``lightning.pytorch.demos.LightningTransformer`` (Lightning's documentation example), with
``configure_optimizers`` returning AdamW and a scheduler stepped every update, as Lightning's
``configure_optimizers`` documentation shows; Lightning launches the 2 CPU processes itself (``devices=2``;
``--accelerator gpu --devices N`` for N GPUs).
The data is random tokens: the demo's WikiText2 needs a download. ``docs/integrations.md`` records what it
printed.
"""

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.demos import LightningTransformer

import acco.integrations.lightning  # noqa: F401  registers strategy="acco"


class Model(LightningTransformer):
    def prepare_data(self):
        pass  # the demo downloads WikiText2 here: the data below is generated instead

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def validation_step(self, batch, batch_idx):
        inputs, target = batch
        loss = torch.nn.functional.nll_loss(self(inputs, target), target.view(-1))
        self.log("val_loss", loss, sync_dist=True)


def tokens(n: int, seed: int) -> TensorDataset:
    """Random sequences with structure to learn: each token is the previous one plus 1 (mod 100), mostly."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 100, (n, 1), generator=g)
    seq = (start + torch.arange(36)) % 100
    noise = torch.rand(n, 36, generator=g) < 0.1
    seq = torch.where(noise, torch.randint(0, 100, (n, 36), generator=g), seq)
    return TensorDataset(seq[:, :-1], seq[:, 1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="acco")
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--accelerator", default="cpu", help="cpu (default) or gpu")
    p.add_argument("--devices", type=int, default=2, help="processes Lightning launches (one per GPU on gpu)")
    args = p.parse_args()
    pl.seed_everything(0)
    trainer = pl.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=args.strategy, max_epochs=args.epochs,
                         accumulate_grad_batches=args.accumulate, gradient_clip_val=1.0, logger=False,
                         enable_checkpointing=False)
    model = Model(vocab_size=100)
    trainer.fit(model, DataLoader(tokens(512, 1), batch_size=16), DataLoader(tokens(128, 2), batch_size=32))
    result = trainer.validate(model, DataLoader(tokens(128, 2), batch_size=32), verbose=False)
    if trainer.global_rank == 0:
        print(f"strategy={args.strategy}: {trainer.global_step} updates, held-out loss {result[0]['val_loss']:.4f}")


if __name__ == "__main__":
    main()
