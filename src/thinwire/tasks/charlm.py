"""Character-level language model: a causal transformer on text shipped with Python.

The text is ``pydoc_data.topics.topics`` (the interactive help pages, ~465k characters of
English and code), its values concatenated in sorted key order; nothing is downloaded.
The vocabulary is the sorted set of characters in the whole text. The first 90% (by
position) trains, the last 10% tests.

Training windows are random: rank ``r`` of ``W`` owns the ``r``-th of ``W`` equal
contiguous regions of the training text and draws window starts from a generator seeded
by (seed, rank, batch number), so windows of different ranks never overlap. The test set
is every non-overlapping window of the test text, in order; ``evaluate`` reports
``bpc`` = test loss (nats per character) / ln 2 and ``accuracy`` = next-character accuracy.
Because each test window starts with an empty context, bpc is a little higher than a
sliding-window evaluation would give.

``model`` picks a preset of (layers, d_model, heads, context); an option passed
explicitly overrides its preset value. Both presets are the same GPT-2-style decoder
(pre-norm blocks, causal self-attention, GELU MLP 4x, learned positions, untied head):

* ``tiny`` (default): 2 layers, d_model 128, 4 heads, context 64: 431,360 parameters.
* ``gpt-small``: 8 layers, d_model 512, 8 heads (64 per head), context 64: 25,358,336
  parameters, 25,219,072 of them in the blocks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from thinwire.tasks.base import Task, TaskDefaults, TaskError, check_shard_args, generator, register

EVAL_BATCH = 64  # windows per evaluation batch

# The size knobs each ``model`` sets when the user does not pass them.
PRESETS = {
    "tiny": dict(layers=2, d_model=128, heads=4, context=64),  # 431,360 params
    "gpt-small": dict(layers=8, d_model=512, heads=8, context=64),  # 25,358,336 params
}


@dataclass(frozen=True, kw_only=True)
class CharLMOptions:
    model: str = "tiny"  # a PRESETS name: sets the four knobs below unless they are passed
    context: int | None = None  # characters per window (preset: 64); longer = more compute, lower bpc
    layers: int | None = None  # transformer blocks (preset: tiny 2, gpt-small 8)
    d_model: int | None = None  # width; must divide by heads (preset: tiny 128, gpt-small 512)
    heads: int | None = None  # attention heads (preset: tiny 4, gpt-small 8)
    dropout: float = 0.0  # in attention and MLP outputs

    def __post_init__(self) -> None:
        if self.model not in PRESETS:
            raise ValueError(f"model must be one of {', '.join(PRESETS)}, got {self.model!r}")
        for knob, value in PRESETS[self.model].items():
            if getattr(self, knob) is None:
                object.__setattr__(self, knob, value)  # frozen: fill the preset once, here
        for knob in ("context", "layers", "d_model", "heads"):
            if getattr(self, knob) < 1:
                raise ValueError(f"{knob} must be >= 1, got {getattr(self, knob)}")
        d_model, heads = self.d_model, self.heads
        assert d_model is not None and heads is not None  # filled from the preset above
        if d_model % heads:
            raise ValueError(f"d_model must be a multiple of heads, got {d_model} and {heads}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


@register
class CharLM(Task):
    """Next-character prediction on Python's help text with a 2-layer transformer (0.43M params),
    or with ``model=gpt-small`` an 8-layer one of width 512 (25.4M params)."""

    name: ClassVar[str] = "charlm"
    metric: ClassVar[str] = "bpc"
    Config: ClassVar[type] = CharLMOptions
    summary: ClassVar[str] = "char-level transformer (tiny or gpt-small) on Python's pydoc text, bits per character"
    # Measured on 2 shards x 32 windows per step, seeds 0-2: test bpc 6.7 (init) -> ~3.2 at
    # step 100 -> 2.04-2.06 at step 600 (next-char accuracy ~0.62); lr 2e-3 / 3e-3 were worse
    # (2.51 / 2.59 at step 500). ~58 ms CPU per rank-step of 32x64 characters.
    # gpt-small: ~4.8 s per forward+backward of 32x64 characters on 1 CPU thread.
    defaults: ClassVar[TaskDefaults] = TaskDefaults(steps=600, batch_size=32, lr=1e-3, optimizer="adam", eval_every=100)

    def __init__(self, *, seed: int = 0, data_dir: str | None = None, **options: Any) -> None:
        super().__init__(seed=seed, data_dir=data_dir, **options)
        if data_dir is not None:
            raise TaskError("charlm reads text shipped with Python; it takes no data_dir")
        text = corpus()
        self.vocab = sorted(set(text))  # index -> character
        self.train_ids, self.test_ids = encode_split(text)
        if len(self.test_ids) < self.options.context + 1:
            raise TaskError(f"charlm: context {self.options.context} is longer than the test text")

    def describe(self) -> str:
        return (
            f"charlm ({self.options.model}): {len(self.train_ids)} train / {len(self.test_ids)} test characters, "
            f"vocab {len(self.vocab)}, context {self.options.context}"
        )

    def decode(self, ids: Tensor) -> str:
        return "".join(self.vocab[i] for i in ids.tolist())

    def build_model(self) -> nn.Module:
        o = self.options
        with self.seeded("model"):
            return TinyTransformer(len(self.vocab), o.context, o.layers, o.d_model, o.heads, o.dropout)

    # -- training data ------------------------------------------------------------------
    def shard_region(self, rank: int, world_size: int) -> tuple[int, int]:
        """[start, end) of the training text that rank ``rank`` reads windows from."""
        per_rank = len(self.train_ids) // world_size
        return rank * per_rank, (rank + 1) * per_rank

    def window_starts(self, rank: int, world_size: int, batch_size: int, batch: int) -> Tensor:
        """Start positions of batch number ``batch`` of this rank: (batch_size,) int64.

        Each window reads ``context + 1`` characters (inputs and shifted targets), all
        inside the rank's region, so windows of different ranks are disjoint.
        """
        lo, hi = self.shard_region(rank, world_size)
        span = hi - lo - self.options.context  # number of valid starts
        if span < 1:
            raise TaskError(f"charlm: {world_size} ranks leave regions shorter than context + 1 characters")
        gen = generator(self.name, self.seed, "windows", rank, batch)
        return lo + torch.randint(span, (batch_size,), generator=gen)

    def train_batches(
        self, rank: int, world_size: int, batch_size: int, start: int = 0
    ) -> Iterator[tuple[Tensor, Tensor]]:
        check_shard_args(self.name, len(self.train_ids), rank, world_size, batch_size, start)
        offsets = torch.arange(self.options.context + 1)  # (T+1,)
        batch = start
        while True:
            starts = self.window_starts(rank, world_size, batch_size, batch)
            windows = self.train_ids[starts[:, None] + offsets]  # (B, T+1)
            yield windows[:, :-1], windows[:, 1:]  # (B, T) inputs, (B, T) next characters
            batch += 1

    def test_batches(self) -> Iterator[tuple[Tensor, Tensor]]:
        t = self.options.context
        n = (len(self.test_ids) - 1) // t
        inputs = self.test_ids[: n * t].view(n, t)  # (n, T) non-overlapping windows
        targets = self.test_ids[1 : n * t + 1].view(n, t)
        for start in range(0, n, EVAL_BATCH):
            yield inputs[start : start + EVAL_BATCH], targets[start : start + EVAL_BATCH]


@functools.lru_cache(maxsize=1)
def corpus() -> str:
    """Python's own help text: ``pydoc_data.topics.topics`` values in sorted key order."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise TaskError("charlm needs pydoc_data.topics, which this Python does not ship") from None
    return "".join(topics[key] for key in sorted(topics))


@functools.lru_cache(maxsize=1)
def encode_split(text: str) -> tuple[Tensor, Tensor]:
    """Character ids of the first 90% (train) and last 10% (test) of ``text``; read-only."""
    index = {ch: i for i, ch in enumerate(sorted(set(text)))}
    ids = torch.tensor([index[ch] for ch in text], dtype=torch.long)  # (len(text),)
    cut = int(len(ids) * 0.9)
    return ids[:cut], ids[cut:]


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)  # 3 x (B, T, C)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))  # (B, H, T, C/H)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, H, T, C/H)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyTransformer(nn.Module):
    """Decoder-only transformer: (B, T) character ids -> (B, T, vocab) next-character logits."""

    def __init__(self, vocab: int, context: int, layers: int, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.Sequential(*(Block(d_model, heads, dropout) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        for name, p in self.named_parameters():  # GPT-2 style: N(0, 0.02), residual outputs scaled down
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)

    def forward(self, ids: Tensor) -> Tensor:
        t = ids.shape[1]
        if t > self.context:
            raise ValueError(f"sequence length must be <= context {self.context}, got {t}")
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))  # (B, T, C)
        return self.head(self.ln_f(self.blocks(x)))  # (B, T, vocab)
