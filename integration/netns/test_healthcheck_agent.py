"""The agent's health servers on this host's kernel, in a throw-away "node" namespace, fed by
the test API server (the real list/watch protocol over HTTPS) as on a cluster: a
LoadBalancer Service with externalTrafficPolicy Local gets its health-check node port on
the node's address (200 with the local endpoint count, 503 without, closed when the Service
goes), and /healthz answers 503 once the Node is tainted for deletion while /livez stays
200. Real sockets and HTTP requests inside the namespace."""

from __future__ import annotations

import json
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from integration.lab import agent_command, inside
from tests.factories import ep, node, port, service, slice_
from tests.kubeapi import ApiServer
from tests.support import eventually

pytestmark = pytest.mark.netns
NODE_IP = "10.250.3.1"
HC_PORT = 31999


def get(ns: str, host: str, port_: int, path: str = "/") -> tuple[int, dict[str, str], Any]:
    """(status, headers, JSON body) of a GET inside the namespace; status 0: refused."""
    with inside(ns):
        try:
            sock = socket.create_connection((host, port_), timeout=5)
        except ConnectionRefusedError:
            return 0, {}, None
    data = b""
    with sock:
        try:
            sock.sendall(f"GET {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:  # accepted by a server closing at that moment
            return -1, {}, None
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def lb(endpoint_node: str) -> list[dict[str, Any]]:
    svc = service(
        "shop", type="LoadBalancer", ports=[port("http", 80, node_port=30080)],
        externalTrafficPolicy="Local", healthCheckNodePort=HC_PORT,
    )  # fmt: skip
    endpoints = slice_("shop", endpoints=[ep("10.244.0.5", node=endpoint_node)])
    return [svc, endpoints]


def test_health_check_node_ports_and_node_eligibility(netns: str, tmp_path: Path) -> None:
    subprocess.run(["ip", "-n", netns, "link", "set", "lo", "up"], check=True)
    subprocess.run(["ip", "-n", netns, "link", "add", "node0", "type", "veth", "peer", "name",
                    "node0p"], check=True)  # fmt: skip
    subprocess.run(["ip", "-n", netns, "addr", "add", f"{NODE_IP}/24", "dev", "node0"], check=True)
    subprocess.run(["ip", "-n", netns, "link", "set", "node0", "up"], check=True)
    with inside(netns):
        api = ApiServer(bookmark_interval=1.0).start()
    proc = None
    try:
        for obj in [node("node-a", (NODE_IP,)), *lb("node-a")]:
            api.put(obj)
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        with (tmp_path / "agent.log").open("wb") as log:
            proc = subprocess.Popen(
                agent_command("--kubeconfig", str(kubeconfig), netns=netns, service_cidr=None,
                              backend="iptables", min_sync_period="100ms", health=10256,
                              metrics=10249),
                stdout=log, stderr=log,
            )  # fmt: skip

        def answers(status: int) -> Callable[[], bool]:
            def check() -> bool:
                assert proc is not None
                assert proc.poll() is None, (tmp_path / "agent.log").read_text()
                return get(netns, NODE_IP, HC_PORT)[0] == status

            return check

        eventually(answers(200), 30, "the health-check node port answers 200", interval=0.2)
        _, headers, body = get(netns, NODE_IP, HC_PORT, "/healthz")
        assert headers["X-Load-Balancing-Endpoint-Weight"] == "1"
        assert body == {"service": {"namespace": "default", "name": "shop"},
                        "localEndpoints": 1, "serviceProxyHealthy": True}  # fmt: skip

        api.put(lb("node-b")[1])  # the only endpoint moves to another node
        eventually(answers(503), 30, "no local endpoint: 503", interval=0.2)
        assert get(netns, NODE_IP, HC_PORT)[1]["X-Load-Balancing-Endpoint-Weight"] == "0"

        api.delete("Service", "default", "shop")
        eventually(answers(0), 30, "the port closes with its Service", interval=0.2)

        assert get(netns, "127.0.0.1", 10256, "/healthz")[0] == 200
        tainted = node("node-a", (NODE_IP,))
        tainted["spec"] = {"taints": [{"key": "ToBeDeletedByClusterAutoscaler",
                                       "effect": "NoSchedule"}]}  # fmt: skip
        api.put(tainted)
        eventually(lambda: get(netns, "127.0.0.1", 10256, "/healthz")[0] == 503, 30,
                   "a Node tainted for deletion: /healthz 503", interval=0.2)  # fmt: skip
        status, _, body = get(netns, "127.0.0.1", 10256, "/healthz")
        assert body["nodeEligible"] is False
        assert get(netns, "127.0.0.1", 10256, "/livez")[0] == 200
        metrics = subprocess.run(
            ["ip", "netns", "exec", netns, "curl", "-s", "http://127.0.0.1:10249/metrics"],
            capture_output=True, text=True,
        ).stdout  # fmt: skip
        assert 'kubeproxy_proxy_healthz_total{code="503"}' in metrics
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        api.stop()
