"""What both benchmarks share: the S x D table, throw-away namespaces, timing."""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from ipaddress import IPv4Address
from typing import Any

from ipvsproxy.model import IpvsState, Proto, RealServer, RSKey, VirtualServer, VSKey
from ipvsproxy.schedulers import Scheduler

_counter = 0


def table(services: int, dests: int, scheduler: Scheduler = Scheduler.RR) -> IpvsState:
    vss = {}
    rss = {}
    for s in range(services):
        key = VSKey(IPv4Address(0x0A600000 + s), 80, Proto.TCP)  # 10.96.x.y
        vss[key] = VirtualServer(key, scheduler)
        rss[key] = {
            rs.key: rs
            for d in range(dests)
            for rs in [RealServer(RSKey(IPv4Address(0x0AF40000 + d * 4096 + s), 8080))]
        }
    return IpvsState(vss, rss)


@contextmanager
def fresh_netns() -> Iterator[str]:
    global _counter
    _counter += 1
    name = f"bench{_counter}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    # IPVS rejects destinations whose address type it cannot resolve: lo must be up.
    subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
    # the bench node's address on a link: NodePorts listen on the host's own addresses
    subprocess.run(  # veth: this host's kernel has no dummy module (the VM's has)
        ["ip", "-n", name, "link", "add", "node0", "type", "veth", "peer", "name", "node0p"],
        check=True,
    )
    subprocess.run(
        ["ip", "-n", name, "addr", "add", f"{node_ip(0)}/32", "dev", "node0"], check=True
    )
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median(fn: Callable[[], float], repeat: int) -> float:
    return statistics.median(fn() for _ in range(repeat))


# ---- a realistic cluster, as the API serves it (bench/whole_path.py) -------------------------

BENCH_NODE = "node-0"  # the node the agent runs as; endpoints are spread over NODES nodes
NODES = 5
POD_NETWORK = "10.128.0.0/9"  # node k's pods are in 10.(128+k).0.0/16
TWO_PORTS_EVERY = 10  # service i with i % 10 == 3 also serves https (443 -> 8443)
NODE_PORT_EVERY = 10  # service i with i % 10 == 5 is a NodePort (30000 + i // 10)
NAMESPACES = 20
SLICE_MAX = 100  # endpoints per EndpointSlice, as the EndpointSlice controller writes them
API_VIP, DNS_VIP = "10.96.0.1", "10.96.0.10"  # critical_services(): below cluster_ip(0)

RawObject = dict[str, Any]


def node_ip(k: int) -> str:
    return str(IPv4Address(0xC0A8000A + k))  # 192.168.0.10 + k


def cluster_ip(i: int) -> str:
    return str(IPv4Address(0x0A600010 + i))  # 10.96.0.16 + i, inside 10.96.0.0/16


def pod_ip(g: int) -> str:
    """The g-th pod of the cluster, on node g % NODES."""
    k, index = g % NODES, g // NODES
    return str(IPv4Address(0x0A800000 + (k << 16) + 2 + index))


def _meta(name: str, namespace: str | None, uid: int, manager: str, **extra: Any) -> RawObject:
    meta: RawObject = {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace
    meta.update(
        uid=f"00000000-0000-4000-8000-{uid:012x}",
        resourceVersion=str(1000 + uid),
        creationTimestamp="2026-11-01T12:00:00Z",
        **extra,
        # what a real API server sends and ipvsproxy never reads
        managedFields=[
            {
                "manager": manager,
                "operation": "Update",
                "apiVersion": "v1",
                "time": "2026-11-01T12:00:00Z",
                "fieldsType": "FieldsV1",
                "fieldsV1": {"f:metadata": {"f:labels": {".": {}, "f:app": {}}}, "f:spec": {}},
            }
        ],
    )
    return meta


def load_balancer_ip(i: int) -> str:
    return str(IPv4Address(0xAC100000 + i))  # 172.16.0.0 + i


def is_load_balancer(i: int, every: int) -> bool:
    return every > 0 and i % every == every // 3 and not is_node_port(i)


def is_node_port(i: int) -> bool:
    return i % NODE_PORT_EVERY == 5


def _service(i: int, load_balancer_every: int = 0) -> RawObject:
    """Service i: ClusterIP, one in NODE_PORT_EVERY a NodePort, one in `load_balancer_every`
    (0: none) a LoadBalancer with an ingress IP (and its NodePorts)."""
    name, ns = f"svc-{i}", f"ns-{i % NAMESPACES}"
    ports: list[RawObject] = [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]
    if i % TWO_PORTS_EVERY == 3:
        ports.append({"name": "https", "port": 443, "protocol": "TCP", "targetPort": 8443})
    spec: RawObject = {
        "clusterIP": cluster_ip(i),
        "clusterIPs": [cluster_ip(i)],
        "internalTrafficPolicy": "Cluster",
        "ipFamilies": ["IPv4"],
        "ipFamilyPolicy": "SingleStack",
        "ports": ports,
        "selector": {"app": name},
        "sessionAffinity": "None",
        "type": "ClusterIP",
    }
    status: RawObject = {"loadBalancer": {}}
    if is_node_port(i):
        spec.update(type="NodePort", externalTrafficPolicy="Cluster")
        for n, p in enumerate(ports):
            p["nodePort"] = 30000 + 2 * (i // NODE_PORT_EVERY) + n
    elif is_load_balancer(i, load_balancer_every):
        spec.update(type="LoadBalancer", externalTrafficPolicy="Cluster",
                    allocateLoadBalancerNodePorts=True)  # fmt: skip
        for n, p in enumerate(ports):  # above the NodePorts' numbers
            p["nodePort"] = 40000 + 2 * (i // load_balancer_every) + n
        status = {"loadBalancer": {"ingress": [{"ip": load_balancer_ip(i), "ipMode": "VIP"}]}}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(
            name, ns, 2 * i, "kube-controller-manager", labels={"app": name}, annotations={}
        ),
        "spec": spec,
        "status": status,
    }


def _slices(i: int, dests: int, first_pod: int) -> list[RawObject]:
    """Service i's EndpointSlices: its `dests` endpoints, SLICE_MAX a slice (the last one
    holds the rest), as the EndpointSlice controller writes them."""
    out = []
    for part, start in enumerate(range(0, max(dests, 1), SLICE_MAX)):
        raw = _slice(i, min(SLICE_MAX, dests - start), first_pod + start, offset=start)
        if part:
            raw["metadata"]["name"] += f"-{part}"
            raw["metadata"]["uid"] = raw["metadata"]["uid"][:-6] + f"{part:06x}"
        out.append(raw)
    return out


def _slice(i: int, dests: int, first_pod: int, *, offset: int = 0) -> RawObject:
    name, ns = f"svc-{i}", f"ns-{i % NAMESPACES}"
    ports = [{"name": "http", "port": 8080, "protocol": "TCP"}]
    if i % TWO_PORTS_EVERY == 3:
        ports.append({"name": "https", "port": 8443, "protocol": "TCP"})
    endpoints = []
    for j in range(offset, offset + dests):
        g = first_pod + j - offset
        endpoints.append(
            {
                "addresses": [pod_ip(g)],
                "conditions": {"ready": True, "serving": True, "terminating": False},
                "nodeName": f"node-{g % NODES}",
                "targetRef": {
                    "kind": "Pod",
                    "namespace": ns,
                    "name": f"{name}-{j:05x}",
                    "uid": f"00000000-0000-4000-9000-{g:012x}",
                },
                "zone": f"zone-{g % NODES % 3}",
            }
        )
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": _meta(
            f"{name}-{i:05x}",
            ns,
            2 * i + 1,
            "endpointslice-controller",
            generateName=f"{name}-",
            labels={
                "kubernetes.io/service-name": name,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            },
            ownerReferences=[
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "name": name,
                    "uid": f"00000000-0000-4000-8000-{2 * i:012x}",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        ),
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": ports,
    }


def cluster_node(k: int) -> RawObject:
    subnet = f"10.{128 + k}.0.0/16"
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": _meta(f"node-{k}", None, 1 << 40 | k, "kubelet"),
        "spec": {"podCIDR": subnet, "podCIDRs": [subnet]},
        "status": {
            "addresses": [
                {"type": "InternalIP", "address": node_ip(k)},
                {"type": "Hostname", "address": f"node-{k}"},
            ]
        },
    }


def cluster(services: int, dests: int, *, load_balancer_every: int = 0) -> list[RawObject]:
    """Nodes, Services and EndpointSlices of a cluster: `services` Services with `dests` ready
    endpoints each (slices of at most SLICE_MAX), spread over NODES nodes (BENCH_NODE among
    them); one in ten Services has a second port, one in ten is a NodePort, and one in
    `load_balancer_every` (0: none) a LoadBalancer."""
    objects = [cluster_node(k) for k in range(NODES)]
    for i in range(services):
        objects.append(_service(i, load_balancer_every))
        objects += _slices(i, dests, i * dests)
    return objects


def critical_services(api_address: str, api_port: int) -> list[RawObject]:
    """The two Services a node needs first (`--first-services`' default): `default/kubernetes`
    (API_VIP:443 -> the API server at api_address:api_port, a slice without selector, as the
    API server writes it) and `kube-system/kube-dns` (DNS_VIP: 53/UDP, 53/TCP, 9153/TCP ->
    two CoreDNS pods)."""
    api = {"name": "https", "port": 443, "protocol": "TCP", "targetPort": api_port}
    kubernetes = _service(0)
    kubernetes["metadata"].update(name="kubernetes", namespace="default", labels={}, uid="api")
    kubernetes["spec"].update(clusterIP=API_VIP, clusterIPs=[API_VIP], ports=[api])
    del kubernetes["spec"]["selector"]
    dns_ports = [("dns", 53, "UDP"), ("dns-tcp", 53, "TCP"), ("metrics", 9153, "TCP")]
    dns = _service(0)
    dns["metadata"].update(name="kube-dns", namespace="kube-system", labels={}, uid="dns")
    dns["spec"].update(
        clusterIP=DNS_VIP,
        clusterIPs=[DNS_VIP],
        selector={"k8s-app": "kube-dns"},
        ports=[{"name": n, "port": p, "protocol": t, "targetPort": p} for n, p, t in dns_ports],
    )
    out = [kubernetes, dns]
    for svc, ns, ports, addresses in (
        ("kubernetes", "default", [("https", api_port, "TCP")], [api_address]),
        ("kube-dns", "kube-system", dns_ports, ["10.128.255.10", "10.129.255.10"]),
    ):
        raw = _slice(0, 0, 0)
        raw["metadata"].update(
            name=svc if svc == "kubernetes" else f"{svc}-00000", namespace=ns, uid=f"{svc}-slice"
        )
        raw["metadata"]["labels"]["kubernetes.io/service-name"] = svc
        raw["metadata"].pop("ownerReferences")
        raw["ports"] = [{"name": n, "port": p, "protocol": t} for n, p, t in ports]
        raw["endpoints"] = [
            {"addresses": [a], "conditions": {"ready": True, "serving": True, "terminating": False}}
            for a in addresses
        ]
        out.append(raw)
    return out


def expected_counts(services: int, dests: int, load_balancer_every: int = 0) -> tuple[int, int]:
    """(virtual servers, real servers) that `cluster(services, dests, ...)` translates to."""
    vss = 0
    for i in range(services):
        ports = 2 if i % TWO_PORTS_EVERY == 3 else 1
        # the ClusterIP; a NodePort's on the one node address; a LoadBalancer's also its ingress
        kinds = 1 + is_node_port(i) + 2 * is_load_balancer(i, load_balancer_every)
        vss += ports * kinds
    return vss, vss * dests
