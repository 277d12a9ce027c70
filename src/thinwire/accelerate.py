"""Hugging Face accelerate: ``thinwire.accelerate.register(accelerator, model, "powersgd:rank=2")``
after ``accelerator.prepare``; see :mod:`thinwire.integrations.accelerate`."""

from thinwire.integrations.accelerate import register

__all__ = ["register"]
