"""Peers: other projects' implementations run as thinwire methods, for a race on equal terms.

PyTorch's own DDP communication hooks (:mod:`~thinwire.peers.torch_builtins`), torchft's
DiLoCo (:mod:`~thinwire.peers.torchft_diloco`) and the DeMo authors' optimizer
(:mod:`~thinwire.peers.detonation_demo`), each with its traffic routed through thinwire's
communicator so its bytes are counted the same way.
"""
