"""The API source against the test API server, through the real `kubernetes` client and TLS."""

from __future__ import annotations

import threading
import time
from ipaddress import ip_address
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ipvsproxy import kube
from ipvsproxy.api import ServiceView
from ipvsproxy.backoff import Backoff
from ipvsproxy.errors import ConfigError, WatchError
from ipvsproxy.kubeclient import unobserved
from ipvsproxy.metrics import Metrics
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, Tracker
from tests.kubeapi import ApiServer
from tests.support import eventually, sample

FAST = kube.Settings(watch_timeout=2, inactivity_timeout=5, backoff=Backoff(first=0.05, cap=0.3))


def svc(name: str, ip: str = "10.96.0.10", ns: str = "demo") -> dict[str, Any]:
    return {
        "kind": "Service",
        "apiVersion": "v1",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"type": "ClusterIP", "clusterIP": ip, "ports": [{"port": 80, "protocol": "TCP"}]},
    }


def node(name: str) -> dict[str, Any]:
    return {"kind": "Node", "apiVersion": "v1", "metadata": {"name": name}}


@pytest.fixture
def server():
    api = ApiServer(bookmark_interval=0.3).start()
    yield api
    api.stop()


def services(run: Run) -> list[ServiceView]:
    return [v for v in run.tracker.views(SERVICE) if isinstance(v, ServiceView)]


class Run:
    """A watcher in a thread; `error` holds what ended it."""

    def __init__(
        self, server: ApiServer, tmp_path, kind: str = SERVICE, token=None, observe=unobserved
    ) -> None:
        self.tracker = Tracker(required=(kind,))
        self.restarts: list[tuple[str, str]] = []
        self.stop = threading.Event()
        self.client = client = kube.connect(
            kubeconfig=server.write_kubeconfig(tmp_path / "kubeconfig", token=token),
            context=None,
            observe=observe,
        )
        self.watcher = kube.Watcher(
            kind,
            api=client,
            node_name="node-a",
            sink=self.tracker,
            stop=self.stop,
            settings=FAST,
            on_restart=lambda k, reason: self.restarts.append((k, reason)),
        )
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._body, daemon=True)
        self.thread.start()

    def _body(self) -> None:
        try:
            self.watcher.run()
        except BaseException as exc:
            self.error = exc

    def names(self) -> set[str]:
        return {view.name for view in self.tracker.views(self.watcher.kind)}

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        self.client.close()


@pytest.fixture
def watch(server, tmp_path):
    runs: list[Run] = []

    def start(**kwargs) -> Run:
        runs.append(Run(server, tmp_path, **kwargs))
        return runs[-1]

    yield start
    for run in runs:
        run.close()


def test_lists_then_follows_adds_changes_and_deletes(server, watch):
    server.put(svc("a"))
    run = watch()
    eventually(lambda: run.names() == {"a"}, detail=lambda: repr(run.error))
    assert run.tracker.synced()
    server.put(svc("b", "10.96.0.11"))
    eventually(lambda: run.names() == {"a", "b"})
    server.put(svc("a", "10.96.0.12"))
    eventually(lambda: any(v.cluster_ips == (ip_address("10.96.0.12"),) for v in services(run)))
    server.delete("Service", "demo", "b")
    eventually(lambda: run.names() == {"a"})
    # parsed on arrival, list items (which carry no kind) as watch events
    assert [type(view) for view in services(run)] == [ServiceView]


def test_list_and_watch_are_counted_as_client_go_counts_them(server, watch):
    """rest_client_requests_total{code, method, host} for every request, the duration
    histogram {verb, host} for all but watches (client-go's Request.request)."""
    metrics = Metrics()
    server.put(svc("a"))
    run = watch(observe=metrics.api_request)
    eventually(lambda: any(q.get("watch") for _, _, q in server.requests))
    host = f"127.0.0.1:{server.port}"
    requests = "rest_client_requests_total"
    eventually(lambda: sample(metrics, requests, code="200", method="GET", host=host) >= 2)
    lists = sum(1 for _, _, q in server.requests if not q.get("watch"))
    duration = "rest_client_request_duration_seconds_count"
    assert lists >= 1
    assert sample(metrics, duration, verb="GET", host=host) == lists
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    (counted,) = [s for s in families["rest_client_requests"].samples if s.name == requests]
    assert set(counted.labels) == {"code", "method", "host"}
    histogram = families["rest_client_request_duration_seconds"].samples
    (bucket, *_) = [s for s in histogram if s.name.endswith("_bucket")]
    assert set(bucket.labels) == {"verb", "host", "le"}  # no `url` (component-base: verb, host)
    run.close()
    refused = Metrics()
    watch(token="wrong", observe=refused.api_request)  # 401: counted with its code
    eventually(lambda: sample(refused, requests, code="401", method="GET", host=host) >= 1)
    server.stop()  # no answer at all: `<error>`, as client-go counts a failed round trip
    gone = Metrics()
    watch(observe=gone.api_request)
    eventually(lambda: sample(gone, requests, code="<error>", method="GET", host=host) >= 1)


def test_resumes_from_bookmarks_and_ends_of_streams(server, watch):
    run = watch()
    eventually(run.tracker.synced)
    before = server.version
    server.put(node("unrelated-kind"))  # moves the resourceVersion; only a bookmark tells
    eventually(lambda: sum(1 for p, _, q in server.requests if q.get("watch")) >= 3, 15)
    resumed = [int(q["resourceVersion"]) for p, _, q in server.requests if q.get("watch")]
    assert resumed[0] == before
    assert max(resumed) > before  # a later stream started from a bookmark's version
    assert all(q.get("allowWatchBookmarks") == "true" for _, _, q in server.requests
               if q.get("watch"))  # fmt: skip
    lists = [q for p, _, q in server.requests if not q.get("watch")]
    assert len(lists) == 1  # streams ending at their timeout are resumed, not relisted


def test_410_gone_relists_and_picks_up_what_changed(server, watch):
    server.put(svc("a"))
    run = watch()
    eventually(lambda: run.names() == {"a"})
    server.stop()  # the watcher is disconnected ...
    server.put(svc("b", "10.96.0.11"))  # ... misses this ...
    server.compact()  # ... and its resourceVersion expires
    server.start()
    eventually(lambda: run.names() == {"a", "b"}, 15)
    assert (SERVICE, "gone") in run.restarts
    lists = [q for p, _, q in server.requests if not q.get("watch")]
    assert len(lists) == 2


def test_outage_then_recovery_with_backoff(server, watch):
    server.put(svc("a"))
    run = watch()
    eventually(lambda: run.names() == {"a"})
    server.stop()
    time.sleep(1.0)
    assert run.names() == {"a"}  # nothing forgotten while the server is away
    server.put(svc("c", "10.96.0.13"))
    server.start()
    eventually(lambda: run.names() == {"a", "c"}, 15)
    assert (SERVICE, "error") in run.restarts
    assert run.error is None


def test_pagination(server, watch):
    for i in range(1203):
        server.put(svc(f"s{i:04}", f"10.96.{i // 250}.{i % 250 + 1}"))
    run = watch()
    eventually(lambda: len(run.names()) == 1203, 20)
    pages = [q for p, _, q in server.requests if not q.get("watch")]
    assert [q.get("limit") for q in pages] == ["500"] * 3
    assert all("continue" in page for page in pages[1:])


def test_node_is_watched_by_name(server, watch):
    server.put(node("node-a"))
    server.put(node("node-b"))
    run = watch(kind=NODE)
    eventually(lambda: run.names() == {"node-a"})
    zone = {"topology.kubernetes.io/zone": "z1"}
    server.put({**node("node-b"), "metadata": {"name": "node-b", "labels": zone}})
    server.put({**node("node-a"), "metadata": {"name": "node-a", "labels": zone}})
    eventually(lambda: run.tracker.views(NODE)[0].labels == zone)
    assert run.names() == {"node-a"}


def test_a_wrong_token_is_a_clear_error(server, watch):
    run = watch(kind=SLICE, token="wrong")
    run.thread.join(timeout=10)
    assert isinstance(run.error, WatchError)
    assert "401 Unauthorized" in str(run.error)
    assert "token" in str(run.error)
    assert not run.tracker.synced()


def test_expired_watch_gets_the_real_error_event(server):
    """The wire format of a 410, as the capture shows: HTTP 200, one ERROR event."""
    server.put(svc("a"))
    server.compact()
    events = list(server.watch("Service", {"resourceVersion": "5"}))
    assert events == [
        {
            "type": "ERROR",
            "object": {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": f"too old resource version: 5 ({server.version})",
                "reason": "Expired",
                "code": 410,
            },
        }
    ]


def test_missing_kubeconfig_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        kube.connect(kubeconfig=tmp_path / "nope", context=None)
    (tmp_path / "bad").write_text("clusters: [")
    with pytest.raises(ConfigError, match="cannot load"):
        kube.connect(kubeconfig=tmp_path / "bad", context=None)


def test_the_first_services_are_listed_alone_by_name_and_label(server, tmp_path):
    """`first_lists`: each first Service by name in its namespace, its slices by their
    service-name label, this node's Node: a few small requests, one complete list per kind
    into the sink, while the whole lists are held (a large cluster's take minutes)."""
    from tests.factories import service, slice_

    server.put(service("kubernetes", ns="default", cluster_ips=("10.96.0.1",)))
    server.put(slice_("kubernetes", ns="default", endpoints=[{"addresses": ["192.168.0.2"]}]))
    server.put(service("kubernetes", ns="other", cluster_ips=("10.96.0.2",)))  # same name
    server.put(slice_("kubernetes", ns="other"))
    server.put(service("kube-dns", ns="kube-system", cluster_ips=("10.96.0.10",)))
    server.put(slice_("kube-dns", ns="kube-system", name="kube-dns-1"))
    server.put(slice_("kube-dns", ns="kube-system", name="kube-dns-2"))
    server.put(slice_("kube-dns-x", ns="kube-system"))  # another Service's slice
    for i in range(30):
        server.put(service(f"s{i}", ns="default", cluster_ips=(f"10.96.1.{i + 1}",)))
        server.put(slice_(f"s{i}", ns="default"))
    server.put(node("node-a"))
    server.put(node("node-b"))
    server.whole_lists.clear()  # the whole lists wait: first_lists must not ask for them
    sink = Tracker(required=(SERVICE, SLICE, NODE), node_name="node-a")
    client = kube.connect(kubeconfig=server.write_kubeconfig(tmp_path / "kc"), context=None)
    try:
        kube.first_lists(
            client, [("default", "kubernetes"), ("kube-system", "kube-dns")],
            node_name="node-a", sink=sink, settings=FAST,
        )  # fmt: skip
    finally:
        client.close()
        server.whole_lists.set()
    assert sink.synced()
    changes = sink.take()
    assert set(changes.services) == {("default", "kubernetes"), ("kube-system", "kube-dns")}
    assert len(changes.slices[("default", "kubernetes")]) == 1
    assert {s.name for s in changes.slices[("kube-system", "kube-dns")]} == {
        "kube-dns-1",
        "kube-dns-2",
    }
    assert changes.node is not None
    assert changes.node.name == "node-a"
    paths = sorted(p for p, _, q in server.requests)
    assert paths == sorted([
        "/api/v1/namespaces/default/services",
        "/api/v1/namespaces/kube-system/services",
        "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices",
        "/apis/discovery.k8s.io/v1/namespaces/kube-system/endpointslices",
        "/api/v1/nodes",
    ])  # fmt: skip


def test_the_first_services_unreachable_is_one_clear_error(tmp_path):
    """An API server that does not answer: `ApiUnavailable` naming it (the agent warns and
    serves them with the whole lists), not a traceback."""
    from ipvsproxy.errors import ApiUnavailable

    api = ApiServer().start()
    kubeconfig = api.write_kubeconfig(tmp_path / "kc")
    api.stop()
    client = kube.connect(kubeconfig=kubeconfig, context=None)
    try:
        with pytest.raises(ApiUnavailable, match="cannot read Services from https://"):
            kube.first_lists(client, [("default", "kubernetes")], node_name="node-a",
                             sink=Tracker(), settings=FAST)  # fmt: skip
    finally:
        client.close()
