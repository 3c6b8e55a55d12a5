"""This host's own addresses over rtnetlink, in a throw-away namespace (issue 15 item 7):
every link's but the dummy device's (VIPs), no loopback, no link-local; an address added or
removed is seen by the next read."""

from __future__ import annotations

import subprocess
from ipaddress import ip_address

import pytest

from integration.lab import inside
from ipvsproxy.netlink.links import node_addresses

pytestmark = pytest.mark.netns


def ip(netns: str, *args: str) -> None:
    subprocess.run(["ip", "-n", netns, *args], check=True)


def test_node_addresses_leave_out_the_dummy_device_loopback_and_link_local(netns: str) -> None:
    ip(netns, "link", "set", "lo", "up")
    ip(netns, "link", "add", "eth0", "type", "veth", "peer", "name", "kube-ipvs0")  # a VIP holder
    ip(netns, "link", "set", "eth0", "up")
    ip(netns, "addr", "add", "192.168.7.10/24", "dev", "eth0")
    ip(netns, "addr", "add", "2001:db8:7::10/64", "dev", "eth0", "nodad")
    ip(netns, "addr", "add", "fe80::7/64", "dev", "eth0", "nodad")
    ip(netns, "addr", "add", "10.96.0.10/32", "dev", "kube-ipvs0")
    with inside(netns):
        found = node_addresses("kube-ipvs0")
        assert set(found) == {ip_address("192.168.7.10"), ip_address("2001:db8:7::10")}
        ip(netns, "addr", "add", "10.1.2.3/32", "dev", "eth0")
        ip(netns, "addr", "del", "192.168.7.10/24", "dev", "eth0")
        assert set(node_addresses("kube-ipvs0")) == {
            ip_address("10.1.2.3"),
            ip_address("2001:db8:7::10"),
        }
        # no dummy device at all: every address of the other links counts
        assert ip_address("10.96.0.10") in node_addresses("no-such-device")
