"""The conntrack settings at start-up, as kube-proxy makes them, against a fake /proc/sys
and /sys: each value written only when it differs (max and hashsize only raised), 0 leaves
it, and a read-only tree is a warning, never an exception."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from ipvsproxy.config import Config
from ipvsproxy.host.conntrack_settings import (
    HASHSIZE,
    MAX,
    MAX_LIMIT,
    Settings,
    Write,
    conntrack_max,
    ensure,
    settings_of,
)

NF = "net/netfilter/nf_conntrack_"
KERNEL_DEFAULTS = {  # a small VM's, as read on the 6.1 test kernel
    "max": 65536,
    "tcp_timeout_established": 432000,
    "tcp_timeout_close_wait": 60,
    "tcp_be_liberal": 0,
    "udp_timeout": 30,
    "udp_timeout_stream": 120,
}


@pytest.fixture
def roots(tmp_path: Path) -> tuple[Path, Path]:
    proc, sys = tmp_path / "proc/sys", tmp_path / "sys"
    for name, value in KERNEL_DEFAULTS.items():
        path = proc / (NF + name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{value}\n")
    hashsize = sys / HASHSIZE
    hashsize.parent.mkdir(parents=True)
    hashsize.write_text("16384\n")
    return proc, sys


def value(root: Path, name: str) -> int:
    return int((root / (NF + name)).read_text())


def read_only(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every write fails as on a read-only mount (also for root, who runs these tests in
    CI); the paths tried, in order."""
    tried = []

    def refuse(path: Path, data: str, *args: object, **kwargs: object) -> int:
        tried.append(path)
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(Path, "write_text", refuse)
    return tried


def test_kube_proxy_defaults_on_a_small_node(roots):
    proc, sys = roots
    outcome = ensure(Settings(), cpus=2, proc_sys=proc, sys_root=sys)
    assert value(proc, "max") == 131072  # the min: 32768 x 2 is less
    assert int((sys / HASHSIZE).read_text()) == 131072 // 4
    assert value(proc, "tcp_timeout_established") == 86400
    assert value(proc, "tcp_timeout_close_wait") == 3600
    # 0 and false: left as they were
    assert value(proc, "udp_timeout") == 30
    assert value(proc, "udp_timeout_stream") == 120
    assert value(proc, "tcp_be_liberal") == 0
    assert {w.name for w in outcome.changed} == {
        "net.netfilter.nf_conntrack_max",
        "/sys/module/nf_conntrack/parameters/hashsize",
        "net.netfilter.nf_conntrack_tcp_timeout_established",
        "net.netfilter.nf_conntrack_tcp_timeout_close_wait",
    }
    assert outcome.warnings == ()


def test_each_value_is_written_only_when_it_differs(roots, monkeypatch):
    proc, sys = roots
    ensure(Settings(), cpus=2, proc_sys=proc, sys_root=sys)
    tried = read_only(monkeypatch)  # a second pass must not even try to write
    again = ensure(Settings(), cpus=2, proc_sys=proc, sys_root=sys)
    assert tried == []
    assert again == type(again)()  # nothing changed, nothing refused


def test_max_and_hashsize_are_only_raised(roots):
    proc, sys = roots
    (proc / MAX).write_text("1000000\n")
    (sys / HASHSIZE).write_text("500000\n")
    outcome = ensure(Settings(), cpus=2, proc_sys=proc, sys_root=sys)
    assert value(proc, "max") == 1000000
    assert int((sys / HASHSIZE).read_text()) == 500000
    assert not {MAX, HASHSIZE} & {w.path for w in outcome.changed}


def test_timeouts_are_written_when_higher_too(roots):
    """Unlike max, a timeout is set to the value asked for, down as well as up."""
    proc, sys = roots
    ensure(Settings(udp=10, udp_stream=60), cpus=2, proc_sys=proc, sys_root=sys)
    assert value(proc, "udp_timeout") == 10
    assert value(proc, "udp_timeout_stream") == 60
    assert value(proc, "tcp_timeout_established") == 86400  # was 432000


def test_zero_leaves_each_setting_alone(roots):
    proc, sys = roots
    zero = Settings(max_per_core=0, min=999999, tcp_established=0, tcp_close_wait=0)
    assert ensure(zero, cpus=64, proc_sys=proc, sys_root=sys).changed == ()
    assert value(proc, "max") == 65536
    assert value(proc, "tcp_timeout_established") == 432000


def test_be_liberal_when_asked(roots):
    proc, sys = roots
    outcome = ensure(Settings(tcp_be_liberal=True), cpus=2, proc_sys=proc, sys_root=sys)
    assert value(proc, "tcp_be_liberal") == 1
    assert Write(NF + "tcp_be_liberal", 1) in outcome.changed


@pytest.mark.parametrize(
    ("per_core", "minimum", "cpus", "expected"),
    [
        (32768, 131072, 2, 131072),  # the min wins on a small node
        (32768, 131072, 8, 262144),  # 32768 x 8
        (32768, 0, 512, MAX_LIMIT),  # kube-proxy's TestGetConntrackMax_Capped
        (1, 123456, 8, 123456),  # "ensure that Min is considered"
        (0, 123456, 8, 0),  # "leave system setting"
    ],
)
def test_conntrack_max_formula(per_core, minimum, cpus, expected):
    assert conntrack_max(per_core, minimum, cpus) == expected


def test_hashsize_is_a_quarter_of_the_scaled_max(roots):
    proc, sys = roots
    ensure(Settings(), cpus=8, proc_sys=proc, sys_root=sys)
    assert value(proc, "max") == 262144
    assert int((sys / HASHSIZE).read_text()) == 65536


def test_a_read_only_tree_is_a_warning_not_a_crash(roots, monkeypatch):
    proc, sys = roots
    tried = read_only(monkeypatch)
    outcome = ensure(Settings(), cpus=2, proc_sys=proc, sys_root=sys)
    assert outcome.changed == ()
    assert len(outcome.warnings) == 4  # max, hashsize, established, close_wait
    assert outcome.warnings[0] == (
        "cannot set net.netfilter.nf_conntrack_max=131072 (it is 65536): Read-only file system"
    )
    assert len(tried) == 4  # one failure does not stop the others
    assert value(proc, "max") == 65536


def test_no_conntrack_module_is_a_warning(tmp_path):
    """nf_conntrack not loaded: none of the files exist."""
    outcome = ensure(Settings(), cpus=2, proc_sys=tmp_path / "proc", sys_root=tmp_path / "sys")
    assert outcome.changed == ()
    assert len(outcome.warnings) == 4
    assert "(it is ?)" in outcome.warnings[0]


def test_settings_of_the_config_defaults_are_kube_proxys():
    assert settings_of(Config()) == Settings(
        max_per_core=32768, min=131072, tcp_established=86400, tcp_close_wait=3600
    )
