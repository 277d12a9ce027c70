"""The compute step, every codec and thinwire's DDP hook on one GPU, set against each other.

Meant for one NVIDIA H200 and about 4 minutes (``python benchmarks/bench_gpu.py``); with no CUDA
device (or ``--tiny``) the same script runs at tiny sizes on the CPU, to show that it works
before a GPU is used: the same sections and tables, its figures marked ``n/a (CPU tiny)``
(the targets are GPU targets). Each section's results are written as soon as it ends: the
markdown file (``--out``, default ``benchmarks/results/gpu.md``; a tiny run writes
``benchmarks/results/raw/gpu-tiny.md`` unless ``--out`` names another) and the JSON beside it
(same name, ``.json``: every figure, machine-readable; ``thinwire cost --compute-from`` reads
it). A run cut short leaves what it finished, and the file names the sections still to come.
A time guard (``--time-budget``, default 225 s, counted from the script's start) skips what
would overrun, and says so in the file: the compute section always runs (every other figure
is relative to it); the codecs may run until 70% of the budget, FFT against top-k until 80%,
the DDP hook until 97%, each item checked before it starts and its repeats cut (never under
the least stated below) where the time left per item asks it.

**Models** (eager PyTorch, no ``torch.compile``; bf16 autocast on CUDA, fp32 on the CPU):

- ``transformer``: the ``text`` task's model (:class:`thinwire.tasks.charlm.TinyTransformer`,
  as ``--task text --option model=gpt-small`` builds it) in GPT-2 small's shape: 12 layers,
  width 768, 12 heads, context 1024, over the task's 256-byte vocabulary, untied output layer
  (86.2M parameters), 8 windows a step, Adam (the task's default optimizer, lr 1e-3);
- ``resnet18``: ResNet-18 at CIFAR shape (``bench_real_models.resnet18``, 11.2M parameters) on
  32x32 images, batch 256, SGD with momentum 0.9 (the ``cifar10`` task's defaults).

Tiny (CPU): the transformer at 2 layers, width 64, 2 heads, context 32, 2 windows; ResNet-18's
layout at width 8 (176K parameters), batch 8.

**Sections.**

1. *Compute step*: forward, backward and optimizer step on random data, each step timed
   alone between ``torch.cuda.synchronize()`` calls; the median of 25 steps after 5 warm-up
   steps (tiny: 5 after 1). The gradients of one more backward pass are each model's
   gradient set.
2. *Codecs*: encode + decode of the gradient set through thinwire's own path,
   ``Aggregator.reduce_`` (error feedback, packing, buckets, decoding; as
   ``bench_codec_overhead.py`` runs it), on a communicator that stands for one rank of
   ``--workers`` (default 8) whose peers all send what it sends, with no network: a summed
   codec's all_reduce multiplies by the worker count, a gathered codec's all_gather copies the
   rank's payload into every row, so a gathered codec decodes 8 payloads, as one rank of 8
   does. Inputs restored before each call (untimed); each call timed alone, CUDA-synchronised;
   the median of 20 calls after 2 warm-up ones (at least 5 under the time guard; tiny: 3 after
   1). Codecs: every codec of the registry (``thinwire methods``) at its default spec, the
   ``hylo`` preset, and the slow-link methods' codecs: DiLoCo's 4-bit pseudo-gradient
   (``rangefloat:bits=4;exp_bits=3;ef=true`` on the flat model, as DiLoCo's averager runs
   it), SparseLoCo's chunked top-k at 2 bits (its own codec at its defaults on the flat
   model, with the decay of its error buffer) and DeMo's DCT top-k (its optimizer's codec on
   every tensor, with the decay of its momenta); the last three run once per sync (DiLoCo,
   SparseLoCo: every H steps) or once per step (DeMo), on the gradient set's values standing
   in for pseudo-gradients and momenta. Per codec and model: ms, GB/s (the set's fp32 bytes
   over the time), the payload one rank contributes per step and the bytes it sends
   (thinwire's byte accounting, ``thinwire.comm.meter``, for 8 workers: an all_reduce sends
   2(n-1)/n of its payload, an all_gather n-1 times it), the time as a share of the compute
   step, and from thinwire's cost model (``thinwire.lab.cost``: ``StepCost``, ``verdict``,
   ``crossings_Bps``, with no latency and no overlap, so ``compute + codec + sent / B``) the
   bandwidths at which the codec's step beats bf16's and the fp32 all_reduce's (identity's):
   compute cancels, ``B = (sent_ref - sent) / (codec - codec_ref)``.
3. *FFT against top-k at equal bytes*: ``topk`` at the ratio whose payload equals ``fft``'s
   at its first step (found from the aggregator's plan, by bisection), measured as above; each
   one's modelled step (``StepCost.seconds``: compute + codec + the link's alpha-beta time for
   8 workers) at ``10gbit,10us`` and ``1gbit,50us``, and top-k's over fft's.
4. *DDP hook*: a training step through ``DistributedDataParallel`` on a one-rank process
   group (NCCL on CUDA, gloo on the CPU), PyTorch's own all_reduce against
   ``thinwire.ddp.register(model, "identity")``, whose communicator is told to issue its
   collectives on one rank too (``TorchComm(one_rank_collectives=True)``: thinwire skips
   them on one rank, DDP does not), so both pay their collective path and no network. Blocks
   of 5 steps, the arms alternating, 2 warm-up rounds then 9 timed (tiny: 2-step blocks, 1 +
   3); the ratio is the median of the per-round ratios.

**Targets** (GPU; ours, where no paper gives one): every gradient codec's encode + decode
(the registry's and ``hylo``) at most 10% of the transformer's compute step; the DDP hook
with identity at most 1.02x PyTorch's own path; the whole run within 4 minutes (240 s). The
FFT paper (Wang et al., HPDC 2020, arXiv 1811.08596) reports training 1.47x faster than
top-k (AlexNet on 8 GPUs over InfiniBand); the modelled speed-up at equal bytes is set beside
it as a figure with that target. Exit code 0 when every figure passes (or a tiny run), 1 on
a MISS, 2 when asked for CUDA where there is none or when an item failed (the file names it
with its error; the run goes on without it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_START = time.perf_counter()  # the time guard and the wall-time figure count from here
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(1, str(ROOT / "src"))  # this tree's thinwire, whether installed (pip install -e .) or not

from _common import Figure, median, mirror, paired_ratio, table  # noqa: E402  (imports torch)

GPU_OUT = HERE / "results" / "gpu.md"
TINY_OUT = HERE / "results" / "raw" / "gpu-tiny.md"
WORKERS = 8  # the ranks the codec times, bytes and break-even bandwidths are for (the FFT paper's 8 GPUs)
LINKS = ("10gbit,10us", "1gbit,50us")  # the modelled links of the FFT-against-top-k section
DILOCO_4BIT = "rangefloat:bits=4;exp_bits=3;ef=true"  # DiLoCo's codec knob: its own knobs separated by ';'
SLOW_LINK = ("diloco-4bit", "sparseloco", "demo")
SHARE_TARGET = 10.0  # % of the transformer's compute step
DDP_TARGET = 1.02
WALL_TARGET = 240.0
FFT_PAPER = 1.47
BUDGET_S = 225.0
# the share of the budget each section may run until (the compute section always runs)
UNTIL = {"codecs": 0.70, "fft_vs_topk": 0.80, "ddp": 0.97}
SECTIONS = ("compute", "codecs", "fft_vs_topk", "ddp")
TITLES = {"compute": "Compute step", "codecs": "Codecs: encode + decode of each gradient set",
          "fft_vs_topk": "FFT against top-k at equal bytes", "ddp": "DDP hook on one device"}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The models' shapes and the repeats of a run: the GPU's, or tiny ones for the CPU."""

    tiny: bool
    layers: int  # the transformer
    d_model: int
    heads: int
    context: int
    windows: int
    width: int  # ResNet-18's stem channels
    images: int
    warmup: int  # compute steps
    steps: int
    codec_warmup: int
    codec_repeats: int
    codec_least: int
    ddp_warmup: int  # rounds
    ddp_rounds: int
    ddp_steps: int  # steps per block


GPU = Sizes(False, 12, 768, 12, 1024, 8, 64, 256, 5, 25, 2, 20, 5, 2, 9, 5)
TINY = Sizes(True, 2, 64, 2, 32, 2, 8, 8, 1, 5, 1, 3, 2, 1, 3, 2)


# -- the clock and the output --------------------------------------------------------------------
class Clock:
    """The time guard: seconds since the script started, against the budget."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - _START

    def left(self, share: float = 1.0) -> float:
        """Seconds left until ``share`` of the budget is spent (negative: past it)."""
        return share * self.budget_s - self.elapsed()


class Output:
    """The markdown file and the JSON beside it, rewritten whole after every section."""

    def __init__(self, md: Path, data: dict[str, Any], header: list[str]) -> None:
        self.md, self.json = md, md.with_suffix(".json")
        self.data, self.header = data, header
        self.parts: dict[str, str] = {}
        self.status = {name: "not run yet" for name in SECTIONS}
        self.figures: list[tuple[Figure, str]] = []  # (figure, verdict)
        self.skipped: list[str] = []
        self.failed: list[str] = []

    def section(self, name: str, text: str, status: str = "done") -> None:
        self.parts[name] = text
        self.status[name] = status
        print(f"## {TITLES[name]}\n\n{text}\n", flush=True)
        self.write()

    def skip(self, what: str, why: str) -> None:
        self.skipped.append(f"{what}: {why}")
        print(f"skipped {what}: {why}", flush=True)

    def fail(self, what: str, error: BaseException) -> None:
        """An item that raised: named in the file with its error's first line, the run goes on."""
        import traceback

        traceback.print_exception(error)
        self.failed.append(f"{what}: {type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}")

    def figure(self, f: Figure, tiny: bool) -> None:
        self.figures.append((f, "n/a (CPU tiny)" if tiny else ("PASS" if f.passed else "MISS")))

    def write(self) -> None:
        self.data["sections"] = dict(self.status)
        self.data["skipped"] = list(self.skipped)
        self.data["failed"] = list(self.failed)
        self.data["figures"] = [dict(dataclasses.asdict(f), verdict=v) for f, v in self.figures]
        lines = list(self.header)
        for name in SECTIONS:
            if name in self.parts:
                lines += [f"## {TITLES[name]}", "", self.parts[name], ""]
        lines += ["## Figures", ""]
        lines += [f"- `{figure_line(f, v)}`" for f, v in self.figures] or ["- none yet"]
        lines += ["", "## Sections", ""]
        lines += [f"- {TITLES[name]}: {self.status[name]}" for name in SECTIONS]
        if self.skipped:
            lines += ["", "Skipped by the time guard:", ""] + [f"- {s}" for s in self.skipped]
        if self.failed:
            lines += ["", "Failed (the run went on without them):", ""] + [f"- {s}" for s in self.failed]
        _replace(self.md, "\n".join(lines) + "\n")
        _replace(self.json, json.dumps(self.data, indent=1) + "\n")


def _replace(path: Path, text: str) -> None:
    """Write ``path`` whole, through a temporary file: a reader never sees half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def figure_line(f: Figure, verdict: str) -> str:
    v = f"{f.value:.3f}" if abs(f.value) < 100 else f"{f.value:.1f}"
    t = f"{f.threshold:.3f}" if abs(f.threshold) < 100 else f"{f.threshold:.1f}"
    line = f"figure {f.name}: {v}{f.unit} target {f.op} {t}{f.unit} {verdict}"
    return line + (f"  ({f.detail})" if f.detail else "")


# -- the machine ---------------------------------------------------------------------------------
def machine(device) -> dict[str, Any]:
    """What the run ran on: device name and memory, torch, CUDA, driver, Python, commit, date."""
    import torch

    from run_all import cpu_model, git_commit

    info: dict[str, Any] = {"device": device.type, "torch": torch.__version__, "cuda": torch.version.cuda or "none",
                            "python": platform.python_version(), "git commit": git_commit(),
                            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device_name=props.name, memory_gib=round(props.total_memory / 2**30, 1), driver=driver())
    else:
        info.update(device_name=f"CPU: {cpu_model()} x {os.cpu_count()}", memory_gib=None, driver="n/a",
                    torch_threads=torch.get_num_threads())
    return info


def driver() -> str:
    """The NVIDIA driver's version from nvidia-smi, or ``unknown``."""
    if shutil.which("nvidia-smi") is None:
        return "unknown"
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
        return (done.stdout.strip().splitlines() or ["unknown"])[0] if done.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def shown(path: Path) -> str:
    """A path as the file may show it: relative to the repository, else its name alone."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return path.name


def command_line(argv: list[str]) -> str:
    """The command as typed from the repository root, ``--out`` shown without machine paths."""
    args = list(argv)
    for i, a in enumerate(args):
        if a == "--out" and i + 1 < len(args):
            args[i + 1] = shown(Path(args[i + 1]))
        elif a.startswith("--out="):
            args[i] = "--out=" + shown(Path(a.split("=", 1)[1]))
    return " ".join(["python benchmarks/bench_gpu.py", *args])


# -- the models ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Model:
    """One model as the sections use it: how to build it, what it was measured as."""

    key: str
    label: str
    task: str | None  # the thinwire task whose model it is (what thinwire cost matches a probe on)
    task_options: dict[str, Any]
    batch_size: int
    build: Callable[[Any], tuple[Any, Any, tuple[Any, Any], Callable]]  # device -> model, optimizer, batch, loss
    record: dict[str, Any] = dataclasses.field(default_factory=dict)  # its part of the JSON's "models"
    module: Any = None  # the model the gradient set came from (the hylo preset assigns by module type)
    named: list[tuple[str, Any]] = dataclasses.field(default_factory=list)  # the gradient set
    compute_s: float | None = None


def transformer(sizes: Sizes) -> Model:
    """The text task's transformer (bytes, untied head) in GPT-2 small's shape, or a tiny one."""
    from thinwire.tasks.text import BYTE_VOCAB, TextOptions

    o = TextOptions(model="gpt-small", layers=sizes.layers, d_model=sizes.d_model, heads=sizes.heads,
                    context=sizes.context)
    options = {k: getattr(o, k) for k in ("model", "layers", "d_model", "heads", "context", "dropout")}

    def build(device):
        import torch
        import torch.nn.functional as F

        from thinwire.run.trainer import build_optimizer
        from thinwire.tasks.charlm import TinyTransformer

        torch.manual_seed(0)
        with torch.device(device):
            model = TinyTransformer(BYTE_VOCAB, o.context, o.layers, o.d_model, o.heads, o.dropout)
            ids = torch.randint(0, BYTE_VOCAB, (sizes.windows, o.context + 1))
        loss = lambda logits, y: F.cross_entropy(logits.reshape(-1, BYTE_VOCAB), y.reshape(-1))  # noqa: E731
        return model, build_optimizer("adam", list(model.parameters()), 1e-3), (ids[:, :-1], ids[:, 1:]), loss

    label = (f"text task transformer, {o.layers} layers, width {o.d_model}, {o.heads} heads, context {o.context}, "
             f"vocab {BYTE_VOCAB}, {sizes.windows} windows")
    return Model("transformer", label, "text", options, sizes.windows, build)


def resnet(sizes: Sizes) -> Model:
    """ResNet-18 at CIFAR shape (32x32 images), or its tiny narrow version."""

    def build(device):
        import torch
        import torch.nn.functional as F

        from bench_real_models import resnet18
        from thinwire.run.trainer import build_optimizer

        torch.manual_seed(0)
        with torch.device(device):
            model = resnet18(width=sizes.width)
            x, y = torch.randn(sizes.images, 3, 32, 32), torch.randint(0, 10, (sizes.images,))
        return model, build_optimizer("sgd", list(model.parameters()), 0.1, 5e-4), (x, y), F.cross_entropy

    label = f"ResNet-18 (width {sizes.width}), 32x32 images, batch {sizes.images}"
    return Model("resnet18", label, None, {}, sizes.images, build)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_fn(model, optimizer, batch, loss_fn, device) -> Callable[[], None]:
    """One training step: forward (bf16 autocast on CUDA), backward, optimizer step."""
    import torch

    x, y = batch

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()

    return step


def timed(fn: Callable[[], Any], device) -> float:
    """Seconds of one call, synchronised on CUDA before and after."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def free(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- 1. the compute step -------------------------------------------------------------------------
def compute_section(models: list[Model], device, sizes: Sizes, out: Output) -> None:
    """Each model's median compute step, and its gradient set (one more backward pass)."""
    rows = []
    for m in models:
        try:
            rows.append(compute_model(m, device, sizes))
        except Exception as e:  # noqa: BLE001  (one model's failure is reported; the other still runs)
            m.compute_s, m.named, m.module = None, [], None
            out.fail(f"compute step of {m.key}", e)
        free(device)
    precision = "bf16 autocast" if device.type == "cuda" else "fp32 (CPU)"
    text = (f"Forward, backward and optimizer step on random data, eager, {precision}; each step timed alone "
            "(synchronised on CUDA), the median of the timed steps after the warm-up ones.\n\n")
    out.data["models"] = {m.key: m.record for m in models}
    out.section("compute", text + table(["model", "shape", "parameters", "gradient tensors", "batch",
                                         "steps (warm-up + timed)", "median ms", "min–max ms"], rows))


def compute_model(m: Model, device, sizes: Sizes) -> list[Any]:
    """One model's compute step (fills ``m``: its median, gradient set and record); its table row."""
    import torch

    model, optimizer, batch, loss_fn = m.build(device)
    step = step_fn(model, optimizer, batch, loss_fn, device)
    for _ in range(sizes.warmup):
        timed(step, device)
    times = [timed(step, device) for _ in range(sizes.steps)]
    m.compute_s = median(times)
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss_fn(model(batch[0]), batch[1]).backward()
    m.named = [(n, p.grad.detach().clone()) for n, p in model.named_parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    del optimizer, step
    m.module = model
    params = sum(p.numel() for p in model.parameters())
    numel = sum(t.numel() for _, t in m.named)
    m.record.update(label=m.label, task=m.task, task_options=m.task_options, batch_size=m.batch_size,
                    parameters=params, gradient_elements=numel, gradient_tensors=len(m.named),
                    compute={"ms": 1e3 * m.compute_s, "steps": len(times), "warmup": sizes.warmup,
                             "min_ms": 1e3 * min(times), "max_ms": 1e3 * max(times)},
                    codecs={})
    return [m.key, m.label, f"{params / 1e6:.2f}M", len(m.named), m.batch_size, f"{sizes.warmup} + {len(times)}",
            f"{1e3 * m.compute_s:.2f}", f"{1e3 * min(times):.2f}–{1e3 * max(times):.2f}"]


# -- 2. the codecs -------------------------------------------------------------------------------
@dataclasses.dataclass
class Arm:
    """One codec on one gradient set: its aggregator, inputs, and untimed-free extra work."""

    label: str
    spec: str  # what rebuilds it (a codec spec, a preset, or the method it stands for)
    kind: str  # "gradient" (a codec or preset of synchronous training) or "slow-link"
    agg: Any
    inputs: dict[str, Any]
    comm: Any
    before: Callable[[], None] | None = None  # per-call work the method does with it (timed)
    note: str = ""


def gradient_arm(spec: str, m: Model, world: int) -> Arm:
    """A codec spec, or the ``hylo`` preset, on every tensor of the gradient set."""
    from thinwire.aggregate import Aggregator
    from thinwire.codecs.specs import build_codec
    from thinwire.policy import as_policy

    policy = as_policy(spec)
    if policy is not None:
        chooser = policy.assign(m.module).codec_for
    else:
        codec = build_codec(spec)
        chooser = lambda name, t: codec  # noqa: E731
    comm = mirror(world)
    agg = Aggregator(m.named, chooser, comm)
    return Arm(spec, spec, "gradient", agg, dict(m.named), comm)


def slow_link_arm(name: str, m: Model, world: int) -> Arm:
    """The codec a slow-link method sends per sync (DiLoCo, SparseLoCo: on the flat model)
    or per step (DeMo: on every tensor), built as the method builds it."""
    import torch

    from thinwire.algorithms.diloco import DiLoCoConfig
    from thinwire.algorithms.sparseloco import ChunkedTopK, ChunkedTopKConfig, SparseLoCoConfig
    from thinwire.codecs.specs import build_codec
    from thinwire.hierarchical import build_aggregator, flat_aggregator
    from thinwire.optim.demo import DeMo

    comm = mirror(world)
    flat = torch.cat([t.reshape(-1) for _, t in m.named]) if name != "demo" else None
    if name == "diloco-4bit":
        spec = DiLoCoConfig(codec=DILOCO_4BIT).codec  # the method's own resolution of its codec knob
        agg = flat_aggregator("model", flat, build_codec(spec.replace(";", ",")), comm)
        return Arm(name, f"diloco:codec={spec}", "slow-link", agg, {"model": flat}, comm,
                   note="per sync, on the flat model")
    if name == "sparseloco":
        cfg = SparseLoCoConfig()
        wire = ChunkedTopK(ChunkedTopKConfig(chunk=cfg.chunk, k=cfg.k, bits=cfg.bits, sigmas=cfg.sigmas),
                           [tuple(t.shape) for _, t in m.named])
        agg = flat_aggregator("model", flat, wire, comm)

        def decay() -> None:  # SparseLoCo's _before_encode: e <- beta e
            residual = agg.feedback.residuals.get("model")
            if residual is not None:
                residual.mul_(cfg.beta)

        return Arm(name, f"sparseloco:chunk={cfg.chunk},k={cfg.k},bits={cfg.bits}", "slow-link", agg,
                   {"model": flat}, comm, decay, "per sync, on the flat model")
    demo = DeMo([(n, torch.nn.Parameter(t, requires_grad=False)) for n, t in m.named], lr=1e-3, comm=comm)
    codec = build_codec(demo.codec_spec)
    agg = build_aggregator(m.named, lambda _n, _t: codec, comm, as_given=True)

    def momentum() -> None:  # DeMo's step: m <- beta m before the codec adds g
        for r in agg.feedback.residuals.values():
            r.mul_(demo.decay)

    return Arm(name, f"demo ({demo.codec_spec})", "slow-link", agg, dict(m.named), comm, momentum,
               "per step, every tensor")


def measure(arm: Arm, device, sizes: Sizes, room: Callable[[], float], items_left: int) -> tuple[list[float], str]:
    """The arm's timed calls (seconds each) after its warm-up, as many as the time left per
    item allows (at least ``codec_least``); none, with the reason, when even that would
    overrun. ``room()``: seconds left in the section."""
    work = {k: v.clone() for k, v in arm.inputs.items()}

    def call() -> float:
        for k, v in arm.inputs.items():
            work[k].copy_(v)  # untimed: the inputs as they were

        def reduce() -> None:
            if arm.before is not None:
                arm.before()
            arm.agg.reduce_(work)

        return timed(reduce, device)

    warm = [call() for _ in range(sizes.codec_warmup)]
    estimate = max(warm[-1], 1e-6)
    left = room()
    if estimate * sizes.codec_least > left:
        return [], f"{sizes.codec_least} calls at {1e3 * estimate:.1f} ms would overrun the {left:.1f} s left"
    n = min(sizes.codec_repeats, max(sizes.codec_least, int(left / max(items_left, 1) / estimate)))
    return [call() for _ in range(n)], ""


def codec_row(arm: Arm, m: Model, times: list[float]) -> dict[str, Any]:
    """The JSON row of one measured arm: time, throughput, bytes, share of the compute step."""
    steps = arm.agg.step  # reduce_ calls made, warm-up included: the meter counted them all
    ops = arm.comm.meter.ops.values()
    seconds = median(times)
    plan = arm.agg.plan()
    compressed = sum(1 for r in plan if not r["codec"].startswith("identity"))
    fp32 = 4 * m.record["gradient_elements"]
    return {"spec": arm.spec, "kind": arm.kind, "note": arm.note, "ms": 1e3 * seconds, "repeats": len(times),
            "min_ms": 1e3 * min(times), "max_ms": 1e3 * max(times), "gbps": fp32 / seconds / 1e9,
            "payload_bytes": sum(c.payload_bytes for c in ops) / steps, "sent_bytes": sum(c.bytes for c in ops) / steps,
            "messages": sum(c.messages for c in ops) / steps, "share": seconds / m.compute_s,
            "tensors_compressed": compressed, "tensors": len(plan)}


def break_even(rows: dict[str, dict[str, Any]], compute_s: float) -> None:
    """Each measured per-step row's verdict against bf16 and against the fp32 all_reduce
    (identity), from thinwire's cost model with no latency: the bandwidths (bytes/s) where
    the steps cross, and the words (``below 3.2 Gbit/s``, ``always``, ``never``)."""
    from thinwire.lab.cost import StepCost, crossings_Bps, verdict

    def cost(label: str, row: dict[str, Any]) -> StepCost:
        return StepCost(label, compute_s, row["ms"] / 1e3, row["sent_bytes"], row["messages"])

    for ref_label, key in (("bf16", "bf16"), ("identity", "fp32")):
        ref = rows.get(ref_label)
        for label, row in rows.items():
            if "ms" not in row or row["kind"] == "slow-link" and label != "demo":
                continue
            if ref is None or "ms" not in ref:
                row[f"beats_{key}"], row[f"beats_{key}_Bps"] = "n/a (reference not measured)", []
                continue
            m, r = cost(label, row), cost(ref_label, ref)
            row[f"beats_{key}"] = verdict(m, r, 0.0)
            row[f"beats_{key}_Bps"] = crossings_Bps(m, r, 0.0)


def codecs_section(models: list[Model], specs: list[str], slow: list[str], device, sizes: Sizes, clock: Clock,
                   world: int, out: Output) -> None:
    """Every codec's encode + decode on each model's gradient set, against its compute step."""
    share = UNTIL["codecs"]
    items = [(m, s, "gradient") for m in models for s in specs] + [(m, s, "slow-link") for m in models for s in slow]
    for i, (m, spec, kind) in enumerate(items):
        what = f"{spec} on {m.key}"
        if m.compute_s is None or not m.named:
            continue
        if clock.left(share) <= 0:
            out.skip(f"codecs: {what}", f"the section's time ran out ({clock.elapsed():.0f} s of "
                     f"{share * clock.budget_s:.0f} s)")
            continue
        try:
            arm = gradient_arm(spec, m, world) if kind == "gradient" else slow_link_arm(spec, m, world)
            times, why = measure(arm, device, sizes, lambda: clock.left(share), len(items) - i)
            if times:
                m.record["codecs"][arm.label] = codec_row(arm, m, times)
                print(f"  {what}: {m.record['codecs'][arm.label]['ms']:.2f} ms", flush=True)
            else:
                out.skip(f"codecs: {what}", why)
        except Exception as e:  # noqa: BLE001  (one codec's failure is reported; the others still run)
            out.fail(f"codecs: {what}", e)
        finally:
            arm = None
            free(device)
    for m in models:
        if m.compute_s is not None:
            break_even(m.record["codecs"], m.compute_s)
    verdict = ""
    tx = next((m for m in models if m.key == "transformer" and m.compute_s is not None), None)
    if tx is not None:
        over = []
        for label, row in tx.record["codecs"].items():
            if row["kind"] == "gradient":
                f = Figure(f"codec_share[{label}]", 100 * row["share"], "<=", SHARE_TARGET, "%",
                           f"{row['ms']:.2f} ms of a {1e3 * tx.compute_s:.2f} ms transformer step")
                out.figure(f, sizes.tiny)
                over += [] if f.passed else [label]
        verdict = (f"\n\nTarget (GPU): every gradient codec's encode + decode at most {SHARE_TARGET:g}% of the "
                   "transformer's compute step: " + ("n/a on a tiny CPU run" if sizes.tiny else
                                                     f"MISS: {', '.join(over)}" if over else "PASS"))
        out.data["codec_share_over_target"] = over  # the gradient codecs above the target's share
    out.section("codecs", codecs_text(models, world, sizes, device) + verdict)


def codecs_text(models: list[Model], world: int, sizes: Sizes, device) -> str:
    head = (f"`Aggregator.reduce_` of the whole gradient set as one rank of {world} workers whose peers send "
            "what it sends (no network; a gathered codec decodes every worker's payload), the inputs restored "
            f"before each call; each call timed alone (synchronised on CUDA), the median of up to "
            f"{sizes.codec_repeats} calls after {sizes.codec_warmup} warm-up. GB/s: the set's fp32 bytes over "
            f"the time. Payload: what one rank contributes a step; sent: what it sends for {world} workers "
            "(thinwire's byte accounting). Share: of the model's compute step. Beats: the bandwidths where its "
            "step (compute + codec + sent / bandwidth, thinwire's cost model with no latency and no overlap) "
            "is shorter than bf16's, or than the fp32 all_reduce's (identity).\n\n")
    headers = ["codec", "model", "tensors compressed", "ms", "GB/s", "payload MB", f"sent MB ({world} workers)",
               "share of compute", "beats bf16", "beats fp32 all_reduce", "calls"]
    rows, slow = [], []
    for m in models:
        for label, r in m.record.get("codecs", {}).items():
            cells = [label, m.key, f"{r['tensors_compressed']}/{r['tensors']}", f"{r['ms']:.3f}", f"{r['gbps']:.1f}",
                     f"{r['payload_bytes'] / 1e6:.3f}", f"{r['sent_bytes'] / 1e6:.3f}", f"{100 * r['share']:.1f}%",
                     r.get("beats_bf16", "-"), r.get("beats_fp32", "-"), r["repeats"]]
            (slow if r["kind"] == "slow-link" else rows).append(cells)
    text = head + table(headers, rows)
    if slow:
        text += ("\n\nThe slow-link methods' codecs (DiLoCo and SparseLoCo send once per sync, every H steps: "
                 "their share is of one compute step, their bytes those of one sync; DeMo's run every step):\n\n")
        text += table(headers, [[f"{r[0]}"] + r[1:] for r in slow])
    return text


# -- 3. FFT against top-k at equal bytes -------------------------------------------------------------
def plan_bytes(m: Model, spec: str) -> float:
    """Payload bytes of one rank's step with ``spec`` on every tensor, from the aggregator's
    plan (the codec's wire layout at its first step; nothing encoded)."""
    from thinwire.aggregate import Aggregator
    from thinwire.codecs.specs import build_codec

    codec = build_codec(spec)
    return sum(r["wire_bytes"] for r in Aggregator(m.named, lambda _n, _t: codec, mirror(2)).plan())


def equal_bytes_ratio(m: Model, target: float) -> float:
    """The top-k ratio (4 significant digits) whose payload on this gradient set is nearest
    ``target`` bytes (bisection: the payload grows with the ratio)."""
    lo, hi = 1e-7, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if plan_bytes(m, f"topk:ratio={mid:.6g}") < target:
            lo = mid
        else:
            hi = mid
    candidates = {float(f"{r:.4g}") for r in (lo, hi)}
    return min(candidates, key=lambda r: abs(plan_bytes(m, f"topk:ratio={r:g}") - target))


def topk_at_fft_bytes(m: Model, device, sizes: Sizes, room: Callable[[], float],
                      world: int) -> tuple[float, dict[str, Any] | None, str]:
    """The top-k ratio of fft's payload on this gradient set, and top-k's row measured at it
    (None, with the reason, where the time guard stopped it)."""
    ratio = equal_bytes_ratio(m, plan_bytes(m, "fft"))
    arm = gradient_arm(f"topk:ratio={ratio:g}", m, world)
    times, why = measure(arm, device, sizes, room, 1)
    return ratio, codec_row(arm, m, times) if times else None, why


def fft_topk_section(models: list[Model], device, sizes: Sizes, clock: Clock, world: int, out: Output) -> None:
    """fft and top-k at the same payload: their modelled steps at two links, top-k's over fft's."""
    from thinwire.comm.link import Link
    from thinwire.lab.cost import StepCost

    share = UNTIL["fft_vs_topk"]
    rows, record = [], {}
    for m in models:
        fft = m.record.get("codecs", {}).get("fft")
        if m.compute_s is None or fft is None:
            out.skip(f"fft against top-k on {m.key}", "fft was not measured in the codecs section")
            continue
        if clock.left(share) <= 0:
            out.skip(f"fft against top-k on {m.key}", f"the section's time ran out ({clock.elapsed():.0f} s)")
            continue
        try:
            ratio, topk, why = topk_at_fft_bytes(m, device, sizes, lambda: clock.left(share), world)
        except Exception as e:  # noqa: BLE001  (one model's failure is reported; the other still runs)
            out.fail(f"fft against top-k on {m.key}", e)
            continue
        finally:
            free(device)
        if topk is None:
            out.skip(f"fft against top-k on {m.key}", why)
            continue
        spec = f"topk:ratio={ratio:g}"
        entry: dict[str, Any] = {"fft_spec": "fft", "topk_spec": spec, "topk_ratio": ratio,
                                 "fft": {k: fft[k] for k in ("ms", "payload_bytes", "sent_bytes", "messages")},
                                 "topk": {k: topk[k] for k in ("ms", "payload_bytes", "sent_bytes", "messages")},
                                 "links": {}}
        costs = {name: StepCost(name, m.compute_s, r["ms"] / 1e3, r["sent_bytes"], r["messages"])
                 for name, r in (("fft", fft), ("topk", topk))}
        for text in LINKS:
            link = Link.parse(text)
            f_s, t_s = costs["fft"].seconds(link), costs["topk"].seconds(link)
            entry["links"][text] = {"fft_ms": 1e3 * f_s, "topk_ms": 1e3 * t_s, "speedup": t_s / f_s}
            out.figure(Figure(f"fft_speedup_over_topk[{m.key} @ {text}]", t_s / f_s, ">=", FFT_PAPER, "x",
                              f"modelled step: topk {1e3 * t_s:.2f} ms / fft {1e3 * f_s:.2f} ms at equal bytes; "
                              "the paper's end-to-end claim"), sizes.tiny)
        record[m.key] = entry
        for name, r in (("fft", fft), (spec, topk)):
            rows.append([m.key, name, f"{r['payload_bytes'] / 1e6:.4f}", f"{r['ms']:.3f}",
                         *[f"{entry['links'][t][('fft' if name == 'fft' else 'topk') + '_ms']:.2f}" for t in LINKS]])
        rows.append([m.key, "top-k / fft", "", "", *[f"{entry['links'][t]['speedup']:.3f}x" for t in LINKS]])
    out.data["fft_vs_topk"] = record
    text = (f"`topk` at the ratio whose payload equals `fft`'s at its first step (theta 0.9), found from the "
            "aggregator's plan by bisection, measured as in the codecs section. Modelled step: compute + codec + "
            f"the link's alpha-beta time for the bytes each sends as one rank of {world} (thinwire's cost model, "
            f"no overlap). The FFT paper (Wang et al., HPDC 2020) reports training {FFT_PAPER}x faster than top-k "
            "(AlexNet, 8 GPUs, InfiniBand): an end-to-end figure, set beside the modelled one.\n\n")
    out.section("fft_vs_topk", text + table(["model", "codec", "payload MB", "codec ms",
                                             *[f"step ms @ {t}" for t in LINKS]], rows))


# -- 4. the DDP hook ---------------------------------------------------------------------------------
def ddp_section(models: list[Model], device, sizes: Sizes, clock: Clock, out: Output) -> None:
    """PyTorch's DDP all_reduce against thinwire's hook with identity on a one-rank group."""
    import torch
    import torch.distributed as dist

    share = UNTIL["ddp"]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    rows, record = [], {}
    try:
        for m in models:
            if m.compute_s is None:
                continue
            steps = (sizes.ddp_warmup + sizes.ddp_rounds) * 2 * sizes.ddp_steps
            if clock.left(share) < 1.5 * steps * m.compute_s:
                out.skip(f"DDP hook on {m.key}", f"{steps} steps of about {1e3 * m.compute_s:.1f} ms would overrun "
                         f"the {max(clock.left(share), 0):.1f} s left")
                continue
            try:
                times = ddp_times(m, device, sizes)
            except Exception as e:  # noqa: BLE001  (one model's failure is reported; the other still runs)
                out.fail(f"DDP hook on {m.key}", e)
                continue
            finally:
                free(device)  # the DDP wrappers go while the process group lives
            ratio = paired_ratio(times["thinwire"], times["ddp"])
            ddp_ms, tw_ms = 1e3 * median(times["ddp"]), 1e3 * median(times["thinwire"])
            record[m.key] = {"ddp_ms": ddp_ms, "thinwire_ms": tw_ms, "ratio": ratio, "rounds": sizes.ddp_rounds,
                             "steps_per_block": sizes.ddp_steps, "warmup_rounds": sizes.ddp_warmup}
            rows.append([m.key, f"{ddp_ms:.2f}", f"{tw_ms:.2f}", f"{ratio:.3f}",
                         f"{sizes.ddp_warmup} + {sizes.ddp_rounds} x {sizes.ddp_steps}"])
            out.figure(Figure(f"ddp_hook_identity[{m.key}]", ratio, "<=", DDP_TARGET, "x",
                              f"thinwire {tw_ms:.2f} ms / DDP {ddp_ms:.2f} ms a step"), sizes.tiny)
    finally:
        dist.destroy_process_group()
    out.data["ddp"] = record
    backend = "NCCL" if device.type == "cuda" else "gloo"
    text = (f"A training step through `DistributedDataParallel` on a one-rank {backend} group: PyTorch's own "
            "all_reduce against `thinwire.ddp.register(model, \"identity\")` with its collectives issued on the "
            "one rank too (`TorchComm(one_rank_collectives=True)`), so both pay their collective path and no "
            "network. Blocks of steps, the arms alternating; ratio: the median of the per-round ratios.\n\n")
    out.section("ddp", text + table(["model", "DDP ms/step", "thinwire identity ms/step", "thinwire / DDP",
                                     "rounds (warm-up + timed x steps)"], rows))


def ddp_times(m: Model, device, sizes: Sizes) -> dict[str, list[float]]:
    """Seconds per step of each arm, per timed round: blocks of ``ddp_steps`` steps, the arms
    alternating (DDP, then thinwire), ``ddp_warmup`` rounds untimed. Everything it builds is
    gone when it returns."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import thinwire.integrations.ddp as tw_ddp
    from thinwire.comm.torch_dist import TorchComm

    arms = {}
    for arm in ("ddp", "thinwire"):
        model, optimizer, batch, loss_fn = m.build(device)
        net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        if arm == "thinwire":
            tw_ddp.register(net, "identity", TorchComm(net.process_group, one_rank_collectives=True))
        arms[arm] = step_fn(net, optimizer, batch, loss_fn, device)
    times: dict[str, list[float]] = {arm: [] for arm in arms}

    def block(step: Callable[[], None]) -> None:
        for _ in range(sizes.ddp_steps):
            step()

    for r in range(sizes.ddp_warmup + sizes.ddp_rounds):
        for arm in arms:
            dt = timed(lambda arm=arm: block(arms[arm]), device)
            if r >= sizes.ddp_warmup:
                times[arm].append(dt / sizes.ddp_steps)
    return times


# -- the run -----------------------------------------------------------------------------------------
def arguments(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--out", type=Path, help=f"the markdown file; the JSON goes beside it (default: "
                   f"{shown(GPU_OUT)} on CUDA, {shown(TINY_OUT)} for a tiny run)")
    p.add_argument("--tiny", action="store_true", help="tiny models and few repeats (the default with no CUDA)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda where there is one, else cpu")
    p.add_argument("--time-budget", type=float, default=BUDGET_S, metavar="S",
                   help=f"seconds from the script's start; later sections skip what would overrun (default "
                   f"{BUDGET_S:g})")
    p.add_argument("--workers", type=int, default=WORKERS,
                   help=f"the ranks the codec times, bytes and break-even bandwidths are for (default {WORKERS})")
    p.add_argument("--models", default="transformer,resnet18", help="of transformer, resnet18 (default: both)")
    p.add_argument("--codecs", help="codec specs and presets separated by ';' (default: every codec of the "
                   "registry at its defaults, and hylo)")
    args = p.parse_args(argv)
    if args.workers < 2:
        p.error("--workers must be >= 2")
    if not args.time_budget >= 0:
        p.error("--time-budget must be a number of seconds >= 0")
    unknown = set(args.models.split(",")) - {"transformer", "resnet18"}
    if unknown:
        p.error(f"unknown model {sorted(unknown)[0]!r}; models: transformer, resnet18")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = arguments(argv)
    import torch

    from thinwire.codecs.specs import available
    from thinwire.lab.gpu_results import KIND, SCHEMA

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here", file=sys.stderr)
        return 2
    cuda = args.device == "cuda" or args.device is None and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sizes = TINY if args.tiny or device.type == "cpu" else GPU
    md = args.out or (TINY_OUT if sizes.tiny else GPU_OUT)
    md.parent.mkdir(parents=True, exist_ok=True)
    clock = Clock(args.time_budget)
    info = machine(device)
    command = command_line(argv)
    header = [f"# thinwire on one {'GPU' if device.type == 'cuda' else 'CPU (tiny)'}: compute step, codecs, DDP "
              "hook", "", f"- command: `{command}` (from the repository root)",
              f"- machine: {info['device_name']}"
              + (f", {info['memory_gib']} GiB, driver {info['driver']}" if device.type == "cuda" else
                 f", {info.get('torch_threads')} torch threads"),
              f"- torch {info['torch']}, CUDA {info['cuda']}, Python {info['python']}",
              f"- git commit: {info['git commit']}", f"- date: {info['date']}",
              f"- workers: {args.workers} (codec times, bytes and break-even bandwidths are one rank's of "
              f"{args.workers})", f"- time budget: {args.time_budget:g} s"]
    if sizes.tiny:
        header.append("- a tiny CPU run: it shows that the script works; its figures are marked n/a, the "
                      "targets are GPU targets")
    header.append("")
    data: dict[str, Any] = {"kind": KIND, "schema": SCHEMA, "tiny": sizes.tiny, "command": command,
                            "machine": info, "workers": args.workers, "budget_s": args.time_budget,
                            "break_even_latency_s": 0.0, "links": list(LINKS), "models": {}}
    out = Output(md, data, header)
    out.write()
    models = [{"transformer": transformer, "resnet18": resnet}[k](sizes) for k in args.models.split(",")]
    specs = [s.strip() for s in args.codecs.split(";") if s.strip()] if args.codecs else [*available(), "hylo"]

    compute_section(models, device, sizes, out)
    for name, run in (("codecs", lambda: codecs_section(models, specs, list(SLOW_LINK) if not args.codecs else [],
                                                        device, sizes, clock, args.workers, out)),
                      ("fft_vs_topk", lambda: fft_topk_section(models, device, sizes, clock, args.workers, out)),
                      ("ddp", lambda: ddp_section(models, device, sizes, clock, out))):
        if clock.left(UNTIL[name]) <= 0:
            out.skip(TITLES[name], f"the time guard: {clock.elapsed():.1f} s of the {args.time_budget:g} s budget "
                     f"used before it began (it may run until {100 * UNTIL[name]:.0f}%)")
            out.status[name] = "skipped (time guard)"
            out.write()
            continue
        try:
            run()
        except Exception as e:  # noqa: BLE001  (a section's failure is reported; the next still runs)
            out.fail(TITLES[name], e)
            out.status[name] = "failed"
            out.write()
    wall = clock.elapsed()
    data["wall_s"] = wall
    out.figure(Figure("wall_time", wall, "<=", WALL_TARGET, " s", f"budget {args.time_budget:g} s"), sizes.tiny)
    out.write()
    print("== figures", flush=True)
    for f, v in out.figures:
        print(figure_line(f, v), flush=True)
    misses = [f.name for f, v in out.figures if v == "MISS"]
    print(f"wrote {shown(md)} and {shown(md.with_suffix('.json'))} in {wall:.1f} s"
          + (f"; MISS: {', '.join(misses)}" if misses else "")
          + (f"; failed: {'; '.join(out.failed)}" if out.failed else ""), flush=True)
    return 2 if out.failed else 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
