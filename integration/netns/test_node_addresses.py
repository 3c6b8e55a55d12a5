"""This host's own addresses over rtnetlink, in a throw-away namespace (issue 15 item 7):
every link's but the dummy device's (VIPs), no loopback, no link-local; an address added or
removed is seen by the next read."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from ipaddress import ip_address

import pytest

from integration.lab import inside
from ipvsproxy.netlink.links import node_addresses

pytestmark = pytest.mark.netns


@pytest.fixture
def ns() -> Iterator[str]:
    name = f"ipvsp-a{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    yield name
    subprocess.run(["ip", "netns", "del", name], check=True)


def ip(ns: str, *args: str) -> None:
    subprocess.run(["ip", "-n", ns, *args], check=True)


def test_node_addresses_leave_out_the_dummy_device_loopback_and_link_local(ns: str) -> None:
    ip(ns, "link", "set", "lo", "up")
    ip(ns, "link", "add", "eth0", "type", "veth", "peer", "name", "kube-ipvs0")  # a VIP holder
    ip(ns, "link", "set", "eth0", "up")
    ip(ns, "addr", "add", "192.168.7.10/24", "dev", "eth0")
    ip(ns, "addr", "add", "2001:db8:7::10/64", "dev", "eth0", "nodad")
    ip(ns, "addr", "add", "fe80::7/64", "dev", "eth0", "nodad")
    ip(ns, "addr", "add", "10.96.0.10/32", "dev", "kube-ipvs0")
    with inside(ns):
        found = node_addresses("kube-ipvs0")
        assert set(found) == {ip_address("192.168.7.10"), ip_address("2001:db8:7::10")}
        ip(ns, "addr", "add", "10.1.2.3/32", "dev", "eth0")
        ip(ns, "addr", "del", "192.168.7.10/24", "dev", "eth0")
        assert set(node_addresses("kube-ipvs0")) == {
            ip_address("10.1.2.3"),
            ip_address("2001:db8:7::10"),
        }
        # no dummy device at all: every address of the other links counts
        assert ip_address("10.96.0.10") in node_addresses("no-such-device")
