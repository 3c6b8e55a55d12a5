"""The migration of docs/migration.md on one node, on the real kernel, with traffic, from each
of kube-proxy's modes (IPVS, iptables, nftables): the node is laid out as kube-proxy v1.36
leaves it in that mode (integration/kube_proxy_layout.py); long-lived TCP connections through
a ClusterIP and a NodePort exchange data every 100 ms and new connections open all along,
while ipvsproxy starts and `ipvsproxy cleanup --kube-proxy` removes kube-proxy's rules (from
iptables and nftables modes, kube-proxy's DNAT keeps serving until then: its rules see a
packet before IPVS does); more connections are opened under ipvsproxy alone, through IPVS.
Then the way back: ipvsproxy stops (its rules stay), kube-proxy starts again in that mode
(its start-up clean-up, then its sync), and the page's way-back `ipvsproxy cleanup` runs:
in IPVS mode at once, kube-proxy taking the table over; in iptables mode once the
connections through IPVS have ended, which until then the IPVS table keeps serving. In
nftables mode kube-proxy's start-up flushes the IPVS table itself: the connections opened
through IPVS are cut (the page says to drain the node first) and the test checks that too.
Every other connection lives, none stalls, every new connection succeeds. Run by
scripts/vm-test inside the IPVS VM.
"""

from __future__ import annotations

import re
import shlex
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from integration import kube_proxy_layout as kube_proxy
from integration.host import STUCK, clean_ipvs
from integration.lab import IPVSPROXY, PORT, Lab, agent_command, connect, request
from ipvsproxy.firewall.rules import PREFIX
from tests import support
from tests.factories import ep, node, port, service, slice_
from tests.kubeapi import ApiServer

pytestmark = pytest.mark.vm

DOC = Path(__file__).resolve().parents[2] / "docs" / "migration.md"
NODE_IP = "10.250.1.1"  # the node's address on the client's link (lab.py topology)
CLUSTER_CIDR = "10.244.0.0/16"
STALL = 1.0  # seconds without an answer on a held connection that count as a stall
PATHS = (("10.96.0.10", 80), (NODE_IP, 30080))  # a ClusterIP, a NodePort
# kube-proxy's fixed chains (nftables: its tables) once it has synced, by mode
CHAINS = {"ipvs": 11, "iptables": 12, "nftables": 2}


def doc_commands() -> tuple[list[str], dict[str, list[str]]]:
    """The node's side of docs/migration.md, as written there: the `ipvsproxy cleanup` it runs
    on the node after the swap, and the way back's, by mode (its dry runs aside)."""
    found = re.findall(r"-- (ipvsproxy cleanup\b[^\n]*)", DOC.read_text())
    swap, back_ipvs, back_rules = (
        [IPVSPROXY, *shlex.split(c)[1:]] for c in found if "--dry-run" not in c
    )
    return swap, {"ipvs": back_ipvs, "iptables": back_rules, "nftables": back_rules}


def saved() -> str:
    return subprocess.run(["ipvsadm-save", "-n"], capture_output=True, text=True).stdout


def own_chains() -> list[str]:
    """ipvsproxy's chains and ipsets, and its nftables table (the IPVS backend's firewall
    rules, in either implementation)."""
    text = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
    sets = subprocess.run(["ipset", "list", "-n"], capture_output=True, text=True).stdout
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    mine = [line for line in (text + sets).splitlines() if line.lstrip(":").startswith(PREFIX)]
    return mine + [line for line in tables.splitlines() if line == "table inet ipvsproxy"]


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
    """New connections through each VIP, one every 250 ms; the failures, and when each
    attempt that failed began (time.monotonic())."""

    client: str
    errors: list[str] = field(default_factory=list)
    failed_at: list[float] = field(default_factory=list)
    opened: int = 0

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            for vip, number in PATHS:
                began = time.monotonic()
                try:
                    request(self.client, vip, number, timeout=STALL * 3)
                    self.opened += 1
                except OSError as exc:
                    self.errors.append(f"{vip}:{number}: {exc!r}")
                    self.failed_at.append(began)
            stop.wait(0.25)


@dataclass
class Batch:
    """Held connections opened together, run on their threads until `end()`."""

    held: list[Held]
    ending: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        self.threads = [threading.Thread(target=h.run, args=(self.ending,)) for h in self.held]
        for thread in self.threads:
            thread.start()

    def end(self) -> None:
        """The clients close them (once they have stopped exchanging)."""
        self.ending.set()
        for thread in self.threads:
            thread.join(timeout=10)
        for h in self.held:
            h.sock.close()


@dataclass
class Traffic:
    """Batches of held connections and the opener, until `stop()`."""

    client: str
    batches: list[Batch] = field(default_factory=list)
    opener: Opener | None = None
    stopping: threading.Event = field(default_factory=threading.Event)
    opening: threading.Thread | None = None

    def hold(self) -> Batch:
        """One more held connection through each path."""
        batch = Batch(
            [Held(sock, name) for name, sock in (connect(self.client, *p) for p in PATHS)]
        )
        self.batches.append(batch)
        batch.start()
        return batch

    def open_all_along(self) -> None:
        self.opener = Opener(self.client)
        self.opening = threading.Thread(target=self.opener.run, args=(self.stopping,))
        self.opening.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.opening is not None:
            self.opening.join(timeout=10)
        for batch in self.batches:
            batch.end()


@pytest.fixture
def lab() -> Iterator[Lab]:
    clean_ipvs()
    made = Lab()
    try:
        yield made
    finally:
        made.close()
        subprocess.run([IPVSPROXY, "cleanup", "--kube-proxy", "--including-ipvs", "--force",
                        "--service-cidr", "10.96.0.0/16"], capture_output=True)  # fmt: skip
        kube_proxy.forget()
        clean_ipvs()


LAYOUT = (
    kube_proxy.Port("10.96.0.10", 80, (f"10.244.1.2:{PORT}", f"10.244.2.2:{PORT}")),
    kube_proxy.Port("10.96.0.11", 80, (f"10.244.1.2:{PORT}",), node_port=30080,
                    name="default/np:http"),
    # a Service deleted while the node changed hands: kube-proxy's rules still list it
    kube_proxy.Port("10.96.0.12", 80, (f"10.244.1.2:{PORT}",), node_port=30081,
                    name="default/gone:http"),
)  # fmt: skip


def start_agent(
    tmp_path: Path, b1: str, b2: str
) -> tuple[subprocess.Popen[bytes], Path, ApiServer]:
    """ipvsproxy on node-a, against a test API server holding the lab's two Services (the
    third of LAYOUT is gone from the cluster); the agent, its log, the server."""
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
    log = tmp_path / "agent.log"
    command = agent_command(
        "--kubeconfig", str(api.write_kubeconfig(tmp_path / "kubeconfig")),
        # the health port a DaemonSet's agent has (0.0.0.0:10256, here on loopback), where the
        # page's `cleanup --kube-proxy` asks whether this node is served yet
        health=10256,
        more=("--cluster-cidr", CLUSTER_CIDR, "--detect-local-mode", "ClusterCIDR"),
    )  # fmt: skip
    with log.open("wb") as out:
        agent = subprocess.Popen(command, stdout=out, stderr=out)
    return agent, log, api


def served() -> bool:
    """Whether the agent's /readyz answers 200 (the readinessProbe's view: this node served)."""
    try:
        with urllib.request.urlopen("http://127.0.0.1:10256/readyz", timeout=10) as answer:
            return bool(answer.status == 200)
    except OSError:  # not listening yet, or 503
        return False


def run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("mode", kube_proxy.MODES)
def test_kube_proxy_to_ipvsproxy_and_back_under_traffic(
    mode: str, lab: Lab, tmp_path: Path
) -> None:
    swap_cleanup, back = doc_commands()
    assert swap_cleanup[2:] == ["--kube-proxy"]
    assert back["ipvs"][2:] == ["--keep-ipvs"]
    assert back["iptables"][2:] == []  # everything of ipvsproxy's, its IPVS table too
    b1, b2 = (lab.add_backend().address for _ in range(2))
    assert (b1, b2) == ("10.244.1.2", "10.244.2.2")  # the layout's endpoints
    traffic = Traffic(lab.add_client())
    kube_proxy.apply(mode, LAYOUT, node_ip=NODE_IP, cluster_cidr=CLUSTER_CIDR)
    # an administrator's virtual server in the NodePort range, in no record: never claimed
    subprocess.run(["ipvsadm", "-A", "-t", f"{NODE_IP}:30082", "-s", "rr"], check=True)
    assert len(kube_proxy.chains(mode)) == CHAINS[mode]
    assert len(kube_proxy.sets()) == (17 if mode == "ipvs" else 0)

    before = [traffic.hold(), traffic.hold()]
    traffic.open_all_along()
    agent, api, via_ipvs = None, None, Batch([])
    starting = started = 0.0
    try:
        time.sleep(1)  # traffic under kube-proxy's rules
        # the swap: ipvsproxy builds (IPVS mode: adopts) the table, then kube-proxy's rules go
        agent, log, api = start_agent(tmp_path, b1, b2)
        support.eventually(
            lambda: served() and own_chains(), STUCK,
            "ipvsproxy ready (/readyz: a full pass done), its rules in place", interval=0.3,
            detail=lambda: saved() + log.read_text()[-3000:],
        )  # fmt: skip
        table = saved()
        if mode == "ipvs":
            assert f"-A -t {NODE_IP}:30081" not in table, "kube-proxy's stale NodePort goes"
        assert f"-A -t {NODE_IP}:30082" in table, "the foreign one in the range stays"
        assert f"-A -t {NODE_IP}:30080" in table
        time.sleep(1)
        run(swap_cleanup)
        assert kube_proxy.chains(mode) == set()
        assert kube_proxy.sets() == set()
        assert "-A -t 10.96.0.10:80" in saved(), "the IPVS table stays"
        via_ipvs = traffic.hold()  # new connections now go through IPVS
        time.sleep(2)  # traffic under ipvsproxy alone

        # the way back: ipvsproxy stops (its rules stay), kube-proxy starts in `mode`
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=60) == 0
        starting = time.monotonic()
        kube_proxy.apply(mode, LAYOUT, node_ip=NODE_IP, cluster_cidr=CLUSTER_CIDR)
        started = time.monotonic()
        time.sleep(2)  # kube-proxy's DNAT for new connections, IPVS for those it carries
        if mode == "iptables":  # the page: the cleanup once those connections have ended
            via_ipvs.end()
            assert all(not h.errors for h in via_ipvs.held), "carried until they ended"
        run(back[mode])
        assert own_chains() == []
        assert len(kube_proxy.chains(mode)) == CHAINS[mode]
        table = saved()
        assert ("-A -t 10.96.0.10:80" in table) == (mode == "ipvs"), table
        if mode == "iptables":
            assert f"-A -t {NODE_IP}:30080" not in table, "ipvsproxy's recorded NodePort goes"
            assert f"-A -t {NODE_IP}:30082" in table, "the foreign one stays"
        time.sleep(2)  # traffic under kube-proxy's rules again
    finally:
        traffic.stop()
        if agent is not None and agent.poll() is None:
            agent.kill()
        if api is not None:
            api.stop()

    opener = traffic.opener
    assert opener is not None
    held = [h for batch in traffic.batches for h in batch.held]
    report = [(h.backend, h.rounds, round(h.longest, 3), h.errors) for h in held]
    print(f"{mode}: held connections (backend, rounds, longest gap s, errors): {report}; "
          f"new connections: {opener.opened}, failed: {opener.errors}")  # fmt: skip
    # nftables mode's start-up flushes the IPVS table: what IPVS carried is cut, and new
    # connections fail until its first sync (the page: drain the node first)
    if mode == "nftables":
        assert all(h.errors for h in via_ipvs.held), report
        # (an attempt that began up to its timeout before the start may be caught in it)
        assert all(starting - STALL * 3 <= t <= started for t in opener.failed_at), report
        opener.errors.clear()
    kept = [h for b in before for h in b.held] + ([] if mode == "nftables" else via_ipvs.held)
    assert all(not h.errors for h in kept), report
    assert all(h.longest < STALL for h in kept), report
    assert all(h.rounds > 50 for b in before for h in b.held), report
    assert all(h.rounds > 20 for h in kept), report
    assert not opener.errors
    assert opener.opened > 20
