"""Per-Service traffic metrics (`--service-metrics`) on the real kernel: a Service programmed
through ipvsproxy's own pass, real connections from a client namespace, and the series
rendered from the IPVS counters, read on a netlink connection of the reader's own (as the
agent reads them), rise by what was sent."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from integration.lab import PORT, Lab, ipvs_lab, request
from integration.services import NODE_IP, program, svc
from ipvsproxy.metrics import Metrics
from ipvsproxy.netlink import NetlinkKernel
from ipvsproxy.traffic import TrafficReader

pytestmark = pytest.mark.vm

VIP = "10.96.0.40"
SERVICE = {"namespace": "default", "service": "metered", "port": "p", "protocol": "TCP"}


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with ipvs_lab(3) as lab:
        yield lab


Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(metrics: Metrics) -> Series:
    out: Series = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[s.name, frozenset(s.labels.items())] = s.value
    return out


def value(series: Series, name: str, **labels: str) -> float:
    return series.get((name, frozenset({**SERVICE, **labels}.items())), 0.0)


def test_the_series_of_a_service_rise_with_real_traffic(lab):
    before: Series = {}
    after: Series = {}

    def rose(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    with NetlinkKernel() as kernel:
        synced = program(kernel, lab, svc("metered", VIP, type="NodePort", node_port=30040))
        metrics = Metrics()
        reader = TrafficReader(NetlinkKernel, min_interval=0.0)  # its own connection
        try:
            traffic = metrics.service_traffic(
                lambda: reader.read().traffic, endpoints=True, max_series=1000
            )
            traffic.use_names(synced.proxier.index.origins())
            before = scrape(metrics)
            answered = Counter(request(lab.clients[0], VIP, 80) for _ in range(9))
            # the kernel reports its counters as its rate estimator last summed them, every
            # 2 s (traffic.KERNEL_REFRESH): scraped until they show the connections
            deadline = time.monotonic() + 10
            while True:
                after = scrape(metrics)
                if rose("ipvsproxy_service_connections_total", address=f"{VIP}:80") >= 9:
                    break
                assert time.monotonic() < deadline, "the counters never showed the traffic"
                time.sleep(0.5)
        finally:
            reader.close()
    assert answered == {"b1": 3, "b2": 3, "b3": 3}
    cluster = {"address": f"{VIP}:80"}

    assert rose("ipvsproxy_service_connections_total", **cluster) == 9
    for direction in ("in", "out"):  # NAT: the replies pass the node too
        assert rose("ipvsproxy_service_packets_total", **cluster, direction=direction) >= 9
        assert rose("ipvsproxy_service_bytes_total", **cluster, direction=direction) > 0
    per_endpoint = [
        rose("ipvsproxy_endpoint_connections_total", **cluster, endpoint=f"{b.address}:{PORT}")
        for b in lab.backends
    ]
    assert per_endpoint == [3, 3, 3]
    node_port = {"address": f"{NODE_IP}:30040"}  # exported, no traffic sent to it
    assert (
        "ipvsproxy_service_connections_total",
        frozenset({**SERVICE, **node_port}.items()),
    ) in after
    assert rose("ipvsproxy_service_connections_total", **node_port) == 0
