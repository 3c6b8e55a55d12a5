"""The agent's /status in a throw-away "node" namespace (the iptables fallback: this kernel
has no IPVS): `ipvsproxy status` finds the agent at its metrics address and reads a valid
document (no counters in the fallback: null); /status is bound where /metrics is (127.0.0.1
by default, not the node's address) and answered while 200 clients trickle their requests
into the same port (the HTTP server's bounds)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import yaml

from integration.lab import IPVSPROXY, agent_command, inside
from tests.factories import ep, node, port, service, slice_
from tests.status.scene import SCHEMA
from tests.support import eventually
from tests.test_serve import Tricklers, answered, probe

pytestmark = pytest.mark.netns
NODE_IP = "10.250.5.1"
METRICS = 10249


@pytest.fixture
def agent(netns: str, tmp_path: Path) -> Iterator[str]:
    """The agent serving a NodePort Service with externalTrafficPolicy Local, one endpoint
    here and one on another node; the namespace's name."""
    for args in (["link", "set", "lo", "up"],
                 ["link", "add", "node0", "type", "veth", "peer", "name", "node0p"],
                 ["addr", "add", f"{NODE_IP}/24", "dev", "node0"],
                 ["link", "set", "node0", "up"]):  # fmt: skip
        subprocess.run(["ip", "-n", netns, *args], check=True)
    objects = [
        node(addresses=(NODE_IP,)),
        service(
            "web",
            type="NodePort",
            ports=[port("http", 80, node_port=30080)],
            externalTrafficPolicy="Local",
        ),  # fmt: skip
        slice_("web", endpoints=[ep("10.244.0.5"), ep("10.244.9.9", node="node-b")]),
    ]
    manifest = tmp_path / "cluster.yaml"
    manifest.write_text(yaml.safe_dump_all(objects))
    log = (tmp_path / "agent.log").open("wb")
    proc = subprocess.Popen(
        agent_command("--manifests", str(manifest), netns=netns, service_cidr=None,
                      backend="iptables", min_sync_period=None, health=10256, metrics=None),
        stdout=log, stderr=log,
    )  # fmt: skip
    try:

        def up() -> bool:
            assert proc.poll() is None, (tmp_path / "agent.log").read_text()
            with inside(netns):
                return probe(METRICS, "/status") < 2

        eventually(up, 60, "the agent serves /status", interval=0.2)
        yield netns
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def status(netns: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", netns, IPVSPROXY, "status", *args],
        capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "120"},
    )  # fmt: skip


def test_the_cli_reads_the_agents_status(agent):
    done = status(agent, "-o", "json", "default/web")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    jsonschema.validate(doc, SCHEMA)
    assert (doc["source"], doc["backend"]) == ("agent", "iptables")
    assert doc["lastFullPass"] is not None
    (web,) = doc["services"]
    there = next(e for e in web["endpoints"] if e["address"] == "10.244.9.9")
    assert [r["reason"] for r in there["notProgrammed"]] == ["OtherNode"]
    assert all(e["traffic"] is None for e in web["endpoints"])  # the fallback has no counters
    table = status(agent, "default/web")
    assert table.returncode == 0, table.stderr
    assert "OtherNode (external)" in table.stdout


def test_status_is_bound_where_metrics_is_and_answered_beside_slow_clients(agent):
    with inside(agent):
        with pytest.raises(ConnectionRefusedError):  # 127.0.0.1 only, as kube-proxy's metrics
            socket.create_connection((NODE_IP, METRICS), timeout=2).close()
        with Tricklers(METRICS, 200):
            time.sleep(0.5)
            assert all(answered(METRICS, "/status") for _ in range(5))
