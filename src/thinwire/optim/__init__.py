"""Optimizers that communicate: :class:`DeMo` steps every rank with the all-gathered top DCT
coefficients of its own momentum, in place of a gradient all_reduce."""

from thinwire.optim.demo import DeMo

__all__ = ["DeMo"]
