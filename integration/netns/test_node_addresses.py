"""This host's own addresses over rtnetlink, in a throw-away namespace:
every link's but the dummy device's (VIPs), no loopback, no link-local; an address added or
removed is seen by the next read."""

from __future__ import annotations

import subprocess
from ipaddress import ip_address

import pytest

from integration.lab import inside
from ipvsproxy.model import IPAddress
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


def test_addresses_are_read_again_only_after_the_kernel_announces_a_change(
    netns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AddressEvents (rtnetlink's multicast groups): an idle resync reads no address, an
    address added or removed (on any link, the dummy device's too) is read at the next."""
    from ipvsproxy.netlink import links
    from ipvsproxy.netlink.rtnl import AddressEvents

    ip(netns, "link", "add", "eth0", "type", "veth", "peer", "name", "kube-ipvs0")
    ip(netns, "addr", "add", "192.168.7.10/24", "dev", "eth0")
    ip(netns, "addr", "add", "10.96.0.10/32", "dev", "kube-ipvs0")
    reads: list[str] = []
    real = links.node_addresses

    def counted(dummy: str) -> tuple[IPAddress, ...]:
        reads.append(dummy)
        return real(dummy)

    monkeypatch.setattr(links, "node_addresses", counted)
    with inside(netns):  # node_addresses() opens its socket where it is called
        events = AddressEvents()
        host = links.NodeAddresses("kube-ipvs0")
        device = links.DummyDevice("kube-ipvs0")
        try:
            assert events.changed()  # the first look
            assert not events.changed()
            assert host() == (ip_address("192.168.7.10"),)
            assert device.addresses() == {ip_address("10.96.0.10")}
            assert host() == (ip_address("192.168.7.10"),)
            assert len(reads) == 1  # nothing changed: not read again
            ip(netns, "addr", "add", "10.96.0.11/32", "dev", "kube-ipvs0")  # behind our back
            ip(netns, "addr", "add", "192.168.7.11/24", "dev", "eth0")
            assert events.changed()
            assert not events.changed()
            assert device.addresses() == {ip_address("10.96.0.10"), ip_address("10.96.0.11")}
            assert set(host()) == {ip_address("192.168.7.10"), ip_address("192.168.7.11")}
            assert len(reads) == 2
            ip(netns, "addr", "del", "10.96.0.10/32", "dev", "kube-ipvs0")
            assert device.addresses() == {ip_address("10.96.0.11")}
        finally:
            events.close()
            host.close()
            device.close()
