"""Inside the IPVS VM: a node without a tool of the firewall rules refuses to start, naming
it, before it touches anything; `--allow-no-firewall-rules` runs without them, saying what
that loses; a node with no iptables tool, no ipset and no ipvsadm at all runs with its
firewall in nftables. A tool is made unavailable the way an operator's image would lack it:
the agent runs with a PATH that has every program of the VM but those."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from integration.lab import IPTABLES_TOOLS, IPVSPROXY, agent_command, path_without

pytestmark = pytest.mark.vm

SERVICE = (
    "kind: Service\nmetadata: {name: web, namespace: demo}\n"
    "spec: {clusterIP: 10.96.0.40, ports: [{port: 80}]}\n"
)


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
    done = run(tmp_path, path_without(tool), "--firewall", "iptables")
    assert done.returncode == 5, done.stdout + done.stderr
    assert f"{tool} not found on PATH" in done.stderr
    assert "--allow-no-firewall-rules" in done.stderr
    assert "no VIP port filter, no loadBalancerSourceRanges, no masquerade" in done.stderr
    assert "Traceback" not in done.stderr
    # refused before anything on the node changed: no virtual server, no dummy device
    assert ipvs_table() == before
    assert not Path("/sys/class/net/kube-ipvs0").exists()


def test_the_explicit_flag_runs_without_the_firewall_and_says_what_is_lost(clean, tmp_path):
    done = run(tmp_path, path_without("iptables-restore"), "--allow-no-firewall-rules",
               "--firewall", "iptables")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "iptables-restore not found on PATH" in done.stderr
    assert "no VIP port filter, no loadBalancerSourceRanges, no masquerade" in done.stderr
    assert "0A600028:0050" in ipvs_table()  # 10.96.0.40:80, served by IPVS alone
    saved = subprocess.run(["iptables-save"], capture_output=True, text=True, check=True)
    assert "IPVSPROXY-" not in saved.stdout  # no firewall rule was written


def test_with_every_tool_the_same_run_starts(clean, tmp_path):
    done = run(tmp_path, os.environ["PATH"], "--firewall", "iptables")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0A600028:0050" in ipvs_table()
    saved = subprocess.run(["iptables-save"], capture_output=True, text=True, check=True)
    assert "IPVSPROXY-FILTER" in saved.stdout  # the firewall rules are there
    removed = subprocess.run([IPVSPROXY, "cleanup"], capture_output=True, text=True, check=False)
    assert removed.returncode == 0, removed.stderr


def test_a_node_without_iptables_ipset_ipvsadm_or_nft_runs_with_nftables(clean, tmp_path):
    """auto takes nftables, spoken to through libnftables (the nftables package's library):
    no iptables tool, no ipset, no ipvsadm, not even the `nft` program on the PATH."""
    path = path_without("nft", prefixes=IPTABLES_TOOLS)
    done = run(tmp_path, path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "firewall rules: nftables, table inet ipvsproxy" in done.stderr
    assert "0A600028:0050" in ipvs_table()
    listed = subprocess.run(["nft", "list", "table", "inet", "ipvsproxy"], capture_output=True,
                            text=True, check=True).stdout  # fmt: skip
    assert "10.96.0.40 . tcp . 80" in listed  # the VIP's port, in the VIP port filter's set
    assert "reject with icmp port-unreachable" in listed
    removed = subprocess.run([IPVSPROXY, "cleanup"], capture_output=True, text=True, check=False,
                             env={**os.environ, "PATH": path})  # fmt: skip
    assert removed.returncode == 0, removed.stderr
    gone = subprocess.run(["nft", "list", "table", "inet", "ipvsproxy"], capture_output=True)
    assert gone.returncode != 0
