"""`ipvsproxy run --kubeconfig` end to end: the real console script, the real `kubernetes`
client over HTTPS to the test API server, the real kernel, real traffic from namespaces.

One long scenario on one agent (starting Python with the Kubernetes client is slow under
emulation): converge, traffic per Service kind, scale, drain, restarts (SIGTERM and kill -9),
a 30 s API outage, a 410 relist, steady state, deletion, and a foreign virtual server that is
never touched. Run by scripts/vm-test inside the IPVS VM.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from integration.host import STUCK, clean_ipvs
from integration.lab import (
    IPTABLES_TOOLS,
    PORT,
    Lab,
    agent_command,
    alive,
    connect,
    path_without,
    request,
    udp_request,
)
from tests import support
from tests.factories import ep, node, port, service, slice_
from tests.kubeapi import ApiServer
from tests.support import free_port

pytestmark = pytest.mark.vm

NODE_IP = "10.250.1.1"  # the node's address on the client's link (lab.py topology)
FOREIGN = ["-t", "192.168.99.1:443"]
DRAIN = 12.0
SYNC_PERIOD = 3.0


def saved() -> str:
    return subprocess.run(["ipvsadm-save", "-n"], capture_output=True, text=True, check=True).stdout


LOGS: list[Path] = []  # the agents' logs, shown when a check fails
STARTED: list[subprocess.Popen[bytes]] = []  # killed when the test ends, whatever happened


def eventually(check: Callable[[], object], timeout: float = STUCK, what: str = "") -> None:
    """tests.support.eventually, showing the IPVS table and the agents' logs on failure."""

    def state() -> str:
        logs = "".join(log.read_text()[-4000:] for log in LOGS if log.exists())
        return f"{saved()}\n{logs}"

    support.eventually(check, timeout, what, interval=0.3, detail=state)


class Agent:
    """The console script as an operator runs it; its log kept in a file."""

    def __init__(self, kubeconfig: Path, log: Path) -> None:
        self.metrics_port, self.health_port = free_port(), free_port()
        self.args = agent_command(
            "--kubeconfig", str(kubeconfig), health=self.health_port, metrics=self.metrics_port,
            sync_period=SYNC_PERIOD, more=("--log-format", "json", "--drain-timeout", f"{DRAIN}s"),
        )  # fmt: skip
        self.log = log
        LOGS.append(log)
        self.proc: subprocess.Popen[bytes] | None = None
        # as on a node with no iptables tool, no ipset, no ipvsadm: its firewall in nftables
        self.path = path_without(prefixes=IPTABLES_TOOLS)

    def start(self) -> Agent:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.args, stdout=out, stderr=out, env={**os.environ, "PATH": self.path}
            )
        STARTED.append(self.proc)
        eventually(self._serving, 2 * STUCK, "the agent serves /healthz and /metrics")
        return self

    def _serving(self) -> bool:
        """Both ports answer: the health port opens first (from the agent's first moment),
        the metrics port once the backend is open."""
        assert self.proc is not None
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        try:
            self.health()
            self.metric("ipvsproxy_syncs_total")
        except OSError:
            return False
        return True

    def health(self) -> dict[str, object]:
        """/healthz's body, whatever its status: on a loaded machine a pass may be late (503
        past 2 x the sync period), which is kube-proxy's meaning, not this test's subject."""
        url = f"http://127.0.0.1:{self.health_port}/healthz"
        try:
            answer = urllib.request.urlopen(url, timeout=30)
        except urllib.error.HTTPError as exc:
            answer = exc
        body: dict[str, object] = json.load(answer)
        return body

    def metric(self, name: str, **labels: str) -> float:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=30).read().decode()
        pairs = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # as exposed
        want = name + ("{" + pairs + "}" if labels else "")
        total = 0.0
        for line in text.splitlines():
            key, _, value = line.rpartition(" ")
            if key == want or (not labels and key.startswith(name + "{")):
                total += float(value)
        return total

    def passes(self) -> float:
        """Sync passes that completed: the whole table written, not part of it."""
        return self.metric("ipvsproxy_syncs_total", result="ok")

    def writes(self) -> float:
        return self.metric("ipvsproxy_kernel_operations_total")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=60)

    def logged(self, text: str) -> bool:
        return text in self.log.read_text()


def objects(lab: Lab, web_backends: int) -> list[dict[str, Any]]:
    b = [x.address for x in lab.backends]
    web_ports = (("http", PORT, "TCP"), ("dns", PORT, "UDP"))
    return [
        node(addresses=(NODE_IP,)),
        service("web", cluster_ips=("10.96.0.10",),
                ports=[port("http", 80, "TCP", PORT), port("dns", 53, "UDP", PORT)]),
        slice_("web", ports=web_ports, endpoints=[ep(a) for a in b[:web_backends]]),
        service("np", type="NodePort", cluster_ips=("10.96.0.11",),
                ports=[port("http", 80, "TCP", PORT, node_port=30080)]),
        slice_("np", ports=(("http", PORT, "TCP"),), endpoints=[ep(b[0])]),
        service("lb", type="LoadBalancer", cluster_ips=("10.96.0.12",),
                ports=[port("http", 80, "TCP", PORT, node_port=30081)],
                externalIPs=["198.51.100.7"],
                status={"loadBalancer": {"ingress": [{"ip": "203.0.113.10"}]}}),
        slice_("lb", ports=(("http", PORT, "TCP"),), endpoints=[ep(b[1])]),
        service("broken", cluster_ips=("10.96.0.13",), ports=[{"port": 0}]),  # malformed
        service("headless", cluster_ips=("None",)),
    ]  # fmt: skip


@pytest.fixture
def world(tmp_path) -> Iterator[tuple[ApiServer, Lab, Path]]:
    clean_ipvs()
    lab = Lab()
    api = ApiServer(bookmark_interval=1.0).start()
    try:
        for _ in range(3):
            lab.add_backend()
        lab.add_client()
        yield api, lab, api.write_kubeconfig(tmp_path / "kubeconfig")
    finally:
        for proc in STARTED:  # an agent left running would keep programming later tests
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)
        STARTED.clear()
        api.stop()
        lab.close()
        clean_ipvs()


def web_counts(ns: str, n: int = 6) -> Counter[str]:
    return Counter(request(ns, "10.96.0.10", 80) for _ in range(n))


def test_agent_end_to_end(world, tmp_path):
    api, lab, kubeconfig = world
    client = lab.clients[0]
    subprocess.run(["ipvsadm", "-A", *FOREIGN, "-s", "wlc"], check=True)  # not ours
    for obj in objects(lab, web_backends=2):
        api.put(obj)
    agent = Agent(kubeconfig, tmp_path / "agent.log").start()

    # converge; every kind of Service carries real traffic
    # (slow the first time: the agent imports the Kubernetes client under emulation)
    eventually(lambda: agent.passes() >= 1, 2 * STUCK, "first complete pass")
    assert "-A -t 203.0.113.10:80" in saved()
    assert web_counts(client) == {"b1": 3, "b2": 3}
    assert udp_request(client, "10.96.0.10", 53) in {"b1", "b2"}
    assert request(client, NODE_IP, 30080) == "b1"
    assert request(client, "203.0.113.10", 80) == "b2"
    assert request(client, "198.51.100.7", 80) == "b2"
    assert agent.logged("skipping malformed Service default/broken")
    assert "10.96.0.13" not in saved()
    assert agent.health()["backend"] == "ipvs"
    assert agent.health()["firewall"] == "nftables"  # no iptables tool on its PATH
    assert "-A -t 192.168.99.1:443 -s wlc" in saved()

    # scale up, then down while a connection to the removed endpoint stays open
    api.put(objects(lab, web_backends=3)[2])
    eventually(lambda: set(web_counts(client)) == {"b1", "b2", "b3"}, what="b3 serves")
    held: dict[str, socket.socket] = {}
    while "b3" not in held:  # a long-lived connection to b3
        name, sock = connect(client, "10.96.0.10", 80)
        held.setdefault(name, sock)
    _, conn = connect(client, "10.96.0.10", 80)  # to b1 or b2: kept through everything below
    api.put(objects(lab, web_backends=2)[2])
    b3 = f"-a -t 10.96.0.10:80 -r {lab.backends[2].address}:{PORT} -m -w 0"
    eventually(lambda: b3 in saved(), what="b3 drains at weight 0")
    assert set(web_counts(client, 8)) == {"b1", "b2"}  # no new connections to b3
    assert alive(held["b3"])  # the established one still works
    # the metric follows the sync pass, which goes on to the firewall rules after IPVS
    eventually(lambda: agent.metric("ipvsproxy_draining_real_servers") == 1, what="metric")

    # a restart in the middle of the drain keeps rules, connections and the drain itself
    before = saved()
    assert agent.stop(signal.SIGTERM) == 0
    assert saved() == before
    assert alive(conn)
    assert alive(held["b3"])
    restarted_at = time.monotonic()  # the new process's drain clock starts after this
    agent.start()
    eventually(lambda: agent.passes() >= 1, 2 * STUCK, "first sync")
    assert agent.writes() == 0  # the restarted agent finds everything as it should be
    assert b3 in saved()  # still draining: its connection is open
    assert alive(held["b3"])
    eventually(lambda: lab.backends[2].address not in saved(), DRAIN + STUCK, "drain ends")
    assert time.monotonic() - restarted_at >= DRAIN - 1  # held to the (restarted) timeout
    eventually(lambda: agent.metric("ipvsproxy_draining_real_servers") == 0, what="metric 0")
    assert " -w 0" not in saved()  # no weight-0 leftovers
    for sock in held.values():
        sock.close()

    # kill -9 keeps rules and established connections; the new agent writes nothing
    before = saved()
    agent.stop(signal.SIGKILL)
    assert saved() == before
    assert alive(conn)
    agent.start()
    eventually(lambda: agent.passes() >= 1, 2 * STUCK, "first sync")
    assert agent.writes() == 0
    assert alive(conn)

    # a 15 s API outage (five sync periods; the watchers retry with growing backoff): nothing
    # changes meanwhile; what changed during it is picked up
    api.stop()
    api.put(objects(lab, web_backends=3)[2])  # scaled up while the agent cannot see
    outage_end = time.monotonic() + 15
    while time.monotonic() < outage_end:
        assert saved() == before
        time.sleep(5)
    assert alive(conn)
    assert agent.proc is not None
    assert agent.proc.poll() is None
    assert agent.metric("ipvsproxy_watch_restarts_total") > 0
    api.start()
    eventually(lambda: lab.backends[2].address in saved(), what="relisted after the outage")
    assert alive(conn)

    # 410 Gone: the agent relists and picks up what it missed
    gone_before = agent.metric("ipvsproxy_watch_restarts_total", resource="EndpointSlice",
                               reason="gone")  # fmt: skip
    api.stop()
    api.put(objects(lab, web_backends=2)[2])
    api.compact()
    api.start()
    eventually(lambda: agent.metric("ipvsproxy_watch_restarts_total", resource="EndpointSlice",
                                    reason="gone") > gone_before, what="410 relist")  # fmt: skip
    eventually(lambda: lab.backends[2].address not in saved(), DRAIN + STUCK, "missed change")

    # steady state: syncs keep happening and write nothing
    writes = agent.writes()
    passes = agent.passes()
    eventually(lambda: agent.passes() >= passes + 2, what="two more periodic passes")
    assert agent.writes() == writes
    assert agent.metric("kubeproxy_sync_proxy_rules_last_timestamp_seconds") > 0

    # the dry run against the API agrees: nothing to do
    diff = subprocess.run(
        agent_command("--kubeconfig", str(kubeconfig), command="diff", min_sync_period=None,
                      health=None, metrics=None),
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert diff.returncode == 0, diff.stdout + diff.stderr

    # deleting a Service removes its virtual servers and its VIP
    api.delete("Service", "default", "lb")
    eventually(lambda: "203.0.113.10" not in saved(), what="lb deleted")
    addresses = subprocess.run(["ip", "-o", "addr", "show", "kube-ipvs0"], capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
    assert "203.0.113.10" not in addresses
    assert "10.96.0.10" in addresses

    assert "-A -t 192.168.99.1:443 -s wlc" in saved()  # the foreign one, never touched
    conn.close()
    assert agent.stop() == 0
    log = [json.loads(line) for line in agent.log.read_text().splitlines() if line.startswith("{")]
    assert any(e["msg"].startswith("sync: ") for e in log)  # one summary line per sync
    errors = [e["msg"] for e in log if e["level"] == "error"]
    assert errors == []  # outages and relists are warnings: retried, not failed
    assert "Traceback" not in agent.log.read_text()


def test_a_wrong_token_exits_with_a_clear_error(world, tmp_path):
    api, _, _ = world
    kubeconfig = api.write_kubeconfig(tmp_path / "bad", token="wrong")
    ran = subprocess.run(
        [str(Path(sys.executable).parent / "ipvsproxy"), "run", "--kubeconfig", str(kubeconfig),
         "--metrics-bind-address", f"127.0.0.1:{free_port()}",
         "--healthz-bind-address", f"127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "NODE_NAME": "node-a"},
    )  # fmt: skip
    assert ran.returncode == 2, ran.stderr
    assert "401 Unauthorized" in ran.stderr
    assert "token" in ran.stderr
    assert "Traceback" not in ran.stderr


class Probes:
    """Short connections to VIPs from a client namespace, in a thread, until stopped: how
    many were made and which failed (a Service that stopped answering)."""

    def __init__(self, client: str, targets: list[tuple[str, int]]) -> None:
        self.client, self.targets = client, targets
        self.made = 0
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Probes:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for vip, vport in self.targets:
                try:
                    request(self.client, vip, vport, timeout=5)
                except OSError as exc:
                    self.failed.append(f"{vip}:{vport}: {exc}")
                self.made += 1
            self._stop.wait(0.05)


def test_the_api_s_service_first_then_a_restart_that_keeps_serving(world, tmp_path):
    """`--first-services` (default: default/kubernetes, kube-system/kube-dns): on a node whose
    table is empty, a pass of their own, firewall entries included, comes before the full
    pass; nothing of it waits for the other Services, nor for the whole lists (held by the
    API server here: the Services are listed alone by name, their slices by label). Then a
    restart on the complete table (issue 37): while the new agent starts and makes its first
    pass, every probe of the Services answers (no flush, no unbind, no rule gap), a
    connection held through it still works, the pass writes nothing and puts no Service
    first."""
    api, lab, kubeconfig = world
    b = [x.address for x in lab.backends]
    api.put(node(addresses=(NODE_IP,)))
    api.put(service("kubernetes", cluster_ips=("10.96.0.1",),
                    ports=[port("https", 443, "TCP", PORT)]))  # fmt: skip
    api.put(slice_("kubernetes", ports=(("https", PORT, "TCP"),), endpoints=[ep(b[0])]))
    for i in range(200):
        api.put(service(f"s{i}", cluster_ips=(f"10.96.2.{i + 1}",),
                        ports=[port("http", 80, "TCP", PORT)]))  # fmt: skip
        api.put(slice_(f"s{i}", ports=(("http", PORT, "TCP"),), endpoints=[ep(b[1])]))
    api.whole_lists.clear()  # a large cluster: the whole lists take minutes
    try:
        agent = Agent(kubeconfig, tmp_path / "agent.log").start()
        # served from their own lists (by name and label), firewall entries included,
        # while the whole lists have not come
        eventually(lambda: agent.logged("first Services served"), 2 * STUCK, "the first Services")
        assert request(lab.clients[0], "10.96.0.1", 443) == "b1"
        listed = subprocess.run(["nft", "list", "set", "inet", "ipvsproxy", "service-ports"],
                                capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert "10.96.0.1 . tcp . 443" in listed
        assert saved().count("-A -t ") == 1  # none of the rest
        assert agent.passes() == 0
    finally:
        api.whole_lists.set()
    eventually(lambda: agent.passes() >= 1, 2 * STUCK, "first complete pass")
    log = agent.log.read_text()
    first = log.index("first Services served before the rest of the table: default/kubernetes")
    assert "(3 operations, 0 failed" in log[first:]  # the service, its destination, its VIP
    assert log.index("sync: ", first) > first  # the full pass came after it
    assert request(lab.clients[0], "10.96.0.1", 443) == "b1"
    assert "10.96.2.1:80" in saved()

    client = lab.clients[0]
    _, held = connect(client, "10.96.2.200", 80)
    assert alive(held)
    table = saved()
    with Probes(client, [("10.96.0.1", 443), ("10.96.2.1", 80), ("10.96.2.200", 80)]) as probes:
        assert agent.stop(signal.SIGTERM) == 0
        assert saved() == table
        made = probes.made
        agent.log = tmp_path / "restarted.log"
        LOGS.append(agent.log)
        agent.start()
        eventually(lambda: agent.passes() >= 1, 2 * STUCK, "the restarted agent's first pass")
    assert probes.failed == []
    assert probes.made > made  # probed while the new agent started and passed
    connections = subprocess.run(["ipvsadm", "-Lcn"], capture_output=True, text=True).stdout
    assert alive(held), f"{agent.log.read_text()[-3000:]}\n{connections[-2000:]}"
    held.close()
    assert agent.writes() == 0
    messages = [json.loads(line)["msg"] for line in agent.log.read_text().splitlines()
                if line.startswith("{")]  # fmt: skip
    # a pass that writes anything (an operation, a set entry or a rule) logs its `sync:`
    # line at the default verbosity: the restarted agent's passes wrote nothing, no rule gap
    assert [msg for msg in messages if msg.startswith("sync: ")] == []
    assert saved() == table
    assert not agent.logged("first Services served")  # the kernel already served them
