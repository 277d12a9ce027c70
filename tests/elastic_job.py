"""Workers of small elastic jobs for the tests: spawned processes around one in-process Lighthouse."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from typing import Any

import torch

HEARTBEAT_S = 1.0  # the tests' Lighthouse drops a silent worker after this long
TIMEOUT_S = 3.0  # a collective with a dead peer fails within this


def model(norm: bool = False) -> torch.nn.Module:
    """The tests' model; ``norm``: with a batch norm, whose running statistics (buffers) each
    forward pass updates."""
    torch.manual_seed(0)
    middle = [torch.nn.BatchNorm1d(32)] if norm else []
    return torch.nn.Sequential(torch.nn.Linear(8, 32), *middle, torch.nn.ReLU(), torch.nn.Linear(32, 32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 4))


def batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``replica``'s batch of ``step`` (1-based): a pure function of the two."""
    g = torch.Generator().manual_seed(7919 * replica + step)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def digest(tensors: Any) -> str:
    """SHA-256 of every tensor in a nested structure, in order."""
    h = hashlib.sha256()

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            h.update(o.detach().cpu().contiguous().numpy().tobytes())
        elif isinstance(o, dict):
            for k in sorted(o, key=str):
                h.update(str(k).encode())
                walk(o[k])
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
        else:
            h.update(repr(o).encode())

    walk(tensors)
    return h.hexdigest()


def worker(replica: int, address: str, spec: str, steps: int, q: Any, plan: dict[str, Any],
           env: dict[str, str]) -> None:
    """Train to ``steps``; ``plan``: ``die_at`` (SIGKILL itself after that step's backward,
    before its vote), ``leave_after`` (close after committing that step), ``min_workers``,
    ``wait_s``, ``check_join`` (on a heal, report whether the model is the method's global one),
    ``join_after`` (seconds to wait before joining), ``pace`` (seconds to sleep in each step),
    ``mark`` (a file created once this worker has committed a step: it is training), ``late``
    (``(step, seconds)``: sleep that long before beginning that step, 1-based), ``secret`` (the
    job secret it holds), ``hostile`` (seconds: a client that holds a wrong secret, accepts every
    proof, ignores its refusal, claims a step far ahead of the job's at every quorum, so that
    the others take their state from it, and leaves after that long), ``bypass`` (a modified
    client that goes around the Lighthouse's gate to its own port: what a process on the
    Lighthouse's machine can reach), ``timeout_s`` (its elastic timeout, default TIMEOUT_S),
    ``die_in_setup`` (a file: write the time there and SIGKILL itself inside the set-up of the
    first quorum's group it takes part in, the others waiting for it in gloo's rendezvous), ``norm``
    (the model with a batch norm; every begin's buffers are then recorded by step, before the
    forward pass), ``clock`` (record when each begin was called and when it returned)."""
    from thinwire.elastic import ElasticWorker, QuorumLost, Refused
    from thinwire.run.spawn import begin_rank

    begin_rank(env)
    time.sleep(plan.get("join_after", 0.0))
    if plan.get("bypass"):
        import thinwire.elastic.gate as gate

        class Around:  # no handshake: straight to the address it is given
            def __init__(self, target, key, timeout_s):
                self.address = f"{target[0]}:{target[1]}"

            def shutdown(self):
                pass

        gate.probe = lambda *args, **kwargs: None  # type: ignore[assignment]
        gate.Forwarder = Around  # type: ignore[assignment,misc]

    if plan.get("die_in_setup"):
        import torchft.process_group as tpg

        def die(self: Any, *args: Any, **kwargs: Any) -> Any:
            with open(plan["die_in_setup"], "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

        tpg.ProcessGroupGloo._create_pg = die  # type: ignore[method-assign]
    torch.set_num_threads(1)
    net = model(bool(plan.get("norm")))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    started = time.time()
    try:
        w = ElasticWorker(net, opt, spec, lighthouse=address, replica=replica,
                          min_workers=plan.get("min_workers", 2), timeout_s=plan.get("timeout_s", TIMEOUT_S),
                          wait_s=plan.get("wait_s", 30.0), start_workers=plan.get("start_workers", 2),
                          secret=plan.get("secret"))
    except Exception as e:  # noqa: BLE001
        q.put({"replica": replica, "error": f"{type(e).__name__}: {e}"})
        return
    out: dict[str, Any] = {"replica": replica, "joins": [], "buffers": {}, "begins": {}}
    if plan.get("hostile"):
        hostile(w, plan["hostile"], out)
        w.close()
        q.put(out)
        return
    try:
        while w.step < steps:
            if plan.get("late") and plan["late"][0] == w.step + 1:
                time.sleep(plan["late"][1])
            called = time.time()
            done = w.begin()
            if plan.get("clock"):
                out["begins"][done + 1] = (called, time.time())
            if plan.get("norm"):
                out["buffers"].setdefault(done + 1, digest(list(net.buffers())))  # a retried step: its first
            if w.tally.changes and w.tally.changes[-1].healed and plan.get("check_join") and not out["joins"]:
                theta = getattr(w.method, "outer_params", None)
                out["joins"].append(theta is None or all(
                    torch.equal(t, p) for t, p in zip(theta, w.method.state.params, strict=True)))
                out["residuals_at_join"] = residuals(w.method)
            if done >= steps:
                break
            x, y = batch(replica, done + 1)
            loss = torch.nn.functional.mse_loss(net(x), y)
            loss.backward()
            time.sleep(plan.get("pace", 0.0))
            if plan.get("die_at") == done + 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if w.commit(loss) and plan.get("mark") and not os.path.exists(plan["mark"]):
                open(plan["mark"], "w").close()
            if plan.get("leave_after") == w.step:
                break
    except (QuorumLost, Refused) as e:
        out["error"] = f"{type(e).__name__}: {e}"
        out["seconds"] = time.time() - started
    out.update(residuals=residuals(w.method), step=w.step, model=digest(list(net.parameters())),
               optimizer=digest(opt.state_dict()["state"]),
               shared=digest(shared_state(w.method)), changes=[c.record() for c in w.tally.changes],
               discarded=w.tally.discarded, committed=w.tally.committed, heals=w.tally.heals,
               present=w.tally.present, votes=int(w.manager.current_step()), refusals=w.tally.refusals,
               ended=time.time())
    w.close()
    q.put(out)


def hostile(w: Any, seconds: float, out: dict[str, Any]) -> None:
    """A client that ignores refusal: every proof of the secret checks out to it, it claims a
    step far ahead at every quorum (so the job's workers would take its state) and trains on
    noise, until ``seconds`` have passed."""
    import thinwire.elastic.secret as secret_module

    secret_module.matches = lambda *args, **kwargs: True  # type: ignore[assignment]
    end, quorums = time.time() + seconds, 0
    while time.time() < end:
        w.manager._step = 10_000 + quorums  # torchft's counter: the quorum's highest step is the source
        try:
            w.begin()
        except Exception:  # noqa: BLE001  (refused or not: it asks again)
            pass
        quorums += 1
        for p in w.model.parameters():
            p.grad = torch.randn_like(p) * 100
        try:
            w.commit(torch.tensor(0.0))
        except Exception:  # noqa: BLE001
            pass
    out.update(quorums=quorums, hostile=True)


def residuals(method: Any) -> int:
    """How many error-feedback residuals the method holds (a worker's own)."""
    state = method.state_dict() if method is not None else {}
    found = len(state.get("feedback", {}))
    for f in state.get("fragments", []):
        found += len((f.get("agg") or {}).get("feedback", {}))
    return found


def shared_state(method: Any) -> Any:
    """The part of a method's state every worker holds alike (not a worker's own residuals)."""
    state = method.state_dict() if method is not None else {}
    return {k: state[k] for k in ("step", "codec_states", "outer_params", "outer") if k in state}


class Job:
    """A Lighthouse here and workers started as local ranks are (thinwire.run.spawn.rank_context);
    :meth:`results` by replica."""

    def __init__(self, min_workers: int = 2, join_timeout_s: float = HEARTBEAT_S, secret: bytes | None = None) -> None:
        from thinwire.elastic import serve

        self.lighthouse = serve(min_workers, heartbeat_timeout_s=HEARTBEAT_S, join_timeout_s=join_timeout_s,
                                secret=secret, gate_timeout_s=TIMEOUT_S)
        # the Lighthouse's own port (behind its gate, with a secret)
        self.inner = "127.0.0.1:" + self.lighthouse.server.address().rsplit(":", 1)[1]
        from thinwire.run.spawn import rank_context

        self.ctx = rank_context()
        self.q = self.ctx.Queue()
        self.procs: list[Any] = []

    def start(self, replica: int, spec: str, steps: int, **plan: Any) -> Any:
        address = self.inner if plan.get("bypass") else self.lighthouse.address
        p = self.ctx.Process(target=worker, args=(replica, address, spec, steps, self.q, plan, dict(os.environ)))
        p.start()
        self.procs.append(p)
        return p

    def results(self, count: int, timeout: float = 120.0) -> dict[int, dict[str, Any]]:
        got = [self.q.get(timeout=timeout) for _ in range(count)]
        return {r["replica"]: r for r in got}

    def close(self) -> None:
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self.lighthouse.shutdown()
