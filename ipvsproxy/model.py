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
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address
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
    # Worked out once: a pass looks a virtual server's key up in several maps (desired,
    # observed, the known table, the firewall's index), and an address's own hash is
    # Python code: worked out per lookup, it is a large share of an idle full pass.
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.address, self.port, self.proto, self.fwmark)))

    def __hash__(self) -> int:
        return self._hash

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

    def __lt__(self, other: RSKey) -> bool:
        return rs_order(self) < rs_order(other)

    def __str__(self) -> str:
        return host_port(self.address, self.port)


@dataclass(frozen=True, slots=True)
class RealServer:
    """Settings of a destination. Weight 0 = draining. No connection counters here."""

    key: RSKey
    weight: int = 1
    forward: Forward = Forward.MASQ
    upper_threshold: int = 0
    lower_threshold: int = 0


Dests = Mapping[RSKey, RealServer]


@dataclass(frozen=True, slots=True)
class Counters:
    """Cumulative IPVS statistics of a virtual server or a destination, as the kernel keeps
    them since the object was added (struct ip_vs_kstats): rates come from two readings."""

    connections: int = 0  # connections scheduled
    packets_in: int = 0
    packets_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


@dataclass(frozen=True, slots=True)
class DestTraffic:
    """A destination's connection counts now, and its counters."""

    active: int = 0
    inactive: int = 0
    counters: Counters = Counters()


@dataclass(frozen=True, slots=True)
class Traffic:
    """A virtual server's counters and its destinations'."""

    counters: Counters = Counters()
    dests: Mapping[RSKey, DestTraffic] = field(default_factory=dict)


class Addressed(Protocol):
    """Anything with an address (an endpoint view): what `destinations()` reads."""

    @property
    def address(self) -> IPAddress: ...


def destinations(
    pairs: Iterable[tuple[Addressed, int]], weight: int = 1
) -> dict[RSKey, RealServer]:
    """{key: RealServer(key, weight)} for each (endpoint, port number), keys
    RSKey(address, port)."""
    out: dict[RSKey, RealServer] = {}
    for holder, port in pairs:
        key = RSKey(holder.address, port)
        out[key] = RealServer(key, weight)
    return out


@dataclass(frozen=True, slots=True)
class IpvsState:
    """The IPVS table (and bound VIPs) as wanted or as seen; treated as immutable.

    Every key of `services` has an entry in `dests` (possibly empty) and vice versa.
    """

    services: Mapping[VSKey, VirtualServer] = field(default_factory=dict)
    dests: Mapping[VSKey, Dests] = field(default_factory=dict)
    bound: frozenset[IPAddress] = frozenset()  # VIPs on the dummy device (IPVS backend)


EMPTY = IpvsState()


def part_of(
    services: Mapping[VSKey, VirtualServer],
    dests: Mapping[VSKey, Dests],
    bound: Container[IPAddress],
    keys: Iterable[VSKey],
    addresses: Iterable[IPAddress],
) -> IpvsState:
    """The part of a table (the desired one, or the kernel's as known) that holds these
    virtual servers and addresses: those of them it has."""
    found = {k: vs for k in keys if (vs := services.get(k)) is not None}
    return IpvsState(
        found, {k: dests[k] for k in found}, frozenset(a for a in addresses if a in bound)
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
# The classes of the operations that write a destination: isinstance() with
# a tuple is a C loop, `A | B` builds a union object at every call (the loops over a cold
# sync's plan see 10,000s of operations).
DEST_WRITES = (AddDest, UpdateDest)


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
