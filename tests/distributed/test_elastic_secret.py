"""An elastic job with a secret (docs/security.md). At the Lighthouse's gate, a worker with
another secret, or none, is refused at once and named. Past the gate (a process on the
Lighthouse's own machine reaching its port), the same two and a hostile client that ignores
its refusal and claims the highest step are each named by the job's workers at the quorum's
admission, and none of their bytes enter the job's models: the workers end bit for bit where
a run without the intruder ends."""

from __future__ import annotations

import pytest

from elastic_job import Job

pytestmark = pytest.mark.timeout(240)

SECRET = b"the job's secret, 32 bytes long!"
OTHER = b"not the job's secret, but long!!"
SPEC, STEPS = "powersgd:rank=2,min_numel=0", 30


def _run(intruder: dict | None) -> dict[int, dict]:
    """Workers 0 and 1 with the secret, and ``intruder``'s plan for worker 2 (or none)."""
    job = Job(secret=SECRET)
    try:
        for r in (0, 1):
            job.start(r, SPEC, STEPS, secret=SECRET, pace=0.05)
        if intruder is not None:
            job.start(2, SPEC, STEPS, join_after=1.0, **intruder)
        return job.results(2 if intruder is None else 3, timeout=180)
    finally:
        job.close()


@pytest.fixture(scope="module")
def alone() -> dict[int, dict]:
    return _run(None)


@pytest.mark.parametrize("kind", ["another secret", "no secret", "hostile"])
def test_an_intruder_past_the_gate_is_named_and_none_of_its_bytes_enter_the_jobs_models(alone, kind):
    plan = {"another secret": {"secret": OTHER}, "no secret": {},
            "hostile": {"secret": OTHER, "hostile": 3.0}}[kind]
    plan["bypass"] = True
    got = _run(plan)
    for r in (0, 1):
        assert "error" not in got[r], got[r]
        # the job's models and optimizers end bit for bit as without the intruder
        assert (got[r]["step"], got[r]["model"], got[r]["optimizer"]) == \
            (alone[r]["step"], alone[r]["model"], alone[r]["optimizer"]), kind
    # named by the job: by the workers that dealt with it (the one that would have sent it its state,
    # those that saw its proof fail at the quorum's admission)
    named = [f for r in (0, 1) for f in got[r]["refusals"] if f["worker"] == 2]
    assert named and all(f["worker"] == 2 for r in (0, 1) for f in got[r]["refusals"]), named
    intruder = got[2]
    if kind == "hostile":
        assert intruder["quorums"] >= 1
        return
    # refused within its first quorum: it committed nothing, and each worker named it once, at one step
    assert intruder["error"].startswith("Refused: worker 2 is refused"), intruder
    assert intruder["committed"] == 0 and intruder["heals"] == 0
    why = "the job's workers hold a job secret and this one has none" if kind == "no secret" else \
        "refused this worker's proof of the job secret"
    assert why in intruder["error"], intruder["error"]
    assert len({f["step"] for f in named}) == 1, named


def test_the_gate_refuses_another_secret_and_none_at_once_and_names_the_first():
    """A worker whose secret is not the Lighthouse's is refused by name before it builds
    anything; one without a secret is told the Lighthouse asks for one (the command line's
    probe); the gate names the connection that failed its proof."""
    import time

    import torch

    from thinwire.elastic import ElasticWorker, serve
    from thinwire.elastic.gate import GateRefused, probe
    from thinwire.elastic.lighthouse import split_address

    gated, plain = serve(2, secret=SECRET), serve(2)
    try:
        host, port = split_address(gated.address)
        net = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        t0 = time.perf_counter()
        with pytest.raises(GateRefused, match=f"^the Lighthouse at {host}:{port} refused this worker: the two hold "
                                              "different job secrets$"):
            ElasticWorker(net, opt, "identity", lighthouse=gated.address, replica=0, min_workers=2, secret=OTHER)
        assert time.perf_counter() - t0 < 2  # at once, not a timeout
        assert [why for _, why in gated.gate.refused] == ["its proof of the job secret fails"]
        with pytest.raises(GateRefused, match="asks for a job secret and this worker has none"):
            probe(host, port, None, 2.0)
        probe(host, port, SECRET, 2.0)  # the job's own secret passes
        with pytest.raises(GateRefused, match="was started without a job secret, and this worker holds one"):
            probe(*split_address(plain.address), SECRET, 0.5)
        probe(*split_address(plain.address), None, 2.0, wait_s=0.2)  # neither has one
        assert len(gated.gate.refused) == 1  # the looks without a proof are not named
    finally:
        gated.shutdown()
        plain.shutdown()
