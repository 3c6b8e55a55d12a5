"""A netlink socket that fails (ENOBUFS, EPERM, closed) surfaces as the project's errors,
the OSError chained, at every entry point; a failed construction leaks no socket.

The sockets are fakes: send()/recv() raise the OSError a real one would; nothing here
opens a netlink socket or needs root.
"""

from __future__ import annotations

import errno
import socket
import struct
from collections.abc import Callable
from ipaddress import ip_address
from typing import Any

import pytest

from ipvsproxy.errors import KernelError, KernelUnavailable
from ipvsproxy.firewall.ipset import SetCommand
from ipvsproxy.firewall.set_reader import SetReader
from ipvsproxy.firewall.set_writer import SetWriter
from ipvsproxy.model import (
    AddService,
    BindAddress,
    IpvsState,
    Op,
    Proto,
    VirtualServer,
    VSKey,
)
from ipvsproxy.netlink import codec
from ipvsproxy.netlink import ipvs_kernel as kernel_module
from ipvsproxy.netlink.genl import GenlSocket
from ipvsproxy.netlink.ipvs_kernel import NetlinkKernel
from ipvsproxy.netlink.links import DummyDevice
from ipvsproxy.netlink.rtnl import RtnlSocket

VS = VirtualServer(VSKey(ip_address("10.96.0.10"), 80, Proto.TCP))


class BrokenSocket:
    """A socket whose send() or recv() fails with `errno` (the other one never called)."""

    def __init__(self, code: int, *, on: str = "send") -> None:
        self.code, self.on, self.closed = code, on, False

    def _fail(self, call: str) -> None:
        if self.on == call:
            raise OSError(self.code, f"{call}: {errno.errorcode[self.code]}")
        raise AssertionError(f"{call}() on a socket whose {self.on}() failed")

    def send(self, data: bytes) -> int:
        if self.on == "recv":
            return len(data)
        self._fail("send")
        return 0

    def recv_into(self, buf: bytearray, *_: int) -> int:
        self._fail("recv")
        return 0

    def recv(self, *_: int) -> bytes:
        self._fail("recv")
        return b""

    def setsockopt(self, *_: object) -> None:
        pass

    def bind(self, _: object) -> None:
        if self.on == "bind":
            raise OSError(self.code, "bind")

    def close(self) -> None:
        self.closed = True


FAILURES = [
    pytest.param(errno.ENOBUFS, "send", KernelError, id="ENOBUFS-send"),
    pytest.param(errno.ENOBUFS, "recv", KernelError, id="ENOBUFS-recv"),
    pytest.param(errno.EBADF, "recv", KernelError, id="EBADF-recv"),
    pytest.param(errno.EPERM, "send", KernelUnavailable, id="EPERM-send"),
]


def genl_on(sock: Any) -> GenlSocket:
    genl = GenlSocket.__new__(GenlSocket)
    genl._sock, genl._seq, genl._recv, genl.family = sock, 0, bytearray(65536), 0x20
    return genl


def rtnl_on(sock: Any) -> RtnlSocket:
    rtnl = RtnlSocket.__new__(RtnlSocket)
    rtnl._sock, rtnl._seq, rtnl._recv = sock, 0, bytearray(65536)
    return rtnl


def device_on(sock: Any, index: int | None = 7) -> DummyDevice:
    dev = DummyDevice.__new__(DummyDevice)
    dev.name, dev._index, dev._rtnl = "kube-ipvs0", index, rtnl_on(sock)
    dev._events, dev._bound = None, None
    return dev


def kernel_on(sock: Any, device_sock: Any | None = None) -> NetlinkKernel:
    kernel = NetlinkKernel.__new__(NetlinkKernel)
    kernel._genl = genl_on(sock)
    kernel._device = device_on(device_sock or sock)
    return kernel


def raised(call: Callable[[], object]) -> BaseException:
    with pytest.raises(KernelError) as info:
        call()
    return info.value


def assert_mapped(error: BaseException, kind: type[KernelError], code: int) -> None:
    assert type(error) is kind, repr(error)
    assert isinstance(error.__cause__, OSError)
    assert error.__cause__.errno == code
    assert errno.errorcode[code] in str(error)


# ---- the sockets' request methods ----------------------------------------------------------

SOCKET_CALLS: dict[str, Callable[[Any], object]] = {
    "genl batch": lambda s: genl_on(s).batch([codec.encode_op(AddService(VS))]),
    "genl request": lambda s: genl_on(s).request(codec.CMD_SET_CONFIG, b""),
    "genl dump_raw": lambda s: genl_on(s).dump_raw(codec.CMD_GET_SERVICE),
    "rtnl change": lambda s: rtnl_on(s).change(7, [(ip_address("10.96.0.10"), True)]),
    "rtnl addresses": lambda s: rtnl_on(s).addresses(7),
    "rtnl all_addresses": lambda s: rtnl_on(s).all_addresses(),
    "rtnl link_index": lambda s: rtnl_on(s).link_index("kube-ipvs0"),
    "rtnl create_link": lambda s: rtnl_on(s).create_link("kube-ipvs0", "dummy"),
    "rtnl delete_link": lambda s: rtnl_on(s).delete_link(7),
}


@pytest.mark.parametrize(("code", "on", "kind"), FAILURES)
@pytest.mark.parametrize("call", SOCKET_CALLS.values(), ids=SOCKET_CALLS.keys())
def test_a_failed_send_or_recv_is_a_kernel_error_with_its_cause(call, code, on, kind):
    assert_mapped(raised(lambda: call(BrokenSocket(code, on=on))), kind, code)


# ---- NetlinkKernel, DummyDevice -------------------------------------------------------------


@pytest.mark.parametrize(("code", "on", "kind"), FAILURES)
@pytest.mark.parametrize(
    "call",
    [
        lambda k: k.observe(),
        lambda k: k.services(),
        lambda k: k.connections(VS.key),
        lambda k: k.set_timeouts(tcp=900),
        lambda k: k.has_device(),
        lambda k: k.remove_device(),
    ],
    ids=["observe", "services", "connections", "set_timeouts", "has_device", "remove_device"],
)
def test_every_netlink_kernel_call_raises_kernel_errors_only(call, code, on, kind):
    kernel = kernel_on(BrokenSocket(code, on=on))
    kernel._device._index = None  # has_device/remove_device look it up
    assert_mapped(raised(lambda: call(kernel)), kind, code)


@pytest.mark.parametrize(("code", "on", "kind"), FAILURES)
def test_apply_reports_each_op_of_a_failed_batch_and_goes_on(code, on, kind):
    """apply() never raises for one batch: its ops fail (their outcome is unknown), the
    next batch still goes out."""
    ipvs = BrokenSocket(code, on=on)
    device = ScriptedAcks()
    kernel = kernel_on(ipvs, device_sock=device)
    plan: list[Op] = [AddService(VS), BindAddress(ip_address("10.96.0.10")), AddService(VS)]
    report = kernel.apply(plan)
    assert [f.op for f in report.failures] == [plan[0], plan[2]]
    for failure in report.failures:
        assert_mapped(failure.error, kind, code)
    assert report.applied == 1
    assert device.requests == 1  # the bind went out between the two failed batches


@pytest.mark.parametrize(("code", "on", "kind"), FAILURES)
def test_a_failed_address_batch_is_reported_for_each_of_its_ops(code, on, kind):
    dev = device_on(BrokenSocket(code, on=on))
    changes = [(ip_address("10.96.0.10"), True), (ip_address("10.96.0.11"), False)]
    errors = dev.change(changes)
    assert len(errors) == 2
    for error in errors:
        assert error is not None
        assert_mapped(error, kind, code)


class ScriptedAcks:
    """Acknowledges every batch (the ack of its last request): a kernel that accepts all."""

    def __init__(self) -> None:
        self.requests, self._replies = 0, b""

    def send(self, data: bytes) -> int:
        *_, (_, _, seq, _) = codec.messages(data)
        self.requests += 1
        self._replies = struct.pack("=IHHIIi", 36, codec.NLMSG_ERROR, 0, seq, 0, 0) + bytes(16)
        return len(data)

    def recv_into(self, buf: bytearray, *_: int) -> int:
        buf[: len(self._replies)] = self._replies
        return len(self._replies)


# ---- a dump after a failed one ---------------------------------------------------------------


def test_a_dump_ignores_late_datagrams_of_an_earlier_failed_request():
    """A recv() that failed midway leaves the rest of that dump on the socket; the next
    dump must not take it for its own (another service's destinations)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        stale = codec.message(0x20, codec.CMD_NEW_DEST, b"\0" * 8, seq=1, flags=2)
        stale_done = struct.pack("=IHHIIi", 20, codec.NLMSG_DONE, 2, 1, 0, 0)
        fresh = codec.message(0x20, codec.CMD_NEW_DEST, b"\1" * 8, seq=2, flags=2)
        fresh_done = struct.pack("=IHHIIi", 20, codec.NLMSG_DONE, 2, 2, 0, 0)
        for datagram in (stale, stale_done, fresh, fresh_done):
            theirs.send(datagram)
        genl = genl_on(ours)
        genl._seq = 1  # the failed dump was request 1
        assert genl.dump_raw(codec.CMD_GET_DEST) == [fresh, fresh_done]
    finally:
        ours.close()
        theirs.close()


# ---- construction ------------------------------------------------------------------------


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[BrokenSocket]:
    """Every netlink socket the code under test opens: fakes whose send() fails EPERM
    unless a test says otherwise."""
    made: list[BrokenSocket] = []

    def factory(*_: object) -> BrokenSocket:
        made.append(BrokenSocket(errno.EPERM))
        return made[-1]

    monkeypatch.setattr(socket, "socket", factory)  # as nlsocket.py opens its sockets
    return made


def test_genl_construction_that_fails_resolving_closes_its_socket(opened):
    error = raised(GenlSocket)
    assert_mapped(error, KernelUnavailable, errno.EPERM)
    assert "resolving family 'IPVS'" in str(error)
    assert opened
    assert all(s.closed for s in opened)  # the device's rtnetlink and events sockets


def test_netlink_kernel_construction_that_fails_closes_every_socket(monkeypatch, opened):
    genl = genl_on(BrokenSocket(errno.EPERM))
    monkeypatch.setattr(kernel_module, "GenlSocket", lambda: genl)
    closed: list[str] = []
    monkeypatch.setattr(GenlSocket, "close", lambda self: closed.append("genl"))

    def no_device(name: str) -> DummyDevice:
        raise KernelUnavailable("cannot open a rtnetlink socket: EMFILE")

    monkeypatch.setattr(kernel_module, "DummyDevice", no_device)
    with pytest.raises(KernelUnavailable, match="EMFILE"):
        NetlinkKernel()
    assert closed == ["genl"]

    # a genl socket passed in stays the caller's
    closed.clear()
    with pytest.raises(KernelUnavailable):
        NetlinkKernel(genl=genl)
    assert closed == []


def test_a_netlink_kernel_that_was_built_closes_what_it_opened(monkeypatch, opened):
    genl = genl_on(BrokenSocket(errno.EPERM))
    monkeypatch.setattr(kernel_module, "GenlSocket", lambda: genl)
    with NetlinkKernel():
        pass
    assert genl._sock.closed  # type: ignore[attr-defined]
    assert opened
    assert all(s.closed for s in opened)  # the device's rtnetlink and events sockets


# ---- the firewall's ipset sockets ---------------------------------------------------------


@pytest.fixture
def ipset_socket(monkeypatch: pytest.MonkeyPatch) -> Callable[[BrokenSocket], None]:
    def use(sock: BrokenSocket) -> None:
        monkeypatch.setattr(socket, "socket", lambda *_: sock)  # as set_reader.py opens it

    return use


@pytest.mark.parametrize(
    ("code", "on"),
    [(errno.ENOBUFS, "send"), (errno.ENOBUFS, "recv"), (errno.EPERM, "send")],
)
@pytest.mark.parametrize(
    "call",
    [
        lambda: SetReader().observe(),
        lambda: SetReader().names(),
        lambda: SetWriter().write([SetCommand("create", "IPVSPROXY-X", "hash:ip", 4, 1024, 65536)]),
        lambda: SetWriter().write([SetCommand("flush", "IPVSPROXY-X")]),
    ],
    ids=["reader observe", "reader names", "writer create", "writer flush"],
)
def test_an_ipset_socket_that_fails_is_a_kernel_error_with_its_cause(ipset_socket, call, code, on):
    ipset_socket(BrokenSocket(code, on=on))
    error = raised(call)
    assert isinstance(error.__cause__, OSError)
    assert error.__cause__.errno == code


def test_an_ipset_socket_that_cannot_bind_is_closed(ipset_socket):
    sock = BrokenSocket(errno.EPERM, on="bind")
    ipset_socket(sock)
    with pytest.raises(KernelError, match="ipset over netlink"):
        SetReader()
    assert sock.closed


def test_observe_with_a_working_socket_still_reads(monkeypatch):
    """The fakes above fail; the same wiring with a socket that answers gives a state."""
    kernel = kernel_on(EmptyDumps(), device_sock=EmptyDumps())
    kernel._device._index = None
    monkeypatch.setattr(DummyDevice, "index", lambda self, create: None)
    assert kernel.observe() == IpvsState({}, {}, frozenset())


class EmptyDumps:
    """Answers every dump with DONE."""

    def __init__(self) -> None:
        self._seq = 0

    def send(self, data: bytes) -> int:
        self._seq = next(codec.messages(data))[2]
        return len(data)

    def recv_into(self, buf: bytearray, *_: int) -> int:
        done = struct.pack("=IHHIIi", 20, codec.NLMSG_DONE, 2, self._seq, 0, 0)
        buf[:20] = done
        return 20
