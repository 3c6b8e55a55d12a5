"""An IPVS node without a tool of the companion rules refuses to start, naming the tool,
unless the operator says explicitly to go on without them (and what that loses)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from ipvsproxy import backends
from ipvsproxy.backends import CompanionUnavailable, _companion
from ipvsproxy.companion.kernel import Companion
from ipvsproxy.config import Config
from ipvsproxy.errors import KernelError
from ipvsproxy.iptables import Commands


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
    over_netlink = Companion(reader=Socket(), writer=Socket())  # type: ignore[arg-type]
    assert over_netlink.required_tools() == ("iptables-save", "iptables-restore")
    assert Companion().required_tools() == ("iptables-save", "iptables-restore", "ipset")
    half = Companion(reader=Socket())  # type: ignore[arg-type]
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
    with pytest.raises(CompanionUnavailable) as refused:
        _companion(Config())
    message = str(refused.value)
    assert f"{missing} not found on PATH" in message
    assert "--allow-no-companion-rules" in message
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
    companion, missing = _companion(Config())
    assert [args[0] for args in ran] == ["iptables-save", "ip6tables-save"]  # no ipset
    assert companion is not None
    companion.close()
    assert missing == ""


def test_the_explicit_flag_runs_without_them_and_says_what_is_lost(monkeypatch, tmp_path, caplog):
    no_netlink(monkeypatch)
    monkeypatch.setenv("PATH", path_with(tmp_path, "iptables-save", "ipset"))
    with caplog.at_level(logging.ERROR, logger="ipvsproxy.backends"):
        companion, missing = _companion(Config(allow_no_companion=True))
    assert companion is None
    assert "iptables-restore" in missing
    (record,) = caplog.records
    assert "iptables-restore" in record.getMessage()
    assert "no VIP port filter, no loadBalancerSourceRanges, no masquerade" in record.getMessage()
    backend = backends.Backend(
        kernel=None,  # type: ignore[arg-type]
        name="ipvs",
        reason="test",
        companion_missing=missing,
    )
    assert "iptables-restore" in str(backend.detail["companionRules"])


def test_the_host_path_is_left_alone():
    assert "PATH" in os.environ  # monkeypatch.setenv restored it
