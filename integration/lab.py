"""A small network lab for real-traffic tests: namespaces joined by veth pairs, with TCP,
UDP and (if the kernel has it) SCTP servers, all run by threads of the test process.

Sockets belong to the network namespace they were created in, and setns() switches only the
calling thread, so the test process briefly enters a namespace to create a socket and then
uses it from anywhere: no helper processes to start (Python starts slowly under emulation).

`built()` makes the usual lab of one node; `two_nodes()` the IPVS firewall's two nodes on one
bridge (see below), with `objects`, `cluster_ip` and `endpoints` for their Services.

Topology (the node running ipvsproxy = the root namespace, or with `Lab(node="NS")` a
namespace of its own, which the lab creates with forwarding on; the iptables tests on the
host use that, so nothing of the host's own network changes):
  backend N   ns ipvsp-bN: eth0 10.244.N.2/24, default via 10.244.N.1 (root side vbN);
              or, with an explicit address: eth0 ADDRESS/32, a /32 route to it on vbN and
              proxy ARP there (several pods of one node in one subnet, as in examples/)
  client N    ns ipvsp-cN: eth0 10.250.N.2/24 (+ extra addresses), default via 10.250.N.1
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from ipaddress import ip_network
from pathlib import Path
from typing import Any

from integration.host import clean_ipvs, skip_unless_ci
from ipvsproxy.agent import build_proxier
from ipvsproxy.backends import IPVS, open_backend
from ipvsproxy.config import Config
from ipvsproxy.firewall.firewall_plan import HostFirewall
from ipvsproxy.host.commands import Commands
from ipvsproxy.proxier import PassResult
from tests.factories import ep, node, port, service, slice_
from tests.support import Synced, free_port

CLONE_NEWNET = 0x40000000
PORT = 8000
IPVSPROXY = str(Path(sys.executable).parent / "ipvsproxy")


def agent_command(
    *source: str,
    command: str = "run",
    netns: str | None = None,
    program: Sequence[str] = (IPVSPROXY,),
    node: str = "node-a",
    service_cidr: str | None = "10.96.0.0/16",
    backend: str | None = None,
    min_sync_period: str | None = "200ms",
    sync_period: float | None = None,
    health: int | None = 0,
    metrics: int | None = 0,
    more: Sequence[str] = (),
) -> list[str]:
    """`ipvsproxy run` as the tests and benches start it on a lab: `source` (`--manifests
    DIR`, `--kubeconfig FILE`, with `--once` if wanted), node-a, the Service CIDR
    10.96.0.0/16, partial passes 200 ms apart, health and metrics on 127.0.0.1 at the given
    ports (0: a free one). None leaves a flag out (the agent's default); `command` may be
    `diff` (with no run flags: min_sync_period, health and metrics None); `netns` runs it in
    that namespace (`ip netns exec`); `program` is what to exec (a chroot's prefix and its
    `ipvsproxy`, say); `more` goes last."""
    args = [*program, command, *source, "--hostname-override", node]
    if service_cidr is not None:
        args += ["--service-cidr", service_cidr]
    if backend is not None:
        args += ["--backend", backend]
    if min_sync_period is not None:
        args += ["--min-sync-period", min_sync_period]
    if health is not None:
        args += ["--healthz-bind-address", f"127.0.0.1:{health or free_port()}"]
    if metrics is not None:
        args += ["--metrics-bind-address", f"127.0.0.1:{metrics or free_port()}"]
    if sync_period is not None:
        args += ["--sync-period", f"{sync_period}s"]
    prefix = ["ip", "netns", "exec", netns] if netns is not None else []
    return [*prefix, *args, *more]


# The tools a node with `--firewall nftables` can do without (the iptables family, ipset,
# ipvsadm): the nftables lab nodes and tests run ipvsproxy with a PATH that has none of them.
IPTABLES_TOOLS = ("iptables", "ip6tables", "ipset", "ipvsadm", "xtables", "ebtables", "arptables")


def path_without(*tools: str, prefixes: Sequence[str] = ()) -> str:
    """A PATH of one directory linking every program on this PATH except `tools` and those
    whose name starts with one of `prefixes`: a node whose image lacks them. Made once per
    PATH and exclusion, under the temporary directory (the symlinks of every program on the
    PATH take seconds under the VM's emulation), and kept."""
    path = os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    key = hashlib.sha256(repr((path, sorted(tools), sorted(prefixes))).encode()).hexdigest()[:12]
    bin_ = Path(tempfile.gettempdir()) / f"ipvsproxy-path-{key}"
    if bin_.is_dir():
        return str(bin_)
    making = Path(tempfile.mkdtemp(prefix=f"{bin_.name}-"))
    for where in reversed(path.split(":")):
        if not Path(where).is_dir():
            continue
        for program in Path(where).iterdir():
            if program.name in tools or program.name.startswith(tuple(prefixes)):
                continue
            link = making / program.name
            if link.is_symlink():
                link.unlink()
            link.symlink_to(program)
    try:
        making.rename(bin_)  # whole or not at all, whoever made it first
    except OSError:
        shutil.rmtree(making, ignore_errors=True)
    return str(bin_)


_libc = ctypes.CDLL(None, use_errno=True)


def sh(*args: str) -> None:
    result = subprocess.run(args, capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"{' '.join(args)}: {result.stderr.strip()}")


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@contextlib.contextmanager
def inside(ns: str) -> Iterator[None]:
    """Run the block with this thread in network namespace `ns`."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        _setns(target)
        yield
    finally:
        _setns(own)
        os.close(own)
        os.close(target)


def sctp_available() -> bool:
    try:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_SCTP).close()
    except OSError:
        return False
    return True


@dataclass
class Backend:
    name: str
    ns: str
    address: str
    sockets: list[socket.socket] = field(default_factory=list)


class Lab:
    def __init__(self, node: str = "", tag: str = "") -> None:
        self.node = node
        self.tag = tag  # in namespace names, so that two labs (two nodes) can coexist
        if node:
            sh("ip", "netns", "add", node)
            sh("ip", "-n", node, "link", "set", "lo", "up")
            sh("ip", "netns", "exec", node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        self.backends: list[Backend] = []
        self.clients: list[str] = []
        self._links: list[str] = []
        self._stop = threading.Event()
        self._servers: list[threading.Thread] = []

    # ---- topology -----------------------------------------------------------------------

    def _ip(self, *args: str) -> None:
        """`ip` on the node's side of the links."""
        sh("ip", *(("-n", self.node) if self.node else ()), *args)

    def _namespace(self, ns: str, link: str, outside: str, inside_cidr: str) -> None:
        sh("ip", "netns", "add", ns)
        self._ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self._links.append(link)
        self._ip("addr", "add", outside, "dev", link)
        self._ip("link", "set", link, "up")
        sh("ip", "-n", ns, "addr", "add", inside_cidr, "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "route", "add", "default", "via", outside.split("/")[0])

    def add_backend(self, address: str = "", ports: tuple[int, ...] = (PORT,)) -> Backend:
        """A backend namespace answering its name on TCP, UDP and SCTP (if available) ports."""
        n = len(self.backends) + 1
        ns, link = f"ipvsp-{self.tag}b{n}", f"vb{n}"
        if address:
            self._host_route_namespace(ns, link, address)
        else:
            address = f"10.244.{n}.2"
            self._namespace(ns, link, f"10.244.{n}.1/24", f"{address}/24")
        backend = Backend(f"{self.tag}b{n}", ns, address)
        for number in ports:
            self._listen(backend, number)
        self.backends.append(backend)
        return backend

    def _host_route_namespace(self, ns: str, link: str, address: str) -> None:
        sh("ip", "netns", "add", ns)
        self._ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self._links.append(link)
        self._ip("link", "set", link, "up")
        prefix = ("ip", "netns", "exec", self.node) if self.node else ()
        sh(*prefix, "sysctl", "-qw", f"net.ipv4.conf.{link}.proxy_arp=1")
        self._ip("route", "add", f"{address}/32", "dev", link)
        sh("ip", "-n", ns, "addr", "add", f"{address}/32", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "route", "add", "default", "dev", "eth0")

    def _listen(self, backend: Backend, number: int) -> None:
        with inside(backend.ns):
            tcp = socket.create_server(("0.0.0.0", number), backlog=64)
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            udp.bind(("0.0.0.0", number))
            sctp = None
            if sctp_available():
                sctp = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_SCTP)
                sctp.bind(("0.0.0.0", number))
                sctp.listen(16)
                # shutdown() does not wake an SCTP accept() (sctp_disconnect does nothing and
                # the socket stays listening), so its server looks at the stop flag this often
                sctp.settimeout(0.2)
        servers = ((tcp, self._serve_stream), (udp, self._serve_udp), (sctp, self._serve_stream))
        for sock, serve in servers:
            if sock is not None:
                backend.sockets.append(sock)
                server = threading.Thread(target=serve, args=(sock, backend.name), daemon=True)
                self._servers.append(server)
                server.start()

    def add_client(self, extra: int = 0) -> str:
        n = len(self.clients) + 1
        ns = f"ipvsp-{self.tag}c{n}"
        self._namespace(ns, f"vc{n}", f"10.250.{n}.1/24", f"10.250.{n}.2/24")
        for i in range(extra):
            sh("ip", "-n", ns, "addr", "add", f"10.250.{n}.{3 + i}/24", "dev", "eth0")
        self.clients.append(ns)
        return ns

    def close(self) -> None:
        """Stop the servers before their sockets close: a server thread that asks a closed
        socket's descriptor number again could read from whatever socket gets that number
        next (a netlink socket of the next test, whose reply it would steal)."""
        self._stop.set()
        sockets = [sock for backend in self.backends for sock in backend.sockets]
        for sock in sockets:
            with contextlib.suppress(OSError):  # unconnected UDP: ENOTCONN, woken all the same
                sock.shutdown(socket.SHUT_RDWR)
        for server in self._servers:
            server.join(timeout=5)
        for sock in sockets:
            sock.close()
        for ns in [b.ns for b in self.backends] + self.clients:
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        node = ["-n", self.node] if self.node else []
        for link in self._links:
            subprocess.run(["ip", *node, "link", "del", link], check=False, capture_output=True)
        if self.node:
            subprocess.run(["ip", "netns", "del", self.node], check=False, capture_output=True)

    # ---- servers: answer with the backend's name ---------------------------------------

    def _serve_stream(self, sock: socket.socket, name: str) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._hold, args=(conn, name), daemon=True).start()

    @staticmethod
    def _hold(conn: socket.socket, name: str) -> None:
        """Answer, then echo what comes until the client closes the connection."""
        with conn:
            try:
                conn.sendall(name.encode() + b"\n")
                while data := conn.recv(64):
                    conn.sendall(data)
            except OSError:
                pass

    def _serve_udp(self, sock: socket.socket, name: str) -> None:
        while not self._stop.is_set():
            try:
                data, peer = sock.recvfrom(64)
                if data and not self._stop.is_set():
                    sock.sendto(name.encode(), peer)
            except OSError:
                return


# ---- clients ----------------------------------------------------------------------------


def connect(
    ns: str,
    vip: str,
    port: int,
    *,
    source: str = "",
    proto: int = socket.IPPROTO_TCP,
    timeout: float = 10,
) -> tuple[str, socket.socket]:
    """Open a stream connection from namespace `ns`; (backend name, the open socket)."""
    with inside(ns):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, proto)
    try:
        sock.settimeout(timeout)
        if source:
            sock.bind((source, 0))
        sock.connect((vip, port))
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(64)
            if not chunk:
                break
            data += chunk
    except OSError:
        sock.close()
        raise
    return data.decode().strip(), sock


def request(
    ns: str,
    vip: str,
    port: int,
    *,
    source: str = "",
    proto: int = socket.IPPROTO_TCP,
    timeout: float = 10,
) -> str:
    """One short connection: which backend answered."""
    name, sock = connect(ns, vip, port, source=source, proto=proto, timeout=timeout)
    sock.close()
    return name


def alive(sock: socket.socket) -> bool:
    """Whether an open connection still carries data both ways (the backend echoes)."""
    try:
        sock.sendall(b"ping\n")
        data = b""
        while not data.endswith(b"ping\n"):
            chunk = sock.recv(64)
            if not chunk:
                return False
            data += chunk
        return True
    except OSError:
        return False


def udp_request(ns: str, vip: str, port: int, *, source_port: int = 0) -> str:
    """One datagram and its answer: which backend answered. IPVS schedules UDP per client
    address and port, so tests that count the spread give each request its own
    `source_port` (a kernel-chosen one may repeat, and then joins the earlier connection)."""
    with inside(ns):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with sock:
        sock.settimeout(5)
        if source_port:
            sock.bind(("", source_port))
        sock.sendto(b"?", (vip, port))
        return sock.recv(64).decode()


@contextlib.contextmanager
def built(
    backends: int = 1,
    *,
    extra_client_addresses: int = 0,
    node: str = "",
    tag: str = "",
    node_routes_to_client: bool = False,
) -> Iterator[Lab]:
    """The labs' fixtures' one recipe: `backends` backends (10.244.N.2) and one client
    (10.250.1.2, plus `extra_client_addresses` more), closed when the block ends. With
    `node_routes_to_client`, the node's default route leads to the client's link, so that
    what the node itself sends to a VIP has a route (a node namespace has no other)."""
    lab = Lab(node=node, tag=tag)
    try:
        for _ in range(backends):
            lab.add_backend()
        lab.add_client(extra=extra_client_addresses)
        if node_routes_to_client:
            lab._ip("route", "add", "default", "dev", "vc1")
        yield lab
    finally:
        lab.close()


# ---- two nodes on one bridge: the IPVS firewall's lab ---------------------------------------
#
#   client ext1 .100 ─┐                         ┌─ pods 10.244.1.x (node1)
#   client ext2 .200 ─┼─ bridge ─ node1 .1 ─────┘
#                     └───────── node2 .2 ─────── pods 10.244.2.x (node2)
#
# Each "node" is a network namespace with its own IPVS table, dummy device, ipsets and
# iptables, programmed by ipvsproxy's own sync path; pods are namespaces behind their node.

LAN = "192.168.50"
CLUSTER_CIDR = "10.244.0.0/16"
SYSCTLS = (
    "net.ipv4.ip_forward=1",
    "net.ipv4.vs.conntrack=1",
    "net.ipv4.vs.expire_nodest_conn=1",
    "net.ipv4.vs.expire_quiescent_template=1",
)


class Node:
    """One node: its namespace, its lab of pods, ipvsproxy's kernel state in it."""

    def __init__(self, n: int, *, firewall: str = "auto") -> None:
        self.name, self.ns, self.address = f"node-{n}", f"ipvsp-n{n}", f"{LAN}.{n}"
        self.lab = Lab(node=self.ns, tag=f"n{n}")
        for setting in SYSCTLS:
            sh("ip", "netns", "exec", self.ns, "sysctl", "-qw", setting)
        attach(self.ns, f"lan{n}", f"{self.address}/24")
        self.config = Config(
            node_name=self.name,
            cluster_cidrs=(ip_network(CLUSTER_CIDR),),
            detect_local_mode="ClusterCIDR",
            nodeport_cidrs=(ip_network(f"{LAN}.0/24"),),
            backend=IPVS,
            firewall=firewall,
        )
        # the backend and the pass as the agent obtains them (backends.open_backend,
        # agent.build_proxier): sockets opened in the node's namespace, tools run in it
        self._opened = contextlib.ExitStack()
        prefix: tuple[str, ...] = ("ip", "netns", "exec", self.ns)
        if firewall == "nftables":
            # as the agent runs: libnftables and the generation number opened in the node's
            # namespace (the thread is in it below) and bound to it; the tools run in the
            # namespace of the thread that calls them (sync() enters it), with a PATH
            # without the iptables tools, ipset or ipvsadm
            prefix = ("env", f"PATH={path_without(prefixes=IPTABLES_TOOLS)}")
        commands = Commands(prefix=prefix)
        with inside(self.ns):
            self.backend = self._opened.enter_context(open_backend(self.config, commands=commands))
        assert self.backend.firewall is not None
        self.firewall: HostFirewall = self.backend.firewall
        self.firewall_s = 0.0  # the last firewall step's duration
        self.synced = Synced(build_proxier(self.config, self.backend))

    def sync(self, objects: list[dict[str, Any]], *, full: bool = True) -> PassResult:
        """One pass of the agent's proxier, the firewall's step included, in the node's
        namespace (where it reads the host's addresses); every IPVS and firewall step must
        succeed."""
        with inside(self.ns):
            result = self.synced.sync(objects, full=full)
        assert result.sync.report.failures == ()
        assert result.firewall_error == ""
        self.firewall_s = result.firewall_seconds
        return result

    def close(self) -> None:
        self._opened.close()
        self.lab.close()


def attach(ns: str, link: str, cidr: str) -> None:
    """A veth from namespace `ns` (eth-lan) to the bridge in the VM's root namespace."""
    sh("ip", "link", "add", link, "type", "veth", "peer", "name", "eth-lan", "netns", ns)
    sh("ip", "link", "set", link, "master", "ipvsp-br", "up")
    sh("ip", "-n", ns, "addr", "add", cidr, "dev", "eth-lan")
    sh("ip", "-n", ns, "link", "set", "eth-lan", "up")
    sh("ip", "-n", ns, "link", "set", "lo", "up")


@contextlib.contextmanager
def two_nodes(
    pods: tuple[tuple[str, ...], tuple[str, ...]],
    *,
    configure: Callable[[Node], None] | None = None,
    firewall: str = "auto",
) -> Iterator[tuple[Node, Node]]:
    """Two nodes on the bridge ipvsp-br with `pods` behind each (node 1's, node 2's), routed
    to each other's pods, from an empty IPVS table; `configure` adjusts each node before its
    pods are added; `firewall`: their --firewall. Everything is removed when the block ends."""

    clean_ipvs()
    subprocess.run(["ip", "link", "del", "ipvsp-br"], capture_output=True, check=False)
    sh("ip", "link", "add", "ipvsp-br", "type", "bridge")
    sh("ip", "link", "set", "ipvsp-br", "up")
    nodes: list[Node] = []
    try:
        nodes = [Node(1, firewall=firewall), Node(2, firewall=firewall)]
        n1, n2 = nodes
        if configure is not None:
            for n in nodes:
                configure(n)
        for n, addresses in zip(nodes, pods, strict=True):
            for address in addresses:
                n.lab.add_backend(address)
        sh("ip", "-n", n1.ns, "route", "add", "10.244.2.0/24", "via", n2.address)
        sh("ip", "-n", n2.ns, "route", "add", "10.244.1.0/24", "via", n1.address)
        yield n1, n2
    finally:
        for n in nodes:
            n.close()
        subprocess.run(["ip", "link", "del", "ipvsp-br"], capture_output=True, check=False)


def cluster_ip(name: str, vip: str) -> dict[str, Any]:
    made: dict[str, Any] = service(name, cluster_ips=(vip,), ports=[port("p", 80, "TCP", PORT)])
    return made


def objects(*extra: dict[str, Any]) -> list[dict[str, Any]]:
    return [node("node-1", addresses=(f"{LAN}.1",)), node("node-2", addresses=(f"{LAN}.2",)),
            *extra]  # fmt: skip


def endpoints(name: str, *pods: tuple[str, str], proto: str = "TCP") -> dict[str, Any]:
    made: dict[str, Any] = slice_(
        name, ports=(("p", PORT, proto),), endpoints=[ep(a, node=where) for a, where in pods]
    )
    return made


def require_sctp() -> None:
    """SCTP traffic needs the kernel's sctp module (scripts/vm loads it): skip without it,
    fail under CI=true, so the SCTP traffic tests cannot go green by skipping."""
    if not sctp_available():
        skip_unless_ci("this kernel cannot open SCTP sockets (modprobe sctp)")


@contextlib.contextmanager
def ipvs_lab(backends: int, **options: Any) -> Iterator[Lab]:
    """A lab (integration.lab.built) on an empty IPVS table, with the sysctls ipvsproxy sets
    for this kernel; the table emptied again afterwards."""
    from ipvsproxy.host import sysctl

    clean_ipvs()
    sysctl.ensure(sysctl.required(os.uname().release))
    try:
        with built(backends, **options) as lab:
            yield lab
    finally:
        clean_ipvs()
