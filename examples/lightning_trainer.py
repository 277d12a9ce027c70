"""A Lightning Trainer communicating through thinwire: the strategy is the only change.

    python examples/lightning_trainer.py --method powersgd:rank=2         # Lightning starts 2 processes
    python examples/lightning_trainer.py --method localsgd:period=8 --devices 4
    torchrun --nproc-per-node 2 examples/lightning_trainer.py --method hylo

Logs thinwire's figures (bytes sent, seconds in codecs and collectives) with the training
loss to TensorBoard under lightning_logs/ when the tensorboard package is installed.
"""

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import thinwire.lightning


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        self.log_dict(self.trainer.strategy.scalars())  # thinwire/bytes_sent, thinwire/comm_seconds, ...
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def data(samples: int = 4096) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 32, generator=g)
    y = (x @ torch.randn(32, 4, generator=g)).argmax(1)
    return DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", default="powersgd:rank=2", help="any codec, policy or model-averaging method spec")
    p.add_argument("--devices", type=int, default=2, help="processes (default: 2)")
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    strategy = thinwire.lightning.strategy(args.method)  # <- the one change
    trainer = pl.Trainer(accelerator="auto", devices=args.devices, strategy=strategy, max_epochs=args.epochs,
                         log_every_n_steps=10, enable_model_summary=False)
    trainer.fit(Classifier(), data())
    if trainer.is_global_zero:
        figures = strategy.scalars()
        print(f"{strategy.spec}: {figures['thinwire/bytes_sent'] / 1e6:.2f} MB sent by rank 0, "
              f"final train loss {trainer.callback_metrics['train_loss'].item():.4f}")


if __name__ == "__main__":
    main()
