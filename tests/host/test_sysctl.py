"""sysctl.ensure: what differs is written; a refusal names the setting, and for --strict-arp
refused by a read-only /proc/sys, where it belongs (issue 46: the agent alone exited 3 with
"Read-only file system" and no hint)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from ipvsproxy.errors import KernelUnavailable
from ipvsproxy.host import sysctl


def proc(tmp_path: Path, *settings: sysctl.Sysctl, value: int = 0) -> Path:
    for setting in settings:
        path = tmp_path / setting.path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{value}\n")
    return tmp_path


def read_only(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Path, *args: object, **kwargs: object) -> int:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "write_text", refuse)


def test_what_differs_is_written(tmp_path):
    root = proc(tmp_path, *sysctl.STRICT_ARP)
    assert sysctl.ensure(sysctl.STRICT_ARP, root) == list(sysctl.STRICT_ARP)
    assert (root / sysctl.STRICT_ARP[1].path).read_text() == "2\n"
    assert sysctl.ensure(sysctl.STRICT_ARP, root) == []


def test_strict_arp_on_a_read_only_proc_names_the_init_container(tmp_path, monkeypatch):
    root = proc(tmp_path, *sysctl.STRICT_ARP)
    read_only(monkeypatch)
    with pytest.raises(KernelUnavailable) as refused:
        sysctl.ensure(sysctl.STRICT_ARP, root)
    message = str(refused.value)
    assert message.startswith("cannot set net.ipv4.conf.all.arp_ignore=1: ")
    assert "Read-only file system" in message
    assert "`ipvsproxy prepare --strict-arp`" in message
    assert "ipvs.strictARP" in message
    assert "\n" not in message


def test_another_setting_refused_gets_no_such_hint(tmp_path, monkeypatch):
    (forward,) = [s for s in sysctl.BASE if s.name == "net.ipv4.ip_forward"]
    root = proc(tmp_path, forward)
    read_only(monkeypatch)
    with pytest.raises(KernelUnavailable, match="ip_forward=1: .*Read-only") as refused:
        sysctl.ensure((forward,), root)
    assert "prepare" not in str(refused.value)
