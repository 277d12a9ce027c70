"""Run under torchrun with two CPU processes: Lightning Trainers with thinwire strategies,
each against the same training in a plain loop (the reference), and an exact resume.

Writes ``rank<R>.json`` into the directory given as the first argument."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import thinwire
import thinwire.lightning

warnings.filterwarnings("ignore")  # Lightning's advice on workers and logging
BATCH, LR = 8, 0.1
# with gradient accumulation: a codec through DDP's no_sync, and DaSGD's warm-up and delayed averages
# (a fixed delay: delay=auto picks it from the warm-up's measured times, which differ from run to run)
ACCUMULATED = ("powersgd:rank=2", "dasgd:period=2,warmup=2,delay=1")


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    return TensorDataset(x, (x[:, :4].sum(1) > 0).long())


OVERFLOW_STEP = 2  # with a scaler: rank 1's loss is inf at this step, so every rank skips it


def overflow(loss: torch.Tensor, step: int) -> torch.Tensor:
    return loss * float("inf") if step == OVERFLOW_STEP and int(os.environ["RANK"]) == 1 else loss


class Net(pl.LightningModule):
    def __init__(self, amp: bool = False) -> None:
        super().__init__()
        self.amp = amp
        torch.manual_seed(1)
        # BatchNorm: buffers that DDP would broadcast from rank 0 (the model-averaging methods keep their own)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                       torch.nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self.amp:
            loss = overflow(loss, self.global_step)
        self.log_dict(self.trainer.strategy.scalars())  # the figures a logger takes, in one call
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def val_dataloader(self):
        return loader()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        return loader()


class ManualNet(Net):
    """The same training with manual optimization: the user's own backward and step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.manual_backward(loss)  # thinwire's after_backward follows it
        opt.step()  # and after_step follows the step
        return loss


def loader() -> DataLoader:
    """Each rank's shard, shuffled per epoch (Lightning calls ``set_epoch`` as the reference does)."""
    return DataLoader(dataset(), batch_size=BATCH, sampler=DistributedSampler(dataset(), shuffle=True, seed=0))


def scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=2.0**10)


def fit(method: str, epochs: int, ckpt: str | None = None, save: str | None = None, amp: bool = False,
        accumulate: int = 1):
    model = Net(amp)
    strategy = thinwire.lightning.strategy(method)
    # fp16 autocast with a GradScaler on the CPU (Lightning's "16-mixed" falls back to bf16 there)
    plugins = [MixedPrecision("16-mixed", device="cpu", scaler=scaler())] if amp else []
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, logger=False,
                         plugins=plugins, use_distributed_sampler=False, enable_checkpointing=False,
                         limit_val_batches=0,  # the plain loop validates nothing either
                         accumulate_grad_batches=accumulate, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, ckpt_path=ckpt)
    if save:
        trainer.save_checkpoint(save)
    return model, strategy


def reference(method: str, epochs: int, amp: bool = False, accumulate: int = 1):
    """The same training in a plain loop: DDP with thinwire's hook (codecs), or thinwire.attach;
    with ``amp``, fp16 autocast and a GradScaler as Lightning's MixedPrecision runs them; with
    ``accumulate``, that many micro-batches a step (the loss divided by it, DDP's ``no_sync``
    on all but the last), as Lightning's ``accumulate_grad_batches``."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = loader()
    grad_scaler = scaler() if amp else None
    if thinwire.lightning.ThinwireStrategy(method).kind == "gradient":
        forward = DistributedDataParallel(model)
        state = thinwire.ddp.register(forward, method, scaler=grad_scaler)
        after_backward, after_step, sent = (lambda loss: None), (lambda: None), lambda: state.comm.meter.bytes_sent
    else:
        run = thinwire.attach(model, opt, method)
        forward, after_backward, after_step, sent = model, run.after_backward, run.after_step, lambda: run.bytes_sent
    step = 0
    for epoch in range(epochs):
        data.sampler.set_epoch(epoch)
        if accumulate > 1:
            batches = list(data)
            for i in range(0, len(batches), accumulate):
                opt.zero_grad()
                window = batches[i:i + accumulate]
                for j, (x, y) in enumerate(window):
                    last = j == len(window) - 1
                    quiet = forward.no_sync() if not last and isinstance(forward, DistributedDataParallel) else \
                        contextlib.nullcontext()
                    with quiet:
                        loss = F.cross_entropy(forward(x), y) / accumulate
                        loss.backward()
                after_backward(loss)
                opt.step()
                after_step()
            continue
        for x, y in data:
            opt.zero_grad()
            if grad_scaler is None:
                loss = F.cross_entropy(forward(x), y)
                loss.backward()
                after_backward(loss)
                opt.step()
            else:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = overflow(F.cross_entropy(forward(x), y), step)
                grad_scaler.scale(loss).backward()
                grad_scaler.unscale_(opt)
                grad_scaler.step(opt)
                grad_scaler.update()
            after_step()
            step += 1
    return model, sent()


def flat(model: torch.nn.Module) -> torch.Tensor:
    """Parameters and buffers (BatchNorm's running statistics: each rank's own)."""
    return torch.cat([t.detach().reshape(-1).float() for t in (*model.parameters(), *model.buffers())])


def params(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def trainer_for(strategy, epochs: int = 1, validate: bool = True) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, logger=False,
                      limit_val_batches=None if validate else 0,
                      use_distributed_sampler=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)


def main(out: str) -> None:
    result: dict[str, object] = {}
    trained: dict[str, torch.nn.Module] = {}
    for method in ("powersgd:rank=2", "localsgd:period=3", "hylo:t_fc=64"):
        model, strategy = fit(method, epochs=2)
        trained[method] = model
        ref, ref_sent = reference(method, epochs=2)
        result[method] = {
            "max_diff": (flat(model) - flat(ref)).abs().max().item(),
            "params": params(model),
            "bytes": strategy.scalars()["thinwire/bytes_sent"],
            "ref_bytes": ref_sent,
            "kind": strategy.kind,
        }
    # gradient accumulation: two micro-batches a step, DDP's no_sync on the first (codecs), one average a step
    for method in ACCUMULATED:
        model, strategy = fit(method, epochs=2, accumulate=2)
        ref, ref_sent = reference(method, epochs=2, accumulate=2)
        result[f"accumulate {method}"] = {"max_diff": (flat(model) - flat(ref)).abs().max().item(),
                                          "bytes": strategy.scalars()["thinwire/bytes_sent"], "ref_bytes": ref_sent}
    # manual optimization: a model-averaging method through manual_backward and the optimizer's step
    manual = ManualNet()
    strategy = thinwire.lightning.strategy("localsgd:period=3,warmup=2")
    trainer_for(strategy, epochs=2, validate=False).fit(manual)  # the plain loop validates nothing either
    ref, ref_sent = reference("localsgd:period=3,warmup=2", epochs=2)
    result["manual"] = {"max_diff": (flat(manual) - flat(ref)).abs().max().item(),
                        "bytes": strategy.scalars()["thinwire/bytes_sent"], "ref_bytes": ref_sent}
    # mixed precision: the hook gets Lightning's GradScaler; rank 1's overflow skips a step on every rank
    model, strategy = fit("powersgd:rank=2", epochs=2, amp=True)
    ref, ref_sent = reference("powersgd:rank=2", epochs=2, amp=True)
    result["amp"] = {"max_diff": (flat(model) - flat(ref)).abs().max().item(), "bytes": ref_sent,
                     "skipped": strategy.scalars()["thinwire/skipped_steps"],
                     "steps": strategy.scalars()["thinwire/steps"], "finite": bool(torch.isfinite(flat(model)).all()),
                     "params": params(model)}
    plain, _ = reference("identity", epochs=2)  # what DDP's all_reduce (fp32) gives: the codecs must differ
    result["identity"] = {"params": params(plain)}
    # an exact resume: one epoch, a checkpoint, a second epoch from it; against two epochs at once
    path = os.path.join(out, "powersgd.ckpt")
    fit("powersgd:rank=2", epochs=1, save=path)
    resumed, _ = fit("powersgd:rank=2", epochs=2, ckpt=path)
    result["resume_max_diff"] = (flat(resumed) - flat(trained["powersgd:rank=2"])).abs().max().item()
    saved = torch.load(path, weights_only=False)["thinwire"]
    result["saved"] = {"spec": saved["spec"], "world_size": saved["world_size"], "ranks": len(saved["ranks"]),
                       "steps": [r["step"] for r in saved["ranks"]]}
    try:
        fit("topk:ratio=0.1", epochs=2, ckpt=path)
        result["other_method"] = "loaded"
    except ValueError as e:
        result["other_method"] = str(e)
    # validating from it with another method's strategy reads no thinwire state
    result["validate_other"] = trainer_for(thinwire.lightning.strategy("topk:ratio=0.1")).validate(
        Net(), ckpt_path=path, verbose=False)[0]["val_loss"]
    # a model-averaging strategy attaches to one fit's optimizer: a second fit is refused
    again = trainer_for(thinwire.lightning.strategy("localsgd:period=3"))
    again.fit(Net())
    try:
        again.fit(Net())
        result["second_fit"] = "ran"
    except RuntimeError as e:
        result["second_fit"] = str(e)
    rank = int(os.environ["RANK"])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
