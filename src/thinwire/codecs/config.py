"""Config dataclasses for codecs: frozen, keyword-only, one documented knob per field."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def knob(default: Any, help: str, allowed: str = "") -> Any:
    """A config field with its help text and allowed range (shown by ``thinwire methods``)."""
    return field(default=default, metadata={"help": help, "allowed": allowed})


@dataclass(frozen=True, kw_only=True)
class CodecConfig:
    """Knobs every codec has. Subclasses add their own and validate in ``__post_init__``."""

    ef: bool = knob(False, "error feedback: what was not sent is added to the next step's tensor", "true|false")
    min_numel: int = knob(
        1024, "tensors with fewer elements, and every 1-D tensor, travel uncompressed in fp32", ">= 0"
    )

    def __post_init__(self) -> None:
        require(self.min_numel >= 0, f"min_numel must be >= 0, got {self.min_numel}")


def require(ok: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``ok``: the message states the rule broken."""
    if not ok:
        raise ValueError(message)
