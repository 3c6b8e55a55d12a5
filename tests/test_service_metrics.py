"""Per-Service traffic metrics (`--service-metrics`, issue 29 item 2): the IPVS counters of
every virtual server ipvsproxy programs, named by the Service port it serves, read at scrape
time and never on the sync path; per endpoint only with `--endpoint-metrics`; a cap on the
series with a counter of what it dropped; none in the iptables fallback; and /metrics
rendered off the event loop, so /healthz stays fast while the kernel is read."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping
from ipaddress import ip_address

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from ipvsproxy import agent, backends
from ipvsproxy.backends import IPTABLES, IPVS, Backend
from ipvsproxy.cli import main
from ipvsproxy.config import Config
from ipvsproxy.errors import KernelError
from ipvsproxy.metrics import Metrics
from ipvsproxy.metrics.service_traffic import ServiceTraffic
from ipvsproxy.model import (
    AddService,
    Counters,
    DestTraffic,
    Proto,
    RSKey,
    Traffic,
    VirtualServer,
    VSKey,
)
from ipvsproxy.serve import Health, InThread
from ipvsproxy.testing import FakeKernel
from ipvsproxy.traffic import TrafficReader
from tests.factories import ep, port, service, slice_
from tests.support import Agent, eventually, sample
from tests.test_cli_flags import agent_run
from tests.test_serve import answered, exchange, probe

CLUSTER = VSKey(ip_address("10.96.0.10"), 80, Proto.TCP)
EXTERNAL = VSKey(ip_address("203.0.113.5"), 80, Proto.TCP)
POD_A = RSKey(ip_address("10.244.0.1"), 8080)
POD_B = RSKey(ip_address("10.244.0.2"), 8080)
WEB = {"namespace": "default", "service": "web", "port": "http", "protocol": "TCP"}


def web_agent(
    *,
    endpoints: bool = False,
    max_series: int = 10_000,
    on_names: Callable[[Mapping[VSKey, str]], None] | None = None,
) -> tuple[Agent, ServiceTraffic]:
    """An agent serving default/web (port `http`, a ClusterIP and an externalIP: two virtual
    servers, two endpoints) with the traffic metrics on, read from its FakeKernel; the pass
    hands its names to the collector, or to `on_names` if given."""
    metrics, kernel = Metrics(), FakeKernel()
    collector = metrics.service_traffic(kernel.traffic, endpoints=endpoints, max_series=max_series)
    agent_ = Agent(metrics=metrics, kernel=kernel, on_names=on_names or collector.use_names)
    agent_.feed(
        service("web", externalIPs=["203.0.113.5"]),
        slice_("web", endpoints=[ep("10.244.0.1"), ep("10.244.0.2")]),
    )
    agent_.sync()
    agent_.kernel.counters[CLUSTER] = Traffic(
        Counters(connections=3, packets_in=10, packets_out=8, bytes_in=1000, bytes_out=800),
        {
            POD_A: DestTraffic(counters=Counters(2, 7, 5, 700, 500)),
            POD_B: DestTraffic(counters=Counters(1, 3, 3, 300, 300)),
        },
    )
    agent_.kernel.conns[CLUSTER] = {POD_A: (2, 1), POD_B: (0, 4)}
    agent_.kernel.counters[EXTERNAL] = Traffic(Counters(1, 2, 2, 100, 90))
    return agent_, collector


def series(metrics: Metrics, prefix: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every traffic sample of the rendered registry whose name starts with `prefix` (not
    the feature's own dropped and error counters)."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if s.name.startswith(prefix) and "_service_metrics_" not in s.name:
                out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def labels(**more: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({**WEB, **more}.items()))


def test_each_virtual_server_of_a_service_port_has_its_counters_exactly():
    agent_, _ = web_agent()
    at = {"address": "10.96.0.10:80"}
    ext = {"address": "203.0.113.5:80"}
    assert series(agent_.metrics, "ipvsproxy_service_") == {
        ("ipvsproxy_service_connections_total", labels(**at)): 3,
        ("ipvsproxy_service_packets_total", labels(**at, direction="in")): 10,
        ("ipvsproxy_service_packets_total", labels(**at, direction="out")): 8,
        ("ipvsproxy_service_bytes_total", labels(**at, direction="in")): 1000,
        ("ipvsproxy_service_bytes_total", labels(**at, direction="out")): 800,
        ("ipvsproxy_service_active_connections", labels(**at)): 2,
        ("ipvsproxy_service_inactive_connections", labels(**at)): 5,
        ("ipvsproxy_service_connections_total", labels(**ext)): 1,
        ("ipvsproxy_service_packets_total", labels(**ext, direction="in")): 2,
        ("ipvsproxy_service_packets_total", labels(**ext, direction="out")): 2,
        ("ipvsproxy_service_bytes_total", labels(**ext, direction="in")): 100,
        ("ipvsproxy_service_bytes_total", labels(**ext, direction="out")): 90,
        ("ipvsproxy_service_active_connections", labels(**ext)): 0,
        ("ipvsproxy_service_inactive_connections", labels(**ext)): 0,
    }
    assert series(agent_.metrics, "ipvsproxy_endpoint_") == {}  # not without the second flag
    text = agent_.metrics.render().decode()
    assert "ipvsproxy_endpoint_" not in text


def test_endpoint_series_come_with_the_second_flag():
    agent_, _ = web_agent(endpoints=True)
    at = {"address": "10.96.0.10:80"}
    got = series(agent_.metrics, "ipvsproxy_endpoint_")
    a = labels(**at, endpoint="10.244.0.1:8080")
    b = labels(**at, endpoint="10.244.0.2:8080")
    assert got[("ipvsproxy_endpoint_connections_total", a)] == 2
    a_in = labels(**at, endpoint="10.244.0.1:8080", direction="in")
    assert got[("ipvsproxy_endpoint_bytes_total", a_in)] == 700
    assert got[("ipvsproxy_endpoint_active_connections", a)] == 2
    assert got[("ipvsproxy_endpoint_inactive_connections", b)] == 4
    assert got[("ipvsproxy_endpoint_packets_total", labels(**at, endpoint="10.244.0.2:8080",
                                                           direction="out"))] == 3  # fmt: skip
    # 2 virtual servers x 2 endpoints x 7 lines
    assert len(got) == 28
    assert len(series(agent_.metrics, "ipvsproxy_service_")) == 14


def test_names_follow_the_services_and_ipv6_addresses_are_bracketed():
    metrics, kernel = Metrics(), FakeKernel()
    collector = metrics.service_traffic(kernel.traffic, endpoints=True, max_series=99)
    agent_ = Agent(metrics=metrics, kernel=kernel, on_names=collector.use_names)
    unnamed = service("dns", ns="kube-system", cluster_ips=("fd00::10",), ipFamilies=["IPv6"],
                      ports=[port(None, 53, "UDP", 53)])  # fmt: skip
    agent_.feed(unnamed, slice_("dns", ns="kube-system", family="IPv6", ports=((None, 53, "UDP"),),
                                endpoints=[ep("fd00::1:5")]))  # fmt: skip
    agent_.sync()
    got = series(agent_.metrics, "ipvsproxy_")
    want = {"namespace": "kube-system", "service": "dns", "port": "53", "protocol": "UDP",
            "address": "[fd00::10]:53"}  # fmt: skip
    assert ("ipvsproxy_service_connections_total", tuple(sorted(want.items()))) in got
    with_ep = tuple(sorted({**want, "endpoint": "[fd00::1:5]:53"}.items()))
    assert ("ipvsproxy_endpoint_connections_total", with_ep) in got
    agent_.feed()  # the Service is gone
    agent_.sync()
    assert not [k for k in series(agent_.metrics, "ipvsproxy_") if "connections_total" in k[0]]


def test_virtual_servers_ipvsproxy_did_not_make_are_not_exported():
    agent_, _ = web_agent()
    foreign = VSKey(ip_address("192.0.2.1"), 8000, Proto.TCP)
    agent_.kernel.apply([AddService(VirtualServer(foreign))])  # another tool's
    agent_.kernel.counters[foreign] = Traffic(Counters(connections=99))
    addresses = {dict(k[1])["address"] for k in series(agent_.metrics, "ipvsproxy_service_")}
    assert addresses == {"10.96.0.10:80", "203.0.113.5:80"}


def test_the_cap_keeps_the_first_groups_in_sorted_order_and_counts_the_rest(caplog):
    caplog.set_level(logging.WARNING, logger="ipvsproxy.metrics")
    agent_, _ = web_agent(endpoints=True, max_series=20)  # room for 2 groups of 7
    got = series(agent_.metrics, "ipvsproxy_service_")
    assert {dict(k[1])["address"] for k in got} == {"10.96.0.10:80", "203.0.113.5:80"}
    assert len(got) == 14
    assert series(agent_.metrics, "ipvsproxy_endpoint_") == {}  # virtual servers first
    dropped = "ipvsproxy_service_metrics_dropped_series_total"
    # each scrape drops the 4 endpoint groups (28 lines), counted in that same scrape
    assert sample(agent_.metrics, dropped) == 28 * 3  # series() rendered twice before
    assert sample(agent_.metrics, dropped) == 28 * 4
    warnings = [r for r in caplog.records if "max-series" in r.message]
    assert len(warnings) == 1  # said once, not per scrape
    agent_small, _ = web_agent(max_series=13)  # one group fits, sorted first: the ClusterIP
    got = series(agent_small.metrics, "ipvsproxy_service_")
    assert {dict(k[1])["address"] for k in got} == {"10.96.0.10:80"}
    assert sample(agent_small.metrics, dropped) == 14  # this scrape and series()', 7 each


def test_what_the_cap_keeps_does_not_depend_on_the_kernels_order():
    """The same groups kept whatever order the dump lists them in: sorted by labels."""
    keys = [VSKey(ip_address(f"10.96.0.{i}"), 80, Proto.TCP) for i in (3, 1, 2)]
    names = {k: f"ns{k.address.packed[-1]}/svc:http" for k in keys}
    kept = []
    for order in (keys, keys[::-1]):
        metrics = Metrics()
        traffic = {k: Traffic(Counters(connections=1)) for k in order}
        read: Callable[[], Mapping[VSKey, Traffic]] = functools.partial(dict, traffic)
        collector = metrics.service_traffic(read, endpoints=False, max_series=14)
        collector.use_names(names)
        kept.append({dict(k[1])["namespace"] for k in series(metrics, "ipvsproxy_service_")})
    assert kept == [{"ns1", "ns2"}, {"ns1", "ns2"}]


def test_nothing_reads_the_kernel_on_the_sync_path():
    agent_, _ = web_agent(endpoints=True)
    for full in (True, False, True):
        if full:
            agent_.sync.request_full()
        agent_.sync()
    assert agent_.kernel.traffic_reads == 0  # syncs never read the counters
    agent_.metrics.render()
    assert agent_.kernel.traffic_reads == 1  # a scrape does


def test_without_the_flag_nothing_is_registered_and_nothing_read():
    agent_ = Agent()
    agent_.feed(service("web"), slice_("web", endpoints=[ep("10.244.0.1")]))
    agent_.sync()
    reader = TrafficReader(lambda: agent_.kernel)
    assert agent._service_metrics(Config(), agent_.metrics, reader, IPVS) is None
    agent_.sync()
    text = agent_.metrics.render().decode()
    assert "ipvsproxy_service_" not in text
    assert agent_.kernel.traffic_reads == 0


def test_the_iptables_fallback_exports_none_and_reads_nothing(caplog):
    caplog.set_level(logging.INFO, logger="ipvsproxy.agent")
    agent_ = Agent()
    opened: list[int] = []
    reader = TrafficReader(lambda: opened.append(1) or agent_.kernel)  # type: ignore[func-returns-value]
    on = Config(service_metrics=True, endpoint_metrics=True)
    assert agent._service_metrics(on, agent_.metrics, reader, IPTABLES) is None
    assert "ipvsproxy_service_" not in agent_.metrics.render().decode()
    assert opened == []
    assert any("iptables fallback" in r.message for r in caplog.records)
    # and what the reader opens there is the fallback's own kernel: no netlink connection
    kernel = FakeKernel()
    assert backends.traffic_kernel(Backend(kernel, IPTABLES, "test")) is kernel


def test_ipvs_traffic_is_read_on_a_kernel_connection_of_its_own(monkeypatch):
    """A generic-netlink connection of its own that opens nothing else (no dummy device,
    no address-event subscription left unread)."""
    from ipvsproxy.netlink import ipvs_kernel

    opened: list[str] = []

    class Genl:
        def __init__(self) -> None:
            opened.append("genl")

    monkeypatch.setattr(ipvs_kernel, "GenlSocket", Genl)
    monkeypatch.setattr(ipvs_kernel, "DummyDevice", lambda name: opened.append(name))
    reader = backends.traffic_kernel(Backend(FakeKernel(), IPVS, "test"))
    assert isinstance(reader, ipvs_kernel.CounterReader)
    assert opened == ["genl"]


def test_a_failed_reading_gives_no_series_and_is_counted_once_in_the_log(caplog):
    caplog.set_level(logging.WARNING, logger="ipvsproxy.metrics")
    failing = [True]

    def read():
        if failing[0]:
            raise KernelError("netlink: no buffer space")
        return {}

    metrics = Metrics()
    metrics.service_traffic(read, endpoints=False, max_series=100)
    for _ in range(3):
        assert "ipvsproxy_service_connections_total{" not in metrics.render().decode()
    assert sample(metrics, "ipvsproxy_service_metrics_read_errors_total") == 4  # 3 + this one
    assert len([r for r in caplog.records if "cannot read" in r.message]) == 1
    failing[0] = False
    assert sample(metrics, "ipvsproxy_service_metrics_read_errors_total") == 4


def test_registering_reads_nothing():
    calls: list[int] = []
    Metrics().service_traffic(lambda: calls.append(1) or {}, endpoints=True, max_series=10)  # type: ignore[func-returns-value]
    assert calls == []


def test_the_names_handed_over_are_a_snapshot_copied_only_when_names_change():
    handed: list[Mapping[VSKey, str]] = []
    agent_, _ = web_agent(on_names=handed.append)
    agent_.sync()
    first = handed[-1]
    agent_.feed(
        service("web", externalIPs=["203.0.113.5"]),
        slice_("web", endpoints=[ep("10.244.0.1")]),  # an endpoint gone: no name changes
    )
    agent_.sync()
    assert handed[-1] is first  # not copied again
    agent_.feed(service("web"), slice_("web", endpoints=[ep("10.244.0.1")]))  # externalIP gone
    agent_.sync()
    assert handed[-1] is not first
    assert set(first) == {CLUSTER, EXTERNAL}  # the one a scrape may hold did not change
    assert set(handed[-1]) == {CLUSTER}
    with pytest.raises(TypeError):
        first[CLUSTER] = "x"  # type: ignore[index]  # read-only: that is the point


# ---- the agent's /metrics with the flag: off the event loop ------------------------------


class SlowKernel(FakeKernel):
    """A kernel whose counters take until `release` is set to read."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.reading = threading.Event()

    def traffic(self):
        self.reading.set()
        self.release.wait(120)  # released by the test (a bound, should it not be)
        return super().traffic()


@pytest.mark.parametrize("in_thread", [True, False])
def test_healthz_is_answered_while_metrics_read_a_slow_kernel(in_thread):
    """With --service-metrics, /metrics reads the kernel: rendered in the worker thread
    (InThread), a probe is answered while that read is still blocked; rendered on the event
    loop, no probe is answered until it ends (why InThread)."""
    kernel = SlowKernel()
    metrics = Metrics()
    reader = TrafficReader(lambda: kernel)
    metrics.service_traffic(lambda: reader.read().traffic, endpoints=False, max_series=100)
    config = Config(metrics_bind_address=("127.0.0.1", 0), healthz_bind_address=("127.0.0.1", 0))
    servers = [
        agent._serve_metrics(config, metrics.render, mode="ipvs", in_thread=in_thread),
        agent._serve_health(config, Health(timeout=60)),
    ]
    try:
        answers: list[bytes] = []
        scrape = threading.Thread(
            target=lambda: answers.append(
                exchange(servers[0].port, b"GET /metrics HTTP/1.1\r\n\r\n", timeout=10)
            )
        )
        scrape.start()
        assert kernel.reading.wait(30)
        if in_thread:  # answered while the scrape still waits for the kernel
            assert answered(servers[1].port)
            assert not answers
        else:  # rendered on the event loop, the probe waits for the kernel: why InThread
            assert probe(servers[1].port, timeout=1.0) >= 1.0
        kernel.release.set()
        scrape.join(30)
        assert answers
        assert answers[0].startswith(b"HTTP/1.1 200")
    finally:
        kernel.release.set()
        for server in servers:
            server.close()


def test_the_metrics_route_is_in_thread_only_with_the_flag(monkeypatch):
    routes: list[dict[str, object]] = []

    class Server:
        port = 0

        def __init__(self, address, given, **kw):
            routes.append(dict(given))

        def start(self):
            return self

    from ipvsproxy import serve

    monkeypatch.setattr(serve, "HttpServer", Server)
    agent._serve_metrics(Config(), lambda: b"", mode="ipvs")
    assert not isinstance(routes[0]["/metrics"], InThread)
    agent._serve_metrics(Config(), lambda: b"", mode="ipvs", in_thread=True)
    assert isinstance(routes[1]["/metrics"], InThread)


# ---- the flags ------------------------------------------------------------------------


def test_the_flags_reach_the_config(monkeypatch):
    config, _, _ = agent_run(monkeypatch, "--kubeconfig", "kc")
    assert (config.service_metrics, config.endpoint_metrics) == (False, False)
    assert config.service_metrics_max_series == 10_000
    on = ("--service-metrics", "--endpoint-metrics", "--service-metrics-max-series", "500")
    config, _, _ = agent_run(monkeypatch, "--kubeconfig", "kc", *on)
    assert (config.service_metrics, config.endpoint_metrics) == (True, True)
    assert config.service_metrics_max_series == 500


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--endpoint-metrics"], "--endpoint-metrics needs --service-metrics"),
        (
            ["--service-metrics", "--service-metrics-max-series", "0"],
            "--service-metrics-max-series",
        ),
        (
            ["--service-metrics", "--service-metrics-max-series", "x"],
            "--service-metrics-max-series",
        ),
    ],
)
def test_bad_flags_exit_2_with_one_line(monkeypatch, args, said):
    monkeypatch.setattr(agent, "run", lambda config, *, source: None)
    result = CliRunner().invoke(main, ["run", "--kubeconfig", "kc", *args])
    assert result.exit_code == 2, result.output
    assert said in result.stderr
    if "needs" in said:
        assert len(result.stderr.strip().splitlines()) == 1


# ---- the agent end to end (FakeKernel backend, manifests) ------------------------------------


def test_the_agent_wires_the_reader_the_names_and_the_slow_route(monkeypatch, tmp_path):
    """`run` with --service-metrics: passes read no counters; a scrape of /metrics reads them
    once, from the reader's own kernel, named after the Services; /healthz answers meanwhile."""
    import json
    from contextlib import contextmanager

    from tests.factories import node
    from tests.support import free_port

    kernel, own = FakeKernel(), SlowKernel()
    own.release.set()

    @contextmanager
    def open_backend(config):
        yield Backend(kernel, IPVS, "test")

    monkeypatch.setattr(agent, "open_backend", open_backend)
    monkeypatch.setattr(agent, "prepare", lambda backend, config: None)
    monkeypatch.setattr(agent, "remove_leftovers", lambda backend, config: [])
    monkeypatch.setattr(backends, "traffic_kernel", lambda backend: own)
    objects = [node("node-a"), service("web"), slice_("web", endpoints=[ep("10.244.0.1")])]
    path = tmp_path / "objects.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    metrics_port, health_port = free_port(), free_port()
    config = Config(
        node_name="node-a",
        metrics_bind_address=("127.0.0.1", metrics_port),
        healthz_bind_address=("127.0.0.1", health_port),
        service_metrics=True,
    )
    stop = threading.Event()
    runner = threading.Thread(
        target=agent.run, args=(config,), kwargs={"source": agent.Manifests((path,)), "stop": stop}
    )
    runner.start()
    try:
        eventually(lambda: kernel.state.services, what="the first pass")
        own.state = kernel.state  # the reader's connection sees the same table
        own.counters[CLUSTER] = Traffic(Counters(connections=42))
        assert own.traffic_reads == kernel.traffic_reads == 0  # passes read no counters
        own.release.clear()
        answers: list[bytes] = []
        scrape = threading.Thread(
            target=lambda: answers.append(
                exchange(metrics_port, b"GET /metrics HTTP/1.1\r\n\r\n", timeout=10)
            )
        )
        scrape.start()
        assert own.reading.wait(30)
        assert answered(health_port)  # /metrics waits in the worker
        assert not answers
        own.release.set()
        scrape.join(30)
        line = (
            'ipvsproxy_service_connections_total{address="10.96.0.10:80",namespace="default",'
            'port="http",protocol="TCP",service="web"} 42.0'
        )
        assert line in answers[0].decode()
        assert (own.traffic_reads, kernel.traffic_reads) == (1, 0)
    finally:
        own.release.set()
        stop.set()
        runner.join(10)
    assert not runner.is_alive()
