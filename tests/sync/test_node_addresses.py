"""NodePort addresses as kube-proxy takes them: this host's own addresses
(not the Node object's), filtered by `--nodeport-addresses` per IP family (a family with no
CIDR keeps all of its addresses), or the Node's primary IP per family with `primary`; an
address added to or removed from the host is followed by the next full pass."""

from __future__ import annotations

from ipaddress import ip_address, ip_network
from typing import Any

from click.testing import CliRunner

from ipvsproxy.config import Config
from ipvsproxy.model import IPAddress
from ipvsproxy.proxier import Proxier
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, Tracker
from ipvsproxy.testing import FakeKernel
from tests.factories import ep, parse_node, port, service, slice_
from tests.support import driven_agent, next_run

V4, V6 = ip_address("192.168.0.10"), ip_address("2001:db8::10")


def node_object(*addresses: tuple[str, str]) -> Any:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": "node-a"},
        "status": {"addresses": [{"type": t, "address": a} for t, a in addresses]},
    }


def nodeports(kernel: FakeKernel) -> set[str]:
    return {str(k.address) for k in kernel.state.services if k.port == 30080}


def dual_stack_nodeport() -> list[Any]:
    svc = service(
        "np",
        type="NodePort",
        cluster_ips=("10.96.0.5", "fd00::5"),
        ports=[port("http", 80, node_port=30080)],
    )
    svc["spec"]["ipFamilies"] = ["IPv4", "IPv6"]
    return [svc, slice_("np", endpoints=[ep("10.244.0.1")])]


def sync(config: Config, host: Any, node: Any) -> tuple[FakeKernel, Proxier, Tracker]:
    tracker = Tracker(required=(SERVICE, SLICE, NODE), node_name="node-a")
    svc, endpoints = dual_stack_nodeport()
    tracker.replace(NODE, [node])
    tracker.replace(SERVICE, [svc])
    tracker.replace(SLICE, [endpoints])
    kernel = FakeKernel()
    proxier = Proxier(kernel=kernel, config=config, node_addresses=lambda: host[0])
    proxier.desired.refresh_host()
    proxier.sync(tracker.take(), full=True)
    return kernel, proxier, tracker


def test_nodeports_listen_on_the_hosts_addresses_not_the_node_objects():
    node = node_object(("InternalIP", "172.16.0.1"))  # not on this host (a stale object)
    host = [(V4, ip_address("10.0.0.7"))]
    kernel, _, _ = sync(Config(node_name="node-a"), host, node)
    assert nodeports(kernel) == {"192.168.0.10", "10.0.0.7"}


def test_nodeport_cidrs_filter_per_family_a_family_without_one_keeps_all():
    host = [(V4, ip_address("10.0.0.7"), V6)]
    config = Config(node_name="node-a", nodeport_cidrs=(ip_network("10.0.0.0/8"),))
    kernel, _, _ = sync(config, host, node_object())
    assert nodeports(kernel) == {"10.0.0.7", "2001:db8::10"}  # IPv6: no CIDR, all of it
    assert config.selects_nodeport_address(V6)
    assert not config.selects_nodeport_address(V4)


def test_primary_means_the_nodes_primary_ip_per_family():
    node = node_object(
        ("ExternalIP", "203.0.113.9"),
        ("InternalIP", "192.168.0.10"),
        ("InternalIP", "192.168.0.11"),
        ("ExternalIP", "2001:db8::99"),
    )
    assert parse_node(node).primary == (V4, ip_address("2001:db8::99"))
    host = [(V4, ip_address("192.168.0.11"), ip_address("10.0.0.7"))]
    kernel, _, _ = sync(Config(node_name="node-a", nodeport_primary=True), host, node)
    assert nodeports(kernel) == {"192.168.0.10", "2001:db8::99"}


def test_the_primary_keyword_on_the_command_line():
    from ipvsproxy.cli import main

    result = CliRunner().invoke(
        main, ["diff", "--nodeport-addresses", "primary", "--manifests", "/nonexistent"]
    )
    assert "--nodeport-addresses" not in result.output  # accepted, unlike a bad CIDR
    bad = CliRunner().invoke(
        main, ["diff", "--nodeport-addresses", "primary,10.0.0.0/8", "--manifests", "/x"]
    )
    assert bad.exit_code == 2
    assert "--nodeport-addresses" in bad.output


def test_an_address_added_to_the_host_gets_its_nodeports_at_the_next_full_pass():
    agent, runner, clock = driven_agent()
    host: list[tuple[IPAddress, ...]] = [(V4,)]
    agent.sync.proxier.desired.node_addresses = lambda: host[0]
    svc, endpoints = dual_stack_nodeport()
    agent.tracker.replace(NODE, [node_object(("InternalIP", "192.168.0.10"))])
    agent.feed(svc, endpoints)
    runner.run_if_due()
    assert nodeports(agent.kernel) == {"192.168.0.10"}
    host[0] = (V4, ip_address("10.0.0.7"))  # an address added: nothing in the API changed
    clock.now += next_run(runner, clock)  # the periodic full pass
    runner.run_if_due()
    assert nodeports(agent.kernel) == {"192.168.0.10", "10.0.0.7"}
    host[0] = (ip_address("10.0.0.7"),)  # and one removed
    clock.now += next_run(runner, clock)
    runner.run_if_due()
    assert nodeports(agent.kernel) == {"10.0.0.7"}


def test_the_same_host_addresses_in_another_order_are_no_change():
    """A dump's order is no change of the host: no Service is translated again for it."""
    found: list[tuple[IPAddress, ...]] = [(V4, V6), (V6, V4)]
    proxier = Proxier(
        kernel=FakeKernel(), config=Config(node_name="node-a"), node_addresses=lambda: found[0]
    )
    assert proxier.desired.refresh_host()  # the first read
    found.pop(0)
    assert not proxier.desired.refresh_host()
    found.append((V4,))
    found.pop(0)
    assert proxier.desired.refresh_host()  # one lost


def test_only_a_node_change_the_translation_reads_hands_over_every_service():
    """Eligibility (deletion, the autoscaler's taint) is the health check's alone."""
    tracker = Tracker(node_name="node-a")
    tracker.replace(SERVICE, [service("web"), service("db", cluster_ips=("10.96.0.11",))])
    tracker.replace(NODE, [node_object(("InternalIP", "192.168.0.10"))])
    assert tracker.take().everything  # the first take
    deleting = node_object(("InternalIP", "192.168.0.10"))
    deleting["metadata"]["deletionTimestamp"] = "2026-11-26T00:00:00Z"
    tracker.replace(NODE, [deleting])
    changes = tracker.take()
    assert not changes.everything
    assert changes.services == {}
    assert changes.node is not None
    assert not changes.node.eligible  # the health check still sees it
    tracker.replace(NODE, [node_object(("InternalIP", "192.168.0.11"))])
    assert len(tracker.take().services) == 2  # a new address: every Service again
