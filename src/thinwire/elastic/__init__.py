"""Elastic training: workers leave and join a running job, on torchft's Lighthouse and Manager.

:mod:`~thinwire.elastic.lighthouse` starts the Lighthouse (torchft's quorum server);
:mod:`~thinwire.elastic.comm` is a worker's communicator over the current quorum;
:mod:`~thinwire.elastic.worker` is one worker's step: the quorum, the state a joining worker
takes, the method over the workers present and the vote that commits or discards the step.
``thinwire train --elastic`` runs it on the bundled tasks (:mod:`thinwire.run.elastic`).
Per-method rules and what is trusted: docs/fault_tolerance.md and docs/security.md.
"""

from thinwire.elastic.lighthouse import Lighthouse, serve
from thinwire.elastic.worker import ElasticWorker, QuorumLost, Refused

__all__ = ["ElasticWorker", "Lighthouse", "QuorumLost", "Refused", "serve"]
