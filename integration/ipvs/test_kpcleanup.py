"""`ipvsproxy cleanup --kube-proxy --including-ipvs` on the real IPVS kernel, in a throw-away
namespace laid out as kube-proxy's IPVS mode leaves a node (made with ip, ipvsadm, ipset and
iptables under kube-proxy's names): its virtual servers (a ClusterIP on kube-ipvs0, a
NodePort on the node's address that its KUBE-NODE-PORT-TCP set lists), kube-ipvs0, its chains
and sets go; a virtual server of another owner (also one on the node's address inside the
NodePort range), another chain and set stay. Without --including-ipvs the table stays."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator

import pytest

from integration.lab import IPVSPROXY

pytestmark = pytest.mark.vm

KUBE_RULES = """*nat
:KUBE-SERVICES - [0:0]
:KUBE-MARK-MASQ - [0:0]
:OTHER - [0:0]
-A PREROUTING -j KUBE-SERVICES
-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A POSTROUTING -j OTHER
COMMIT
"""


def sh(ns: str, *args: str, stdin: str | None = None) -> str:
    done = subprocess.run(
        ["ip", "netns", "exec", ns, *args], input=stdin, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def ns() -> Iterator[str]:
    name = f"ipvsp-kp{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        sh(name, "ip", "link", "set", "lo", "up")
        for link, address in (("kube-ipvs0", "10.96.0.10/32"), ("node0", "10.250.0.1/24")):
            sh(name, "ip", "link", "add", link, "type", "dummy")
            sh(name, "ip", "addr", "add", address, "dev", link)
        sh(name, "ip", "link", "set", "node0", "up")
        for args in (
            ["-A", "-t", "10.96.0.10:80", "-s", "rr"],
            ["-a", "-t", "10.96.0.10:80", "-r", "10.250.0.7:8080", "-m"],
            ["-A", "-t", "10.250.0.1:30080", "-s", "rr"],  # a NodePort
            ["-A", "-t", "10.250.0.1:30081", "-s", "rr"],  # in the range, kube-proxy's set no
            ["-A", "-t", "192.0.2.50:80", "-s", "wlc"],  # someone else's
        ):
            sh(name, "ipvsadm", *args)
        sh(name, "ipset", "create", "KUBE-CLUSTER-IP", "hash:ip,port")
        # kube-proxy's record of its NodePorts (ipsetInfo's kubeNodePortSetTCP)
        sh(name, "ipset", "create", "KUBE-NODE-PORT-TCP", "bitmap:port", "range", "0-65535")
        sh(name, "ipset", "add", "KUBE-NODE-PORT-TCP", "30080")
        sh(name, "ipset", "create", "other-owner", "hash:ip")
        sh(name, "iptables-restore", "--noflush", stdin=KUBE_RULES)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)


def table(ns: str) -> str:
    return sh(ns, "ipvsadm", "-S", "-n")


def test_kube_proxys_ipvs_layout_leaves_and_nothing_else(ns: str) -> None:
    before = table(ns)
    kept = sh(ns, IPVSPROXY, "cleanup", "--kube-proxy", "--dry-run")
    assert "would remove: ipset KUBE-CLUSTER-IP" in kept
    assert "IPVS" not in kept  # without --including-ipvs: left for ipvsproxy to take over
    dry = sh(ns, IPVSPROXY, "cleanup", "--kube-proxy", "--including-ipvs", "--dry-run")
    assert "would remove: IPVS: ipvsadm -D -t 10.96.0.10:80" in dry
    assert "would remove: IPVS: ipvsadm -D -t 10.250.0.1:30080" in dry
    assert "would remove: IPVS: the dummy device kube-ipvs0" in dry
    assert "192.0.2.50" not in dry
    assert "30081" not in dry  # in the NodePort range, but in no record: not kube-proxy's
    assert table(ns) == before

    sh(ns, IPVSPROXY, "cleanup", "--kube-proxy", "--including-ipvs", "--force")  # no agent
    after = table(ns)
    assert "192.0.2.50:80" in after
    assert "10.96.0.10" not in after
    assert "10.250.0.1:30080" not in after
    assert "10.250.0.1:30081" in after
    links = sh(ns, "ip", "-o", "link")
    assert "kube-ipvs0" not in links
    assert "node0" in links
    assert sh(ns, "ipset", "list", "-n").split() == ["other-owner"]
    rules = sh(ns, "iptables-save", "-t", "nat")
    assert "KUBE-" not in rules
    assert "-A POSTROUTING -j OTHER" in rules
