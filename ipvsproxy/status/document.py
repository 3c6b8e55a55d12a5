"""The status document (`apiVersion: ipvsproxy.io/v1alpha1`, `kind: Status`), pure.

Owns: `Observed` (the kernel's side of the Services shown), `Passes`, `Selector` (a
`NAMESPACE/NAME[:PORT]` filter), `build()` (explanations + kernel -> the document, a dict
ready for `json.dumps`) and `exit_code()`. Nothing here reads the kernel or the API: the
explanations come from `sync.desired.explain_service` (the translation's own rules say why
an endpoint is left out), drift from `sync.plan` rendered by `sync.render.describe` (`diff`'s
words), rates from `traffic.rates`.

Imports: proxier (touched), sync, traffic, model, api, errors.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ipvsproxy.api import EndpointView, NodeView, Ref, ServiceView
from ipvsproxy.errors import ConfigError
from ipvsproxy.model import (
    Counters,
    DestTraffic,
    IPAddress,
    IpvsState,
    Op,
    RSKey,
    Traffic,
    VSKey,
)
from ipvsproxy.proxier import touched
from ipvsproxy.sync.desired import Explanation, PortExplanation, Reason, Scope
from ipvsproxy.sync.render import describe
from ipvsproxy.traffic import Rates

API_VERSION = "ipvsproxy.io/v1alpha1"
KIND = "Status"
MAX_PORTS = 1000  # Service ports in one document (a filter shows any one of them)

Json = dict[str, Any]
PerDest = Mapping[tuple[VSKey, RSKey], Rates]
# slow start's state of one destination of one virtual server, as JSON (None: no ramp)
RampOf = Callable[[VSKey, RSKey], Mapping[str, Any] | None]


def no_ramp(key: VSKey, rs: RSKey) -> None:
    """No endpoint ramps its weight (the default until slow start is wired in)."""
    return None


@dataclass(frozen=True, slots=True)
class Observed:
    """The kernel's side of the Services shown."""

    kernel: IpvsState  # the kernel's table (the agent: as last observed, advanced since)
    drift: Sequence[Op] = ()  # what the next pass would change in it
    traffic: Mapping[VSKey, Traffic] | None = None  # None: no counters (fallback, saved table)
    rates: tuple[Mapping[VSKey, Rates], PerDest] | None = None  # None: one sample only
    window: float | None = None  # seconds between the two samples of `rates`


@dataclass(frozen=True, slots=True)
class Passes:
    """Wall-clock times (epoch seconds) of the agent's last passes (None: none yet)."""

    full: float | None = None
    partial: float | None = None


@dataclass(frozen=True, slots=True)
class Selector:
    """`NAMESPACE/NAME[:PORT]`: one Service, or one of its ports (by name or number)."""

    namespace: str
    name: str
    port: str = ""

    @classmethod
    def parse(cls, text: str) -> Selector:
        ref, colon, port = text.partition(":")
        namespace, slash, name = ref.partition("/")
        if not slash or not namespace or not name or "/" in name or (colon and not port):
            raise ConfigError(f"{text!r} is not NAMESPACE/NAME or NAMESPACE/NAME:PORT")
        return cls(namespace, name, port)

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}" + (f":{self.port}" if self.port else "")

    def matches(self, svc: ServiceView) -> bool:
        return (svc.namespace, svc.name) == (self.namespace, self.name)

    def port_matches(self, explained: PortExplanation) -> bool:
        port = explained.port
        return not self.port or self.port in (port.name, str(port.port))


@dataclass(frozen=True, slots=True)
class Context:
    """What every part of the document is built from."""

    node: NodeView
    owners: Mapping[VSKey, str]  # the Service port whose virtual server each key is
    observed: Observed
    device: str  # the dummy device (drift lines name it)
    ramp: RampOf = no_ramp
    lines: dict[VSKey | None, list[str]] = field(default_factory=dict)  # drift, per key


def build(
    explained: Sequence[tuple[ServiceView, Explanation]],
    *,
    node: NodeView,
    owners: Mapping[VSKey, str],
    observed: Observed,
    source: str,
    backend: str | None,
    firewall: str | None = None,
    now: float,
    passes: Passes = Passes(),
    warnings: Sequence[str] = (),
    device: str = "kube-ipvs0",
    selector: Selector | None = None,
    ramp: RampOf = no_ramp,
    pending: Container[Ref] = frozenset(),
) -> Json:
    """The document for these Services (each with its `explain_service`), in their order;
    those in `pending` changed since the agent's last pass (not in sync until the next)."""
    ctx = Context(node, owners, observed, device, ramp, _drift_lines(observed, owners, device))
    services: list[Json] = []
    for svc, explanation in explained:
        changed = (svc.namespace, svc.name) in pending
        if explanation.skipped is not None:
            services.append(_skipped(svc, explanation, changed))
            continue
        for port in explanation.ports:
            if selector is None or selector.port_matches(port):
                services.append(_service_port(svc, explanation, port, ctx, changed))
    shown = services[:MAX_PORTS]
    # drift of no Service port's virtual server (stale ones): only on a whole node's status
    other = ctx.lines.get(None, []) if selector is None else []
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "node": node.name,
        "zone": node.zone or None,
        "source": source,
        "backend": backend,
        "firewall": firewall,
        "generatedAt": _iso(now),
        "lastFullPass": _iso(passes.full),
        "lastPartialPass": _iso(passes.partial),
        "rateWindowSeconds": observed.window if observed.rates and observed.traffic else None,
        "inSync": not other and all(s["inSync"] for s in services),
        "otherDrift": other,
        "truncated": len(shown) < len(services),
        "warnings": list(warnings),
        "services": shown,
    }


def exit_code(doc: Mapping[str, Any]) -> int:
    """0 in sync, 1 drift (errors are exceptions: exit 2)."""
    return 0 if doc["inSync"] else 1


def _iso(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _skipped(svc: ServiceView, explanation: Explanation, pending: bool) -> Json:
    return {
        "namespace": svc.namespace,
        "name": svc.name,
        "port": None,
        "protocol": None,
        "type": str(svc.type),
        "skipped": str(explanation.skipped),
        "scheduler": None,
        "persistenceSeconds": None,
        "trafficPolicies": _policies(svc),
        "fellBack": [],
        "pending": pending,
        "inSync": not pending,
        "virtualServers": [],
        "endpoints": [],
    }


def _policies(svc: ServiceView) -> Json:
    return {
        "internal": "Local" if svc.internal_local else "Cluster",
        "external": "Local" if svc.external_local else "Cluster",
    }


def _service_port(
    svc: ServiceView, explanation: Explanation, port: PortExplanation, ctx: Context, pending: bool
) -> Json:
    entries = [
        (key, entry)
        for key, entry in explanation.contribution.entries.items()
        if entry.origin == port.origin
    ]
    entries.sort(key=lambda item: _REACH_ORDER.index(item[1].access.reach.value))
    owned = [key for key, _ in entries if ctx.owners.get(key) == port.origin]
    servers = [_virtual_server(key, entry.access.reach.value, port, ctx) for key, entry in entries]
    vs = next((entry.vs for _, entry in entries), None)
    desired = {key: entry.dests for key, entry in entries}
    return {
        "namespace": svc.namespace,
        "name": svc.name,
        "port": port.port.name or str(port.port.port),
        "protocol": port.port.protocol.name,
        "type": str(svc.type),
        "skipped": None,
        "scheduler": str(vs.scheduler) if vs is not None else None,
        "persistenceSeconds": svc.affinity_timeout or None,
        "trafficPolicies": _policies(svc),
        "fellBack": sorted(str(scope) for scope in port.fell_back),
        "pending": pending,
        "inSync": not pending and all(not s["drift"] for s in servers),
        "virtualServers": servers,
        "endpoints": _endpoints(port, owned, desired, ctx),
    }


_REACH_ORDER = ("cluster-ip", "load-balancer", "external-ip", "node-port")


def _virtual_server(key: VSKey, reach: str, port: PortExplanation, ctx: Context) -> Json:
    owner = ctx.owners.get(key)
    kernel = ctx.observed.kernel
    traffic = ctx.observed.traffic
    counters = None
    if traffic is not None and key in traffic:
        rates = ctx.observed.rates[0].get(key) if ctx.observed.rates is not None else None
        counters = _traffic(traffic[key].counters, rates)
    return {
        "address": str(key.address),
        "port": key.port,
        "protocol": key.proto.name,
        "family": f"IPv{key.address.version}",
        "kind": reach,
        "scope": "internal" if reach == "cluster-ip" else "external",
        "claimedBy": owner if owner != port.origin else None,
        "inKernel": key in kernel.services,
        "drift": ctx.lines.get(key, []) if owner == port.origin else [],
        "traffic": counters,
    }


def _endpoints(
    port: PortExplanation,
    owned: Sequence[VSKey],
    desired: Mapping[VSKey, Mapping[RSKey, Any]],
    ctx: Context,
) -> list[Json]:
    kernel = ctx.observed.kernel
    rows: dict[RSKey, EndpointView | None] = {}
    for ep, number in port.endpoints:
        rows.setdefault(RSKey(ep.address, number), ep)
    for key in owned:  # in the kernel, not in any slice: removed, draining (or stale)
        for rs in kernel.dests.get(key, {}):
            rows.setdefault(rs, None)
    left: dict[RSKey, list[Json]] = {}
    for scope, excluded in port.left.items():
        for (ep, number), reason in excluded:
            left.setdefault(RSKey(ep.address, number), []).append(
                {
                    "scope": str(scope),
                    "reason": str(reason),
                    "message": _why(reason, ep, scope, ctx.node, port),
                }
            )
    return [_endpoint(rs, ep, left.get(rs, []), owned, desired, ctx) for rs, ep in rows.items()]


def _endpoint(
    rs: RSKey,
    ep: EndpointView | None,
    left: list[Json],
    owned: Sequence[VSKey],
    desired: Mapping[VSKey, Mapping[RSKey, Any]],
    ctx: Context,
) -> Json:
    kernel = ctx.observed.kernel
    weights = {
        key: kernel.dests[key][rs].weight for key in owned if rs in kernel.dests.get(key, {})
    }
    draining = any(w == 0 and rs not in desired.get(key, {}) for key, w in weights.items())
    ramp = next((r for key in weights if (r := ctx.ramp(key, rs)) is not None), None)
    return {
        "address": str(rs.address),
        "port": rs.port,
        "pod": (ep.pod or None) if ep else None,
        "node": (ep.node_name or None) if ep else None,
        "zone": (ep.zone or None) if ep else None,
        "inSlice": ep is not None,
        "ready": ep.ready if ep else None,
        "serving": ep.serving if ep else None,
        "terminating": ep.terminating if ep else None,
        "programmed": [
            {"virtualServer": str(key), "weight": weight} for key, weight in weights.items()
        ],
        "draining": draining,
        "ramp": dict(ramp) if ramp is not None else None,
        "notProgrammed": left,
        "traffic": _dest_traffic(rs, weights, ctx.observed),
    }


def _dest_traffic(rs: RSKey, keys: Iterable[VSKey], observed: Observed) -> Json | None:
    """The destination's counters summed over the port's virtual servers it is in; None
    when the kernel has none of it (no counters: the iptables fallback; not programmed)."""
    keys = [key for key in keys if observed.traffic is not None and key in observed.traffic]
    if observed.traffic is None or not keys:
        return None
    total = DestTraffic()
    rates: Rates | None = Rates() if observed.rates is not None else None
    for key in keys:
        dest = observed.traffic.get(key, Traffic()).dests.get(rs)
        if dest is not None:
            total = _add(total, dest)
        if rates is not None and observed.rates is not None:
            rates = _plus(rates, observed.rates[1].get((key, rs), Rates()))
    return {
        "activeConnections": total.active,
        "inactiveConnections": total.inactive,
        **_traffic(total.counters, rates),
    }


def _add(a: DestTraffic, b: DestTraffic) -> DestTraffic:
    x, y = a.counters, b.counters
    return DestTraffic(
        a.active + b.active,
        a.inactive + b.inactive,
        Counters(
            x.connections + y.connections,
            x.packets_in + y.packets_in,
            x.packets_out + y.packets_out,
            x.bytes_in + y.bytes_in,
            x.bytes_out + y.bytes_out,
        ),
    )


def _plus(a: Rates, b: Rates) -> Rates:
    return Rates(a.connections + b.connections, a.packets + b.packets, a.bytes + b.bytes)


def _traffic(counters: Counters, rates: Rates | None) -> Json:
    return {
        "connections": counters.connections,
        "packetsIn": counters.packets_in,
        "packetsOut": counters.packets_out,
        "bytesIn": counters.bytes_in,
        "bytesOut": counters.bytes_out,
        "rates": None
        if rates is None
        else {
            "connectionsPerSecond": round(rates.connections, 3),
            "packetsPerSecond": round(rates.packets, 3),
            "bytesPerSecond": round(rates.bytes, 3),
        },
    }


def _why(
    reason: Reason, ep: EndpointView, scope: Scope, node: NodeView, port: PortExplanation
) -> str:
    """A reason in words."""
    policy = "internalTrafficPolicy" if scope is Scope.INTERNAL else "externalTrafficPolicy"
    match reason:
        case Reason.NOT_READY:
            return "not ready" + ("" if ep.serving else ", not serving")
        case Reason.TERMINATING:
            return "terminating, and ready endpoints exist"
        case Reason.OTHER_NODE:
            return f"on node {ep.node_name or '(none)'}, {policy}: Local"
        case Reason.TOPOLOGY_ZONE:
            zones = ", ".join(sorted(ep.zone_hints))
            return f"hinted for zone {zones}, this node is in {node.zone or '(no zone)'}"
        case Reason.TOPOLOGY_NODE:
            return f"hinted for node {', '.join(sorted(ep.node_hints))}"
        case Reason.OTHER_FAMILY:
            v = ep.address.version
            return f"IPv{v}, and the Service has no IPv{v} ClusterIP"
        case Reason.NO_PORT:
            named = port.port.name or "(unnamed)"
            return f"its EndpointSlice has no port {named}/{port.port.protocol.name}"
    return str(reason)  # pragma: no cover


def _drift_lines(
    observed: Observed, owners: Mapping[VSKey, str], device: str
) -> dict[VSKey | None, list[str]]:
    """Each drift operation in `diff`'s words, under the virtual servers it is about (an
    address of the dummy device: under every virtual server at that address); under None
    those about no virtual server a Service port owns (stale ones, addresses)."""
    by_address: dict[IPAddress, list[VSKey]] = {}
    for key in owners:
        by_address.setdefault(key.address, []).append(key)
    out: dict[VSKey | None, list[str]] = {}
    for op in observed.drift:
        line = describe(op, owners, observed.kernel, device)
        keys, addresses = touched((op,))
        about: list[VSKey | None] = [k for k in keys if k in owners]
        about.extend(k for a in addresses for k in by_address.get(a, ()))
        for where in about or [None]:
            out.setdefault(where, []).append(f"{line.sign} {line.command}")
    return out
