"""Hypothesis strategies for IPVS state: owned (inside the service CIDR) and foreign; and
for raw objects that change (`services`, `slices`, `nodes`: few names and addresses, so
that they collide), as the incremental-path tests feed them."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv6Address, ip_address
from typing import Any

from hypothesis import strategies as st

from ipvsproxy.model import (
    Forward,
    IpvsState,
    Proto,
    RealServer,
    RSKey,
    ServiceFlags,
    VirtualServer,
    VSKey,
)
from ipvsproxy.schedulers import Scheduler, allowed_flags
from tests.factories import ep, node, port, service, slice_

# Owned VIPs live in 10.96.0.0/24 and fd00:96::/120; foreign ones in TEST-NET-1/documentation v6.
owned_v4 = st.integers(0, 15).map(lambda n: ip_address(f"10.96.0.{n}"))
owned_v6 = st.integers(0, 15).map(lambda n: ip_address(f"fd00:96::{n:x}"))
foreign_v4 = st.integers(0, 15).map(lambda n: ip_address(f"192.0.2.{n}"))
foreign_v6 = st.integers(0, 15).map(lambda n: ip_address(f"2001:db8::{n:x}"))
ports = st.sampled_from([53, 80, 443, 8080])
MASQ_ONLY = st.just(Forward.MASQ)


@st.composite
def virtual_servers(draw, addresses=owned_v4 | owned_v6) -> VirtualServer:
    key = VSKey(draw(addresses), draw(ports), draw(st.sampled_from(list(Proto))))
    scheduler = draw(st.sampled_from(list(Scheduler)))
    flags = ServiceFlags(0)
    for flag in allowed_flags(scheduler).values():
        if draw(st.booleans()):
            flags |= ServiceFlags(int(flag))
    timeout = 0
    if draw(st.booleans()):
        flags |= ServiceFlags.PERSISTENT
        timeout = draw(st.integers(1, 86400))
    return VirtualServer(key, scheduler, flags, timeout)


@st.composite
def real_servers(draw, version: int, forwards=MASQ_ONLY) -> RealServer:
    n = draw(st.integers(1, 20))
    address: IPv4Address | IPv6Address = ip_address(
        f"10.244.0.{n}" if version == 4 else f"fd00:244::{n:x}"
    )
    return RealServer(
        RSKey(address, draw(st.sampled_from([8080, 9090]))),
        weight=draw(st.integers(0, 3)),
        forward=draw(forwards),
    )


@st.composite
def states(draw, addresses=owned_v4 | owned_v6, forwards=MASQ_ONLY) -> IpvsState:
    vss = draw(st.lists(virtual_servers(addresses), max_size=6, unique_by=lambda v: v.key))
    dests = {}
    for vs in vss:
        rss = draw(
            st.lists(
                real_servers(vs.key.address.version, forwards),
                max_size=4,
                unique_by=lambda r: r.key,
            )
        )
        dests[vs.key] = {rs.key: rs for rs in rss}
    bound = frozenset(vs.key.address for vs in vss)
    return IpvsState({vs.key: vs for vs in vss}, dests, bound)


@st.composite
def foreign_states(draw) -> IpvsState:
    """Someone else's virtual servers (keepalived, an admin): other addresses, fwmarks."""
    plain = draw(states(foreign_v4 | foreign_v6, st.sampled_from(list(Forward))))
    marks = draw(st.lists(st.integers(1, 1000), max_size=2, unique=True))
    services, dests = dict(plain.services), dict(plain.dests)
    for mark in marks:
        key = VSKey(ip_address("0.0.0.0"), 0, Proto.TCP, fwmark=mark)
        services[key] = VirtualServer(key, Scheduler.WLC)
        dests[key] = {}
    return IpvsState(services, dests, frozenset())


def merge(a: IpvsState, b: IpvsState) -> IpvsState:
    return IpvsState({**a.services, **b.services}, {**a.dests, **b.dests}, a.bound | b.bound)


def restrict(state: IpvsState, keep) -> IpvsState:
    return IpvsState(
        {k: v for k, v in state.services.items() if keep(k)},
        {k: v for k, v in state.dests.items() if keep(k)},
        state.bound,
    )


# ---- raw objects that change ----------------------------------------------------------------

NAMES = ("a", "b", "c", "d")
VIPS = ("10.96.0.1", "10.96.0.2", "10.96.0.3")  # few: Services collide on them
PODS = {f"10.244.{n}.{i}": f"node-{'ab'[n]}" for n in (0, 1) for i in (1, 2, 3)}  # ip -> node

service_ports = st.lists(
    st.sampled_from(
        [
            port("http", 80, node_port=30080),
            port("dns", 53, "UDP", node_port=30053),
            port("https", 443),
        ]
    ),
    min_size=1,
    max_size=2,
    unique_by=lambda p: p["name"],
)


@st.composite
def services(draw: st.DrawFn) -> Any:
    kind = draw(st.sampled_from(["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"]))
    spec: dict[str, Any] = {}
    if draw(st.booleans()):
        spec["externalIPs"] = draw(st.lists(st.sampled_from(VIPS), max_size=2))
    if draw(st.booleans()):
        spec["externalTrafficPolicy"] = "Local"
    if draw(st.booleans()):
        spec["sessionAffinity"] = "ClientIP"
    status = None
    if kind == "LoadBalancer" and draw(st.booleans()):
        status = {"loadBalancer": {"ingress": [{"ip": draw(st.sampled_from(VIPS))}]}}
    headless = draw(st.integers(0, 9)) == 0
    return service(
        draw(st.sampled_from(NAMES)),
        type=kind,
        cluster_ips=("None",) if headless else (draw(st.sampled_from(VIPS)),),
        ports=draw(service_ports),
        status=status,
        **spec,
    )


@st.composite
def slices(draw: st.DrawFn) -> Any:
    endpoints = [
        ep(
            ip,
            ready=draw(st.booleans()),
            serving=draw(st.sampled_from([None, True, False])),
            terminating=draw(st.sampled_from([None, True])),
            node=PODS[ip],
        )
        for ip in draw(st.lists(st.sampled_from(sorted(PODS)), max_size=3, unique=True))
    ]
    owner = draw(st.sampled_from(NAMES))
    return slice_(
        owner,
        name=f"slice-{draw(st.integers(0, 4))}",
        ports=(("http", 8080, "TCP"), ("dns", 5353, "UDP"), ("https", 8443, "TCP")),
        endpoints=endpoints,
    )


def nodes() -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(
        node,
        st.just("node-a"),
        st.lists(st.sampled_from(["192.168.0.10", "192.168.0.11", VIPS[0]]), max_size=2),
    )
