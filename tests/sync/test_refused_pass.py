"""Health is honest about passes that apply nothing (issue 28): a pass whose backend
transaction was refused as a whole (the fallback's iptables-restore: no rule written) is a
failed pass. It does not refresh /healthz, is counted as a sync error, is logged once with
its cause (not once per object it carried), and is retried with backoff; the first pass
that goes in makes the node healthy again. Per-object refusals stay as they are
(tests/sync/test_failures.py::test_health_stays_up_over_sync_periods_while_an_operation_keeps_failing)."""

from __future__ import annotations

import logging

from ipvsproxy.agent_loop import AgentLoop
from ipvsproxy.fallback import IptablesKernel
from ipvsproxy.metrics import Metrics
from ipvsproxy.proxier import Proxier
from ipvsproxy.serve import Health
from ipvsproxy.sync.drain import Drainer
from ipvsproxy.sync.runner import Runner
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, Tracker
from tests.factories import ep, node, service, slice_
from tests.support import AGENT_CONFIG, Clock, FakeIptables, next_run, sample

REFUSAL = "iptables-restore failed: scripted"


def refusing_node() -> tuple[AgentLoop, Runner, Clock, FakeIptables, Metrics, Health]:
    clock = Clock(1000.0)
    commands = FakeIptables()
    tracker = Tracker(required=(SERVICE, SLICE, NODE), node_name="node-a")
    tracker.replace(NODE, [node()])
    tracker.replace(SERVICE, [service("web")])
    endpoints = [ep(f"10.244.0.{n}") for n in range(1, 21)]
    tracker.replace(SLICE, [slice_("web", endpoints=endpoints)])
    metrics, health = Metrics(), Health(timeout=60, clock=clock)
    drainer = Drainer(timeout=AGENT_CONFIG.drain_timeout, clock=clock)
    kernel = IptablesKernel(commands=commands)
    loop = AgentLoop(
        proxier=Proxier(kernel=kernel, config=AGENT_CONFIG, drainer=drainer, clock=clock),
        tracker=tracker,
        metrics=metrics,
        health=health,
        clock=clock,
    )
    return loop, loop.runner, clock, commands, metrics, health


def test_a_pass_whose_transaction_is_refused_whole_is_a_failed_pass(caplog):
    """Before: every such pass refreshed /healthz (200 while no rule was ever written),
    counted as `failed` like a per-object refusal, and named the objects it carried."""
    loop, runner, clock, commands, metrics, health = refusing_node()
    commands.refusals["iptables-restore"] = 10**6  # refuses every transaction
    delays = []
    start = clock.now
    with caplog.at_level(logging.INFO, logger="ipvsproxy.sync"):
        for _ in range(6):
            health.queued()  # as the agent does on every change
            runner.run_if_due()
            delays.append(next_run(runner, clock))
            clock.now += delays[-1]
    assert delays == [1, 2, 4, 8, 16, 30]  # retried with backoff
    assert clock.now - start > health.timeout
    assert not health.status()[0]  # never refreshed by a pass that wrote nothing
    assert sample(metrics, "ipvsproxy_syncs_total", result="error") == 6
    assert sample(metrics, "ipvsproxy_syncs_total", result="failed") == 0
    restores = "kubeproxy_sync_proxy_rules_iptables_restore_failures_total"
    assert sample(metrics, restores, ip_family="IPv4") == 12  # per run: nat and filter
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 6, errors  # one line per failed pass, with its cause
    assert all("nothing of it was written" in e and REFUSAL in e for e in errors)

    commands.refusals["iptables-restore"] = 0  # the node lets the rules in again
    runner.run_if_due()
    assert health.status()[0]
    assert commands.tables[4]["IPVSPX-SERVICES"]
    assert sample(metrics, "ipvsproxy_syncs_total", result="ok") == 1
    assert next_run(runner, clock) == AGENT_CONFIG.sync_period  # backoff over
