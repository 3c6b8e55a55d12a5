"""A decoded Node (api/schema.py) to its `NodeView`.

Imports: api.views, api.schema, api.values, api.services, model, the standard library.
"""

from __future__ import annotations

from ipvsproxy.api import schema
from ipvsproxy.api.services import names
from ipvsproxy.api.values import cidr, ip, kept
from ipvsproxy.api.views import NodeView
from ipvsproxy.model import IPAddress, IPNetwork

TO_BE_DELETED_TAINT = "ToBeDeletedByClusterAutoscaler"  # kube-proxy's ToBeDeletedTaint


def node_view(raw: schema.Node) -> NodeView:
    _, node_name, meta = names(raw.metadata, namespaced=False)
    addresses: list[IPAddress] = []
    by_kind: dict[str, list[IPAddress]] = {"InternalIP": [], "ExternalIP": []}
    status = raw.status
    for i, item in enumerate(status.addresses or () if status is not None else ()):
        if item.type in by_kind:
            address = ip(item.address, f"status.addresses[{i}].address")
            by_kind[item.type].append(address)
            if address not in addresses:
                addresses.append(address)
    ranked = (*by_kind["InternalIP"], *by_kind["ExternalIP"])
    primary = [
        next(a for a in ranked if a.version == v)
        for v in (4, 6)
        if any(a.version == v for a in ranked)
    ]
    spec = raw.spec or schema.NodeSpec()
    return NodeView(
        node_name,
        tuple(addresses),
        kept(meta.labels),
        _pod_cidrs(spec),
        tuple(primary),
        _eligible(meta.deletion_timestamp, spec),
    )


def _pod_cidrs(spec: schema.NodeSpec) -> tuple[IPNetwork, ...]:
    """spec.podCIDRs, or the older spec.podCIDR alone."""
    if spec.pod_cidrs:
        return tuple(cidr(text, f"spec.podCIDRs[{i}]") for i, text in enumerate(spec.pod_cidrs))
    return (cidr(spec.pod_cidr, "spec.podCIDR"),) if spec.pod_cidr else ()


def _eligible(deletion_timestamp: object, spec: schema.NodeSpec) -> bool:
    """kube-proxy's SyncNode: a Node being deleted or tainted for deletion by the cluster
    autoscaler is not eligible (its /healthz answers 503, so load balancers drain it)."""
    if deletion_timestamp not in (None, ""):
        return False
    return not any(taint.key == TO_BE_DELETED_TAINT for taint in spec.taints or ())
