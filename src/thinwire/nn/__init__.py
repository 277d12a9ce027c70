"""Layers thinwire's methods put into a user's model (AB-training's factored weights), and
the way back to the user's own layers."""

from thinwire.nn.factorized import Factorized, factorize_model, unfactorize_model

__all__ = ["Factorized", "factorize_model", "unfactorize_model"]
