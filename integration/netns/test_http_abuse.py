"""The agent's HTTP ports under abuse, in a throw-away "node" namespace: with 1,000 clients
trickling their requests (2 bytes/s, reconnecting when cut off) into the health port and a
health-check node port, and then 10,000 connections opened at once, /healthz, /livez,
/metrics and the node port go on answering; the agent keeps one HTTP thread and its
descriptors stay under its cap. The latency under that load is bench/http_abuse.py's."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from integration.lab import agent_command, inside
from tests.factories import ep, port, service, slice_
from tests.support import eventually
from tests.test_serve import PROBE_DEADLINE, Tricklers, p99, probe

pytestmark = pytest.mark.netns
NODE_IP = "10.250.4.1"
HC_PORT = 31998
HEALTHZ, METRICS = 10256, 10249
TARGETS = [(HEALTHZ, "/healthz"), (HC_PORT, "/"), (HEALTHZ, "/livez"), (METRICS, "/metrics")]


@pytest.fixture
def agent(netns: str, tmp_path: Path) -> Iterator[int]:
    """The agent serving one LoadBalancer Service with a local endpoint; its pid."""
    for args in (["link", "set", "lo", "up"],
                 ["link", "add", "node0", "type", "veth", "peer", "name", "node0p"],
                 ["addr", "add", f"{NODE_IP}/24", "dev", "node0"],
                 ["link", "set", "node0", "up"]):  # fmt: skip
        subprocess.run(["ip", "-n", netns, *args], check=True)
    svc = service(
        "shop", type="LoadBalancer", ports=[port("http", 80, node_port=30080)],
        externalTrafficPolicy="Local", healthCheckNodePort=HC_PORT,
    )  # fmt: skip
    manifest = tmp_path / "cluster.yaml"
    manifest.write_text(
        yaml.safe_dump_all([svc, slice_("shop", endpoints=[ep("10.244.0.5", node="node-a")])])
    )
    log = (tmp_path / "agent.log").open("wb")
    proc = subprocess.Popen(
        agent_command("--manifests", str(manifest), netns=netns, service_cidr=None,
                      backend="iptables", min_sync_period=None, health=HEALTHZ, metrics=METRICS),
        stdout=log, stderr=log,
    )  # fmt: skip
    try:

        def up() -> bool:
            assert proc.poll() is None, (tmp_path / "agent.log").read_text()
            with inside(netns):
                return all(probe(p, path) < 2 for p, path in TARGETS)

        eventually(up, 60, "the agent serves every port", interval=0.2)
        yield proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def latencies(netns: str, count: int) -> list[float]:
    with inside(netns):
        out = []
        for i in range(count):
            out.append(probe(*TARGETS[i % len(TARGETS)], timeout=PROBE_DEADLINE))
            time.sleep(0.005)
        return out


def test_every_port_answers_under_slow_clients_and_a_burst(netns, agent):
    """1,000 slow clients, then 10,000 connections at once beside them: every port goes on
    answering (at least 99 % of the probes within PROBE_DEADLINE: the cap on connections
    closes the oldest, which may rarely be a probe), with no thread per client and the
    descriptors under the cap. The latencies are printed; their figures are a benchmark
    (bench/http_abuse.py, docs/performance.md), not asserted here."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    held: list[socket.socket] = []
    try:
        with inside(netns), Tricklers(HEALTHZ, 500), Tricklers(HC_PORT, 500):
            time.sleep(1)
            slow = latencies(netns, 400)
            threads = len(os.listdir(f"/proc/{agent}/task"))

            def burst() -> None:
                for _ in range(10_000):
                    sock = socket.socket()
                    sock.setblocking(False)
                    sock.connect_ex(("127.0.0.1", HEALTHZ))
                    held.append(sock)

            opener = threading.Thread(target=burst)
            opener.start()  # in the namespace: a thread starts in its creator's
            during = latencies(netns, 400)
            opener.join()
            descriptors = len(os.listdir(f"/proc/{agent}/fd"))
            assert threads == len(os.listdir(f"/proc/{agent}/task"))  # none per client
    finally:
        for sock in held:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    print(f"p99 {p99(slow) * 1000:.1f} ms with 1,000 slow clients, "
          f"{p99(during) * 1000:.1f} ms with 10,000 more connections at once")  # fmt: skip
    for probes in (slow, during):
        assert sum(took < PROBE_DEADLINE for took in probes) >= 0.99 * len(probes)
    assert descriptors < 2048 + 100  # the cap (serve.MAX_CONNECTIONS) and the agent's own
