"""Which of kube-proxy's chains, sets and nftables tables `cleanup --kube-proxy` selects, in
each of its modes (pure, and over scripted commands; the real thing is in
integration/netns/test_kpcleanup.py and integration/ipvs/test_migration.py)."""

from __future__ import annotations

import pytest

from ipvsproxy.config import Config
from ipvsproxy.kpcleanup import ALL_SETS, SETS, cleanup_kube_proxy, nft_tables, selected
from tests.support import ScriptedCommands

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

# iptables mode's nat and filter tables as v1.36 writes them (pkg/proxy/iptables/proxier.go),
# beside kubelet's chains and one of a CNI plugin whose name starts like kube-proxy's
IPTABLES_NAT = """*nat
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-SVC-TCOU7JCQXEZGVUNU - [0:0]
:KUBE-SVL-TCOU7JCQXEZGVUNU - [0:0]
:KUBE-EXT-TCOU7JCQXEZGVUNU - [0:0]
:KUBE-FW-TCOU7JCQXEZGVUNU - [0:0]
:KUBE-SEP-GFJH72YCBKBFB6OG - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-SERVICES-CNI - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A POSTROUTING -j KUBE-SERVICES-CNI
-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-TCOU7JCQXEZGVUNU
-A KUBE-SVC-TCOU7JCQXEZGVUNU -j KUBE-SEP-GFJH72YCBKBFB6OG
-A KUBE-SEP-GFJH72YCBKBFB6OG -p tcp -m tcp -j DNAT --to-destination 10.244.1.2:8000
COMMIT
"""
IPTABLES_FILTER = """*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A INPUT -m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-A INPUT -j KUBE-FIREWALL
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A OUTPUT -j KUBE-FIREWALL
COMMIT
"""  # noqa: E501


def test_kube_proxys_ipvs_chains_and_every_jump_into_them():
    saved = selected(SAVE, "nat")
    assert set(saved.chains) == {"KUBE-SERVICES", "KUBE-MARK-MASQ", "KUBE-SVC-ABC"}
    assert set(saved.jumps) == {
        ("PREROUTING", '-m comment --comment "kubernetes service portals" -j KUBE-SERVICES'),
    }  # KUBE-MARK-DROP is kubelet's (older kubelets made it): it and its jump stay


def test_iptables_modes_chains_by_name_and_service_prefix():
    nat = selected(IPTABLES_NAT, "nat")
    assert set(nat.chains) == {
        "KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ",
        "KUBE-PROXY-CANARY", "KUBE-SVC-TCOU7JCQXEZGVUNU", "KUBE-SVL-TCOU7JCQXEZGVUNU",
        "KUBE-EXT-TCOU7JCQXEZGVUNU", "KUBE-FW-TCOU7JCQXEZGVUNU", "KUBE-SEP-GFJH72YCBKBFB6OG",
    }  # fmt: skip
    assert {chain for chain, _ in nat.jumps} == {"PREROUTING", "OUTPUT", "POSTROUTING"}
    assert len(nat.jumps) == 3  # the CNI's KUBE-SERVICES-CNI and its jump stay
    filter_ = selected(IPTABLES_FILTER, "filter")
    assert set(filter_.chains) == {
        "KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES", "KUBE-FORWARD", "KUBE-NODEPORTS",
        "KUBE-PROXY-FIREWALL", "KUBE-PROXY-CANARY",
    }  # fmt: skip
    assert [chain for chain, _ in filter_.jumps] == ["INPUT", "INPUT", "INPUT", "FORWARD"]


def test_service_prefixes_count_in_nat_only():
    text = "*filter\n:KUBE-SVC-ABC - [0:0]\n:KUBE-PROXY-CANARY - [0:0]\nCOMMIT\n"
    assert set(selected(text, "filter").chains) == {"KUBE-PROXY-CANARY"}
    mangle = "*mangle\n:KUBE-PROXY-CANARY - [0:0]\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n"
    assert set(selected(mangle, "mangle").chains) == {"KUBE-PROXY-CANARY"}


def test_every_set_of_both_families_as_kube_proxy_names_it():
    assert len(SETS) == 17
    assert len(ALL_SETS) == 34
    assert all(len(name) <= 31 for name in ALL_SETS)
    # the two IPv6 names kube-proxy cuts to 31 characters (pkg/proxy/ipvs/ipset.go)
    assert {"KUBE-6-LOAD-BALANCER-SOURCE-CID", "KUBE-6-NODE-PORT-LOCAL-SCTP-HAS"} <= ALL_SETS
    assert {"KUBE-CLUSTER-IP", "KUBE-6-CLUSTER-IP", "KUBE-6-LOAD-BALANCER-SOURCE-IP"} <= ALL_SETS
    assert "KUBE-FIREWALL" not in ALL_SETS


def test_nft_tables_of_kube_proxy_only():
    listed = (
        "table ip kube-proxy\ntable ip6 kube-proxy\ntable inet firewalld\n"
        "table inet kube-proxy\ntable ip nat\ntable bridge kube-proxy\n"
    )
    assert nft_tables(listed) == [("ip", "kube-proxy"), ("ip6", "kube-proxy")]


@pytest.mark.parametrize("dry_run", [True, False])
def test_nftables_modes_tables_go_in_one_transaction(dry_run, monkeypatch):
    monkeypatch.setattr("ipvsproxy.kpcleanup.shutil.which", lambda t: t if t == "nft" else None)
    commands = ScriptedCommands(
        {("nft", "list", "tables"): "table ip kube-proxy\ntable inet firewalld\n"
         "table ip6 kube-proxy\n", ("nft", "-f", "-"): ""}
    )  # fmt: skip
    removed = cleanup_kube_proxy(Config(), dry_run=dry_run, commands=commands)  # type: ignore[arg-type]
    assert removed == ["nft: table ip kube-proxy", "nft: table ip6 kube-proxy"]
    writes = [(args, stdin) for args, stdin in commands.ran if args[:2] == ["nft", "-f"]]
    expected = "delete table ip kube-proxy\ndelete table ip6 kube-proxy\n"
    assert writes == ([] if dry_run else [(["nft", "-f", "-"], expected)])


def test_without_nft_the_clean_up_says_it_did_not_look_for_nftables_mode(monkeypatch, caplog):
    """An image without nft once reported 'nothing of kube-proxy's found' beside kube-proxy's
    nftables tables, which went on DNATing new connections to deleted pods."""
    monkeypatch.setattr("ipvsproxy.kpcleanup.shutil.which", lambda tool: None)
    removed = cleanup_kube_proxy(Config(), dry_run=True, commands=ScriptedCommands({}))  # type: ignore[arg-type]
    assert removed == []
    assert "nft is not installed: kube-proxy's nftables tables" in caplog.text
