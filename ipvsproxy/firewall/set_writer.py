"""ipvsproxy's ipset changes written over netfilter netlink: no process, no libc lookup.

Owns: `SetWriter` (runs the `SetCommand`s of ipset.py, the same list `ipset_script()` renders
for `ipset restore -exist`) and `encode_entry()`.

Why not `ipset restore`: for every entry it parses, the tool stats /etc/resolv.conf
(getaddrinfo) and reads /etc/protocols: file system calls per entry, which a node with a slow
root filesystem pays 10,000s of times in a first sync, and a process to start. Here an ADD or
DEL message carries up to ADT_BYTES of entries in its IPSET_ATTR_ADT nest, and one `send()`
up to SEND_BYTES of messages, which the kernel runs in order, answering each.

Messages are the ones `ipset restore -exist` (v7.17, checked with strace) sends: the same
flags (CREATE without NLM_F_EXCL, ADD/DEL without it: IPSET_FLAG_EXIST in the kernel), the
same attributes in the same order, IPSET_ATTR_LINENO per entry, so that the kernel names the
entry it refused; a DESTROY of a missing set is ignored, as the tool does with -exist. The
set revision is the kernel's newest (IPSET_CMD_TYPE), at most the newest the ipset tool knows.

Order: what was sent before a SWAP is acknowledged before the SWAP is sent, and nothing is
sent after an error: a temporary set only filled in part is never swapped in.

Imports: firewall.ipset, firewall.set_reader, errors, the standard library.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from ipvsproxy.errors import KernelError
from ipvsproxy.firewall.ipset import PROTOCOL_NUMBERS, SetCommand
from ipvsproxy.firewall.set_reader import (
    ATTR_ADT,
    ATTR_CIDR,
    ATTR_CIDR2,
    ATTR_DATA,
    ATTR_FAMILY,
    ATTR_IP,
    ATTR_IP2,
    ATTR_MAXELEM,
    ATTR_PORT,
    ATTR_PROTO,
    ATTR_SETNAME,
    ATTR_TYPENAME,
    IPADDR_IPV4,
    IPADDR_IPV6,
    IPSET_CMD_ADD,
    IPSET_CMD_CREATE,
    IPSET_CMD_DEL,
    IPSET_CMD_DESTROY,
    IPSET_CMD_FLUSH,
    IPSET_CMD_SWAP,
    IPSET_CMD_TYPE,
    NLM_F_REQUEST,
    IpsetSocket,
    _attr,
    _attrs,
)
from ipvsproxy.netlink.nlsocket import Request

NLM_F_ACK, NLM_F_CREATE = 0x4, 0x400
NLA_F_NESTED, NLA_F_NET_BYTEORDER = 0x8000, 0x4000
NLMSG_ERROR = 2
ATTR_REVISION, ATTR_LINENO, ATTR_REVISION_MIN, ATTR_HASHSIZE = 4, 9, 10, 18
ADT_BYTES = 32768  # entries per ADD/DEL message (an attribute's length is 16 bits)
SEND_BYTES = 131072  # messages per send(): below the default socket buffers (212 KB)
VERBS = {
    "create": IPSET_CMD_CREATE,
    "destroy": IPSET_CMD_DESTROY,
    "flush": IPSET_CMD_FLUSH,
    "swap": IPSET_CMD_SWAP,
    "add": IPSET_CMD_ADD,
    "del": IPSET_CMD_DEL,
}
# the newest revisions ipset v7.17 knows (what it creates on a 6.18 kernel): newer ones
# could not be listed by the tool (the fallback, and people debugging)
NEWEST = {"hash:ip": 6, "hash:ip,port": 7, "hash:ip,port,ip": 6, "hash:ip,port,net": 8}
# include/uapi/linux/netfilter/ipset/ip_set.h, ip_set_hash.h: what the kernel's codes mean
ERRORS = {
    4097: "protocol error",
    4098: "unknown set type",
    4099: "the maximum number of sets is reached",
    4100: "set in use (busy)",
    4101: "the second set does not exist",
    4102: "the sets differ in type or family",
    4103: "already exists with other parameters",
    4104: "invalid CIDR",
    4105: "invalid netmask",
    4106: "invalid family",
    4107: "timeout not supported",
    4108: "set referenced by a rule",
    4109: "invalid IPv4 address",
    4110: "invalid IPv6 address",
    4352: "the set is full (maxelem)",
    4353: "invalid element",
    4354: "invalid protocol",
    4355: "missing protocol",
}


def _nest(kind: int, payload: bytes) -> bytes:
    return _attr(kind | NLA_F_NESTED, payload)


def _net(kind: int, payload: bytes) -> bytes:
    return _attr(kind | NLA_F_NET_BYTEORDER, payload)


def _lineno(number: int) -> bytes:
    return _net(ATTR_LINENO, struct.pack("!I", number))


def _name(name: str) -> bytes:
    return name.encode() + b"\0"


def _address(kind: int, text: str) -> tuple[bytes, int | None]:
    """An IPSET_ATTR_IP(2) nest, and the prefix length written after a `/`, if any."""
    address, slash, prefix = text.partition("/")
    # inet_pton: the entries are ipvsproxy's own, printed from parsed addresses, so the
    # plain C parser takes them as they are
    try:
        if ":" in address:
            inner = _net(IPADDR_IPV6, socket.inet_pton(socket.AF_INET6, address))
        else:
            inner = _net(IPADDR_IPV4, socket.inet_pton(socket.AF_INET, address))
    except OSError as exc:
        raise ValueError(f"not an IP address: {address!r}") from exc
    return _nest(kind, inner), int(prefix) if slash else None


def encode_entry(entry: str) -> bytes:
    """An entry as `ipset save` prints it (`ip[/cidr][,proto:port[,ip2[/cidr]]]`, the
    protocol named or numbered) -> the attributes inside its IPSET_ATTR_DATA, in the tool's
    order (lineno excluded)."""
    parts = entry.split(",")
    out, cidr = _address(ATTR_IP, parts[0])
    if cidr is not None:
        out += _attr(ATTR_CIDR, bytes([cidr]))
    if len(parts) > 1:
        proto, _, port = parts[1].rpartition(":")
        number = PROTOCOL_NUMBERS.get(proto)
        out += _net(ATTR_PORT, struct.pack("!H", int(port)))
        out += _attr(ATTR_PROTO, bytes([number if number is not None else int(proto)]))
    if len(parts) > 2:
        second, cidr = _address(ATTR_IP2, parts[2])
        out += second
        if cidr is not None:
            out += _attr(ATTR_CIDR2, bytes([cidr]))
    return out


@dataclass(frozen=True, slots=True)
class Sent:
    """One request and what it was about, to name the change an error belongs to."""

    request: Request
    command: SetCommand
    entries: tuple[str, ...] = ()  # ADD/DEL: the entries of this message, lineno - 1


class SetWriter(IpsetSocket):
    """Writes ipvsproxy's sets: `write(set_commands(changes))` does what
    `ipset restore -exist` does with `ipset_script(changes)`."""

    def __init__(self) -> None:
        super().__init__()
        self._revisions: dict[tuple[str, int], int] = {}

    def write(self, commands: Iterable[SetCommand]) -> int:
        """Runs the commands in order; returns the number of send() calls. KernelError
        (set and entry named) at the first the kernel refuses; nothing is sent after it."""
        batch: list[Sent] = []
        sends = 0
        for command in commands:
            if command.verb == "swap" and batch:  # acknowledged before the swap
                sends += self._send(batch)
                batch = []
            for sent in self._requests(command):
                if batch and sum(map(_size, batch)) + _size(sent) > SEND_BYTES:
                    sends += self._send(batch)
                    batch = []
                batch.append(sent)
        if batch:
            sends += self._send(batch)
        return sends

    def _requests(self, command: SetCommand) -> list[Sent]:
        verb = VERBS[command.verb]
        name = _attr(ATTR_SETNAME, _name(command.name))
        if verb == IPSET_CMD_CREATE:
            flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE  # no NLM_F_EXCL: -exist
            attrs = name + self._shape(command)
        elif verb == IPSET_CMD_SWAP:
            flags, attrs = (
                NLM_F_REQUEST | NLM_F_ACK,
                name + _attr(ATTR_TYPENAME, _name(command.other)),
            )
        elif verb in (IPSET_CMD_ADD, IPSET_CMD_DEL):
            return self._entries(verb, command)
        else:
            flags, attrs = NLM_F_REQUEST | NLM_F_ACK, name
        return [Sent(self._request(verb, flags, attrs), command)]

    def _shape(self, command: SetCommand) -> bytes:
        family = socket.AF_INET if command.version == 4 else socket.AF_INET6
        sizes = _net(ATTR_HASHSIZE, struct.pack("!I", command.hashsize))
        sizes += _net(ATTR_MAXELEM, struct.pack("!I", command.maxelem))
        return (
            _attr(ATTR_TYPENAME, _name(command.kind))
            + _attr(ATTR_REVISION, bytes([self._revision(command.kind, family)]))
            + _attr(ATTR_FAMILY, bytes([family]))
            + _nest(ATTR_DATA, sizes)
        )

    def _entries(self, verb: int, command: SetCommand) -> list[Sent]:
        """ADD/DEL messages of up to ADT_BYTES of entries each, numbered from 1 per message."""
        out: list[Sent] = []
        chunk: list[tuple[str, bytes]] = []
        size = 0
        for entry in command.entries:
            data = encode_entry(entry)
            cost = len(data) + 12  # its DATA nest's header and lineno
            if chunk and size + cost > ADT_BYTES:
                out.append(self._adt(verb, command, chunk))
                chunk, size = [], 0
            chunk.append((entry, data))
            size += cost
        if chunk:
            out.append(self._adt(verb, command, chunk))
        return out

    def _adt(self, verb: int, command: SetCommand, chunk: list[tuple[str, bytes]]) -> Sent:
        nest = b"".join(
            _nest(ATTR_DATA, data + _lineno(number)) for number, (_, data) in enumerate(chunk, 1)
        )
        attrs = _attr(ATTR_SETNAME, _name(command.name)) + _lineno(len(chunk))
        request = self._request(verb, NLM_F_REQUEST | NLM_F_ACK, attrs + _nest(ATTR_ADT, nest))
        return Sent(request, command, tuple(entry for entry, _ in chunk))

    def _send(self, batch: list[Sent]) -> int:
        """One send() of these messages; raises for the first one refused."""
        refused: dict[int, bytes] = {}
        codes = self._nl.send_batch([sent.request for sent in batch], refused=refused)
        for index, (sent, code) in enumerate(zip(batch, codes, strict=True)):
            if code and not (code == errno.ENOENT and sent.command.verb == "destroy"):
                raise _error(sent, code, refused.get(index, b""))
        return 1

    def _revision(self, kind: str, family: int) -> int:
        """The revision `ipset create` would use: the kernel's newest, at most NEWEST."""
        found = self._revisions.get((kind, family))
        if found is None:
            attrs = _attr(ATTR_TYPENAME, _name(kind)) + _attr(ATTR_FAMILY, bytes([family]))
            for reply in self._ask(IPSET_CMD_TYPE, attrs):
                newest = reply[ATTR_REVISION][0]
                oldest = reply.get(ATTR_REVISION_MIN, b"\0")[0]
                found = max(oldest, min(newest, NEWEST.get(kind, newest)))
            if found is None:
                raise KernelError(f"ipset: the kernel knows no set type {kind}")
            self._revisions[(kind, family)] = found
        return found


def _size(sent: Sent) -> int:
    _, _, head, attrs = sent.request
    return 16 + len(head) + len(attrs)  # with its nlmsghdr


def _error(sent: Sent, code: int, payload: bytes) -> KernelError:
    """The kernel's refusal as the change it belongs to: the set and, for ADD/DEL, the entry
    (the kernel writes its number into the echoed request's IPSET_ATTR_LINENO)."""
    reason = ERRORS.get(code) or os.strerror(code)
    command = sent.command
    where = f"ipset {command.verb} {command.name}"
    if command.verb == "swap":
        where += f" {command.other}"
    if sent.entries:
        echoed = dict(_attrs(payload[4 + 16 + 4 :]))  # error, nlmsghdr, nfgenmsg
        lineno = echoed.get(ATTR_LINENO)
        if lineno is not None and 0 < (at := struct.unpack("!I", lineno)[0]) <= len(sent.entries):
            where += f" {sent.entries[at - 1]}"
    return KernelError(f"{where}: {reason} (netlink error {code})")
