"""Addresses on one link over rtnetlink, batched like the IPVS requests (nlsocket.py), and
the few link requests the dummy device needs (look up by name, create, delete).

Why not pyroute2 here: it sends one RTM_NEWADDR/RTM_DELADDR and waits for its ack per
address, and builds each through its request filters; a cluster of 1000 Services binds 1000
VIPs, here in one batch (one round trip instead of one per address: bench/ipvs_sync.py
--only-vips compares the two).

The messages are exactly pyroute2's `addr("add"/"del", index=..., address=...,
prefixlen=32|128)` (tests/netlink/test_rtnl.py checks the bytes): IPv4 with IFA_LOCAL =
IFA_ADDRESS, IPv6 with IFA_FLAGS = IFA_F_NODAD (a VIP must not wait for duplicate address
detection).

Links: the device is looked up, created and deleted once per start or after it vanished, and
the one socket serves them too (no second netlink library in the product). The link requests are
pyroute2's `link("get", ifname=)`, `link("add", ifname=, kind="dummy")` and `link("del",
index=)` byte for byte (test_rtnl.py). The lookup is an RTM_GETLINK on this socket, not
`socket.if_nametoindex`: the socket answers for the network namespace it was opened in (as
the IPVS sockets do), the ioctl for the caller's current one.

Layouts: include/uapi/linux/{rtnetlink,if_addr,if_link}.h.

Imports: codec, nlsocket, model, the standard library.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
from collections.abc import Sequence
from ipaddress import IPv4Address, IPv6Address

from ipvsproxy.model import IPAddress
from ipvsproxy.netlink import codec
from ipvsproxy.netlink.nlsocket import SOL_NETLINK, NetlinkSocket, Request

NETLINK_ROUTE = 0
NETLINK_GET_STRICT_CHK = 12  # the kernel filters a dump by the request's header (4.20+)
RTM_NEWLINK, RTM_DELLINK, RTM_GETLINK = 16, 17, 18
RTM_NEWADDR, RTM_DELADDR, RTM_GETADDR = 20, 21, 22
NLM_F_EXCL, NLM_F_CREATE = 0x200, 0x400
IFA_ADDRESS, IFA_LOCAL, IFA_FLAGS = 1, 2, 8
IFA_F_NODAD = 0x02
IFLA_IFNAME, IFLA_LINKINFO, IFLA_INFO_KIND = 3, 18, 1
_IFADDRMSG = struct.Struct("=BBBBI")  # family, prefixlen, flags, scope, index
_IFINFOMSG = struct.Struct("=BxHiII")  # family, pad, type, index, flags, change
_NODAD = codec.nla(IFA_FLAGS, struct.pack("=I", IFA_F_NODAD))
_ADD = codec.NLM_F_REQUEST | NLM_F_CREATE | NLM_F_EXCL
_DEL = codec.NLM_F_REQUEST


def address_request(index: int, address: IPAddress, *, add: bool) -> Request:
    """RTM_NEWADDR (add) or RTM_DELADDR of `address` as a host address (/32, /128)."""
    raw = codec.nla(IFA_ADDRESS, address.packed)
    if address.version == 4:
        head = _IFADDRMSG.pack(socket.AF_INET, 32, 0, 0, index)
        attrs = raw + codec.nla(IFA_LOCAL, address.packed)
    else:
        head = _IFADDRMSG.pack(socket.AF_INET6, 128, 0, 0, index)
        attrs = raw + _NODAD if add else raw
    return (RTM_NEWADDR, _ADD, head, attrs) if add else (RTM_DELADDR, _DEL, head, attrs)


def link_request(kind: int, *, name: str = "", index: int = 0, link_kind: str = "") -> Request:
    """RTM_GETLINK (by name), RTM_NEWLINK (create `name` of `link_kind`, failing if it exists)
    or RTM_DELLINK (by index). IFLA_LINKINFO is sent without NLA_F_NESTED, as pyroute2 and
    iproute2 send it (the kernel parses it either way)."""
    attrs = codec.nla(IFLA_IFNAME, name.encode() + b"\0") if name else b""
    if link_kind:
        attrs += codec.nla(IFLA_LINKINFO, codec.nla(IFLA_INFO_KIND, link_kind.encode() + b"\0"))
    flags = _ADD if kind == RTM_NEWLINK else codec.NLM_F_REQUEST
    return kind, flags, _IFINFOMSG.pack(socket.AF_UNSPEC, 0, index, 0, 0), attrs


class RtnlSocket(NetlinkSocket):
    """Address changes and address dumps for links, by index; links by name."""

    WHAT = "rtnetlink"

    def __init__(self) -> None:
        super().__init__(NETLINK_ROUTE, "rtnetlink")
        with contextlib.suppress(OSError):  # older kernels: a full dump, filtered below
            self._sock.setsockopt(SOL_NETLINK, NETLINK_GET_STRICT_CHK, 1)
        # the last dump's messages (their bytes after the nlmsghdr, which alone carries the
        # sequence number) and the address each holds: a full resync re-reads the dummy
        # device's 1,000s of VIPs, unchanged, and parses none of them again
        self._parsed: dict[bytes, IPAddress | None] = {}

    def link_index(self, name: str) -> int | None:
        """The index of link `name` in this socket's namespace (None: no such link).
        OSError with the errno for any other refusal."""
        code, answers = self.ask(link_request(RTM_GETLINK, name=name))
        if code == errno.ENODEV:
            return None
        _check(code)
        for kind, payload in answers:
            if kind == RTM_NEWLINK:
                index: int = _IFINFOMSG.unpack_from(payload)[2]
                return index
        raise OSError(errno.EPROTO, f"no RTM_NEWLINK answered the lookup of {name}")

    def create_link(self, name: str, kind: str) -> None:
        """Create link `name` of `kind` ("dummy"), left down. OSError(EEXIST) if it exists."""
        _check(self.ask(link_request(RTM_NEWLINK, name=name, link_kind=kind))[0])

    def delete_link(self, index: int) -> None:
        """Delete link `index` (and its addresses). OSError(ENODEV) if it is gone."""
        _check(self.ask(link_request(RTM_DELLINK, index=index))[0])

    def change(self, index: int, changes: Sequence[tuple[IPAddress, bool]]) -> list[int]:
        """Add (True) or delete (False) each address on link `index`, in order, in as few
        sends as fit; the errno of each (0 = done)."""
        return self.send_batch([address_request(index, a, add=add) for a, add in changes])

    def addresses(self, index: int) -> frozenset[IPAddress]:
        """The addresses on link `index` (IFA_ADDRESS, as pyroute2's get_addr reports)."""
        return frozenset(self.all_addresses(index))

    def all_addresses(self, index: int = 0, *, exclude: int = 0) -> list[IPAddress]:
        """The addresses on link `index` (0: on every link but `exclude`), in the kernel's
        order."""
        chunks = self.dump(RTM_GETADDR, _IFADDRMSG.pack(socket.AF_UNSPEC, 0, 0, 0, index))
        previous, self._parsed = self._parsed, {}
        out: list[IPAddress] = []
        for chunk in chunks:
            for kind, _, _, payload in codec.messages(chunk):
                if kind != RTM_NEWADDR:
                    continue
                got = _IFADDRMSG.unpack_from(payload)[4]
                if (index and got != index) or (exclude and got == exclude):
                    continue  # a kernel without strict dump checking sends every link's
                raw = bytes(payload)
                address = previous[raw] if raw in previous else _address(payload)
                self._parsed[raw] = address
                if address is not None:
                    out.append(address)
        return out


RTMGRP_LINK, RTMGRP_IPV4_IFADDR, RTMGRP_IPV6_IFADDR = 0x1, 0x10, 0x100


class AddressEvents:
    """Whether any link or address of this network namespace changed since the last look.

    Why: a full resync would otherwise re-read the dummy device's VIPs and this host's
    addresses (one RTM_NEWADDR message per VIP: 10,000s in a large cluster) every sync
    period, although they hardly ever change. The kernel announces every change on
    rtnetlink's multicast groups; a socket subscribed to them, drained without blocking,
    says whether anything
    happened (ipvsproxy's own binds included). Overflowed (ENOBUFS) or failed, it says yes:
    the caller reads everything again. The first look always says yes."""

    def __init__(self) -> None:
        self._sock = socket.socket(
            socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
            NETLINK_ROUTE,
        )  # fmt: skip
        try:
            self._sock.bind((0, RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR))
        except OSError:
            self._sock.close()
            raise
        self._first = True

    def changed(self) -> bool:
        seen, self._first = self._first, False
        while True:
            try:
                if not self._sock.recv(65536):
                    return seen
            except BlockingIOError:
                return seen
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    return True
            seen = True

    def close(self) -> None:
        self._sock.close()


def _check(code: int) -> None:
    if code:
        raise OSError(code, os.strerror(code))


def _address(payload: memoryview) -> IPAddress | None:
    """The address of one RTM_NEWADDR message (IFA_ADDRESS, else IFA_LOCAL)."""
    family = _IFADDRMSG.unpack_from(payload)[0]
    found = codec.attrs(payload, _IFADDRMSG.size)
    raw = found.get(IFA_ADDRESS) or found.get(IFA_LOCAL)
    if raw is None:
        return None
    if family == socket.AF_INET:
        return IPv4Address(bytes(raw))
    if family == socket.AF_INET6:
        return IPv6Address(bytes(raw))
    return None
