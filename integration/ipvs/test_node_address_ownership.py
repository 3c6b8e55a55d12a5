"""Inside the IPVS VM (issue 28, item 2): virtual servers on the node's own address go with
their Service at any port, across restarts (each `run --once` and `diff` is a new process),
and `diff` shows their deletion; one an administrator made on the node address
(`ipvsadm -A`) is never touched, by a sync or by `cleanup`. The record is the
IPVSPROXY-CREATED ipset (firewall/sets.py, ownership rule 5).

The node address is a test address on a dummy link of its own, and NodePorts are confined to
it (`--nodeport-addresses`): a NodePort of 22 on the VM's own addresses would take its SSH.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from integration.lab import IPVSPROXY, agent_command
from tests.factories import ep, node, port, service, slice_

pytestmark = pytest.mark.vm

LINK = "ipvsp-node"
NODE_IP = "10.250.9.1"
NODE_PORTS = ("--nodeport-addresses", "10.250.9.0/24")


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


@pytest.fixture
def node_address(clean: None) -> Iterator[None]:
    subprocess.run(["ip", "link", "add", LINK, "type", "dummy"], check=True)
    try:
        subprocess.run(["ip", "link", "set", LINK, "up"], check=True)
        subprocess.run(["ip", "addr", "add", f"{NODE_IP}/32", "dev", LINK], check=True)
        yield
    finally:
        subprocess.run(["ip", "link", "del", LINK], check=False)


def ipvsproxy(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [IPVSPROXY, *args], capture_output=True, text=True, check=False, timeout=300
    )


def agent(command: str, *source: str) -> subprocess.CompletedProcess[str]:
    """`ipvsproxy COMMAND SOURCE` as node-a, its NodePorts on the test address only."""
    args = agent_command(
        *source, command=command, min_sync_period=None, health=None, metrics=None,
        more=NODE_PORTS,
    )  # fmt: skip
    return subprocess.run(args, capture_output=True, text=True, check=False, timeout=300)


def table() -> str:
    return subprocess.run(["ipvsadm", "-Ln"], capture_output=True, text=True, check=True).stdout


def has(port_: int) -> bool:
    return f"TCP  {NODE_IP}:{port_} " in table()


def test_node_address_virtual_servers_go_with_their_service_across_restarts(
    node_address: None, tmp_path: Path
) -> None:
    manifest = tmp_path / "cluster.yaml"
    source = ("--manifests", str(manifest))
    subprocess.run(["ipvsadm", "-A", "-t", f"{NODE_IP}:2223", "-s", "rr"], check=True)
    manifest.write_text(yaml.safe_dump_all(objects(with_services=True)))
    done = agent("run", "--once", *source)
    assert done.returncode == 0, done.stderr
    assert has(2222)
    assert has(22)
    record = subprocess.run(  # auto: the firewall, and so the record, in nftables
        ["nft", "list", "set", "inet", "ipvsproxy", "created"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert f"{NODE_IP} . tcp . 2222" in record
    assert f"{NODE_IP} . tcp . 2223" not in record  # the administrator's: never recorded

    manifest.write_text(yaml.safe_dump_all(objects(with_services=False)))  # both deleted
    diff = agent("diff", *source)
    assert diff.returncode == 1, diff.stdout + diff.stderr
    assert f"-D -t {NODE_IP}:2222" in diff.stdout
    assert f"-D -t {NODE_IP}:22 " in diff.stdout
    assert "2223" not in diff.stdout

    done = agent("run", "--once", *source)
    assert done.returncode == 0, done.stderr
    assert not has(2222)
    assert not has(22)
    assert has(2223)
    assert agent("diff", *source).returncode == 0


def test_cleanup_removes_recorded_node_address_virtual_servers_and_nothing_foreign(
    node_address: None, tmp_path: Path
) -> None:
    manifest = tmp_path / "cluster.yaml"
    subprocess.run(["ipvsadm", "-A", "-t", f"{NODE_IP}:2223", "-s", "rr"], check=True)
    manifest.write_text(yaml.safe_dump_all(objects(with_services=True)))
    done = agent("run", "--once", "--manifests", str(manifest))
    assert done.returncode == 0, done.stderr
    done = ipvsproxy("cleanup")
    assert done.returncode == 0, done.stdout + done.stderr
    assert not has(2222)
    assert not has(22)
    assert has(2223)
