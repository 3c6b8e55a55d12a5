"""The long-running pieces with FakeKernel: tracker, sync pass, metrics, health, manifests."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import urllib.error
import urllib.request
from ipaddress import ip_address, ip_network
from typing import Any

import pytest

from ipvsproxy.agent_loop import DRAIN_POLL
from ipvsproxy.errors import ConfigError, KernelError
from ipvsproxy.manifest_source import ManifestSource
from ipvsproxy.metrics import Metrics
from ipvsproxy.model import AddService, Op
from ipvsproxy.serve import Health, HttpServer, parse_bind_address
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, TRIGGER_TIME, Tracker
from tests.factories import ep, port, service, slice_
from tests.support import AGENT_CONFIG as CONFIG
from tests.support import Agent, driven_agent, eventually, next_run, sample


def web_slice(*addresses: str, **meta):
    obj = slice_("web", endpoints=[ep(a) for a in addresses])
    obj["metadata"].update(meta)
    return obj


def test_nothing_is_programmed_before_both_kinds_listed():
    agent = Agent()
    agent.tracker.replace(SERVICE, [service("web")])
    agent.sync()
    assert agent.kernel.observations == 0
    assert agent.kernel.applied == []
    agent.tracker.replace(SLICE, [])
    agent.sync()
    assert agent.kernel.applied  # the Service's virtual server, with no endpoints yet


def test_steady_state_writes_nothing():
    agent = Agent()
    agent.feed(service("web"), web_slice("10.244.0.1", "10.244.0.2"))
    agent.sync()
    writes = len(agent.kernel.applied)
    kinds = sorted(type(op).__name__ for op in agent.kernel.applied)
    assert kinds == ["AddDest", "AddDest", "AddService", "BindAddress"]
    for _ in range(5):
        agent.sync()
    assert len(agent.kernel.applied) == writes
    assert sample(agent.metrics, "ipvsproxy_syncs_total", result="ok") == 6
    assert sample(agent.metrics, "ipvsproxy_kernel_operations_total", kind="AddDest",
                  result="ok") == 2  # fmt: skip
    assert sample(agent.metrics, "ipvsproxy_virtual_servers") == 1
    assert sample(agent.metrics, "ipvsproxy_real_servers") == 2


def test_tracker_events_and_change_callbacks():
    agent = Agent()
    agent.feed(service("web"), web_slice("10.244.0.1"))
    agent.changes.clear()
    agent.tracker.replace(SERVICE, [service("web")])  # the same list again: no change
    assert agent.changes == []
    agent.tracker.event(SLICE, "MODIFIED", web_slice("10.244.0.1", "10.244.0.3"))
    agent.tracker.event(SLICE, "BOOKMARK", {"metadata": {"resourceVersion": "9"}})
    agent.tracker.event(SERVICE, "DELETED", service("gone"))  # unknown: no change
    assert agent.changes == [SLICE]
    agent.tracker.event(SERVICE, "DELETED", service("web"))
    assert agent.changes == [SLICE, SERVICE]
    assert agent.tracker.counts() == {SERVICE: 0, SLICE: 1}


def test_failed_operation_is_retried_after_1_2_4_s_up_to_the_period_and_reported():
    """Issue 14: the old test asserted `due(now) <= now + 1.5` on a runner that never ran,
    true whether or not the sync pass asks for a retry. Here the runner runs the pass."""
    agent, runner, clock = driven_agent()
    agent.feed(service("web"), web_slice())
    assert runner.run_if_due() == 0  # the first run is due at once: programs the Service
    assert next_run(runner, clock) == CONFIG.sync_period  # all done: the next in 30 s
    vs = next(iter(agent.kernel.state.services.values()))
    flushed = type(agent.kernel.state)({}, {})
    agent.kernel.state = flushed  # someone flushed the table
    clock.now += CONFIG.sync_period  # the periodic full pass sees the flush ...
    agent.kernel.errors[AddService(vs)] = KernelError("boom")  # ... and its repair fails
    assert runner.run_if_due() == 0
    assert sample(agent.metrics, "ipvsproxy_syncs_total", result="failed") == 1
    assert sample(agent.metrics, "ipvsproxy_kernel_operations_total", kind="AddService",
                  result="error") == 1  # fmt: skip
    assert next_run(runner, clock) == 1  # retried after 1 s, not at the next period
    clock.now += 1
    observations = agent.kernel.observations
    assert runner.run_if_due() == 0  # a partial pass: the failed virtual server again
    assert agent.kernel.state.services  # the retry repaired it
    assert agent.kernel.observations == observations  # without observing the kernel again
    assert next_run(runner, clock) == CONFIG.sync_period  # all done: no early retry

    agent.kernel.state = flushed
    clock.now += CONFIG.sync_period
    delays = []
    for _ in range(7):  # failing again and again
        agent.kernel.errors[AddService(vs)] = KernelError("boom")
        assert runner.run_if_due() == 0
        delays.append(next_run(runner, clock))
        clock.now += delays[-1]
    assert delays == [1, 2, 4, 8, 16, 30, 30]  # backoff, capped at the sync period
    assert sample(agent.metrics, "ipvsproxy_syncs_total", result="failed") == 8


def test_a_pass_with_draining_endpoints_asks_to_be_run_again_in_a_second():
    agent, runner, clock = driven_agent()
    agent.feed(service("web"), web_slice("10.244.0.1", "10.244.0.2"))
    runner.run_if_due()
    (key,) = agent.kernel.state.services
    gone = next(rs for rs in agent.kernel.state.dests[key] if str(rs.address) == "10.244.0.2")
    agent.kernel.conns[key] = {gone: (1, 0)}  # an open connection holds the drain
    agent.tracker.event(SLICE, "MODIFIED", web_slice("10.244.0.1"))
    runner.request()
    clock.now += 5
    assert runner.run_if_due() == 0
    assert agent.sync.last is not None
    assert agent.sync.last.sync.draining == 1
    assert next_run(runner, clock) == DRAIN_POLL
    agent.kernel.conns[key] = {gone: (0, 0)}
    clock.now += DRAIN_POLL
    assert runner.run_if_due() == 0  # the poll: the connection is gone, so is the endpoint
    assert agent.sync.last.sync.draining == 0
    assert next_run(runner, clock) == CONFIG.sync_period  # drained: no more polling


def test_a_kernel_contradicting_the_table_makes_the_next_pass_full():
    agent = Agent()
    agent.feed(service("web"), web_slice("10.244.0.1"))
    agent.sync()
    vs_key = next(iter(agent.kernel.state.services))
    agent.kernel.state = type(agent.kernel.state)({}, {})  # flushed behind our back
    agent.tracker.event(SLICE, "MODIFIED", web_slice("10.244.0.1", "10.244.0.2"))
    agent.sync()  # partial: adding a destination to a service that is gone -> NotFound
    assert agent.kernel.observations == 1
    assert agent.sync.last is not None
    assert agent.sync.last.stale
    agent.sync()  # so this pass is full: observes, and puts everything back
    assert agent.kernel.observations == 2
    assert len(agent.kernel.state.dests[vs_key]) == 2


def test_warnings_are_logged_once(caplog):
    agent = Agent()
    bad = service("bad", ports=[{"port": 0}])
    agent.feed(service("web"), bad, web_slice())
    agent.sync()
    agent.sync()
    assert sum("skipping malformed Service default/bad" in r.message for r in caplog.records) == 1


def test_a_refused_external_ip_is_warned_once_per_change_of_the_service(caplog):
    config = dataclasses.replace(CONFIG, external_ip_cidrs=(ip_network("198.51.100.0/24"),))
    agent, _, clock = driven_agent(config)

    def warned(address: str) -> int:
        text = f"Service default/web: externalIP {address} is outside --external-ip-cidrs"
        return sum(text in r.message for r in caplog.records)

    agent.feed(service("web", externalIPs=["203.0.113.9"]), web_slice())
    agent.sync()
    agent.sync()
    clock.now += CONFIG.sync_period + 1  # a full resync: still no second warning
    agent.sync()
    assert warned("203.0.113.9") == 1
    assert not any(k.address == ip_address("203.0.113.9") for k in agent.kernel.state.services)
    agent.feed(service("web", externalIPs=["203.0.113.10"]), web_slice())
    agent.sync()
    agent.sync()
    assert (warned("203.0.113.9"), warned("203.0.113.10")) == (1, 1)
    agent.feed(service("web", externalIPs=["198.51.100.7"]), web_slice())
    agent.sync()
    agent.feed(service("web", externalIPs=["203.0.113.9"]), web_slice())
    agent.sync()
    assert warned("203.0.113.9") == 2  # refused again after a fix: a new warning


def test_network_programming_latency_comes_from_the_trigger_annotation():
    agent = Agent()
    agent.feed(service("web"), web_slice())
    agent.sync()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 3))
    changed = web_slice("10.244.0.9")
    changed["metadata"]["annotations"] = {TRIGGER_TIME: stamp}
    agent.tracker.event(SLICE, "MODIFIED", changed)
    agent.sync()
    name = "kubeproxy_network_programming_duration_seconds"
    count = sample(agent.metrics, name + "_count", ip_family="IPv4")
    total = sample(agent.metrics, name + "_sum", ip_family="IPv4")
    assert count == 1
    assert 2 <= total <= 60


def test_health_turns_unhealthy_when_a_queued_sync_is_overdue():
    now = [1000.0]
    health = Health(timeout=60, clock=lambda: now[0])
    assert health.status()[0]
    health.queued()
    now[0] += 59
    assert health.status()[0]
    now[0] += 2
    healthy, body = health.status()
    assert not healthy
    assert body["oldestPendingQueued"]
    health.updated()
    assert health.status()[0]
    assert health.healthz()[0] == 200


def test_http_endpoints_serve_health_and_metrics():
    metrics = Metrics()
    metrics.use_backend("ipvs")
    health = Health(timeout=60)
    health.use_backend({"backend": "ipvs"})
    server = HttpServer(
        ("127.0.0.1", 0),
        {"/metrics": lambda: (200, "text/plain", metrics.render()), "/healthz": health.healthz},
    ).start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        answer = urllib.request.urlopen(base + "/healthz", timeout=5)
        assert answer.headers["X-Content-Type-Options"] == "nosniff"
        body = json.load(answer)
        assert body["backend"] == "ipvs"
        assert body["healthy"] is True
        text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
        assert 'ipvsproxy_backend{backend="ipvs"} 1.0' in text
        assert "kubeproxy_sync_proxy_rules_duration_seconds_bucket" in text
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(base + "/nope", timeout=5)
    finally:
        server.close()


def test_bind_addresses():
    assert parse_bind_address("0.0.0.0:10256", option="x") == ("0.0.0.0", 10256)
    assert parse_bind_address("[::]:1", option="x") == ("::", 1)
    with pytest.raises(ConfigError, match="--metrics-bind-address"):
        parse_bind_address("nope:80", option="--metrics-bind-address")


def test_manifest_source_rereads_changed_files_and_keeps_last_good(tmp_path, caplog):
    import yaml

    path = tmp_path / "svc.yaml"
    path.write_text(yaml.safe_dump_all([service("web"), web_slice("10.244.0.1")]))
    changes: list[str] = []
    tracker = Tracker(required=(SERVICE, SLICE, NODE), on_change=changes.append)
    stop = threading.Event()
    source = ManifestSource([tmp_path], sink=tracker, stop=stop, interval=0.05)
    source.load()
    assert tracker.synced()
    assert tracker.counts()[SERVICE] == 1
    thread = threading.Thread(target=source.run)
    thread.start()
    try:
        changes.clear()
        path.write_text(yaml.safe_dump_all([service("web"), web_slice("10.244.0.1", "10.244.0.2")]))
        eventually(lambda: SLICE in changes, 5.0)  # (a half-written file may count twice)
        assert set(changes) == {SLICE}
        path.write_text("kind: [broken")
        eventually(lambda: "keeping its last good content" in caplog.text, 5.0)
        assert tracker.counts()[SLICE] == 1
    finally:
        stop.set()
        thread.join(5)


def test_a_failed_firewall_restore_is_counted_and_the_pass_does_not_count_as_healthy(
    monkeypatch,
):
    """kube-proxy's iptables_restore_failures_total{ip_family} per failed restore run, and
    no health update for a pass whose firewall rules failed."""
    import dataclasses

    now = [1000.0]
    agent = Agent()
    agent.health = Health(timeout=60, clock=lambda: now[0])
    agent.sync._health = agent.health
    apply = agent.sync.proxier.apply

    def failing(planned):
        result = apply(planned)
        return dataclasses.replace(
            result, firewall_error="ip6tables-restore failed: boom", restore_failed=(6,)
        )

    monkeypatch.setattr(agent.sync.proxier, "apply", failing)
    agent.feed(service("web"), web_slice("10.244.0.1"))
    agent.health.queued()
    agent.sync()
    now[0] += 61
    assert not agent.health.healthy()  # the pass did not complete the queued update
    name = "kubeproxy_sync_proxy_rules_iptables_restore_failures_total"
    assert sample(agent.metrics, name, ip_family="IPv6") == 1
    assert sample(agent.metrics, name, ip_family="IPv4") == 0


def test_a_pass_whose_restore_failed_is_timed_but_sets_no_last_sync_time(monkeypatch):
    """kube-proxy's syncProxyRules returns after a failed iptables-restore: its duration is
    observed, the last-sync timestamp is not set."""
    import dataclasses

    agent = Agent()
    apply = agent.sync.proxier.apply

    def failing(planned):
        return dataclasses.replace(
            apply(planned), firewall_error="iptables-restore: boom", restore_failed=(4,)
        )

    monkeypatch.setattr(agent.sync.proxier, "apply", failing)
    agent.feed(service("web"), web_slice("10.244.0.1"))
    agent.sync()
    duration = "kubeproxy_sync_proxy_rules_duration_seconds_count"
    assert sample(agent.metrics, duration, ip_family="IPv4") == 1
    last = "kubeproxy_sync_proxy_rules_last_timestamp_seconds"
    assert sample(agent.metrics, last, ip_family="IPv4") == 0
    assert sample(agent.metrics, "ipvsproxy_syncs_total", result="error") == 1  # refused whole
    monkeypatch.setattr(agent.sync.proxier, "apply", apply)  # the next pass restores
    agent.feed(service("web"), web_slice("10.244.0.2"))
    agent.sync()
    assert sample(agent.metrics, last, ip_family="IPv4") > 0


def test_a_pass_that_raised_is_timed_as_kube_proxy_times_every_pass(monkeypatch):
    agent, runner, clock = driven_agent()

    def raising(planned):
        clock.now += 7.5  # the pass ran this long before the kernel refused it
        raise KernelError("netlink: boom")

    monkeypatch.setattr(agent.sync.proxier, "apply", raising)
    agent.feed(service("web"), web_slice("10.244.0.1"))
    agent.sync()
    assert sample(agent.metrics, "ipvsproxy_syncs_total", result="error") == 1
    name = "kubeproxy_sync_proxy_rules_duration_seconds"
    assert sample(agent.metrics, name + "_count", ip_family="IPv4") == 1
    assert sample(agent.metrics, name + "_sum", ip_family="IPv4") == 7.5
    full = "kubeproxy_sync_full_proxy_rules_duration_seconds"
    assert sample(agent.metrics, full + "_sum", ip_family="IPv4") == 7.5


def test_a_change_right_after_a_first_pass_longer_than_the_period_is_a_partial_pass():
    """A first sync that outlasts the sync period (a large cluster on a slow node) is not
    followed by a full pass at once: a change right after it is synced partially, Service by
    Service, and the periodic full pass comes a period after the first one ended."""
    agent, runner, clock = driven_agent()
    agent.feed(service("web"), web_slice("10.244.0.5"))
    apply = agent.kernel.apply

    def slow_first(plan, *, names=None, access=None):
        clock.now += 45  # the first pass takes longer than the 30 s period
        return apply(plan, names=names, access=access)

    agent.kernel.apply = slow_first  # type: ignore[method-assign]
    assert runner.run_if_due() == 0
    agent.kernel.apply = apply  # type: ignore[method-assign]
    observations = agent.kernel.observations
    agent.feed(service("web"), web_slice("10.244.0.5", "10.244.0.6"))
    runner.request()
    assert runner.run_if_due() == 0
    assert agent.sync.last is not None
    assert not agent.sync.last.full  # the change alone, no observation
    assert agent.kernel.observations == observations
    assert len(next(iter(agent.kernel.state.dests.values()))) == 2
    assert next_run(runner, clock) == pytest.approx(CONFIG.sync_period)


def test_a_full_pass_asked_for_during_a_full_pass_is_the_next_one(monkeypatch):
    """SIGHUP (agent._signals) asks from another thread, possibly while a full pass runs:
    the end of that pass must not swallow the request (issue 28)."""
    agent, runner, clock = driven_agent()
    agent.feed(service("web"), web_slice("10.244.0.1"))
    real_apply = agent.sync.proxier.apply

    def apply(planned):
        agent.sync.resync()  # the signal's thread, in the middle of this pass
        return real_apply(planned)

    def last_full() -> bool:
        assert agent.sync.last is not None
        return agent.sync.last.full

    with monkeypatch.context() as patched:
        patched.setattr(agent.sync.proxier, "apply", apply)
        runner.run_if_due()
    assert last_full()
    clock.now += 1
    assert runner.run_if_due() == 0  # woken: due at once
    assert last_full()  # the request made during the first pass
    clock.now += 1
    agent.sync()
    assert not last_full()  # asked once, done once


def test_the_other_firewall_goes_once_after_the_first_full_pass_that_wrote_the_rules(
    monkeypatch,
):
    """Switching firewall implementations: the old rules stay until the new ones are
    written (the first full pass whose firewall step did not fail), then go, once."""
    import dataclasses

    agent = Agent()
    retired: list[int] = []
    agent.sync._after_first_full = lambda: retired.append(1)
    apply = agent.sync.proxier.apply
    failing = [True]

    def first_fails(planned):
        result = apply(planned)
        if failing[0]:
            return dataclasses.replace(result, firewall_error="nft failed: boom")
        return result

    monkeypatch.setattr(agent.sync.proxier, "apply", first_fails)
    agent.feed(service("web"), web_slice("10.244.0.1"))
    agent.sync()
    assert retired == []  # the new rules were not written: the old ones stay
    failing[0] = False
    agent.sync._full_asked = True
    agent.sync()
    agent.sync._full_asked = True
    agent.sync()
    assert retired == [1]


def first_services_cluster(count: int) -> list[dict[str, Any]]:
    """The API's Service and the cluster DNS (served first by default), and `count` others."""
    objects = [
        service("kubernetes", cluster_ips=("10.96.0.1",), ports=[port("https", 443, "TCP", 6443)]),
        slice_("kubernetes", ports=(("https", 6443, "TCP"),), endpoints=[ep("192.168.0.1")]),
        service("kube-dns", ns="kube-system", cluster_ips=("10.96.0.10",),
                ports=[port("dns", 53, "UDP", 53)]),
        slice_("kube-dns", ns="kube-system", ports=(("dns", 53, "UDP"),),
               endpoints=[ep("10.244.0.53")]),
    ]  # fmt: skip
    for i in range(count):
        objects += [
            service(f"s{i}", cluster_ips=(f"10.96.1.{i + 1}",)),
            slice_(f"s{i}", endpoints=[ep(f"10.244.1.{i + 1}")]),
        ]
    return objects


def recorded_applies(agent: Agent) -> list[list[Op]]:
    calls: list[list[Op]] = []
    apply = agent.kernel.apply

    def recording(plan, **kwargs):
        calls.append(list(plan))
        return apply(plan, **kwargs)

    agent.kernel.apply = recording  # type: ignore[method-assign]
    return calls


def test_the_first_services_are_served_by_a_pass_of_their_own_before_the_rest(caplog):
    """...before the others are even translated (which takes seconds in a large cluster)."""
    agent = Agent()
    calls = recorded_applies(agent)
    translated: list[int] = []  # the desired virtual servers when each pass applied
    apply = agent.kernel.apply

    def counting(plan, **kwargs):
        translated.append(len(agent.sync.proxier.index))
        return apply(plan, **kwargs)

    agent.kernel.apply = counting  # type: ignore[method-assign]
    agent.feed(*first_services_cluster(20))
    with caplog.at_level("INFO", logger="ipvsproxy.sync"):
        agent.sync()
    assert translated == [2, 22]
    first, rest = calls
    keys = {str(op.vs.key.address) for op in first if isinstance(op, AddService)}
    assert keys == {"10.96.0.1", "10.96.0.10"}  # the API's Service and the DNS, alone
    assert {type(op).__name__ for op in first} == {"AddService", "AddDest", "BindAddress"}
    assert len([op for op in rest if isinstance(op, AddService)]) == 20  # then the rest
    assert "first Services served before the rest of the table: default/kubernetes, " \
        "kube-system/kube-dns" in caplog.text  # fmt: skip
    agent.sync()
    assert len(calls) == 2  # nothing more to do; the first Services' pass never again


def test_a_restart_with_the_first_services_served_has_no_pass_for_them():
    agent = Agent()
    agent.feed(*first_services_cluster(3))
    agent.sync()
    again = Agent(kernel=agent.kernel)  # the next process, on the table the first one left
    calls = recorded_applies(again)
    again.feed(*first_services_cluster(4))
    again.sync()
    (only,) = calls  # one pass: the full one, with the one new Service
    assert [type(op).__name__ for op in only if isinstance(op, AddService)] == ["AddService"]


def test_no_first_services_no_pass_of_their_own():
    agent = Agent()
    agent.sync.proxier.config = dataclasses.replace(CONFIG, first_services=())
    agent.sync._config = agent.sync.proxier.config
    calls = recorded_applies(agent)
    agent.feed(*first_services_cluster(2))
    agent.sync()
    assert len(calls) == 1


def test_a_restart_reads_the_kernel_once_for_the_first_services_and_the_full_pass():
    """Where the first Services are served already, the full pass plans against the table
    their check read (no second dump of a large table)."""
    agent = Agent()
    agent.feed(*first_services_cluster(3))
    agent.sync()
    again = Agent(kernel=agent.kernel)
    before = agent.kernel.observations
    again.feed(*first_services_cluster(3))
    again.sync()
    assert agent.kernel.observations == before + 1


def test_the_first_services_own_lists_are_served_before_the_whole_lists():
    """The agent lists the first Services alone beside the whole lists (`early`): when their
    lists come first, their pass runs on them at once, the node not yet ready; once the whole
    lists come, the full pass serves the rest and the first Services' pass never comes again."""
    early = Tracker(required=(SERVICE, SLICE, NODE), node_name=CONFIG.node_name)
    agent = Agent(early=early)
    calls = recorded_applies(agent)
    objects = first_services_cluster(20)
    first = [o for o in objects if o["metadata"]["name"] in ("kubernetes", "kube-dns")]
    assert agent.sync() is False  # nothing listed yet: no pass
    assert calls == []
    for kind in (SERVICE, SLICE, NODE):
        early.replace(kind, [o for o in first if o["kind"] == kind])
    assert agent.sync() is False  # the whole lists have not come: the runner counts no pass
    (alone,) = calls
    keys = {str(op.vs.key.address) for op in alone if isinstance(op, AddService)}
    assert keys == {"10.96.0.1", "10.96.0.10"}
    assert not agent.health.served  # /readyz: not before a full pass
    agent.sync()
    assert len(calls) == 1  # still waiting for the whole lists
    agent.feed(*objects)
    assert agent.sync() is True
    assert len(calls) == 2
    added = {str(op.vs.key.address) for op in calls[1] if isinstance(op, AddService)}
    assert len(added) == 20  # the rest
    assert not added & keys  # the first Services are served already
    assert agent.health.served
