"""NetlinkKernel on a real IPVS kernel: the shared contract, plus what only a kernel shows."""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Iterator
from ipaddress import IPv4Address, IPv6Address, ip_address
from pathlib import Path

import pytest

from integration.host import kernel_missing_schedulers
from ipvsproxy.config import Config
from ipvsproxy.errors import Unsupported
from ipvsproxy.host import sysctl as sysctls
from ipvsproxy.model import (
    AddDest,
    AddService,
    Proto,
    RealServer,
    RSKey,
    UpdateDest,
    VirtualServer,
    VSKey,
)
from ipvsproxy.netlink import NetlinkKernel, probe
from ipvsproxy.netlink.genl import GenlSocket
from ipvsproxy.saved_table import parse_save
from ipvsproxy.schedulers import Scheduler
from ipvsproxy.sync.ownership import ownership_for
from ipvsproxy.sync.plan import plan
from tests.contract.kernel_contract import KernelContract
from tests.factories import desired_from_manifests

pytestmark = pytest.mark.vm

EXAMPLES = Path(__file__).parents[2] / "examples"


def ipvsadm_save() -> str:
    return subprocess.run(["ipvsadm-save", "-n"], capture_output=True, text=True, check=True).stdout


class TestNetlinkKernel(KernelContract):
    @pytest.fixture
    def kernel(self, clean) -> Iterator[NetlinkKernel]:
        with NetlinkKernel() as kernel:
            yield kernel

    @pytest.fixture
    def missing_schedulers(self) -> frozenset[Scheduler]:
        return kernel_missing_schedulers()


@pytest.fixture
def kernel(clean) -> Iterator[NetlinkKernel]:
    with NetlinkKernel() as k:
        yield k


def test_ipvsadm_sees_exactly_what_observe_returns(kernel):
    config = Config(node_name="node-a")
    desired, node = desired_from_manifests([EXAMPLES], config)
    kernel.apply(
        plan(desired.state, kernel.observe(), ownership=ownership_for(config, node.addresses))
    )
    saved = parse_save(ipvsadm_save())
    observed = kernel.observe()
    assert (saved.services, saved.dests) == (observed.services, observed.dests)
    assert observed.services == desired.state.services
    out = subprocess.run(
        ["ip", "-o", "addr", "show", "dev", "kube-ipvs0"], capture_output=True, text=True
    ).stdout
    assert "10.96.0.10/32" in out
    assert "fd00:96::60/128" in out


def test_foreign_virtual_servers_survive_a_sync(kernel):
    subprocess.run(["ipvsadm", "-A", "-t", "192.168.99.1:443", "-s", "wlc", "-p", "60"], check=True)
    subprocess.run(
        ["ipvsadm", "-a", "-t", "192.168.99.1:443", "-r", "192.168.99.11:443", "-g"], check=True
    )
    subprocess.run(["ipvsadm", "-A", "-f", "77", "-s", "rr"], check=True)
    before = [
        line for line in ipvsadm_save().splitlines() if "192.168.99" in line or "-f 77" in line
    ]
    config = Config(node_name="node-a", service_cidrs=())
    desired, node = desired_from_manifests([EXAMPLES], config)
    own = ownership_for(config, node.addresses)
    assert kernel.apply(plan(desired.state, kernel.observe(), ownership=own)).failures == ()
    # and a second sync that deletes everything of ours
    from ipvsproxy.model import EMPTY

    assert kernel.apply(plan(EMPTY, kernel.observe(), ownership=own)).failures == ()
    after = ipvsadm_save().splitlines()
    assert after == before


def test_a_plan_touching_k_objects_sends_k_requests(kernel, monkeypatch):
    vss = [VirtualServer(VSKey(ip_address("10.96.2.1"), 1000 + n, Proto.TCP)) for n in range(200)]
    rs = RealServer(RSKey(ip_address("10.244.1.1"), 80))
    from ipvsproxy.model import AddDest

    assert (
        kernel.apply([AddService(v) for v in vss] + [AddDest(v.key, rs) for v in vss]).failures
        == ()
    )
    sent: list[int] = []
    original = GenlSocket.batch

    def counting(self, requests):
        sent.append(len(requests))
        return original(self, requests)

    monkeypatch.setattr(GenlSocket, "batch", counting)
    ops = [
        UpdateDest(vss[7].key, RealServer(rs.key, weight=0)),
        UpdateDest(vss[9].key, RealServer(rs.key, weight=3)),
    ]
    assert kernel.apply(ops).failures == ()
    assert sent == [2]


def test_unknown_scheduler_module_is_unsupported(kernel):
    missing = kernel_missing_schedulers()
    if not missing:
        pytest.skip("this kernel ships every scheduler module")
    scheduler = sorted(missing)[0]
    (failure,) = kernel.apply(
        [AddService(VirtualServer(VSKey(ip_address("10.96.0.1"), 80, Proto.TCP), scheduler))]
    ).failures
    assert isinstance(failure.error, Unsupported)
    assert scheduler.module in str(failure.error)


def test_probe(clean):
    assert probe(Scheduler.RR).usable
    for scheduler in kernel_missing_schedulers():
        result = probe(scheduler)
        assert not result.usable
        assert scheduler.module in result.reason
    assert "198.51.100.0" not in ipvsadm_save()


def test_sysctls_and_timeouts(kernel):
    settings = sysctls.required(
        subprocess.run(["uname", "-r"], capture_output=True, text=True).stdout
    )
    sysctls.ensure(settings)
    for setting in settings:
        assert int(Path("/proc/sys", setting.path).read_text()) == setting.value
    assert sysctls.ensure(settings) == []  # idempotent
    kernel.set_timeouts(tcp=901, tcp_fin=121, udp=301)
    out = subprocess.run(
        ["ipvsadm", "-L", "--timeout"], capture_output=True, text=True, check=True
    ).stdout
    assert "901 121 301" in out


def test_a_dummy_device_deleted_behind_our_back_is_recreated(kernel):
    config = Config(node_name="node-a")
    desired, node = desired_from_manifests([EXAMPLES], config)
    own = ownership_for(config, node.addresses)
    kernel.apply(plan(desired.state, kernel.observe(), ownership=own))
    subprocess.run(["ip", "link", "del", "kube-ipvs0"], check=True)
    observed = kernel.observe()
    assert observed.bound == frozenset()
    assert kernel.apply(plan(desired.state, observed, ownership=own)).failures == ()
    assert kernel.observe() == desired.state


def test_the_unit_tests_ipvsadm_sample_is_what_real_ipvsadm_prints(kernel):
    """tests/data/ipvsadm-save-mixed.txt is loaded by ipvsadm and saved back line for line."""
    sample = Path(__file__).parents[2] / "tests" / "data" / "ipvsadm-save-mixed.txt"
    subprocess.run(["ipvsadm", "-R"], input=sample.read_bytes(), check=True)
    printed = ipvsadm_save()
    assert sorted(printed.splitlines()) == sorted(sample.read_text().splitlines())
    observed = kernel.observe()
    expected = parse_save(sample.read_text())
    assert (observed.services, observed.dests) == (expected.services, expected.dests)


def test_a_larger_table_observed_first_and_again_equals_ipvsadm_save(kernel):
    """104 services of mixed families and weights: a fresh kernel object's first
    observation (the settings-bytes decoder) and its second (the cache) agree with ipvsadm."""
    ops: list[AddService | AddDest] = []
    for n in range(104):
        v6 = n % 7 == 0
        address = ip_address(f"fd00:97::{n:x}" if v6 else f"10.97.{n // 250}.{n % 250 + 1}")
        key = VSKey(address, 80, Proto.TCP)
        ops.append(AddService(VirtualServer(key)))
        for d in range(n % 4):
            backend = ip_address(f"fd00:245::{n:x}:{d}" if v6 else f"10.245.{n % 250}.{d + 1}")
            ops.append(AddDest(key, RealServer(RSKey(backend, 8080), weight=d)))
    assert kernel.apply(ops).failures == ()
    with NetlinkKernel() as fresh:
        observed = fresh.observe()
        again = fresh.observe()
    saved = parse_save(ipvsadm_save())
    assert (observed.services, observed.dests) == (saved.services, saved.dests)
    assert len(observed.services) == 104
    assert again == observed


# ---- observe(): every setting, every family, firewall marks ---------------------------------


def _mixed_table() -> list[AddService | AddDest]:
    """Every setting observe() reads, on IPv4, IPv6 and firewall-mark services: weights 0,
    thresholds, forwarding methods, persistence with timeouts, sh/mh
    scheduler flags, TCP/UDP/SCTP."""
    from ipvsproxy.model import Forward, ServiceFlags

    ops: list[AddService | AddDest] = []
    both = ServiceFlags.SCHED1 | ServiceFlags.SCHED2
    sched_flags = [ServiceFlags(0), ServiceFlags.SCHED1, ServiceFlags.SCHED2, both]
    for n in range(60):
        v6, mark = n % 5 == 0, 100 + n if n % 7 == 3 else 0
        address = ip_address(f"fd00:98::{n:x}" if v6 else f"10.98.0.{n + 1}")
        proto = (Proto.TCP, Proto.UDP, Proto.SCTP)[n % 3] if not mark else Proto.TCP
        if mark:
            address = ip_address("::" if v6 else "0.0.0.0")
        key = VSKey(address, 0 if mark else 1000 + n, proto, fwmark=mark)
        scheduler = (Scheduler.RR, Scheduler.SH, Scheduler.MH, Scheduler.WLC)[n % 4]
        flags = sched_flags[n % 4] if scheduler in (Scheduler.SH, Scheduler.MH) else ServiceFlags(0)
        if n % 6 == 1:
            flags |= ServiceFlags.PERSISTENT
        timeout = 60 + n if flags & ServiceFlags.PERSISTENT else 0
        ops.append(AddService(VirtualServer(key, scheduler, flags, timeout)))
        for d in range(n % 5):
            backend = ip_address(f"fd00:246::{n:x}:{d}" if v6 else f"10.246.{n}.{d + 1}")
            rs = RealServer(
                RSKey(backend, 8000 + d),
                weight=(0, 1, 7, 65535)[d % 4],
                forward=(Forward.MASQ, Forward.ROUTE, Forward.TUNNEL)[(n + d) % 3],
                upper_threshold=(0, 100)[d % 2],
                lower_threshold=(0, 10)[d % 2],
            )
            ops.append(AddDest(key, rs))
    return ops


@pytest.fixture
def mixed(kernel):
    from integration.lab import sctp_available

    ops = [
        op
        for op in _mixed_table()
        if sctp_available()
        or (op.vs.key if isinstance(op, AddService) else op.service).proto != Proto.SCTP
    ]
    assert kernel.apply(ops).failures == ()
    return ops


def test_observe_reads_every_setting_as_ipvsadm_shows_it(kernel, mixed):
    with NetlinkKernel() as fresh:
        first, again = fresh.observe(), fresh.observe()
    assert again == first
    saved = parse_save(ipvsadm_save())  # which never prints thresholds
    unthresholded = {
        key: {
            k: dataclasses.replace(rs, upper_threshold=0, lower_threshold=0) for k, rs in d.items()
        }
        for key, d in first.dests.items()
    }
    assert (first.services, unthresholded) == (saved.services, saved.dests)
    assert {k.address.version for k in first.services} == {4, 6}
    assert any(k.fwmark for k in first.services)
    for op in mixed:  # the thresholds ipvsadm does not print, too
        if isinstance(op, AddDest):
            assert first.dests[op.service][op.rs.key] == op.rs


def test_connection_counts_of_a_gone_service_are_none(kernel, mixed):
    gone = VSKey(ip_address("10.98.9.9"), 1, Proto.TCP)
    assert kernel.destinations(gone) == []


def test_a_kernel_reads_the_namespace_it_was_opened_in(kernel, mixed):
    from integration.lab import inside, sh

    sh("ip", "netns", "add", "nsread1")
    try:
        sh("ip", "-n", "nsread1", "link", "set", "lo", "up")
        key = VSKey(ip_address("10.99.0.1"), 80, Proto.TCP)
        rs = RealServer(RSKey(ip_address("10.99.1.1"), 8080), weight=3)
        with inside("nsread1"):
            inner = NetlinkKernel(device="nsread0")
        with inner:
            assert inner.apply([AddService(VirtualServer(key)), AddDest(key, rs)]).ok
            state = inner.observe()
        assert state.services == {key: VirtualServer(key)}
        assert state.dests == {key: {rs.key: rs}}
        assert len(kernel.observe().services) == len(
            [op for op in mixed if isinstance(op, AddService)]
        )
    finally:
        sh("ip", "netns", "del", "nsread1")


# ---- VIPs on the dummy device: one batch per run of address operations (rtnl.py) ----------


def _shown(device: str = "kube-ipvs0") -> set[IPv4Address | IPv6Address]:
    out = subprocess.run(
        ["ip", "-o", "addr", "show", "dev", device], capture_output=True, text=True, check=True
    ).stdout
    return {ip_address(line.split()[3].split("/")[0]) for line in out.splitlines()}


def _vips(n: int, v6_every: int = 10) -> list[IPv4Address | IPv6Address]:
    return [
        ip_address(f"fd00:96::{i:x}" if i % v6_every == 0 else f"10.96.{i // 250}.{i % 250 + 1}")
        for i in range(n)
    ]


def test_a_thousand_vips_bound_and_unbound_in_one_batch_each(kernel, monkeypatch):
    from ipvsproxy.model import BindAddress, UnbindAddress
    from ipvsproxy.netlink.rtnl import RtnlSocket

    batches: list[int] = []
    original = RtnlSocket.send_batch

    def counting(self, requests):
        batches.append(len(requests))
        return original(self, requests)

    monkeypatch.setattr(RtnlSocket, "send_batch", counting)
    vips = _vips(1000)
    assert kernel.apply([BindAddress(a) for a in vips]).failures == ()
    assert _shown() == set(vips)
    assert kernel.observe().bound == set(vips)
    assert kernel.apply([UnbindAddress(a) for a in vips]).failures == ()
    assert _shown() == set()
    assert kernel.observe().bound == frozenset()
    assert batches == [1000, 1000]


def test_a_refused_address_change_is_reported_alone(kernel):
    from ipvsproxy.errors import AlreadyExists, NotFound
    from ipvsproxy.model import BindAddress, UnbindAddress

    vips = _vips(200)
    assert kernel.apply([BindAddress(vips[50])]).failures == ()
    ops = [BindAddress(a) for a in vips] + [UnbindAddress(ip_address("10.99.0.1"))]
    report = kernel.apply(ops)
    assert [(f.op, type(f.error)) for f in report.failures] == [
        (BindAddress(vips[50]), AlreadyExists),
        (UnbindAddress(ip_address("10.99.0.1")), NotFound),
    ]
    assert report.applied == len(ops) - 2
    assert _shown() == set(vips)


# ---- the dummy device over rtnl.py (no pyroute2) ------------------------------------------


def test_the_device_is_created_in_the_namespace_the_kernel_was_opened_in(kernel):
    """The link lookup is an RTM_GETLINK on the rtnetlink socket, not if_nametoindex (the
    caller's namespace): a kernel opened in a namespace keeps its device there."""
    from integration.lab import inside, sh
    from ipvsproxy.model import BindAddress, UnbindAddress

    vip = ip_address("10.98.0.1")
    sh("ip", "netns", "add", "links1")
    try:
        with inside("links1"):
            inner = NetlinkKernel(device="links0")
        with inner:
            assert inner.apply([BindAddress(vip)]).failures == ()
            assert inner.observe().bound == {vip}
            assert inner.has_device()
            shown = subprocess.run(
                ["ip", "-n", "links1", "-o", "addr", "show", "dev", "links0"],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            assert "10.98.0.1/32" in shown
            missing = subprocess.run(["ip", "link", "show", "links0"], capture_output=True)
            assert missing.returncode != 0  # not in the namespace we call from
            assert inner.apply([UnbindAddress(vip)]).failures == ()
            inner.remove_device()
            assert not inner.has_device()
    finally:
        sh("ip", "netns", "del", "links1")


def test_host_addresses_are_what_ip_addr_shows(kernel):
    from ipvsproxy.model import BindAddress
    from ipvsproxy.netlink.links import host_addresses

    assert kernel.apply([BindAddress(ip_address("10.98.0.2"))]).failures == ()
    out = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, check=True)
    shown = [ip_address(line.split()[3].split("/")[0]) for line in out.stdout.splitlines()]
    assert sorted(map(str, host_addresses())) == sorted(map(str, shown))  # v4 and v6 mixed
    assert ip_address("10.98.0.2") in host_addresses()
