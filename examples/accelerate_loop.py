"""An accelerate training loop with thinwire's hook on the prepared model: one line.

    torchrun --nproc-per-node 2 examples/accelerate_loop.py --method topk:ratio=0.01
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_loop.py   # on GPUs

(``accelerate launch --cpu`` starts one process; torchrun starts several CPU processes, which
accelerate joins with gloo.)
"""

import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import thinwire.accelerate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", default="powersgd:rank=2", help="a codec spec or policy")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--save", help="accelerator.save_state here at the end (thinwire's state included)")
    args = p.parse_args()

    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # on the CPU, cpu=True joins the processes
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=g)
    y = (x @ torch.randn(32, 4, generator=g)).argmax(1)
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    hook = thinwire.accelerate.register(accelerator, model, args.method)  # <- the one line

    loss = torch.zeros(())
    for _ in range(args.epochs):
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
    if args.save:
        accelerator.save_state(args.save)
    if accelerator.is_main_process:
        sent = hook.scalars()["thinwire/bytes_sent"] / 1e6 if hook is not None else 0.0
        print(f"{args.method}: {sent:.2f} MB sent by the main process, last loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
