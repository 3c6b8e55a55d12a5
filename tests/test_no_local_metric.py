"""kubeproxy_sync_proxy_rules_no_local_endpoints_total, as kube-proxy exports it: Services
whose Local traffic policy found no endpoint on this node, by policy and IP family."""

from __future__ import annotations

from tests.factories import ep, port, service, slice_
from tests.test_agent_loop import Agent, sample

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
