"""NetlinkKernel on a real IPVS kernel: the shared contract, plus what only a kernel shows."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from ipaddress import ip_address
from pathlib import Path

import pytest

from integration.conftest import kernel_missing_schedulers
from ipvsproxy.agent import desired_from_manifests
from ipvsproxy.config import Config
from ipvsproxy.errors import Unsupported
from ipvsproxy.ipvsadm import parse_save
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
from ipvsproxy.netlink import sysctl as sysctls
from ipvsproxy.netlink.genl import GenlSocket
from ipvsproxy.schedulers import Scheduler
from ipvsproxy.sync.ownership import ownership_for
from ipvsproxy.sync.plan import plan
from tests.contract.kernel_contract import KernelContract

EXAMPLES = Path(__file__).parent.parent / "examples"


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
    sample = Path(__file__).parent.parent / "tests" / "data" / "ipvsadm-save-mixed.txt"
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
