"""Dataplane parity in the real kernel, with real traffic, through the
real console script (`run --once --manifests`) with its firewall rules (nftables, on a PATH
without the iptables tools, ipset or ipvsadm):

- an externalIP that is one of the node's own addresses is served, but not bound to the dummy
  device and not fenced: the node's other ports (SSH, the kubelet) stay reachable on it;
- externalTrafficPolicy: Local with no endpoint on this node uses the cluster's endpoints, so
  a client still reaches the Service (kube-proxy PR 97081), and the virtual server is not
  left empty."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from integration.host import clean_ipvs
from integration.lab import IPTABLES_TOOLS, PORT, Lab, agent_command, connect, path_without, request
from tests.factories import ep, node, port, service, slice_

pytestmark = pytest.mark.vm

NODE_IP = "10.250.1.1"  # the node's address on the first client's link (lab.py)
EXTERNAL = "203.0.113.50"


def _listener() -> tuple[socket.socket, threading.Thread]:
    """A server of the node itself on NODE_IP:2222 (stands for SSH): answers 'node'."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((NODE_IP, 2222))
    sock.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            conn.sendall(b"node\n")
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return sock, thread


def test_node_address_external_ip_and_local_policy_without_local_endpoints(tmp_path: Path):
    clean_ipvs()
    lab = Lab()
    listener = None
    try:
        backend = lab.add_backend()
        client = lab.add_client()
        listener, _ = _listener()
        ports = (("http", PORT, "TCP"),)
        on_node = service(
            "on-node", cluster_ips=("10.96.9.1",), ports=[port("http", 80, target=PORT)],
            externalIPs=[NODE_IP],
        )  # fmt: skip
        local = service(
            "local", cluster_ips=("10.96.9.2",), ports=[port("http", 80, target=PORT)],
            externalIPs=[EXTERNAL], externalTrafficPolicy="Local",
        )  # fmt: skip
        objects = [
            node("node-a", [NODE_IP]),
            on_node,
            slice_("on-node", ports=ports, endpoints=[ep(backend.address, node="node-a")]),
            local,  # its only endpoint is on another node
            slice_("local", ports=ports, endpoints=[ep(backend.address, node="node-b")]),
        ]
        manifests = tmp_path / "m"
        manifests.mkdir()
        (manifests / "all.json").write_text(json.dumps({"kind": "List", "items": objects}))
        no_iptables = path_without(prefixes=IPTABLES_TOOLS)  # nftables firewall
        ran = subprocess.run(
            agent_command("--once", "--manifests", str(manifests), min_sync_period=None,
                          health=None, metrics=None),
            capture_output=True, text=True, check=False, env={**os.environ, "PATH": no_iptables},
        )  # fmt: skip
        assert ran.returncode == 0, ran.stderr[-3000:]
        # item 2: served on the node's address, not bound, the node's own port reachable
        assert request(client, NODE_IP, 80) == backend.name
        dummy = subprocess.run(
            ["ip", "-o", "addr", "show", "dev", "kube-ipvs0"], capture_output=True, text=True
        ).stdout
        assert "10.96.9.1" in dummy
        assert NODE_IP not in dummy
        name, sock = connect(client, NODE_IP, 2222)
        sock.close()
        assert name == "node"  # not rejected by the VIP port filter
        # item 5: Local with no local endpoint falls back to the cluster's endpoints
        assert request(client, EXTERNAL, 80) == backend.name
    finally:
        if listener is not None:
            listener.close()
        lab.close()
        clean_ipvs()
