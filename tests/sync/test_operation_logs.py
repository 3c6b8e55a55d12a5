"""Logs an operator can use: at debug one record per operation of a real pass, naming the
Service, the virtual server and the real server (as fields and in words); none at info, where
the per-operation work is not even done; a refused operation's error line names them too."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from ipvsproxy import logs
from ipvsproxy.config import Config
from ipvsproxy.errors import KernelError
from ipvsproxy.fallback import IptablesKernel
from ipvsproxy.kernel import ApplyReport
from ipvsproxy.model import AddDest, Op
from ipvsproxy.proxier import Proxier
from ipvsproxy.sync import ipvs_pass
from ipvsproxy.sync.render import KINDS
from ipvsproxy.testing import FakeKernel
from tests.factories import ep, node, port, service, slice_
from tests.support import FakeIptables, Synced, driven_agent

CONFIG = Config(node_name="node-a")
DNS_PORT = port("dns", 53, "UDP", target=53)
DNS_SLICE_PORTS = (("dns", 53, "UDP"),)


def cluster(*, web_endpoints: Sequence[str] = ("10.244.0.1", "10.244.0.2"), dns: bool = True):
    objects: list[dict[str, Any]] = [
        node(),
        service("web", ns="shop", ports=[port("http", 80, target=8080)]),
        slice_("web", ns="shop", endpoints=[ep(a) for a in web_endpoints]),
    ]
    if dns:
        objects += [
            service("dns", ns="kube-system", cluster_ips=("10.96.0.53",), ports=[DNS_PORT]),
            slice_("dns", ns="kube-system", ports=DNS_SLICE_PORTS, endpoints=[ep("10.244.0.7")]),
        ]
    return objects


def op_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if hasattr(r, "op")]


def test_at_debug_every_operation_of_a_pass_is_one_record_naming_service_and_servers(caplog):
    synced = Synced(Proxier(FakeKernel(), CONFIG))
    with caplog.at_level(logging.DEBUG, logger="ipvsproxy.sync"):
        result = synced.sync(cluster())
    plan = result.sync.plan
    records = op_records(caplog)
    assert [r.op for r in records] == [KINDS[type(op)] for op in plan]  # type: ignore[attr-defined]
    assert all(r.levelno == logging.DEBUG and r.name == "ipvsproxy.sync" for r in records)
    web = [r.__dict__ for r in records if getattr(r, "service", "") == "shop/web:http"]
    assert {k: web[0][k] for k in ("op", "vip", "port", "protocol", "scheduler")} == {
        "op": "add-service",
        "vip": "10.96.0.10",
        "port": 80,
        "protocol": "TCP",
        "scheduler": "rr",
    }
    dests = [(r["op"], r["endpoint"], r["weight"], r["scheduler"]) for r in web[1:]]
    assert dests == [
        ("add-dest", "10.244.0.1:8080", 1, "rr"),
        ("add-dest", "10.244.0.2:8080", 1, "rr"),
    ]
    assert web[1]["message"] == (
        "add-dest: Service shop/web:http, virtual server TCP 10.96.0.10:80 rr, "
        "real server 10.244.0.1:8080 weight 1"
    )
    dns = [r for r in records if getattr(r, "service", "") == "kube-system/dns:dns"]
    assert [r.getMessage() for r in dns] == [
        "add-service: Service kube-system/dns:dns, virtual server UDP 10.96.0.53:53 rr",
        "add-dest: Service kube-system/dns:dns, virtual server UDP 10.96.0.53:53 rr, "
        "real server 10.244.0.7:53 weight 1",
    ]
    binds = [r.getMessage() for r in records if r.op == "bind-address"]  # type: ignore[attr-defined]
    assert binds == ["bind-address: 10.96.0.10", "bind-address: 10.96.0.53"]


def test_removals_name_the_endpoint_and_a_service_no_longer_wanted_says_so(caplog):
    synced = Synced(Proxier(FakeKernel(), CONFIG))
    synced.sync(cluster())
    with caplog.at_level(logging.DEBUG, logger="ipvsproxy.sync"):
        synced.sync(cluster(web_endpoints=("10.244.0.1",), dns=False), full=False)
    messages = [r.getMessage() for r in op_records(caplog)]
    assert messages == [
        "delete-dest: Service shop/web:http, virtual server TCP 10.96.0.10:80 rr, "
        "real server 10.244.0.2:8080",
        "delete-service: no Service (no longer wanted), virtual server UDP 10.96.0.53:53 rr",
        "unbind-address: 10.96.0.53",
    ]
    gone = op_records(caplog)[1]
    assert not hasattr(gone, "service")
    assert (gone.vip, gone.scheduler) == ("10.96.0.53", "rr")  # type: ignore[attr-defined]


def test_the_iptables_fallback_logs_its_operations_the_same_way_and_a_failed_restore(caplog):
    commands = FakeIptables()
    synced = Synced(Proxier(IptablesKernel(commands=commands), CONFIG))
    commands.fail.add("iptables-restore")
    with caplog.at_level(logging.DEBUG, logger="ipvsproxy.sync"):
        result = synced.sync(cluster(dns=False))
    records = op_records(caplog)
    assert [r.op for r in records] == [KINDS[type(op)] for op in result.sync.plan]  # type: ignore[attr-defined]
    assert len(result.sync.report.failures) == len(records) == 4  # one restore carried them all
    assert (
        records[1]
        .getMessage()
        .startswith(
            "add-dest: Service shop/web:http, virtual server TCP 10.96.0.10:80 rr, "
            "real server 10.244.0.1:8080 weight 1: failed: "
        )
    )
    assert all(getattr(r, "error", "") for r in records)


def test_at_info_no_operation_is_logged_nor_even_described(caplog, monkeypatch):
    def described(*args: Any) -> Any:
        raise AssertionError("an operation was described with debug off")

    monkeypatch.setattr(ipvs_pass, "facts", described)
    synced = Synced(Proxier(FakeKernel(), CONFIG))
    with caplog.at_level(logging.INFO, logger="ipvsproxy.sync"):
        result = synced.sync(cluster())
    assert result.sync.plan
    assert op_records(caplog) == []


@pytest.fixture
def root_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.usefixtures("root_logging")
def test_json_lines_of_a_real_pass_parse_and_carry_the_fields():
    out = io.StringIO()
    logs.configure("debug", "json", stream=out)
    result = Synced(Proxier(FakeKernel(), CONFIG)).sync(cluster(dns=False))
    entries = [json.loads(line) for line in out.getvalue().splitlines()]
    ops = [e for e in entries if "op" in e]
    assert len(ops) == len(result.sync.plan)
    for entry in entries:
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", entry["time"])
    last_dest = [e for e in ops if e["op"] == "add-dest"][-1]
    assert ops[-1]["op"] == "bind-address"  # the VIP bound last, once its Service is in
    assert last_dest == {
        "time": last_dest["time"],
        "level": "debug",
        "logger": "ipvsproxy.sync",
        "msg": "add-dest: Service shop/web:http, virtual server TCP 10.96.0.10:80 rr, "
        "real server 10.244.0.2:8080 weight 1",
        "op": "add-dest",
        "service": "shop/web:http",
        "vip": "10.96.0.10",
        "port": 80,
        "protocol": "TCP",
        "scheduler": "rr",
        "endpoint": "10.244.0.2:8080",
        "weight": 1,
    }


def test_a_refused_operation_is_an_error_line_naming_service_servers_and_error(caplog):
    agent, runner, _ = driven_agent()
    real_apply = agent.kernel.apply

    def refusing(plan: Sequence[Op], *, names: Any = None, access: Any = None) -> ApplyReport:
        for op in plan:
            if isinstance(op, AddDest) and str(op.rs.key.address) == "10.244.0.2":
                agent.kernel.errors[op] = KernelError("EINVAL")
        return real_apply(plan, names=names, access=access)

    agent.kernel.apply = refusing  # type: ignore[method-assign]
    agent.feed(*cluster(dns=False))
    with caplog.at_level(logging.DEBUG, logger="ipvsproxy.sync"):
        runner.run_if_due()
    (error,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert error.getMessage() == (
        "operation failed: add-dest: Service shop/web:http, virtual server TCP 10.96.0.10:80 "
        "rr, real server 10.244.0.2:8080 weight 1: EINVAL"
    )
    fields = {k: error.__dict__[k] for k in ("service", "vip", "op", "endpoint", "error")}
    assert fields == {
        "service": "shop/web:http",
        "vip": "10.96.0.10",
        "op": "add-dest",
        "endpoint": "10.244.0.2:8080",
        "error": "EINVAL",
    }
    (debug,) = [r for r in op_records(caplog) if getattr(r, "error", "") and r.levelno < 30]
    assert debug.getMessage().endswith("weight 1: failed: EINVAL")
    (summary,) = [r for r in caplog.records if r.getMessage().startswith("sync: ")]
    assert agent.sync.last is not None
    counts = (summary.__dict__["operations"], summary.__dict__["failed"])
    assert counts == (len(agent.sync.last.sync.plan), 1)


@pytest.mark.usefixtures("root_logging")
@pytest.mark.parametrize(("verbosity", "lines"), [(0, 2), (2, 5)])
def test_a_pass_that_writes_nothing_is_logged_only_at_v_2(verbosity, lines):
    """kube-proxy logs its per-sync line at V(2): at the default verbosity a pass is logged
    when it wrote something (the first one, a removed endpoint), and idle resyncs (thousands
    a day) say nothing; with --v 2 every pass has its line."""
    from tests.support import Agent
    from tests.test_agent_loop import web_slice

    stream = io.StringIO()
    logs.configure("info", "json", stream=stream)
    logs.set_verbosity(verbosity)
    try:
        agent = Agent()
        agent.feed(service("web"), web_slice("10.244.0.1", "10.244.0.2"))
        agent.sync()  # writes the Service
        agent.sync.request_full()
        agent.sync()  # a full resync that finds nothing to do
        agent.sync()
        agent.feed(service("web"), web_slice("10.244.0.1"))
        agent.sync()  # an endpoint goes
        agent.sync()
    finally:
        logs.set_verbosity(0)
    passes = [json.loads(line) for line in stream.getvalue().splitlines()]
    passes = [p for p in passes if p["msg"].startswith("sync: ")]
    assert len(passes) == lines, [p["msg"] for p in passes]
    assert all(p["operations"] for p in passes) or verbosity == 2
