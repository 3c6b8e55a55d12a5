"""One node's Services for the status tests: what the doc's walkthrough shows, as raw objects
(tests/factories.py), programmed into a FakeKernel by the product's own pass (support.Synced),
with counters set as the kernel's IPVS statistics would read."""

from __future__ import annotations

import json
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import jsonschema

from ipvsproxy import agent
from ipvsproxy.config import Config
from ipvsproxy.model import Counters, DestTraffic, RSKey, Traffic, VSKey
from ipvsproxy.proxier import Proxier
from ipvsproxy.testing import FakeKernel
from ipvsproxy.traffic import TrafficReader
from tests.factories import V, ep, node, port, service, slice_
from tests.support import Clock, Synced

SCHEMA = json.loads((Path(__file__).parents[2] / "docs" / "status.schema.json").read_text())
CONFIG = Config(node_name="node-a")


def pod(address: str, name: str, *, zone: str = "zone-a", **kw: Any):
    e = ep(address, **kw)
    e["targetRef"] = {"kind": "Pod", "name": name, "namespace": "demo"}
    e["zone"] = zone
    return e


def zoned_node():
    n = node("node-a")
    n["metadata"]["labels"] = {"topology.kubernetes.io/zone": "zone-a"}
    return n


WEB = service(
    "web",
    ns="demo",
    type="NodePort",
    ports=[port(node_port=30080)],
    externalTrafficPolicy="Local",
)
WEB_SLICE = slice_(
    "web",
    ns="demo",
    endpoints=[
        pod("10.244.1.5", "web-6d4cf-x7k2p"),
        pod("10.244.2.7", "web-6d4cf-q9z8m", node="node-b", zone="zone-b"),
        pod("10.244.1.9", "web-6d4cf-old11", ready=False, serving=True, terminating=True),
        pod("10.244.1.6", "web-6d4cf-new22", ready=False, serving=False),
    ],
)
DB = service("db", ns="demo", cluster_ips=("10.96.0.20",), ports=[port("pg", 5432, target=5432)])
DB_SLICE = slice_("db", ns="demo", ports=(("pg", 5432, "TCP"),), endpoints=[
    pod("10.244.1.20", "db-0"),
])  # fmt: skip
HEADLESS = service("peers", ns="demo", cluster_ips=("None",))
OBJECTS = [zoned_node(), WEB, WEB_SLICE, DB, DB_SLICE, HEADLESS]

WEB_VIP = V("10.96.0.10").key
WEB_NODEPORT = V("192.168.0.10", 30080).key
HERE = RSKey(ip_address("10.244.1.5"), 8080)
THERE = RSKey(ip_address("10.244.2.7"), 8080)


def programmed(objects: list[dict[str, Any]] = OBJECTS) -> FakeKernel:
    """A kernel as the agent's pass leaves it for `objects`."""
    kernel = FakeKernel()
    Synced(Proxier(kernel=kernel, config=CONFIG)).sync(objects)
    return kernel


def count(kernel: FakeKernel, key: VSKey, rs: RSKey, *, conns: int, scale: int = 1) -> None:
    """Counters of one destination (and its virtual server's, summed): `scale` x a
    reference reading, so two readings give known rates."""
    c = Counters(conns * scale, 10 * scale, 8 * scale, 1000 * scale, 4000 * scale)
    traffic = kernel.counters.get(key, Traffic())
    dests = {**traffic.dests, rs: DestTraffic(counters=c)}
    total = Counters(*(sum(getattr(d.counters, f) for d in dests.values()) for f in c.__slots__))
    kernel.counters[key] = Traffic(total, dests)
    kernel.conns.setdefault(key, {})[rs] = (conns, 2)


def valid(doc: dict[str, Any]):
    """The document, checked against docs/status.schema.json."""
    jsonschema.validate(doc, SCHEMA)
    return doc


def on_a_fake_clock(monkeypatch: Any) -> Clock:
    """`status` without an agent reads the counters on this clock (agent.TrafficReader)."""
    clock = Clock(100.0)

    def reader(open_kernel: Any, **kw: Any) -> TrafficReader:
        return TrafficReader(open_kernel, clock=clock, **kw)

    monkeypatch.setattr(agent, "TrafficReader", reader)
    return clock
