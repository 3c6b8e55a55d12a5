"""The agent on this host's kernel (no IPVS), as an operator runs it, inside a "node"
namespace: auto mode falls back to iptables loudly and serves traffic; --no-fallback exits 4
having changed nothing; cleanup removes ipvsproxy's rules and nothing else."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from integration.lab import IPVSPROXY, PORT, Lab, agent_command, built, inside, request
from tests.factories import ep, node, port, service, slice_
from tests.support import eventually, free_port

pytestmark = pytest.mark.netns
NODE = "ipvsp-fb"
NODE_IP = "10.250.1.1"
VIP = "10.96.0.20"
FOREIGN = "-A POSTROUTING -s 192.0.2.0/24 -j MASQUERADE"


def in_node(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", NODE, *args], capture_output=True, text=True, check=check
    )


def nat() -> str:
    text = in_node("iptables-save", "-t", "nat").stdout
    return "\n".join(line for line in text.splitlines() if not line.startswith("#"))


def objects(lab: Lab, backends: int) -> list[dict[str, Any]]:
    return [
        node(addresses=(NODE_IP,)),
        service(
            "web", cluster_ips=(VIP,), ports=[port("http", 80, "TCP", PORT, 30090)], type="NodePort"
        ),  # fmt: skip
        slice_(
            "web",
            ports=(("http", PORT, "TCP"),),
            endpoints=[ep(b.address) for b in lab.backends[:backends]],
        ),  # fmt: skip
    ]


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with built(2, node=NODE) as lab:
        subprocess.run(
            ["ip", "netns", "exec", NODE, "iptables-restore", "--noflush"],
            input=f"*nat\n{FOREIGN}\nCOMMIT\n", text=True, check=True,
        )  # fmt: skip
        yield lab


def free_port_in_node() -> int:
    with inside(NODE):
        return free_port()


def http(port_: int, path: str) -> bytes:
    with inside(NODE):
        sock = socket.create_connection(("127.0.0.1", port_), timeout=5)
    with sock:
        sock.sendall(f"GET {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data.partition(b"\r\n\r\n")[2]


def test_auto_falls_back_loudly_serves_traffic_and_follows_changes(lab, tmp_path):
    manifest = tmp_path / "cluster.yaml"
    manifest.write_text(yaml.safe_dump_all(objects(lab, 2)))
    metrics, health = free_port_in_node(), free_port_in_node()
    log = tmp_path / "agent.log"
    args = agent_command(
        "--manifests", str(manifest), netns=NODE, service_cidr=None, min_sync_period="100ms",
        health=health, metrics=metrics, more=("--log-format", "json"),
    )  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=out)
    try:

        def serving() -> bool:
            assert proc.poll() is None, log.read_text()
            synced = any(
                json.loads(line)["msg"].startswith("sync:") for line in log.read_text().splitlines()
            )
            try:
                return synced and bool(json.loads(http(health, "/healthz")).get("healthy"))
            except OSError:
                return False

        eventually(serving, 60, "the agent synced and serves /healthz", interval=0.2)
        warnings = [json.loads(line) for line in log.read_text().splitlines()]
        fallback = [w for w in warnings if "FALLING BACK" in w["msg"]]
        assert fallback
        assert fallback[0]["level"] == "warning"
        assert "IPVS" in fallback[0]["msg"]
        body = json.loads(http(health, "/healthz"))
        assert body["backend"] == "iptables"
        assert body["fallback"] is True
        assert "IPVS is not usable" in body["backendReason"]
        exposed = http(metrics, "/metrics").decode()
        assert 'ipvsproxy_backend{backend="iptables"} 1.0' in exposed
        assert 'ipvsproxy_backend{backend="ipvs"} 0.0' in exposed

        got = Counter(request(lab.clients[0], VIP, 80) for _ in range(4))
        assert got == {"b1": 2, "b2": 2}
        assert Counter(request(lab.clients[0], NODE_IP, 30090) for _ in range(4)) == got

        manifest.write_text(yaml.safe_dump_all(objects(lab, 1)))  # b2 leaves the Service
        eventually(
            lambda: {request(lab.clients[0], VIP, 80) for _ in range(4)} == {"b1"},
            30,
            "b2 gets no new connections",
            interval=0.2,
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "IPVSPX-SERVICES" in nat()  # rules stay across a restart
    assert FOREIGN in nat()


def test_no_fallback_exits_4_and_changes_nothing(lab, tmp_path):
    manifest = tmp_path / "cluster.yaml"
    manifest.write_text(yaml.safe_dump_all(objects(lab, 2)))
    before = nat()
    done = in_node(
        IPVSPROXY, "run", "--once", "--manifests", str(manifest), "--no-fallback", check=False
    )
    assert done.returncode == 4, done.stderr
    assert "--no-fallback forbids the iptables fallback" in done.stderr
    assert "Traceback" not in done.stderr
    assert nat() == before


def test_diff_on_the_fallback_backend_then_cleanup(lab, tmp_path):
    manifest = tmp_path / "cluster.yaml"
    manifest.write_text(yaml.safe_dump_all(objects(lab, 2)))
    in_node(IPVSPROXY, "run", "--once", "--manifests", str(manifest), "--backend", "iptables")
    in_node("iptables", "-t", "nat", "-A", "IPVSPX-SERVICES", "-s", "198.51.100.7", "-j", "RETURN")
    diff = in_node(IPVSPROXY, "diff", "--manifests", str(manifest), check=False)
    assert diff.returncode == 1, diff.stdout + diff.stderr  # no operation, but a repair
    assert "! repair: IPv4: chain IPVSPX-SERVICES differs" in diff.stdout
    assert "In sync: no changes." in diff.stdout
    assert in_node(IPVSPROXY, "run", "--once", "--manifests", str(manifest)).returncode == 0
    assert "198.51.100.7" not in nat()

    dry = in_node(IPVSPROXY, "cleanup", "--dry-run").stdout
    assert "would remove: IPv4 nat: chain IPVSPX-SERVICES" in dry
    assert "IPVSPX-SERVICES" in nat()
    done = in_node(IPVSPROXY, "cleanup").stdout
    assert "removed: IPv4 nat: chain IPVSPX-SERVICES" in done
    after = nat()
    assert "IPVSPX" not in after
    assert FOREIGN in after
    assert "nothing of ipvsproxy's found" in in_node(IPVSPROXY, "cleanup").stdout


def test_a_one_shot_run_ends_its_process_with_its_output_and_status(lab, tmp_path):
    """`run --once` as a process of its own: what it printed and logged reaches the pipes,
    buffered or not, and the exit status is the run's."""
    manifest = tmp_path / "cluster.yaml"
    manifest.write_text(yaml.safe_dump_all(objects(lab, 2)))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # pipes buffered
    done = subprocess.run(
        ["ip", "netns", "exec", NODE, IPVSPROXY, "run", "--once", "--manifests", str(manifest)]
        + ["--backend", "iptables"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("applied "), done.stdout
    assert done.stdout.endswith(" operations\n"), done.stdout
    assert "sync done:" in done.stderr  # the log line, flushed before the end
