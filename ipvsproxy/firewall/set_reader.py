"""ipvsproxy's ipsets read over netfilter netlink: no process, no libc lookup per entry.

Owns: `SetReader` (names, then one dump per set of `sets.OWNED_SETS`, decoded into the text
`ipset save` prints, so observed and wanted sets still compare as text) and `decode_entry()`.

Why not `ipset save`: it prints each entry's protocol through getprotobynumber(), which opens
and reads /etc/protocols once per entry (10,000s of file system calls in every resync of a
large cluster, each slow on a node with a network or overlay root filesystem), in a process
of its own. A netlink dump sends a few kernel messages of ~100 entries each.

Protocol (include/uapi/linux/netfilter/ipset/ip_set.h): NFNL_SUBSYS_IPSET, IPSET_CMD_LIST
with IPSET_ATTR_PROTOCOL 7; IPSET_FLAG_LIST_SETNAME lists names only.

`IpsetSocket` (ipset requests over the one netlink socket, netlink/nlsocket.py) is shared
with set_writer.SetWriter.

Imports: firewall.sets, netlink (the socket and its framing), errors, the standard library.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator
from ipaddress import IPv4Address, IPv6Address

from ipvsproxy.errors import KernelError
from ipvsproxy.firewall.sets import OWNED_SETS, SetState
from ipvsproxy.netlink import codec
from ipvsproxy.netlink.nlsocket import NetlinkSocket, Request

NETLINK_NETFILTER = 12
NFNL_SUBSYS_IPSET = 6
IPSET_CMD_CREATE, IPSET_CMD_DESTROY, IPSET_CMD_FLUSH = 2, 3, 4
IPSET_CMD_SWAP, IPSET_CMD_LIST, IPSET_CMD_ADD, IPSET_CMD_DEL, IPSET_CMD_TYPE = 6, 7, 9, 10, 13
COMMANDS = {2: "create", 3: "destroy", 4: "flush", 6: "swap", 7: "list", 9: "add", 10: "del"}
COMMANDS[IPSET_CMD_TYPE] = "type"
IPSET_PROTOCOL = 7
NLM_F_REQUEST = 0x1
NLA_TYPE_MASK = 0x3FFF
# attributes: top level, then inside DATA (per entry / the set's header)
ATTR_PROTOCOL, ATTR_SETNAME, ATTR_TYPENAME, ATTR_FAMILY, ATTR_FLAGS = 1, 2, 3, 5, 6
ATTR_DATA, ATTR_ADT = 7, 8
ATTR_IP, ATTR_CIDR, ATTR_PORT, ATTR_PROTO, ATTR_MAXELEM = 1, 3, 4, 7, 19
ATTR_IP2, ATTR_CIDR2 = 20, 21
IPADDR_IPV4, IPADDR_IPV6 = 1, 2
FLAG_LIST_SETNAME = 1 << 1
PROTOCOLS = {6: "tcp", 17: "udp", 132: "sctp", 1: "icmp", 58: "ipv6-icmp"}
_ATTR = struct.Struct("=HH")
_NFGEN = struct.pack("=BBH", socket.AF_INET, 0, 0)  # nfgenmsg: family, version, res_id
_NFGEN_SIZE = len(_NFGEN)


def _attr(kind: int, payload: bytes) -> bytes:
    size = _ATTR.size + len(payload)
    return _ATTR.pack(size, kind) + payload + b"\0" * (-size % 4)


def _attrs(data: bytes) -> Iterator[tuple[int, bytes]]:
    at = 0
    while at + _ATTR.size <= len(data):
        size, kind = _ATTR.unpack_from(data, at)
        if size < _ATTR.size:
            return
        yield kind & NLA_TYPE_MASK, data[at + _ATTR.size : at + size]
        at += (size + 3) & ~3


def _address(data: bytes) -> IPv4Address | IPv6Address:
    for kind, value in _attrs(data):
        if kind == IPADDR_IPV4:
            return IPv4Address(value)
        if kind == IPADDR_IPV6:
            return IPv6Address(value)
    raise KernelError("ipset: an entry without an address")


def decode_entry(data: bytes) -> str:
    """One entry (the attributes inside IPSET_ATTR_DATA) as `ipset save` prints it."""
    found = dict(_attrs(data))
    address = _address(found[ATTR_IP])
    text = str(address)
    if ATTR_CIDR in found and found[ATTR_CIDR][0] < address.max_prefixlen:
        text += f"/{found[ATTR_CIDR][0]}"
    if ATTR_PORT in found:
        proto = found[ATTR_PROTO][0] if ATTR_PROTO in found else socket.IPPROTO_TCP
        port = struct.unpack("!H", found[ATTR_PORT][:2])[0]
        text += f",{PROTOCOLS.get(proto, str(proto))}:{port}"
    if ATTR_IP2 in found:
        second = _address(found[ATTR_IP2])
        text += f",{second}"
        if ATTR_CIDR2 in found and found[ATTR_CIDR2][0] < second.max_prefixlen:
            text += f"/{found[ATTR_CIDR2][0]}"
    return text


class IpsetSocket:
    """ipset requests over the one netlink socket (netfilter netlink), in the network
    namespace it was made in; SetReader and SetWriter (set_writer.py) share it."""

    def __init__(self) -> None:
        # echo: the kernel names a refused entry in the request it sends back
        self._nl = NetlinkSocket(NETLINK_NETFILTER, "ipset over netlink", echo=True)

    def close(self) -> None:
        self._nl.close()

    def _request(self, command: int, flags: int, attrs: bytes) -> Request:
        """One ipset request: nfgenmsg, then the protocol and `attrs`."""
        kind = (NFNL_SUBSYS_IPSET << 8) | command
        return kind, flags, _NFGEN, _attr(ATTR_PROTOCOL, bytes([IPSET_PROTOCOL])) + attrs

    def _dump(self, command: int, extra: bytes) -> Iterator[dict[int, bytes]]:
        """The top-level attributes of each message of one dump."""
        kind, _, head, attrs = self._request(command, 0, extra)
        for payload in codec.dumped(self._nl.dump(kind, head + attrs)):
            yield dict(_attrs(bytes(payload[_NFGEN_SIZE:])))

    def _ask(self, command: int, extra: bytes) -> list[dict[int, bytes]]:
        """The top-level attributes of each message answering one request."""
        code, answers = self._nl.ask(self._request(command, NLM_F_REQUEST, extra))
        if code:
            raise KernelError(f"ipset {COMMANDS[command]}: {os.strerror(code)}")
        return [dict(_attrs(payload[_NFGEN_SIZE:])) for _, payload in answers]


class SetReader(IpsetSocket):
    """Reads ipvsproxy's sets."""

    def __init__(self) -> None:
        super().__init__()
        # per set: the entry bytes of its last dump, and what they decoded to
        self._decoded: dict[str, tuple[tuple[bytes, ...], frozenset[str]]] = {}

    def observe(self) -> SetState:
        """ipvsproxy's sets (exactly `sets.OWNED_SETS`): type, family, maxelem, entries."""
        names = [n for n in self.names() if n in OWNED_SETS]
        sets: dict[str, tuple[str, int, frozenset[str]]] = {}
        maxelem: dict[str, int] = {}
        for name in names:
            kind, version, capacity, entries = self._one(name)
            sets[name] = (kind, version, entries)
            maxelem[name] = capacity
        self._decoded = {name: self._decoded[name] for name in names if name in self._decoded}
        return SetState(sets, maxelem)

    def names(self) -> list[str]:
        flags = _attr(ATTR_FLAGS, struct.pack("!I", FLAG_LIST_SETNAME))
        found = []
        for attrs in self._dump(IPSET_CMD_LIST, flags):
            name = attrs.get(ATTR_SETNAME)
            if name is not None:
                found.append(name.rstrip(b"\0").decode())
        return found

    def _one(self, name: str) -> tuple[str, int, int, frozenset[str]]:
        """One set's type, family, maxelem and entries. The entries are decoded only when
        the dump's entry bytes differ from the last dump of this set: a set nobody changed
        dumps the same bytes (its hash table is walked in the same order), and a periodic
        resync then costs the dump alone, not the decoding of every entry of every set."""
        kind, version, capacity, blobs = "", 4, 65536, []
        for attrs in self._dump(IPSET_CMD_LIST, _attr(ATTR_SETNAME, name.encode() + b"\0")):
            if ATTR_TYPENAME in attrs:  # the first message; the others carry entries only
                kind = attrs[ATTR_TYPENAME].rstrip(b"\0").decode()
            if ATTR_FAMILY in attrs:
                version = 6 if attrs[ATTR_FAMILY][0] == socket.AF_INET6 else 4
            header = dict(_attrs(attrs.get(ATTR_DATA, b"")))
            if ATTR_MAXELEM in header:
                capacity = struct.unpack("!I", header[ATTR_MAXELEM])[0]
            blobs.append(attrs.get(ATTR_ADT, b""))
        raw = tuple(blobs)
        last = self._decoded.get(name)
        if last is not None and last[0] == raw:
            return kind, version, capacity, last[1]
        entries = frozenset(decode_entry(data) for blob in raw for _, data in _attrs(blob))
        self._decoded[name] = (raw, entries)
        return kind, version, capacity, entries
