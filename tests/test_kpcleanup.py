"""Which of kube-proxy's chains `cleanup --kube-proxy` selects (pure; the real thing is in
integration/netns/test_kpcleanup.py and integration/ipvs/test_kpcleanup.py)."""

from __future__ import annotations

from ipvsproxy.kpcleanup import ALL_SETS, selected

SAVE = """*nat
:PREROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-MARK-DROP - [0:0]
:KUBE-SVC-ABC - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A PREROUTING -j KUBE-MARK-DROP
-A KUBE-SERVICES -j KUBE-MARK-MASQ
-A KUBE-SVC-ABC -j KUBE-MARK-MASQ
-A KUBE-SVC-ABC -j KUBE-MARK-DROP
COMMIT
"""


def test_kube_proxys_ipvs_chains_and_every_jump_into_them():
    saved = selected(SAVE, "nat")
    assert set(saved.chains) == {"KUBE-SERVICES", "KUBE-MARK-MASQ"}
    assert set(saved.jumps) == {
        ("PREROUTING", '-m comment --comment "kubernetes service portals" -j KUBE-SERVICES'),
        ("KUBE-SVC-ABC", "-j KUBE-MARK-MASQ"),  # iptables mode's chain stays, its jump goes
    }


def test_both_families_sets():
    assert {"KUBE-CLUSTER-IP", "KUBE-6-CLUSTER-IP", "KUBE-6-NODE-PORT-LOCAL-SCTP-HASH"} <= ALL_SETS
    assert "KUBE-FIREWALL" not in ALL_SETS
