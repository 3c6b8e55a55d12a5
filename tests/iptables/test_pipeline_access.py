"""The fallback in the proxier: the agent's Proxier hands the iptables backend each virtual
server's access, so loadBalancerSourceRanges are enforced from the first sync, and a Service
that only gains or loses ranges (no IPVS operation) is rewritten by the next partial pass."""

from __future__ import annotations

import copy
from typing import Any

from ipvsproxy.config import Config
from ipvsproxy.iptables import IptablesKernel
from ipvsproxy.proxier import Proxier
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, Tracker
from tests.factories import ep, node, port, service, slice_
from tests.iptables.test_policy import CLUSTER_IP, INSIDE, LB_IP, NODE_IP, OUTSIDE, key, reaches
from tests.support import FakeIptables

CONFIG = Config(node_name="node-a", service_cidrs=())


def lb(ranges: list[str]) -> Any:
    return service(
        "lb",
        type="LoadBalancer",
        cluster_ips=(CLUSTER_IP,),
        ports=[port("http", 80, "TCP", 8080, 30080)],
        status={"loadBalancer": {"ingress": [{"ip": LB_IP}]}},
        loadBalancerSourceRanges=ranges,
    )


def test_the_agents_fallback_enforces_source_ranges_and_follows_a_change_at_once():
    tracker = Tracker(required=(SERVICE, SLICE, NODE), node_name="node-a")
    tracker.replace(NODE, [node(addresses=(NODE_IP,))])
    tracker.replace(SERVICE, [lb(["192.0.2.0/24"])])
    tracker.replace(
        SLICE, [slice_("lb", ports=(("http", 8080, "TCP"),), endpoints=[ep("10.244.1.9")])]
    )
    commands = FakeIptables()
    proxier = Proxier(kernel=IptablesKernel(commands=commands), config=CONFIG)
    assert proxier.sync(tracker.take(), full=True).sync.report.ok
    chains = commands.tables[4]
    assert reaches(chains, INSIDE, key(LB_IP))
    assert not reaches(chains, OUTSIDE, key(LB_IP))  # closed from the first sync
    assert reaches(chains, OUTSIDE, key(CLUSTER_IP))  # the ranges guard the LB IP only
    tracker.event(SERVICE, "MODIFIED", copy.deepcopy(lb([])))  # ranges removed: no operation
    result = proxier.sync(tracker.take(), full=False)
    assert not result.sync.plan
    assert reaches(commands.tables[4], OUTSIDE, key(LB_IP))  # open at once, not next period
    tracker.event(SERVICE, "MODIFIED", lb(["192.0.2.0/24"]))
    proxier.sync(tracker.take(), full=False)
    assert not reaches(commands.tables[4], OUTSIDE, key(LB_IP))
