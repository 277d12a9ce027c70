"""thinwire: train across many workers when the network between them is the bottleneck.

The public API (importing does no work beyond importing torch):

* :func:`attach`: any method ``thinwire methods`` lists, in a user's loop, with the same
  calls for all (``after_backward``, ``after_step``, ``finish``, ``state_dict``).
* :class:`SyncReducer`: compressed synchronous gradient averaging for any training loop.
* :class:`Policy`: a codec per parameter by module type, name and size (presets: ``hylo``).
* :class:`LocalSGD`, :class:`DaSGD`: periodic model averaging, blocking or hidden behind
  the next steps; :class:`DiLoCo`: an outer optimizer on the averaged pseudo-gradients,
  :class:`StreamingDiLoCo` the same synced in fragments behind the next steps,
  :class:`SparseLoCo` with per-rank error feedback and 2-bit chunked top-k in place of
  outer momentum;
  :class:`DPSGD`, :class:`PowerGossip`: gossip with graph neighbours,
  plain or low-rank compressed (``thinwire.topology``); :class:`ABTraining`: low-rank
  ``A·B`` factors trained in groups (``thinwire.nn.Factorized``); all attach with
  ``after_backward()`` and ``after_step()``.
* :class:`DeMo` (``thinwire.optim``): an optimizer that communicates, each rank's momentum
  sent as its top chunked-DCT coefficients; :func:`method_optimizer` builds the optimizer of
  a method that is one (``demo``, ``peer-demo``) from its spec.
* :mod:`thinwire.ddp`: a DDP communication hook on the same codecs (``thinwire.ddp.register``).
* :func:`build_codec` / :func:`available_codecs`: codecs by spec, e.g. ``"topk:ratio=0.01"``.
* :class:`Aggregator`: average any named tensors through codecs (the building block);
  :func:`build_aggregator` gives the two-level one over a world whose ranks are grouped into nodes.
* :class:`Method`: the contract every training method keeps (``docs/adding_a_method.md``);
  :data:`METHODS`, the registry of methods by name (a method of your own registers there).
* :class:`Link`: the alpha-beta network model; :class:`ByteMeter` counts bytes sent.
* :class:`ParameterMismatch`: raised on every rank when the ranks building a method hold
  different parameters, or the same ones in another order.
* :mod:`thinwire.elastic`: workers that leave and join a running job, on torchft
  (``thinwire.elastic.ElasticWorker`` in a user's loop; not imported here).
"""

from thinwire.aggregate import Aggregator
from thinwire.algorithms.ab import ABTraining
from thinwire.algorithms.attach import Attached, attach
from thinwire.algorithms.base import Method
from thinwire.algorithms.build import method_optimizer
from thinwire.algorithms.dasgd import DaSGD
from thinwire.algorithms.diloco import DiLoCo
from thinwire.algorithms.gossip import DPSGD
from thinwire.algorithms.local_sgd import LocalSGD
from thinwire.algorithms.methods import METHODS
from thinwire.algorithms.powergossip import PowerGossip
from thinwire.algorithms.sparseloco import SparseLoCo
from thinwire.algorithms.streaming_diloco import StreamingDiLoCo
from thinwire.algorithms.sync import SyncReducer
from thinwire.codecs.specs import available as available_codecs
from thinwire.codecs.specs import build_codec
from thinwire.comm.fingerprint import ParameterMismatch
from thinwire.comm.link import Link
from thinwire.comm.meter import ByteMeter
from thinwire.hierarchical import build_aggregator
from thinwire.integrations import ddp
from thinwire.optim import DeMo
from thinwire.payload import Aggregation, Payload
from thinwire.policy import Policy, Rule
from thinwire.version import __version__

__all__ = [
    "ABTraining", "Aggregation", "Attached", "attach", "Aggregator", "ByteMeter", "DaSGD", "DeMo", "DiLoCo", "DPSGD",
    "Link", "LocalSGD", "METHODS", "Method", "ParameterMismatch", "Payload", "Policy", "PowerGossip", "Rule",
    "SparseLoCo", "StreamingDiLoCo", "SyncReducer", "available_codecs", "build_aggregator", "build_codec", "ddp",
    "method_optimizer",
    "__version__",
]
