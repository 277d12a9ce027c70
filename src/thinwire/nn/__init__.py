"""Layers thinwire's methods put into a user's model (AB-training's factored weights)."""

from thinwire.nn.factorized import Factorized, factorize_model

__all__ = ["Factorized", "factorize_model"]
