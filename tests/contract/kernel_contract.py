"""The Kernel contract: one suite, run against FakeKernel (tests/) and the real backends
(integration/), so the fake cannot drift from the kernel it stands for.

A subclass provides the `kernel` fixture (an empty kernel) and `missing_schedulers`.
"""

from __future__ import annotations

from ipaddress import ip_address
from itertools import combinations
from pathlib import Path

import pytest

from ipvsproxy.config import Config
from ipvsproxy.errors import AlreadyExists, NotFound, Unsupported
from ipvsproxy.kernel import Kernel
from ipvsproxy.model import (
    AddDest,
    AddService,
    BindAddress,
    Counters,
    DeleteDest,
    DeleteService,
    DestTraffic,
    Proto,
    RealServer,
    RSKey,
    ServiceFlags,
    UnbindAddress,
    UpdateDest,
    UpdateService,
    VirtualServer,
    VSKey,
)
from ipvsproxy.schedulers import Scheduler, allowed_flags
from ipvsproxy.sync.ownership import ownership_for
from ipvsproxy.sync.plan import plan
from tests.factories import desired_from_manifests

EXAMPLES = Path(__file__).parent.parent.parent / "examples"
KEY = VSKey(ip_address("10.96.0.10"), 80, Proto.TCP)
VS = VirtualServer(KEY)
RS1 = RealServer(RSKey(ip_address("10.244.1.1"), 8080))
RS2 = RealServer(RSKey(ip_address("10.244.1.2"), 8080))


def flag_sets(scheduler: Scheduler) -> list[ServiceFlags]:
    names = list(allowed_flags(scheduler).values())
    out = [ServiceFlags(0)]
    for n in range(1, len(names) + 1):
        for combo in combinations(names, n):
            flags = ServiceFlags(0)
            for flag in combo:
                flags |= ServiceFlags(int(flag))
            out.append(flags)
    return out


class KernelContract:
    @pytest.fixture
    def kernel(self) -> Kernel:
        raise NotImplementedError

    @pytest.fixture
    def missing_schedulers(self) -> frozenset[Scheduler]:
        return frozenset()

    @pytest.fixture
    def has_counters(self) -> bool:
        return True

    def test_traffic_counts_every_destination_from_zero(self, kernel: Kernel, has_counters) -> None:
        """Counters exist for what observe() shows, zero before any packet; a backend
        without counters says so with {}."""
        kernel.apply([AddService(VS), AddDest(KEY, RS1), AddDest(KEY, RS2)])
        traffic = kernel.traffic()
        if not has_counters:
            assert traffic == {}
            return
        assert traffic.keys() == {KEY}
        assert traffic[KEY].counters == Counters()
        assert traffic[KEY].dests == {RS1.key: DestTraffic(), RS2.key: DestTraffic()}
        kernel.apply([DeleteDest(KEY, RS2.key)])
        assert kernel.traffic()[KEY].dests.keys() == {RS1.key}

    def test_add_and_observe(self, kernel: Kernel) -> None:
        report = kernel.apply([AddService(VS), AddDest(KEY, RS1), AddDest(KEY, RS2)])
        assert report.failures == ()
        assert report.applied == 3
        state = kernel.observe()
        assert state.services == {KEY: VS}
        assert state.dests == {KEY: {RS1.key: RS1, RS2.key: RS2}}

    def test_duplicates_fail_with_already_exists_and_the_rest_goes_on(self, kernel: Kernel) -> None:
        other = VirtualServer(VSKey(ip_address("10.96.0.11"), 80, Proto.TCP))
        report = kernel.apply(
            [
                AddService(VS),
                AddService(VS),
                AddDest(KEY, RS1),
                AddDest(KEY, RS1),
                AddService(other),
            ]
        )
        assert [(f.op, type(f.error)) for f in report.failures] == [
            (AddService(VS), AlreadyExists),
            (AddDest(KEY, RS1), AlreadyExists),
        ]
        assert set(kernel.observe().services) == {KEY, other.key}

    @pytest.mark.parametrize(
        "op",
        [
            UpdateService(VS),
            DeleteService(KEY),
            AddDest(KEY, RS1),
            UpdateDest(KEY, RS1),
            DeleteDest(KEY, RS1.key),
        ],
        ids=["update-service", "delete-service", "add-dest", "update-dest", "delete-dest"],
    )
    def test_missing_service_is_not_found(self, kernel: Kernel, op) -> None:
        (failure,) = kernel.apply([op]).failures
        assert isinstance(failure.error, NotFound)

    @pytest.mark.parametrize(
        "op", [UpdateDest(KEY, RS1), DeleteDest(KEY, RS1.key)], ids=["update", "delete"]
    )
    def test_missing_destination_is_not_found(self, kernel: Kernel, op) -> None:
        (failure,) = kernel.apply([AddService(VS), op]).failures
        assert isinstance(failure.error, NotFound)

    def test_update_in_place_and_weight_zero(self, kernel: Kernel) -> None:
        kernel.apply([AddService(VS), AddDest(KEY, RS1)])
        sticky = VirtualServer(
            KEY, Scheduler.SH, ServiceFlags.PERSISTENT | ServiceFlags.SCHED2, 600
        )
        drained = RealServer(RS1.key, weight=0)
        assert kernel.apply([UpdateService(sticky), UpdateDest(KEY, drained)]).failures == ()
        state = kernel.observe()
        assert state.services[KEY] == sticky
        assert state.dests[KEY] == {RS1.key: drained}

    def test_delete_service_drops_its_destinations(self, kernel: Kernel) -> None:
        kernel.apply([AddService(VS), AddDest(KEY, RS1)])
        assert kernel.apply([DeleteService(KEY)]).failures == ()
        assert kernel.apply([AddService(VS)]).failures == ()
        assert kernel.observe().dests == {KEY: {}}

    def test_ipv6_and_other_protocols(self, kernel: Kernel) -> None:
        v6 = VirtualServer(VSKey(ip_address("fd00:96::10"), 53, Proto.UDP), Scheduler.WRR)
        sctp = VirtualServer(VSKey(ip_address("10.96.0.12"), 5060, Proto.SCTP))
        rs6 = RealServer(RSKey(ip_address("fd00:244::5"), 5353), weight=5)
        report = kernel.apply([AddService(v6), AddDest(v6.key, rs6), AddService(sctp)])
        assert report.failures == ()
        state = kernel.observe()
        assert state.services == {v6.key: v6, sctp.key: sctp}
        assert state.dests[v6.key] == {rs6.key: rs6}

    @pytest.mark.parametrize("scheduler", list(Scheduler), ids=str)
    def test_every_scheduler_and_flag_set_round_trips(
        self, kernel: Kernel, scheduler: Scheduler, missing_schedulers: frozenset[Scheduler]
    ) -> None:
        services = [
            VirtualServer(VSKey(ip_address("10.96.1.1"), 1000 + n, Proto.TCP), scheduler, flags)
            for n, flags in enumerate(flag_sets(scheduler))
        ]
        report = kernel.apply([AddService(vs) for vs in services])
        if scheduler in missing_schedulers:
            assert {type(f.error) for f in report.failures} == {Unsupported}
            return
        assert report.failures == ()
        assert kernel.observe().services == {vs.key: vs for vs in services}

    def test_persistence_timeout(self, kernel: Kernel) -> None:
        vs = VirtualServer(KEY, Scheduler.RR, ServiceFlags.PERSISTENT, 10800)
        kernel.apply([AddService(vs)])
        assert kernel.observe().services[KEY].timeout_s == 10800

    def test_addresses(self, kernel: Kernel) -> None:
        a, b = ip_address("10.96.0.10"), ip_address("fd00:96::10")
        report = kernel.apply(
            [
                BindAddress(a),
                BindAddress(b),
                BindAddress(a),
                UnbindAddress(ip_address("10.96.0.99")),
            ]
        )
        assert [type(f.error) for f in report.failures] == [AlreadyExists, NotFound]
        assert kernel.observe().bound == {a, b}
        assert kernel.apply([UnbindAddress(a)]).failures == ()
        assert kernel.observe().bound == {b}

    def test_plan_converges_on_the_bundled_example(self, kernel: Kernel) -> None:
        config = Config(node_name="node-a")
        desired, node = desired_from_manifests([EXAMPLES], config)
        own = ownership_for(config, node.addresses)
        assert kernel.apply(plan(desired.state, kernel.observe(), ownership=own)).failures == ()
        observed = kernel.observe()
        assert observed == desired.state
        assert plan(desired.state, observed, ownership=own) == ()
