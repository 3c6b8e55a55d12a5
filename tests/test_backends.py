"""Choosing the backends (backends.py): an IPVS node without a tool of the firewall rules
refuses to start, naming the tool,
unless the operator says explicitly to go on without them (and what that loses)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from ipvsproxy import backends
from ipvsproxy.backends import FirewallUnavailable, _firewall
from ipvsproxy.config import Config
from ipvsproxy.errors import KernelError
from ipvsproxy.firewall.host_firewall import Firewall
from ipvsproxy.firewall.nft_firewall import NftFirewall
from ipvsproxy.host.commands import Commands


class Socket:
    """Stands for a netlink SetReader/SetWriter that opened."""

    def close(self) -> None:
        pass


def path_with(tmp_path: Path, *tools: str) -> str:
    """A PATH holding only `tools` (scripts that print nothing and succeed)."""
    for tool in tools:
        script = tmp_path / tool
        script.write_text("#!/bin/sh\nexit 0\n")
        script.chmod(0o755)
    return str(tmp_path)


def no_netlink(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse() -> None:
        raise KernelError("no netfilter netlink here")

    monkeypatch.setattr(backends, "SetReader", refuse)
    monkeypatch.setattr(backends, "SetWriter", refuse)


def test_the_tools_needed_depend_on_whether_the_sets_go_over_netlink():
    over_netlink = Firewall(reader=Socket(), writer=Socket())  # type: ignore[arg-type]
    assert over_netlink.required_tools() == ("iptables-save", "iptables-restore")
    assert Firewall().required_tools() == ("iptables-save", "iptables-restore", "ipset")
    half = Firewall(reader=Socket())  # type: ignore[arg-type]
    assert "ipset" in half.required_tools()


@pytest.mark.parametrize(
    ("present", "missing"),
    [
        (("iptables-save", "ipset"), "iptables-restore"),
        (("iptables-restore", "ipset"), "iptables-save"),
        (("iptables-save", "iptables-restore"), "ipset"),
    ],
)
def test_a_missing_tool_refuses_the_start_naming_it(monkeypatch, tmp_path, present, missing):
    no_netlink(monkeypatch)
    monkeypatch.setenv("PATH", path_with(tmp_path, *present))
    with pytest.raises(FirewallUnavailable) as refused:
        _firewall(Config(firewall="iptables"))
    message = str(refused.value)
    assert f"{missing} not found on PATH" in message
    assert "--allow-no-firewall-rules" in message
    assert "no loadBalancerSourceRanges" in message


def test_with_netlink_sets_the_ipset_tool_is_not_needed(monkeypatch, tmp_path):
    monkeypatch.setattr(backends, "SetReader", Socket)
    monkeypatch.setattr(backends, "SetWriter", Socket)
    monkeypatch.setenv("PATH", path_with(tmp_path, "iptables-save", "iptables-restore"))
    ran: list[list[str]] = []

    def record(self: Commands, args: list[str], stdin: str | None = None) -> str:
        ran.append(args)
        return ""

    monkeypatch.setattr(Commands, "run", record)
    firewall, why = _firewall(Config(firewall="iptables"))
    assert [args[0] for args in ran] == ["iptables-save", "ip6tables-save"]  # no ipset
    assert firewall is not None
    firewall.close()
    assert why == "--firewall iptables"


def test_auto_takes_nftables_where_the_kernel_takes_the_table(monkeypatch, caplog):
    checked: list[str] = []
    monkeypatch.setattr(NftFirewall, "check", lambda self: checked.append("nft"))
    with caplog.at_level(logging.INFO, logger="ipvsproxy.backends"):
        firewall, why = _firewall(Config())
    assert firewall is not None
    assert firewall.name == "nftables"
    assert checked == ["nft"]
    assert why == "--firewall auto: the kernel takes ipvsproxy's nftables table"
    assert "firewall rules: nftables, table inet ipvsproxy" in caplog.text


def test_auto_without_nftables_says_why_it_takes_iptables(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(backends, "SetReader", Socket)
    monkeypatch.setattr(backends, "SetWriter", Socket)
    monkeypatch.setenv("PATH", path_with(tmp_path, "iptables-save", "iptables-restore"))
    monkeypatch.setattr(Commands, "run", lambda self, args, stdin=None: "")
    with caplog.at_level(logging.WARNING, logger="ipvsproxy.backends"):
        firewall, why = _firewall(Config())
    assert firewall is not None
    assert firewall.name == "iptables"
    firewall.close()
    assert why == "--firewall auto: nftables: nft not found on PATH"
    (record,) = caplog.records
    assert "iptables and ipsets, as nftables is refused (nftables: nft not found" in record.message


def test_nftables_asked_for_and_refused_stops_the_start_naming_why(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", path_with(tmp_path, "iptables-save", "iptables-restore", "ipset"))
    with pytest.raises(FirewallUnavailable) as refused:
        _firewall(Config(firewall="nftables"))
    message = str(refused.value)
    assert "nftables table cannot be used: nft not found on PATH" in message
    assert "--allow-no-firewall-rules" in message


def test_the_explicit_flag_runs_without_them_and_says_what_is_lost(monkeypatch, tmp_path, caplog):
    no_netlink(monkeypatch)
    monkeypatch.setenv("PATH", path_with(tmp_path, "iptables-save", "ipset"))
    with caplog.at_level(logging.ERROR, logger="ipvsproxy.backends"):
        firewall, missing = _firewall(Config(allow_no_firewall=True, firewall="iptables"))
    assert firewall is None
    assert "iptables-restore" in missing
    (record,) = caplog.records
    assert "iptables-restore" in record.getMessage()
    assert "no VIP port filter, no loadBalancerSourceRanges, no masquerade" in record.getMessage()
    backend = backends.Backend(
        kernel=None,  # type: ignore[arg-type]
        name="ipvs",
        reason="test",
        firewall_missing=missing,
    )
    assert "iptables-restore" in str(backend.detail["firewallRules"])


def test_the_host_path_is_left_alone():
    assert "PATH" in os.environ  # monkeypatch.setenv restored it


def test_a_family_the_firewall_cannot_cover_gets_no_virtual_server(caplog):
    """IPv6 on a node without ip6tables: the firewall covers IPv4 only, so IPv6 virtual
    servers and VIPs are refused (fail closed: no VIP port filter, no source ranges there),
    each with a failure and one warning; IPv4 is programmed; deletions always pass."""
    from ipaddress import ip_address

    from ipvsproxy.backends import FailClosed
    from ipvsproxy.errors import Unsupported
    from ipvsproxy.model import (
        AddDest,
        AddService,
        BindAddress,
        DeleteService,
        Op,
        Proto,
        RealServer,
        RSKey,
        VirtualServer,
        VSKey,
    )
    from ipvsproxy.testing import FakeKernel

    v4 = VSKey(ip_address("10.96.0.1"), 80, Proto.TCP)
    v6 = VSKey(ip_address("fd00:96::1"), 80, Proto.TCP)
    fake = FakeKernel()
    kernel = FailClosed(fake, (4,))  # type: ignore[arg-type]
    ops: list[Op] = [
        AddService(VirtualServer(v4)),
        AddDest(v4, RealServer(RSKey(ip_address("10.244.1.2"), 8080))),
        BindAddress(v4.address),
        AddService(VirtualServer(v6)),
        AddDest(v6, RealServer(RSKey(ip_address("fd00:244::2"), 8080))),
        BindAddress(v6.address),
    ]
    with caplog.at_level(logging.WARNING, logger="ipvsproxy.backends"):
        report = kernel.apply(ops)
        kernel.apply([AddService(VirtualServer(v6))])  # warned once per virtual server
    assert report.applied == 3
    assert [f.op for f in report.failures] == ops[3:]
    assert all(isinstance(f.error, Unsupported) for f in report.failures)
    assert "fail closed" in str(report.failures[0].error)
    assert fake.state.services.keys() == {v4}
    assert fake.state.bound == {v4.address}
    assert len([r for r in caplog.records if str(v6) in r.getMessage()]) == 1
    assert kernel.apply([DeleteService(v6)]).failures[0].op == DeleteService(v6)  # not refused:
    # the fake has no such service, so the kernel itself answers NotFound
    assert not isinstance(kernel.apply([DeleteService(v6)]).failures[0].error, Unsupported)


@pytest.mark.parametrize(("versions", "guarded"), [((4,), True), ((4, 6), False)])
def test_ipvs_is_guarded_only_when_the_firewall_lacks_a_family(monkeypatch, versions, guarded):
    from contextlib import nullcontext

    from ipvsproxy.backends import FailClosed, _ipvs_backend
    from ipvsproxy.testing import FakeKernel

    monkeypatch.setattr(backends, "_ipvs", lambda config: nullcontext(FakeKernel()))
    firewall = Firewall(versions=versions)
    monkeypatch.setattr(backends, "_firewall", lambda config, commands=None: (firewall, ""))
    with _ipvs_backend(Config(), "test") as backend:
        assert isinstance(backend.kernel, FailClosed) is guarded
        assert backend.firewall is firewall


def test_cleanup_keeping_ipvs_removes_only_the_rules_and_sets(monkeypatch):
    """The way back from a migration: kube-proxy's IPVS mode takes the table over in place."""
    calls: list[str] = []

    def recorder(name: str):
        def remove(*args, dry_run, **_):
            calls.append(name)
            return []

        return remove

    monkeypatch.setattr(backends, "_recorded", frozenset)
    monkeypatch.setattr(backends, "_firewall_cleanup", recorder("fw"))
    monkeypatch.setattr(backends, "_iptables_cleanup", recorder("ipt"))
    monkeypatch.setattr(backends, "ipvs_cleanup", recorder("ipvs"))
    backends.cleanup(Config(), dry_run=True, ipvs=False)
    assert calls == ["fw", "ipt"]
    calls.clear()
    backends.cleanup(Config(), dry_run=True)
    assert calls == ["fw", "ipvs", "ipt"]
