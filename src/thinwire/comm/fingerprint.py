"""The ranks agree on the model's parameters before any method averages them.

Every method averages parameters (or their gradients) by position: bucket by bucket, tensor
after tensor, in the order each rank lists them. Ranks that list different parameters, or
the same ones in another order, would average one layer with another, or wait in
collectives of different sizes. :func:`agree_on_parameters` checks this once, when a method
is built: each rank sends a fixed-size fingerprint of its parameters (every name, shape,
dtype and ``requires_grad`` flag, in order) in one all_gather of 40 bytes, with the meter
paused (set-up, not the method's traffic). When the fingerprints agree, that is all. When
they do not, every rank saw the same fingerprints, so every rank takes the same second,
bounded exchange (each rank's description, padded to the longest) and raises the same
:class:`ParameterMismatch`, naming the first parameter the ranks disagree on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable, Iterable, Sequence
from typing import TypeVar

import torch

from thinwire.comm.base import Communicator
from thinwire.comm.byte_rows import gather_bytes

# what one rank says of one parameter: name, shape, dtype, requires_grad
Entry = tuple[str, tuple[int, ...], str, bool]

RULE = "every rank must build the same model, its parameters registered in the same order"
SHOWN = 4  # at most this many distinct answers are named in a message; the rest are counted

K = TypeVar("K", bound=Hashable)


class ParameterMismatch(ValueError):
    """Ranks hold different parameters (names, shapes, dtypes, requires_grad) or hold them
    in another order; raised on every rank alike, naming the first difference."""


def entries(named: Iterable[tuple[str, torch.Tensor]]) -> list[Entry]:
    """What the ranks must agree on, parameter by parameter, in the order given."""
    return [(name, tuple(p.shape), str(p.dtype).removeprefix("torch."), bool(p.requires_grad)) for name, p in named]


def agree_on_parameters(named: Iterable[tuple[str, torch.Tensor]], comm: Communicator) -> None:
    """Raise :class:`ParameterMismatch` on every rank unless every rank of ``comm`` holds the
    same parameters as ``named`` lists them (``model.named_parameters()``): same names,
    shapes, dtypes and ``requires_grad``, in the same order. One all_gather of 40 bytes,
    not metered; nothing at all on one rank."""
    if comm.world_size == 1:
        return
    pairs = list(named)
    mine = entries(pairs)
    text = json.dumps(mine, separators=(",", ":")).encode()
    device = _device(pairs, comm)
    fingerprint = torch.tensor([len(mine), len(text), *_digest(text)], dtype=torch.int64, device=device)
    every = torch.empty(comm.world_size, fingerprint.numel(), dtype=torch.int64, device=device)
    with comm.meter.paused():  # set-up, not the method's traffic
        comm.all_gather(fingerprint, every)
    rows = every.tolist()
    if all(row == rows[0] for row in rows):
        return
    longest = max(row[1] for row in rows)  # every rank knows it: the second exchange has one size everywhere
    with comm.meter.paused():
        texts = gather_bytes(comm, text, longest, device)
    raise ParameterMismatch(mismatch_message([_parse(t) for t in texts]))


def _digest(text: bytes) -> list[int]:
    """The first 24 bytes of ``text``'s SHA-256 as three signed 64-bit integers."""
    h = hashlib.sha256(text).digest()
    return [int.from_bytes(h[i:i + 8], "little", signed=True) for i in range(0, 24, 8)]


def _parse(text: bytes) -> list[Entry]:
    return [(str(n), tuple(int(d) for d in s), str(t), bool(g)) for n, s, t, g in json.loads(text.decode())]


def _device(pairs: Sequence[tuple[str, torch.Tensor]], comm: Communicator) -> torch.device:
    """Where the fingerprints live: under NCCL (which moves only GPU tensors) the GPU the
    parameters are on (a rank whose model sits on ``cuda:1`` need not have called
    ``set_device``), else the current one; the CPU for gloo and in-process worlds."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    try:
        backend = dist.get_backend(getattr(comm, "group", None))
    except (RuntimeError, ValueError):  # a group this process is not in, or an in-process world's
        backend = dist.get_backend()
    if backend != "nccl":
        return torch.device("cpu")
    on_gpu = next((p.device for _, p in pairs if p.is_cuda), None)
    return on_gpu if on_gpu is not None else torch.device("cuda", torch.cuda.current_device())


# -- the message -----------------------------------------------------------------------------
def describe(entry: Entry | None) -> str:
    """``fc1.weight (64x32, float32)``; ``frozen`` added when it does not require grad;
    ``nothing`` for a position past a rank's last parameter."""
    if entry is None:
        return "nothing"
    name, shape, dtype, grad = entry
    size = "x".join(map(str, shape)) if shape else "scalar"
    return f"{name} ({size}, {dtype}{'' if grad else ', frozen'})"


def mismatch_message(every: Sequence[Sequence[Entry]]) -> str:
    """One line naming how the ranks' parameter lists (``every[r]``: rank ``r``'s, in order)
    differ: the counts, when they do, and the first position where a rank differs from
    rank 0, with what each rank holds there (positions count from 0, as
    ``list(model.named_parameters())`` does)."""
    ref = every[0]
    parts = []
    counts = [len(e) for e in every]
    if len(set(counts)) > 1:
        parts.append(_counts(counts))
    first = min(_first_difference(ref, e) for e in every if list(e) != list(ref))
    at = [e[first] if first < len(e) else None for e in every]
    held = {a for a in at if a is not None}
    if len(held) == 1 and None in at:
        # some ranks ended there and the longer ones agree on what comes next: an extra parameter
        (extra,) = held
        parts.append(f"the first extra is {describe(extra)} on {_ranks([r for r, a in enumerate(at) if a])}")
    else:
        groups = _groups(at)
        head, rest = groups[0], groups[1:]
        shown = [f"{describe(a)} on {_ranks(rs)}" for a, rs in rest[:SHOWN]]
        more = sum(len(rs) for _, rs in rest[SHOWN:])
        tail = f", and {more} more ranks differ" if more else ""
        parts.append(f"parameter {first} is {describe(head[0])} on {_ranks(head[1])} but {', '.join(shown)}{tail}")
    return f"ranks disagree on the model's parameters: {'; '.join(parts)}; {RULE}"


def _first_difference(a: Sequence[Entry], b: Sequence[Entry]) -> int:
    """The first position where ``a`` and ``b`` differ (the shorter one's length when one
    starts the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _groups(at: Sequence[K]) -> list[tuple[K, list[int]]]:
    """The ranks grouped by what they hold (``at[r]``: rank ``r``'s), in order of each
    group's lowest rank (rank 0's group first)."""
    groups: dict[K, list[int]] = {}
    for rank, a in enumerate(at):
        groups.setdefault(a, []).append(rank)
    return list(groups.items())


def _counts(counts: Sequence[int]) -> str:
    """``rank 1 has 5 parameters, rank 0 has 4``: the ranks apart from rank 0 first."""
    groups = _groups(counts)
    order = groups[1:][:SHOWN] + groups[:1]
    said = []
    for i, (n, ranks) in enumerate(order):
        unit = "" if i else " parameter" if n == 1 else " parameters"  # named once, with the first count
        said.append(f"{_ranks(ranks)} {'has' if len(ranks) == 1 else 'have'} {n}{unit}")
    more = sum(len(ranks) for _, ranks in groups[1:][SHOWN:])
    return ", ".join(said) + (f", and {more} more ranks have other counts" if more else "")


def _ranks(ranks: Sequence[int]) -> str:
    """``rank 1``, ``ranks 0, 2``, ``ranks 0, 1, 2, 3 and 12 more``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) <= SHOWN:
        return f"ranks {', '.join(map(str, ranks))}"
    return f"ranks {', '.join(map(str, ranks[:SHOWN]))} and {len(ranks) - SHOWN} more"
