"""Value types of IPVS state and the operations that change it, with kernel semantics.

Owns: identity keys (`VSKey`, `RSKey`) kept apart from settings (`VirtualServer`,
`RealServer`); `IpvsState`, the one type for desired and observed state; the `Op` union;
and `transition(state, op)`, the kernel's behaviour as a pure function (what `FakeKernel`
executes and what the planner is property-tested against).

Imports: schedulers, errors, the standard library.
"""

from __future__ import annotations

import enum
import socket
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass, field, fields
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address
from socket import inet_ntoa
from typing import Protocol

from ipvsproxy.errors import AlreadyExists, NotFound
from ipvsproxy.schedulers import SchedFlag, Scheduler

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network


class Proto(enum.IntEnum):
    """Transport protocols a virtual server can balance (IPPROTO_* numbers)."""

    TCP = socket.IPPROTO_TCP
    UDP = socket.IPPROTO_UDP
    SCTP = socket.IPPROTO_SCTP


class ServiceFlags(enum.IntFlag):
    """Virtual service flags (linux/ip_vs.h IP_VS_SVC_F_*). HASHED is never stored."""

    PERSISTENT = 0x0001
    HASHED = 0x0002
    ONEPACKET = 0x0004
    SCHED1 = SchedFlag.SCHED1.value
    SCHED2 = SchedFlag.SCHED2.value
    SCHED3 = SchedFlag.SCHED3.value


SCHED_FLAGS = ServiceFlags.SCHED1 | ServiceFlags.SCHED2 | ServiceFlags.SCHED3


class Forward(enum.IntEnum):
    """Destination forwarding method (IP_VS_CONN_F_FWD_MASK values)."""

    MASQ = 0  # NAT: what a Kubernetes proxy needs (the destination port may differ)
    LOCAL = 1
    TUNNEL = 2
    ROUTE = 3  # direct routing (pyroute2's default, wrong for us)


@dataclass(frozen=True, slots=True)
class VSKey:
    """Identity of a virtual server: address, port, protocol (fwmark services: the mark).

    Ordered IPv4 before IPv6 (ipaddress objects of two families do not compare).
    """

    address: IPAddress
    port: int
    proto: Proto
    fwmark: int = 0  # non-zero only for firewall-mark services (never ipvsproxy's own)
    # Worked out once: a virtual server's key is looked up ~20 times per resync (observing,
    # planning, the companion), 22,800 hashes in an idle one at 1000x10, each a Python call.
    # As RSKey.__hash__, from the address's integer (IPv4Address.__hash__ is Python code).
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        key = (self.address._ip, self.port, self.proto, self.fwmark)  # type: ignore[union-attr]
        object.__setattr__(self, "_hash", hash(key))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        # What dataclass would generate, in one call: its tuple comparison calls
        # IPv4Address.__eq__ (Python code) for every two equal keys that are not one object,
        # as a dict lookup of a decoded key in the desired state does (see same_address).
        if other.__class__ is not VSKey:
            return NotImplemented
        return (
            self.port == other.port
            and self.proto == other.proto
            and self.fwmark == other.fwmark
            and same_address(self.address, other.address)
        )

    def __lt__(self, other: VSKey) -> bool:
        return vs_order(self) < vs_order(other)

    def __str__(self) -> str:
        if self.fwmark:
            family = " IPv6" if self.address.version == 6 else ""
            return f"FWM {self.fwmark}{family}"
        return f"{self.proto.name} {host_port(self.address, self.port)}"


@dataclass(frozen=True, slots=True)
class VirtualServer:
    """Settings of a virtual server; compared with ==. HASHED is masked off on decode."""

    key: VSKey
    scheduler: Scheduler = Scheduler.RR
    flags: ServiceFlags = ServiceFlags(0)
    timeout_s: int = 0  # persistence timeout; meaningful with PERSISTENT


@dataclass(frozen=True, slots=True)
class RSKey:
    """Identity of a real server (destination) within its virtual server."""

    address: IPAddress
    port: int

    def __hash__(self) -> int:
        # What dataclass would generate, hash((address, port)), calls IPv4Address.__hash__,
        # itself Python code (hash(hex(int(self._ip)))); observing and planning hash every
        # destination's key, 10,000s of times per sync of a large cluster. The address's
        # integer gives equal keys equal hashes just the same (checked at import below).
        return hash((self.address._ip, self.port))  # type: ignore[union-attr]

    def __eq__(self, other: object) -> bool:  # as VSKey.__eq__
        if other.__class__ is not RSKey:
            return NotImplemented
        return self.port == other.port and same_address(self.address, other.address)

    def __lt__(self, other: RSKey) -> bool:
        return rs_order(self) < rs_order(other)

    def __str__(self) -> str:
        return host_port(self.address, self.port)


def same_address(a: IPAddress, b: IPAddress) -> bool:
    """`a == b` for two ipaddress addresses without IPv4Address.__eq__ (Python code): the
    same object, or the same class and integer."""
    return a is b or (a._ip == b._ip and a.__class__ is b.__class__)  # type: ignore[union-attr]


def _check_address_integers() -> None:
    for address in (IPv4Address("192.0.2.1"), IPv6Address("2001:db8::1")):
        if getattr(address, "_ip", None) != int(address):  # pragma: no cover
            raise ImportError("ipaddress objects no longer hold their integer in _ip:"
                              " RSKey.__hash__ needs changing")  # fmt: skip


_check_address_integers()


# An IPv4Address built through its one slot (`_ip`, an int), skipping the constructor's type
# dispatch and range check (0.8 us instead of 1.4 us natively): every endpoint address parsed
# (api.py) and every destination address of a first observation (netlink/fast.py) is a new
# one. The first 4 bytes always fit. If a Python release changes IPv4Address's internals,
# the self-check below falls back to the constructor.
ipv4_set_ip = IPv4Address.__dict__["_ip"].__set__ if "_ip" in IPv4Address.__dict__ else None


def _ipv4_by_slot(raw: bytes) -> IPv4Address:
    address = object.__new__(IPv4Address)
    ipv4_set_ip(address, int.from_bytes(raw[:4], "big"))  # type: ignore[misc]
    return address


def _ipv4_by_constructor(raw: bytes) -> IPv4Address:
    return IPv4Address(raw[:4])


def _pick_ipv4() -> Callable[[bytes], IPv4Address]:
    sample = b"\xc0\x00\x02\x81" + bytes(12)
    try:
        fast, slow = _ipv4_by_slot(sample), _ipv4_by_constructor(sample)
        if (fast, hash(fast), str(fast), fast.packed) == (slow, hash(slow), str(slow), slow.packed):
            return _ipv4_by_slot
    except (TypeError, AttributeError):  # pragma: no cover
        pass
    return _ipv4_by_constructor  # pragma: no cover


ipv4_from_packed: Callable[[bytes], IPv4Address] = _pick_ipv4()


@dataclass(frozen=True, slots=True)
class RealServer:
    """Settings of a destination. Weight 0 = draining. No connection counters here."""

    key: RSKey
    weight: int = 1
    forward: Forward = Forward.MASQ
    upper_threshold: int = 0
    lower_threshold: int = 0

    def __eq__(self, other: object) -> bool:
        # As VSKey.__eq__, and the key compared inline: an idle resync of a table this
        # process did not write compares each of 12,000 destinations at 1000x10 by value.
        if other.__class__ is not RealServer:
            return NotImplemented
        a, b = self.key, other.key
        return (
            self.weight == other.weight
            and self.forward == other.forward
            and self.upper_threshold == other.upper_threshold
            and self.lower_threshold == other.lower_threshold
            and (a is b or (a.port == b.port and same_address(a.address, b.address)))
        )


Dests = Mapping[RSKey, RealServer]

# The slot descriptors' setters of RSKey and RealServer, in field order: objects built
# through them skip the generated __init__ (here and in netlink/fast.py's decoder).
RSKEY_SETTERS = tuple(RSKey.__dict__[name].__set__ for name in ("address", "port"))
REAL_SERVER_SETTERS = tuple(
    RealServer.__dict__[name].__set__
    for name in ("key", "weight", "forward", "upper_threshold", "lower_threshold")
)
_key_address, _key_port = RSKEY_SETTERS
_rs_key, _rs_weight, _rs_forward, _rs_upper, _rs_lower = REAL_SERVER_SETTERS


class Addressed(Protocol):
    """Anything with an address (an endpoint view): what `destinations()` reads."""

    @property
    def address(self) -> IPAddress: ...


def destinations(pairs: Iterable[tuple[Addressed, int]]) -> dict[RSKey, RealServer]:
    """{key: RealServer(key)} for each (endpoint, port number), keys RSKey(address, port),
    built through the slot descriptors rather than the generated __init__s, which call
    object.__setattr__ once per field (half the cost, as in netlink/fast.py), in one loop:
    a translation's innermost one, 12,000 turns at 1000x10. Checked at import."""
    out: dict[RSKey, RealServer] = {}
    new, masq = object.__new__, Forward.MASQ
    set_address, set_port, set_key, set_weight = _key_address, _key_port, _rs_key, _rs_weight
    set_forward, set_upper, set_lower = _rs_forward, _rs_upper, _rs_lower
    for holder, port in pairs:
        key = new(RSKey)
        set_address(key, holder.address)
        set_port(key, port)
        rs = new(RealServer)
        set_key(rs, key)
        set_weight(rs, 1)
        set_forward(rs, masq)
        set_upper(rs, 0)
        set_lower(rs, 0)
        out[key] = rs
    return out


def _check_destination() -> None:
    sample = IPv4Address("192.0.2.1")
    if destinations([(RSKey(sample, 80), 81)]) != {  # pragma: no cover
        RSKey(sample, 81): RealServer(RSKey(sample, 81))
    }:
        raise ImportError("model.destinations no longer builds what RealServer(RSKey()) does")
    if tuple(f.name for f in fields(RealServer)) != (  # pragma: no cover
        "key",
        "weight",
        "forward",
        "upper_threshold",
        "lower_threshold",
    ):
        raise ImportError("model.destinations needs changing: RealServer's fields changed")


_check_destination()


@dataclass(frozen=True, slots=True)
class IpvsState:
    """The IPVS table (and bound VIPs) as wanted or as seen; treated as immutable.

    Every key of `services` has an entry in `dests` (possibly empty) and vice versa.
    """

    services: Mapping[VSKey, VirtualServer] = field(default_factory=dict)
    dests: Mapping[VSKey, Dests] = field(default_factory=dict)
    bound: frozenset[IPAddress] = frozenset()  # VIPs on the dummy device (IPVS backend)


EMPTY = IpvsState()


def state_of(
    services: Mapping[VirtualServer, list[RealServer]] | None = None,
    bound: frozenset[IPAddress] = frozenset(),
) -> IpvsState:
    """Build a state from virtual servers and their destination lists (tests, parsers)."""
    services = services or {}
    return IpvsState(
        services={vs.key: vs for vs in services},
        dests={vs.key: {rs.key: rs for rs in rss} for vs, rss in services.items()},
        bound=bound,
    )


# ---- operations -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddService:
    vs: VirtualServer


@dataclass(frozen=True, slots=True)
class UpdateService:
    vs: VirtualServer


@dataclass(frozen=True, slots=True)
class DeleteService:
    key: VSKey


@dataclass(frozen=True, slots=True)
class AddDest:
    service: VSKey
    rs: RealServer


_add_service, _add_rs = (AddDest.__dict__[name].__set__ for name in ("service", "rs"))


def add_dests(service: VSKey, servers: Iterable[RealServer]) -> list[AddDest]:
    """`[AddDest(service, rs) for rs in servers]` through the slot descriptors (as
    `destinations()`): a first sync plans one for every destination, 12,000 at 1000x10.
    Checked against the constructor at import."""
    out = []
    new, set_service, set_rs = object.__new__, _add_service, _add_rs
    for rs in servers:
        op = new(AddDest)
        set_service(op, service)
        set_rs(op, rs)
        out.append(op)
    return out


def _check_add_dests() -> None:
    key = VSKey(IPv4Address("192.0.2.1"), 80, Proto.TCP)
    rs = RealServer(RSKey(IPv4Address("192.0.2.2"), 8))
    names = [f.name for f in fields(AddDest)]
    if add_dests(key, [rs]) != [AddDest(key, rs)] or names != ["service", "rs"]:  # pragma: no cover
        raise ImportError("model.add_dests no longer builds what AddDest() does")


_check_add_dests()


@dataclass(frozen=True, slots=True)
class UpdateDest:
    service: VSKey
    rs: RealServer


@dataclass(frozen=True, slots=True)
class DeleteDest:
    service: VSKey
    key: RSKey


@dataclass(frozen=True, slots=True)
class BindAddress:
    address: IPAddress


@dataclass(frozen=True, slots=True)
class UnbindAddress:
    address: IPAddress


Op = (
    AddService
    | UpdateService
    | DeleteService
    | AddDest
    | UpdateDest
    | DeleteDest
    | BindAddress
    | UnbindAddress
)
# The classes of the operations that write a destination, and a service: isinstance() with
# a tuple is a C loop, `A | B` builds a union object at every call (the loops over a cold
# sync's plan see 10,000s of operations).
DEST_WRITES = (AddDest, UpdateDest)
SERVICE_WRITES = (AddService, UpdateService)


def transition(state: IpvsState, op: Op) -> IpvsState:
    """The state after the kernel executes `op`; raises like the kernel would.

    Adding an existing object -> AlreadyExists (EEXIST); changing or deleting a missing one,
    or touching a destination of a missing service -> NotFound (ESRCH/ENOENT); deleting a
    service drops its destinations.
    """
    services, dests, bound = dict(state.services), dict(state.dests), set(state.bound)
    execute(services, dests, bound, op)
    return IpvsState(services, dests, frozenset(bound))


def execute(
    services: dict[VSKey, VirtualServer],
    dests: dict[VSKey, Dests],
    bound: set[IPAddress],
    op: Op,
) -> None:
    """`transition` in place, on a table's own dicts (each service's destination mapping is
    replaced, never changed, so mappings shared with other states stay as they were)."""
    match op:
        case AddService(vs):
            _absent(vs.key, services, "service")
            services[vs.key], dests[vs.key] = vs, {}
        case UpdateService(vs):
            _present(vs.key, services, "service")
            services[vs.key] = vs
        case DeleteService(key):
            _present(key, services, "service")
            del services[key], dests[key]
        case AddDest(service, rs):
            _present(service, services, "service")
            _absent(rs.key, dests[service], "destination", service)
            dests[service] = {**dests[service], rs.key: rs}
        case UpdateDest(service, rs):
            _present(service, services, "service")
            _present(rs.key, dests[service], "destination", service)
            dests[service] = {**dests[service], rs.key: rs}
        case DeleteDest(service, key):
            _present(service, services, "service")
            _present(key, dests[service], "destination", service)
            dests[service] = {k: v for k, v in dests[service].items() if k != key}
        case BindAddress(address):
            _absent(address, bound, "address")
            bound.add(address)
        case UnbindAddress(address):
            _present(address, bound, "address")
            bound.discard(address)


def _present(key: object, where: Container[object], what: str, of: object = None) -> None:
    if key not in where:
        raise NotFound(f"{_what(what, of)} {key} not found")


def _absent(key: object, where: Container[object], what: str, of: object = None) -> None:
    if key in where:
        raise AlreadyExists(f"{_what(what, of)} {key} exists already")


def _what(what: str, of: object) -> str:
    """The object's description, spelled only for an error (a cold sync checks 10,000s)."""
    return what if of is None else f"{what} of {of}"


# ---- small helpers shared by parsers and renderers --------------------------------------


def addr_order(address: IPAddress) -> tuple[int, int]:
    """Sort key for addresses of both families: IPv4 first, then numeric."""
    return address.version, int(address)


def vs_order(key: VSKey) -> tuple[int, int, int, int, int]:
    """Sort key for virtual servers: `sorted(keys, key=vs_order)` is much faster than
    `sorted(keys)`, which calls `__lt__` n log n times."""
    return key.address.version, int(key.address), key.port, key.proto, key.fwmark


def rs_order(key: RSKey) -> tuple[int, int, int]:
    """Sort key for real servers (see vs_order)."""
    return key.address.version, int(key.address), key.port


def address_key(address: IPAddress) -> tuple[type, int]:
    """What tells addresses apart, hashed in C: an IPAddress's own hash is Python code
    (hash(hex(int))), and a full pass looks up every endpoint's address. Hot loops inline it."""
    return type(address), address._ip  # type: ignore[union-attr]


def address_text(address: IPAddress) -> str:
    """str(address), an IPv4 one in C (its own __str__ is Python code: every set entry
    ipvsproxy writes names one or two addresses, 7,000 in a cold sync at 1000x10)."""
    if type(address) is IPv4Address:
        return inet_ntoa(address._ip.to_bytes(4, "big"))  # type: ignore[attr-defined]
    return str(address)


def host_port(address: IPAddress, port: int) -> str:
    """`10.0.0.1:80` or `[fd00::1]:80`, as ipvsadm prints them."""
    return f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"


def parse_host_port(text: str) -> tuple[IPAddress, int]:
    """Inverse of `host_port`; ValueError on anything else."""
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            raise ValueError(f"bad address {text!r}")
    else:
        host, sep, port = text.rpartition(":")
        if not sep or ":" in host:
            raise ValueError(f"bad address {text!r}")
    number = int(port)
    if not 0 <= number <= 65535:
        raise ValueError(f"port out of range in {text!r}")
    return ip_address(host), number


def summary(op: Op) -> str:
    """A short human description of an operation, for logs and errors."""
    match op:
        case AddService(vs) | UpdateService(vs):
            verb = "add" if isinstance(op, AddService) else "update"
            return f"{verb} service {vs.key} ({vs.scheduler})"
        case DeleteService(key):
            return f"delete service {key}"
        case AddDest(key, rs) | UpdateDest(key, rs):
            verb = "add" if isinstance(op, AddDest) else "update"
            return f"{verb} destination {rs.key} (weight {rs.weight}) of {key}"
        case DeleteDest(key, rs_key):
            return f"delete destination {rs_key} of {key}"
        case BindAddress(address):
            return f"bind {address}"
        case UnbindAddress(address):
            return f"unbind {address}"
    raise TypeError(f"not an operation: {op!r}")  # pragma: no cover
