"""QuorumComm's failure rule, without a network: a collective that fails is reported to the
manager once, never raised; every later collective of the step returns at once without
launching; the outputs of a gather, a scatter or a receive that failed are zeros."""

from __future__ import annotations

from datetime import timedelta

import torch

from thinwire.elastic.comm import QuorumComm


class Manager:
    def __init__(self) -> None:
        self.errors: list[Exception] = []

    def errored(self):
        return self.errors[0] if self.errors else None

    def report_error(self, e: Exception) -> None:
        self.errors.append(e)


class Work:
    waited: list = []  # the timeout of every wait, in order

    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def wait(self, timeout=None) -> bool:
        Work.waited.append(timeout)
        if self.fail:
            raise RuntimeError("Connection closed by peer")
        return True

    def is_completed(self) -> bool:
        return True


class Group:
    """A group of 2 whose works fail from the ``fail_from``-th launch on."""

    def __init__(self, fail_from: int) -> None:
        self.launched, self.fail_from = 0, fail_from

    def _work(self, fill=None) -> Work:
        self.launched += 1
        ok = self.launched < self.fail_from
        if ok and fill is not None:
            fill()
        return Work(not ok)

    def allreduce(self, tensors, opts):
        return self._work(lambda: tensors[0].mul_(2))

    def allgather(self, outputs, inputs, opts):
        return self._work(lambda: [o.copy_(inputs[0]) for o in outputs[0]])

    def broadcast(self, tensors, opts):
        return self._work()

    def send(self, tensors, dst, tag):
        return self._work()

    def recv(self, tensors, src, tag):
        return self._work(lambda: tensors[0].fill_(7))

    def barrier(self, opts):
        return self._work()


def comm(fail_from: int) -> tuple[QuorumComm, Manager, Group]:
    m, g = Manager(), Group(fail_from)
    c = QuorumComm(m, g, timeout=timedelta(seconds=7))
    c.reconfigure(0, 2)
    return c, m, g


def test_every_work_waits_the_comms_own_timeout():
    # gloo's own timeout is the group's set-up bound (short); a send, a receive or a
    # collective of a step waits the elastic timeout the comm was given
    c, _, _ = comm(fail_from=100)
    Work.waited.clear()
    c.all_reduce(torch.ones(3))
    c.exchange({1: torch.ones(2)}, {1: torch.zeros(2)})
    assert Work.waited == [timedelta(seconds=7)] * 3


def test_collectives_that_succeed_land_their_outputs():
    c, m, _ = comm(fail_from=100)
    t = torch.ones(3)
    c.all_reduce(t)
    out = torch.full((2, 3), -1.0)
    c.all_gather(torch.arange(3.0), out)
    assert torch.equal(t, torch.full((3,), 2.0)) and torch.equal(out, torch.arange(3.0).expand(2, 3))
    assert not m.errors and not c.broken


def test_a_failed_collective_is_reported_once_zeroes_its_output_and_the_rest_of_the_step_sends_nothing():
    c, m, g = comm(fail_from=1)
    out = torch.full((2, 3), 5.0)
    c.all_gather(torch.arange(3.0), out)  # fails at wait: no exception
    assert c.broken and len(m.errors) == 1 and torch.equal(out, torch.zeros(2, 3))
    launched = g.launched
    recv = {1: torch.full((4,), 9.0)}
    c.exchange({1: torch.ones(4)}, recv)
    scattered = torch.full((2,), 3.0)
    c.reduce_scatter(torch.ones(4), scattered)
    c.all_reduce(torch.ones(2))
    c.barrier()
    assert g.launched == launched  # nothing more went out this step
    assert torch.equal(recv[1], torch.zeros(4)) and torch.equal(scattered, torch.zeros(2))
    assert len(m.errors) == 1


def test_bytes_are_metered_as_sent_failed_steps_included():
    c, _, _ = comm(fail_from=1)
    c.all_reduce(torch.ones(10))
    assert c.meter.bytes_sent > 0
