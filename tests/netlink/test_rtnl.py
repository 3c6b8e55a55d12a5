"""Address changes over rtnetlink: golden bytes against pyroute2's own encoding of the same
requests (no socket, no root), dump parsing, and failures mapped back to their operation
inside one batch (a scripted kernel)."""

from __future__ import annotations

import errno
import socket
import struct
import types
from ipaddress import ip_address
from typing import Any

import pytest
from pyroute2.iproute.linux import get_arguments_processor, get_dump_filter
from pyroute2.netlink.nlsocket import NetlinkRequest
from pyroute2.netlink.rtnl.ifaddrmsg import ifaddrmsg

from ipvsproxy.errors import AlreadyExists, KernelError, NotFound
from ipvsproxy.model import BindAddress, IPAddress, UnbindAddress
from ipvsproxy.netlink import codec, rtnl
from ipvsproxy.netlink.kernel import NetlinkKernel
from ipvsproxy.netlink.links import DummyDevice
from ipvsproxy.netlink.rtnl import RtnlSocket
from tests.netlink.scripted import ScriptedKernel


def pyroute2_addr(command: str, seq: int, **kwarg: Any) -> bytes:
    """What pyroute2's IPRoute.addr(command, **kwarg) sends, built by its own request path."""
    sock = types.SimpleNamespace(addr_pool=None, status={"nlm_echo": False}, epid=0, marshal=None)
    command_map = {"add": (rtnl.RTM_NEWADDR, "create"), "del": (rtnl.RTM_DELADDR, "req")}
    _, kwarg = get_dump_filter("addr", command, kwarg)
    arguments = get_arguments_processor("addr", command, kwarg)
    request = NetlinkRequest(sock, ifaddrmsg(), command, command_map, None, arguments, msg_seq=seq)
    request.msg["header"]["pid"] = 0
    request.msg.encode()
    return bytes(request.msg.data)


def rtnl_socket(kernel: ScriptedKernel, seq: int = 0) -> RtnlSocket:
    sock = RtnlSocket.__new__(RtnlSocket)
    sock._sock, sock._seq, sock._recv = kernel, seq, bytearray(65536)  # type: ignore[assignment]
    return sock


@pytest.mark.parametrize("add", [True, False])
@pytest.mark.parametrize("address", ["10.96.0.10", "fd00:96::60", "255.255.255.255", "::"])
def test_one_address_change_is_pyroute2s_request_byte_for_byte(address, add):
    """A batch of one asks for the ack, as every pyroute2 request does: same bytes."""
    kernel = ScriptedKernel(lambda *_: 0)
    addr = ip_address(address)
    prefix = 32 if addr.version == 4 else 128
    nodad = {"flags": rtnl.IFA_F_NODAD} if addr.version == 6 and add else {}
    theirs = pyroute2_addr(
        "add" if add else "del", 42, index=7, address=address, prefixlen=prefix, **nodad
    )
    assert rtnl_socket(kernel, seq=41).change(7, [(addr, add)]) == [0]
    assert kernel.sends == [theirs]


def test_a_batch_acks_only_its_last_request():
    kernel = ScriptedKernel(lambda *_: 0)
    changes = [(ip_address(f"10.96.0.{n}"), n % 2 == 0) for n in range(1, 6)]
    rtnl_socket(kernel).change(3, changes)
    (sent,) = kernel.sends
    flags = [flags for _, flags, _, _ in codec.messages(sent)]
    assert [bool(f & codec.NLM_F_ACK) for f in flags] == [False] * 4 + [True]
    theirs = [pyroute2_addr("add" if add else "del", 1, index=3, address=str(a), prefixlen=32)
              for a, add in changes]  # fmt: skip
    ours = [bytes(payload) for _, _, _, payload in codec.messages(sent)]
    assert ours == [theirs_one[16:] for theirs_one in theirs]  # bodies equal after nlmsghdr


def dumped(index: int, family: int, address: str, **attrs: str) -> bytes:
    msg = ifaddrmsg()
    msg["family"], msg["prefixlen"], msg["index"] = family, 32 if family == 2 else 128, index
    msg["attrs"] = [("IFA_ADDRESS", address), *((k, v) for k, v in attrs.items())]
    msg["header"]["type"], msg["header"]["flags"] = rtnl.RTM_NEWADDR, codec.NLM_F_MULTI
    msg.encode()
    return bytes(msg.data)


def test_a_dump_keeps_the_device_s_addresses_only():
    chunk = (
        dumped(7, socket.AF_INET, "10.96.0.1", IFA_LOCAL="10.96.0.1", IFA_LABEL="kube-ipvs0")
        + dumped(1, socket.AF_INET, "127.0.0.1")  # another link (no strict dump checking)
        + dumped(7, socket.AF_INET6, "fd00:96::1")
        + struct.pack("=IHHIIi", 20, codec.NLMSG_DONE, 2, 0, 0, 0)
    )
    assert rtnl.parse_addresses(chunk, 7) == [ip_address("10.96.0.1"), ip_address("fd00:96::1")]


class FakeLinks:
    """pyroute2's IPRoute as DummyDevice uses it: one link, `index` (None: missing)."""

    def __init__(self, index: int | None) -> None:
        self.index, self.created = index, 0

    def link_lookup(self, *, ifname: str) -> list[int]:
        return [] if self.index is None else [self.index]

    def link(self, command: str, **kwarg: object) -> None:
        assert command == "add"
        self.created += 1
        self.index = 10 + self.created


def device(kernel: ScriptedKernel, links: FakeLinks) -> DummyDevice:
    dev = DummyDevice.__new__(DummyDevice)
    dev.name, dev._index = "kube-ipvs0", None
    dev._ipr, dev._rtnl = links, rtnl_socket(kernel)
    return dev


def scripted_kernel(refuse: dict[int, int]) -> NetlinkKernel:
    kernel = NetlinkKernel.__new__(NetlinkKernel)
    kernel._device = device(ScriptedKernel(lambda position, *_: refuse.get(position, 0)),
                            FakeLinks(7))  # fmt: skip
    return kernel


def addresses(n: int) -> list[IPAddress]:
    return [ip_address(f"10.96.{i // 250}.{i % 250 + 1}") for i in range(n)] + [
        ip_address(f"fd00:96::{i:x}") for i in range(1, n // 10)
    ]


def test_a_refused_change_inside_a_batch_is_reported_for_its_operation():
    vips = addresses(3000)
    ops = [BindAddress(a) for a in vips] + [UnbindAddress(a) for a in vips[::7]]
    refuse = {0: errno.EEXIST, 1234: errno.EEXIST, len(vips) + 5: errno.EADDRNOTAVAIL}
    kernel = scripted_kernel(refuse)
    report = kernel.apply(ops)
    assert [f.op for f in report.failures] == [ops[0], ops[1234], ops[len(vips) + 5]]
    assert [type(f.error) for f in report.failures] == [AlreadyExists, AlreadyExists, NotFound]
    assert str(ops[1234].address) in str(report.failures[1].error)
    assert "EEXIST" in str(report.failures[1].error)
    assert report.applied == len(ops) - 3
    sends = kernel._device._rtnl._sock.sends  # type: ignore[attr-defined]
    assert len(sends) == 1  # ~3,300 requests (~170 KB): one send, not one per address


def test_a_device_deleted_since_the_lookup_is_created_again_once_for_binds():
    def answer(position: int, kind: int, payload: memoryview) -> int:
        index = struct.unpack_from("=I", payload, 4)[0]
        return errno.ENODEV if index == 7 else 0  # the first index no longer exists

    links = FakeLinks(None)  # deleted behind our back ...
    dev = device(ScriptedKernel(answer), links)
    dev._index = 7  # ... after we looked it up
    a, b, c = (ip_address(f"10.96.0.{n}") for n in (1, 2, 3))
    errors = dev.change([(a, True), (b, False), (c, True)])
    assert links.created == 1
    assert errors[0] is None
    assert errors[2] is None
    assert isinstance(errors[1], NotFound)  # an unbind is not retried: nothing to unbind
    assert dev.index(create=False) == 11


def test_unbinds_without_a_device_fail_without_a_request_and_binds_create_it():
    kernel = ScriptedKernel(lambda *_: 0)
    links = FakeLinks(None)
    dev = device(kernel, links)
    a = ip_address("10.96.0.1")
    (error,) = dev.change([(a, False)])
    assert isinstance(error, NotFound)
    assert kernel.sends == []
    assert links.created == 0
    assert dev.change([(a, True), (a, False)]) == [None, None]
    assert links.created == 1


def test_a_device_that_cannot_be_created_fails_every_change():
    class Refusing(FakeLinks):
        def link(self, command: str, **kwarg: object) -> None:
            from pyroute2.netlink.exceptions import NetlinkError

            raise NetlinkError(errno.EPERM)

    dev = device(ScriptedKernel(lambda *_: 0), Refusing(None))
    errors = dev.change([(ip_address("10.96.0.1"), True), (ip_address("10.96.0.2"), True)])
    assert len(errors) == 2
    assert all(isinstance(e, KernelError) and "create dummy device" in str(e) for e in errors)
