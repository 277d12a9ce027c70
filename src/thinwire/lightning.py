"""PyTorch Lightning: ``Trainer(strategy=thinwire.lightning.strategy("powersgd:rank=2"))``.

Needs the ``lightning`` extra (``pip install 'thinwire[lightning]'``); see
:mod:`thinwire.integrations.lightning` for what runs and how.
"""

from thinwire.integrations.lightning import ThinwireStrategy, strategy

__all__ = ["ThinwireStrategy", "strategy"]
