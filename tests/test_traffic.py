"""Traffic readings for `status` and the per-Service metrics: a reader shares one reading
among callers, never reads twice at once, and rates come from two samples."""

from __future__ import annotations

import threading
import time
from ipaddress import ip_address

from hypothesis import given
from hypothesis import strategies as st

from ipvsproxy.model import (
    AddDest,
    AddService,
    Counters,
    DestTraffic,
    Proto,
    RealServer,
    RSKey,
    Traffic,
    VirtualServer,
    VSKey,
)
from ipvsproxy.testing import FakeKernel
from ipvsproxy.traffic import Rates, Sample, TrafficReader, rate, rates
from tests.support import Clock

KEY = VSKey(ip_address("10.96.0.10"), 80, Proto.TCP)
RS = RSKey(ip_address("10.244.1.1"), 8080)


def kernel_with_one() -> FakeKernel:
    kernel = FakeKernel()
    kernel.apply([AddService(VirtualServer(KEY)), AddDest(KEY, RealServer(RS))])
    return kernel


def test_the_reader_opens_its_own_kernel_once_and_shares_readings_within_the_interval():
    kernel, clock, opened = kernel_with_one(), Clock(100.0), []

    def open_kernel() -> FakeKernel:
        opened.append(1)
        return kernel

    reader = TrafficReader(open_kernel, min_interval=1.0, clock=clock)
    assert opened == []  # nothing opened until asked
    first = reader.read()
    assert first.at == 100.0
    assert first.traffic[KEY].dests.keys() == {RS}
    kernel.counters[KEY] = Traffic(Counters(connections=5))
    clock.now = 100.5
    assert reader.read() is first  # shared
    clock.now = 101.0
    assert reader.read().traffic[KEY].counters.connections == 5
    assert opened == [1]


def test_callers_arriving_during_a_reading_wait_for_it_instead_of_reading_again():
    reads: list[float] = []
    gate = threading.Event()

    class Slow(FakeKernel):
        def traffic(self):
            reads.append(time.monotonic())
            gate.wait(5)
            return super().traffic()

    reader = TrafficReader(Slow, min_interval=10.0)
    samples: list[Sample] = []
    callers = [threading.Thread(target=lambda: samples.append(reader.read())) for _ in range(5)]
    for caller in callers:
        caller.start()
    time.sleep(0.1)
    gate.set()
    for caller in callers:
        caller.join(5)
    assert len(reads) == 1
    assert len(samples) == 5
    assert len({id(s) for s in samples}) == 1


def test_rates_per_second_between_two_samples():
    before = Sample(10.0, {KEY: Traffic(Counters(2, 10, 10, 1000, 500), {RS: DestTraffic()})})
    after = Sample(
        12.0,
        {
            KEY: Traffic(
                Counters(6, 30, 20, 3000, 900),
                {RS: DestTraffic(1, 0, Counters(4, 30, 20, 2000, 400))},
            )
        },
    )
    services, dests = rates(before, after)
    assert services == {KEY: Rates(2.0, 15.0, 1200.0)}
    assert dests == {(KEY, RS): Rates(2.0, 25.0, 1200.0)}


def test_an_object_new_since_the_first_sample_counts_from_zero():
    after = Sample(1.0, {KEY: Traffic(Counters(3), {RS: DestTraffic(counters=Counters(3))})})
    services, dests = rates(Sample(0.0), after)
    assert services[KEY].connections == 3.0
    assert dests[KEY, RS].connections == 3.0


@given(
    old=st.integers(0, 2**64 - 1),
    new=st.integers(0, 2**64 - 1),
    seconds=st.floats(0.001, 1e6),
)
def test_a_rate_is_never_negative(old, new, seconds):
    """A counter that went down (the object was replaced between the samples) counts from
    zero, never backwards."""
    got = rate(Counters(old, old, old, old, old), Counters(new, new, new, new, new), seconds)
    assert got.connections >= 0
    assert got.packets >= 0
    assert got.bytes >= 0
    assert rate(Counters(), Counters(), 0) == Rates()
