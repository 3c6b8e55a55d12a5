"""ipvsproxy's own nat chains, as saved -> the IPVS state they encode (pure).

Owns: `read_state()` (the virtual servers and destinations the fallback's chains encode, read
best-effort: whatever cannot be read is left out, so the planner puts it back;
`transaction.damage()` finds the rest). The inverse of chains.py's rendering.

Imports: fallback.chains, iptables.parse, model, schedulers, the standard library.
"""

from __future__ import annotations

import re
from collections import defaultdict
from ipaddress import ip_address

from ipvsproxy.fallback.chains import SERVICES, SVC_PREFIX, VIP_COMMENT, group_of, is_sep
from ipvsproxy.iptables.parse import Saved
from ipvsproxy.model import (
    IPAddress,
    IpvsState,
    Proto,
    RealServer,
    RSKey,
    ServiceFlags,
    VirtualServer,
    VSKey,
    parse_host_port,
)
from ipvsproxy.schedulers import Scheduler

_COMMENT = r'--comment (?:"(?P<c>[^"]*)"|(?P<bare>\S+))'
_DISPATCH = re.compile(
    rf"-A {SERVICES} -d (?P<addr>[0-9a-f.:]+)/(?:32|128) -p (?P<proto>tcp|udp|sctp) "
    rf"-m comment {_COMMENT} -m (?P=proto) --dport (?P<port>\d+) -j (?P<svc>{SVC_PREFIX}\w+)$"
)
_VIP = re.compile(
    rf"-A {SERVICES} -d (?P<addr>[0-9a-f.:]+)/(?:32|128) "
    rf'-m comment --comment "{VIP_COMMENT}" -j RETURN$'
)
_SERVICE = re.compile(
    r"(?P<name>\S+) sched=(?P<sched>\w+) flags=(?P<flags>0x[0-9a-f]+) timeout=(?P<timeout>\d+)$"
)
_DNAT = re.compile(rf"-m comment {_COMMENT} -j DNAT --to-destination (?P<to>\S+)$")
_WEIGHT = re.compile(r"\S+ weight=(?P<weight>\d+)$")


def read_state(saved: Saved) -> tuple[IpvsState, dict[VSKey, str]]:
    """The virtual servers, destinations and VIPs the chains encode, and each one's name."""
    services: dict[VSKey, VirtualServer] = {}
    names: dict[VSKey, str] = {}
    svc_of: dict[str, VSKey] = {}
    bound: set[IPAddress] = set()
    for line in saved.chains.get(SERVICES, ()):
        if vip := _VIP.match(line):
            bound.add(ip_address(vip["addr"]))
        elif parsed := _service(line):
            vs, name, chain = parsed
            services[vs.key], names[vs.key], svc_of[group_of(chain)] = vs, name, vs.key
    dests: dict[VSKey, dict[RSKey, RealServer]] = defaultdict(dict)
    for chain, lines in saved.chains.items():
        key = svc_of.get(group_of(chain)) if is_sep(chain) else None
        rs = _dest(lines) if key is not None else None
        if key is not None and rs is not None:
            dests[key][rs.key] = rs
    state = IpvsState(
        services=services,
        dests={key: dests.get(key, {}) for key in services},
        bound=frozenset(bound),
    )
    return state, names


def _service(line: str) -> tuple[VirtualServer, str, str] | None:
    m = _DISPATCH.match(line)
    meta = _SERVICE.match(m["c"] or m["bare"]) if m else None
    if m is None or meta is None:
        return None
    try:
        key = VSKey(ip_address(m["addr"]), int(m["port"]), Proto[m["proto"].upper()])
        vs = VirtualServer(
            key,
            scheduler=Scheduler(meta["sched"]),
            flags=ServiceFlags(int(meta["flags"], 16)),
            timeout_s=int(meta["timeout"]),
        )
    except ValueError:
        return None
    return vs, meta["name"], m["svc"]


def _dest(lines: tuple[str, ...]) -> RealServer | None:
    for line in lines:
        m = _DNAT.search(line)
        weight = _WEIGHT.match(m["c"] or m["bare"]) if m else None
        if m is not None and weight is not None:
            try:
                address, port = parse_host_port(m["to"])
            except ValueError:
                return None
            return RealServer(RSKey(address, port), weight=int(weight["weight"]))
    return None
