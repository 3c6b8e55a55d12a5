"""Node checks written with pytest-testinfra: one suite, two places.

- In CI, inside the IPVS VM (the default, `--hosts` not given): the local backend, the real
  `ipvsproxy run --manifests examples/` started by the fixture below, the example's pods as
  network namespaces.
- Against the Vagrant cluster over SSH, from the machine that ran `vagrant up`:

      vagrant ssh-config > .vagrant/ssh-config
      python -m pytest integration/test_node.py --cluster --sudo \\
          --ssh-config=.vagrant/ssh-config --hosts=cp,worker1,worker2

  There every node's own API view (kubectl with the kubelet's credentials) says what to
  expect, and the `kubernetes` Service's ClusterIP must reach the API server.

Checks: the dummy device holds exactly the Services' VIPs; `ipvsadm-save -n` has their
virtual servers with the right scheduler and only masquerading real servers; the sysctls
ipvsproxy needs are set; the agent is running and healthy; a request to a VIP is answered.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from integration.host import clean_ipvs, require
from integration.lab import Lab, agent_command
from integration.services import EXAMPLE_NODE_ADDRESS, EXAMPLE_PODS
from ipvsproxy.schedulers import Scheduler

pytestmark = [pytest.mark.vm, pytest.mark.node]
ROOT = Path(__file__).resolve().parent.parent
SCHEDULER_ANNOTATION = "ipvsproxy.io/scheduler"
HEALTHZ = "http://127.0.0.1:10256/healthz"


@dataclass(frozen=True)
class Expect:
    services: list[dict[str, Any]]  # Service objects as the API returns them
    probe: str  # a shell command that prints what answered through a VIP
    answer: str  # a substring of a good answer
    is_running: str  # "pod" (the DaemonSet's container, on the cluster) or "process" (here)


def vips(services: list[dict[str, Any]]) -> set[str]:
    """Every ClusterIP, externalIP and LoadBalancer ingress IP (read from the Service spec
    directly, not by ipvsproxy's translation)."""
    found: set[str] = set()
    for svc in services:
        spec = svc.get("spec", {})
        if spec.get("type") == "ExternalName" or spec.get("clusterIP") in (None, "None"):
            continue
        found.update(spec.get("clusterIPs") or [spec["clusterIP"]])
        found.update(spec.get("externalIPs", []))
        ingress = svc.get("status", {}).get("loadBalancer", {}).get("ingress", [])
        # ipMode Proxy: the load balancer proxies; the node does not take the address
        found.update(i["ip"] for i in ingress if "ip" in i and i.get("ipMode") != "Proxy")
    return found


def virtual_servers(services: list[dict[str, Any]]) -> set[str]:
    """`-A -t 10.96.0.10:80 -s rr` prefixes as ipvsadm-save prints them, per ClusterIP."""
    flag = {"TCP": "-t", "UDP": "-u", "SCTP": "--sctp-service"}
    out = set()
    for svc in services:
        spec = svc.get("spec", {})
        if spec.get("type") == "ExternalName" or spec.get("clusterIP") in (None, "None"):
            continue
        scheduler = svc["metadata"].get("annotations", {}).get(SCHEDULER_ANNOTATION, "rr")
        if scheduler not in {s.value for s in Scheduler}:
            scheduler = "rr"  # an unknown name: the node-wide default
        for ip in spec.get("clusterIPs") or [spec["clusterIP"]]:
            host = f"[{ip}]" if ":" in ip else ip
            for port in spec.get("ports", []):
                proto = flag[port.get("protocol", "TCP")]
                out.add(f"-A {proto} {host}:{port['port']} -s {scheduler}")
    return out


@pytest.fixture(scope="module")
def expect(request: pytest.FixtureRequest) -> Iterator[Expect]:
    if request.config.getoption("--cluster"):
        yield Expect([], "", "", "pod")  # per host, see `services()`
        return
    yield from _local_agent()


def _local_agent() -> Iterator[Expect]:
    """The bundled example on this machine: pods as namespaces, the agent as an operator
    starts it."""
    require()
    clean_ipvs()
    lab = Lab()
    agent = None
    try:
        for address, ports in EXAMPLE_PODS.items():
            lab.add_backend(address, ports)
        client = lab.add_client()
        subprocess.run(
            ["ip", "addr", "add", f"{EXAMPLE_NODE_ADDRESS}/32", "dev", "vc1"], check=True
        )
        agent = subprocess.Popen(
            agent_command("--manifests", str(ROOT / "examples"), min_sync_period=None,
                          health=10256, metrics=10249),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        services = [
            o for o in yaml.safe_load_all((ROOT / "examples/cluster.yaml").read_text())
            if o and o.get("kind") == "Service"
        ]  # fmt: skip
        probe = (
            f'ip netns exec {client} {sys.executable} -c "import socket; '
            "s = socket.create_connection(('10.96.0.10', 80), timeout=10); "
            'print(s.recv(64).decode().strip())"'
        )
        deadline = time.monotonic() + 180
        while "-A -t 10.96.0.10:80" not in _save() and time.monotonic() < deadline:
            assert agent.poll() is None, "the agent exited"
            time.sleep(1)
        yield Expect(services, probe, "b", "process")
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait(timeout=60)
        lab.close()
        clean_ipvs()


def _save() -> str:
    return subprocess.run(["ipvsadm-save", "-n"], capture_output=True, text=True).stdout


def services(host: Any, expect: Expect) -> list[dict[str, Any]]:
    if expect.services:
        return expect.services
    out = host.check_output(
        "kubectl --kubeconfig /etc/kubernetes/kubelet.conf get services -A -o json"
    )
    items: list[dict[str, Any]] = json.loads(out)["items"]
    return items


def test_the_dummy_device_holds_exactly_the_service_vips(host, expect):
    addresses = json.loads(host.check_output("ip -j address show dev kube-ipvs0"))
    bound = {a["local"] for link in addresses for a in link.get("addr_info", [])}
    assert bound == vips(services(host, expect))


def test_ipvsadm_shows_the_virtual_servers_with_scheduler_and_masquerading(host, expect):
    saved = host.check_output("ipvsadm-save -n")
    lines = saved.splitlines()
    for prefix in virtual_servers(services(host, expect)):
        assert any(line.startswith(prefix) for line in lines), prefix
    real = [line for line in lines if line.startswith("-a ")]
    assert real
    assert all(" -m " in line for line in real)  # NAT: the target port may differ


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("net.ipv4.ip_forward", 1),
        ("net.ipv4.vs.conntrack", 1),
        ("net.ipv4.vs.expire_nodest_conn", 1),
        ("net.ipv4.vs.expire_quiescent_template", 1),
    ],
)
def test_the_sysctls_ipvsproxy_needs_are_set(host, name, value):
    assert host.sysctl(name) == value


def test_ipvsproxy_is_running_and_healthy(host, expect):
    # the DaemonSet's container or the local agent: either way a process of the node's
    assert [p for p in host.process.filter(user="root") if "ipvsproxy" in p.args]
    body = host.check_output(
        f"{sys.executable if expect.is_running == 'process' else 'python3'} -c "
        f"\"import urllib.request; print(urllib.request.urlopen('{HEALTHZ}').read().decode())\""
    )
    health = json.loads(body)
    assert health["healthy"] is True
    assert health["backend"] == "ipvs"


def test_a_request_to_a_service_vip_gets_an_answer_from_a_backend(host, expect):
    if expect.probe:
        assert host.check_output(expect.probe).startswith(expect.answer)
        return
    # on a cluster node: the `kubernetes` Service's ClusterIP reaches an API server
    cluster_ip = next(
        s["spec"]["clusterIP"]
        for s in services(host, expect)
        if s["metadata"]["name"] == "kubernetes" and s["metadata"]["namespace"] == "default"
    )
    answer = host.check_output(
        f'python3 -c "import ssl, socket; c = ssl.create_default_context(); '
        f"c.check_hostname = False; c.verify_mode = ssl.CERT_NONE; "
        f"s = c.wrap_socket(socket.create_connection(('{cluster_ip}', 443), timeout=10)); "
        f'print(s.version())"'
    )
    assert answer.startswith("TLS")
