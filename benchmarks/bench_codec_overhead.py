"""Per-tensor overhead of the codecs on real gradient sets: each tensor on its own vs one flat tensor.

What a rank does per step for 2 ranks, without the network: ``Aggregator.reduce_`` over a
communicator whose one peer sends exactly what this rank sends (so a GATHER codec decodes
and sums two payloads, a SUM codec decodes the summed one). That is encode every tensor,
error feedback (``compensate``, then ``update_decoded``, which calls ``decode_add``),
packing, ``decode_sum`` of ``[payload, payload]`` (GATHER) or ``decode`` (SUM) into the
output, with the aggregator's buffers, as training runs it.

Gradient sets: one forward/backward on random data of ResNet-18 at CIFAR shape (62 tensors,
11.2M floats, batch 32) and of the ``charlm`` task's ``gpt-small`` transformer (101 tensors,
25.4M floats, ids of shape (4, 64)). The inputs are restored before every step (untimed).

Arms, per codec and gradient set, alternating in one process, median of >= 5 rounds after a
warm-up:

- ``per-tensor``: the codec's default spec chosen for every parameter (what it declines,
  1-D and small tensors, travels as fp32 in the fused identity bucket);
- ``flat``: the bare reference, what the codec would cost with zero per-tensor overhead:
  the tensors it compresses concatenated (one ``torch.cat``) into a single flat tensor,
  encoded as one (the rest as in ``per-tensor``). For ``kernels`` the flat tensor is cut
  into 3x3 units and its rate fixed at the share of values the per-tensor arm sends (the
  per-layer rate falls with layer size, so one big layer would send far less); ``hylo``
  (the preset: ``kernels`` for conv weights, ``twobit`` for linear ones) gets one flat
  tensor per codec.

Codecs: the default specs of ``topk`` (ratio 0.01, ``select=auto``), ``randomk``, ``qsgd``,
``terngrad``, ``signsgd``, ``twobit`` and ``kernels``, and the ``hylo`` preset (``--codecs`` takes
any specs). Both arms include the aggregator's and error feedback's own work per tensor
(``compensate``'s add, ``update_decoded``'s two negations, the division by the world size):
part of the overhead measured is theirs, not the codec's.

1 torch thread by default (``--threads``): what ``thinwire train`` gives each of 2 ranks on 2
cores; several threads on shared cores stall on OpenMP wake-ups and mostly measure the load
(with 2 threads on a busy 2-core machine those per-tensor torch ops of the aggregator and
error feedback cost several times the codecs' own work).

Target (our own; no paper gives one): ``overhead_CODEC = per-tensor ms / flat ms <= 1.5`` on
each gradient set (the median of per-round ratios), i.e. handling tensors one by one costs at
most half again what one flat tensor of the same values does. ``kernels`` on the transformer
is skipped: it has no tensor of 3 or more dimensions, so nothing is compressed.
"""

from __future__ import annotations

import dataclasses
import sys
import time

from _common import Figure, Report, load_note, median, mirror, paired_ratio, parser, table

SETS = ("resnet18", "gpt-small")
CODECS = ("topk", "randomk", "qsgd", "terngrad", "signsgd", "twobit", "kernels", "hylo")
TARGET = 1.5


def gradient_set(name: str):
    """(model, [(name, grad)]) after one forward/backward on random data."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "resnet18":
        from bench_real_models import resnet18

        model = resnet18()
        x, y = torch.randn(32, 3, 32, 32, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        F.cross_entropy(model(x), y).backward()
    else:
        from thinwire.tasks.charlm import CharLM

        task = CharLM(model="gpt-small")
        model, v = task.build_model(), len(task.vocab)
        ids, targets = torch.randint(0, v, (4, 64), generator=gen), torch.randint(0, v, (4, 64), generator=gen)
        F.cross_entropy(model(ids).reshape(-1, v), targets.reshape(-1)).backward()
    return model, [(n, p.grad.detach().clone()) for n, p in model.named_parameters() if p.grad is not None]


def chooser(spec: str, model):
    """The per-parameter codec choice of ``spec``: one codec for every tensor, or a preset."""
    from thinwire.codecs.specs import build_codec
    from thinwire.policy import Policy

    if spec == "hylo":
        return Policy.preset("hylo").assign(model).codec_for
    codec = build_codec(spec)
    return lambda name, t: codec


def flat_reference(named, codec_for):
    """(named tensors, chooser) of the flat arm: each codec's compressed tensors concatenated
    into one, with a fresh codec of the same spec; the declined tensors as they are."""
    import torch

    from thinwire.codecs.specs import build_codec

    groups: dict[int, tuple[object, list]] = {}
    rest = []
    for name, t in named:
        codec = codec_for(name, t)
        if codec.name != "identity" and codec.compresses(t.shape):
            groups.setdefault(id(codec), (codec, []))[1].append(t)
        else:
            rest.append((name, t))
    flat, codecs = [], {}
    for i, (codec, ts) in enumerate(groups.values()):
        values = torch.cat([t.reshape(-1) for t in ts])
        fresh = build_codec(codec.describe())
        if codec.name == "kernels":  # 3x3 units, sending the share of values the per-tensor arm sends
            sent = sum(codec.k(t.shape) * codec.units(t.shape)[1] for t in ts) / values.numel()
            fresh = type(codec)(dataclasses.replace(codec.config, r_max=sent, r_min=sent))
            values = torch.cat([values, values.new_zeros(-values.numel() % 9)]).view(-1, 1, 3, 3)
        else:
            values = values.view(1, -1)
        flat.append((f"flat{i}:{codec.name}", values))
        codecs[flat[-1][0]] = fresh
    return flat + rest, lambda name, t: codecs.get(name) or codec_for(name, t)


def arm(named, codec_for):
    """A step closure: restore the inputs (untimed), then time one ``reduce_``."""
    from thinwire.aggregate import Aggregator

    agg = Aggregator(named, codec_for, mirror(2))
    work = {n: t.clone() for n, t in named}

    def step() -> float:
        for n, t in named:
            work[n].copy_(t)
        t0 = time.perf_counter()
        agg.reduce_(work)
        return time.perf_counter() - t0

    return step


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: one rank of 2 on 2 cores)")
    p.add_argument("--sets", default=",".join(SETS), help=f"gradient sets, of {', '.join(SETS)}")
    p.add_argument("--codecs", default=",".join(CODECS), help="codec specs (and the hylo preset), comma-separated")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    rounds = 5 if args.quick else 9
    command = "PYTHONPATH=benchmarks python benchmarks/bench_codec_overhead.py" + (" --quick" if args.quick else "")
    report = Report("Per-tensor codec overhead on real gradient sets", command)
    report.add(f"{torch.get_num_threads()} torch thread(s), 2 ranks mirrored in one process, median of {rounds} "
               f"alternating rounds after 1 warm-up; {load_note()}")
    rows = []
    for set_name in args.sets.split(","):
        model, named = gradient_set(set_name)
        total = sum(t.numel() for _, t in named)
        for spec in args.codecs.split(","):
            codec_for = chooser(spec, model)
            compressed = [(n, t) for n, t in named
                          if codec_for(n, t).name != "identity" and codec_for(n, t).compresses(t.shape)]
            if not compressed:
                rows.append([spec, set_name, f"0/{len(named)}", "0", "-", "-", "-"])
                continue
            named_flat, flat_for = flat_reference(named, codec_for)
            arms = {"per-tensor": arm(named, codec_for), "flat": arm(named_flat, flat_for)}
            times: dict[str, list[float]] = {k: [] for k in arms}
            for r in range(rounds + 1):
                for k, step in arms.items():
                    dt = step()
                    if r:
                        times[k].append(dt)
            per, flat = median(times["per-tensor"]) * 1e3, median(times["flat"]) * 1e3
            ratio = paired_ratio(times["per-tensor"], times["flat"])
            values = sum(t.numel() for _, t in compressed)
            rows.append([spec, set_name, f"{len(compressed)}/{len(named)}",
                         f"{values / 1e6:.1f}M of {total / 1e6:.1f}M", f"{per:.1f}", f"{flat:.1f}", f"{ratio:.2f}"])
            report.figures.append(Figure(f"overhead_{spec}[{set_name}]", ratio, "<=", TARGET, "x",
                                         f"per-tensor {per:.1f} ms, flat {flat:.1f} ms per step"))
            print(f"  {spec} on {set_name}: per-tensor {per:.1f} ms, flat {flat:.1f} ms", flush=True)
    report.add(table(["codec", "gradients", "tensors compressed", "values compressed", "per-tensor ms/step",
                      "flat ms/step", "per-tensor / flat"], rows))
    return report.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())
