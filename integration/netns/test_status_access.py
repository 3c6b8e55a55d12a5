"""Who may read the agent's plain metrics port: with the shipped DaemonSet's addresses
(127.0.0.1:10249, kube-proxy's default; scrapers use the secure port) another host cannot
connect at all. Bound to every address (`--metrics-bind-address=0.0.0.0:10249`, as before
issue 46), another host reaches /metrics but gets 403 for /status (every Service, endpoint,
pod and node of the cluster: what RBAC would refuse an anonymous client), while `ipvsproxy
status` on the node (the pod's own loopback) reads it; `--status-remote` opens it to other
hosts. Two throw-away namespaces joined by a veth pair: the node (the agent, the iptables
fallback) and another host."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from integration.lab import IPVSPROXY, agent_command, inside
from tests.factories import ep, node, service, slice_
from tests.support import eventually
from tests.test_deploy import pod_spec

pytestmark = pytest.mark.netns
NODE_IP, OTHER_IP = "10.250.6.1", "10.250.6.2"


def shipped_addresses() -> list[str]:
    """The DaemonSet's own --metrics-bind-address and --healthz-bind-address flags."""
    (container,) = pod_spec("standalone")["containers"]
    return [a for a in container["args"] if a.startswith(("--metrics-bind", "--healthz-bind"))]


def link(node_ns: str, other: str) -> None:
    for ns, args in ((node_ns, ["link", "set", "lo", "up"]),
                     (node_ns, ["link", "add", "node0", "type", "veth", "peer", "name", "out0",
                                "netns", other]),
                     (node_ns, ["addr", "add", f"{NODE_IP}/24", "dev", "node0"]),
                     (node_ns, ["link", "set", "node0", "up"]),
                     (other, ["addr", "add", f"{OTHER_IP}/24", "dev", "out0"]),
                     (other, ["link", "set", "out0", "up"])):  # fmt: skip
        subprocess.run(["ip", "-n", ns, *args], check=True)


def get(ns: str, address: str, path: str) -> bytes:
    with inside(ns), socket.create_connection((address, 10249), timeout=5) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\n\r\n".encode())
        return sock.makefile("rb").read()


@pytest.mark.parametrize(
    ("wildcard", "remote"),
    [(False, False), (True, False), (True, True)],
    ids=["shipped", "wildcard", "wildcard-status-remote"],
)
def test_status_answers_the_node_only_unless_opened(
    netns, other_netns, tmp_path: Path, wildcard, remote
):
    other_host = other_netns
    link(netns, other_host)
    flags = shipped_addresses()
    assert "--metrics-bind-address=127.0.0.1:10249" in flags
    if wildcard:
        flags = [f for f in flags if not f.startswith("--metrics-bind")]
        flags.append("--metrics-bind-address=0.0.0.0:10249")
    manifest = tmp_path / "cluster.yaml"
    manifest.write_text(yaml.safe_dump_all([
        node(addresses=(NODE_IP,)), service("web"), slice_("web", endpoints=[ep("10.244.0.5")]),
    ]))  # fmt: skip
    log_path = tmp_path / "agent.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            agent_command("--manifests", str(manifest), netns=netns, service_cidr=None,
                          backend="iptables", min_sync_period=None, health=None, metrics=None,
                          more=[*flags, *(["--status-remote"] if remote else [])]),
            stdout=log, stderr=log,
        )  # fmt: skip
    try:

        def up() -> bool:
            assert proc.poll() is None, log_path.read_text()
            try:
                return get(netns, "127.0.0.1", "/status").startswith(b"HTTP/1.1 200")
            except OSError:
                return False

        eventually(up, 60, "the agent serves /status on the node", interval=0.2)
        if not wildcard:  # the shipped address: nothing listens on the node's own address
            with pytest.raises(ConnectionRefusedError):
                get(other_host, NODE_IP, "/metrics")
            return
        assert get(other_host, NODE_IP, "/metrics").startswith(b"HTTP/1.1 200")
        answer = get(other_host, NODE_IP, "/status")
        if remote:
            assert answer.startswith(b"HTTP/1.1 200")
            assert b"default" in answer
        else:
            assert answer.startswith(b"HTTP/1.1 403"), answer[:200]
            assert b"web" not in answer
            assert b"10.244.0.5" not in answer
        # the node itself (`kubectl exec ... ipvsproxy status` in the pod)
        done = subprocess.run(
            ["ip", "netns", "exec", netns, IPVSPROXY, "status", "default/web"],
            capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "120"},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "10.244.0.5" in done.stdout
    finally:
        proc.terminate()
        proc.wait(timeout=30)
