"""An elastic job with a secret (docs/security.md): a worker with another secret, one with none,
and a hostile client that ignores its refusal and claims the highest step are each named, and
none of their bytes enter the job's models: the workers end bit for bit where a run without
the intruder ends."""

from __future__ import annotations

import pytest

from elastic_job import Job

pytestmark = pytest.mark.timeout(240)

SECRET = b"the job's secret, 32 bytes long!"
SPEC, STEPS = "powersgd:rank=2,min_numel=0", 30


def _run(intruder: dict | None) -> dict[int, dict]:
    """Workers 0 and 1 with the secret, and ``intruder``'s plan for worker 2 (or none)."""
    job = Job()
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
def test_an_intruder_is_named_and_none_of_its_bytes_enter_the_jobs_models(alone, kind):
    plan = {"another secret": {"secret": b"not the job's secret, but long!!"}, "no secret": {},
            "hostile": {"secret": b"not the job's secret, but long!!", "hostile": 3.0}}[kind]
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
