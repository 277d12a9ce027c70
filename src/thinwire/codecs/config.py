"""Config dataclasses for codecs: frozen, keyword-only, one documented knob per field."""

from __future__ import annotations

from dataclasses import dataclass

from thinwire.knobs import knob, require

__all__ = ["CodecConfig", "knob", "require"]


@dataclass(frozen=True, kw_only=True)
class CodecConfig:
    """Knobs every codec has. Subclasses add their own and validate in ``__post_init__``."""

    ef: bool = knob(False, "error feedback: what was not sent is added to the next step's tensor", "true|false")
    min_numel: int = knob(
        1024, "tensors with fewer elements, and every 1-D tensor, travel uncompressed in fp32", ">= 0"
    )

    def __post_init__(self) -> None:
        require(self.min_numel >= 0, f"min_numel must be >= 0, got {self.min_numel}")
