"""Prometheus metrics: kube-proxy's names where one exists, ipvsproxy's own otherwise.

Owns: `Metrics`, one registry per agent (no process-global registry), and what each sync,
watch restart and backend choice records. Exposed by `ipvsproxy.serve` on
`--metrics-bind-address` (default 127.0.0.1:10249, as kube-proxy).

kube-proxy v1.36 (pkg/proxy/metrics/metrics.go, RegisterMetrics for the IPVS mode): every
core metric with its name, labels, help text and buckets (tests/test_metrics.py holds the
table). Beyond its IPVS mode, the full/partial sync histograms of its iptables and nftables
modes (ipvsproxy has both kinds of pass). Not exported: conntrack_reconciler_* (ipvsproxy
deletes stale UDP flows within the pass, it has no reconciler) and the iptables mode's
rule counts and nfacct counters.

client-go's REST client metrics, as every Kubernetes component exports them
(k8s.io/component-base/metrics/prometheus/restclient, fed by client-go's rest/request.go):
`rest_client_requests_total{code, method, host}` for every request (code `<error>` when no
response came) and `rest_client_request_duration_seconds{verb, host}` for every request but
watches (client-go times `Request.request`, which a watch does not go through). The other
rest_client_* series (sizes, rate limiter, exec plugin) are not exported.

`ipvsproxy_build_info{version, revision, python_version} 1`: what is running, as every
Prometheus server (`prometheus_build_info`) and Kubernetes component (`kubernetes_build_info`)
says it.

Per-Service traffic (`--service-metrics`, opt-in): `service_traffic.ServiceTraffic`, which
`Metrics.service_traffic` registers.

Imports: prometheus_client, kernel, model, and its own service_traffic.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

from ipvsproxy import __version__
from ipvsproxy.following import Unread
from ipvsproxy.kernel import ApplyReport, Plan
from ipvsproxy.metrics.service_traffic import ServiceTraffic
from ipvsproxy.model import Traffic, VSKey

log = logging.getLogger(__name__)

# kube-proxy's buckets: sync durations exponential from 1 ms; the programming latency
# merged from linear runs after a first bucket at 0 (pkg/proxy/metrics/metrics.go)
SYNC_BUCKETS = tuple(0.001 * 2**i for i in range(15))
LATENCY_BUCKETS = (0.0, 0.25, 0.5, *range(1, 60), *range(60, 120, 5), *range(120, 301, 30))
# component-base/metrics/prometheus/restclient/metrics.go, requestLatency
REST_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)
FAMILIES = {4: "IPv4", 6: "IPv6"}


REVISION_ENV = "IPVSPROXY_REVISION"  # the git commit, set by the image build (Containerfile)


def build_labels(environ: Mapping[str, str] = os.environ) -> tuple[str, str, str]:
    """(version, revision, python_version) of `ipvsproxy_build_info`, as Prometheus'
    `prometheus_build_info` and `kubernetes_build_info`: the revision is the commit the image
    was built from (scripts/image passes it to the Containerfile, which sets
    IPVSPROXY_REVISION), "unknown" outside an image; git is never run."""
    revision = environ.get(REVISION_ENV, "").strip() or "unknown"
    return __version__, revision, platform.python_version()


class Metrics:
    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        # client_golang (kube-proxy) writes no `*_created` series; prometheus_client would
        # add one per counter and histogram child (a process-wide switch, idempotent)
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=True)
        self._clock = clock
        r = self.registry
        # the process's CPU, memory, file descriptors and start time (process_*, as every
        # Kubernetes component exports them), and the interpreter's (python_*)
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.build_info = Gauge(
            "ipvsproxy_build_info",
            "A metric with a constant '1' value labeled by version, revision and python_version",
            ["version", "revision", "python_version"],
            registry=r,
        )
        self.build_info.labels(*build_labels()).set(1)
        family = ["ip_family"]
        self.sync_duration = Histogram(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            family,
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        self.full_duration = Histogram(
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs",
            family,
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        self.partial_duration = Histogram(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs",
            family,
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        self.last_sync = Gauge(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            family,
            registry=r,
        )
        self.last_queued = Gauge(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            family,
            registry=r,
        )
        self.programming = Histogram(
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            family,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.service_changes = Counter(
            "kubeproxy_sync_proxy_rules_service_changes",
            "Cumulative proxy rules Service changes",
            registry=r,
        )
        self.endpoint_changes = Counter(
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "Cumulative proxy rules Endpoint changes",
            registry=r,
        )
        self.service_pending = Gauge(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Pending proxy rules Service changes",
            registry=r,
        )
        self.endpoint_pending = Gauge(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "Pending proxy rules Endpoint changes",
            registry=r,
        )
        self.restore_failures = Counter(
            "kubeproxy_sync_proxy_rules_iptables_restore_failures",
            "Cumulative proxy iptables restore failures",
            family,
            registry=r,
        )
        self.healthz = Counter(
            "kubeproxy_proxy_healthz", "Cumulative proxy healthz HTTP status", ["code"],
            registry=r,
        )  # fmt: skip
        self.livez = Counter(
            "kubeproxy_proxy_livez", "Cumulative proxy livez HTTP status", ["code"], registry=r
        )
        self.bind_errors = Counter(
            "ipvsproxy_health_check_node_port_bind_errors",
            "Health-check node ports that could not be bound (retried at the next sync)",
            registry=r,
        )
        self._families: tuple[str, ...] = ()
        self.families((4,))
        self.operations = Counter(
            "ipvsproxy_kernel_operations",
            "Operations written to the kernel backend, by kind and result",
            ["kind", "result"],
            registry=r,
        )
        self.syncs = Counter(
            "ipvsproxy_syncs", "Sync passes, by result (ok, failed, error)", ["result"], registry=r
        )
        self.virtual_servers = Gauge(
            "ipvsproxy_virtual_servers", "Virtual servers ipvsproxy programs", registry=r
        )
        self.real_servers = Gauge(
            "ipvsproxy_real_servers", "Real servers ipvsproxy programs", registry=r
        )
        self.draining = Gauge(
            "ipvsproxy_draining_real_servers",
            "Removed real servers held at weight 0 until their connections end",
            registry=r,
        )
        self.backend = Gauge(
            "ipvsproxy_backend", "The kernel backend in use (1 for the one in use)", ["backend"],
            registry=r,
        )  # fmt: skip
        self.firewall = Gauge(
            "ipvsproxy_firewall",
            "Where IPVS mode's firewall rules live (1 for the implementation in use)",
            ["implementation"],
            registry=r,
        )
        self.no_local_endpoints = Gauge(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints",
            ["traffic_policy", "ip_family"],
            registry=r,
        )
        self.watch_restarts = Counter(
            "ipvsproxy_watch_restarts",
            "Watch streams restarted, by resource and reason",
            ["resource", "reason"],
            registry=r,
        )
        self.api_unread = Gauge(
            "ipvsproxy_api_unread_seconds",
            "Seconds the resource unread the longest has not been read from the API server "
            "while its watch fails (0 while every watch works)",
            registry=r,
        )
        self.api_stale = Gauge(
            "ipvsproxy_api_stale",
            "1 while a resource has not been read from the API server for longer than 2 sync "
            "periods after the first full pass: the node does not follow changes",
            registry=r,
        )

        self.rest_requests = Counter(
            "rest_client_requests",
            "Number of HTTP requests, partitioned by status code, method, and host.",
            ["code", "method", "host"],
            registry=r,
        )
        self.rest_duration = Histogram(
            "rest_client_request_duration_seconds",
            "Request latency in seconds. Broken down by verb, and host.",
            ["verb", "host"],
            buckets=REST_BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def service_traffic(
        self, read: Callable[[], Mapping[VSKey, Traffic]], *, endpoints: bool, max_series: int
    ) -> ServiceTraffic:
        """Registers the per-Service traffic metrics (`--service-metrics`): from now on
        every rendering calls `read` (which blocks on the kernel: render off the event
        loop). Their names come from `ServiceTraffic.use_names`."""
        dropped = Counter(
            "ipvsproxy_service_metrics_dropped_series",
            "Series of the per-Service traffic metrics left out of scrapes by "
            "--service-metrics-max-series",
            registry=None,
        )
        errors = Counter(
            "ipvsproxy_service_metrics_read_errors",
            "Scrapes whose reading of the kernel's traffic counters failed (no traffic series)",
            registry=None,
        )
        collector = ServiceTraffic(
            read, endpoints=endpoints, max_series=max_series, dropped=dropped, errors=errors
        )
        # collected in this order: a scrape's own drops and errors are in the same scrape
        for registered in (collector, dropped, errors):
            self.registry.register(registered)
        return collector

    def following(self, unread: Callable[[], Unread | None]) -> None:
        """Whether this node follows the API (`ipvsproxy.following`), read at every scrape:
        for how long the resource unread the longest has not been read (0 while every
        watch works), and whether that is past the bound (the node does not follow)."""
        self.api_unread.set_function(lambda: (u := unread()) and u.seconds or 0.0)
        self.api_stale.set_function(lambda: 1.0 if (u := unread()) and u.stale else 0.0)

    def pending(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """kube-proxy's *_changes_pending gauges, read from `counts` (changes by kind not
        yet taken by a sync) at every scrape."""
        self.service_pending.set_function(lambda: counts().get("Service", 0))
        self.endpoint_pending.set_function(lambda: counts().get("EndpointSlice", 0))

    def families(self, versions: Iterable[int]) -> None:
        """The IP families this node's proxy serves: the `ip_family` label values."""
        self._families = tuple(FAMILIES[v] for v in sorted(set(versions)) if v in FAMILIES) or (
            "IPv4",
        )
        for family in self._families:  # exported from the start, as zeros
            for metric in (self.sync_duration, self.full_duration, self.partial_duration,
                           self.programming, self.restore_failures):  # fmt: skip
                metric.labels(family)

    def queued(self) -> None:
        for family in self._families:
            self.last_queued.labels(family).set(self._clock())

    def health_answered(self, path: str, code: int) -> None:
        """One answer of the health server: kube-proxy's counters for `/healthz` and
        `/livez`; `/readyz` (ipvsproxy's own) is not counted."""
        if path == "/healthz":
            self.healthz_answered(code)
        elif path == "/livez":
            self.livez_answered(code)

    def healthz_answered(self, code: int) -> None:
        """kube-proxy's kubeproxy_proxy_healthz_total{code}: one /healthz answer."""
        self.healthz.labels(str(code)).inc()

    def livez_answered(self, code: int) -> None:
        """kube-proxy's kubeproxy_proxy_livez_total{code}: one /livez answer."""
        self.livez.labels(str(code)).inc()

    def api_request(self, method: str, host: str, code: str, seconds: float | None) -> None:
        """One request to the API server (`code`: the HTTP status, or `<error>`);
        `seconds` is None for a watch, which client-go does not time."""
        self.rest_requests.labels(code, method, host).inc()
        if seconds is not None:
            self.rest_duration.labels(method, host).observe(seconds)

    def bind_failed(self) -> None:
        self.bind_errors.inc()

    def restore_failed(self, version: int = 4) -> None:
        """One failed `iptables-restore` (`ip6tables-restore`: version 6) run, the
        firewall's or the fallback's, however many rules it carried (kube-proxy's
        IPTablesRestoreFailuresTotal)."""
        self.restore_failures.labels(FAMILIES.get(version, "IPv4")).inc()

    def changed(self, kind: str) -> None:
        if kind == "Service":
            self.service_changes.inc()
        elif kind == "EndpointSlice":
            self.endpoint_changes.inc()

    def use_backend(self, name: str, *, others: Iterable[str] = ()) -> None:
        for other in others:
            self.backend.labels(other).set(0)
        self.backend.labels(name).set(1)

    def use_firewall(self, name: str, *, others: Iterable[str] = ()) -> None:
        for other in others:
            self.firewall.labels(other).set(0)
        self.firewall.labels(name).set(1)

    def synced(
        self,
        *,
        seconds: float,
        plan: Plan,
        report: ApplyReport,
        virtual_servers: int,
        real_servers: int,
        draining: int,
        triggers: Iterable[str] = (),
        full: bool = True,
        restored: bool = True,
    ) -> None:
        """Record one completed sync pass (its whole duration, firewall rules included).
        `restored=False`: its firewall rules (or the fallback's) were not written (a
        transaction refused as a whole); as kube-proxy's syncProxyRules returning after a
        failed iptables-restore, the pass then sets no last-sync time and observes no
        programming latency, and it counts as a sync error (`result="error"`)."""
        self._observe(seconds, full=full)
        attempted = Tally(type(op).__name__ for op in plan)
        failed = Tally(type(f.op).__name__ for f in report.failures)
        for kind, count in attempted.items():
            if count - failed[kind]:
                self.operations.labels(kind, "ok").inc(count - failed[kind])
            if failed[kind]:
                self.operations.labels(kind, "error").inc(failed[kind])
        self.syncs.labels("error" if not restored else "ok" if report.ok else "failed").inc()
        self.virtual_servers.set(virtual_servers)
        self.real_servers.set(real_servers)
        self.draining.set(draining)
        if not restored:
            return
        now = self._clock()
        for family in self._families:  # refused IPVS operations too, as kube-proxy's
            self.last_sync.labels(family).set(now)
        if report.ok:
            for trigger in triggers:
                started = _timestamp(trigger)
                if started is not None and now >= started:
                    for family in self._families:
                        self.programming.labels(family).observe(now - started)

    def no_local(self, counts: Mapping[tuple[str, int], int]) -> None:
        """kube-proxy's gauge, every (policy, family) set (0 when none fell back)."""
        for policy in ("internal", "external"):
            for version, family in ((4, "IPv4"), (6, "IPv6")):
                self.no_local_endpoints.labels(policy, family).set(counts.get((policy, version), 0))

    def sync_error(self, *, seconds: float | None = None, full: bool | None = None) -> None:
        """A pass that did not complete; given `seconds`, its duration is observed too
        (kube-proxy observes every syncProxyRules, however it returns)."""
        self.syncs.labels("error").inc()
        if seconds is not None:
            self._observe(seconds, full=full)

    def _observe(self, seconds: float, *, full: bool | None) -> None:
        """The sync duration histograms (full or partial: None is neither)."""
        for family in self._families:
            self.sync_duration.labels(family).observe(seconds)
            if full is not None:
                kind = self.full_duration if full else self.partial_duration
                kind.labels(family).observe(seconds)


def _timestamp(text: str) -> float | None:
    """RFC 3339 (`2026-11-22T05:43:24Z`) → seconds since the epoch."""
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
