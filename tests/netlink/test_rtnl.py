"""Address and link changes over rtnetlink: golden bytes against pyroute2's own encoding of the same
requests (no socket, no root), dump parsing, and failures mapped back to their operation
inside one batch (a scripted kernel)."""

from __future__ import annotations

import errno
import socket
import struct
import types
from collections.abc import Callable
from ipaddress import ip_address
from typing import Any

import pytest
from pyroute2.iproute.linux import get_arguments_processor, get_dump_filter
from pyroute2.netlink.nlsocket import NetlinkRequest
from pyroute2.netlink.rtnl.ifaddrmsg import ifaddrmsg
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

from ipvsproxy.errors import AlreadyExists, KernelError, KernelUnavailable, NotFound, Unsupported
from ipvsproxy.model import BindAddress, IPAddress, UnbindAddress
from ipvsproxy.netlink import codec, rtnl
from ipvsproxy.netlink.ipvs_kernel import NetlinkKernel
from ipvsproxy.netlink.links import DummyDevice
from ipvsproxy.netlink.rtnl import RtnlSocket
from tests.support import ScriptedKernel, error


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


def pyroute2_link(command: str, seq: int, **kwarg: Any) -> bytes:
    """What pyroute2's IPRoute.link(command, **kwarg) sends (link_lookup(ifname=) is
    link("get", ifname=)), built by its own request path."""
    sock = types.SimpleNamespace(addr_pool=None, status={"nlm_echo": False}, epid=0, marshal=None)
    command_map = {
        "get": (rtnl.RTM_GETLINK, "get"),
        "add": (rtnl.RTM_NEWLINK, "create"),
        "del": (rtnl.RTM_DELLINK, "req"),
    }
    _, kwarg = get_dump_filter("link", command, kwarg)
    arguments = get_arguments_processor("link", command, kwarg)
    request = NetlinkRequest(sock, ifinfmsg(), command, command_map, None, arguments, msg_seq=seq)
    request.msg["header"]["pid"] = 0
    request.msg.encode()
    return bytes(request.msg.data)


@pytest.mark.parametrize("name", ["kube-ipvs0", "d", "sockopt0", "a-15-chars-name"])
def test_link_requests_are_pyroute2s_byte_for_byte(name):
    kernel = LinkKernel(None)
    sock = rtnl_socket(kernel, seq=41)
    assert sock.link_index(name) is None
    sock.create_link(name, "dummy")
    assert sock.link_index(name) == 11
    assert kernel._queue == []  # read up to its ack: nothing left for the next request
    sock.delete_link(11)
    assert kernel.link_requests == [
        pyroute2_link("get", 42, ifname=name),
        pyroute2_link("add", 43, ifname=name, kind="dummy"),
        pyroute2_link("get", 44, ifname=name),
        pyroute2_link("del", 45, index=11),
    ]


@pytest.mark.parametrize(
    ("code", "kind"),
    [(errno.EEXIST, AlreadyExists), (errno.EPERM, KernelUnavailable),
     (errno.EOPNOTSUPP, Unsupported), (errno.ENODEV, NotFound), (errno.EINVAL, KernelError)],
)  # fmt: skip
def test_a_refused_create_is_mapped_like_an_address_error(code, kind):
    dev = device(LinkKernel(None, refuse_create=code))
    with pytest.raises(kind, match=f"create dummy device kube-ipvs0: {errno.errorcode[code]}"):
        dev.index(create=True)


def test_a_missing_device_is_looked_up_again_created_once_and_deleted():
    links = LinkKernel(None)
    dev = device(links)
    assert dev.index(create=False) is None
    assert dev.delete() is False
    assert dev.index(create=True) == 11
    assert dev.index(create=True) == 11  # cached: no more requests
    assert links.created == 1
    assert len(links.link_requests) == 5  # get, get, get (missing), add, get
    assert dev.delete() is True
    assert links.index is None
    assert dev.addresses() == frozenset()  # looked up again: gone, no dump
    assert dev.index(create=True) == 12


def test_a_device_deleted_before_our_delete_is_not_found():
    links = LinkKernel(7)
    dev = device(links)
    assert dev.index(create=False) == 7
    links.index = None  # deleted behind our back
    with pytest.raises(NotFound, match="delete kube-ipvs0: ENODEV"):
        dev.delete()
    assert dev.delete() is False  # looked up again


def dumped(index: int, family: int, address: str, **attrs: str) -> bytes:
    msg = ifaddrmsg()
    msg["family"], msg["prefixlen"], msg["index"] = family, 32 if family == 2 else 128, index
    msg["attrs"] = [("IFA_ADDRESS", address), *((k, v) for k, v in attrs.items())]
    msg["header"]["type"], msg["header"]["flags"] = rtnl.RTM_NEWADDR, codec.NLM_F_MULTI
    msg.encode()
    return bytes(msg.data)


def dumping(*chunks: bytes) -> rtnl.RtnlSocket:
    """An RtnlSocket whose address dumps answer `chunks` (no socket)."""
    sock = rtnl.RtnlSocket.__new__(rtnl.RtnlSocket)
    sock._parsed = {}
    sock.dump = lambda kind, body: list(chunks)  # type: ignore[method-assign]
    return sock


DONE = struct.pack("=IHHIIi", 20, codec.NLMSG_DONE, 2, 0, 0, 0)


def test_a_dump_keeps_the_device_s_addresses_only():
    chunk = (
        dumped(7, socket.AF_INET, "10.96.0.1", IFA_LOCAL="10.96.0.1", IFA_LABEL="kube-ipvs0")
        + dumped(1, socket.AF_INET, "127.0.0.1")  # another link (no strict dump checking)
        + dumped(7, socket.AF_INET6, "fd00:96::1")
        + DONE
    )
    want = [ip_address("10.96.0.1"), ip_address("fd00:96::1")]
    assert dumping(chunk).all_addresses(7) == want


def test_a_dump_of_every_link_keeps_every_address_but_the_excluded_link_s():
    chunk = (
        dumped(7, socket.AF_INET, "10.96.0.1")
        + dumped(1, socket.AF_INET, "127.0.0.1")
        + dumped(2, socket.AF_INET6, "fd00::2")
        + DONE
    )
    assert dumping(chunk).all_addresses() == [
        ip_address("10.96.0.1"), ip_address("127.0.0.1"), ip_address("fd00::2")
    ]  # fmt: skip
    assert dumping(chunk).all_addresses(exclude=7) == [
        ip_address("127.0.0.1"), ip_address("fd00::2")
    ]  # fmt: skip


def test_an_unchanged_message_is_not_parsed_again_a_changed_one_is():
    one, two = dumped(7, socket.AF_INET, "10.96.0.1"), dumped(7, socket.AF_INET, "10.96.0.2")
    sock = dumping(one + two + DONE)
    first = sock.all_addresses(7)
    again = sock.all_addresses(7)
    assert again == first
    assert all(a is b for a, b in zip(again, first, strict=True))
    sock.dump = lambda kind, body: [one + dumped(7, socket.AF_INET, "10.96.0.3") + DONE]  # type: ignore[method-assign]
    assert sock.all_addresses(7) == [ip_address("10.96.0.1"), ip_address("10.96.0.3")]
    assert len(sock._parsed) == 2  # only the last dump's messages are kept


class LinkKernel(ScriptedKernel):
    """A scripted kernel with one link, `index` (None: missing): RTM_GETLINK by name,
    RTM_NEWLINK and RTM_DELLINK answered as the kernel does (`refuse_create`: the errno of
    every create); address requests as ScriptedKernel."""

    def __init__(
        self,
        index: int | None,
        answer: Callable[[int, int, memoryview], int] = lambda *_: 0,
        refuse_create: int = 0,
    ) -> None:
        super().__init__(answer)
        self.index, self.created, self.refuse_create = index, 0, refuse_create
        self.link_requests: list[bytes] = []

    def send(self, data: bytes) -> int:
        kind, flags, seq, payload = next(codec.messages(data))
        if kind not in (rtnl.RTM_GETLINK, rtnl.RTM_NEWLINK, rtnl.RTM_DELLINK):
            return super().send(data)
        assert len(list(codec.messages(data))) == 1  # a link request goes alone
        self.link_requests.append(data)
        assert flags & codec.NLM_F_ACK
        code = self._link(kind, payload)
        if kind == rtnl.RTM_GETLINK and not code:  # the link, then the ack: two datagrams
            self._queue.append(
                struct.pack("=IHHII", 32, rtnl.RTM_NEWLINK, 0, seq, 0)
                + struct.pack("=BxHiII", 0, 1, self.index, 0, 0)
            )
        self._queue.append(error(seq, code))
        return len(data)

    def _link(self, kind: int, payload: memoryview) -> int:
        if kind == rtnl.RTM_NEWLINK:
            if self.refuse_create:
                return self.refuse_create
            if self.index is not None:
                return errno.EEXIST
            self.created += 1
            self.index = 10 + self.created
            return 0
        if self.index is None:
            return errno.ENODEV
        if kind == rtnl.RTM_DELLINK:
            assert struct.unpack_from("=i", payload, 4)[0] == self.index
            self.index = None
        return 0


def device(kernel: LinkKernel) -> DummyDevice:
    dev = DummyDevice.__new__(DummyDevice)
    dev.name, dev._index, dev._events, dev._bound = "kube-ipvs0", None, None, None
    dev._rtnl = rtnl_socket(kernel)
    return dev


def scripted_kernel(refuse: dict[int, int]) -> NetlinkKernel:
    kernel = NetlinkKernel.__new__(NetlinkKernel)
    kernel._device = device(LinkKernel(7, lambda position, *_: refuse.get(position, 0)))
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

    links = LinkKernel(None, answer)  # deleted behind our back ...
    dev = device(links)
    dev._index = 7  # ... after we looked it up
    a, b, c = (ip_address(f"10.96.0.{n}") for n in (1, 2, 3))
    errors = dev.change([(a, True), (b, False), (c, True)])
    assert links.created == 1
    assert errors[0] is None
    assert errors[2] is None
    assert isinstance(errors[1], NotFound)  # an unbind is not retried: nothing to unbind
    assert dev.index(create=False) == 11


def test_unbinds_without_a_device_fail_without_a_request_and_binds_create_it():
    links = LinkKernel(None)
    dev = device(links)
    a = ip_address("10.96.0.1")
    (failed,) = dev.change([(a, False)])
    assert isinstance(failed, NotFound)
    assert links.sends == []
    assert links.created == 0
    assert dev.change([(a, True), (a, False)]) == [None, None]
    assert links.created == 1


def test_a_device_that_cannot_be_created_fails_every_change():
    dev = device(LinkKernel(None, refuse_create=errno.EPERM))
    errors = dev.change([(ip_address("10.96.0.1"), True), (ip_address("10.96.0.2"), True)])
    assert len(errors) == 2
    assert all(isinstance(e, KernelUnavailable) and "create dummy device" in str(e) for e in errors)
    assert "EPERM" in str(errors[0])
