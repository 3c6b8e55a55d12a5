"""The IPVS generic-netlink codec: requests encoded and replies decoded, pure functions over
bytes (owns no socket).

The attribute layouts are data, copied from include/uapi/linux/ip_vs.h the way pyroute2
describes messages (its `ipvsmsg` classes): one table per attribute space (`SERVICE`,
`DEST`, `COMMAND`), used both to encode (`pack`) and to decode (`unpack`). Why not pyroute2's
classes themselves: they build each message through ~2,000 Python calls, and a sync of a
large cluster encodes tens of thousands of requests. tests/netlink/test_codec.py checks the
bytes against pyroute2's own encoding of the same messages (no socket or root needed).

Also here: netlink's own framing (nlmsghdr, attributes), shared with rtnl.py.

Imports: model, schedulers, the standard library.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address
from typing import Any

from ipvsproxy.model import (
    AddDest,
    AddService,
    Counters,
    DeleteDest,
    DeleteService,
    DestTraffic,
    Forward,
    IPAddress,
    Proto,
    RealServer,
    RSKey,
    ServiceFlags,
    UpdateDest,
    UpdateService,
    VirtualServer,
    VSKey,
)
from ipvsproxy.schedulers import Scheduler

# netlink (linux/netlink.h)
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLMSG_MIN_TYPE = 0x10  # lower types are netlink's own (noop, error, done, overrun)
NLM_F_REQUEST, NLM_F_MULTI, NLM_F_ACK, NLM_F_DUMP = 0x1, 0x2, 0x4, 0x300
NLA_F_NESTED = 0x8000
NLA_TYPE_MASK = 0x3FFF
GENL_ID_CTRL = 0x10
CTRL_CMD_GETFAMILY, CTRL_ATTR_FAMILY_ID, CTRL_ATTR_FAMILY_NAME = 3, 1, 2

# IPVS commands (linux/ip_vs.h enum IPVS_CMD_*)
IPVS_GENL_VERSION = 1
CMD_NEW_SERVICE, CMD_SET_SERVICE, CMD_DEL_SERVICE, CMD_GET_SERVICE = 1, 2, 3, 4
CMD_NEW_DEST, CMD_SET_DEST, CMD_DEL_DEST, CMD_GET_DEST = 5, 6, 7, 8
CMD_SET_CONFIG, CMD_GET_CONFIG = 12, 13
FWD_MASK = 0x7  # IP_VS_CONN_F_FWD_MASK

# How an attribute's payload is laid out: a struct format, or one of these.
ADDRESS = "address"  # union nf_inet_addr: 4 or 16 bytes sent, 16 dumped whatever the family
STRING = "string"  # NUL-terminated
NESTED = "nested"  # attributes of another space (kept as bytes here)


@dataclass(frozen=True, slots=True)
class Attr:
    kind: int  # the attribute's number in its space
    layout: str  # a struct format (host order "=", network order "!") or ADDRESS/STRING/NESTED


# enum IPVS_CMD_ATTR_*
COMMAND: Mapping[str, Attr] = {
    "service": Attr(1, NESTED),
    "dest": Attr(2, NESTED),
    "daemon": Attr(3, NESTED),
    "timeout_tcp": Attr(4, "=I"),
    "timeout_tcp_fin": Attr(5, "=I"),
    "timeout_udp": Attr(6, "=I"),
}
# enum IPVS_SVC_ATTR_*
SERVICE: Mapping[str, Attr] = {
    "af": Attr(1, "=H"),
    "protocol": Attr(2, "=H"),
    "addr": Attr(3, ADDRESS),
    "port": Attr(4, "!H"),
    "fwmark": Attr(5, "=I"),
    "sched_name": Attr(6, STRING),
    "flags": Attr(7, "=II"),  # struct ip_vs_flags {flags, mask}
    "timeout": Attr(8, "=I"),
    "netmask": Attr(9, "=I"),
    "stats": Attr(10, NESTED),
    "pe_name": Attr(11, STRING),
    "stats64": Attr(12, NESTED),
}
# enum IPVS_DEST_ATTR_*
DEST: Mapping[str, Attr] = {
    "addr": Attr(1, ADDRESS),
    "port": Attr(2, "!H"),
    "fwd_method": Attr(3, "=I"),
    "weight": Attr(4, "=I"),
    "u_thresh": Attr(5, "=I"),
    "l_thresh": Attr(6, "=I"),
    "active_conns": Attr(7, "=I"),
    "inact_conns": Attr(8, "=I"),
    "persist_conns": Attr(9, "=I"),
    "stats": Attr(10, NESTED),
    "addr_family": Attr(11, "=H"),
    "stats64": Attr(12, NESTED),
    "tun_type": Attr(13, "=B"),
    "tun_port": Attr(14, "!H"),
    "tun_flags": Attr(15, "=H"),
}

# enum IPVS_STATS_ATTR_*, in IPVS_SVC_ATTR_STATS64 / IPVS_DEST_ATTR_STATS64 (all u64); the
# kernel's own rate estimates (cps, inpps, ...) are left: rates come from two readings
STATS64: Mapping[str, Attr] = {
    "conns": Attr(1, "=Q"),
    "inpkts": Attr(2, "=Q"),
    "outpkts": Attr(3, "=Q"),
    "inbytes": Attr(4, "=Q"),
    "outbytes": Attr(5, "=Q"),
}

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_GENLHDR = struct.Struct("=BBH")  # cmd, version, reserved
_NLAHDR = struct.Struct("=HH")  # len, type
_HEADER_LEN = _NLMSGHDR.size + _GENLHDR.size
_FORMATS = {attr.layout: struct.Struct(attr.layout) for t in (COMMAND, SERVICE, DEST, STATS64)
            for attr in t.values() if attr.layout not in (ADDRESS, STRING, NESTED)}  # fmt: skip
# per space: attribute number -> (name, its struct or None, layout), for `unpack`
_BY_KIND = {id(t): {a.kind: (name, _FORMATS.get(a.layout), a.layout) for name, a in t.items()}
            for t in (COMMAND, SERVICE, DEST, STATS64)}  # fmt: skip


# ---- framing ----------------------------------------------------------------------------


def nla(kind: int, payload: bytes) -> bytes:
    """One attribute, padded to 4 bytes."""
    length = _NLAHDR.size + len(payload)
    return _NLAHDR.pack(length, kind) + payload + b"\0" * (-length & 3)


def message(family: int, cmd: int, attrs: bytes, *, seq: int, flags: int) -> bytes:
    """A generic-netlink request: nlmsghdr + genlmsghdr + attributes."""
    header = _NLMSGHDR.pack(_HEADER_LEN + len(attrs), family, flags, seq, 0)
    return header + _GENLHDR.pack(cmd, IPVS_GENL_VERSION, 0) + attrs


def messages(buf: bytes) -> Iterator[tuple[int, int, int, memoryview]]:
    """(type, flags, seq, payload after nlmsghdr) for each netlink message in `buf`."""
    view = memoryview(buf)
    offset = 0
    while offset + _NLMSGHDR.size <= len(buf):
        length, kind, flags, seq, _ = _NLMSGHDR.unpack_from(buf, offset)
        if length < _NLMSGHDR.size:
            raise ValueError(f"netlink message with bad length {length}")
        yield kind, flags, seq, view[offset + _NLMSGHDR.size : offset + length]
        offset += (length + 3) & ~3


def error_code(payload: memoryview) -> int:
    """The (positive) errno of an NLMSG_ERROR payload; 0 for an ack."""
    return -int(struct.unpack_from("=i", payload)[0])


def attrs(buf: memoryview, offset: int = 0) -> dict[int, memoryview]:
    """Top-level attributes of `buf` from `offset`: type (flags stripped) -> payload."""
    out: dict[int, memoryview] = {}
    end = len(buf)
    while offset + 4 <= end:
        length, kind = _NLAHDR.unpack_from(buf, offset)
        if length < 4:
            break
        out[kind & NLA_TYPE_MASK] = buf[offset + 4 : offset + length]
        offset += (length + 3) & ~3
    return out


def genl_attrs(payload: memoryview) -> dict[int, memoryview]:
    """Attributes of a generic-netlink message payload (after the genl header)."""
    return attrs(payload, _GENLHDR.size)


def dumped(chunks: Iterable[bytes]) -> Iterator[memoryview]:
    """The payloads of a dump's data messages (the datagrams a socket's `dump` returned)."""
    for chunk in chunks:
        for kind, _, _, payload in messages(chunk):
            if kind >= NLMSG_MIN_TYPE:
                yield payload


def u16(raw: memoryview) -> int:
    return int(struct.unpack_from("=H", raw)[0])


def getfamily_request(name: str, *, seq: int) -> bytes:
    """CTRL_CMD_GETFAMILY for a generic-netlink family name."""
    payload = nla(CTRL_ATTR_FAMILY_NAME, name.encode() + b"\0")
    header = _NLMSGHDR.pack(_HEADER_LEN + len(payload), GENL_ID_CTRL, NLM_F_REQUEST, seq, 0)
    return header + _GENLHDR.pack(CTRL_CMD_GETFAMILY, 1, 0) + payload


# ---- the tables at work -----------------------------------------------------------------


def pack(space: Mapping[str, Attr], values: Sequence[tuple[str, Any]]) -> bytes:
    """Attributes of one space, in the given order: (name, value) with a value of the
    attribute's layout (an int or a tuple for a struct, an address, a str, nested bytes)."""
    out = []
    for name, value in values:
        attr = space[name]
        if attr.layout == ADDRESS:
            out.append(nla(attr.kind, value.packed))
        elif attr.layout == STRING:
            out.append(nla(attr.kind, value.encode() + b"\0"))
        elif attr.layout == NESTED:
            out.append(nla(attr.kind | NLA_F_NESTED, value))
        else:
            fields = value if isinstance(value, tuple) else (value,)
            out.append(nla(attr.kind, _FORMATS[attr.layout].pack(*fields)))
    return b"".join(out)


def unpack(space: Mapping[str, Attr], buf: memoryview) -> dict[str, Any]:
    """The attributes of `buf` this space names: addresses and nests as raw bytes, strings
    decoded, structs unpacked (one field: its value; more: a tuple). Unknown ones skipped.

    One pass over the attributes, each unpacked where it lies: an observation decodes every
    destination of the table (120,000 at 10,000 Services x 10), each a dozen attributes."""
    names = _BY_KIND[id(space)]
    out: dict[str, Any] = {}
    offset, end = 0, len(buf)
    while offset + 4 <= end:
        length, kind = _NLAHDR.unpack_from(buf, offset)
        if length < 4:
            break
        found = names.get(kind & NLA_TYPE_MASK)
        if found is not None:
            name, fmt, layout = found
            if fmt is not None:
                fields = fmt.unpack_from(buf, offset + 4)
                out[name] = fields[0] if len(fields) == 1 else fields
            elif layout == STRING:
                raw = bytes(buf[offset + 4 : offset + length])
                out[name] = raw.split(b"\0", 1)[0].decode("ascii", "replace")
            else:
                out[name] = buf[offset + 4 : offset + length]
        offset += (length + 3) & ~3
    return out


class Run:
    """A run of fixed-size attributes of one space, in one nest, compiled from the table into
    one `struct`: `pack(*values)` lays out the nest's header and each attribute's header,
    value and padding in one call. The messages a sync sends by the ten thousand (a
    destination, a service's key) are such runs; encoding them one attribute at a time
    costs several times as much (the figure: docs/performance.md, "What each kept
    optimisation buys", measured by bench/kept.py).
    An address is given as its packed bytes, a big-endian field as an int."""

    def __init__(
        self, space: Mapping[str, Attr], names: Sequence[str], *, nest: Attr, address: int
    ) -> None:
        fmt = "=HH"
        template: list[Any] = [0, nest.kind | NLA_F_NESTED]
        self._big: list[tuple[int, Any]] = []  # (argument index, host-to-network conversion)
        for name in names:
            attr = space[name]
            layout = attr.layout
            if layout == ADDRESS:
                payload = f"{address}s"
            elif layout in (STRING, NESTED) or len(layout) != 2:
                raise ValueError(f"{name}: not a fixed-size single field ({layout})")
            else:
                payload = layout[1]
                if layout[0] == "!":  # packed in host order after htons/htonl: network order
                    convert = socket.htons if payload == "H" else socket.htonl
                    self._big.append((len(template) + 2, convert))
            size = struct.calcsize("=" + payload)
            fmt += f"HH{payload}{-(4 + size) & 3}x"
            template += [4 + size, attr.kind, None]
        self._struct = struct.Struct(fmt)
        template[0] = self._struct.size
        self._template = template
        # for `unpack`: the headers alone (values skipped), then the values alone
        heads, values = "=2xH", "=4x"
        for at in range(2, len(template), 3):
            size = template[at] - 4
            heads += f"HH{size + (-size & 3)}x"
        for name in names:
            layout = space[name].layout
            payload = f"{address}s" if layout == ADDRESS else layout[1]
            size = struct.calcsize("=" + payload)
            values += f"4x{payload}{-(4 + size) & 3}x"
        self._heads, self._values = struct.Struct(heads), struct.Struct(values)
        self._expected = (nest.kind, *(v for at in range(2, len(template), 3)
                                       for v in (template[at], template[at + 1])))  # fmt: skip
        self._big_values = [(at // 3 - 1, convert) for at, convert in self._big]

    def pack(self, *values: Any) -> bytes:
        args = self._template.copy()
        args[4::3] = values  # each attribute's value after its (length, type)
        for at, convert in self._big:
            args[at] = convert(args[at])
        return self._struct.pack(*args)

    def unpack(self, buf: memoryview, offset: int = 0) -> list[Any] | None:
        """The values of a nest at `offset` that starts with exactly this run, as `pack` lays
        it out (a dump's nest may go on after it: its length is not checked); None when its
        attributes are others, in another order or of other sizes (the caller decodes them
        one at a time then, with `unpack`). The kernel writes a dumped destination's
        attributes in one fixed order (ip_vs_genl_fill_dest): checking that order costs one
        comparison and turns an observation's dozen attribute reads a destination into one.
        Two structs over the run: its headers (the nest's type and each attribute's length
        and type), compared whole with the template's, then its values."""
        if len(buf) - offset < self._struct.size:
            return None
        if self._heads.unpack_from(buf, offset) != self._expected:
            return None
        values = list(self._values.unpack_from(buf, offset))
        for at, convert in self._big_values:
            values[at] = convert(values[at])  # ntohs/ntohl: the same swap as htons/htonl
        return values


def _af(address: IPAddress) -> int:
    return socket.AF_INET6 if address.version == 6 else socket.AF_INET


def _address(af: int, raw: memoryview) -> IPAddress:
    if af == socket.AF_INET:
        return IPv4Address(bytes(raw[:4]))
    return IPv6Address(bytes(raw[:16]))


# ---- services and destinations ----------------------------------------------------------


_KEY = ("af", "protocol", "addr", "port")
_DEST_KEY = ("addr_family", "addr", "port")
_DEST = (*_DEST_KEY, "fwd_method", "weight", "u_thresh", "l_thresh")
# per IP version: the COMMAND-level nest of a service's key, of a destination, of its key
_KEY_RUN = {v: Run(SERVICE, _KEY, nest=COMMAND["service"], address=n) for v, n in ((4, 4), (6, 16))}
_DEST_RUN = {v: Run(DEST, _DEST, nest=COMMAND["dest"], address=n) for v, n in ((4, 4), (6, 16))}
_DEST_KEY_RUN = {
    v: Run(DEST, _DEST_KEY, nest=COMMAND["dest"], address=n) for v, n in ((4, 4), (6, 16))
}


def service_key_attrs(key: VSKey) -> bytes:
    """The attributes that identify a service: AF + FWMARK, or AF + PROTOCOL + ADDR + PORT."""
    if key.fwmark:
        return pack(SERVICE, [("af", _af(key.address)), ("fwmark", key.fwmark)])
    return pack(
        SERVICE,
        [
            ("af", _af(key.address)),
            ("protocol", int(key.proto)),
            ("addr", key.address),
            ("port", key.port),
        ],
    )


def service_attrs(vs: VirtualServer) -> bytes:
    """Key plus settings: NEW/SET_SERVICE need SCHED_NAME, FLAGS, TIMEOUT and NETMASK."""
    # The kernel reads NETMASK as a raw 32-bit value: an IPv4 mask, or for IPv6 a prefix
    # length used unconverted (ip_vs_ctl.c); ipvsadm sends both host-order, so do we.
    netmask = 128 if vs.key.address.version == 6 else 0xFFFFFFFF
    flags = int(vs.flags) & ~ServiceFlags.HASHED
    return service_key_attrs(vs.key) + pack(
        SERVICE,
        [
            ("sched_name", vs.scheduler.value),
            ("flags", (flags, 0xFFFFFFFF)),
            ("timeout", vs.timeout_s),
            ("netmask", netmask),
        ],
    )


def service_nest(key: VSKey) -> bytes:
    """The COMMAND-level nest naming one service (GET_DEST, DEL_SERVICE, *_DEST)."""
    if key.fwmark:
        return pack(COMMAND, [("service", service_key_attrs(key))])
    address = key.address
    return _KEY_RUN[address.version].pack(_af(address), int(key.proto), address.packed, key.port)


def dest_nest(rs: RealServer) -> bytes:
    """The COMMAND-level nest of a destination with its settings (NEW/SET_DEST):
    ADDR_FAMILY (as current ipvsadm sends it), ADDR, PORT, FWD_METHOD, WEIGHT, U_THRESH and
    L_THRESH."""
    address = rs.key.address
    return _DEST_RUN[address.version].pack(
        _af(address),
        address.packed,
        rs.key.port,
        int(rs.forward),
        rs.weight,
        rs.upper_threshold,
        rs.lower_threshold,
    )


def dest_key_nest(key: RSKey) -> bytes:
    """The COMMAND-level nest naming one destination (DEL_DEST)."""
    address = key.address
    return _DEST_KEY_RUN[address.version].pack(_af(address), address.packed, key.port)


IpvsOp = AddService | UpdateService | DeleteService | AddDest | UpdateDest | DeleteDest


def encode_op(op: IpvsOp) -> tuple[int, bytes]:
    """(command, attributes) of the request that performs `op`."""
    return encode_ops([op])[0]


def encode_ops(ops: Sequence[IpvsOp]) -> list[tuple[int, bytes]]:
    """(command, attributes) of each request; a service's key nest is made once for the
    run of operations on it (a plan groups a service's destinations)."""
    out: list[tuple[int, bytes]] = []
    last: VSKey | None = None
    nest = b""
    for op in ops:
        match op:
            case AddDest(key, rs) | UpdateDest(key, rs):
                if key is not last:
                    last, nest = key, service_nest(key)
                cmd = CMD_NEW_DEST if op.__class__ is AddDest else CMD_SET_DEST
                out.append((cmd, nest + dest_nest(rs)))
            case DeleteDest(key, rs_key):
                if key is not last:
                    last, nest = key, service_nest(key)
                out.append((CMD_DEL_DEST, nest + dest_key_nest(rs_key)))
            case AddService(vs) | UpdateService(vs):
                cmd = CMD_NEW_SERVICE if op.__class__ is AddService else CMD_SET_SERVICE
                out.append((cmd, pack(COMMAND, [("service", service_attrs(vs))])))
            case DeleteService(key):
                out.append((CMD_DEL_SERVICE, service_nest(key)))
            case _:  # pragma: no cover
                raise TypeError(f"not an IPVS operation: {op!r}")
    return out


def decode_service(payload: memoryview) -> VirtualServer | None:
    """A dumped service (a GET_SERVICE reply's payload). None for one ipvsproxy cannot model
    (a scheduler or protocol it does not know): never ipvsproxy's, so left out of observed
    state and never touched."""
    nested = unpack(COMMAND, payload[_GENLHDR.size :]).get("service")
    if nested is None:
        return None
    a = unpack(SERVICE, nested)
    try:
        af, scheduler = a["af"], Scheduler(a["sched_name"])
        flags = a["flags"][0] & ~ServiceFlags.HASHED  # the kernel sets HASHED on every one
        if a.get("fwmark"):
            zero = IPv6Address(0) if af == socket.AF_INET6 else IPv4Address(0)
            key = VSKey(zero, 0, Proto.TCP, a["fwmark"])
        else:
            key = VSKey(_address(af, a["addr"]), a["port"], Proto(a["protocol"]))
    except (KeyError, ValueError):
        return None
    timeout = a.get("timeout", 0) if flags & ServiceFlags.PERSISTENT else 0
    return VirtualServer(key, scheduler, ServiceFlags(flags), timeout)


# a dumped destination's attributes up to its statistics, in the kernel's order
# (ip_vs_genl_fill_dest since Linux 5.3, which added the tunnel attributes); an address is
# dumped as 16 bytes whatever its family
_DUMPED_DEST = (
    "addr", "port", "fwd_method", "weight", "tun_type", "tun_port", "tun_flags", "u_thresh",
    "l_thresh", "active_conns", "inact_conns", "persist_conns", "addr_family",
)  # fmt: skip
_DUMPED_DEST_RUN = Run(DEST, _DUMPED_DEST, nest=COMMAND["dest"], address=16)


def decode_dest(payload: memoryview, service_af: int) -> tuple[RealServer, int, int]:
    """A dumped destination (a GET_DEST reply's payload) -> (RealServer, active connections,
    inactive connections): the one decoding of a destination, for the table and for the
    counters (`decode_dest_traffic`). Its address family is the service's unless it says
    otherwise.

    An idle resync decodes every destination of the table (100,000 at 10,000 Services x 10,
    every sync period): laid out as the kernel writes them, in one struct (`Run.unpack`),
    several times cheaper than attribute by attribute (docs/performance.md, "What each kept
    optimisation buys"); any other layout, attribute by attribute."""
    run = _DUMPED_DEST_RUN.unpack(payload, _GENLHDR.size)
    if run is not None:
        addr, port, fwd, weight, _, _, _, upper, lower, active, inactive, _, af = run
        key = RSKey(_address(af, addr), port)
        return RealServer(key, weight, Forward(fwd & FWD_MASK), upper, lower), active, inactive
    return _decode_dest_attributes(payload, service_af)


def _decode_dest_attributes(payload: memoryview, service_af: int) -> tuple[RealServer, int, int]:
    """`decode_dest` one attribute at a time: for any order and any kernel."""
    a = _dest(payload)
    key = RSKey(_address(a.get("addr_family", service_af), a["addr"]), a["port"])
    rs = RealServer(
        key,
        weight=a["weight"],
        forward=Forward(a["fwd_method"] & FWD_MASK),
        upper_threshold=a["u_thresh"],
        lower_threshold=a["l_thresh"],
    )
    return rs, a.get("active_conns", 0), a.get("inact_conns", 0)


def decode_dest_traffic(payload: memoryview, service_af: int) -> tuple[RSKey, DestTraffic]:
    """A dumped destination's key, connection counts (`decode_dest`) and counters."""
    rs, active, inactive = decode_dest(payload, service_af)
    stats = attrs(_dest_nest(payload)).get(DEST["stats64"].kind)  # what decode_dest leaves
    return rs.key, DestTraffic(active, inactive, counters(stats))


def decode_service_traffic(payload: memoryview) -> tuple[VSKey, Counters] | None:
    """A dumped service's key and counters; None where decode_service gives None."""
    vs = decode_service(payload)
    if vs is None:
        return None
    nested = unpack(COMMAND, payload[_GENLHDR.size :])["service"]
    return vs.key, counters(unpack(SERVICE, nested).get("stats64"))


def counters(nest: memoryview | None) -> Counters:
    """The STATS64 nest of a service or destination (all zero without one: kernels before
    4.0 send only the 32-bit STATS nest, whose counters wrap)."""
    if nest is None:
        return Counters()
    s = unpack(STATS64, nest)
    return Counters(
        s.get("conns", 0), s.get("inpkts", 0), s.get("outpkts", 0),
        s.get("inbytes", 0), s.get("outbytes", 0),
    )  # fmt: skip


def _dest_nest(payload: memoryview) -> memoryview:
    return unpack(COMMAND, payload[_GENLHDR.size :])["dest"]  # type: ignore[no-any-return]


def _dest(payload: memoryview) -> dict[str, Any]:
    return unpack(DEST, _dest_nest(payload))


def family_af(key: VSKey) -> int:
    return _af(key.address)


def timeouts_attrs(tcp: int, tcp_fin: int, udp: int) -> bytes:
    """SET_CONFIG attributes; 0 leaves a timeout unchanged (the kernel skips zeros)."""
    return pack(COMMAND, [("timeout_tcp", tcp), ("timeout_tcp_fin", tcp_fin), ("timeout_udp", udp)])
