"""PowerSGD's CPU cost per step, thinwire's codec against PyTorch's ``powerSGD_hook``, on ResNet-18's gradients.

No network: one process, a 1-rank gloo group (all_reduce of one rank is nearly free), so what
is measured is the compression work a training step pays on top of its forward and backward.
ResNet-18 at CIFAR-10 shape (``bench_real_models.resnet18``: 62 tensors, 11.2M floats), batch
32 of random data, ``--threads`` torch threads (default 1, as each rank of the real-model tier).

DDP arms, each its own DDP copy of the same model, run in alternating rounds (A B C ... A B C)
after 4 warm-up steps per arm (DDP's bucket rebuild, PyTorch's ``start_powerSGD_iter=2``,
first allocations), then the median of the timed rounds; a step is ``zero_grad``, forward,
``backward()``:

- ``compute``: ``backward()`` under ``no_sync()`` (no hook at all);
- ``torch-rR``: ``powerSGD_hook`` with ``PowerSGDState(matrix_approximation_rank=R,
  start_powerSGD_iter=2)`` (its defaults otherwise: error feedback, warm start, no batching);
- ``thinwire-rR``: ``thinwire.ddp.register(ddp, "powersgd:rank=R", overlap=False)`` (every
  bucket averaged inside the hook: error feedback, both rounds, packing, decode);
- ``baseline-rR`` (with ``--baseline FILE``): the same with the PowerSGD codec of another
  ``powersgd.py``, e.g. ``git show HEAD:src/thinwire/codecs/powersgd.py > /tmp/old.py``: a
  before/after comparison in one process.

Both hooks are wrapped by a timer that calls the hook and waits for its future: ``hook ms``
is the wall time of the compression per step, ``hook cpu ms`` the process's CPU time over the
same span (the hook's own threads included; nothing else runs meanwhile). The figures use CPU
time, the cost asked about, which other jobs on the same cores disturb far less than wall time;
``step - compute`` (median of the per-round differences) is the same cost seen as step time,
noisy: it is the difference of two numbers of seconds. Bytes per step are the wire tensors'
bytes (what an all_reduce over n ranks carries per rank before its algorithm factor):
thinwire's from its aggregators' plans, PyTorch's counted from the tensors its hook
all_reduces on one extra untimed step; they must agree within 1%.

The ``aggregator`` table times ``Aggregator.reduce_`` alone (the codec path without DDP) on
fresh copies of the same gradients; ``--profile`` adds torch.profiler's table of it.

Figures: ``powersgd_rR_cost_vs_torch`` = thinwire hook CPU ms / torch hook CPU ms (median of
per-round ratios) <= 0.8, and ``powersgd_rR_bytes_vs_torch`` = |thinwire bytes / torch bytes
- 1| <= 0.01.
"""

# no `from __future__ import annotations`: DDP checks that a hook's annotations are the real
# GradBucket / Future classes
import importlib.util
import socket
import sys
import time

from _common import Figure, Report, load_note, median, paired_ratio, parser, table

TARGET = 0.8
BATCH = 32
WARMUP_STEPS = 4  # per arm: DDP rebuilds its buckets after step 1; PyTorch's hook compresses from step 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_codec_class(path: str):
    """The ``PowerSGD`` class of another ``powersgd.py`` (kept out of the codec registry)."""
    import thinwire.codecs.specs as registry

    spec = importlib.util.spec_from_file_location("_baseline_powersgd", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    original, registry.register = registry.register, lambda cls: cls
    try:
        spec.loader.exec_module(module)
    finally:
        registry.register = original
    return module.PowerSGD


def main(argv: "list[str] | None" = None) -> int:
    p = parser(__doc__)
    p.add_argument("--ranks", default="1,4", help="PowerSGD ranks to compare (comma-separated)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as a real-model rank)")
    p.add_argument("--rounds", type=int, default=0, help="timed rounds (default 9, --quick 5)")
    p.add_argument("--baseline", help="another powersgd.py whose codec runs as the baseline-rR arms")
    p.add_argument("--profile", action="store_true", help="print torch.profiler's table of thinwire's reduce_")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    import thinwire
    from bench_real_models import resnet18
    from thinwire.codecs.powersgd import PowerSGD
    from thinwire.integrations import ddp as tw_ddp

    torch.set_num_threads(args.threads)
    ranks = [int(r) for r in args.ranks.split(",")]
    rounds = args.rounds or (5 if args.quick else 9)
    steps = 1 if args.quick else 2  # steps per arm per round
    codecs = {"thinwire": PowerSGD}
    if args.baseline:
        codecs["baseline"] = load_codec_class(args.baseline)
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    loss_fn = torch.nn.CrossEntropyLoss()

    wall: dict[str, float] = {}
    cpu: dict[str, float] = {}

    def timed(inner, arm: str):
        def hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            t0, c0 = time.perf_counter(), time.process_time()
            fut = inner(state, bucket)
            fut.wait()
            wall[arm] += time.perf_counter() - t0
            cpu[arm] += time.process_time() - c0
            return fut

        return hook

    models, states = {}, {}
    arms = ["compute"] + [f"{kind}-r{r}" for r in ranks for kind in ("torch", *codecs)]
    for arm in arms:
        torch.manual_seed(0)
        model = DDP(resnet18())
        wall[arm] = cpu[arm] = 0.0
        kind, _, r = arm.partition("-r")
        if kind == "torch":
            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=int(r), start_powerSGD_iter=2)
            model.register_comm_hook(state, timed(psgd.powerSGD_hook, arm))
        elif kind in codecs:
            cls = codecs[kind]
            original = tw_ddp.hook
            tw_ddp.hook = timed(original, arm)  # register() installs the module's `hook`
            try:
                states[arm] = thinwire.ddp.register(model, cls(cls.Config(rank=int(r))), overlap=False)
            finally:
                tw_ddp.hook = original
        models[arm] = model

    def step(arm: str) -> None:
        model = models[arm]
        model.zero_grad()
        if arm == "compute":
            with model.no_sync():
                loss_fn(model(x), y).backward()
        else:
            loss_fn(model(x), y).backward()

    for arm in arms:  # warm-up: DDP's bucket rebuild, PyTorch's 2 plain steps, first allocations
        for _ in range(WARMUP_STEPS):
            step(arm)
    step_ms: dict[str, list[float]] = {a: [] for a in arms}
    wall_ms: dict[str, list[float]] = {a: [] for a in arms}
    cpu_ms: dict[str, list[float]] = {a: [] for a in arms}
    for _ in range(rounds):
        for arm in arms:
            w0, c0, t0 = wall[arm], cpu[arm], time.perf_counter()
            for _ in range(steps):
                step(arm)
            step_ms[arm].append((time.perf_counter() - t0) / steps * 1e3)
            wall_ms[arm].append((wall[arm] - w0) / steps * 1e3)
            cpu_ms[arm].append((cpu[arm] - c0) / steps * 1e3)

    sent = {arm: _torch_bytes(lambda arm=arm: step(arm)) for arm in arms if arm.startswith("torch-")}
    for arm, state in states.items():
        sent[arm] = sum(row["wire_bytes"] for agg in state.aggregators.values() for row in agg.plan())
    dist.destroy_process_group()

    command = "PYTHONPATH=src:benchmarks python benchmarks/bench_powersgd_codec.py"
    command += (" --quick" if args.quick else "") + (f" --baseline {args.baseline}" if args.baseline else "")
    report = Report("PowerSGD codec cost vs PyTorch's powerSGD_hook (ResNet-18, no network)", command)
    report.add(f"ResNet-18 gradients (62 tensors, 11.2M floats), batch {BATCH}, {args.threads} torch thread(s), "
               f"1-rank gloo group, {steps} step(s) per arm per round, median of {rounds} alternating rounds "
               f"after {WARMUP_STEPS} warm-up steps per arm; {load_note()}")
    rows = [["compute", f"{median(step_ms['compute']):.0f}", "-", "-", "-", "-"]]
    for arm in arms[1:]:
        diff = median([a - c for a, c in zip(step_ms[arm], step_ms["compute"])])
        rows.append([arm, f"{median(step_ms[arm]):.0f}", f"{diff:.1f}", f"{median(wall_ms[arm]):.1f}",
                     f"{median(cpu_ms[arm]):.1f}", f"{sent[arm] / 1e3:.1f}"])
    report.add(table(["arm", "step ms", "step - compute ms", "hook ms", "hook cpu ms", "kB per step"], rows))
    report.add("hook cpu ms per step, by round:\n\n" + table(
        ["arm"] + [str(i + 1) for i in range(rounds)],
        [[arm] + [f"{v:.1f}" for v in cpu_ms[arm]] for arm in arms[1:]]))
    for r in ranks:
        tw, pt = f"thinwire-r{r}", f"torch-r{r}"
        report.figures.append(Figure(
            f"powersgd_r{r}_cost_vs_torch", paired_ratio(cpu_ms[tw], cpu_ms[pt]), "<=", TARGET, "x",
            f"hook CPU per step: thinwire {median(cpu_ms[tw]):.1f} ms, torch {median(cpu_ms[pt]):.1f} ms; "
            f"wall: thinwire {median(wall_ms[tw]):.1f} ms, torch {median(wall_ms[pt]):.1f} ms, "
            f"ratio {paired_ratio(wall_ms[tw], wall_ms[pt]):.3f}"))
    for r in ranks:
        tw, pt = f"thinwire-r{r}", f"torch-r{r}"
        report.figures.append(Figure(f"powersgd_r{r}_bytes_vs_torch", abs(sent[tw] / sent[pt] - 1), "<=", 0.01, "",
                                     f"thinwire {sent[tw]:.0f} B, torch {sent[pt]:.0f} B per step"))
    if args.baseline:
        report.add("thinwire against the baseline codec (median of per-round ratios of hook CPU ms): " + ", ".join(
            f"rank {r} {paired_ratio(cpu_ms[f'thinwire-r{r}'], cpu_ms[f'baseline-r{r}']):.3f}" for r in ranks))
    report.add(_aggregator_table(resnet18, x, y, loss_fn, ranks, codecs, rounds, args.profile))
    return report.finish(args.json)


def _torch_bytes(step) -> float:
    """Bytes of the tensors PyTorch's hook all_reduces in one step."""
    import torch.distributed as dist

    original, total = dist.all_reduce, [0]

    def counting(tensor, *args, **kwargs):
        total[0] += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        step()
    finally:
        dist.all_reduce = original
    return float(total[0])


def _aggregator_table(resnet18, x, y, loss_fn, ranks: "list[int]", codecs: dict, rounds: int, profile: bool) -> str:
    """``Aggregator.reduce_`` alone on ResNet-18's gradients, 1-rank LocalWorld, per codec and rank."""
    import torch

    from thinwire.aggregate import Aggregator
    from thinwire.comm.local import LocalWorld

    torch.manual_seed(0)
    net = resnet18()
    loss_fn(net(x), y).backward()
    grads = [(n, p.grad.detach().clone()) for n, p in net.named_parameters()]
    arms = [(kind, r) for r in ranks for kind in codecs]

    def run(comm):
        aggs = {}
        for kind, r in arms:
            codec = codecs[kind](codecs[kind].Config(rank=r))
            aggs[kind, r] = Aggregator(grads, lambda n, t, codec=codec: codec, comm)
        work = {n: t.clone() for n, t in grads}
        wall: dict = {a: [] for a in arms}
        cpu: dict = {a: [] for a in arms}

        def reduce(arm) -> tuple[float, float]:
            for n, t in grads:
                work[n].copy_(t)
            t0, c0 = time.perf_counter(), time.process_time()
            aggs[arm].reduce_(work)
            return time.perf_counter() - t0, time.process_time() - c0

        for rnd in range(3 + 2 * rounds):
            for arm in arms:
                dt, dc = reduce(arm)
                if rnd >= 3:
                    wall[arm].append(dt * 1e3)
                    cpu[arm].append(dc * 1e3)
        if profile:
            from torch.profiler import profile as prof

            for r in ranks:
                with prof() as p:
                    for _ in range(5):
                        reduce(("thinwire", r))
                print(f"-- torch.profiler, thinwire powersgd:rank={r}, 5 reduce_ calls")
                print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        return wall, cpu

    ((wall, cpu),) = LocalWorld(1).run(run)
    rows = [[f"{kind} powersgd:rank={r}", f"{median(wall[kind, r]):.1f}", f"{min(wall[kind, r]):.1f}",
             f"{median(cpu[kind, r]):.1f}"] for kind, r in arms]
    return ("`Aggregator.reduce_` alone (EF, both rounds, packing, decode; 1-rank LocalWorld), "
            f"{2 * rounds} alternating calls:\n\n" + table(["codec", "median ms", "min ms", "median cpu ms"], rows))


if __name__ == "__main__":
    sys.exit(main())
