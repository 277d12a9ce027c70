"""The package version (one place: the package, summaries and checkpoints read it here)."""

__version__ = "0.1.0"
