"""The firewall's sets (firewall/sets.py). An externalIP that is one of the node's own
addresses is served, but not bound to the dummy device and not a VIP, so
the firewall's port filter (VIPS / SERVICE-PORTS) does not fence the node's other ports
(SSH, kubelet, apiserver). Local addresses are told apart by family."""

from __future__ import annotations

from ipaddress import ip_address

from ipvsproxy.firewall.sets import entries_for, wanted
from ipvsproxy.model import (
    Proto,
    RSKey,
    VSKey,
)
from tests.factories import ep, node, port, service, slice_, translate


def test_an_external_ip_on_the_node_is_served_but_not_fenced():
    desired = translate(
        node(addresses=("192.168.0.10",)),
        service(
            "web",
            cluster_ips=("10.96.0.10",),
            ports=[port("http", 80)],
            externalIPs=["192.168.0.10", "198.51.100.7"],
        ),
        slice_("web", endpoints=[ep("10.244.0.1")]),
    )
    served = {str(k.address) for k in desired.state.services}
    assert served == {"10.96.0.10", "192.168.0.10", "198.51.100.7"}
    assert {str(a) for a in desired.state.bound} == {"10.96.0.10", "198.51.100.7"}
    sets = wanted(desired.state, desired.access, local=desired.local_endpoints).sets
    assert sets["IPVSPROXY-VIPS"][2] == {"10.96.0.10", "198.51.100.7"}
    assert "192.168.0.10,tcp:80" not in sets["IPVSPROXY-SERVICE-PORTS"][2]
    assert "198.51.100.7,tcp:80" in sets["IPVSPROXY-SERVICE-PORTS"][2]


# ---- entries by family -------------------------------------------------------------------


LOOP_BACK = "IPVSPROXY-LOOP-BACK"


def test_local_addresses_are_told_apart_by_family():
    """::a00:1 has the integer of 10.0.0.1 but is not it: no hairpin entry for it."""
    local = frozenset({ip_address("10.0.0.1")})
    for endpoint, vip, entry in (
        ("10.0.0.1", "10.96.0.1", "10.0.0.1,tcp:80,10.0.0.1"),
        ("::a00:1", "fd00:96::1", None),  # not local: no hairpin entry
    ):
        key = VSKey(ip_address(vip), 80, Proto.TCP)
        dests = [RSKey(ip_address(endpoint), 80)]
        made = entries_for(key, None, dests, local=local, bound=True)
        assert {e for name, e in made if name.startswith(LOOP_BACK)} == ({entry} - {None})
