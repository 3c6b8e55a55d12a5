"""The test host's side of the real-kernel suites: what a test needs of the machine (root,
IPVS, namespaces, iptables), and a clean IPVS table. Skips, or fails under CI=true.

Plain functions (the fixtures in conftest.py call them; tests import them from here, never
from conftest).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ipvsproxy.schedulers import Scheduler

# How long a step of a real-kernel test may take before the test calls it stuck: a deadline for
# liveness, never a measure of speed (that is bench/'s). Beside another emulated VM on two cores,
# a pass in the VM takes several times its quiet figure, and an agent's start (its imports over
# the 9p share) a minute or more; so the deadlines are minutes, and each wait is for the event.
STUCK = 180.0


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


def require(*, netns: bool = False) -> None:
    """Skip (fail under CI=true) unless this machine can run the test; also for fixtures of
    a wider scope, which pytest sets up before conftest.py's autouse check."""
    skip_unless_ci(_netns_missing() if netns else _missing())


def skip_unless_ci(reason: str) -> None:
    if reason and os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but a prerequisite is missing: {reason}", pytrace=False)
    if reason:
        pytest.skip(reason)


def clean_ipvs(device: str = "kube-ipvs0") -> None:
    """The VM is throw-away: start every test from an empty IPVS table, no dummy device, and
    none of ipvsproxy's iptables chains, ipsets or nftables table (an agent leaves its rules
    in place).

    Runs twice per test, and every process costs a lot under emulation: look first
    (/proc, /sys and one save per tool), clean only what is there.
    """
    from ipvsproxy.fallback import IptablesKernel
    from ipvsproxy.fallback import chains as fallback_rules
    from ipvsproxy.firewall import rules as firewall_rules
    from ipvsproxy.firewall import sets as firewall_sets
    from ipvsproxy.firewall.host_firewall import Firewall

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
    # one process whether or not the table is there (absent: nft fails, and that is all)
    subprocess.run(["nft", "delete", "table", "inet", "ipvsproxy"], capture_output=True)
    if any(prefix in seen for prefix in ours):
        firewall = Firewall()
        firewall.check()
        firewall.cleanup()
        fallback = IptablesKernel()
        fallback.check()
        fallback.cleanup()


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
