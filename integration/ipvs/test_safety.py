"""Inside the IPVS VM: a node without a tool of the firewall rules refuses to start, naming
it, before it touches anything; `--allow-no-firewall-rules` runs without them, saying what
that loses. The tool is made unavailable the way an operator's image would lack it: the
agent runs with a PATH that has every program of the VM but that one."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from integration.lab import IPVSPROXY, agent_command

pytestmark = pytest.mark.vm

SERVICE = (
    "kind: Service\nmetadata: {name: web, namespace: demo}\n"
    "spec: {clusterIP: 10.96.0.40, ports: [{port: 80}]}\n"
)


def path_without(tmp_path: Path, *tools: str) -> str:
    """A PATH of one directory linking every program on this PATH except `tools`."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for directory in reversed(os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin").split(":")):
        if not Path(directory).is_dir():
            continue
        for program in Path(directory).iterdir():
            if program.name in tools:
                continue
            link = bin_ / program.name
            if link.is_symlink():
                link.unlink()
            link.symlink_to(program)
    return str(bin_)


def run(tmp_path: Path, path: str, *extra: str) -> subprocess.CompletedProcess[str]:
    manifest = tmp_path / "svc.yaml"
    manifest.write_text(SERVICE)
    once = agent_command("--once", "--manifests", str(manifest), min_sync_period=None,
                         health=None, metrics=None, more=extra)  # fmt: skip
    return subprocess.run(
        once,
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": path},
        check=False,
        timeout=300,
    )


def ipvs_table() -> str:
    return Path("/proc/net/ip_vs").read_text()


@pytest.mark.parametrize("tool", ["iptables-restore", "iptables-save"])
def test_a_missing_firewall_tool_refuses_the_start_naming_it(clean, tmp_path, tool):
    before = ipvs_table()
    done = run(tmp_path, path_without(tmp_path, tool))
    assert done.returncode == 5, done.stdout + done.stderr
    assert f"{tool} not found on PATH" in done.stderr
    assert "--allow-no-firewall-rules" in done.stderr
    assert "no VIP port filter, no loadBalancerSourceRanges, no masquerade" in done.stderr
    assert "Traceback" not in done.stderr
    # refused before anything on the node changed: no virtual server, no dummy device
    assert ipvs_table() == before
    assert not Path("/sys/class/net/kube-ipvs0").exists()


def test_the_explicit_flag_runs_without_the_firewall_and_says_what_is_lost(clean, tmp_path):
    done = run(tmp_path, path_without(tmp_path, "iptables-restore"), "--allow-no-firewall-rules")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "iptables-restore not found on PATH" in done.stderr
    assert "no VIP port filter, no loadBalancerSourceRanges, no masquerade" in done.stderr
    assert "0A600028:0050" in ipvs_table()  # 10.96.0.40:80, served by IPVS alone
    saved = subprocess.run(["iptables-save"], capture_output=True, text=True, check=True)
    assert "IPVSPROXY-" not in saved.stdout  # no firewall rule was written


def test_with_every_tool_the_same_run_starts(clean, tmp_path):
    done = run(tmp_path, os.environ["PATH"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0A600028:0050" in ipvs_table()
    saved = subprocess.run(["iptables-save"], capture_output=True, text=True, check=True)
    assert "IPVSPROXY-FILTER" in saved.stdout  # the firewall rules are there
    removed = subprocess.run([IPVSPROXY, "cleanup"], capture_output=True, text=True, check=False)
    assert removed.returncode == 0, removed.stderr
