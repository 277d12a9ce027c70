"""One elastic worker: a torchft replica group of one rank, running a thinwire method.

torchft decides everything about membership: the Lighthouse forms a quorum at each step that
communicates, the ``Manager`` reconfigures its gloo group over it, votes on committing the
step (in a replica group of one rank the vote is the rank's own, decided without the round
trip to torchft's manager server: :func:`_vote_locally`), and brings a worker that joins (or
fell behind) up to date by fetching a present worker's state before its step starts. A step
on which the method sends nothing (the DiLoCo family's inner steps,
:meth:`~thinwire.algorithms.base.Method.communicates_next`) asks for no quorum, casts no
vote and keeps no copy to undo: the worker trains alone, and the workers meet again at the
next average (a joiner waits there for them). thinwire supplies the state and keeps each
method's maths right:

* **the state sent to a joining worker**: the model, the optimizer, the method's own state
  (error-feedback residuals, PowerSGD's Q, DiLoCo's outer optimizer and global model, ...)
  and whatever the loop adds (``extra_state``), with torchft's step counter, which is also
  the data position: a worker's batches are a pure function of (seed, worker, step);
* **the method over the quorum**: at each change of the quorum the method is built again
  over the new group (its state carried over), so its divisor is the number of workers
  present and anything it laid out by world size is laid out again;
* **a step that failed is applied nowhere**: a collective that fails makes the manager vote
  against the step (:class:`~thinwire.elastic.comm.QuorumComm`); the step's changes are then
  undone (the method's state, and the model and optimizer where the method stepped them
  before the vote), so it leaves no residual changed, and the same step is tried again at the
  next quorum with the same batch;
* **admission**: a worker joins only a job of the same method, model and thinwire version
  (:class:`Refused` on the newcomer, by name; the others discard that one step), and, in a
  job with a secret (:mod:`thinwire.elastic.secret`), only one that proves at each new
  quorum that it holds it: every member shows a fresh nonce, then an HMAC over the quorum
  and every member's nonce. A member whose proof fails, or who shows none, is named, and
  the others vote against the step before any other collective of it runs;
* **the state a joiner takes** travels over the quorum's own group, sealed with the secret
  and checked before it is unpickled (:mod:`thinwire.elastic.transport`): no worker runs a
  state server.

The loop::

    worker = ElasticWorker(model, optimizer, "powersgd", lighthouse="127.0.0.1:29510",
                           replica=0, min_workers=2)
    while worker.step < steps:
        step = worker.begin()                  # the quorum; a joiner is brought up to date here
        x, y = batch(replica=0, step=step + 1)  # the data position is the committed step
        loss = loss_fn(model(x), y)
        loss.backward()
        worker.commit(loss)                    # average, step, vote; undone if the vote fails
    worker.close()
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import copy
import hashlib
import json
import os
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from thinwire.comm.byte_rows import gather_bytes
from thinwire.comm.fingerprint import entries
from thinwire.elastic.comm import QuorumComm
from thinwire.elastic.lighthouse import url

TEXT_BYTES = 1024  # room for a worker's fingerprint in the admission exchange
TIMEOUT_S = 4.0  # a collective, a commit vote or a state transfer waiting longer fails
WAIT_S = 60.0  # how long a worker waits for a quorum of --min-workers before it gives up
RENDEZVOUS_S = 3.0  # a new quorum's group set up: a member not there by then is taken for dead


class Refused(ValueError):
    """This worker cannot join the running job (another method, model or thinwire version)."""


class QuorumLost(RuntimeError):
    """No quorum of ``min_workers`` formed within the wait: the job cannot go on."""


@dataclass
class Change:
    """One change of the quorum, as this worker saw it."""

    step: int  # committed steps when the quorum formed (the next step is step + 1)
    size: int
    members: list[int]
    joined: list[int]
    left: list[int]
    seconds: float  # from asking for the quorum to having it (a joiner: its state received too)
    healed: bool  # this worker took a present worker's state at this quorum
    at: float  # time.time() when the quorum formed

    def record(self) -> dict[str, Any]:
        return {"step": self.step, "workers": self.size, "members": self.members, "joined": self.joined,
                "left": self.left, "seconds": round(self.seconds, 4), "healed": self.healed,
                "time": round(self.at, 3)}


@dataclass
class Tally:
    """What the worker counts across membership changes."""

    changes: list[Change] = field(default_factory=list)
    committed: int = 0  # steps this worker committed
    discarded: int = 0  # steps this worker ran and threw away (a collective failed, or too few workers)
    heals: int = 0
    present: list[list[int]] = field(default_factory=list)  # [first step, last step, workers]: runs of equal size
    refusals: list[dict[str, Any]] = field(default_factory=list)  # members not admitted: step, worker, why, time

    def count(self, step: int, workers: int) -> None:
        if self.present and self.present[-1][2] == workers and self.present[-1][1] == step - 1:
            self.present[-1][1] = step
        else:
            self.present.append([step, step, workers])


@contextlib.contextmanager
def _manager_server_on(host: str) -> Iterator[None]:
    """torchft's manager server, while a ``Manager`` is built, listening on ``host`` alone:
    torchft 0.2 binds it to every interface (``[::]``) with no setting to change that."""
    import torchft.manager as torchft_manager

    real = torchft_manager.ManagerServer

    def on_host(*args: Any, **kwargs: Any) -> Any:
        port = str(kwargs.get("bind", "0")).rsplit(":", 1)[-1]
        kwargs["bind"] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return real(*args, **kwargs)

    torchft_manager.ManagerServer = on_host
    try:
        yield
    finally:
        torchft_manager.ManagerServer = real


def _listening(host: str) -> Any:
    """A TCP socket listening on ``host`` alone, on a free port (for the worker's store)."""
    from thinwire.elastic.gate import listening

    try:
        return listening(host)
    except OSError as e:
        raise ValueError(f"an elastic worker cannot listen on {host}: {e.strerror or e}") from None


class _LocalVote:
    """torchft's manager client, but for the commit vote: in a replica group of one rank, the
    group's decision is that rank's own vote, which torchft's manager server (in this
    process) would only echo back over gRPC. Everything else goes to the real client."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: Any = None) -> bool:
        return bool(should_commit)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def _vote_locally(manager: Any) -> None:
    """Let ``manager`` (a replica group of one rank) decide its commit vote without the round
    trip to its own server; torchft's bookkeeping of the vote (the step counter, the failure
    count, a heal's pending state, the checkpoint transport) runs as before. A torchft whose
    manager keeps no ``_client`` is left as it is."""
    client = getattr(manager, "_client", None)
    if client is not None and getattr(manager, "_group_world_size", 1) == 1 and not isinstance(client, _LocalVote):
        manager._client = _LocalVote(client)


def _gloo_group(timeout: timedelta, rendezvous: timedelta) -> Any:
    """torchft's reconfigurable gloo group, remembering the quorum it was last configured for.

    Setting up the group of a new quorum waits at most ``rendezvous`` for its members (a
    quorum can name a worker that died after asking for it: the others learn it then, not a
    whole ``timeout`` later); its collectives then wait up to ``timeout``."""
    from torchft.process_group import ProcessGroupGloo

    class QuorumGloo(ProcessGroupGloo):
        quorum_id: int | None = None
        members: list[int] = []

        def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                      quorum_id: int | None = None, group_rank: int | None = None,
                      group_world_size: int | None = None, global_ranks: list[int] | None = None) -> None:
            self._timeout = min(timeout, rendezvous)  # torchft's store client and gloo's connections
            try:
                super().configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank,
                                  group_world_size, global_ranks)
            finally:
                self._timeout = timeout
            self._pg._get_backend(torch.device("cpu"))._set_default_timeout(timeout)
            self.quorum_id, self.members = quorum_id, list(global_ranks or [])

    return QuorumGloo(timeout=timeout)


def copy_state(state: Any, kept: Any = None) -> Any:
    """A copy of ``state`` (nested dicts, lists and tuples of tensors and plain values), as
    ``copy.deepcopy`` makes it but writing each tensor into ``kept``'s at the same place, an
    earlier copy, where that one has the same shape, dtype, layout and device: a step's copy
    then allocates nothing. Tensors that shared memory in ``state`` do not in the copy."""
    if isinstance(state, torch.Tensor):
        state = state.detach()
        if (isinstance(kept, torch.Tensor) and kept.shape == state.shape and kept.dtype == state.dtype
                and kept.layout == state.layout == torch.strided and kept.device == state.device
                and kept.stride() == state.stride()):
            return kept.copy_(state)
        return copy.deepcopy(state)
    if type(state) in (dict, collections.OrderedDict):
        earlier: dict[Any, Any] = kept if isinstance(kept, dict) else {}
        return type(state)((k, copy_state(v, earlier.get(k))) for k, v in state.items())
    if type(state) in (list, tuple):
        at = kept if isinstance(kept, (list, tuple)) and len(kept) == len(state) else [None] * len(state)
        return type(state)(copy_state(v, m) for v, m in zip(state, at, strict=True))
    return copy.deepcopy(state)


class ElasticWorker:
    """Worker ``replica`` (an integer, unique in the job) of an elastic job whose Lighthouse
    is at ``lighthouse``, training ``model`` with ``optimizer`` and the method ``spec``.

    ``min_workers``: no step commits with fewer workers present. ``timeout_s``: a collective,
    a commit vote or a state transfer that takes longer fails (a stopped worker is dropped
    this long after it stopped answering). ``wait_s``: how long :meth:`begin` waits for a
    quorum before it raises :class:`QuorumLost`. ``extra_state``: a pair ``(get, set)`` of
    the loop's own state to send to a joining worker. ``host``: the address the other workers
    reach this one at, and the only one its store listens on (loopback by default).
    ``start_workers``: a job that starts, or is resumed whole from its checkpoints, waits up
    to ``wait_s`` for this many workers before its first step (default: ``min_workers``), so
    that it does not start with the first few to arrive. ``secret``: the job's secret
    (:func:`thinwire.elastic.secret.read`), or None for a job without one.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, spec: str, *, lighthouse: str,
                 replica: int, min_workers: int, timeout_s: float = TIMEOUT_S, wait_s: float = WAIT_S,
                 bucket_mb: float = 25.0, extra_state: tuple[Callable[[], Any], Callable[[Any], None]] | None = None,
                 host: str = "127.0.0.1", start_workers: int | None = None, secret: bytes | None = None) -> None:
        from thinwire.algorithms.methods import elastic_refusal, parse_spec, resolve_method
        from thinwire.version import __version__

        spec = resolve_method(spec)
        why = elastic_refusal(spec)
        if why is not None:
            raise ValueError(f"{parse_spec(spec)[0]} cannot run elastic: {why}")
        if replica < 0:
            raise ValueError(f"a worker's replica number must be >= 0, got {replica}")
        if min_workers < 1:
            raise ValueError(f"min_workers must be >= 1, got {min_workers}")
        os.environ.setdefault("RUST_LOG", "warn")
        import torch.distributed as dist
        from torchft.manager import Manager

        from thinwire.elastic.transport import SignedTransport, quiet_torchft
        from thinwire.peers.torchft_diloco import _quiet_flight_recorder

        _quiet_flight_recorder()
        quiet_torchft()
        # torchft reads a received state from a read-only buffer (the tensors are copied into place)
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        self.model, self.optimizer, self.spec, self.replica = model, optimizer, spec, replica
        self.min_workers, self.bucket_mb, self.extra_state = min_workers, bucket_mb, extra_state
        described = json.dumps(entries(model.named_parameters()), separators=(",", ":"))
        self.fingerprint = {"method": spec, "thinwire": __version__,
                            "model": hashlib.sha256(described.encode()).hexdigest()[:16]}
        self.secret = secret
        self.tally = Tally()
        self.method: Any = None
        self.quorum_id: int | None = None
        self.members: list[int] = []
        self._taken: dict[str, Any] | None = None  # a present worker's method state, taken at a heal
        self.incarnation = uuid.uuid4().hex[:12]  # this process: a worker restarted under its number is another
        self.present: dict[int, str] = {}  # the last quorum's workers and their incarnations
        self._healed = False
        self._admitted = False  # took part in a committed step, or took a present worker's state
        self._closed = False
        self._first_step: int | None = None
        self._started = 0.0  # when this worker first asked for a quorum (perf_counter)
        self._steps = 0  # steps the job has committed (torchft's counter counts only the steps that vote)
        self._local = False  # the step begun trains alone: no quorum, no vote, nothing to undo
        # a step begun over an unchanged quorum asks for the next one beside its forward and
        # backward passes (:meth:`begin`): the question in flight, when it was asked, what it
        # raised (for the next begin), this thread, the buffers at the step's start, a state taken meanwhile
        self._asking: tuple[concurrent.futures.Future[float], float] | None = None
        self._asker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="thinwire-quorum")
        self._lost: BaseException | None = None
        self._owner = threading.get_ident()  # the thread the loop runs on (set again at each begin)
        self._held: dict[str, torch.Tensor] = {}
        self._saved_buffers: set[str] | None = None
        self._arrived: dict[str, Any] | None = None
        self._kept: dict[str, Any] | None = None  # the last step's copy, to undo a failed step (:meth:`_snapshot`)
        self._named: set[tuple[int | None, str]] = set()  # refusals on record since the last committed step
        timeout = timedelta(seconds=timeout_s)
        self.forwarder: Any = None
        if secret is not None:  # the Lighthouse is behind a gate: its handshake first, then through a forwarder
            from thinwire.elastic.gate import Forwarder, probe
            from thinwire.elastic.lighthouse import split_address

            target = split_address(lighthouse)
            probe(*target, secret, timeout_s)
            self.forwarder = Forwarder(target, secret, timeout_s)
            lighthouse = self.forwarder.address
        self._listen = _listening(host)  # the store listens on host alone (c10d's own would take every interface)
        self.store = dist.TCPStore(host, self._listen.getsockname()[1], is_master=True, wait_for_workers=False,
                                   timeout=timeout, master_listen_fd=self._listen.fileno())
        self.pg = _gloo_group(timeout, timedelta(seconds=RENDEZVOUS_S))
        self.transport = SignedTransport(self.pg, secret, lambda: self.pg.quorum_id, self._worker_at)
        try:
            with _manager_server_on(host):
                self.manager = Manager(
                    pg=self.pg, load_state_dict=self._load, state_dict=self._state, min_replica_size=min_workers,
                    use_async_quorum=False, timeout=timeout, quorum_timeout=timedelta(seconds=wait_s),
                    connect_timeout=timeout, rank=0, world_size=1, store_addr=host, store_port=self.store.port,
                    lighthouse_addr=url(lighthouse), replica_id=f"thinwire_{replica}", hostname=host, init_sync=True,
                    max_retries=None, checkpoint_transport=self.transport)
        except BaseException:
            self.transport.shutdown(wait=False)
            self._listen.close()
            if self.forwarder is not None:
                self.forwarder.shutdown()
            raise
        _vote_locally(self.manager)
        self.comm = QuorumComm(self.manager, self.pg, timeout=timeout)
        self.wait_s = wait_s
        self.start_workers = min_workers if start_workers is None else start_workers
        self.gradient_sync = False

    # -- the step ------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Steps committed by the job so far: also the data position. torchft's own counter
        counts the steps that voted, which are fewer where the method trains alone between
        its averages (the DiLoCo family's inner steps)."""
        return self._steps

    @property
    def workers(self) -> int:
        """Workers in the current quorum."""
        return self.comm.world_size

    def begin(self) -> int:
        """Join the quorum for the next step and return the steps committed so far (the step
        to train is that + 1). A worker that joins or fell behind takes a present worker's
        state here, before its forward pass; at a change of the quorum the method is built
        again over it. Raises :class:`QuorumLost` when no quorum of ``min_workers`` forms
        within ``wait_s``, and :class:`Refused` on a worker the job does not admit.

        A worker whose method is set up over the current quorum does not wait here: it asks
        for the next quorum on a thread of its own, beside the step's forward and backward
        passes, and :meth:`commit` takes the answer before the step's first collective (and
        sets the method up again there when the quorum changed). A worker that joins meanwhile
        is sent the state as it stood at this call. The loop's own state (``extra_state``) is
        read only on the loop's thread: a worker with one asks here, as do all on the first step."""
        t0 = time.perf_counter()
        self._owner = threading.get_ident()  # the loop's thread: a state reaching another waits for the commit
        if self._lost is not None:  # the quorum asked for beside the last step failed
            lost, self._lost = self._lost, None
            raise lost
        self._healed = False
        if self._first_step is None:
            self._first_step = self.step  # 0, or a resumed worker's checkpoint
            self._started = t0
        # a step that sends nothing, on a method set up over a quorum, trains alone: the
        # workers meet at the next step that communicates (a joiner waits there for them)
        self._local = (self.quorum_id is not None and self.method is not None and not self.comm.broken
                       and not self.method.communicates_next())
        if self._local:
            return self.step
        if self.quorum_id is not None and self.method is not None and not self.comm.broken \
                and self.extra_state is None:
            self._hold_buffers()  # before the question: a joiner may be sent the state at once
            self._asking = (self._asker.submit(self._ask), t0)
            return self.step
        self._quorum()
        # a job that starts (or is resumed whole) waits for start_workers, or for wait_s from its
        # first ask: every member of such a quorum has committed nothing yet and stands at the
        # step it began with, so they all wait alike, and they stop waiting together (one that
        # went on alone would fail its step, and the others would start their wait again); a
        # worker joining a running job took its state (a later step) and does not wait
        while (self.tally.committed == 0 and self.step == self._first_step
               and self.manager.num_participants() < self.start_workers
               and not self._waited(time.perf_counter() - self._started >= self.wait_s)):
            time.sleep(0.05)
            self._quorum()
        if self.pg.quorum_id != self.quorum_id or self._healed or self.quorum_id is None:
            self._new_quorum(time.perf_counter() - t0)
        return self.step

    def _waited(self, mine: bool) -> bool:
        """Whether any member of the quorum has waited ``wait_s`` for the job to start (a sum
        over the quorum's group: all of them get the same answer). A sum that fails (a member
        left) is no; the next quorum asks again."""
        from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

        flag = torch.tensor([float(mine)])
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM  # type: ignore[assignment]  # torch's stubs: RedOpType
        try:
            self.pg.allreduce([flag], opts).wait(self.comm.timeout)
        except Exception:  # noqa: BLE001  (a member that left: not settled in this quorum)
            return False
        return bool(flag.item() > 0)

    def _ask(self) -> float:
        """The quorum, on the asking thread: when it was ready (``perf_counter``)."""
        self._quorum()
        return time.perf_counter()

    def _hold_buffers(self) -> None:
        """The model's buffers as they stand before the forward pass (which updates some, a
        batch norm's running statistics): what a worker joining during the step is sent
        (:meth:`_state`, on torchft's thread, until :meth:`_answer`)."""
        if self._saved_buffers is None:  # the buffers a state holds (not the non-persistent ones)
            params = {n for n, _ in self.model.named_parameters()}
            self._saved_buffers = set(self.model.state_dict(keep_vars=True)) - params
        self._held = {k: b.detach().clone() for k, b in self.model.named_buffers() if k in self._saved_buffers}

    def _answer(self) -> bool:
        """Take the quorum asked for at :meth:`begin`: False when asking failed (the step is
        discarded and the next :meth:`begin` raises what it raised). The method is set up
        again where the quorum changed. A state this worker took meanwhile (it was behind, which
        a worker that committed its last step should not be) is loaded now, and the step, whose
        forward pass ran on the state it replaced, is voted down."""
        assert self._asking is not None
        future, t0 = self._asking
        self._asking = None
        try:
            ready = future.result()
        except Exception as e:  # noqa: BLE001  (QuorumLost, Refused, or worse: raised at the next begin)
            self._lost = e
            return False
        finally:
            self._held = {}
        arrived, self._arrived = self._arrived, None
        stale = arrived is not None
        if arrived is not None:
            self._load(arrived)
        if self.pg.quorum_id != self.quorum_id or self._healed:
            self._new_quorum(ready - t0)
        if stale:
            if not self.comm.broken:
                self.manager.report_error(RuntimeError("this worker took a present worker's state during the step"))
            self.manager.should_commit()
            self.quorum_id = None
            return False
        return True

    def _quorum(self) -> None:
        try:
            self.manager.start_quorum()
        except Refused:
            raise
        except Exception as e:
            if self.forwarder is not None and self.forwarder.error is not None:  # the gate refused the secret since
                raise Refused(str(self.forwarder.error)) from None
            text = str(e).lower()
            if "timeout" in text or "timed out" in text or "deadline" in text:
                raise QuorumLost(f"no quorum of {self.min_workers} worker(s) formed within {self.wait_s:g} s") from None
            raise

    def _new_quorum(self, seconds: float) -> None:
        from thinwire.algorithms.build import build_method
        from thinwire.algorithms.methods import is_gradient_codec
        from thinwire.elastic.transport import StateRefused

        rank, size = self.manager.participating_rank(), self.manager.num_participants()
        self.comm.reconfigure(0 if rank is None else int(rank), max(1, int(size)))
        error = getattr(self.manager.errored(), "original_exception", None)
        if isinstance(error, StateRefused):  # a state, or a joiner asking for one, failed its authentication
            if error.mine and not self._admitted:  # a newcomer whose proof of the secret the job refused
                from thinwire.elastic.secret import HOW

                raise Refused(f"worker {self.replica} is refused: " + (
                    f"{error}" if self.secret is not None else f"the job's workers hold a job secret and this one "
                                                                f"has none; {HOW}"))
            for r in error.ranks:
                self._refused(self.pg.members[r] if 0 <= r < len(self.pg.members) else None, str(error))
        healed = self._healed
        present = self._admit()
        state = self._taken if self._taken is not None else (self.method.state_dict() if self.method else None)
        self.gradient_sync = is_gradient_codec(self.spec)
        self.quorum_id, self._taken = None, state  # until the method is set up over this quorum
        if self.comm.broken:  # a peer left, or one not admitted is here: this step is discarded
            return
        try:
            method = build_method(self.spec, self.model, self.optimizer, self.comm, bucket_mb=self.bucket_mb,
                                  overlap=False)
        except Exception:
            if not self.comm.broken:
                raise
            return  # its set-up exchange failed (a peer left meanwhile): set up again at the next quorum
        if state is not None:
            method.load_state_dict(state)
        if healed:
            method.elastic_join()
        if self.comm.broken:
            return
        self.method, self.quorum_id, self._taken = method, self.pg.quorum_id, None
        if present is None:
            return
        joined = sorted(r for r, inc in present.items() if self.present.get(r) != inc)
        left = sorted(r for r, inc in self.present.items() if present.get(r) != inc)
        if joined or left or healed:
            self.tally.changes.append(Change(
                step=self.step, size=self.comm.world_size, members=sorted(present), joined=joined, left=left,
                seconds=seconds, healed=healed, at=time.time()))
        self.present, self.members = present, sorted(present)

    def commit(self, loss: torch.Tensor | float | None = None, step: Callable[[], None] | None = None) -> bool:
        """After ``loss.backward()``: average through the method, step the optimizer (``step``,
        default ``optimizer.step()``; a loop's learning-rate schedule goes in it), and vote.
        Returns whether the step was committed; a step that was not is undone on this worker
        (the gradients are zeroed either way)."""
        step_fn = step if step is not None else self.optimizer.step
        loss = loss.detach() if isinstance(loss, torch.Tensor) else loss
        if self._asking is not None and not self._answer():
            self.tally.discarded += 1
            self.optimizer.zero_grad(set_to_none=False)
            return False
        if self._local:  # nothing to average, vote on or undo
            self._local = False
            self.method.after_backward(loss)
            step_fn()
            self.method.after_step()
            self._committed()
            self.optimizer.zero_grad(set_to_none=False)
            return True
        if self.quorum_id is None:  # the quorum's set-up failed at begin(): nothing to average, vote no
            if not self.comm.broken:
                self.manager.report_error(RuntimeError("the method was not set up over this quorum"))
            self.manager.should_commit()
            self.tally.discarded += 1
            self.optimizer.zero_grad(set_to_none=False)
            return False
        snapshot = self._snapshot()
        if self.gradient_sync:  # the collectives end in after_backward: vote before anything is stepped
            ok = self._guarded(lambda: self.method.after_backward(loss)) and bool(self.manager.should_commit())
            if ok:
                step_fn()
                self.method.after_step()
        else:  # the method syncs after the optimizer's step: vote after it, undo if it fails
            ok = self._guarded(lambda: (self.method.after_backward(loss), step_fn(), self.method.after_step()))
            ok = ok and bool(self.manager.should_commit())
        if ok:
            self._committed()
            self._admitted = True
        else:
            self._restore(snapshot)
            self.tally.discarded += 1
            self.quorum_id = None  # set the method up again at the next quorum, whatever it is
            self._taken = snapshot["method"]
            self._kept = None  # the copy is the method's state now: not to be written over
        self.optimizer.zero_grad(set_to_none=False)
        return ok

    def _committed(self) -> None:
        self._named.clear()
        self._steps += 1
        self.tally.committed += 1
        self.tally.count(self.step, self.comm.world_size)

    def _guarded(self, run: Callable[[], object]) -> bool:
        """Run the method's part of the step. What it raises after a collective failed (a
        decoder that refuses the zeros a failed gather left, say) only confirms that the step
        is lost: the vote is cast against it and False returned. Anything raised while every
        collective succeeded is the method's own error, and propagates."""
        try:
            run()
        except Exception:
            if not self.comm.broken:
                raise
        if self.comm.broken:
            self.manager.should_commit()  # votes no: the manager knows of the failure
            return False
        return True

    def restore(self, state: dict[str, Any]) -> None:
        """Start from a saved state (a checkpoint of this worker's: ``model``, ``optimizer``,
        ``method``, ``step``, the job's step, and ``manager``, torchft's counter of voted
        steps; a state without ``step`` takes torchft's), before the first :meth:`begin`.
        Where the job is further on, the first quorum brings this worker up to it."""
        self.model.load_state_dict(state["model"], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.manager.load_state_dict(state["manager"])
        self._steps = int(state.get("step", self.manager.current_step()))
        self._taken = state["method"]

    # -- undo ----------------------------------------------------------------------------------
    def _snapshot(self) -> dict[str, Any]:
        """What the step may change, copied into the last step's copy where it fits (a step
        that commits leaves its copy unread: the next one writes over its tensors)."""
        kept = self._kept or {}
        snap: dict[str, Any] = {"method": copy_state(self.method.state_dict(), kept.get("method"))}
        if not self.gradient_sync:
            snap["model"] = copy_state(self.model.state_dict(), kept.get("model"))
            snap["optimizer"] = copy_state(self.optimizer.state_dict(), kept.get("optimizer"))
        self._kept = snap
        return snap

    def _restore(self, snap: dict[str, Any]) -> None:
        if "model" in snap:
            self.model.load_state_dict(snap["model"])
            self.optimizer.load_state_dict(snap["optimizer"])
        self.method.load_state_dict(copy.deepcopy(snap["method"]))

    # -- state sent to a joining worker ----------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        method = self._taken if self._taken is not None or self.method is None else self.method.state_dict()
        model = self.model.state_dict()
        if self._held and threading.get_ident() != self._owner:  # asked beside a forward pass
            model.update(self._held)
        return {"fingerprint": self.fingerprint, "steps": self._steps, "model": model,
                "optimizer": self.optimizer.state_dict(), "method": method,
                "extra": self.extra_state[0]() if self.extra_state is not None else None}

    def _load(self, state: dict[str, Any]) -> None:
        if threading.get_ident() != self._owner:  # taken beside a forward pass: loaded at the commit
            self._arrived = state
            return
        self._check(state["fingerprint"])
        self._steps = int(state["steps"])
        self.model.load_state_dict(state["model"], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self._taken = state["method"]
        if self.extra_state is not None and state.get("extra") is not None:
            self.extra_state[1](state["extra"])
        self._healed = self._admitted = True
        self.tally.heals += 1

    def _check(self, theirs: dict[str, Any]) -> None:
        mine = self.fingerprint
        for key, what in (("thinwire", "thinwire version"), ("method", "method"), ("model", "model's parameters")):
            if theirs.get(key) != mine.get(key):
                if key == "model":
                    raise Refused(f"worker {self.replica} is refused: its model's parameters (names, shapes or "
                                  "dtypes) differ from the running job's")
                raise Refused(f"worker {self.replica} is refused: its {what} {mine.get(key)!r} differs from the "
                              f"running job's {theirs.get(key)!r}")

    def _worker_at(self, rank: int) -> str:
        """The worker at ``rank`` of the current quorum, named for a message."""
        members = self.pg.members
        return f"worker {members[rank]}" if 0 <= rank < len(members) else f"the worker at rank {rank} of the quorum"

    def _admit(self) -> dict[int, str] | None:
        """Every worker of the new quorum shows its fingerprint and a fresh nonce; in a job
        with a secret each then proves it holds it (:meth:`_prove`). One whose fingerprint
        differs from the job's (the admitted workers', else the most common) is refused, the
        others discard the step. Returns the quorum's workers and their incarnations (None:
        the exchange failed, or a member failed admission)."""
        if self.comm.world_size == 1:
            return {self.replica: self.incarnation}
        from thinwire.elastic import secret

        mine = json.dumps({**self.fingerprint, "admitted": self._admitted, "replica": self.replica,
                           "incarnation": self.incarnation, "nonce": secret.nonce().hex(),
                           "secret": self.secret is not None}).encode()
        with self.comm.meter.paused():
            every = gather_bytes(self.comm, mine, TEXT_BYTES)
        if self.comm.broken:
            return None
        shown, unreadable = [], []
        for rank, row in enumerate(every):
            try:
                s = json.loads(row.decode())
                shown.append({**s, "replica": int(s["replica"]), "incarnation": str(s["incarnation"]),
                              "key": json.dumps({k: s[k] for k in ("method", "thinwire", "model")}, sort_keys=True)})
            except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):  # not a thinwire worker
                unreadable.append(rank)
        if unreadable:
            for rank in unreadable:
                self._refused(self.pg.members[rank] if rank < len(self.pg.members) else None,
                              "it showed no readable admission")
            self.manager.report_error(RuntimeError("a member of the quorum showed no readable admission"))
            return None
        replicas = [s["replica"] for s in shown]
        if any(bool(s.get("secret")) for s in shown) and not self._prove(every, shown, replicas):
            return None
        keys = [s["key"] for s in shown]
        admitted = [k for k, s in zip(keys, shown, strict=True) if s.get("admitted")]
        reference = admitted[0] if admitted else max(keys, key=lambda k: (keys.count(k), -keys.index(k)))
        if keys[self.comm.rank] != reference:
            self._check(json.loads(reference))
        elif any(k != reference for k in keys):
            self.manager.report_error(RuntimeError("a worker the job does not admit is in the quorum"))
        return {s["replica"]: s["incarnation"] for s in shown}

    def _prove(self, every: list[bytes], shown: list[dict[str, Any]], replicas: list[int]) -> bool:
        """Every member's HMAC, under the job secret, of the quorum id, its own place and the
        whole first exchange (every member's fresh nonce): whether every member proved it
        holds this worker's secret. A member without one, or whose proof fails, is named in
        :attr:`Tally.refusals` and the step voted down (in a job without a secret, a member
        that shows one). This worker, while it has not been admitted, is :class:`Refused` when
        it has no secret and others show one, or when no other member's proof checks out under
        its own: one worker alone against the quorum is the one that differs."""
        from thinwire.elastic import secret

        transcript = b"".join(len(row).to_bytes(4, "big") + row for row in every)
        qid = str(self.pg.quorum_id).encode()

        def proof(key: bytes, rank: int) -> bytes:
            return secret.tag(key, "thinwire-admit", qid, rank.to_bytes(4, "big"), transcript)

        mine = proof(self.secret, self.comm.rank).hex().encode() if self.secret is not None else b""
        with self.comm.meter.paused():
            proofs = gather_bytes(self.comm, mine, 2 * secret.DIGEST_BYTES)
        if self.comm.broken:
            return False
        others = [r for r in range(self.comm.world_size) if r != self.comm.rank]
        if self.secret is None:
            if not self._admitted:  # a newcomer without a secret, among workers that show one
                raise Refused(f"worker {self.replica} is refused: the job's workers hold a job secret and this one "
                              f"has none; {secret.HOW}")
            # a job without a secret: a member that shows one is not of this job
            failed = [(r, "it holds a job secret and this job has none") for r in others if shown[r].get("secret")]
        else:
            failed = []
            for rank in others:
                try:
                    ok = secret.matches(self.secret, bytes.fromhex(proofs[rank].decode()), "thinwire-admit", qid,
                                        rank.to_bytes(4, "big"), transcript)
                except (ValueError, UnicodeDecodeError):
                    ok = False
                if not ok:
                    failed.append((rank, "it holds no job secret" if not shown[rank].get("secret")
                                   else "its proof of the job's secret fails"))
        if not failed:
            return True
        if self.secret is not None and len(failed) == len(others) and not self._admitted:
            theirs = "hold no job secret" if not any(shown[r].get("secret") for r in others) else \
                "hold another job secret (no other worker's proof checks out under this one's)"
            raise Refused(f"worker {self.replica} is refused: the running job's workers {theirs}")
        for rank, why in failed:
            self._refused(replicas[rank], why)
        names = ", ".join(f"worker {replicas[r]} ({why})" for r, why in failed)
        self.manager.report_error(RuntimeError(f"not admitted: {names}"))
        return False

    def _refused(self, worker: int | None, why: str) -> None:
        """Name a member not admitted, or a peer whose state was refused, in
        :attr:`Tally.refusals`: once for each reason until a step commits again."""
        if (worker, why) not in self._named:
            self._named.add((worker, why))
            self.tally.refusals.append({"step": self.step, "worker": worker, "why": why, "time": round(time.time(), 3)})

    # -- the end ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop this worker's manager, state server, store and group (the others go on)."""
        if self._closed:
            return
        self._closed = True
        self._asker.shutdown(wait=False)
        self.manager.shutdown(wait=False)
        # torchft's state server stops within its 0.5 s poll: off the caller's clock
        threading.Thread(target=self.transport.shutdown, name="thinwire-elastic-close", daemon=True).start()
        self.pg.shutdown()
        self._listen.close()
        if self.forwarder is not None:
            self.forwarder.shutdown()
