"""What the harness reads of a method beyond its training calls: the figures of the records and
of summary.json, and what the cost model needs.

Optional: a :class:`~thinwire.algorithms.base.Method` that implements only the training calls
is complete. The trainer, the elastic worker and :class:`~thinwire.algorithms.attach.Attached`
read these figures through the functions below, which give the default for a method without
them; :class:`Reports` holds the same defaults for a method that reports some figures and
wants the rest as they are.
"""

from __future__ import annotations

from typing import Any

from thinwire.comm.link import Link


class Reports:
    """The reporting protocol with its defaults (a mixin beside :class:`Method`)."""

    @property
    def spec(self) -> str:
        """The method's spec (:attr:`Method.spec`, which comes first in a method's bases)."""
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        """Figures logged with every evaluation in metrics.jsonl. Default: none."""
        return {}

    def report(self) -> dict[str, Any]:
        """The ``method_report`` of summary.json. Default: the spec."""
        return {"method": self.spec}

    def summary_fields(self) -> dict[str, Any]:
        """Top-level fields added to summary.json (the summary's ``method_fields``; a name of
        the summary's own fields is refused when it is written). Default: none."""
        return {}

    def per_parameter(self) -> list[dict[str, Any]]:
        """Per parameter: ``name``, ``shape``, ``codec`` and ``bytes_sent`` so far, for
        methods that send each parameter through a codec. Default: none."""
        return []

    def overlap_report(self) -> dict[str, Any] | None:
        """How much gradient averaging ran beside the backward pass (see
        :meth:`~thinwire.algorithms.sync.SyncReducer.overlap_report`), for the cost model;
        None (the default) for methods that report none. The warm-ups of model averaging
        and AB-training overlap their buckets too, and report none: the modeled time counts
        their averaging whole."""
        return None

    def hidden_seconds(self, link: Link) -> float:
        """Modeled seconds of this rank's codec and communication work on ``link`` that ran
        behind computation (and so do not add to the step time). Default: none."""
        return 0.0

    def hidden_fraction(self) -> float | None:
        """The measured share of communication time hidden behind computation, where the
        method measures it. Default: None."""
        return None


def stats(method: Any) -> dict[str, Any]:
    """``method.stats()``, or no figures."""
    own = getattr(method, "stats", None)
    return own() if own is not None else {}


def report(method: Any) -> dict[str, Any]:
    """``method.report()``, or its spec."""
    own = getattr(method, "report", None)
    return own() if own is not None else {"method": method.spec}


def summary_fields(method: Any) -> dict[str, Any]:
    """``method.summary_fields()``, or none."""
    own = getattr(method, "summary_fields", None)
    return own() if own is not None else {}


def per_parameter(method: Any) -> list[dict[str, Any]]:
    """``method.per_parameter()``, or none."""
    own = getattr(method, "per_parameter", None)
    return own() if own is not None else []


def overlap_report(method: Any) -> dict[str, Any] | None:
    """``method.overlap_report()``, or None: no averaging beside the backward pass to report."""
    own = getattr(method, "overlap_report", None)
    return own() if own is not None else None


def hidden_seconds(method: Any, link: Link) -> float:
    """``method.hidden_seconds(link)``, or none hidden."""
    own = getattr(method, "hidden_seconds", None)
    return own(link) if own is not None else 0.0


def hidden_fraction(method: Any) -> float | None:
    """``method.hidden_fraction()``, or None: not measured."""
    own = getattr(method, "hidden_fraction", None)
    return own() if own is not None else None
