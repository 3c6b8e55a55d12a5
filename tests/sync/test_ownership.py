"""Which virtual servers ipvsproxy may delete: the NodePort range's edges and the rule as
`ownership_for` builds it from the configuration (scripts/mutants)."""

from __future__ import annotations

from ipaddress import ip_address, ip_network

import pytest

from ipvsproxy.config import Config
from ipvsproxy.model import IPAddress, Proto, VSKey
from ipvsproxy.sync.ownership import Ownership, ownership_for

NODE = ip_address("192.168.0.10")
NOTHING_BOUND: frozenset[IPAddress] = frozenset()


def key(port: int, address=NODE) -> VSKey:
    return VSKey(ip_address(address), port, Proto.TCP)


@pytest.mark.parametrize(
    ("port", "claimed"),
    [(29999, False), (30000, True), (30001, True), (32766, True), (32767, True), (32768, False)],
)
def test_node_ports_are_claimed_inside_the_default_range_edges_included(port, claimed):
    own = Ownership(nodeport_addresses=frozenset({NODE}))
    assert own.claims(key(port), NOTHING_BOUND) is claimed


@pytest.mark.parametrize(
    ("port", "claimed"), [(19999, False), (20000, True), (20100, True), (20101, False)]
)
def test_a_configured_node_port_range_comes_from_the_configuration(port, claimed):
    config = Config(node_name="node-a", nodeport_range=(20000, 20100))
    assert ownership_for(config, (NODE,)).claims(key(port), NOTHING_BOUND) is claimed


def test_node_ports_only_on_node_addresses_that_nodeport_addresses_selects():
    config = Config(node_name="node-a", nodeport_cidrs=(ip_network("192.168.0.0/24"),))
    other = ip_address("10.0.0.5")
    own = ownership_for(config, (NODE, other))
    assert own.claims(key(30080), NOTHING_BOUND)
    assert not own.claims(key(30080, other), NOTHING_BOUND)  # an address NodePorts skip
    assert not own.claims(key(30080, "192.168.0.11"), NOTHING_BOUND)  # not this node's


def test_without_nodeport_addresses_every_node_address_has_node_ports():
    own = ownership_for(Config(node_name="node-a"), (NODE, ip_address("fd00::10")))
    assert own.claims(key(30080), NOTHING_BOUND)
    assert own.claims(key(30080, "fd00::10"), NOTHING_BOUND)


def test_service_and_exclude_cidrs_come_from_the_configuration():
    config = Config(
        node_name="node-a",
        service_cidrs=(ip_network("10.96.0.0/16"),),
        exclude_cidrs=(ip_network("10.96.5.0/24"),),
    )
    own = ownership_for(config, ())
    assert own.claims(key(80, "10.96.0.10"), NOTHING_BOUND)
    assert not own.claims(key(80, "10.96.5.5"), NOTHING_BOUND)
    assert not own.claims(key(80, "10.96.5.5"), frozenset({ip_address("10.96.5.5")}))


@pytest.mark.parametrize("port", [30000, 30080, 32767])
def test_where_a_record_is_kept_the_node_port_range_claims_nothing(port):
    """With the record (IPVS with its firewall sets, the fallback's chains) a node-address
    virtual server is ipvsproxy's only when recorded: the range proves nothing."""
    own = Ownership(nodeport_addresses=frozenset({NODE}), range_claims=False)
    assert not own.claims(key(port), NOTHING_BOUND)
    assert Ownership(nodeport_addresses=frozenset({NODE}), recorded={key(port)}).claims(
        key(port), NOTHING_BOUND
    )
