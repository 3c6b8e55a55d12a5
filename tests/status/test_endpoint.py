"""The agent's /status (status/endpoint.py) over the agent's own pieces on a FakeKernel
(support.Agent): the document from the snapshot the last pass published, filtered by
`?service=`, changes not synced yet shown pending, what a pass could not do shown as drift,
a pass in progress neither waited for nor seen, probes answered meanwhile, no document
before the first pass, a failed kernel read a 503, a bad filter a 400."""

from __future__ import annotations

import math
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from ipaddress import ip_address
from typing import Any

import pytest

from ipvsproxy.errors import ConfigError, KernelError
from ipvsproxy.model import AddDest, RealServer, RSKey
from ipvsproxy.serve import HttpServer
from ipvsproxy.status.client import fetch
from ipvsproxy.status.compute import Sampler
from ipvsproxy.status.document import Selector
from ipvsproxy.status.endpoint import PATH, selector_of, status_route
from ipvsproxy.status.table import render
from ipvsproxy.sync.tracker import NODE
from ipvsproxy.traffic import TrafficReader
from tests.factories import ep, slice_
from tests.status.scene import HERE, OBJECTS, WEB_VIP, count, pod, valid, zoned_node
from tests.support import AGENT_CONFIG, Agent, Clock


class Served:
    def __init__(self) -> None:
        self.agent = Agent()
        self.agent.tracker.replace(NODE, [zoned_node()])
        self.agent.feed(*OBJECTS)
        self.agent.sync()
        self.clock = Clock(100.0)
        self.reader = TrafficReader(lambda: self.agent.kernel, clock=self.clock)
        route = status_route(
            snapshot=lambda: self.agent.sync.snapshot,
            pending=self.agent.sync.pending,
            tracker=self.agent.tracker,
            passes=lambda: self.agent.sync.passes,
            sampler=Sampler(self.reader),
            backend="ipvs",
            config=AGENT_CONFIG,
            clock=lambda: 1_800_000_000.0,
        )
        probe = lambda: (200, "text/plain", b"ok\n")  # noqa: E731
        self.server = HttpServer(("127.0.0.1", 0), {PATH: route, "/healthz": probe}).start()
        self.url = f"http://127.0.0.1:{self.server.port}"


@pytest.fixture
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.server.close()


def test_the_agents_document(served):
    doc = valid(fetch(served.url, None))
    assert (doc["source"], doc["backend"], doc["generatedAt"]) == (
        "agent", "ipvs", "2027-01-15T08:00:00Z"
    )  # fmt: skip
    assert doc["lastFullPass"] is not None
    assert doc["inSync"]
    web = next(s for s in doc["services"] if s["name"] == "web")
    assert [v["kind"] for v in web["virtualServers"]] == ["cluster-ip", "node-port"]
    assert {e["address"]: [r["reason"] for r in e["notProgrammed"]] for e in web["endpoints"]} == {
        "10.244.1.5": [],
        "10.244.2.7": ["OtherNode"],
        "10.244.1.9": ["Terminating", "Terminating"],
        "10.244.1.6": ["NotReady", "NotReady"],
    }


def test_filtered_by_service_and_port(served):
    doc = valid(fetch(served.url, Selector.parse("demo/web:http")))
    assert [(s["name"], s["port"]) for s in doc["services"]] == [("web", "http")]
    assert valid(fetch(served.url, Selector.parse("demo/nothing")))["services"] == []


@pytest.mark.parametrize("query", ["service=web", "service=a/b&service=c/d", "service="])
def test_a_bad_filter_is_a_400_with_one_line(served, query):
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(f"{served.url}{PATH}?{query}", timeout=10)
    assert caught.value.code == 400
    assert len(caught.value.read().decode().strip().splitlines()) == 1
    with pytest.raises(ConfigError):
        selector_of(query)


def test_changes_not_synced_yet_are_pending_until_the_next_pass(served):
    moved = slice_("web", ns="demo", endpoints=[pod("10.244.1.5", "web-x"), ep("10.244.1.7")])
    served.agent.feed(*[o for o in OBJECTS if o["kind"] != "EndpointSlice"], moved)
    doc = valid(fetch(served.url, Selector.parse("demo/web")))
    (web,) = doc["services"]
    assert (doc["inSync"], web["pending"], web["inSync"]) == (False, True, False)
    assert all(vs["drift"] == [] for vs in web["virtualServers"])  # nothing failed
    new = next(e for e in web["endpoints"] if e["address"] == "10.244.1.7")
    assert new["programmed"] == []  # the last pass's table: not there yet
    text = render(doc, width=120)
    assert "PENDING: changed since the last pass" in text.splitlines()[0]
    assert "PENDING: Services changed since the last pass" in text
    served.agent.sync()
    doc = valid(fetch(served.url, Selector.parse("demo/web")))
    (web,) = doc["services"]
    assert (doc["inSync"], web["pending"]) == (True, False)
    new = next(e for e in web["endpoints"] if e["address"] == "10.244.1.7")
    assert {"virtualServer": "TCP 10.96.0.10:80", "weight": 1} in new["programmed"]


def test_what_a_pass_could_not_do_is_drift_until_a_pass_does_it(served):
    moved = slice_("web", ns="demo", endpoints=[pod("10.244.1.5", "web-x"), ep("10.244.1.7")])
    added = AddDest(WEB_VIP, RealServer(RSKey(ip_address("10.244.1.7"), 8080), 1))
    served.agent.kernel.errors[added] = KernelError("refused by the test")
    served.agent.feed(*[o for o in OBJECTS if o["kind"] != "EndpointSlice"], moved)
    served.agent.sync()
    doc = valid(fetch(served.url, Selector.parse("demo/web")))
    (web,) = doc["services"]
    assert (doc["inSync"], web["pending"]) == (False, False)
    assert web["virtualServers"][0]["drift"] == [
        "+ ipvsadm -a -t 10.96.0.10:80 -r 10.244.1.7:8080 -m -w 1"
    ]
    served.agent.sync.proxier.backoff.clock = lambda: math.inf  # the retry is due
    served.agent.sync()  # the error was one-shot: the retry succeeds
    assert valid(fetch(served.url, Selector.parse("demo/web")))["inSync"]


def test_no_document_before_the_first_pass():
    agent = Agent()
    route = status_route(
        snapshot=lambda: agent.sync.snapshot,
        pending=agent.sync.pending,
        tracker=agent.tracker,
        passes=lambda: agent.sync.passes,
        sampler=Sampler(TrafficReader(lambda: agent.kernel)),
        backend="ipvs",
        config=AGENT_CONFIG,
    )
    server = HttpServer(("127.0.0.1", 0), {PATH: route}).start()
    try:
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}{PATH}", timeout=10)
    finally:
        server.close()
    assert caught.value.code == 503
    assert b"no sync pass has completed yet" in caught.value.read()


def test_rates_once_the_agent_has_two_samples(served):
    count(served.agent.kernel, WEB_VIP, HERE, conns=1)
    first = fetch(served.url, None)
    assert first["rateWindowSeconds"] is None
    served.clock.now += 1.5
    count(served.agent.kernel, WEB_VIP, HERE, conns=1, scale=4)
    second = valid(fetch(served.url, None))
    assert second["rateWindowSeconds"] == 1.5
    web = next(s for s in second["services"] if s["name"] == "web")
    here = next(e for e in web["endpoints"] if e["address"] == "10.244.1.5")
    assert here["traffic"]["rates"]["connectionsPerSecond"] == 2.0


def test_a_pass_in_progress_is_neither_waited_for_nor_seen(served, monkeypatch):
    applying, release = threading.Event(), threading.Event()
    real = served.agent.kernel.apply

    def held(plan: Any, **kwargs: Any) -> Any:
        report = real(plan, **kwargs)  # the kernel has it; the pass is not over
        applying.set()
        release.wait(timeout=30)
        return report

    monkeypatch.setattr(served.agent.kernel, "apply", held)
    gone = slice_("web", ns="demo", endpoints=[pod("10.244.2.7", "web-b", node="node-b")])
    served.agent.feed(*[o for o in OBJECTS if o["kind"] != "EndpointSlice"], gone)
    passing = threading.Thread(target=served.agent.sync)
    passing.start()
    try:
        assert applying.wait(timeout=30)
        doc = valid(fetch(served.url, Selector.parse("demo/web")))  # answered mid-pass
        with urllib.request.urlopen(f"{served.url}/healthz", timeout=10) as answer:
            assert answer.status == 200  # the event loop is not held
    finally:
        release.set()
        passing.join(timeout=30)
    (web,) = doc["services"]
    here = next(e for e in web["endpoints"] if e["address"] == "10.244.1.5")
    assert here["programmed"]  # the table as the last completed pass left it
    assert web["pending"]  # the Service the pass in progress applies
    doc = valid(fetch(served.url, Selector.parse("demo/web")))
    assert doc["inSync"]
    (web,) = doc["services"]
    assert "10.244.1.5" not in {e["address"] for e in web["endpoints"]}  # gone, as planned


def test_a_failed_kernel_read_is_a_503(served, monkeypatch):
    def fail() -> None:
        raise KernelError("netlink: no")

    monkeypatch.setattr(served.agent.kernel, "traffic", fail)
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(f"{served.url}{PATH}", timeout=10)
    assert caught.value.code == 503
    assert b"netlink: no" in caught.value.read()


def test_a_drain_in_progress_is_shown_and_is_no_drift(served):
    served.agent.kernel.conns[WEB_VIP] = {HERE: (2, 0)}
    rest = slice_("web", ns="demo", endpoints=[pod("10.244.2.7", "web-b", node="node-b")])
    served.agent.feed(*[o for o in OBJECTS if o["kind"] != "EndpointSlice"], rest)
    served.agent.sync()  # 10.244.1.5 leaves with a connection: it drains at weight 0
    doc = valid(fetch(served.url, Selector.parse("demo/web")))
    row = next(e for e in doc["services"][0]["endpoints"] if e["address"] == "10.244.1.5")
    assert (row["inSlice"], row["draining"]) == (False, True)
    assert {"virtualServer": "TCP 10.96.0.10:80", "weight": 0} in row["programmed"]
    assert doc["inSync"], doc["services"][0]["virtualServers"]


def test_the_agents_winner_of_a_contested_virtual_server(served):
    from tests.factories import service

    twin = service("a-twin", ns="demo")  # 10.96.0.10:80 too; first by namespace/name
    served.agent.feed(*OBJECTS, twin)
    served.agent.sync()
    doc = valid(fetch(served.url, Selector.parse("demo/web")))
    vip = doc["services"][0]["virtualServers"][0]
    assert (vip["claimedBy"], vip["drift"]) == ("demo/a-twin:http", [])
    assert doc["inSync"]


def test_a_slow_start_ramp_is_shown_and_is_no_drift():
    from tests.support import driven_agent
    from tests.sync.test_slow_start import A, B, C, endpoints, sync, web

    agent, runner, clock = driven_agent()
    sync(agent, runner, web(), endpoints(A, B))
    clock.now += 3
    sync(agent, runner, web(), endpoints(A, B, C))  # C ramps: weight 1 of 10 for 2 s
    clock.now += 0.5
    route = status_route(
        snapshot=lambda: agent.sync.snapshot,
        pending=agent.sync.pending,
        tracker=agent.tracker,
        passes=lambda: agent.sync.passes,
        sampler=Sampler(TrafficReader(lambda: agent.kernel, clock=clock)),
        backend="ipvs",
        config=AGENT_CONFIG,
        monotonic=clock,
    )
    server = HttpServer(("127.0.0.1", 0), {PATH: route}).start()
    try:
        doc = valid(fetch(f"http://127.0.0.1:{server.port}", Selector.parse("default/web")))
    finally:
        server.close()
    rows = {e["address"]: e for e in doc["services"][0]["endpoints"]}
    assert rows[C]["ramp"] == {
        "weight": 1, "fullWeight": 10, "startedSecondsAgo": 0.5, "endsInSeconds": 9.5
    }  # fmt: skip
    assert rows[C]["programmed"] == [{"virtualServer": "TCP 10.96.0.10:80", "weight": 1}]
    assert rows[A]["ramp"] is None
    assert doc["inSync"], doc["services"][0]["virtualServers"][0]["drift"]
