"""thinwire on a CUDA device: every codec, every method a loop can attach, and `thinwire train` under
torchrun with NCCL, each checked against the same work on the CPU.

1. **codecs**: each codec encodes and decodes the same tensors on the GPU and on the CPU: the
   payload stays on the GPU, the decoded tensor matches the CPU's within the codec's own
   rounding (relative error of the difference below 1e-3 of the tensor's norm; a selecting codec
   may pick other ties, so the check is on the norms of what it keeps; randomk draws its positions
   from a generator on the tensor's device, so on the GPU it keeps as many values, at other places);
2. **methods**: two in-process ranks (thinwire's LocalWorld) train a small model on the GPU for
   20 steps through ``thinwire.attach(..., overlap=False)``: the loss is finite and falls, every
   tensor the method keeps is on the GPU, and the ranks end with the same model where the method
   promises it (overlap off: ranks that are threads of one process share the GPU's one autograd
   thread, where a gradient hook's blocking in-process collective would wait for a rank that
   cannot run; real ranks are processes);
3. **torchrun**: ``torchrun --nproc_per_node 1 -m thinwire train`` on the synthetic task with
   NCCL: the run's summary says ``device cuda``.

Prints one line per check, ``PASS`` or ``FAIL``, and exits 1 on any failure. Needs a CUDA device.
Not part of the package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DEVICE = os.environ.get("THINWIRE_CHECK_DEVICE", "cuda")  # "cpu": a dry run of this script without a GPU
METHODS = ("identity", "bf16", "topk:ratio=0.05", "randomk:ratio=0.05", "qsgd", "signsgd", "terngrad",
           "powersgd:rank=2", "rangefloat", "fft", "dct", "twobit", "hylo", "localsgd:period=4,warmup=2",
           "dasgd:period=4,warmup=2", "diloco:period=5", "streaming-diloco:period=6,fragments=2",
           "sparseloco:period=5,chunk=8,k=6", "dpsgd", "powergossip", "ab:group_size=1,warmup=4,cycle=8,full_steps=2")
AGREE = {"identity", "bf16", "topk", "randomk", "qsgd", "signsgd", "terngrad", "powersgd", "rangefloat", "fft", "dct",
         "twobit", "hylo", "diloco", "sparseloco"}  # ranks hold one model after these (at a sync, for DiLoCo's)


def check_codecs(say) -> bool:
    from thinwire.codecs.specs import CODECS, build_codec

    ok = True
    for name in CODECS:
        try:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(64, 96, generator=g)
            out = {}
            for device in ("cpu", DEVICE):
                codec = build_codec(name)
                payload = codec.encode(x.to(device), key="w")
                for _ in range(1, codec.rounds):  # one rank: each round's reduced payload is its own
                    payload = codec.encode_next(payload, key="w")
                on = {t.device.type for t in payload.tensors}
                assert on <= {device}, f"payload on {on}"
                out[device] = codec.decode(payload).float().cpu()
            a, b = out["cpu"], out[DEVICE]
            close = (a - b).norm() <= 1e-3 * max(a.norm(), 1e-12) or abs(a.norm() - b.norm()) <= 1e-2 * a.norm()
            if name == "randomk":  # its positions come from a generator on the tensor's device: others on the GPU
                close = b.count_nonzero() == a.count_nonzero()
            assert close, f"cpu {a.norm():.4g} vs cuda {b.norm():.4g}, difference {(a - b).norm():.3g}"
            say(f"PASS codec {name}")
        except Exception as e:  # noqa: BLE001
            ok = False
            say(f"FAIL codec {name}: {type(e).__name__}: {e}")
    return ok


def _train(comm, spec: str, steps: int):
    import thinwire

    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4))
    init = torch.Generator().manual_seed(0)  # the same model on every rank (the ranks are threads: no global seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=init))
    model = model.to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # overlap=False: ranks that are threads of one process share the GPU's one autograd thread, where a
    # gradient hook's blocking in-process collective would wait for a rank that cannot run
    run = thinwire.attach(model, opt, spec, comm=comm, overlap=False)
    g = torch.Generator().manual_seed(100 + comm.rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 16, generator=g).to(DEVICE)
        y = ((x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long())
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(run.model(x), y)
        loss.backward()
        run.after_backward(loss)
        opt.step()
        run.after_step()
        losses.append(loss.item())
    run.finish()
    state = run.method.state_dict()
    devices = {t.device.type for t in _tensors(state) if t.numel()}
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    return losses, devices, flat


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def check_methods(say) -> bool:
    from thinwire.comm.local import LocalWorld

    ok = True
    for spec in METHODS:
        name = spec.split(":")[0]
        try:
            results = LocalWorld(2).run(lambda comm, spec=spec: _train(comm, spec, 20))
            for losses, devices, _ in results:
                assert all(map(torch.isfinite, map(torch.tensor, losses))), "a loss is not finite"
                assert sum(losses[-5:]) < sum(losses[:5]), f"the loss did not fall: {losses[:3]} ... {losses[-3:]}"
                assert devices <= {DEVICE}, f"state on {devices}"
            if name in AGREE:
                assert torch.equal(results[0][2], results[1][2]), "the ranks' models differ"
            say(f"PASS method {spec} (loss {results[0][0][0]:.3f} -> {results[0][0][-1]:.3f})")
        except Exception as e:  # noqa: BLE001
            ok = False
            say(f"FAIL method {spec}: {type(e).__name__}: {e}")
            traceback.print_exc()
    return ok


def check_torchrun(say) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m", "thinwire",
               "train", "--task", "synthetic", "--method", "powersgd:rank=2", "--steps", "60", "--out",
               f"{tmp}/run", "--quiet", "--no-tensorboard"]
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        if done.returncode != 0:
            say(f"FAIL torchrun train: exit {done.returncode}: {done.stderr[-1500:]}")
            return False
        s = json.loads(Path(tmp, "run", "summary.json").read_text())
        device = s["machine"]["device"]
        good = device == DEVICE and s["status"] == "ok"
        say(f"{'PASS' if good else 'FAIL'} torchrun train: device {device}, status {s['status']}, final loss "
            f"{s['final_loss']:.4f}, {s['bytes_sent_per_worker'] / 1e6:.2f} MB sent")
        return good


def main() -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here", flush=True)
        return 2
    sys.path.insert(0, str(ROOT / "src"))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0) if DEVICE == 'cuda' else 'cpu'}", flush=True)
    say = lambda line: print(line, flush=True)  # noqa: E731
    results = [check_codecs(say), check_methods(say), check_torchrun(say)]
    print("ALL PASS" if all(results) else "SOME FAIL", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
