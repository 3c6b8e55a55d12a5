"""Real-kernel tests, run by the README's test command. Markers choose the environment:
`netns` (integration/netns/, `scripts/test` runs `-m netns`) on this host's own kernel in
throw-away network namespaces, `vm` (integration/ipvs/, test_node.py, test_conntrack_vm.py)
inside the IPVS VM (`scripts/vm-test` runs `-m vm`). Every test carries exactly one of the
two, or collection fails: no test can fall outside both suites.

IPVS tests need root and a kernel with IPVS; netns tests root, iptables and namespaces.
Elsewhere they skip, except under CI=true, where a missing prerequisite is a failure: CI
must never go green by skipping.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from integration.lab import Lab, built
from ipvsproxy.schedulers import Scheduler


def _missing() -> str:
    if os.geteuid() != 0:
        return "needs root"
    if not Path("/proc/net/ip_vs").exists():
        return "this kernel has no IPVS (/proc/net/ip_vs missing); run via scripts/vm-test"
    return ""


def _netns_missing() -> str:
    if os.geteuid() != 0:
        return "needs root (network namespaces, iptables)"
    for tool in ("ip", "iptables-save", "iptables-restore", "ip6tables-save"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return ""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cluster",
        action="store_true",
        help="integration/test_node.py checks remote nodes (--hosts, --ssh-config: the "
        "Vagrant cluster), not a local agent",
    )


ENVIRONMENTS = ("vm", "netns")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each real-kernel test runs in exactly one environment, named by its module's marker."""
    for item in items:
        marked = [m for m in ENVIRONMENTS if item.get_closest_marker(m) is not None]
        if len(marked) != 1 and item.path.is_relative_to(Path(__file__).parent):
            raise pytest.UsageError(f"{item.nodeid}: marked {marked}, needs one of {ENVIRONMENTS}")


@pytest.fixture(autouse=True)
def _prerequisites(request: pytest.FixtureRequest) -> None:
    """IPVS tests need the VM's kernel; `netns` tests need root, namespaces and iptables;
    node checks against a cluster need nothing local."""
    if request.config.getoption("--cluster"):
        if request.node.get_closest_marker("node") is None:
            pytest.skip("--cluster runs only the node checks (integration/test_node.py)")
        return
    require(netns=request.node.get_closest_marker("netns") is not None)


def require(*, netns: bool = False) -> None:
    """Skip (fail under CI=true) unless this machine can run the test; also for fixtures of
    a wider scope, which pytest sets up before the autouse check above."""
    _skip_unless_ci(_netns_missing() if netns else _missing())


def require_sctp() -> None:
    """SCTP traffic needs the kernel's sctp module (scripts/vm loads it): skip without it,
    fail under CI=true, so the SCTP traffic tests cannot go green by skipping."""
    from integration.lab import sctp_available

    if not sctp_available():
        _skip_unless_ci("this kernel cannot open SCTP sockets (modprobe sctp)")


def _skip_unless_ci(reason: str) -> None:
    if reason and os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but a prerequisite is missing: {reason}", pytrace=False)
    if reason:
        pytest.skip(reason)


def clean_ipvs(device: str = "kube-ipvs0") -> None:
    """The VM is throw-away: start every test from an empty IPVS table, no dummy device, and
    none of ipvsproxy's iptables chains or ipsets (an agent leaves its rules in place).

    Runs twice per test, and every process costs a lot under emulation: look first
    (/proc, /sys and one save per tool), clean only what is there.
    """
    from ipvsproxy.firewall import rules as firewall_rules
    from ipvsproxy.firewall import sets as firewall_sets
    from ipvsproxy.firewall.kernel import Firewall
    from ipvsproxy.iptables import IptablesKernel
    from ipvsproxy.iptables import rules as fallback_rules

    services = Path("/proc/net/ip_vs").read_text().splitlines()[3:]  # after 3 header lines
    if services:
        subprocess.run(["ipvsadm", "-C"], check=True)
    if Path(f"/sys/class/net/{device}").exists():
        subprocess.run(["ip", "link", "del", device], capture_output=True, check=False)
    seen = "".join(
        subprocess.run(command, capture_output=True, text=True, check=False).stdout
        for command in (["iptables-save"], ["ip6tables-save"], ["ipset", "list", "-n"])
    )
    ours = (firewall_rules.PREFIX, firewall_sets.SET_PREFIX, fallback_rules.PREFIX)
    if any(prefix in seen for prefix in ours):
        firewall = Firewall()
        firewall.check()
        firewall.cleanup()
        fallback = IptablesKernel()
        fallback.check()
        fallback.cleanup()


@pytest.fixture
def clean() -> Iterator[None]:
    clean_ipvs()
    yield
    clean_ipvs()


@contextlib.contextmanager
def ipvs_lab(backends: int, **options: Any) -> Iterator[Lab]:
    """A lab (integration.lab.built) on an empty IPVS table, with the sysctls ipvsproxy sets
    for this kernel; the table emptied again afterwards."""
    from ipvsproxy.netlink import sysctl

    clean_ipvs()
    sysctl.ensure(sysctl.required(os.uname().release))
    try:
        with built(backends, **options) as lab:
            yield lab
    finally:
        clean_ipvs()


def kernel_missing_schedulers() -> frozenset[Scheduler]:
    """Schedulers whose module this kernel does not ship (e.g. twos before 6.2)."""
    release = os.uname().release
    base = Path(f"/lib/modules/{release}/kernel/net/netfilter/ipvs")
    return frozenset(
        s for s in Scheduler if not any(base.glob(f"{s.module}.ko*")) and not _builtin(s)
    )


def _builtin(s: Scheduler) -> bool:
    builtin = Path(f"/lib/modules/{os.uname().release}/modules.builtin")
    return builtin.exists() and f"/{s.module}.ko" in builtin.read_text()
