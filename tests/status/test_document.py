"""The status document: built from the translation's explanation, the kernel's table and its
counters, checked against docs/status.schema.json; rates from two samples; drift; the
`status` without an agent (agent.LocalStatus, over a FakeKernel as `diff` runs over the live
kernel)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ipvsproxy import agent
from ipvsproxy.errors import ConfigError
from ipvsproxy.model import AddDest, DeleteDest, RealServer, UpdateDest
from ipvsproxy.status.compute import Sampler, with_rates
from ipvsproxy.status.document import MAX_PORTS, Observed, Selector, exit_code
from ipvsproxy.testing import FakeKernel
from ipvsproxy.traffic import Sample, TrafficReader
from tests.status.scene import (
    CONFIG,
    HERE,
    OBJECTS,
    THERE,
    WEB_NODEPORT,
    WEB_VIP,
    count,
    valid,
)
from tests.support import Clock


def manifests(tmp_path: Path, objects: list[dict[str, Any]] = OBJECTS) -> agent.Manifests:
    path = tmp_path / "objects.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    return agent.Manifests((path,))


def local(tmp_path: Path, selector: str | None = None, **kw: Any):
    with agent.LocalStatus(CONFIG, source=manifests(tmp_path), kernel_state=None, **kw) as st:
        return valid(st.document(Selector.parse(selector) if selector else None))


def port_of(doc: dict[str, Any], name: str):
    (found,) = [s for s in doc["services"] if s["name"] == name]
    return found


def endpoint(svc: dict[str, Any], address: str):
    (found,) = [e for e in svc["endpoints"] if e["address"] == address]
    return found


def test_every_service_port_its_virtual_servers_and_endpoints(host, tmp_path):
    doc = local(tmp_path)
    assert doc["apiVersion"] == "ipvsproxy.io/v1alpha1"
    assert doc["kind"] == "Status"
    assert (doc["node"], doc["zone"], doc["source"], doc["backend"]) == (
        "node-a", "zone-a", "local", "ipvs"
    )  # fmt: skip
    assert [(s["name"], s["port"]) for s in doc["services"]] == [
        ("db", "pg"), ("peers", None), ("web", "http")
    ]  # fmt: skip
    web = port_of(doc, "web")
    assert [(v["address"], v["port"], v["kind"], v["scope"]) for v in web["virtualServers"]] == [
        ("10.96.0.10", 80, "cluster-ip", "internal"),
        ("192.168.0.10", 30080, "node-port", "external"),
    ]
    assert web["scheduler"] == "rr"
    assert web["trafficPolicies"] == {"internal": "Cluster", "external": "Local"}
    here = endpoint(web, "10.244.1.5")
    assert (here["pod"], here["node"], here["zone"]) == ("web-6d4cf-x7k2p", "node-a", "zone-a")
    assert here["programmed"] == [
        {"virtualServer": "TCP 10.96.0.10:80", "weight": 1},
        {"virtualServer": "TCP 192.168.0.10:30080", "weight": 1},
    ]
    assert here["notProgrammed"] == []
    assert (doc["inSync"], exit_code(doc)) == (True, 0)


def test_why_not_programmed_per_scope_in_words(host, tmp_path):
    web = port_of(local(tmp_path), "web")
    there = endpoint(web, "10.244.2.7")
    assert there["programmed"] == [{"virtualServer": "TCP 10.96.0.10:80", "weight": 1}]
    assert there["notProgrammed"] == [{
        "scope": "external",
        "reason": "OtherNode",
        "message": "on node node-b, externalTrafficPolicy: Local",
    }]  # fmt: skip
    old = endpoint(web, "10.244.1.9")
    assert {(r["scope"], r["reason"]) for r in old["notProgrammed"]} == {
        ("internal", "Terminating"), ("external", "Terminating")
    }  # fmt: skip
    assert old["programmed"] == []
    new = endpoint(web, "10.244.1.6")
    assert new["notProgrammed"][0]["message"] == "not ready, not serving"


def test_a_skipped_service_says_why(host, tmp_path):
    peers = port_of(local(tmp_path), "peers")
    assert peers["skipped"] == "Headless"
    assert peers["virtualServers"] == peers["endpoints"] == []


def test_counters_summed_over_the_ports_virtual_servers_and_rates_from_two_samples(host, tmp_path):
    clock = Clock(100.0)
    count(host, WEB_VIP, HERE, conns=3)
    count(host, WEB_NODEPORT, HERE, conns=1)
    reader = TrafficReader(lambda: host, clock=clock)
    sampler = Sampler(reader, max_age=10.0)
    first = sampler.observe(Observed(kernel=host.state))
    assert first.rates is None  # one sample: no rates yet
    clock.now += 2.0
    count(host, WEB_VIP, HERE, conns=3, scale=3)  # 2 x the reference reading in 2 s
    second = sampler.observe(Observed(kernel=host.state))
    assert second.window == 2.0
    assert second.rates is not None
    rates = second.rates[1][(WEB_VIP, HERE)]
    assert (rates.connections, rates.packets, rates.bytes) == (3.0, 18.0, 5000.0)


def test_the_document_carries_counters_and_rates(host, tmp_path, monkeypatch):
    count(host, WEB_VIP, HERE, conns=3)
    count(host, WEB_NODEPORT, HERE, conns=1)
    count(host, WEB_VIP, THERE, conns=5)
    with agent.LocalStatus(CONFIG, source=manifests(tmp_path), kernel_state=None) as st:
        doc = valid(st.document(None))
        assert doc["rateWindowSeconds"] is None
        here = endpoint(port_of(doc, "web"), "10.244.1.5")["traffic"]
        assert (here["activeConnections"], here["inactiveConnections"]) == (4, 4)
        assert (here["connections"], here["bytesOut"], here["rates"]) == (4, 8000, None)
        vip = port_of(doc, "web")["virtualServers"][0]["traffic"]
        assert vip["connections"] == 8  # both destinations of the ClusterIP
        st._sampler.reader.min_interval = 0.0  # type: ignore[union-attr]
        count(host, WEB_VIP, HERE, conns=3, scale=2)
        doc = valid(st.document(None))
    rates = endpoint(port_of(doc, "web"), "10.244.1.5")["traffic"]["rates"]
    assert doc["rateWindowSeconds"] > 0
    assert rates["connectionsPerSecond"] > 0


def test_no_counters_in_the_fallback_show_as_null(host, tmp_path, monkeypatch):
    monkeypatch.setattr(FakeKernel, "traffic", lambda self: {})  # the iptables fallback's
    doc = local(tmp_path)
    web = port_of(doc, "web")
    assert endpoint(web, "10.244.1.5")["traffic"] is None
    assert web["virtualServers"][0]["traffic"] is None


def test_drift_named_in_diffs_words_under_its_virtual_server_exit_1(host, tmp_path):
    host.apply([DeleteDest(WEB_VIP, HERE), UpdateDest(WEB_VIP, RealServer(THERE, 5))])
    doc = local(tmp_path)
    web = port_of(doc, "web")
    assert web["virtualServers"][0]["drift"] == [
        "+ ipvsadm -a -t 10.96.0.10:80 -r 10.244.1.5:8080 -m -w 1",
        "~ ipvsadm -e -t 10.96.0.10:80 -r 10.244.2.7:8080 -m -w 1",
    ]
    assert endpoint(web, "10.244.2.7")["programmed"][0]["weight"] == 5
    assert (web["inSync"], doc["inSync"], exit_code(doc)) == (False, False, 1)
    assert port_of(doc, "db")["inSync"]


def test_a_draining_endpoint_removed_from_its_slice_is_shown(host, tmp_path):
    gone = RealServer(THERE.__class__(THERE.address, 9999), 0)
    host.apply([AddDest(WEB_VIP, gone)])
    host.conns[WEB_VIP] = {gone.key: (2, 0)}
    web = port_of(local(tmp_path), "web")
    row = next(e for e in web["endpoints"] if e["port"] == 9999)
    assert (row["inSlice"], row["draining"], row["ready"], row["pod"]) == (False, True, None, None)
    assert row["programmed"] == [{"virtualServer": "TCP 10.96.0.10:80", "weight": 0}]
    assert web["inSync"]  # a drain in progress is no drift


def test_a_stale_virtual_server_is_drift_of_the_node_only(host, tmp_path):
    from ipvsproxy.model import AddService, BindAddress
    from tests.factories import V

    stale = V("10.96.0.99")  # on the dummy device: ipvsproxy's (the ownership rule)
    host.apply([AddService(stale), BindAddress(stale.key.address)])
    doc = local(tmp_path)
    assert doc["otherDrift"] == [
        "- ipvsadm -D -t 10.96.0.99:80",
        "- ip addr del 10.96.0.99/32 dev kube-ipvs0",
    ]
    assert not doc["inSync"]
    one = local(tmp_path, "demo/web")
    assert (one["otherDrift"], one["inSync"]) == ([], True)


def test_a_selector_shows_one_service_or_one_port(host, tmp_path):
    assert [s["name"] for s in local(tmp_path, "demo/web")["services"]] == ["web"]
    assert [s["port"] for s in local(tmp_path, "demo/web:http")["services"]] == ["http"]
    assert [s["port"] for s in local(tmp_path, "demo/web:80")["services"]] == ["http"]
    assert local(tmp_path, "demo/web:9")["services"] == []
    assert local(tmp_path, "other/web")["services"] == []


@pytest.mark.parametrize("text", ["web", "/web", "demo/", "demo/web:", "a/b/c", ""])
def test_a_bad_selector_is_a_config_error(text):
    with pytest.raises(ConfigError, match="NAMESPACE/NAME"):
        Selector.parse(text)


def test_the_document_is_bounded(host, tmp_path, monkeypatch):
    from ipvsproxy.status import document

    monkeypatch.setattr(document, "MAX_PORTS", 1)
    doc = local(tmp_path)
    assert (len(doc["services"]), doc["truncated"]) == (1, True)
    assert MAX_PORTS >= 1000


def test_with_rates_needs_a_later_sample():
    after = Sample(5.0, {})
    assert with_rates(Observed(kernel=FakeKernel().state), None, after).rates is None
    assert with_rates(Observed(kernel=FakeKernel().state), after, after).rates is None


def test_a_virtual_server_claimed_by_another_service_says_by_whom(host, tmp_path):
    from tests.factories import service

    twin = service("a-twin", ns="demo")  # 10.96.0.10:80, first by namespace/name: it wins
    path = tmp_path / "objects.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": [*OBJECTS, twin]}))
    with agent.LocalStatus(CONFIG, source=agent.Manifests((path,)), kernel_state=None) as st:
        doc = valid(st.document(Selector.parse("demo/web")))
    vip = port_of(doc, "web")["virtualServers"][0]
    assert (vip["address"], vip["claimedBy"], vip["drift"]) == (
        "10.96.0.10",
        "demo/a-twin:http",
        [],
    )


def test_two_samples_too_far_apart_give_no_rates(host):
    clock = Clock(100.0)
    sampler = Sampler(TrafficReader(lambda: host, clock=clock), max_age=10.0)
    sampler.observe(Observed(kernel=host.state))
    clock.now += 60.0
    assert sampler.observe(Observed(kernel=host.state)).rates is None
    clock.now += 2.0
    assert sampler.observe(Observed(kernel=host.state)).window == 2.0
