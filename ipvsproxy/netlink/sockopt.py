"""IPv4 virtual servers read through the kernel's legacy getsockopt interface.

Why: a periodic resync observes the whole table, and over generic netlink that is one dump
per service for its destinations (a request, at least two datagrams, a message per
destination). The older interface that `ipvsadm` also speaks (linux/ip_vs.h `IP_VS_SO_GET_*`,
net/netfilter/ipvs/ip_vs_ctl.c `do_ip_vs_get_ctl`) answers one `getsockopt` with all of a
service's destinations as one flat array of fixed-size C structs, which `struct.iter_unpack`
cuts up in C. notes/netlink-ipvs.md measured a dump this way at 0.06x `ipvsadm -S -n`.

What the interface cannot do, and how it is handled (NetlinkKernel.observe combines them):
- It lists only AF_INET services; IPv6 services come from the netlink service dump, and so
  do firewall-mark services (by choice: one path for them).
- It skips a service's destinations of the other family (mixed-family tunnels), and it
  returns what fits in the buffer. A service whose destination count is not the one the
  service list gave (such destinations, or a change in between) is read over netlink.
- The buffer length must be exact (`sizeof(header) + n * sizeof(entry)`): the layouts below
  are ctypes copies of the kernel's structs, so they carry this platform's C alignment.
- It answers for the network namespace the socket was created in: open it where the
  netlink sockets are opened. It needs CAP_NET_ADMIN (EPERM otherwise) and the ip_vs module
  (ENOPROTOOPT otherwise); `Unavailable` then tells the caller to use netlink alone.

Any IPv4 socket reaches the interface (ip_getsockopt hands unknown options to netfilter);
a UDP socket is used, which unlike ipvsadm's raw socket needs no CAP_NET_RAW.

Imports: fast (the slot builders), model, schedulers, the standard library.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct
from collections.abc import Iterable, Sequence
from ipaddress import IPv4Address
from typing import Any

from ipvsproxy.model import Forward, Proto, RealServer, RSKey, ServiceFlags, VirtualServer, VSKey
from ipvsproxy.netlink.fast import (
    _ipv4,
    _new,
    _rs_forward,
    _rs_key,
    _rs_key_address,
    _rs_key_port,
    _rs_lower,
    _rs_upper,
    _rs_weight,
)
from ipvsproxy.schedulers import Scheduler

# linux/ip_vs.h
IP_VS_BASE_CTL = 64 + 1024 + 64
IP_VS_SO_GET_INFO = IP_VS_BASE_CTL + 1
IP_VS_SO_GET_SERVICES = IP_VS_BASE_CTL + 2
IP_VS_SO_GET_SERVICE = IP_VS_BASE_CTL + 3
IP_VS_SO_GET_DESTS = IP_VS_BASE_CTL + 4
SOL_IP = 0

u16, u32, u64 = ctypes.c_uint16, ctypes.c_uint32, ctypes.c_uint64


class _Stats(ctypes.Structure):  # struct ip_vs_stats_user
    _fields_ = [("conns", u32), ("inpkts", u32), ("outpkts", u32), ("inbytes", u64),
                ("outbytes", u64), ("cps", u32), ("inpps", u32), ("outpps", u32),
                ("inbps", u32), ("outbps", u32)]  # fmt: skip


class _GetInfo(ctypes.Structure):  # struct ip_vs_getinfo
    _fields_ = [("version", ctypes.c_uint), ("size", ctypes.c_uint),
                ("num_services", ctypes.c_uint)]  # fmt: skip


class _ServiceEntry(ctypes.Structure):  # struct ip_vs_service_entry
    _fields_ = [("protocol", u16), ("addr", u32), ("port", u16), ("fwmark", u32),
                ("sched_name", ctypes.c_char * 16), ("flags", ctypes.c_uint),
                ("timeout", ctypes.c_uint), ("netmask", u32), ("num_dests", ctypes.c_uint),
                ("stats", _Stats)]  # fmt: skip


class _GetServices(ctypes.Structure):  # struct ip_vs_get_services
    _fields_ = [("num_services", ctypes.c_uint), ("entrytable", _ServiceEntry * 0)]


class _DestEntry(ctypes.Structure):  # struct ip_vs_dest_entry
    _fields_ = [("addr", u32), ("port", u16), ("conn_flags", ctypes.c_uint),
                ("weight", ctypes.c_int), ("u_threshold", u32), ("l_threshold", u32),
                ("activeconns", u32), ("inactconns", u32), ("persistconns", u32),
                ("stats", _Stats)]  # fmt: skip


class _GetDests(ctypes.Structure):  # struct ip_vs_get_dests
    _fields_ = [("protocol", u16), ("addr", u32), ("port", u16), ("fwmark", u32),
                ("num_dests", ctypes.c_uint), ("entrytable", _DestEntry * 0)]  # fmt: skip


def _format(cls: Any, fields: Sequence[tuple[str, str]], *, size: int | None = None) -> str:
    """A little-endian-free `struct` format reading `fields` (name, code) of the ctypes
    struct `cls` at their C offsets, padded to `size` (default: the struct's size)."""
    out, position = "=", 0
    for name, code in fields:
        offset = getattr(cls, name).offset
        out += f"{offset - position}x" if offset > position else ""
        out += code
        position = offset + struct.calcsize("=" + code)
    end = ctypes.sizeof(cls) if size is None else size
    return out + (f"{end - position}x" if end > position else "")


# address and port are big-endian on the wire; read as bytes
_SERVICE = struct.Struct(
    _format(
        _ServiceEntry,
        [
            ("protocol", "H"),
            ("addr", "4s"),
            ("port", "2s"),
            ("fwmark", "I"),
            ("sched_name", "16s"),
            ("flags", "I"),
            ("timeout", "I"),
            ("num_dests", "I"),
        ],
    )  # fmt: skip
)
_SETTINGS = [
    ("addr", "4s"),
    ("port", "2s"),
    ("conn_flags", "I"),
    ("weight", "i"),
    ("u_threshold", "I"),
    ("l_threshold", "I"),
]  # a destination's settings; the connection counts follow them in the kernel's struct
_DEST_SETTINGS = struct.Struct(_format(_DestEntry, _SETTINGS))
_DEST_FULL = struct.Struct(
    _format(
        _DestEntry,
        [*_SETTINGS, ("activeconns", "I"), ("inactconns", "I")],
    )  # fmt: skip
)
_GET_DESTS = struct.Struct(
    _format(
        _GetDests,
        [("protocol", "H"), ("addr", "4s"), ("port", "2s"), ("fwmark", "I"), ("num_dests", "I")],
        size=_GetDests.entrytable.offset,
    )  # fmt: skip
)
_NUM = struct.Struct("=I")
_INFO_SIZE = ctypes.sizeof(_GetInfo)
_SERVICES_HEAD = _GetServices.entrytable.offset
_SERVICE_SIZE = ctypes.sizeof(_ServiceEntry)
_DESTS_HEAD = _GetDests.entrytable.offset
_DEST_SIZE = ctypes.sizeof(_DestEntry)
# Entries are written from the first slot on; slots the kernel left alone keep this filler.
# A written service's protocol is TCP, UDP or SCTP and a written weight is >= 0, never
# all ones, so the filler marks where the written entries end.
_FILL = 0xFF
_PROTOCOL_AT = _ServiceEntry.protocol.offset
_WEIGHT_AT = _DestEntry.weight.offset
_UNUSED = bytes([_FILL]) * 4  # a weight slot the kernel did not write

_SCHEDULERS = {s.value.encode(): s for s in Scheduler}
_PROTOS = {int(p): p for p in Proto}
_FORWARD = {int(f): f for f in Forward}
_NOT_HASHED, _PERSISTENT = ~int(ServiceFlags.HASHED), int(ServiceFlags.PERSISTENT)

DestEntry = tuple[RealServer, int, int]  # destination, active, inactive connections


def lists(key: VSKey) -> bool:
    """Whether this interface lists the service (IPv4, not by firewall mark)."""
    return not key.fwmark and type(key.address) is IPv4Address


class Unavailable(Exception):
    """The legacy interface cannot be used here (no CAP_NET_ADMIN, no ip_vs, a refusal)."""


class SockoptReader:
    """IPv4 services and their destinations over `getsockopt(IP_VS_SO_GET_*)`.

    Keeps the objects of the last observation by their settings, as fast.DestDecoder does:
    a resync of an unchanged table builds none.
    """

    def __init__(self) -> None:
        try:
            self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        except OSError as exc:
            raise Unavailable(f"cannot open an IPv4 socket: {exc}") from exc
        self._fd = self._sock.fileno()
        self._buf = ctypes.create_string_buffer(0)
        self._view = memoryview(self._buf).cast("B")
        # a resync asks for every service's destinations: per service the request's header,
        # per slot count the filler of its entries, built once (the call is the hot path)
        self._headers: dict[VSKey, tuple[int, bytes]] = {}
        self._fillers: dict[int, bytes] = {}
        self._size = ctypes.c_uint32()
        self._size_ref = ctypes.byref(self._size)  # made once: the call is the hot path
        self._services: dict[tuple[Any, ...], VirtualServer] = {}
        self._cache: dict[tuple[Any, ...], RealServer] = {}
        self._previous: dict[tuple[Any, ...], RealServer] = {}
        # per service, the bytes of its destination array last read and what they decoded
        # to: an idle resync finds most arrays byte-equal (the counters too: no traffic)
        # and decodes none of them
        self._arrays: dict[VSKey, tuple[bytes, dict[RSKey, RealServer]]] = {}
        self._arrays_previous: dict[VSKey, tuple[bytes, dict[RSKey, RealServer]]] = {}
        # objects ipvsproxy wrote since the last observation, and those the current one may
        # return in place of equal decoded ones (see wrote())
        self._written: list[list[Any]] = []
        self._canonical: dict[Any, Any] = {}

    def close(self) -> None:
        self._sock.close()

    # ---- the calls ----------------------------------------------------------------------

    def _room(self, size: int) -> memoryview:
        if len(self._buf) < size:
            self._buf = ctypes.create_string_buffer(max(size, 2 * len(self._buf)))
            self._view = memoryview(self._buf).cast("B")
        return self._view

    def _get(self, option: int, size: int) -> int:
        """getsockopt(SOL_IP, option) on the first `size` bytes of the buffer; 0 or errno."""
        self._size.value = size
        if _getsockopt(self._fd, SOL_IP, option, self._buf, self._size_ref):
            return ctypes.get_errno()
        return 0

    def _slots(self, view: memoryview, head: int, size: int, count: int) -> None:
        view[head : head + size * count] = bytes([_FILL]) * (size * count)

    # ---- services -----------------------------------------------------------------------

    def services(self) -> list[tuple[VirtualServer, int]]:
        """IPv4 address/port services (no firewall-mark ones) with their destination counts.

        Services ipvsproxy cannot model (an unknown scheduler or protocol) are left out,
        as fast.ServiceDecoder leaves them out. Raises Unavailable.
        """
        for _ in range(8):  # the table grew while we looked: ask again
            view = self._room(_INFO_SIZE)
            code = self._get(IP_VS_SO_GET_INFO, _INFO_SIZE)
            if code:
                raise Unavailable(f"IP_VS_SO_GET_INFO: {_error(code)}")
            # 6.1 counts services of every family, newer kernels IPv4 ones: a bound either way
            slots = _NUM.unpack_from(view, _GetInfo.num_services.offset)[0] + 1
            size = _SERVICES_HEAD + slots * _SERVICE_SIZE
            view = self._room(size)
            _NUM.pack_into(view, 0, slots)
            self._slots(view, _SERVICES_HEAD, _SERVICE_SIZE, slots)
            code = self._get(IP_VS_SO_GET_SERVICES, size)
            if code:
                raise Unavailable(f"IP_VS_SO_GET_SERVICES: {_error(code)}")
            written = _written(view, _SERVICES_HEAD, _SERVICE_SIZE, slots, _PROTOCOL_AT, 2)
            if written < slots:
                return self._decode_services(
                    view[_SERVICES_HEAD : _SERVICES_HEAD + written * _SERVICE_SIZE]
                )
        raise Unavailable("IP_VS_SO_GET_SERVICES: the table kept growing")

    def _decode_services(self, view: memoryview) -> list[tuple[VirtualServer, int]]:
        previous, self._services = self._services, {}
        out = []
        for fields in _SERVICE.iter_unpack(view):
            settings, count = fields[:-1], fields[-1]
            if settings[3]:  # fwmark: read over netlink
                continue
            vs = previous.get(settings)
            if vs is None:
                vs = _service(settings)
                if vs is None:
                    continue
                vs = self._canonical.get(vs, vs)
            self._services[settings] = vs
            out.append((vs, count))
        return out

    # ---- destinations -------------------------------------------------------------------

    def _dests(self, key: VSKey, count: int) -> memoryview | None:
        """The `count` destination entries of an IPv4 service, or None if the kernel did
        not write exactly `count` (see the module docstring). Raises LookupError if the
        service is gone (ESRCH), Unavailable on any other refusal."""
        slots = max(count, 0) + 1  # one spare slot: a destination added since the count shows
        size = _DESTS_HEAD + slots * _DEST_SIZE
        known = self._headers.get(key)
        if known is None or known[0] != slots:
            known = (
                slots,
                _GET_DESTS.pack(
                    key.proto, key.address.packed, key.port.to_bytes(2, "big"), 0, slots
                ),
            )
            self._headers[key] = known
        filler = self._fillers.get(slots)
        if filler is None:
            filler = self._fillers[slots] = bytes([_FILL]) * (slots * _DEST_SIZE)
        view = self._room(size)
        view[:_DESTS_HEAD] = known[1]
        view[_DESTS_HEAD:size] = filler
        code = self._get(IP_VS_SO_GET_DESTS, size)
        if code == errno.ESRCH:
            raise LookupError(str(key))
        if code:
            raise Unavailable(f"IP_VS_SO_GET_DESTS {key}: {_error(code)}")
        # written from the first slot on: exactly `count` when the spare slot kept its
        # filler and the one before it (if any) did not
        end = _DESTS_HEAD + count * _DEST_SIZE
        if view[end + _WEIGHT_AT : end + _WEIGHT_AT + 4] != _UNUSED or (
            count
            and view[end - _DEST_SIZE + _WEIGHT_AT : end - _DEST_SIZE + _WEIGHT_AT + 4] == _UNUSED
        ):
            return None
        return view[_DESTS_HEAD:end]

    def start_round(self) -> None:
        self._previous, self._cache = self._cache, {}
        self._arrays_previous, self._arrays = self._arrays, {}
        # hashed here, not as they are written: a cold sync writes 13,000, and a process
        # that observes no more (run --once) would hash them for nothing (0.25 s in the VM)
        self._canonical = {obj: obj for objects in self._written for obj in objects}
        self._written = []

    def wrote(self, objects: Iterable[VirtualServer | RealServer]) -> None:
        """The services and destinations just written to the kernel. The next observation
        returns these very objects where it decodes equal ones, so the planner's comparison
        of desired (which holds them) and observed state takes the identity fast path:
        together with the byte-equal arrays, an idle resync compares 13,000 destinations
        at C speed instead of by Python `__eq__` calls (0.19 s in the VM with the
        generated ones, see model.same_address)."""
        self._written.append(list(objects))

    def mapping(self, key: VSKey, count: int) -> dict[RSKey, RealServer] | None:
        """A service's destinations by key (the hot path of observe()); None: ask netlink.
        Raises LookupError if the service is gone."""
        view = self._dests(key, count)
        if view is None:
            return None
        raw = bytes(view)
        last = self._arrays_previous.get(key)
        if last is not None and last[0] == raw:  # not one byte changed, counters included
            self._arrays[key] = last
            return dict(last[1])
        out: dict[RSKey, RealServer] = {}
        previous, cache = self._previous, self._cache
        for settings in _DEST_SETTINGS.iter_unpack(view):
            rs = previous.get(settings)
            if rs is None:
                rs = _real_server(*settings)
                rs = self._canonical.get(rs, rs)
            cache[settings] = rs
            out[rs.key] = rs
        self._arrays[key] = (raw, out)
        return dict(out)

    def entries(self, key: VSKey) -> list[DestEntry] | None:
        """A service's destinations with (active, inactive) connection counts; None: ask
        netlink (also for a service this interface does not list)."""
        if not lists(key):
            return None
        size = _SERVICE_SIZE
        view = self._room(size)
        self._slots(view, 0, size, 1)
        struct.pack_into("=H", view, _PROTOCOL_AT, key.proto)
        view[_ServiceEntry.addr.offset : _ServiceEntry.addr.offset + 4] = key.address.packed
        view[_ServiceEntry.port.offset : _ServiceEntry.port.offset + 2] = key.port.to_bytes(
            2, "big"
        )
        _NUM.pack_into(view, _ServiceEntry.fwmark.offset, 0)
        code = self._get(IP_VS_SO_GET_SERVICE, size)
        if code == errno.ESRCH:
            return []
        if code:
            raise Unavailable(f"IP_VS_SO_GET_SERVICE {key}: {_error(code)}")
        count = _SERVICE.unpack_from(view)[-1]
        try:
            dests = self._dests(key, count)
        except LookupError:
            return []
        if dests is None:
            return None
        out = []
        for addr, port, flags, weight, upper, lower, active, inactive in _DEST_FULL.iter_unpack(
            dests
        ):
            out.append((_real_server(addr, port, flags, weight, upper, lower), active, inactive))
        return out


def _written(view: memoryview, head: int, size: int, slots: int, at: int, width: int) -> int:
    """How many entries the kernel wrote: the first slot still holding the filler ends them.
    The usual answer is slots - 1 (the spare slot unused): checked first."""
    filler = bytes([_FILL]) * width

    def used(i: int) -> bool:
        start = head + i * size + at
        return view[start : start + width] != filler

    if used(slots - 1):
        return slots
    if slots == 1 or used(slots - 2):
        return slots - 1
    low, high = 0, slots - 2  # used(low - 1) or low == 0; not used(high)
    while low < high:
        middle = (low + high) // 2
        if used(middle):
            low = middle + 1
        else:
            high = middle
    return low


def _service(settings: tuple[Any, ...]) -> VirtualServer | None:
    """A VirtualServer from an entry's (protocol, addr, port, fwmark, sched, flags, timeout),
    as fast.ServiceDecoder builds it from netlink attributes (HASHED masked off, a timeout
    only with PERSISTENT); None for what ipvsproxy cannot model."""
    protocol, addr, port, _, sched, flags, timeout = settings
    scheduler = _SCHEDULERS.get(sched.split(b"\0", 1)[0])
    proto = _PROTOS.get(protocol)
    if scheduler is None or proto is None:
        return None
    flags &= _NOT_HASHED
    key = VSKey(_ipv4(addr), int.from_bytes(port, "big"), proto)
    return VirtualServer(key, scheduler, ServiceFlags(flags), timeout if flags & _PERSISTENT else 0)


def _real_server(
    addr: bytes, port: bytes, flags: int, weight: int, upper: int, lower: int, *_: int
) -> RealServer:
    """Built through the slots, as fast.DestDecoder builds them (half a constructor's cost:
    a first observation meets every destination once)."""
    key = _new(RSKey)
    _rs_key_address(key, _ipv4(addr))
    _rs_key_port(key, int.from_bytes(port, "big"))
    rs = _new(RealServer)
    _rs_key(rs, key)
    _rs_weight(rs, weight)
    _rs_forward(rs, _FORWARD[flags & 7])
    _rs_upper(rs, upper)
    _rs_lower(rs, lower)
    return rs


def _error(code: int) -> str:
    return f"{errno.errorcode.get(code, str(code))} ({os.strerror(code)})"


_libc = ctypes.CDLL(None, use_errno=True)
_getsockopt = _libc.getsockopt
# No argtypes: ctypes then passes the three ints as C ints and the buffer and the size's
# byref() as pointers, as getsockopt(2) takes them, without checking each argument's type
# on every call (0.8 us a call instead of 2.1 natively; an idle resync makes one per
# service). Every call is _get()'s, with exactly these types.
_getsockopt.restype = ctypes.c_int
