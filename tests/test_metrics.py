"""Metrics as kube-proxy v1.36 exports them (pkg/proxy/metrics/metrics.go): names, types,
labels, help texts and buckets, the pending gauges read from the tracker, and a sync
duration that covers the whole pass, firewall rules included; the Services whose Local
traffic policy found no endpoint on this node, by policy and IP family."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ipvsproxy.agent_loop import AgentLoop
from ipvsproxy.config import Config
from ipvsproxy.firewall.host_firewall import Firewall
from ipvsproxy.kernel import ApplyReport
from ipvsproxy.metrics import Metrics
from ipvsproxy.proxier import Proxier
from ipvsproxy.serve import Health
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, Tracker
from ipvsproxy.testing import FakeKernel
from tests.factories import ep, node, port, service, slice_
from tests.support import Agent, FakeHost, sample


def linear(start: float, width: float, count: int) -> list[float]:
    """client_golang's LinearBuckets."""
    return [start + width * i for i in range(count)]


def exponential(start: float, factor: float, count: int) -> list[float]:
    """client_golang's ExponentialBuckets: each bucket the previous one times `factor`."""
    out = [start]
    while len(out) < count:
        out.append(out[-1] * factor)
    return out


SYNC_BUCKETS = exponential(0.001, 2, 15)
# metrics.MergeBuckets starts with a bucket at 0
PROGRAMMING_BUCKETS = [
    0.0,
    *linear(0.25, 0.25, 2),
    *linear(1, 1, 59),
    *linear(60, 5, 12),
    *linear(120, 30, 7),
]

# kube-proxy's metrics as v1.36 registers them for the IPVS mode (plus the full/partial
# histograms of its iptables and nftables modes): name -> (type, labels, help, buckets)
KUBE_PROXY = {
    "kubeproxy_sync_proxy_rules_duration_seconds": (
        "histogram", {"ip_family"}, "SyncProxyRules latency in seconds", SYNC_BUCKETS
    ),
    "kubeproxy_sync_full_proxy_rules_duration_seconds": (
        "histogram",
        {"ip_family"},
        "SyncProxyRules latency in seconds for full resyncs",
        SYNC_BUCKETS,
    ),
    "kubeproxy_sync_partial_proxy_rules_duration_seconds": (
        "histogram",
        {"ip_family"},
        "SyncProxyRules latency in seconds for partial resyncs",
        SYNC_BUCKETS,
    ),
    "kubeproxy_sync_proxy_rules_last_timestamp_seconds": (
        "gauge", {"ip_family"}, "The last time proxy rules were successfully synced", None
    ),
    "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds": (
        "gauge", {"ip_family"}, "The last time a sync of proxy rules was queued", None
    ),
    "kubeproxy_network_programming_duration_seconds": (
        "histogram",
        {"ip_family"},
        "In Cluster Network Programming Latency in seconds",
        PROGRAMMING_BUCKETS,
    ),
    "kubeproxy_sync_proxy_rules_endpoint_changes_pending": (
        "gauge", set(), "Pending proxy rules Endpoint changes", None
    ),
    "kubeproxy_sync_proxy_rules_endpoint_changes": (
        "counter", set(), "Cumulative proxy rules Endpoint changes", None
    ),
    "kubeproxy_sync_proxy_rules_service_changes_pending": (
        "gauge", set(), "Pending proxy rules Service changes", None
    ),
    "kubeproxy_sync_proxy_rules_service_changes": (
        "counter", set(), "Cumulative proxy rules Service changes", None
    ),
    "kubeproxy_sync_proxy_rules_iptables_restore_failures": (
        "counter", {"ip_family"}, "Cumulative proxy iptables restore failures", None
    ),
    "kubeproxy_proxy_healthz": ("counter", {"code"}, "Cumulative proxy healthz HTTP status", None),
    "kubeproxy_proxy_livez": ("counter", {"code"}, "Cumulative proxy livez HTTP status", None),
    "kubeproxy_sync_proxy_rules_no_local_endpoints_total": (
        "gauge",
        {"traffic_policy", "ip_family"},
        "Number of services with a Local traffic policy and no endpoints",
        None,
    ),
}  # fmt: skip


def every_metric_recorded() -> Metrics:
    """A registry in which every metric has at least one sample."""
    metrics = Metrics(clock=lambda: 1_700_000_000.0)
    metrics.families((4, 6))
    metrics.queued()
    metrics.changed(SERVICE)
    metrics.changed(SLICE)
    metrics.pending(lambda: {SERVICE: 2, SLICE: 5})
    metrics.synced(
        seconds=0.5,
        plan=(),
        report=ApplyReport(),
        virtual_servers=1,
        real_servers=2,
        draining=0,
        triggers=("2023-11-14T22:13:19Z",),
    )
    metrics.no_local({("internal", 4): 1})
    metrics.restore_failed(6)
    metrics.healthz_answered(200)
    metrics.livez_answered(503)
    metrics.use_backend("ipvs", others=("iptables",))
    metrics.watch_restarts.labels(SERVICE, "410").inc()
    metrics.bind_failed()
    metrics.sync_error()
    return metrics


def families(metrics: Metrics):
    text = metrics.render().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}, text


@pytest.mark.parametrize("name", sorted(KUBE_PROXY))
def test_kube_proxys_metrics_have_its_type_labels_help_and_buckets(name):
    kind, labels, help_text, buckets = KUBE_PROXY[name]
    exported, _ = families(every_metric_recorded())
    family = exported[name]
    assert family.type == kind
    assert family.documentation == help_text
    assert family.samples, name
    for point in family.samples:
        assert set(point.labels) - {"le"} == labels, point
    if buckets is not None:
        bounds = [s.labels["le"] for s in family.samples if s.name.endswith("_bucket")]
        per_series = bounds[: len(buckets) + 1]
        assert [float(b) for b in per_series] == [*buckets, float("inf")]


def test_bucket_bounds_are_written_as_kube_proxy_writes_them():
    """The same `le` text as client_golang's output, so recording rules and dashboards
    written for kube-proxy select the same buckets."""
    _, text = families(every_metric_recorded())
    sync = "kubeproxy_sync_proxy_rules_duration_seconds_bucket"
    assert f'{sync}{{ip_family="IPv4",le="0.001"}}' in text
    assert f'{sync}{{ip_family="IPv4",le="16.384"}}' in text
    programming = "kubeproxy_network_programming_duration_seconds_bucket"
    for le in ("0.0", "0.25", "59.0", "115.0", "300.0", "+Inf"):
        assert f'{programming}{{ip_family="IPv6",le="{le}"}}' in text


def test_counters_render_with_total_and_ipvsproxys_own_metrics_stay():
    _, text = families(every_metric_recorded())
    for line in (
        "kubeproxy_sync_proxy_rules_service_changes_total 1.0",
        "kubeproxy_sync_proxy_rules_endpoint_changes_total 1.0",
        "kubeproxy_sync_proxy_rules_service_changes_pending 2.0",
        "kubeproxy_sync_proxy_rules_endpoint_changes_pending 5.0",
        'kubeproxy_sync_proxy_rules_iptables_restore_failures_total{ip_family="IPv6"} 1.0',
        'kubeproxy_sync_proxy_rules_iptables_restore_failures_total{ip_family="IPv4"} 0.0',
        'kubeproxy_proxy_healthz_total{code="200"} 1.0',
        'kubeproxy_proxy_livez_total{code="503"} 1.0',
        'ipvsproxy_syncs_total{result="error"} 1.0',
        'ipvsproxy_backend{backend="ipvs"} 1.0',
        "ipvsproxy_health_check_node_port_bind_errors_total 1.0",
        'ipvsproxy_watch_restarts_total{reason="410",resource="Service"} 1.0',
    ):
        assert line in text.splitlines(), line
    for name in ("virtual_servers", "real_servers", "draining_real_servers"):
        assert f"\nipvsproxy_{name} " in text


def test_restore_failures_are_counted_per_family_ipv4_by_default():
    metrics = Metrics()
    metrics.families((4, 6))
    metrics.restore_failed()
    metrics.restore_failed(6)
    metrics.restore_failed(6)
    name = "kubeproxy_sync_proxy_rules_iptables_restore_failures_total"
    assert sample(metrics, name, ip_family="IPv4") == 1
    assert sample(metrics, name, ip_family="IPv6") == 2


def test_health_answers_are_counted_by_path_and_code():
    metrics = Metrics()
    metrics.health_answered("/healthz", 503)
    metrics.health_answered("/livez", 200)
    metrics.healthz_answered(200)
    assert sample(metrics, "kubeproxy_proxy_healthz_total", code="503") == 1
    assert sample(metrics, "kubeproxy_proxy_healthz_total", code="200") == 1
    assert sample(metrics, "kubeproxy_proxy_livez_total", code="200") == 1
    assert sample(metrics, "kubeproxy_proxy_livez_total", code="503") == 0


SERVICES_PENDING = "kubeproxy_sync_proxy_rules_service_changes_pending"
SLICES_PENDING = "kubeproxy_sync_proxy_rules_endpoint_changes_pending"


def test_pending_counts_services_by_name_and_slice_changes_one_by_one():
    """kube-proxy's ServiceChangeTracker holds one change per Service (len(items)); its
    EndpointsChangeTracker adds one per slice change. An empty list changes nothing."""
    metrics = Metrics()
    tracker = Tracker(node_name="node-a")
    metrics.pending(tracker.pending)
    tracker.replace(SLICE, [])
    tracker.replace(SERVICE, [service("web"), service("db")])
    assert (sample(metrics, SERVICES_PENDING), sample(metrics, SLICES_PENDING)) == (2, 0)
    tracker.event(SERVICE, "MODIFIED", service("web", cluster_ips=("10.96.0.99",)))
    tracker.event(SERVICE, "MODIFIED", service("web", cluster_ips=("10.96.0.98",)))
    tracker.event(SLICE, "ADDED", slice_())
    tracker.event(SLICE, "MODIFIED", slice_(endpoints=[ep("10.244.0.9")]))
    tracker.event(SLICE, "MODIFIED", slice_(endpoints=[ep("10.244.0.9")]))  # no change
    assert (sample(metrics, SERVICES_PENDING), sample(metrics, SLICES_PENDING)) == (2, 2)
    tracker.take()
    assert (sample(metrics, SERVICES_PENDING), sample(metrics, SLICES_PENDING)) == (0, 0)
    tracker.event(SERVICE, "DELETED", service("db"))
    tracker.replace(NODE, [node()])
    assert tracker.pending() == {SERVICE: 1, SLICE: 0, NODE: 1}


class SlowHost(FakeHost):
    """The firewall's tools, each run taking `seconds` on the pass's clock (the 73.7 s
    iptables-restore)."""

    def __init__(self, clock: list[float], seconds: float) -> None:
        super().__init__()
        self.clock, self.seconds = clock, seconds

    def run(self, args, *, stdin=None):
        self.clock[0] += self.seconds
        return super().run(args, stdin=stdin)


def test_the_sync_duration_covers_the_firewall_rules():
    """kube-proxy observes sync_proxy_rules_duration_seconds over the whole syncProxyRules,
    iptables-restore included: a pass whose firewall tools take 70 s is a 70 s sync."""
    now = [1000.0]
    host = SlowHost(now, seconds=7.0)
    tracker = Tracker(node_name="node-a")
    metrics = Metrics()
    sync = AgentLoop(
        proxier=Proxier(
            kernel=FakeKernel(),
            config=Config(node_name="node-a", min_sync_period=0.0, sync_period=30.0),
            firewall=Firewall(commands=host, versions=(4,)),  # type: ignore[arg-type]
            clock=lambda: now[0],
        ),
        tracker=tracker,
        metrics=metrics,
        health=Health(timeout=60),
        clock=lambda: now[0],
    )
    tracker.replace(NODE, [node()])
    tracker.replace(SERVICE, [service("web")])
    tracker.replace(SLICE, [slice_(endpoints=[ep("10.244.0.1")])])
    sync()
    assert any(args[0] == "iptables-restore" for args in host.ran)
    took = 7.0 * len(host.ran)
    name = "kubeproxy_sync_proxy_rules_duration_seconds"
    assert sample(metrics, name + "_count", ip_family="IPv4") == 1
    assert sample(metrics, name + "_sum", ip_family="IPv4") == pytest.approx(took)
    assert took > 16.384
    below = {"ip_family": "IPv4", "le": "16.384"}
    assert metrics.registry.get_sample_value(name + "_bucket", below) == 0.0
    full = "kubeproxy_sync_full_proxy_rules_duration_seconds_sum"
    assert sample(metrics, full, ip_family="IPv4") == pytest.approx(took)


def test_a_pass_whose_rules_were_not_restored_sets_no_sync_time_and_no_latency():
    """kube-proxy's syncProxyRules returns after a failed iptables-restore: its duration
    is observed, the last-sync time and the programming latency are not."""
    now = [1_700_000_100.0]
    metrics = Metrics(clock=lambda: now[0])
    pass_ = {
        "plan": (),
        "report": ApplyReport(),
        "virtual_servers": 0,
        "real_servers": 0,
        "draining": 0,
        "triggers": ("2023-11-14T22:13:19Z",),
    }
    metrics.synced(seconds=2.0, restored=False, **pass_)  # type: ignore[arg-type]
    last = "kubeproxy_sync_proxy_rules_last_timestamp_seconds"
    latency = "kubeproxy_network_programming_duration_seconds_count"
    assert sample(metrics, last, ip_family="IPv4") == 0
    assert sample(metrics, latency, ip_family="IPv4") == 0
    assert sample(metrics, "kubeproxy_sync_proxy_rules_duration_seconds_sum", ip_family="IPv4") == 2
    assert sample(metrics, "ipvsproxy_syncs_total", result="error") == 1  # refused whole
    metrics.synced(seconds=1.0, **pass_)  # type: ignore[arg-type]
    assert sample(metrics, last, ip_family="IPv4") == now[0]
    assert sample(metrics, latency, ip_family="IPv4") == 1
    assert sample(metrics, "ipvsproxy_syncs_total", result="ok") == 1


def test_a_pass_that_did_not_complete_is_still_timed():
    metrics = Metrics()
    metrics.sync_error()  # as agent_loop.py calls it today: counted only
    metrics.sync_error(seconds=3.0, full=False)
    name = "kubeproxy_sync_proxy_rules_duration_seconds"
    assert sample(metrics, name + "_count", ip_family="IPv4") == 1
    assert sample(metrics, name + "_sum", ip_family="IPv4") == 3
    partial = "kubeproxy_sync_partial_proxy_rules_duration_seconds_count"
    assert sample(metrics, partial, ip_family="IPv4") == 1
    assert sample(metrics, "ipvsproxy_syncs_total", result="error") == 2


# ---- deploy/monitoring/dashboards/ipvsproxy.json ------------------------------------------

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy/monitoring/dashboards/ipvsproxy.json"
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
                "or", "unless", "offset", "inf", "nan"}  # fmt: skip


def rendered_names() -> set[str]:
    """Every series name an agent's /metrics can hold (with --service-metrics and
    --endpoint-metrics), read from the rendered registry's `# TYPE` lines (labelled metrics
    appear there before their first sample)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}
    names = set()
    metrics = Metrics()
    metrics.service_traffic(dict, endpoints=True, max_series=1)
    for line in metrics.render().decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            name = name.removesuffix("_total") if kind == "counter" else name
            names |= {name + suffix for suffix in suffixes.get(kind, ("",))}
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers once strings, label
    matchers, ranges and `by (...)` lists are removed, other than functions and keywords."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    found = re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)\s*(\(?)", expr)
    return {m[1] for m in found if not m[2] and m[1].lower() not in PROMQL_WORDS}


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def queried(board: dict[str, Any]) -> list[dict[str, Any]]:
    """The panels that query (all but the rows, which only title the panels below them)."""
    return [p for p in board["panels"] if p["type"] != "row"]


def test_promql_metric_names_are_parsed_out_of_expressions():
    expr = (
        'histogram_quantile(0.99, sum by (le, ip_family) (rate(a_bucket{job=~"$job", '
        'x="by (y)"}[5m]))) - on(instance) group_left max without (le) (b) > bool 0 or c:d'
    )
    assert metric_names(expr) == {"a_bucket", "b", "c:d"}
    assert metric_names("time() - max by (instance) (up)") == {"up"}


def test_the_dashboard_queries_only_metrics_the_agent_exports():
    """The dashboard cannot drift from the metrics package: every metric name in every panel's
    PromQL is one a rendered registry holds."""
    exported = rendered_names()
    for panel in queried(dashboard()):
        for target in panel["targets"]:
            used = metric_names(target["expr"])
            assert used, target["expr"]
            assert used <= exported, (panel["title"], used - exported)


def test_the_dashboard_shows_what_an_operator_watches():
    used = {n for p in queried(dashboard()) for t in p["targets"] for n in metric_names(t["expr"])}
    wanted = {
        "ipvsproxy_syncs_total",
        "kubeproxy_sync_proxy_rules_duration_seconds_bucket",
        "kubeproxy_sync_full_proxy_rules_duration_seconds_bucket",
        "kubeproxy_sync_partial_proxy_rules_duration_seconds_bucket",
        "kubeproxy_network_programming_duration_seconds_bucket",
        "kubeproxy_sync_proxy_rules_service_changes_pending",
        "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
        "ipvsproxy_virtual_servers",
        "ipvsproxy_real_servers",
        "ipvsproxy_draining_real_servers",
        "ipvsproxy_kernel_operations_total",
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
        "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
        "ipvsproxy_watch_restarts_total",
        "ipvsproxy_backend",
        "kubeproxy_proxy_healthz_total",
        "kubeproxy_proxy_livez_total",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "ipvsproxy_service_connections_total",
        "ipvsproxy_service_bytes_total",
        "ipvsproxy_service_packets_total",
        "ipvsproxy_service_active_connections",
        "ipvsproxy_service_inactive_connections",
        "ipvsproxy_service_metrics_dropped_series_total",
        "ipvsproxy_service_metrics_read_errors_total",
    }
    assert wanted <= used, wanted - used


def test_the_service_traffic_panels_sit_under_their_row():
    board = dashboard()
    rows = [p for p in board["panels"] if p["type"] == "row"]
    assert [r["title"] for r in rows] == ["Service traffic (--service-metrics)"]
    (row,) = rows
    below = [p for p in board["panels"] if p["gridPos"]["y"] > row["gridPos"]["y"]]
    assert below
    for panel in below:
        names = {n for t in panel["targets"] for n in metric_names(t["expr"])}
        assert all(n.startswith("ipvsproxy_service_") for n in names), panel["title"]
    assert all(p["gridPos"]["y"] < row["gridPos"]["y"] for p in board["panels"] if p not in below
               and p is not row)  # fmt: skip


def test_the_dashboard_is_grafana_10_on_a_prometheus_data_source_variable():
    board = dashboard()
    assert 37 <= board["schemaVersion"] <= 39  # Grafana 10.0 to 10.4
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == (
        "datasource",
        "prometheus",
    )
    source = {"type": "prometheus", "uid": "${datasource}"}
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in queried(board):
        assert panel["datasource"] == source, panel["title"]
        assert panel["description"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        assert all(t["datasource"] == source for t in panel["targets"]), panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]


def test_no_created_series_as_kube_proxy_writes_none():
    _, text = families(every_metric_recorded())
    assert "_created" not in text


# ---- no-local-endpoint Services (kubeproxy_sync_proxy_rules_no_local_endpoints_total) ----
# kubeproxy_sync_proxy_rules_no_local_endpoints_total, as kube-proxy exports it: Services
# whose Local traffic policy found no endpoint on this node, by policy and IP family.


NAME = "kubeproxy_sync_proxy_rules_no_local_endpoints_total"


def test_services_falling_back_from_local_are_counted_per_policy_and_family():
    agent = Agent()
    internal = service("in", cluster_ips=("10.96.0.1",), internalTrafficPolicy="Local")
    external = service(
        "ex",
        cluster_ips=("10.96.0.2",),
        ports=[port("http", 80)],
        externalIPs=["203.0.113.5"],
        externalTrafficPolicy="Local",
    )
    elsewhere = [ep("10.244.9.1", node="node-b")]  # no endpoint on node-a
    agent.feed(
        internal, external, slice_("in", endpoints=elsewhere), slice_("ex", endpoints=elsewhere)
    )
    agent.sync()
    assert sample(agent.metrics, NAME, traffic_policy="internal", ip_family="IPv4") == 1
    assert sample(agent.metrics, NAME, traffic_policy="external", ip_family="IPv4") == 1
    assert sample(agent.metrics, NAME, traffic_policy="internal", ip_family="IPv6") == 0
    here = [ep("10.244.0.1", node="node-a"), *elsewhere]
    agent.feed(internal, external, slice_("in", endpoints=here), slice_("ex", endpoints=here))
    agent.sync()
    assert sample(agent.metrics, NAME, traffic_policy="internal", ip_family="IPv4") == 0
    assert sample(agent.metrics, NAME, traffic_policy="external", ip_family="IPv4") == 0


def test_the_process_and_the_interpreter_are_exported():
    """process_* (CPU, memory, descriptors, start time) as every Kubernetes component exports
    them, and python_* for the interpreter: dashboards and alerts on them work unchanged."""
    text = Metrics().render().decode()
    for name in (
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_start_time_seconds",
        "process_open_fds",
        "python_info",
        "python_gc_collections_total",
    ):
        assert f"\n{name}" in text, name


# ---- what the kube-proxy dashboards and the shipped alerts query ---------------------------

DATA = Path(__file__).resolve().parent / "data"
RULES = Path(__file__).resolve().parent.parent / "deploy/monitoring/prometheusrule.yaml"
# Queried, but no agent can export them; each is left out on purpose, for its reason.
NOT_THE_AGENTS = {
    "up": "Prometheus's own series for each target it scrapes",
    "kube_pod_info": "kube-state-metrics' (the mixin's `cluster` variable), not a proxy's",
    "go_goroutines": "Go's runtime: a Python agent has threads, not goroutines; process_* "
    "and python_* describe its process and interpreter instead (no stand-in that would "
    "pretend to be a goroutine count)",
}


def scraped_names() -> set[str]:
    """The series names of an agent's /metrics after a real sync (a Service with a Local
    policy and no endpoint here, the IPVS backend chosen) and one API request: what a
    Prometheus scrape would see, parsed from the rendered text, not from names in code."""
    # with --service-metrics and --endpoint-metrics, read from the agent's kernel
    metrics, kernel = Metrics(), FakeKernel()
    traffic = metrics.service_traffic(kernel.traffic, endpoints=True, max_series=99)
    agent = Agent(metrics=metrics, kernel=kernel, on_names=traffic.use_names)
    svc = service("in", cluster_ips=("10.96.0.1",), internalTrafficPolicy="Local")
    agent.feed(svc, slice_("in", endpoints=[ep("10.244.9.1", node="node-b")]))
    agent.metrics.use_backend("ipvs", others=("iptables",))
    agent.sync()
    agent.metrics.api_request("GET", "192.0.2.10:6443", "200", 0.02)
    text = agent.metrics.render().decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def mixin_names() -> set[str]:
    lines = (DATA / "kubernetes-mixin-proxy-metrics.txt").read_text().splitlines()
    return {line for line in lines if line and not line.startswith("#")}


def test_every_metric_of_the_mixins_proxy_dashboard_is_exported():
    """kube-prometheus' "Kubernetes / Proxy" dashboard shows ipvsproxy as it shows kube-proxy."""
    wanted = mixin_names()
    assert len(wanted) == 11
    missing = wanted - scraped_names() - set(NOT_THE_AGENTS)
    assert not missing, missing
    assert set(NOT_THE_AGENTS) <= wanted | {"up"}  # no excuse kept for a name not queried


def rule_exprs() -> list[str]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule["expr"] for group in doc["spec"]["groups"] for rule in group["rules"]]


def test_every_metric_the_shipped_alerts_query_is_exported():
    exported = scraped_names() | {"up"}  # up: Prometheus's, for IpvsproxyDown
    for expr in rule_exprs():
        used = metric_names(expr)
        assert used, expr
        assert used <= exported, (expr, used - exported)


def test_the_shipped_dashboards_metrics_are_in_a_scrape_after_a_sync():
    """The dashboard's names against a scrape after a sync (the `# TYPE` test above also
    allows series that appear only after an event: health answers, watch restarts)."""
    eventful = {
        "kubeproxy_proxy_healthz_total",
        "kubeproxy_proxy_livez_total",
        "ipvsproxy_watch_restarts_total",
        "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
        "ipvsproxy_kernel_operations_total",
        "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",  # set by the tracker's callback
    }
    used = {n for p in queried(dashboard()) for t in p["targets"] for n in metric_names(t["expr"])}
    assert used - eventful <= scraped_names(), used - eventful - scraped_names()


def test_build_info_names_the_version_the_revision_the_image_recorded_and_python():
    import platform

    from ipvsproxy import __version__
    from ipvsproxy.metrics import build_labels

    assert build_labels({"IPVSPROXY_REVISION": "2e8a388\n"}) == (
        __version__,
        "2e8a388",
        platform.python_version(),
    )
    assert build_labels({})[1] == "unknown"
    families = {f.name: f for f in text_string_to_metric_families(Metrics().render().decode())}
    (sample_,) = families["ipvsproxy_build_info"].samples
    assert sample_.value == 1
    assert sample_.labels["version"] == __version__
    assert set(sample_.labels) == {"version", "revision", "python_version"}
