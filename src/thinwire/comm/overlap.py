"""The modeled seconds of codec and communication work that a step hides behind its backward pass.

Buckets launched during backward run on one background thread while backward goes on; what
is left when the step calls ``reduce()`` is the part not hidden. The trainer's modeled time
and ``thinwire cost``'s prediction both use :func:`overlap_hidden_seconds`.
"""

from __future__ import annotations

from thinwire.comm.link import Link


def overlap_hidden_seconds(link: Link, *, bytes: float, messages: float, codec_s: float, window_s: float,
                           early_share: float, wait_s: float = 0.0,
                           leads: tuple[tuple[float, float], ...] = (), intra_s: float = 0.0) -> float:
    """Modeled seconds of codec and communication work hidden behind the backward pass on
    ``link``: ``min(window_s, early_share · (codec_s + max(wait_s, messages · α + bytes / β)))``.

    Pass run totals (bytes and messages sent by this rank, codec seconds, the summed overlap
    window ``overlap_report()["window_seconds"]``) for the run's hidden seconds, or the same
    figures per step for a step's: the formula is the same for both (every term scales with
    the number of steps). ``early_share`` is ``overlap_report()["early_share"]``, the share of
    averaged elements launched during backward, taken as the share of the codec time, bytes
    and messages too. ``wait_s`` (default 0: the trainer's modeled time has no such floor) is
    the collectives' own time with no link, as ``thinwire cost`` measures it. 0 when nothing
    was launched in backward (``window_s`` 0 or ``early_share`` 0).

    ``leads``, when given (per-step figures only), refines this: per launched bucket, in
    launch order, (seconds from its launch to ``reduce()``, its share of the elements); the
    buckets queue on the one background thread, so the part left at ``reduce()`` is
    ``max(0, max_i(S_i · G − lead_i))`` with ``S_i`` the share of bucket ``i`` and those after
    it, and the hidden part is ``early · G`` minus that (``leads`` = ((W, s),) is the formula
    above). ``intra_s``: the seconds of the collectives inside a node, on their own link
    (hierarchical runs; ``bytes`` and ``messages`` are then those between nodes).
    """
    busy = codec_s + max(wait_s, intra_s + messages * link.latency_s + bytes / link.bandwidth_Bps)
    return hidden_part(busy, launch_groups(leads, window_s, early_share))


def launch_groups(leads: tuple[tuple[float, float], ...], window_s: float,
            early_share: float) -> tuple[tuple[float, float], ...]:
    """The launched buckets as (lead seconds, share), in launch order: ``leads`` when known,
    else one group (the window, the early share), else none."""
    if leads:
        return tuple((max(float(lead), 0.0), clamp_share(share)) for lead, share in leads)
    if window_s > 0 and early_share > 0:
        return ((float(window_s), clamp_share(early_share)),)
    return ()


def tail_shares(groups: tuple[tuple[float, float], ...]) -> list[tuple[float, float]]:
    """(lead_i, S_i): each launched bucket's lead and the share of it and every bucket after it."""
    out, after = [], 0.0
    for lead, share in reversed(groups):
        after += share
        out.append((lead, after))
    return out[::-1]


def hidden_part(busy: float, groups: tuple[tuple[float, float], ...]) -> float:
    """Seconds of ``busy`` (a step's codec and communication work) hidden behind backward."""
    if not groups:
        return 0.0
    early = min(sum(share for _, share in groups), 1.0)
    left = max(0.0, *(tail * busy - lead for lead, tail in tail_shares(groups)))
    return max(0.0, early * busy - left)


def clamp_share(early_share: float) -> float:
    return min(max(early_share, 0.0), 1.0)
