"""The iptables fallback on a node's own address, in a throw-away namespace (issue 28, item 2):
the DNAT rules of a Service with `externalIPs: [<node address>]` and of a NodePort outside
`--service-node-port-range` go with the Service, across restarts (each `run --once` is a new
process), `diff` shows their deletion first, and a foreign rule for the node address stays."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from integration.lab import agent_command
from tests.factories import ep, node, port, service, slice_

pytestmark = pytest.mark.netns
NODE_IP = "10.250.7.1"
FOREIGN = (  # an administrator's DNAT on the node address: never ipvsproxy's
    f"-A PREROUTING -d {NODE_IP}/32 -p tcp -m tcp --dport 2223 -j DNAT --to-destination "
    "10.250.7.9:22"
)


def objects(*, with_services: bool) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [node(addresses=(NODE_IP,))]
    if with_services:
        out += [
            service("ext", externalIPs=[NODE_IP], ports=[port(number=2222)]),
            slice_("ext", endpoints=[ep("10.244.0.5")]),
            service(
                "low",
                type="NodePort",
                cluster_ips=("10.96.0.11",),
                ports=[port(number=80, node_port=22)],
            ),  # fmt: skip
            slice_("low", endpoints=[ep("10.244.0.6")]),
        ]
    return out


def ours(saved: str, number: int) -> list[str]:
    """ipvsproxy's rules for NODE_IP:number (tcp) in an iptables-save text."""
    return [
        line
        for line in saved.splitlines()
        if line.startswith("-A IPVSPX-")
        and f"-d {NODE_IP}/32 " in line
        and f"--dport {number} " in line
    ]


def test_node_address_rules_go_with_their_service_across_restarts(netns: str, tmp_path: Path):
    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", netns, *args], capture_output=True, text=True, check=check
        )

    def nat() -> str:
        return run("iptables-save", "-t", "nat").stdout

    run("ip", "link", "set", "lo", "up")
    run("ip", "link", "add", "eth0", "type", "veth", "peer", "name", "eth1")
    run("ip", "link", "set", "eth0", "up")
    run("ip", "addr", "add", f"{NODE_IP}/24", "dev", "eth0")
    subprocess.run(
        ["ip", "netns", "exec", netns, "iptables-restore", "--noflush"],
        input=f"*nat\n{FOREIGN}\nCOMMIT\n", text=True, check=True,
    )  # fmt: skip
    manifest = tmp_path / "cluster.yaml"

    def agent(command: str, *once: str) -> subprocess.CompletedProcess[str]:
        args = agent_command(
            *once, "--manifests", str(manifest), command=command, netns=netns,
            service_cidr=None, backend="iptables", min_sync_period=None, health=None,
            metrics=None,
        )  # fmt: skip
        return subprocess.run(args, capture_output=True, text=True, check=False)

    manifest.write_text(yaml.safe_dump_all(objects(with_services=True)))
    done = agent("run", "--once")
    assert done.returncode == 0, done.stderr
    assert ours(nat(), 2222)
    assert ours(nat(), 22)

    manifest.write_text(yaml.safe_dump_all(objects(with_services=False)))  # both deleted
    diff = agent("diff")  # a new process: nothing known
    assert diff.returncode == 1, diff.stdout + diff.stderr
    assert f"-D -t {NODE_IP}:2222" in diff.stdout
    assert f"-D -t {NODE_IP}:22" in diff.stdout
    assert "2223" not in diff.stdout

    done = agent("run", "--once")
    assert done.returncode == 0, done.stderr
    assert not ours(nat(), 2222)
    assert not ours(nat(), 22)
    assert FOREIGN in nat()  # never ipvsproxy's
    diff = agent("diff")
    assert diff.returncode == 0, diff.stdout + diff.stderr
