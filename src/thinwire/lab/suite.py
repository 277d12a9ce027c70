"""``thinwire compare --suite seeds``: each of the five seed methods against its paper's
peers, at small scale, and the measured ratio next to the paper's headline claim.
``thinwire compare --suite lowbandwidth --task text``: the slow-link methods (DiLoCo with fp32
and 4-bit pseudo-gradients, Streaming DiLoCo, MuLoCo, SparseLoCo, DeMo, local SGD, torchft's
DiLoCo) against synchronous AdamW (fp32 and bf16) on a corpus read less than once, 4 workers,
H = 30, 3,000 steps, warm-up + cosine, each figure beside a target of ours (PASS/MISS): final
loss, bytes, the most sent in one step, the share hidden and the modeled time to a target loss
(synchronous AdamW's final loss + 3%) at 10 Mbit/s.
``thinwire compare --suite transform``: DeMo (bf16 and 1-bit coefficients) against
detonation's DeMo, the ``dct`` codec with error feedback, the seed FFT method, top-k,
PowerSGD and fp32 all_reduce, read against targets the same way. A peer whose method cannot
run on the task's model (detonation's DeMo on convolutions) is left out of its race, and
the claims that need it say why.

One race per seed method (a ``thinwire compare`` of its own in ``OUT/<group>/``: report,
CSV, plots), all on the same task, workers, steps and seed. A method that several races
share (``identity``) runs once and its run is copied. ``OUT/report.md`` then sets each
paper's headline figure beside what this machine measured; ``OUT/claims.csv`` holds the
same rows. An ``OUT`` holding any of these, or any file a race writes in ``OUT/<group>/``,
is refused unless ``--overwrite``.

The papers measured wall-clock time on real clusters (AlexNet on 8 GPUs over InfiniBand,
VGG/ResNet on GPU clusters); here the times are the modeled times at each ``--link``
(measured compute and codec time plus the link's alpha-beta time for the bytes sent), on a
small task. The ratios are therefore comparable in kind, not in size: they say whether
the effect the paper reports shows at this scale and on these links. The choice of peers
and knobs is ours (the papers' own hyperparameters do not transfer to a 2-core machine);
it is written into every group below.
"""

from __future__ import annotations

import csv
import dataclasses
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from thinwire.lab import compare
from thinwire.run import outdir
from thinwire.run.config import TrainConfig, for_method
from thinwire.run.summary import Summary

SUITE_WORKERS = 4  # a ring of 4 is still a ring; 4 ranks fit 2 cores
ACCURACY_NOISE_PTS = compare.ACCURACY_NOISE_PTS  # what one seed's final accuracy moves by here: allowed on top


@dataclass(frozen=True)
class Claim:
    """One headline figure of a paper (or a target of ours) and how to measure it here.

    ``kind``: ``speedup`` (peer's modeled time over the seed's, same steps, per link),
    ``bytes`` (peer's bytes over the seed's), ``hidden`` (share of the seed's modeled
    communication overlapped with computation, per link), ``accuracy`` (seed's final
    accuracy minus the peer's, in points), ``loss`` (seed's final test loss over the peer's,
    minus 1: lower is better, at most the figure), ``peak`` (seed's most bytes sent in one
    step over the peer's: at most the figure), ``to-target`` (peer's modeled time to the
    group's target loss over the seed's, per link), ``best-to-target`` (the peer's modeled
    time to the target loss over the shortest of the candidates ``among``, per link).

    ``peer`` may also be ``best-uniform`` (the fastest peer other than ``identity``, by modeled
    time) or ``best:A|B|C`` (of the peers named, the first to the target loss)."""

    text: str  # the paper's claim, in our words
    kind: str
    peer: str | None = None  # the peer: a spec of the group's peers or its method's name (None: the seed alone)
    paper: float | None = None  # the paper's figure (or the target's), when it gives one
    unit: str = "x"
    target: bool = False  # a target of ours, read PASS/MISS, rather than a paper's claim
    link: str | None = None  # per-link kinds: only the race's links that start with this (e.g. "10mbit")
    race: str | None = None  # the peer's run is in this other group's race (one of another optimizer)
    among: str | None = None  # best-to-target: the candidates, "A|B|C" (default: the group's specs but the peer)

@dataclass(frozen=True)
class Group:
    key: str
    title: str
    source: str
    seed: str  # spec of the seed method
    peers: tuple[str, ...]
    claims: tuple[Claim, ...]
    note: str = ""
    # the target loss of the to-target claims: (peer, band) = that peer's final test loss x (1 + band)
    target_loss: tuple[str, float] | None = None
    optimizer: str | None = None  # this race's optimizer (None: the suite's); e.g. muon for MuLoCo
    lr: float | None = None  # this race's learning rate (None: the suite's); e.g. a baseline at its own best lr

    @property
    def specs(self) -> list[str]:
        return [self.seed, *self.peers]


SEEDS: tuple[Group, ...] = (
    Group("fft", "FFT sparsification + range-based float", "Wang et al., HPDC 2020 (arXiv 1811.08596)",
          "fft", ("identity", "qsgd", "terngrad", "topk"),
          (Claim("up to 2.26x faster than no compression", "speedup", "identity", 2.26),
           Claim("1.31x faster than QSGD", "speedup", "qsgd", 1.31),
           Claim("1.25x faster than TernGrad", "speedup", "terngrad", 1.25),
           Claim("1.47x faster than top-k", "speedup", "topk", 1.47),
           Claim("no accuracy loss against no compression", "accuracy", "identity", 0.0, " pts")),
          "AlexNet on 8 GPUs over InfiniBand in the paper; every codec at its defaults here"),
    Group("hylo", "Hylo: hybrid layer-based compression", "Peng, 2021",
          "hylo", ("identity", "twobit", "topk", "qsgd"),
          (Claim("up to 1.31x faster than existing (uniform) methods: against the fastest uniform codec here",
                 "speedup", "best-uniform", 1.31),
           Claim("accuracy loss under 0.5 pts against no compression", "accuracy", "identity", -0.5, " pts")),
          "Uniform = one codec for every layer: twobit (the fc rule everywhere), top-k 1% and QSGD"),
    Group("dasgd", "DaSGD: local SGD with delayed averaging", "Zhou et al., arXiv 2006.00441",
          "dasgd:delay=4", ("identity", "localsgd:period=4,warmup=8"),
          (Claim("100% of the averaging communication hidden behind computation (measured: share of all of "
                 "its modeled communication, the warm-up's included)", "hidden", None, 1.0, ""),
           Claim("faster than blocking local SGD", "speedup", "localsgd", None),
           Claim("faster than synchronous SGD", "speedup", "identity", None),
           Claim("converges as synchronous SGD does (accuracy)", "accuracy", "identity", 0.0, " pts")),
          "Period 4, the longest delay the period allows (4 steps), the 8 warm-up steps of dasgd's default "
          "given to local SGD too; delay=auto would size the delay on this machine's own (fast) loopback"),
    Group("powergossip", "PowerGossip: low-rank gossip", "Vogels et al., NeurIPS 2020 (arXiv 2008.01425)",
          "powergossip", ("dpsgd",),
          (Claim("on par with uncompressed gossip (accuracy of the averaged model)", "accuracy", "dpsgd", 0.0,
                 " pts"),
           Claim("far fewer bytes than uncompressed gossip (no figure in the abstract)", "bytes", "dpsgd", None)),
          "A ring of the suite's workers, rank 1, one power iteration per step (the defaults)"),
    Group("ab", "AB-training", "Coquelin et al., arXiv 2405.01067",
          "ab", ("torch-ddp",),
          (Claim("about 50% less network traffic than data parallel", "bytes", "torch-ddp", 2.0),
           Claim("competitive accuracy with data parallel", "accuracy", "torch-ddp", 0.0, " pts")),
          "Group size half the world, the defaults otherwise (warm-up 100, cycle 100)"),
)

# the slow-link methods on the text task (a corpus read less than once: no repeated data), every method with
# AdamW (MuLoCo: Muon) and warm-up + cosine, H = 30 for every periodic method (the same syncs for all, 100 of
# them in the suite's 3,000 steps); targets of ours, read PASS/MISS. The outer learning rates are
# the ones benchmarks/bench_lowbandwidth.py chose on the validation split (benchmarks/results/lowbandwidth.md)
H = 30
# Douillard et al.'s (outer SGD, Nesterov 0.9); the sweep's choice of {0.4, 0.7, 1.0} x inner {1e-3, 2e-3, 4e-3},
# with inner lr 1e-3 (the text task's, every race's)
DILOCO_OUTER_LR = 0.7
# the sweep's choice of {1 (the authors' code's), 2, 4}: the paper divides the sum of the sparse updates by the R
# workers, the code by the workers that sent each entry, so at R = 4 an entry one worker sent moves 4x less here
SPARSELOCO_OUTER_LR = 4.0
TUNED_ADAMW_LR = 0.004  # synchronous AdamW's own best lr of {1e-3, 2e-3, 4e-3} on the validation split
# 4-bit pseudo-gradients: E3M0 (sign and 3 exponent bits: 7 octaves below the max, half the rounding error of
# E2M1 on a gaussian), averaged by a compressed reduce-scatter + all-gather (thinwire.scatter), without and
# with error feedback
FOUR_BIT = "codec=rangefloat:bits=4;exp_bits=3,scatter=true"
FOUR_BIT_EF = "codec=rangefloat:bits=4;exp_bits=3;ef=true,scatter=true"
LOCALSGD, TORCHFT = f"localsgd:period={H}", f"torch-diloco:period={H}"  # torchft's DiLoCo: outer lr 0.7, Nesterov
DEMO_LOWBW = "demo"  # the paper's defaults: chunk 64, top 32 of 4,096, decay 0.999, sign step at the run's lr
# the settings the suite runs with where the command leaves them out (prepare): 4 x 4 windows of 64 bytes a step,
# 3,000 steps = 3.1 MB of the 11.6 MB of training text (0.26 epochs); warm-up 5% then cosine to 0.1 x lr (ours)
LOWBANDWIDTH_SETTINGS: dict[str, Any] = {"steps": 100 * H, "batch_size": 4, "eval_every": 150,
                                         "optimizer": "adamw", "lr_schedule": "cosine", "warmup_share": 0.05,
                                         "min_lr": 0.1, "text_options": {"context": 64, "eval_windows": 512}}


def diloco_spec(outer_lr: float = DILOCO_OUTER_LR, codec: str = "") -> str:
    return f"diloco:period={H},outer_lr={outer_lr:g}" + (f",{codec}" if codec else "")


def sparseloco_spec(outer_lr: float = SPARSELOCO_OUTER_LR) -> str:
    return f"sparseloco:period={H},outer_lr={outer_lr:g}"


def streaming_spec(outer_lr: float = DILOCO_OUTER_LR) -> str:
    return f"streaming-diloco:period={H},fragments=4,delay=1,outer_lr={outer_lr:g}"


def _diloco_race(diloco: str, slow: tuple[str, ...], sparse: str, four_bit: str, streaming: str, tuned_lr: float,
                 diloco_lr: float, note: str) -> Group:
    """The lowbandwidth suite's main race: DiLoCo against synchronous AdamW, local SGD and every
    other slow-link method."""
    return Group("diloco", "DiLoCo against synchronous AdamW, local SGD and every slow-link method",
                 "Douillard et al. 2023 (arXiv 2311.08105)", diloco,
                 ("identity", LOCALSGD, sparse, four_bit, DEMO_LOWBW, streaming, "bf16", TORCHFT),
                 (Claim("final loss within 2% of synchronous AdamW (fp32 all_reduce every step)", "loss", "identity",
                        0.02, "rel", target=True),
                  Claim("the outer optimizer matters: a final loss below local SGD's at the same H", "loss", LOCALSGD,
                        0.0, "rel", target=True),
                  Claim("bytes per worker against synchronous AdamW", "bytes", "identity", None),
                  Claim(f"final loss against synchronous AdamW at its own best lr ({tuned_lr:g}, chosen on the "
                        "validation split)", "loss", "identity", None, "rel", race="tuned"),
                  Claim("final loss against torchft's DiLoCo", "loss", TORCHFT, None, "rel"),
                  Claim("time to the target loss at 10 Mbit/s: the best slow-link method at least 10x shorter than "
                        "synchronous AdamW", "best-to-target", "identity", 10.0, target=True, link="10mbit",
                        among="|".join(slow)),
                  Claim("time to the target loss against synchronous AdamW, at every link", "to-target", "identity")),
                 f"H = {H} for every periodic method; outer SGD lr {diloco_lr:g}, Nesterov 0.9 (the paper's; the lr "
                 f"chosen on the validation split). The best slow-link method: of {', '.join(slow)}. {note}",
                 target_loss=("identity", 0.03))


def lowbandwidth(diloco_lr: float = DILOCO_OUTER_LR, sparseloco_lr: float = SPARSELOCO_OUTER_LR,
                 tuned_lr: float = TUNED_ADAMW_LR) -> tuple[Group, ...]:
    """The lowbandwidth suite's races with these outer learning rates (DiLoCo's also for its
    4-bit, streamed and Muon variants), and synchronous AdamW at its own best lr ``tuned_lr``
    (the ``tuned`` race) beside the races' shared inner lr."""
    diloco, sparse, streaming = diloco_spec(diloco_lr), sparseloco_spec(sparseloco_lr), streaming_spec(diloco_lr)
    four_bit, four_bit_ef = diloco_spec(diloco_lr, FOUR_BIT), diloco_spec(diloco_lr, FOUR_BIT_EF)
    slow = (diloco, four_bit, streaming, sparse, DEMO_LOWBW, LOCALSGD, TORCHFT)
    note = ("Target loss: synchronous AdamW's final test loss + 3%; times to it are modeled at each link from the "
            "evaluations (measured compute and codec time + the link's time for the bytes sent)")
    return (
        _diloco_race(diloco, slow, sparse, four_bit, streaming, tuned_lr, diloco_lr, note),
        Group("diloco-4bit", "DiLoCo with 4-bit range-float pseudo-gradients",
              "Douillard et al. 2025 (arXiv 2501.18512)", four_bit, (diloco, four_bit_ef),
              (Claim("final loss within 1% of fp32 pseudo-gradients", "loss", diloco, 0.01, "rel", target=True),
               Claim("at least 7x fewer bytes per sync than fp32 pseudo-gradients on 4 workers", "bytes", diloco, 7.0,
                     target=True),
               Claim("final loss against 4-bit with error feedback", "loss", four_bit_ef, None, "rel")),
              "1 sign and 3 exponent bits per value (E3M0) and a window exponent per chunk, averaged by a compressed "
              "reduce-scatter + all-gather (scatter=true: each rank sends 2(n - 1)/n of its 4-bit payload, as the "
              "fp32 ring all_reduce does of its fp32 one; the mean is rounded to 4 bits once more); no error "
              "feedback, as in the paper, and beside it the same with error feedback"),
        Group("streaming", "Streaming DiLoCo: four fragments, each overlapped with the next step",
              "Douillard et al. 2025 (arXiv 2501.18512)", streaming, (diloco,),
              (Claim("final loss within 1% of DiLoCo at the same H", "loss", diloco, 0.01, "rel", target=True),
               Claim("the most sent in one step at most 0.3x DiLoCo's", "peak", diloco, 0.3, target=True),
               Claim("at least 90% of its modeled communication hidden behind computation", "hidden", None, 0.9, "",
                     target=True)),
              f"Fragments: contiguous tensor groups balanced by size; delay 1, alpha 0.5 (ours), DiLoCo's outer lr "
              f"{diloco_lr:g}"),
        Group("sparseloco", "SparseLoCo: top-k of an error-feedback buffer at 2 bits, no outer momentum",
              "Sarfi et al. 2025 (arXiv 2508.15706)", sparse, (diloco,),
              (Claim("final loss at most 1.01x DiLoCo fp32's", "loss", diloco, 0.01, "rel", target=True),
               Claim("at least 50x fewer bytes per worker than DiLoCo fp32", "bytes", diloco, 50.0, target=True)),
              f"The authors' defaults (64 x 64 blocks, k = 64, 2 bits, beta 0.95) but H = {H} (theirs: 15) and outer "
              f"lr {sparseloco_lr:g} (chosen on the validation split)"),
        Group("muloco", "MuLoCo: DiLoCo with Muon as the inner optimizer", "Thérien et al. 2025 (arXiv 2505.23725)",
              diloco, ("identity",),
              (Claim("final loss within 2% of synchronous Muon (the same inner optimizer: the gap is communication's)",
                     "loss", "identity", 0.02, "rel", target=True),
               Claim("final loss no higher than DiLoCo's with AdamW inside", "loss", diloco, 0.0, "rel", target=True,
                     race="diloco"),
               Claim(f"final loss against synchronous AdamW at its own best lr ({tuned_lr:g})", "loss", "identity",
                     None, "rel", race="tuned"),
               Claim("time to the diloco race's target loss against synchronous AdamW (AdamW inside both: this "
                     "compares Muon with AdamW as much as the schedules)", "to-target", "identity", race="diloco")),
              f"--optimizer muon for this race, synchronous Muon (identity) its baseline (Muon on the hidden matrices "
              f"at the run's lr rescaled to AdamW's RMS, "
              f"AdamW on the rest), DiLoCo's outer SGD lr {diloco_lr:g}, Nesterov 0.9 (ours: not retuned for Muon)",
              target_loss=("identity", 0.03), optimizer="muon"),
        Group("demo", "DeMo: each rank's momentum, its top chunked-DCT coefficients all_gathered, a sign step",
              "Peng, Quesnelle, Kingma 2024 (arXiv 2411.19870)", DEMO_LOWBW, ("identity",),
              (Claim("final loss within 5% of synchronous AdamW", "loss", "identity", 0.05, "rel", target=True),
               Claim("bytes per worker against synchronous AdamW", "bytes", "identity", None)),
              "The paper's defaults (chunk 64, top 32, decay 0.999, sign step) at the run's lr and schedule; DeMo is "
              "its own optimizer"),
        Group("tuned", "Synchronous AdamW at its own best learning rate", "the reference, tuned", "identity", (), (),
              f"lr {tuned_lr:g}: the best of the inner-lr sweep for synchronous AdamW on the validation split; the "
              "other races share one inner lr (the DiLoCo paper's protocol: the baseline's lr is the inner one)",
              lr=tuned_lr),
    )


LOWBANDWIDTH: tuple[Group, ...] = lowbandwidth()

# DeMo and the transform codecs (charlm with AdamW, or mnist1d) at equal steps: DeMo (bf16 and 1-bit
# values), detonation's DeMo, the dct codec with error feedback, the seed FFT method, top-k with error
# feedback and PowerSGD, against AdamW (or the task's optimizer) with fp32 all_reduce
DEMO, DEMO_1BIT = "demo", "demo:values=sign"
# about detonation's bytes on charlm (139,648 B a step against its 144,896): 4 B a coefficient (bf16 + int16
# position) against its 8 (fp32 + int32), and its blocks, whose sides divide the tensor's, more numerous than ours
DEMO_AT_PEER_BYTES = "demo:topk=304"
PEER_DEMO = "peer-demo"
_DEMO_TARGET_NOTE = ("Target loss: fp32 all_reduce's final test loss + 2%; times to it are modeled at each link from "
                     "the evaluations (measured compute and codec time + the link's time for the bytes sent)")
TRANSFORM: tuple[Group, ...] = (
    Group("demo", "DeMo: each rank's momentum, its top chunked-DCT coefficients all_gathered, a sign step",
          "Peng, Quesnelle, Kingma 2024 (arXiv 2411.19870)", DEMO,
          ("identity", "fft", "dct:ef=true", "topk", "powersgd", DEMO_1BIT, PEER_DEMO),
          (Claim("final loss within 3% of fp32 all_reduce", "loss", "identity", 0.03, "rel", target=True),
           Claim("at least 30x fewer bytes per worker than fp32 all_reduce", "bytes", "identity", 30.0, target=True),
           Claim("time to the target loss at 10 Mbit/s at least 3x shorter than fp32 all_reduce", "to-target",
                 "identity", 3.0, target=True, link="10mbit"),
           Claim("time to the target loss against fp32 all_reduce, at every link", "to-target", "identity"),
           Claim("final loss against the dct codec as a gradient codec (error feedback, the run's optimizer)",
                 "loss", "dct", None, "rel"),
           Claim("final loss against detonation's DeMo (0.13x its bytes on charlm)", "loss", PEER_DEMO, None, "rel")),
          f"chunk 64, top 32 of each block's 4,096 coefficients, bf16 values, momentum decay 0.999, the run's "
          f"lr (the paper's defaults but the value format). {_DEMO_TARGET_NOTE}",
          target_loss=("identity", 0.02)),
    Group("demo-1bit", "DeMo with 1-bit coefficients (sign and a per-tensor scale)", "ours", DEMO_1BIT, (DEMO,),
          (Claim("final loss against bf16 coefficients", "loss", DEMO, None, "rel"),
           Claim("bytes per worker against bf16 coefficients", "bytes", DEMO, None)),
          "1 bit per kept coefficient and an int16 position: 2.125 B against bf16's 4"),
    Group("demo-peer", "DeMo against detonation's at about equal bytes", "Peng et al. 2024; detonation 0.5.2",
          DEMO_AT_PEER_BYTES, (PEER_DEMO,),
          (Claim("final loss no higher than detonation's DeMo", "loss", PEER_DEMO, 0.0, "rel", target=True),
           Claim("bytes per worker against detonation's DeMo (1x: equal)", "bytes", PEER_DEMO, None),
           Claim("optimizer step (codec and communication seconds) at most 1.0x detonation's", "step", PEER_DEMO,
                 1.0, target=True)),
          "thinwire's DeMo keeps the top 304 of each 64 x 64 block as bf16 + int16 (4 B each); detonation the top 32 "
          "as fp32 + int32 (8 B each) of more, smaller blocks (sides that divide the tensor's): 0.96x its bytes on "
          "charlm"),
    Group("dct", "The dct codec: chunked-DCT top-k gradients with error feedback", "DeMo's transform, as a codec",
          "dct:ef=true", ("identity", "fft", "topk"),
          (Claim("final loss against top-k with error feedback", "loss", "topk", None, "rel"),
           Claim("final loss against the seed FFT method", "loss", "fft", None, "rel"),
           Claim("fewer bytes than fp32 all_reduce", "bytes", "identity", None)),
          "Default knobs (chunk 64, top 32, bf16) with error feedback; tensors under 1,024 values and 1-D ones "
          "travel as fp32"),
)

SUITES = {"seeds": SEEDS, "lowbandwidth": LOWBANDWIDTH, "transform": TRANSFORM}
OUTPUTS = ("report.md", "claims.csv")  # what a suite writes at the top of --out, besides its races


def prepare(base: TrainConfig, out: str, overwrite: bool = False,
            groups: tuple[Group, ...] = SEEDS) -> list[compare.Race]:
    """One validated race per group, in ``out/<key>/``; raises ``ValueError`` (bad method for
    the task, an --out already holding a suite, ...). Unless ``overwrite``, an ``out`` holding
    any file a suite writes (:func:`earlier_output`) is refused before any race directory is made."""
    path = Path(out)
    found = None if overwrite else earlier_output(path, groups)
    if found is not None:
        raise ValueError(f"--out {out} already holds a suite ({found.relative_to(path).as_posix()}); "
                         "pass --overwrite or choose another --out")
    own = outdir.owned(path) if path.is_dir() else set()
    for name in OUTPUTS:  # even --overwrite replaces only thinwire's own (thinwire.run.outdir)
        if os.path.lexists(path / name) and (name not in own or os.path.islink(path / name)):
            raise ValueError(f"--out {out}: {name} was not written by thinwire (it is not in {outdir.MANIFEST}), "
                             "so the suite would replace it; move it away or choose another --out")
    if [g.key for g in groups] == [g.key for g in LOWBANDWIDTH]:  # the suite, whatever its outer lrs
        base = lowbandwidth_settings(base)
    steps = int(for_method(base, "identity").resolve().steps or 0)  # --steps, or the task's budget
    for g in groups:
        for spec in g.specs:
            why = unreached_phase(spec, steps)
            if why is not None:
                raise ValueError(f"--steps {steps} cannot measure the {g.key} race: {why}; its claims need that "
                                 "phase (pass a larger --steps)")
    wanted = [c.link for g in groups for c in g.claims if c.link is not None]
    if not base.links and wanted:  # the race's default links, and one for each claim about a link of its own
        base = dataclasses.replace(base, links=(*compare.DEFAULT_LINKS, *dict.fromkeys(f"{w},1ms" for w in wanted)))
    races = []
    for g in groups:  # every race checked before any folder is made
        given: dict[str, Any] = {k: v for k, v in (("optimizer", g.optimizer), ("lr", g.lr)) if v is not None}
        gbase = dataclasses.replace(base, **given)
        skipped = cannot_run(gbase, g.peers)  # a peer that cannot run on the task is left out, with why
        race = compare.prepare(gbase, [s for s in g.specs if s not in skipped], str(path / g.key),
                               overwrite=overwrite, create=False)
        race.skipped = skipped
        races.append(race)
    for race in races:
        compare.make(race)
    return races


def lowbandwidth_settings(base: TrainConfig) -> TrainConfig:
    """``base`` with the lowbandwidth suite's settings (:data:`LOWBANDWIDTH_SETTINGS`) where the
    command left them out: steps, batch, evaluations, AdamW, warm-up (5% of the steps) + cosine
    to 0.1 x lr (a schedule is left as given unless it is the default constant one without
    warm-up), and on the text task a context of 64 and 512 evaluation windows."""
    s = LOWBANDWIDTH_SETTINGS
    changes: dict[str, Any] = {k: s[k] for k in ("steps", "batch_size", "eval_every", "optimizer")
                               if getattr(base, k) is None}
    if base.lr_schedule == "constant" and base.warmup_steps == 0 and base.min_lr == 0.0:
        steps = base.steps if base.steps is not None else s["steps"]
        changes.update(lr_schedule=s["lr_schedule"], warmup_steps=max(1, round(s["warmup_share"] * steps)),
                       min_lr=s["min_lr"])
    if base.task == "text":
        changes["task_options"] = {**s["text_options"], **base.task_options}
    return dataclasses.replace(base, **changes)


def unreached_phase(spec: str, steps: int) -> str | None:
    """Why a run of ``steps`` steps never reaches the phase ``spec``'s method is about, or None:
    a method with a ``warmup`` knob (synchronous steps first: AB-training, DaSGD, local SGD,
    the DiLoCo family, post-local SGD) must leave it, and one with a ``period`` must average at
    least once after it (at step ``warmup + period``). A run that never does is synchronous
    training under another name: its ratios would read as measured."""
    from thinwire.algorithms.methods import kind_of, method_config

    if kind_of(spec) != "method":
        return None
    _, config = method_config(spec)
    name = spec.split(":")[0]
    warmup, period = getattr(config, "warmup", 0), getattr(config, "period", None)
    warmup = warmup if isinstance(warmup, int) else 0
    if isinstance(period, int) and period > 1 and steps < warmup + period:
        return (f"{name} first averages after step {warmup + period} (warmup {warmup} + period {period}), "
                f"later than the run's {steps} steps")
    if warmup > 0 and steps <= warmup:
        return f"{name} never leaves its warm-up of {warmup} synchronous steps (warmup={warmup}) in {steps} steps"
    return None


def cannot_run(base: TrainConfig, specs: tuple[str, ...]) -> dict[str, str]:
    """The peers among ``specs`` whose method cannot run on the task's model or here at all,
    with why (detonation's DeMo on convolutions, or without the package)."""
    from thinwire.algorithms.methods import check_model, check_world, resolve_method
    from thinwire.tasks import get as get_task

    model = None
    out = {}
    for spec in specs:
        try:
            resolved = resolve_method(spec)
        except ValueError:
            continue  # a bad spec: the race's own checks name it
        if model is None:
            model = get_task(base.task)(seed=base.seed, data_dir=base.data_dir, **base.task_options).build_model()
        try:
            check_world(resolved, base.workers)
            check_model(resolved, model)
        except ValueError as e:
            out[spec] = str(e).splitlines()[0]
    return out


def earlier_output(path: Path, groups: tuple[Group, ...] = SEEDS) -> Path | None:
    """The first file in ``path`` that a suite writes: its own (:data:`OUTPUTS`), then any a
    race writes in its ``<key>/`` (:func:`compare.earlier_output`); None when there is none."""
    for name in OUTPUTS:
        if (path / name).exists():
            return path / name
    for g in groups:
        found = compare.earlier_output(path / g.key)
        if found is not None:
            return found
    return None


def run(races: list[compare.Race], groups: tuple[Group, ...] = SEEDS, *, launch: Callable[..., Any] | None = None,
        show_progress: bool = True, say: Callable[[str], None] = print) -> list[list[dict[str, Any]]]:
    """Run every race; a spec an earlier race already ran (same settings) is copied, not rerun."""
    if launch is None:
        from thinwire.run.launch import launch as default_launch

        launch = default_launch
    # (spec, optimizer, lr) -> (its run directory, summary)
    done: dict[tuple[str, str | None, float | None], tuple[str, Any]] = {}

    def cached(cfg: TrainConfig, show_progress: bool = True) -> Any:
        assert cfg.out is not None  # compare.run gives every run its own directory
        key = (cfg.method, cfg.optimizer, cfg.lr)
        if key in done:
            src, summary = done[key]
            # a copy, recorded as thinwire's in its new folder (whose earlier records stay); the
            # prepare checked that no file of anyone else's is in the way
            before = outdir.owned(cfg.out) if os.path.isdir(cfg.out) else set()
            shutil.copytree(src, cfg.out, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns(outdir.LOCK, outdir.MANIFEST))
            outdir.record(cfg.out, *(before | outdir.owned(src)))
            return summary
        summary = launch(cfg, show_progress=show_progress)
        done[key] = (cfg.out, summary)
        return summary

    t0 = time.perf_counter()
    out = []
    for i, (race, group) in enumerate(zip(races, groups, strict=False), 1):
        methods = ", ".join(s.split(":")[0] for s in race.specs)
        say(f"== race {i}/{len(races)}: {group.title} ({methods}); suite {time.perf_counter() - t0:.0f} s so far")
        out.append(compare.run(race, launch=cached, show_progress=show_progress, say=say))
    return out


def finish(out: str, races: list[compare.Race], results: list[list[dict[str, Any]]], command: str,
           groups: tuple[Group, ...] = SEEDS) -> dict[str, Any]:
    """Each race's report, then ``out/report.md`` and ``out/claims.csv``."""
    rows = []
    views = []  # each race's runs on its shared compute figure, as its report reads them: no claim rests on one
    for race, res, group in zip(races, results, groups, strict=False):  # run's noisy compute
        shared = compare.finish(race, res, command + f"  (race {group.key})")["compute"]
        views.append(compare.with_compute(res, None if shared is None else shared.per_step))
    others = {g.key: _by_spec(g, v, race.skipped) for race, v, g in zip(races, views, groups, strict=False)}
    for race, v, group in zip(races, views, groups, strict=False):
        rows += measure(group, v, race.links, race.skipped, others)
    path = Path(out)
    outdir.claim(path, *OUTPUTS)
    _write_claims(path / "claims.csv", rows)
    name = next((k for k, v in SUITES.items() if [g.key for g in v] == [g.key for g in groups]), "custom")
    _write_report(path / "report.md", races[0], groups, rows, command, name)
    return {"report": str(path / "report.md"), "csv": str(path / "claims.csv"), "rows": rows}


# -- the measured ratios -------------------------------------------------------------------------
def _by_spec(group: Group, results: list[dict[str, Any]],
             skipped: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """A race's results by spec (``results`` in the order of ``group.specs`` less the ``skipped``)."""
    skipped = skipped or {}
    ran = [s for s in group.specs if s not in skipped]
    by_spec = dict(zip(ran, results, strict=False))
    for spec, why in skipped.items():
        by_spec[spec] = {"label": spec.split(":")[0], "spec": spec, "status": "skipped", "error": why,
                         "summary": None, "rows": []}
    return by_spec


def measure(group: Group, results: list[dict[str, Any]], links: tuple[str, ...],
            skipped: dict[str, str] | None = None,
            others: dict[str, dict[str, dict[str, Any]]] | None = None) -> list[dict[str, Any]]:
    """One row per claim and link (a claim that does not depend on the link: one row).
    ``results`` are the race's, in the order of ``group.specs`` less the ``skipped`` ones
    (spec -> why it could not run on the task); ``others``: every race's results by spec, by
    group key, for a claim whose peer ran in another race (``Claim.race``)."""
    by_spec = _by_spec(group, results, skipped)
    seed = by_spec.get(group.seed)
    target = _target_loss(group, by_spec)
    rows = []
    for claim in group.claims:
        per_link = claim.kind in ("speedup", "hidden", "to-target", "best-to-target")
        chosen = [x for x in links if claim.link is None or x.startswith(claim.link)] if per_link else [None]
        if per_link and not chosen:  # the race has no such link: the claim is not measured
            rows.append({"group": group.key, "seed": group.seed, "claim": claim.text, "kind": claim.kind,
                         "peer": claim.peer or "", "link": claim.link or "", "paper": claim.paper, "measured": None,
                         "unit": claim.unit, "detail": f"the race has no {claim.link} link (--link)",
                         "reading": "not measured"})
        for link in chosen:
            if claim.race is not None:  # the peer ran in another race (the target loss too, when it is there)
                theirs = (others or {}).get(claim.race)
                both = {**by_spec, **(theirs or {})}
                value, detail = ((None, f"the {claim.race} race did not run") if theirs is None else
                                 _value(claim, seed, both, group, link, target or _target_loss(group, both)))
            else:
                value, detail = _value(claim, seed, by_spec, group, link, target)
            rows.append({"group": group.key, "seed": group.seed, "claim": claim.text, "kind": claim.kind,
                         "peer": claim.peer or "", "link": link or "", "paper": claim.paper, "measured": value,
                         "unit": claim.unit, "detail": detail, "reading": _reading(claim, value)})
    return rows


def _ok(r: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    return r is not None and r["status"] == "ok" and r["summary"] is not None


def _peer(by_spec: dict[str, dict[str, Any]], key: str) -> dict[str, Any] | None:
    """The result of the peer ``key``: a spec of the group, or the first whose method is named so."""
    if key in by_spec:
        return by_spec[key]
    return next((r for spec, r in by_spec.items() if spec.split(":")[0] == key), None)


def _target_loss(group: Group, by_spec: dict[str, dict[str, Any]]) -> float | None:
    if group.target_loss is None:
        return None
    ref = _peer(by_spec, group.target_loss[0])
    if not _ok(ref) or ref["summary"].final_loss is None:
        return None
    return float(ref["summary"].final_loss) * (1 + group.target_loss[1])


def to_target_loss(r: dict[str, Any], target: float, link: str) -> float | None:
    """Modeled seconds at ``link`` at which the test loss comes down to ``target``, interpolated
    between the two evaluations that straddle it (:func:`compare.crossing`)."""
    return compare.crossing(r["rows"], "test_loss", target, link, higher=False)[1]


def _value(claim: Claim, seed: dict[str, Any] | None, by_spec: dict[str, dict[str, Any]], group: Group,
           link: str | None, target: float | None) -> tuple[float | None, str]:
    if not _ok(seed):
        return None, "the seed method's run failed"
    s = seed["summary"]
    if claim.kind == "hidden":
        comm = s.modeled_comm_seconds_by_link[link]
        hidden = s.hidden_seconds_by_link[link]
        return (hidden / comm if comm > 0 else None), f"{hidden:.2f} of {comm:.2f} s modeled communication hidden"
    if claim.kind == "to-target":
        return _to_target(claim, seed, by_spec, link, target)
    if claim.kind == "best-to-target":
        return _best_to_target(claim, by_spec, group, link, target)
    peer_label = claim.peer
    peer: dict[str, Any] | None
    if peer_label == "best-uniform":  # the fastest peer other than the uncompressed reference
        uniform = [p for p in group.peers if p != "identity"]
        timed = [by_spec[p] for p in uniform if _ok(by_spec.get(p))]
        if not timed:
            return None, "no uniform codec's run completed"
        peer = min(timed, key=lambda r: r["summary"].modeled_seconds_by_link[link])
        peer_label = peer["label"]
    else:
        peer = _peer(by_spec, peer_label) if peer_label is not None else None
        peer_label = peer["label"] if peer is not None else peer_label
    if peer is not None and peer["status"] == "skipped":
        return None, f"{peer_label} cannot run on this task: {peer['error']}"
    if not _ok(peer):
        return None, f"{peer_label}'s run failed"
    p = peer["summary"]
    if claim.kind == "step":
        ms, mp = _step_seconds(s), _step_seconds(p)
        return (ms / mp if mp > 0 else None), (f"{seed['label']} {1e3 * ms:.1f} ms / {peer_label} {1e3 * mp:.1f} "
                                               "ms codec and communication per step")
    if claim.kind == "speedup":
        ts, tp = s.modeled_seconds_by_link[link], p.modeled_seconds_by_link[link]
        return tp / ts, f"{peer_label} {tp:.1f} s / {seed['label']} {ts:.1f} s"
    if claim.kind == "bytes":
        bs, bp = s.bytes_sent_per_worker, p.bytes_sent_per_worker
        return (bp / bs if bs > 0 else None), f"{peer_label} {bp / 1e6:.1f} MB / {seed['label']} {bs / 1e6:.1f} MB"
    if claim.kind == "accuracy":
        a, b = s.final_accuracy, p.final_accuracy
        if a is None or b is None:
            return None, "no accuracy (task without one)"
        return 100 * (a - b), f"{seed['label']} {a:.4f} vs {peer_label} {b:.4f}"
    if claim.kind == "loss":
        a, b = s.final_loss, p.final_loss
        if a is None or b is None or b <= 0:
            return None, "no final loss"
        return a / b - 1, f"{seed['label']} {a:.4f} vs {peer_label} {b:.4f}"
    if claim.kind == "peak":
        a, b = _peak(s), _peak(p)
        if a is None or b is None or b <= 0:
            return None, "no peak bytes per sync reported"
        return a / b, f"{seed['label']} {a / 1e6:.3f} MB / {peer_label} {b / 1e6:.3f} MB in one step"
    raise ValueError(f"unknown claim kind {claim.kind!r}")


def _step_seconds(summary: Summary) -> float:
    """Codec and communication seconds per training step of a run."""
    return (summary.codec_seconds + summary.comm_seconds) / max(1, summary.steps)


def _peak(summary: Summary) -> float | None:
    return summary.method_report.get("peak_bytes_per_sync")


def _to_target(claim: Claim, seed: dict[str, Any], by_spec: dict[str, dict[str, Any]], link: str | None,
               target: float | None) -> tuple[float | None, str]:
    assert link is not None and claim.peer is not None  # to-target claims are per link, against a peer
    if target is None:
        return None, "no target loss (its reference run failed)"
    keys = claim.peer[len("best:"):].split("|") if claim.peer.startswith("best:") else [claim.peer]
    peers = [r for r in (_peer(by_spec, k) for k in keys) if _ok(r)]
    if not peers:
        return None, f"{claim.peer}: no run completed"
    ts = to_target_loss(seed, target, link)
    if ts is None:  # its time to the target is unbounded: no peer is slower
        return 0.0, f"{seed['label']} did not reach loss {target:.4f}"
    # a peer that never reached it: its whole run's time is a lower bound of its time to the target
    timed = [(to_target_loss(r, target, link), r) for r in peers]
    bounds = [(t if t is not None else r["summary"].modeled_seconds_by_link[link], t is None, r) for t, r in timed]
    tp, unreached, best = min(bounds, key=lambda x: x[0])
    if unreached:
        return tp / ts, (f"{best['label']} never reached loss {target:.4f} (its whole run {tp:.1f} s: a lower "
                         f"bound) / {seed['label']} {ts:.1f} s")
    return tp / ts, f"{best['label']} {tp:.1f} s / {seed['label']} {ts:.1f} s to loss {target:.4f}"


def _best_to_target(claim: Claim, by_spec: dict[str, dict[str, Any]], group: Group, link: str | None,
                    target: float | None) -> tuple[float | None, str]:
    """The peer's modeled time to the target loss over the shortest of the candidates'."""
    assert link is not None and claim.peer is not None
    if target is None:
        return None, "no target loss (its reference run failed)"
    ref = _peer(by_spec, claim.peer)
    if not _ok(ref):
        return None, f"{claim.peer}'s run failed"
    keys = claim.among.split("|") if claim.among else [s for s in group.specs if s != claim.peer]
    timed = [(to_target_loss(r, target, link), r) for r in (_peer(by_spec, k) for k in keys) if _ok(r)]
    reached = [(t, r) for t, r in timed if t is not None]
    if not reached:
        return 0.0, f"no slow-link method reached loss {target:.4f} ({len(timed)} ran)"
    tb, best = min(reached, key=lambda x: x[0])
    tp = to_target_loss(ref, target, link)
    bound = tp is None
    tp = ref["summary"].modeled_seconds_by_link[link] if tp is None else tp
    return tp / tb, (f"{ref['label']} {tp:.1f} s{' (never reached it: its whole run)' if bound else ''} / the best, "
                     f"{best['label']}, {tb:.1f} s to loss {target:.4f}")


def _reading(claim: Claim, value: float | None) -> str:
    """Does the measurement show the paper's effect here? ``holds`` / ``partly`` / ``not here``;
    a target of ours: ``PASS`` / ``MISS``."""
    if value is None:
        return "not measured"
    if claim.paper is None and claim.kind in ("loss", "peak"):
        return "measured"
    if claim.target:
        assert claim.paper is not None
        if claim.kind in ("loss", "peak", "step"):  # lower is better
            return "PASS" if value <= claim.paper else "MISS"
        return "PASS" if value >= claim.paper else "MISS"
    if claim.kind in ("speedup", "bytes", "to-target", "best-to-target"):
        if claim.paper is None:
            return "holds" if value > 1.0 else "not here"
        return "holds" if value >= claim.paper else ("partly" if value > 1.0 else "not here")
    if claim.kind == "hidden":
        return "holds" if value >= 0.99 else ("partly" if value > 0 else "not here")
    # accuracy: the paper's figure is the change it allows, in points (0: no loss; -0.5: under half a
    # point lost); one seed on a small task moves by about half a point, so that much is allowed on top
    floor = (claim.paper or 0.0) - ACCURACY_NOISE_PTS
    return "holds" if value >= floor else ("partly" if value >= floor - 2.0 else "not here")


def format_value(value: float | None, unit: str) -> str:
    """A claim's figure as the reports show it: ratios as 1.23x, accuracy as +0.4 pts, shares as 96%."""
    if value is None:
        return "-"
    if unit == " pts":
        return f"{value:+.1f} pts"
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "rel":
        return f"{100 * value:+.1f}%"
    return f"{100 * value:.0f}%"


def _write_claims(path: Path, rows: list[dict[str, Any]]) -> None:
    fields = ["group", "seed", "claim", "kind", "peer", "link", "paper", "measured", "unit", "detail", "reading"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r[k] is None else r[k]) for k in fields})


def _write_report(path: Path, race: compare.Race, groups: tuple[Group, ...], rows: list[dict[str, Any]],
                  command: str, name: str = "seeds") -> None:
    b = race.base
    lines = [f"# thinwire compare --suite {name}: {b.task}, {b.workers} workers, {b.steps} steps", "",
             f"- command: `{command}`",
             f"- seed {b.seed}, optimizer {b.optimizer} (lr {b.lr}), batch {b.batch_size} per worker; links: "
             + ", ".join(race.links),
             "- speedup = the peer's modeled time over the seed method's for the same steps (measured compute and "
             "codec time + the link's alpha-beta time); bytes = the peer's bytes per worker over the seed's; "
             "accuracy = the seed's final test accuracy minus the peer's; loss = the seed's final test loss over the "
             "peer's, minus 1; peak = the seed's most bytes sent in one step over the peer's; to target = the peer's "
             "modeled time to the target loss over the seed's",
             "- reading: holds = the paper's figure is reached (accuracy: to within "
             f"{ACCURACY_NOISE_PTS} pts, what one seed moves by here); partly = the effect shows, smaller; "
             "not here = it does not show at this scale; PASS / MISS: a target of ours, met or not",
             "- the papers measured large models on GPU clusters; this is a small task on a 2-core machine, so a "
             "ratio says whether the paper's effect shows here, not whether its size carries over", ""]
    for g in groups:
        lines += [f"## {g.title} — {g.source}", "", f"Race: `{g.seed}` against " + ", ".join(f"`{p}`" for p in g.peers)
                  + f" ([report]({g.key}/report.md)). {g.note}.", "",
                  "| claim | link | paper / target | measured | reading | from |", "|---|---|---|---|---|---|"]
        for r in (r for r in rows if r["group"] == g.key):
            paper = format_value(r["paper"], r["unit"]) if r["paper"] is not None else "(no figure)"
            measured = format_value(r["measured"], r["unit"])
            lines.append(f"| {r['claim']} | {r['link'] or 'any'} | {paper} | {measured} | {r['reading']} | "
                         f"{r['detail']} |")
        lines.append("")
    lines += ["Every row: `claims.csv`. Each race's runs, table and plots: `<race>/report.md`.", ""]
    path.write_text("\n".join(lines))


def summary_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One console line per claim row."""
    out = []
    for r in rows:
        at = f" @ {r['link']}" if r["link"] else ""
        paper = format_value(r["paper"], r["unit"]) if r["paper"] is not None else "-"
        measured = format_value(r["measured"], r["unit"])
        figure = "target" if r["reading"] in ("PASS", "MISS") else "paper"
        out.append(f"{r['group']}: {r['claim']}{at}: {figure} {paper}, measured {measured} ({r['reading']})")
    return out


__all__ = ["Claim", "Group", "LOWBANDWIDTH", "OUTPUTS", "SEEDS", "SUITES", "SUITE_WORKERS", "TRANSFORM", "cannot_run",
           "diloco_spec", "earlier_output", "finish", "format_value", "lowbandwidth", "lowbandwidth_settings",
           "measure", "prepare", "run", "sparseloco_spec", "summary_lines", "to_target_loss", "unreached_phase"]
