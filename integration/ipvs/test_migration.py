"""The migration of docs/migration.md on one node, on the real kernel, with traffic: the node is
laid out as kube-proxy v1.36's IPVS mode leaves it (integration/kube_proxy_layout.py); long-lived
TCP connections through a ClusterIP and a NodePort exchange data every 100 ms and new
connections open all along, while ipvsproxy starts and adopts the IPVS table in place and
`ipvsproxy cleanup --kube-proxy` removes kube-proxy's chains and sets; then the way back:
ipvsproxy stops (its rules stay), kube-proxy's sync lays its chains and sets out again over the
same table, and `ipvsproxy cleanup --keep-ipvs` removes ipvsproxy's. No connection is reset or
stalls, every new connection succeeds. Run by scripts/vm-test inside the IPVS VM.
"""

from __future__ import annotations

import re
import shlex
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from integration import kube_proxy_layout as kube_proxy
from integration.conftest import clean_ipvs
from integration.lab import IPVSPROXY, PORT, Lab, connect, request
from ipvsproxy.firewall.rules import PREFIX
from tests import support
from tests.factories import ep, node, port, service, slice_
from tests.kubeapi import ApiServer
from tests.support import free_port

pytestmark = pytest.mark.vm

DOC = Path(__file__).resolve().parents[2] / "docs" / "migration.md"
NODE_IP = "10.250.1.1"  # the node's address on the client's link (lab.py topology)
CLUSTER_CIDR = "10.244.0.0/16"
STALL = 1.0  # seconds without an answer on a held connection that count as a stall
PATHS = (("10.96.0.10", 80), (NODE_IP, 30080))  # a ClusterIP, a NodePort


def doc_commands() -> tuple[list[str], list[str]]:
    """The node's side of docs/migration.md, as written there: the `ipvsproxy cleanup` it runs
    on the node after the swap, and the one on the way back (its dry runs aside)."""
    found = re.findall(r"-- (ipvsproxy cleanup [^\n]*)", DOC.read_text())
    swap, back = (shlex.split(c) for c in found if "--dry-run" not in c)
    return [IPVSPROXY, *swap[1:]], [IPVSPROXY, *back[1:]]


def saved() -> str:
    return subprocess.run(["ipvsadm-save", "-n"], capture_output=True, text=True).stdout


def own_chains() -> list[str]:
    """ipvsproxy's chains and ipsets (the IPVS backend's firewall rules)."""
    text = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
    sets = subprocess.run(["ipset", "list", "-n"], capture_output=True, text=True).stdout
    return [line for line in (text + sets).splitlines() if line.lstrip(":").startswith(PREFIX)]


@dataclass
class Held:
    """A connection through a VIP that exchanges a line every 100 ms; what went wrong."""

    sock: socket.socket
    backend: str
    errors: list[str] = field(default_factory=list)
    longest: float = 0.0
    rounds: int = 0

    def run(self, stop: threading.Event) -> None:
        self.sock.settimeout(STALL * 3)
        last = time.monotonic()
        while not stop.is_set():
            try:
                self.sock.sendall(b"ping\n")
                data = b""
                while not data.endswith(b"ping\n"):
                    chunk = self.sock.recv(64)
                    if not chunk:
                        raise ConnectionResetError("closed by the peer")
                    data += chunk
            except OSError as exc:
                self.errors.append(f"{exc!r} after {self.rounds} rounds")
                return
            now = time.monotonic()
            self.longest, last = max(self.longest, now - last), now
            self.rounds += 1
            stop.wait(0.1)


@dataclass
class Opener:
    """New connections through each VIP, one every 250 ms; the failures."""

    client: str
    errors: list[str] = field(default_factory=list)
    opened: int = 0

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            for vip, number in PATHS:
                try:
                    request(self.client, vip, number, timeout=STALL * 3)
                    self.opened += 1
                except OSError as exc:
                    self.errors.append(f"{vip}:{number}: {exc!r}")
            stop.wait(0.25)


@pytest.fixture
def lab() -> Iterator[Lab]:
    clean_ipvs()
    made = Lab()
    try:
        yield made
    finally:
        made.close()
        subprocess.run([IPVSPROXY, "cleanup", "--kube-proxy", "--including-ipvs",
                        "--service-cidr", "10.96.0.0/16"], capture_output=True)  # fmt: skip
        clean_ipvs()


def test_kube_proxy_to_ipvsproxy_and_back_drops_no_connection(lab: Lab, tmp_path: Path) -> None:
    swap_cleanup, back_cleanup = doc_commands()
    assert swap_cleanup[2:] == ["--kube-proxy"]
    assert back_cleanup[2:] == ["--keep-ipvs"]
    b1, b2 = (lab.add_backend().address for _ in range(2))
    client = lab.add_client()
    layout = (
        kube_proxy.Port("10.96.0.10", 80, (f"{b1}:{PORT}", f"{b2}:{PORT}")),
        kube_proxy.Port("10.96.0.11", 80, (f"{b1}:{PORT}",), node_port=30080),
        # a Service deleted while the node changed hands: kube-proxy's NodePort set lists it
        kube_proxy.Port("10.96.0.12", 80, (f"{b1}:{PORT}",), node_port=30081),
    )
    kube_proxy.apply(layout, node_ip=NODE_IP, cluster_cidr=CLUSTER_CIDR)
    # an administrator's virtual server in the NodePort range, in no record: never claimed
    subprocess.run(["ipvsadm", "-A", "-t", f"{NODE_IP}:30082", "-s", "rr"], check=True)
    assert len(kube_proxy.chains()) == 11
    assert len(kube_proxy.sets()) == 17

    api = ApiServer().start()
    for obj in (
        node(addresses=(NODE_IP,)),
        service("web", cluster_ips=("10.96.0.10",), ports=[port("http", 80, "TCP", PORT)]),
        slice_("web", ports=(("http", PORT, "TCP"),), endpoints=[ep(b1), ep(b2)]),
        service("np", type="NodePort", cluster_ips=("10.96.0.11",),
                ports=[port("http", 80, "TCP", PORT, node_port=30080)]),
        slice_("np", ports=(("http", PORT, "TCP"),), endpoints=[ep(b1)]),
    ):  # fmt: skip
        api.put(obj)
    health = free_port()
    log = tmp_path / "agent.log"
    command = [
        IPVSPROXY, "run", "--kubeconfig", str(api.write_kubeconfig(tmp_path / "kubeconfig")),
        "--hostname-override", "node-a", "--service-cidr", "10.96.0.0/16",
        "--cluster-cidr", CLUSTER_CIDR, "--detect-local-mode", "ClusterCIDR",
        "--min-sync-period", "200ms", "--healthz-bind-address", f"127.0.0.1:{health}",
        "--metrics-bind-address", f"127.0.0.1:{free_port()}",
    ]  # fmt: skip

    held = []
    for vip, number in PATHS * 2:
        backend, sock = connect(client, vip, number)
        held.append(Held(sock, backend))
    opener = Opener(client)
    stop = threading.Event()
    threads = [threading.Thread(target=h.run, args=(stop,)) for h in held]
    threads.append(threading.Thread(target=opener.run, args=(stop,)))
    for thread in threads:
        thread.start()
    agent = None
    try:
        time.sleep(1)  # traffic under kube-proxy's rules
        # the swap: ipvsproxy adopts the table, then kube-proxy's chains and sets go
        with log.open("wb") as out:
            agent = subprocess.Popen(command, stdout=out, stderr=out)
        support.eventually(
            lambda: " sync: " in log.read_text() and own_chains(), 120,
            "ipvsproxy synced, its rules in place", interval=0.3,
            detail=lambda: saved() + log.read_text()[-3000:],
        )  # fmt: skip
        table = saved()
        assert f"-A -t {NODE_IP}:30081" not in table, "kube-proxy's stale NodePort is deleted"
        assert f"-A -t {NODE_IP}:30082" in table, "the foreign one in the range stays"
        assert f"-A -t {NODE_IP}:30080" in table
        time.sleep(1)
        cleaned = subprocess.run(swap_cleanup, capture_output=True, text=True)
        assert cleaned.returncode == 0, cleaned.stderr
        assert kube_proxy.chains() == set()
        assert kube_proxy.sets() == set()
        assert "-A -t 10.96.0.10:80" in saved(), "the IPVS table stays"
        time.sleep(2)  # traffic under ipvsproxy alone

        # the way back: ipvsproxy stops, kube-proxy syncs over the same table, ipvsproxy's go
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=60) == 0
        kube_proxy.apply(layout, node_ip=NODE_IP, cluster_cidr=CLUSTER_CIDR)
        time.sleep(1)
        back = subprocess.run(back_cleanup, capture_output=True, text=True)
        assert back.returncode == 0, back.stderr
        assert own_chains() == []
        assert len(kube_proxy.chains()) == 11
        assert "-A -t 10.96.0.10:80" in saved()
        time.sleep(2)  # traffic under kube-proxy's rules again
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=10)
        if agent is not None and agent.poll() is None:
            agent.kill()
        api.stop()
        for h in held:
            h.sock.close()

    report = [(h.backend, h.rounds, round(h.longest, 3), h.errors) for h in held]
    print(f"held connections (backend, rounds, longest gap s, errors): {report}; "
          f"new connections: {opener.opened}, failed: {opener.errors}")  # fmt: skip
    assert all(not h.errors for h in held), report
    assert all(h.longest < STALL for h in held), report
    assert all(h.rounds > 50 for h in held), report
    assert not opener.errors
    assert opener.opened > 20
