"""Integrations with other training stacks (PyTorch DDP)."""
