"""kube-proxy's record of the NodePorts it programs, read when a node moves to ipvsproxy.

Owns: `ipv6_set_name()` (kube-proxy's naming of its IPv6 sets), `NODE_PORT_SETS`
(kube-proxy's IPVS-mode NodePort ipsets, pkg/proxy/ipvs/ipset.go) and `node_ports()` (what
they list). kube-proxy's IPVS mode writes every NodePort it programs
into these sets, per protocol (TCP and UDP by port, SCTP by node address and port), with or
without `externalTrafficPolicy: Local`. A node that has just moved from kube-proxy still holds
them until `ipvsproxy cleanup --kube-proxy` removes them (docs/migration.md): a virtual
server on a node address whose port they list is kube-proxy's, made for a Service, and so
ipvsproxy's to take over or delete (sync/ownership.py), proven by kube-proxy's own record
rather than by the port falling inside the NodePort range.

Imports: host.commands (Commands), model, errors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from ipaddress import ip_address

from ipvsproxy.errors import KernelError, KernelUnavailable
from ipvsproxy.host.commands import Commands
from ipvsproxy.model import IPAddress, Proto, VSKey

_BY_PROTOCOL = {
    "NODE-PORT-TCP": Proto.TCP,
    "NODE-PORT-LOCAL-TCP": Proto.TCP,
    "NODE-PORT-UDP": Proto.UDP,
    "NODE-PORT-LOCAL-UDP": Proto.UDP,
    "NODE-PORT-SCTP-HASH": Proto.SCTP,  # hash:ip,port: node address,sctp:port
    "NODE-PORT-LOCAL-SCTP-HASH": Proto.SCTP,
}
SET_NAME_MAX = 31  # IPSET_MAXNAMELEN (32) less the terminating NUL: kube-proxy cuts to it


def ipv6_set_name(name: str) -> str:
    """kube-proxy's name for the IPv6 twin of a set: `KUBE-` becomes `KUBE-6-`, then the name
    is cut to 31 characters (NewIPSet), so KUBE-NODE-PORT-LOCAL-SCTP-HASH's twin is
    KUBE-6-NODE-PORT-LOCAL-SCTP-HAS."""
    return ("KUBE-6-" + name.removeprefix("KUBE-"))[:SET_NAME_MAX]


# IPv4's KUBE-..., IPv6's KUBE-6-... cut to 31 characters (kube-proxy's dual-stack naming)
NODE_PORT_SETS: Mapping[str, Proto] = {
    set_name: proto
    for name, proto in _BY_PROTOCOL.items()
    for set_name in (f"KUBE-{name}", ipv6_set_name(f"KUBE-{name}"))
}

# (protocol, port, node address or None for any): one listed NodePort
NodePort = tuple[Proto, int, IPAddress | None]


def node_ports(commands: Commands) -> frozenset[NodePort]:
    """The NodePorts kube-proxy's sets list on this host; none when it holds no such set.
    Raises KernelError when ipset cannot be run."""
    names = [
        name for name in commands.run(["ipset", "list", "-n"]).split() if name in NODE_PORT_SETS
    ]
    if not names:
        return frozenset()
    saved = commands.run(["ipset", "restore"], stdin="".join(f"save {n}\n" for n in names))
    return parse_saved(saved)


def parse_saved(text: str) -> frozenset[NodePort]:
    """`ipset save` of those sets: `add KUBE-NODE-PORT-TCP 30080`, `add
    KUBE-NODE-PORT-SCTP-HASH 192.168.0.10,sctp:30080`; any other line, or an entry that does
    not read as one, is left out (it proves nothing)."""
    out: set[NodePort] = set()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3 or parts[0] != "add" or parts[1] not in NODE_PORT_SETS:
            continue
        proto, entry = NODE_PORT_SETS[parts[1]], parts[2]
        try:
            if "," in entry:
                address, _, port = entry.partition(",")
                out.add((proto, int(port.rpartition(":")[2]), ip_address(address)))
            else:
                out.add((proto, int(entry), None))
        except ValueError:
            continue
    return frozenset(out)


def adopted(
    listed: frozenset[NodePort], keys: Iterable[VSKey], node_addresses: frozenset[IPAddress]
) -> frozenset[VSKey]:
    """The virtual servers among `keys` that kube-proxy's record proves are its NodePorts:
    on one of this node's NodePort addresses, with a protocol and port its sets list."""
    if not listed:
        return frozenset()
    return frozenset(
        key
        for key in keys
        if not key.fwmark
        and key.address in node_addresses
        and ((key.proto, key.port, None) in listed or (key.proto, key.port, key.address) in listed)
    )


def read_adopted(
    commands: Commands, keys: Iterable[VSKey], node_addresses: frozenset[IPAddress]
) -> tuple[frozenset[VSKey], str]:
    """`adopted()` from the host's sets, and a warning when they could not be read ("").
    Without the ipset tool (a node whose firewall is nftables, where kube-proxy's IPVS mode
    never ran) nothing is adopted and nothing is said."""
    try:
        listed = node_ports(commands)
    except KernelUnavailable:
        return frozenset(), ""
    except KernelError as exc:
        return frozenset(), f"cannot read kube-proxy's NodePort ipsets (none adopted): {exc}"
    return adopted(listed, keys, node_addresses), ""
