"""Link grammar, the alpha-beta formulas, and the meter against the ring and gather byte counts."""

import math
import threading
import time

import pytest
import torch

from thinwire.comm.link import EmulatedLink, Link
from thinwire.comm.local import LocalWorld


@pytest.mark.parametrize(
    "text, latency_s, bandwidth_Bps",
    [
        ("1gbit,50us", 50e-6, 125e6),
        ("50us,1gbit", 50e-6, 125e6),  # order-independent
        ("100mbit,1ms", 1e-3, 12.5e6),
        ("2.5Gbit, 0.5ms", 0.5e-3, 312.5e6),  # case and spaces
        ("1e3kbit,10ns", 10e-9, 125e3),
        ("8bit,2s", 2.0, 1.0),
        ("10gbit,0us", 0.0, 1.25e9),
    ],
)
def test_parse(text, latency_s, bandwidth_Bps):
    link = Link.parse(text)
    assert link == Link(latency_s=latency_s, bandwidth_Bps=bandwidth_Bps)
    assert Link.parse(str(link)) == link


def test_str_is_readable_and_round_trips():
    assert str(Link.parse("1gbit,50us")) == "1gbit,50us"
    assert str(Link.parse("100mbit,1ms")) == "100mbit,1ms"
    assert str(Link(latency_s=0.0, bandwidth_Bps=1.0)) == "8bit,0s"
    gen = torch.Generator().manual_seed(0)
    for _ in range(500):
        u = torch.rand(2, generator=gen, dtype=torch.float64).tolist()
        link = Link(latency_s=u[0] * 10 ** (-9 + 10 * u[1]), bandwidth_Bps=u[1] * 10 ** (12 * u[0]) + 1e-3)
        assert Link.parse(str(link)) == link, str(link)


@pytest.mark.parametrize(
    "text",
    ["fast", "1gbit", "1gbit,2gbit", "50us,1ms", "1gbit,50us,1ms", "gbit,50us", "1gbps,50us", "1gbit,-5us", ""]
    + ["1 g bit,1us"],
)
def test_parse_errors_state_the_grammar(text):
    with pytest.raises(ValueError) as e:
        Link.parse(text)
    msg = str(e.value)
    assert msg == (
        "link must look like 1gbit,50us (bandwidth <number>bit|kbit|mbit|gbit, latency <number>s|ms|us|ns), "
        f"got {text!r}"
    )


def test_invalid_values():
    with pytest.raises(ValueError, match="bandwidth must be a finite number of bytes/s > 0, got 0.0"):
        Link.parse("0gbit,1us")
    with pytest.raises(ValueError, match="latency must be"):
        Link(latency_s=-1.0, bandwidth_Bps=1.0)
    with pytest.raises(ValueError, match="bandwidth must be"):
        Link(latency_s=0.0, bandwidth_Bps=math.inf)


def test_model_formulas_on_hand_computed_cases():
    link = Link.parse("8mbit,1ms")  # β = 1e6 B/s, α = 1e-3 s
    B = 1_000_000
    # ring all_reduce, n = 4: 2*3*1ms + 2*3/4 * 1 s = 0.006 + 1.5
    assert link.all_reduce_time(B, 4) == pytest.approx(1.506, rel=1e-12)
    # n = 2: 2*1ms + 1 s
    assert link.all_reduce_time(B, 2) == pytest.approx(1.002, rel=1e-12)
    # all_gather, n = 4: 3*1ms + 3 * 1 s
    assert link.all_gather_time(B, 4) == pytest.approx(3.003, rel=1e-12)
    assert link.broadcast_time(B, 4) == pytest.approx(3.003, rel=1e-12)
    # neighbour exchange, degree 2: 1ms + 2 * 1 s
    assert link.exchange_time(B, 2) == pytest.approx(2.001, rel=1e-12)
    # one rank, nothing to send
    assert link.all_reduce_time(B, 1) == link.all_gather_time(B, 1) == link.exchange_time(B, 0) == 0.0


def _sent_formula(op: str, B: int, n: int) -> float:
    """Bytes each rank sends (ring all_reduce 2(n-1)/n B, all_gather (n-1) B, send B), written out
    independently of meter.py."""
    if n == 1:
        return 0.0
    return {"all_reduce": 2 * (n - 1) / n * B, "all_gather": (n - 1) * B}[op]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_meter_and_modeled_time_match_the_formulas(n):
    link = Link.parse("100mbit,20us")
    numel = 1000  # fp32: B = 4000 bytes

    def fn(comm):
        em = EmulatedLink(comm, link, sleep=False)
        B = 4 * numel
        expected_bytes, expected_s = 0.0, 0.0

        comm.meter.reset()
        em.all_reduce(torch.ones(numel))
        assert comm.meter.bytes_sent == pytest.approx(_sent_formula("all_reduce", B, n), abs=1e-9)
        expected_bytes += _sent_formula("all_reduce", B, n)
        expected_s += 0.0 if n == 1 else 2 * (n - 1) * 20e-6 + 2 * (n - 1) / n * B / 12.5e6

        out = torch.empty(n, numel)
        em.all_gather(torch.ones(numel), out)
        expected_bytes += _sent_formula("all_gather", B, n)
        expected_s += 0.0 if n == 1 else (n - 1) * 20e-6 + (n - 1) * B / 12.5e6

        peers = sorted({(comm.rank - 1) % n, (comm.rank + 1) % n} - {comm.rank})  # ring degree k
        em.exchange({p: torch.ones(numel) for p in peers}, {p: torch.empty(numel) for p in peers})
        expected_bytes += len(peers) * B  # point-to-point: B per send
        expected_s += 0.0 if not peers else 20e-6 + len(peers) * B / 12.5e6

        with comm.meter.paused():  # bookkeeping: neither counted nor modeled
            em.all_reduce(torch.ones(numel))
        assert comm.meter.bytes_sent == pytest.approx(expected_bytes, abs=1e-9)  # counted once, not twice
        assert em.modeled_seconds == pytest.approx(expected_s, rel=1e-12, abs=0)
        return comm.meter.snapshot()

    snaps = LocalWorld(n).run(fn)
    if n > 1:
        assert snaps[0]["all_reduce"]["messages"] == 2 * (n - 1) and snaps[0]["all_gather"]["messages"] == n - 1


class _VirtualTime:
    """A clock per thread (per rank of a LocalWorld) that moves only when the link sleeps or
    the test "computes": the link's waits are recorded, not measured, so load cannot move them."""

    def __init__(self, start: float = 1000.0) -> None:
        self._start = start
        self._local = threading.local()

    def _state(self):
        if not hasattr(self._local, "t"):
            self._local.t, self._local.slept = self._start, []
        return self._local

    def now(self) -> float:
        return self._state().t

    def sleep(self, seconds: float) -> None:
        state = self._state()
        state.slept.append(seconds)
        state.t += seconds

    def compute(self, seconds: float) -> None:  # work that overlaps the transfers
        self._state().t += seconds

    @property
    def slept(self) -> list[float]:
        return self._state().slept


def test_emulated_link_delays_queues_and_overlaps(monkeypatch):
    from thinwire.comm import link as link_module

    clock = _VirtualTime()
    monkeypatch.setattr(link_module, "_now", clock.now)
    monkeypatch.setattr(link_module, "_sleep", clock.sleep)
    link = Link.parse("8mbit,0s")  # 1e6 B/s: a 2-rank all_reduce of B bytes takes B/1e6 s
    numel = 10_000  # 40 kB -> 40 ms modeled

    def fn(comm):
        em = EmulatedLink(comm, link)
        t = torch.ones(numel)
        t0 = clock.now()
        em.all_reduce(t)
        blocking = clock.now() - t0
        t0 = clock.now()
        h1 = em.all_reduce(torch.ones(numel), async_op=True)
        h2 = em.all_reduce(torch.ones(numel), async_op=True)  # queues behind h1: done at 80 ms
        issued = clock.slept[:]  # async issue waits for nothing
        clock.compute(0.05)  # "compute" overlapping the transfers
        h1.wait()  # h1 (done at 40 ms) finished during the compute: no wait
        h2_done_early = h2.is_completed()
        h2.wait()  # the rest of h2: 80 - 50 = 30 ms
        overlapped = clock.now() - t0
        sub = em.subgroup([0, 1])
        return (blocking, issued, clock.slept, overlapped, h2_done_early, type(sub).__name__, em.modeled_seconds,
                t[0].item())

    for blocking, issued, slept, overlapped, h2_done_early, sub_type, modeled, value in LocalWorld(2).run(fn):
        assert value == 2.0  # the real collective ran
        assert blocking == pytest.approx(0.04, abs=1e-9)  # a blocking call waits its modeled time
        assert issued == [pytest.approx(0.04, abs=1e-9)]  # only the blocking call's wait so far
        assert slept == [pytest.approx(0.04, abs=1e-9), pytest.approx(0.03, abs=1e-9)]
        assert overlapped == pytest.approx(0.08, abs=1e-9)  # max(compute, comm), not compute + comm = 0.13
        assert not h2_done_early and sub_type == "EmulatedLink"
        assert modeled == pytest.approx(0.12)


def test_emulated_link_waits_on_the_real_clock_by_default():
    """The seam's defaults: without a test's clock, a blocking call takes at least its modeled
    time (a lower bound only: load can lengthen a wait, never shorten it)."""
    from thinwire.comm import link as link_module

    assert link_module._now is time.perf_counter and link_module._sleep is time.sleep
    link = Link.parse("8mbit,0s")

    def fn(comm):
        em = EmulatedLink(comm, link)
        t0 = time.perf_counter()
        em.all_reduce(torch.ones(5_000))  # 20 kB -> 20 ms modeled
        return time.perf_counter() - t0

    for elapsed in LocalWorld(2).run(fn):
        assert elapsed >= 0.02 * 0.99  # (slack for the clock's rounding)


def test_sub_group_collectives_are_modeled_over_their_own_ranks():
    from thinwire.comm.link import Link, meter_seconds
    from thinwire.comm.meter import ByteMeter

    link = Link.parse("1gbit,50us")
    meter = ByteMeter()
    meter.record("all_reduce", 1_000_000, 2)  # a group of 2 inside a world of 4
    meter.record("all_reduce", 1_000_000, 4)
    expected = link.all_reduce_time(1_000_000, 2) + link.all_reduce_time(1_000_000, 4)
    assert meter_seconds(link, meter, 4) == pytest.approx(expected, rel=1e-12)
    assert meter_seconds(link, meter, 4) < 2 * link.all_reduce_time(1_000_000, 4)
