"""Hierarchical reduction on two real nodes: 2 network namespaces x 2 ranks, a shaped veth between them.

Each node is a network namespace holding two ranks (``_shaped_link.py``: its ranks talk over
the namespace's loopback); the two nodes are joined by one veth pair shaped with ``tc tbf``
at each rate (1 Gbit/s and 100 Mbit/s each way; needs Linux, root and iproute2, and says so
and skips otherwise). Every rank: 1 torch thread, SGD with momentum, random data for
ResNet-18 (CIFAR-10 shape, batch 32: a step's cost does not depend on the values), the
task's own batches for mnist1d. Arms, each its own model copy, run in alternating blocks
(A B C ... A B C) after one untimed round; a block is one step, or one period (4 steps) for
the local SGD arms:

- ``compute``: no communication (the floor);
- ``flat-SPEC``: ``SyncReducer(model, SPEC)`` over the world as one flat ring;
- ``hier-SPEC``: the same over the world with ``--ranks-per-node 2``'s groups: fp32
  reduce_scatter inside the node, the codec between nodes on each local rank's shard,
  all_gather inside the node (``thinwire.hierarchical``);
- ``flat-localsgd`` / ``hier-localsgd``: ``localsgd:period=4`` flat, and two-level (every
  step's gradients averaged inside the node, the model between nodes every 4 steps);
- ``torch-localsgd``: PyTorch's layout for the same: DDP with ``post_localSGD_hook`` on the
  intra-node subgroup (``dist.new_subgroups``) and ``PeriodicModelAverager`` (period 4) over
  the world.

Per arm: median step time, its ratio to the flat arm with the same codec (median of per-block
ratios), and the bytes that crossed between the nodes per step: thinwire's meter (the
``inter`` link, summed over the four ranks; PyTorch's arm counted from the tensors its
``dist.all_reduce`` calls send, a flat ring's crossing taken as the meter takes it) beside the
veth's own counters (both directions, read by rank 0 inside its namespace around every timed
block, after barriers). The veth counts Ethernet, IP and TCP headers: the payload estimate
subtracts 66 bytes per packet (14 Ethernet + 20 IPv4 + 32 TCP with timestamps; pure ACKs are
packets of headers alone) and the bytes of the block's own barriers and timing all_reduce
(measured once, with no arm). For ``thinwire cost``'s model: the compute floor, each
SyncReducer arm's codec seconds, bytes and messages between nodes, its overlap window, and
the intra-node collectives timed on the loopback as measured at start-up (an fp32
all_reduce inside a node).

mnist1d accuracy: ``thinwire train --task mnist1d --workers 4`` flat and with
``--ranks-per-node 2`` for each codec (no link: accuracy does not depend on it).

Targets (issue: hierarchical reduction): hier / flat step time with the same codec at
100 Mbit/s <= 0.67 for powersgd and topk on ResNet-18; hier identity / flat identity <= 0.70
at 100 Mbit/s and <= 1.02 at 1 Gbit/s; the meter's inter-node bytes within 5% of the veth's
payload estimate for every arm; thinwire cost's prediction within 20% of the measured step
for the hierarchical SyncReducer arms; mnist1d accuracy of hierarchical within 0.3 points
of flat with the same codec.
"""  # noqa: E501  (line 1 is the --help description: kept whole)

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import Figure, Report, load_note, median, paired_ratio, parser, table

HERE = Path(__file__).resolve().parent
RATES_MBIT = (1000, 100)
PER_NODE = 2
CODECS = ("identity", "bf16", "powersgd:rank=4", "topk:ratio=0.01")
ARMS = ("compute", *(f"{kind}-{c}" for c in CODECS for kind in ("flat", "hier")), "flat-localsgd", "hier-localsgd",
        "torch-localsgd")
PERIOD = 4  # local SGD's period: one average per block
BATCH = {"resnet18": 32}
LATENCY = "50us"  # the veth's own latency, roughly: tbf shapes the rate only
HEADER_BYTES = 66  # per packet: Ethernet 14 + IPv4 20 + TCP 32 (with timestamps)
TARGETS = (  # (figure, codec, target, rates, models)
    ("hier_vs_flat_powersgd", "powersgd:rank=4", 0.67, (100,), ("resnet18",)),
    ("hier_vs_flat_topk", "topk:ratio=0.01", 0.67, (100,), ("resnet18",)),
    ("hier_vs_flat_identity", "identity", 0.70, (100,), ("resnet18",)),
    ("hier_vs_flat_identity", "identity", 1.02, (1000,), ("resnet18",)),
)
BYTES_ERROR = 0.05
MODEL_ERROR = 0.20
ACCURACY_POINTS = 0.3


# -- the models ------------------------------------------------------------------------------------
def build(model: str, rank: int, world: int):
    """(model, loss_fn, batches) of ``rank``."""
    import torch

    if model == "resnet18":
        from bench_real_models import resnet18

        g = torch.Generator().manual_seed(rank)
        b = BATCH[model]
        batches = [(torch.randn(b, 3, 32, 32, generator=g), torch.randint(0, 10, (b,), generator=g)) for _ in range(2)]
        return resnet18(), torch.nn.CrossEntropyLoss(), batches
    from thinwire.tasks import get as get_task

    task = get_task(model)(seed=0)
    stream = task.train_batches(rank, world, task.defaults.batch_size)
    return task.build_model(), task.loss, [next(stream) for _ in range(8)]


# -- one rank (inside its namespace) ---------------------------------------------------------------------
def rank_main(model_name: str, warmup: int, blocks: int, arms: list[str], device: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.nn.parallel import DistributedDataParallel as DDP

    import thinwire
    from _shaped_link import veth_counters
    from thinwire.comm.layout import NodeLayout
    from thinwire.comm.meter import sent_bytes
    from thinwire.comm.nodes import build_hierarchy
    from thinwire.comm.torch_dist import TorchComm

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    layout = NodeLayout(n, int(os.environ["LOCAL_WORLD_SIZE"]))
    intra_group, _ = dist.new_subgroups(group_size=layout.ranks_per_node)  # PyTorch's own node groups
    crosses = layout.node((rank + 1) % n) != layout.node(rank)  # a flat ring's crossing rank
    steppers, meters, timings, reducers, torch_bytes = {}, {}, {}, {}, {}

    def comm_for(kind: str) -> TorchComm:
        comm = TorchComm()
        if kind == "hier":
            build_hierarchy(comm, layout)
        else:
            comm.nodes = layout  # flat: each rank's ring bytes counted on the link they cross
        return comm

    for arm in arms:
        torch.manual_seed(0)
        net, loss_fn, batches = build(model_name, rank, n)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        model, after_backward, after_step = net, None, None
        kind, _, spec = arm.partition("-")
        if kind in ("flat", "hier") and spec != "localsgd":
            comm = comm_for(kind)
            r = thinwire.SyncReducer(net, spec, comm)
            meters[arm], timings[arm], reducers[arm] = comm.meter, (lambda r=r: r.timing), r
            after_backward = r.reduce
        elif kind in ("flat", "hier"):
            comm = comm_for(kind)
            a = thinwire.attach(net, opt, f"localsgd:period={PERIOD}", comm=comm)
            meters[arm], timings[arm] = comm.meter, (lambda a=a: a.method.timing)
            after_backward, after_step = a.after_backward, a.after_step
        elif arm == "torch-localsgd":
            model = DDP(net, broadcast_buffers=False)
            state = post.PostLocalSGDState(process_group=None, subgroup=intra_group, start_localSGD_iter=1)
            model.register_comm_hook(state, post.post_localSGD_hook)
            averager = PeriodicModelAverager(period=PERIOD, warmup_steps=1)

            def after_step(averager=averager, net=net) -> None:
                averager.average_parameters(net.parameters())

            torch_bytes[arm] = {"inter": 0.0, "intra": 0.0}

        def step(i: int, model=model, opt=opt, loss_fn=loss_fn, batches=batches, after_backward=after_backward,
                 after_step=after_step) -> None:
            x, y = batches[i % len(batches)]
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            if after_backward is not None:
                after_backward()
            opt.step()
            if after_step is not None:
                after_step()

        steppers[arm] = step

    original = dist.all_reduce

    def counting(arm: str):
        def all_reduce(tensor, *args, **kwargs):  # PyTorch's arm: what its hook and averager send
            group = kwargs.get("group", args[1] if len(args) > 1 else None)
            nbytes = tensor.numel() * tensor.element_size()
            if group is intra_group:
                torch_bytes[arm]["intra"] += sent_bytes("all_reduce", nbytes, layout.ranks_per_node)
            else:
                torch_bytes[arm]["inter" if crosses else "intra"] += sent_bytes("all_reduce", nbytes, n)
            return original(tensor, *args, **kwargs)
        return all_reduce

    # the loopback inside a node, as thinwire cost's intra link: an fp32 all_reduce of 16 MB
    probe = torch.zeros(4 * 2**20)
    for _ in range(2):
        dist.all_reduce(probe, group=intra_group)
    t0 = time.perf_counter()
    for _ in range(3):
        dist.all_reduce(probe, group=intra_group)
    intra_s = torch.tensor([(time.perf_counter() - t0) / 3], dtype=torch.float64)
    dist.all_reduce(intra_s, op=dist.ReduceOp.MAX)
    intra_Bps = sent_bytes("all_reduce", probe.numel() * 4, layout.ranks_per_node) / intra_s.item()

    def sync_and_read() -> dict[str, int] | None:
        dist.barrier()
        return veth_counters(device) if rank == 0 else None

    # what a block's own barriers and timing all_reduce put on the veth, with no arm
    c0 = sync_and_read()
    dist.barrier()
    dt = torch.zeros(1, dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    c1 = veth_counters(device) if rank == 0 else None
    overhead = _delta(c0, c1) if rank == 0 else None

    seconds = {arm: [] for arm in arms}
    veth = {arm: [] for arm in arms}  # per timed block: the counters' deltas (rank 0)
    meter_inter = {arm: 0.0 for arm in arms}
    crossing = {arm: 0.0 for arm in arms}  # messages this rank sent between nodes (thinwire's arms)
    counter = {arm: 0 for arm in arms}
    marks: dict[str, tuple] = {}
    for rnd in range(warmup + blocks):
        timed = rnd >= warmup
        if rnd == warmup:
            for arm, m in meters.items():
                t = timings[arm]()
                marks[arm] = (m.bytes_sent, m.messages, m.bound_bytes("intra"), m.bound_messages("intra"),
                              t.codec_seconds, dict(reducers[arm].reducer.overlap_figures) if arm in reducers else {})
        for arm, step in steppers.items():
            steps = PERIOD if arm.endswith("localsgd") else 1
            before = sync_and_read()
            inter0 = meters[arm].link_bytes("inter") if arm in meters else torch_bytes.get(arm, {}).get("inter", 0.0)
            sent0 = meters[arm].link_messages("inter") if arm in meters else 0
            if arm in torch_bytes:
                dist.all_reduce = counting(arm)
            dist.barrier()
            t0 = time.perf_counter()
            try:
                for _ in range(steps):
                    step(counter[arm])
                    counter[arm] += 1
            finally:
                dist.all_reduce = original
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            after = veth_counters(device) if rank == 0 else None
            inter1 = meters[arm].link_bytes("inter") if arm in meters else torch_bytes.get(arm, {}).get("inter", 0.0)
            if timed:
                seconds[arm].append(dt.item() / steps)
                meter_inter[arm] += inter1 - inter0
                crossing[arm] += (meters[arm].link_messages("inter") if arm in meters else 0) - sent0
                if rank == 0:
                    veth[arm].append(_delta(before, after))
    sums = torch.tensor([meter_inter[arm] for arm in arms] + [crossing[arm] for arm in arms], dtype=torch.float64)
    dist.all_reduce(sums)  # every rank's bytes and messages between nodes
    cost = {}
    timed_steps = {arm: blocks * (PERIOD if arm.endswith("localsgd") else 1) for arm in arms}
    for arm, m in meters.items():
        t, mk, k = timings[arm](), marks[arm], timed_steps[arm]
        intra_b, intra_m = (m.bound_bytes("intra") - mk[2]) / k, (m.bound_messages("intra") - mk[3]) / k
        c = {"codec_s": (t.codec_seconds - mk[4]) / k, "bytes": (m.bytes_sent - mk[0]) / k - intra_b,
             "messages": (m.messages - mk[1]) / k - intra_m, "intra_bytes": intra_b, "intra_messages": intra_m,
             "window_s": 0.0, "early_share": 0.0, "leads": []}
        if arm in reducers:
            f, f0 = reducers[arm].reducer.overlap_figures, mk[5]
            elements = f["elements"] - f0["elements"]
            c.update(window_s=(f["window_seconds"] - f0["window_seconds"]) / k,
                     early_share=(f["early_elements"] - f0["early_elements"]) / elements if elements else 0.0,
                     leads=reducers[arm].overlap_report()["leads"])
        cost[arm] = c
    if rank == 0:
        Path(out).write_text(json.dumps({
            "seconds": seconds, "veth": veth, "overhead": overhead, "intra_Bps": intra_Bps, "cost": cost,
            "meter_inter_per_step": {arm: sums[i].item() / timed_steps[arm] for i, arm in enumerate(arms)},
            "messages_inter_per_step": {arm: sums[len(arms) + i].item() / timed_steps[arm]
                                        for i, arm in enumerate(arms)},
            "timed_steps": timed_steps}))
    dist.barrier()
    dist.destroy_process_group()


def _delta(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int]:
    assert before is not None and after is not None
    return {k: after[k] - before[k] for k in after}


# -- the launcher (root namespace) ---------------------------------------------------------------------
def run_rate(model: str, rate: int, warmup: int, blocks: int, arms: list[str]) -> dict:
    from _shaped_link import ShapedPair, run_nodes

    device = ShapedPair(rate).devices[0]  # node 0's end of the veth, which rank 0 reads the counters of
    cmd = [sys.executable, str(Path(__file__).resolve()), "--rank-worker", "--model", model, "--warmup", str(warmup),
           "--blocks", str(blocks), "--arms", ",".join(arms), "--device", device]
    return run_nodes(rate, PER_NODE, cmd, port=29518, timeout=3000, tag=f"hier-{model}")


def measure(report: Report, model: str, arms: list[str], args) -> bool:
    from thinwire.comm.link import Link
    from thinwire.lab.cost import StepCost

    label = {"resnet18": "ResNet-18 (11.2M), batch 32", "mnist1d": "mnist1d (the task's model and batches)"}[model]
    ok = True
    for rate in (int(x) for x in args.rates.split(",")):
        t0 = time.perf_counter()
        try:
            r = run_rate(model, rate, args.warmup, args.blocks, arms)
        except RuntimeError as e:
            report.add(f"### {label}, {rate} Mbit/s between the nodes: FAILED\n\n```\n{str(e)[-2000:]}\n```")
            ok = False
            continue
        sec, over = r["seconds"], r["overhead"]
        floor = median(sec["compute"])
        link = Link.parse(f"{rate}mbit,{LATENCY}")
        intra = Link(latency_s=20e-6, bandwidth_Bps=r["intra_Bps"])
        rows, checks, predictions = [], [], []
        for arm in arms:
            kind, _, spec = arm.partition("-")
            flat = f"flat-{spec}"
            vs_flat = (f"{paired_ratio(sec[arm], sec[flat]):.3f}" if kind in ("hier", "torch") and flat in sec
                       else "-")
            steps = PERIOD if arm.endswith("localsgd") else 1
            meter = r["meter_inter_per_step"][arm]
            if arm != "compute":
                blocks = r["veth"][arm]
                raw = sum(b["tx_bytes"] + b["rx_bytes"] for b in blocks) / len(blocks)
                packets = sum(b["tx_packets"] + b["rx_packets"] for b in blocks) / len(blocks)
                own = over["tx_bytes"] + over["rx_bytes"] - HEADER_BYTES * (over["tx_packets"] + over["rx_packets"])
                payload = (raw - HEADER_BYTES * packets - own) / steps
                error = meter / payload - 1 if payload > 0 else float("inf")
                msgs = r.get("messages_inter_per_step", {}).get(arm, 0.0)
                checks.append([arm, f"{meter / 1e6:.3f}", f"{raw / steps / 1e6:.3f}", f"{packets / steps:.0f}",
                               f"{payload / 1e6:.3f}", f"{100 * error:+.2f}%", f"{msgs:.0f}" if msgs else "-",
                               f"{(payload - meter) / msgs:.0f}" if msgs else "-"])
                if meter > 0:
                    report.figures.append(Figure(f"meter_vs_veth_{model}_{arm.replace(':', '_')}_{rate}mbit",
                                                 abs(error), "<=", BYTES_ERROR, "",
                                                 f"meter {meter / 1e6:.3f} MB/step, veth payload "
                                                 f"{payload / 1e6:.3f} MB/step"))
            rows.append([arm, f"{1e3 * median(sec[arm]):.0f}", f"{1e3 * min(sec[arm]):.0f}-{1e3 * max(sec[arm]):.0f}",
                         f"{paired_ratio(sec[arm], sec['compute']):.3f}", vs_flat, f"{meter / 1e6:.3f}"])
            c = r["cost"].get(arm)
            if c is not None and not arm.endswith("localsgd"):
                intra_s = c["intra_messages"] * intra.latency_s + c["intra_bytes"] / intra.bandwidth_Bps
                share = PER_NODE if kind == "hier" else 1  # the node's ranks share its link between nodes
                cost = StepCost(method=arm, compute_s=floor, codec_s=c["codec_s"], bytes=share * c["bytes"],
                                messages=c["messages"], window_s=c["window_s"], early_share=c["early_share"],
                                leads=tuple(map(tuple, c["leads"])), intra_s=intra_s)
                predicted, measured = cost.seconds(link), median(sec[arm])
                predictions.append([arm, f"{1e3 * predicted:.0f}", f"{1e3 * measured:.0f}",
                                    f"{100 * (predicted / measured - 1):+.1f}%", f"{1e3 * c['codec_s']:.0f}",
                                    f"{1e3 * intra_s:.1f}", f"{1e3 * c['window_s']:.0f}"])
                if kind == "hier":
                    report.figures.append(Figure(f"cost_model_error_{model}_{arm.replace(':', '_')}_{rate}mbit",
                                                 abs(predicted / measured - 1), "<=", MODEL_ERROR, "",
                                                 f"predicted {1e3 * predicted:.0f} ms, "
                                                 f"measured {1e3 * measured:.0f} ms"))
        report.add(f"### {label}, {rate} Mbit/s between the nodes ({len(sec['compute'])} timed blocks, "
                   f"{time.perf_counter() - t0:.0f} s; {load_note()}); compute-only floor {1e3 * floor:.0f} ms\n\n"
                   + table(["arm", "ms/step (median)", "range", "/ compute", "/ flat, same codec",
                            "MB between nodes/step (meter)"], rows))
        report.add(f"Bytes between the nodes per step, both directions: the meter (all ranks) against the veth "
                   f"(raw, its packets, and the payload estimate: raw - {HEADER_BYTES} B per packet - the blocks' "
                   f"own barriers, {over['tx_bytes'] + over['rx_bytes']} B raw per block)\n\n"
                   + table(["arm", "meter MB", "veth raw MB", "packets", "veth payload MB", "meter / payload - 1",
                            "messages across (meter)", "payload - meter, B per message"], checks)
                   + "\n\nThe last column is what the veth carried beyond the tensors, per message the meter "
                   "counted across: gloo frames every message with a 48-byte preamble, and its unbound-buffer "
                   "send/recv adds a 48-byte ready notice or two (gloo/transport/tcp/pair.h), which the meter, "
                   "counting tensor bytes, leaves out.")
        if predictions:
            report.add(f"thinwire cost's model at {rate}mbit,{LATENCY} between the nodes and the measured loopback "
                       f"inside them ({8 * r['intra_Bps'] / 1e9:.1f} Gbit/s, 20 us) from the compute floor and each "
                       "SyncReducer arm's codec seconds, bytes, messages and overlap window:\n\n"
                       + table(["arm", "predicted ms", "measured ms", "error", "codec ms", "intra ms", "window ms"],
                               predictions))
        for name, codec, target, rates, models in TARGETS:
            hier, flat = f"hier-{codec}", f"flat-{codec}"
            if rate in rates and model in models and hier in sec and flat in sec:
                report.figures.append(Figure(f"{name}_{model}_{rate}mbit", paired_ratio(sec[hier], sec[flat]), "<=",
                                             target, "x", f"{hier} {1e3 * median(sec[hier]):.0f} ms/step, {flat} "
                                             f"{1e3 * median(sec[flat]):.0f} ms/step"))
    return ok


def accuracy(report: Report, codecs: list[str]) -> None:
    """mnist1d, 4 workers, each codec flat and with two ranks per node: final accuracies."""
    rows = []
    for codec in codecs:
        acc = {}
        for kind, extra in (("flat", []), ("hier", ["--ranks-per-node", str(PER_NODE)])):
            with tempfile.TemporaryDirectory(prefix="thinwire-hier-acc-") as tmp:
                cmd = [sys.executable, "-m", "thinwire", "train", "--task", "mnist1d", "--workers", "4", "--method",
                       codec, "--quiet", "--out", tmp, *extra]
                print(f"accuracy: {kind} {codec}", flush=True)
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                acc[kind] = json.loads(Path(tmp, "summary.json").read_text())["final_accuracy"]
        gap = round(100 * abs(acc["hier"] - acc["flat"]), 9)  # accuracies count test samples: no float dust
        rows.append([codec, f"{100 * acc['flat']:.2f}", f"{100 * acc['hier']:.2f}", f"{gap:.2f}"])
        report.figures.append(Figure(f"accuracy_gap_mnist1d_{codec.replace(':', '_')}", gap, "<=", ACCURACY_POINTS,
                                     " pts", f"flat {100 * acc['flat']:.2f}%, hierarchical {100 * acc['hier']:.2f}%"))
    report.add("### mnist1d accuracy, 4 workers (2 nodes x 2 ranks for hierarchical), the task's default budget\n\n"
               + table(["codec", "flat %", "hierarchical %", "gap (points)"], rows))


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--rank-worker", action="store_true", help=argparse_hidden())
    p.add_argument("--model", choices=["resnet18", "mnist1d", "all"], default="all",
                   help="default: both, mnist1d first")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--blocks", type=int, default=3, help="timed rounds")
    p.add_argument("--arms", help="comma-separated (default: every arm)")
    p.add_argument("--rates", default=",".join(map(str, RATES_MBIT)), help="link rates in Mbit/s, comma-separated")
    p.add_argument("--no-accuracy", action="store_true", help="leave out the mnist1d accuracy runs")
    p.add_argument("--device", help=argparse_hidden())
    p.add_argument("--result", help=argparse_hidden())
    args = p.parse_args(argv)
    if args.rank_worker:
        rank_main(args.model, args.warmup, args.blocks, args.arms.split(","), args.device, args.result)
        return 0
    from _shaped_link import unavailable

    command = "python benchmarks/bench_hierarchical.py" + (f" --model {args.model}" if args.model != "all" else "")
    report = Report("Hierarchical reduction: two nodes of two ranks over a shaped link", command)
    why = unavailable()
    failed = False
    if why is not None:
        report.add(f"Two-node step times: skipped: {why}")
    else:
        arms = args.arms.split(",") if args.arms else list(ARMS)
        for model in (["mnist1d", "resnet18"] if args.model == "all" else [args.model]):
            failed |= not measure(report, model, arms, args)
    if not args.no_accuracy:
        accuracy(report, list(CODECS) + ["localsgd"])
    code = report.finish(args.json)
    return 2 if failed else code


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
