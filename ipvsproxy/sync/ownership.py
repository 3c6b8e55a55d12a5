"""Which virtual servers ipvsproxy may change or delete: the precise rule.

A virtual server is ipvsproxy's when it is wanted now (its key is in the desired state), or
when all of these hold:
  1. it is an address/port/protocol service (firewall-mark services are never ours);
  2. its address is in no `--ipvs-exclude-cidrs` range;
  3. and one of:
     a. its address is bound on ipvsproxy's dummy device, or is about to be (every ClusterIP,
        externalIP and LoadBalancer IP of a Service lives there; the device is ipvsproxy's);
     b. its address is inside a `--service-cidr` range (the cluster's Service VIP ranges);
     c. only where no record is kept (rule 5: IPVS without the firewall's sets, a saved
        table given to `diff`): its address is one of this node's NodePort addresses and
        its port is inside `--service-node-port-range` (default 30000-32767).
  4. or this process wanted it earlier (`known`): a NodePort on an address the node has
     since lost is still ipvsproxy's to delete;
  5. or ipvsproxy's record in the kernel lists it (`recorded`): with IPVS, the
     IPVSPROXY-CREATED ipsets (firewall/sets.py), where every virtual server ipvsproxy
     makes on an address not on its dummy device (a node address: NodePorts, node-address
     externalIPs) is written in the pass that makes it and removed in the pass that deletes
     it; with the iptables fallback, its own chains, which hold nothing but what it wrote.
     So a node-address virtual server goes with its Service at any port, also after a
     restart, and one that ipvsproxy did not make is never claimed for being on a node
     address, at any port;
  6. or kube-proxy's record lists it (firewall/kube_proxy.py): on a node that has just
     moved from kube-proxy's IPVS mode, a virtual server on a NodePort address whose
     protocol and port kube-proxy's NodePort ipsets list (read at the process's first full
     pass, while `cleanup --kube-proxy` has not removed them) is a NodePort kube-proxy made.
Everything else (keepalived's VIPs, an administrator's `ipvsadm -A`, fwmark services) is
foreign: never updated, never deleted, destinations never touched.

Imports: config, model.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

from ipvsproxy.config import Config
from ipvsproxy.model import IPAddress, IPNetwork, VSKey


@dataclass(frozen=True, slots=True)
class Ownership:
    service_cidrs: tuple[IPNetwork, ...] = ()
    exclude_cidrs: tuple[IPNetwork, ...] = ()
    nodeport_addresses: frozenset[IPAddress] = frozenset()
    nodeport_range: tuple[int, int] = (30000, 32767)
    known: Container[VSKey] = frozenset()  # virtual servers this process has wanted
    recorded: Container[VSKey] = frozenset()  # listed in the kernel as made by ipvsproxy
    # (or kube-proxy); False where such a record is kept, so that rule 3c does not apply
    range_claims: bool = True

    def claims(self, key: VSKey, bound: frozenset[IPAddress]) -> bool:
        """Whether an existing virtual server that is not desired is ipvsproxy's to delete."""
        address = key.address
        if key.fwmark or any(address in net for net in self.exclude_cidrs):
            return False
        if (
            key in self.known
            or key in self.recorded
            or address in bound
            or any(address in net for net in self.service_cidrs)
        ):
            return True
        low, high = self.nodeport_range
        return self.range_claims and address in self.nodeport_addresses and low <= key.port <= high


def ownership_for(config: Config, node_addresses: tuple[IPAddress, ...]) -> Ownership:
    """The ownership rule for this node and configuration."""
    return Ownership(
        service_cidrs=config.service_cidrs,
        exclude_cidrs=config.exclude_cidrs,
        nodeport_addresses=frozenset(
            a for a in node_addresses if config.selects_nodeport_address(a)
        ),
        nodeport_range=config.nodeport_range,
    )
