"""The ipsets the firewall rules match, and their wanted entries (pure).

Owns: the set names (all `IPVSPROXY-*`, `-6` for IPv6), their types, `entries_for()` (the
entries one virtual server contributes) and `wanted()` (their union over the IPVS state), spelt
as `ipset save` prints them, so wanted and observed sets compare as text. The full path
(`wanted()`) and the incremental one (`firewall.set_index.SetIndex`, fed per virtual server) are
both built on `entries_for()`, so they agree by construction. The rules stay constant; only
these entries grow with the number of Services.

  CLUSTER-IP     hash:ip,port      ClusterIP,proto:port      masquerade from outside the cluster
  EXTERNAL-IP    hash:ip,port      externalIP/LB IP (policy Cluster)      masquerade
  NODE-PORT      hash:ip,port      node address,proto:nodePort (Cluster)  masquerade
  LOOP-BACK      hash:ip,port,ip   endpoint,proto:port,endpoint           hairpin masquerade
                                   (endpoints on this node only, as kube-proxy: a pod on
                                   another node never reaches itself through this node)
  LB-FW          hash:ip,port      LB IP,proto:port with source ranges    filter
  LB-SOURCE      hash:ip,port,net  LB IP,proto:port,allowed range         filter
  SERVICE-PORTS  hash:ip,port      every VIP,proto:port                   accepted on VIPs
  VIPS           hash:ip           every VIP on the dummy device          other ports rejected
  CREATED        hash:ip,port      every virtual server not on the        no rule: the record
                                   dummy device (a node address),         of what ipvsproxy
                                   proto:port                             created (ownership.py)

CREATED is matched by no rule. It is the record, kept in the kernel (it survives a restart
of the agent, and goes with the IPVS table when the node reboots), of the virtual servers
ipvsproxy made on addresses it does not otherwise own: NodePorts and node-address
externalIPs. A virtual server listed there is ipvsproxy's to delete at any port, across
restarts (`recorded()`, read by the proxier before it plans a full pass).

Imports: policy, sync.desired (Access), model, the standard library.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from ipaddress import collapse_addresses, ip_address, ip_network

from ipvsproxy.model import (
    IPAddress,
    IPNetwork,
    IpvsState,
    Proto,
    RSKey,
    VSKey,
)
from ipvsproxy.policy import Frontend, FrontendPolicy, Masquerade, frontend_policy
from ipvsproxy.sync.desired import Access

SET_PREFIX = "IPVSPROXY-"
TEMPORARY = "-T"  # suffix of the set a swap fills (ipset.py)
Entry = tuple[str, str]  # (set name, entry as `ipset save` prints it)


@dataclass(frozen=True, slots=True)
class SetSpec:
    base: str  # e.g. "CLUSTER-IP"
    kind: str  # ipset type

    def name(self, version: int) -> str:
        return SET_PREFIX + self.base + ("" if version == 4 else "-6")

    def nft_name(self, version: int) -> str:
        """Its name in ipvsproxy's nftables table (nft_firewall.py): `cluster-ip`,
        `cluster-ip-6`; no prefix, as the table is ipvsproxy's alone."""
        return self.base.lower() + ("" if version == 4 else "-6")


CLUSTER_IP = SetSpec("CLUSTER-IP", "hash:ip,port")
EXTERNAL_IP = SetSpec("EXTERNAL-IP", "hash:ip,port")
NODE_PORT = SetSpec("NODE-PORT", "hash:ip,port")
LOOP_BACK = SetSpec("LOOP-BACK", "hash:ip,port,ip")
LB_FW = SetSpec("LB-FW", "hash:ip,port")
LB_SOURCE = SetSpec("LB-SOURCE", "hash:ip,port,net")
SERVICE_PORTS = SetSpec("SERVICE-PORTS", "hash:ip,port")
VIPS = SetSpec("VIPS", "hash:ip")
CREATED = SetSpec("CREATED", "hash:ip,port")
SPECS = (
    CLUSTER_IP,
    EXTERNAL_IP,
    NODE_PORT,
    LOOP_BACK,
    LB_FW,
    LB_SOURCE,
    SERVICE_PORTS,
    VIPS,
    CREATED,
)
VERSIONS = (4, 6)
# each set's name per IP version, looked up for every entry a full pass makes
_NAMES = {version: {spec: spec.name(version) for spec in SPECS} for version in VERSIONS}


@dataclass(frozen=True, slots=True)
class SetState:
    """Set name -> (type, family, entries); one type for wanted and observed sets.
    `maxelem`: an observed set's capacity (wanted sets leave it empty: sized when written)."""

    sets: Mapping[str, tuple[str, int, frozenset[str]]]
    maxelem: Mapping[str, int] = field(default_factory=dict)


def all_sets() -> Iterator[tuple[str, str, int]]:
    """(name, type, IP version) of every set ipvsproxy owns."""
    for spec in SPECS:
        for version in VERSIONS:
            yield spec.name(version), spec.kind, version


# each set's name in the nftables table, by its name here
NFT_NAMES = {spec.name(version): spec.nft_name(version) for spec in SPECS for version in VERSIONS}

# Every set name ipvsproxy makes, its swap temporaries included: ownership is by these exact
# names, never by prefix, so anyone else's IPVSPROXY-MINE is never read or destroyed.
OWNED_SETS = frozenset(name + suffix for name, _, _ in all_sets() for suffix in ("", TEMPORARY))


def wanted(
    state: IpvsState,
    access: Mapping[VSKey, Access],
    *,
    local: Container[IPAddress] = frozenset(),
) -> SetState:
    """Every set's entries for this state: the union of `entries_for()` over its virtual
    servers. `local`: the addresses of this node's endpoints (`Desired.local_endpoints`);
    only they get LOOP-BACK entries."""
    entries: dict[str, set[str]] = {name: set() for name, _, _ in all_sets()}
    for key in state.services:
        dests = state.dests.get(key, {})
        bound = key.address in state.bound
        for name, entry in entries_for(key, access.get(key), dests, local=local, bound=bound):
            entries[name].add(entry)
    kinds = {name: (kind, version) for name, kind, version in all_sets()}
    return SetState({name: (*kinds[name], frozenset(found)) for name, found in entries.items()})


def entries_for(
    key: VSKey,
    access: Access | None,
    dests: Iterable[RSKey],
    *,
    local: Container[IPAddress],
    bound: bool,
    policy: FrontendPolicy | None = None,
) -> frozenset[Entry]:
    """The (set name, entry) pairs one virtual server contributes, from its policy
    (`policy.frontend_policy()`: without access info it is a ClusterIP when its address is
    `bound`, on the dummy device, else a NodePort; `policy` if the caller has it already);
    only destinations whose address is in `local` get a LOOP-BACK entry; fwmark services
    none."""
    if key.fwmark:
        return frozenset()
    if policy is None:
        policy = frontend_policy(access, bound=bound)
    return frozenset(_entries(key, policy, dests, local, bound=bound))


def _entries(
    key: VSKey,
    policy: FrontendPolicy,
    dests: Iterable[RSKey],
    local: Container[IPAddress],
    *,
    bound: bool,
) -> list[Entry]:
    """The set entries one virtual server contributes."""
    names = _NAMES[key.address.version]
    proto = _proto(key.proto)
    ip_port = f"{key.address},{proto}:{key.port}"
    out = []
    if not bound:  # on an address that is not ipvsproxy's: recorded as its own
        out.append(record_of(key))
    if policy.frontend is Frontend.CLUSTER_IP:
        out.append((names[CLUSTER_IP], ip_port))  # masqueraded as the node policy says
    elif policy.masquerade is Masquerade.ALWAYS:
        spec = NODE_PORT if policy.frontend is Frontend.NODE_PORT else EXTERNAL_IP
        out.append((names[spec], ip_port))
    if policy.port_filter:
        out.append((names[SERVICE_PORTS], ip_port))
        out.append((names[VIPS], str(key.address)))
    if policy.firewalled:  # LoadBalancer frontends only: others are never filtered
        out.append((names[LB_FW], ip_port))
        # overlapping ranges merged: an nftables interval set refuses overlapping elements
        # (ipset took them; the same addresses match either way)
        for net in collapse_addresses(policy.allowed(key.address.version)):  # type: ignore[type-var]
            for part in _splittable(net):
                out.append((names[LB_SOURCE], f"{ip_port},{_net(part)}"))
    for rs in dests:  # kube-proxy: a hairpin can only start on the pod's node
        if rs.address in local:
            text = str(rs.address)
            out.append((names[LOOP_BACK], f"{text},{proto}:{rs.port},{text}"))
    return out


def is_record(name: str) -> bool:
    """Whether a set is one of the CREATED sets (either family)."""
    return name in _RECORDS


def record_of(key: VSKey) -> Entry:
    """The CREATED entry that records a virtual server as ipvsproxy's."""
    return _NAMES[key.address.version][CREATED], f"{key.address},{_proto(key.proto)}:{key.port}"


def recorded(state: SetState) -> frozenset[VSKey]:
    """The virtual servers the CREATED sets list (both families): those ipvsproxy made on
    addresses not its own. An entry that does not parse (written by someone else) is no
    record."""
    keys = set()
    for version in VERSIONS:
        found = state.sets.get(CREATED.name(version))
        if found is None or found[0] != CREATED.kind:
            continue
        for entry in found[2]:
            key = _key_of(entry)
            if key is not None and key.address.version == version:
                keys.add(key)
    return frozenset(keys)


def _key_of(entry: str) -> VSKey | None:
    """`ADDRESS,PROTO:PORT` (as `ipset save` prints a hash:ip,port entry) as a key."""
    address, _, proto_port = entry.rpartition(",")
    proto, _, number = proto_port.partition(":")
    try:
        return VSKey(ip_address(address), int(number), Proto[proto.upper()])
    except (KeyError, ValueError):
        return None


def nft_element(entry: str) -> str:
    """An entry as `ipset save` prints it, as an nftables element: `10.96.0.1,tcp:443` ->
    `10.96.0.1 . tcp . 443`; `a,tcp:80,10.0.0.0/8` -> `a . tcp . 80 . 10.0.0.0/8`."""
    first, *rest = entry.split(",")
    if not rest:
        return first
    proto, _, port = rest[0].partition(":")
    return " . ".join((first, proto, port, *rest[1:]))


def _splittable(net: IPNetwork) -> list[IPNetwork]:
    """ipset's net types take no /0: 0.0.0.0/0 becomes its two halves."""
    if net.prefixlen:
        return [net]
    return list(net.subnets(prefixlen_diff=1))


def _net(net: IPNetwork) -> str:
    """As `ipset save` prints a net: a full-length prefix as a plain address."""
    if net.prefixlen == net.max_prefixlen:
        return str(net.network_address)
    return str(ip_network(net, strict=False))


def _proto(proto: Proto) -> str:
    return proto.name.lower()


_RECORDS = frozenset(CREATED.name(version) for version in VERSIONS)
