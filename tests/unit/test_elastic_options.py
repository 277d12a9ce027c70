"""``thinwire train --elastic`` and ``thinwire lighthouse``: what is refused, in one line, exit 2,
before anything starts; which methods run elastic and why the others do not."""

from __future__ import annotations

import pytest

from clicheck import refused
from spawn import free_port
from thinwire.algorithms.methods import elastic_refusal, resolve_method


@pytest.mark.parametrize("spec", ["identity", "powersgd", "topk:ratio=0.01", "qsgd", "randomk", "hylo", "localsgd",
                                  "diloco", "sparseloco", "streaming-diloco:delay=0"])
def test_these_run_elastic(spec):
    assert elastic_refusal(resolve_method(spec)) is None


@pytest.mark.parametrize(("spec", "why"), [
    ("dpsgd", "graph of neighbours"), ("powergossip", "graph of neighbours"),
    ("dasgd", "in flight for delay steps"), ("streaming-diloco", "delay=1 keeps a fragment's average in flight"),
    ("streaming-diloco:delay=auto,link=10mbit;1ms", "delay=auto keeps a fragment's average in flight"),
    ("diloco:sync=eager", "sync=eager keeps a round's average in flight through the next round"),
    ("sparseloco:sync=delayed", "sync=delayed keeps a round's average in flight"),
    ("demo", "holds the communicator"), ("ab", "fixed by rank"), ("torch-ddp", "fixed size"),
    ("torch-diloco", "torchft Manager of its own"), ("peer-demo", "fixed size")])
def test_these_are_refused_by_name_with_the_reason(spec, why):
    assert why in elastic_refusal(resolve_method(spec))


@pytest.mark.parametrize(("argv", "needles"), [
    (["--method", "dpsgd"], ("--elastic: dpsgd cannot run elastic", "graph of neighbours")),
    (["--min-workers", "0"], ("--min-workers must be in 1..2",)),
    (["--min-workers", "3"], ("--min-workers must be in 1..2",)),
    (["--replica", "1"], ("--replica needs --lighthouse",)),
    (["--lighthouse", "127.0.0.1:1", "--replica", "2"], ("--replica must be in 0..1",)),
    (["--elastic-timeout", "0"], ("--elastic-timeout must be",)),
    (["--elastic-wait", "-1"], ("--elastic-wait must be",)),
    (["--ranks-per-node", "2"], ("--elastic does not take --group-size",)),
    (["--link", "1gbit,50us"], ("--elastic does not take --link",)),
    (["--lighthouse", "nowhere"], ("an address must be HOST:PORT",)),
    (["--worker-host", "10.0.0.7"], ("--worker-host needs --lighthouse",)),
])
def test_bad_elastic_options_are_one_line(capsys, argv, needles):
    refused(capsys, ["train", "--elastic", "--workers", "2", "--steps", "5", *argv], *needles)


def test_elastic_options_without_elastic_are_refused(capsys):
    refused(capsys, ["train", "--min-workers", "2", "--steps", "5"], "--min-workers needs --elastic")
    refused(capsys, ["train", "--lighthouse", "127.0.0.1:29510", "--steps", "5"], "--lighthouse needs --elastic")
    refused(capsys, ["train", "--worker-host", "127.0.0.1", "--steps", "5"], "--worker-host needs --elastic")


def _secret_file(tmp_path, content: bytes, mode: int = 0o600) -> str:
    path = tmp_path / "job.secret"
    path.write_bytes(content)
    path.chmod(mode)
    return str(path)


GOOD = b"0123456789abcdef0123456789abcdef\n"


def test_a_job_secret_that_cannot_be_used_is_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("THINWIRE_JOB_SECRET", raising=False)
    elastic = ["train", "--elastic", "--workers", "2", "--steps", "5", "--job-secret-file"]
    refused(capsys, [*elastic, str(tmp_path / "missing")], f"--job-secret-file {tmp_path / 'missing'}: no such file")
    refused(capsys, [*elastic, _secret_file(tmp_path, b"")], "the file is empty")
    refused(capsys, [*elastic, _secret_file(tmp_path, b"  \n")], "the file is empty")
    refused(capsys, [*elastic, _secret_file(tmp_path, b"short\n")],
            "it holds 5 byte(s); a job secret needs at least 16")
    path = _secret_file(tmp_path, GOOD, 0o644)
    refused(capsys, [*elastic, path], f"every user of this machine can read it; make it yours alone (chmod 600 {path})")
    refused(capsys, [*elastic, str(tmp_path)], "not a file")
    path = _secret_file(tmp_path, GOOD)
    refused(capsys, ["train", "--job-secret-file", path, "--steps", "5"], "--job-secret-file needs --elastic")
    monkeypatch.setenv("THINWIRE_JOB_SECRET", "0123456789abcdef")
    refused(capsys, [*elastic, path],
            "--job-secret-file and THINWIRE_JOB_SECRET are both set: give the job secret once")
    monkeypatch.setenv("THINWIRE_JOB_SECRET", "too short")
    refused(capsys, elastic[:-1], "THINWIRE_JOB_SECRET holds 9 byte(s); a job secret needs at least 16")


def test_a_secret_file_that_cannot_be_read_is_named(tmp_path, monkeypatch):
    from thinwire.elastic import secret

    path = _secret_file(tmp_path, GOOD)
    assert secret.read(path, env={}) == GOOD.rstrip() and secret.read(None, env={}) is None
    assert secret.read(None, env={"THINWIRE_JOB_SECRET": " 0123456789abcdef\n"}) == b"0123456789abcdef"

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("builtins.open", denied)  # root reads any file: the refusal as another user meets it
    with pytest.raises(secret.SecretError, match=r"^--job-secret-file .*: cannot be read \(Permission denied\)$"):
        secret.read(path, env={})


def test_a_worker_without_a_secret_warns_once_it_reaches_beyond_this_machine():
    from thinwire.run.elastic import secret_warning

    for local in ("127.0.0.1:29510", "localhost:29510", "[::1]:29510", "http://127.0.0.2:1"):
        assert secret_warning(local, None) is None
    assert secret_warning("10.0.0.7:29510", GOOD) is None
    line = secret_warning("10.0.0.7:29510", None)
    assert line is not None and len(line.splitlines()) == 1 and line.startswith("thinwire: warning: this elastic job "
                                                                                   "has no job secret")
    assert "--job-secret-file PATH" in line and "THINWIRE_JOB_SECRET" in line


def test_proofs_bind_every_part_and_its_boundaries():
    from thinwire.elastic import secret

    key = GOOD.rstrip()
    t = secret.tag(key, "p", b"ab", b"c")
    assert secret.matches(key, t, "p", b"ab", b"c")
    assert not secret.matches(key, t, "p", b"a", b"bc")  # the same bytes cut elsewhere
    assert not secret.matches(key, t, "q", b"ab", b"c") and not secret.matches(key[::-1], t, "p", b"ab", b"c")
    import hashlib
    import hmac

    # HMAC-SHA-256 of the purpose, then each part after its 8-byte length
    assert t == hmac.new(key, b"p" + (2).to_bytes(8, "big") + b"ab" + (1).to_bytes(8, "big") + b"c",
                         hashlib.sha256).digest()


def test_a_lighthouse_that_does_not_answer_is_named_within_the_timeout(capsys):
    import time

    port = free_port()  # nothing listens there
    t0 = time.perf_counter()
    refused(capsys, ["train", "--elastic", "--workers", "2", "--steps", "5", "--lighthouse", f"127.0.0.1:{port}",
                     "--replica", "0", "--elastic-timeout", "2"], f"no Lighthouse answers at 127.0.0.1:{port}")
    assert time.perf_counter() - t0 < 10


def test_the_lighthouse_command_refuses_a_bad_address_and_minimum(capsys):
    refused(capsys, ["lighthouse", "--min-workers", "0"], "--min-workers must be >= 1")
    refused(capsys, ["lighthouse", "--min-workers", "2", "--bind", "localhost"], "an address must be HOST:PORT")


@pytest.mark.parametrize("spec", ["diloco:period=3,warmup=2", "localsgd:period=4", "sparseloco:period=3,chunk=4,k=2",
                                  "streaming-diloco:period=6,fragments=3,delay=0", "topk:ratio=0.5,min_numel=0"])
def test_a_step_said_to_send_nothing_sends_nothing_and_one_said_to_send_does(spec):
    # an elastic worker asks for no quorum, votes on nothing and keeps no undo copy on a step
    # whose method says it sends nothing: the meter, step by step, must agree
    import copy

    import torch

    import tiny
    from thinwire.algorithms.build import build_method
    from thinwire.comm.local import LocalWorld

    base = tiny.net(5, 8, 3)

    def fn(comm):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        method = build_method(resolve_method(spec), model, opt, comm, overlap=False)
        said, sent = [], []
        for step in range(14):
            said.append(method.communicates_next())
            before = comm.meter.messages
            tiny.backward(model, opt, comm.rank, step)
            method.after_backward()
            opt.step()
            method.after_step()
            sent.append(comm.meter.messages > before)
        return said, sent

    for said, sent in LocalWorld(2).run(fn):
        assert said == sent
        assert not all(said) or spec.startswith("topk")  # the periodic ones train alone between averages
