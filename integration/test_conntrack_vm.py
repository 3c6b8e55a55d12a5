"""Conntrack settings at start-up on the real kernel, read back: what
`ipvsproxy run --once` leaves in /proc/sys/net/netfilter and the hashsize, as kube-proxy."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from integration.lab import PORT, Lab, agent_command, built, inside
from integration.services import CONFIG, NODE_IP
from ipvsproxy.firewall.conntrack import forget_udp, udp_gone
from ipvsproxy.host import sysctl as sysctls
from ipvsproxy.host.commands import Commands
from ipvsproxy.netlink import NetlinkKernel
from ipvsproxy.proxier import Proxier
from tests.factories import ep, node, port, service, slice_
from tests.support import Synced

pytestmark = pytest.mark.vm

NF = Path("/proc/sys/net/netfilter")
HASHSIZE = Path("/sys/module/nf_conntrack/parameters/hashsize")
NAMES = ("nf_conntrack_max", "nf_conntrack_tcp_timeout_established",
         "nf_conntrack_tcp_timeout_close_wait", "nf_conntrack_udp_timeout")  # fmt: skip
VIP = "10.96.0.77"
SERVICE = (
    "kind: Service\nmetadata: {name: s, namespace: x}\n"
    "spec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n"
)


def read(name: str) -> int:
    return int((NF / name).read_text())


def write(name: str, value: int) -> None:
    (NF / name).write_text(f"{value}\n")


@pytest.fixture
def conntrack() -> Iterator[None]:
    """nf_conntrack loaded, its settings put back afterwards (the VM is shared by tests)."""
    subprocess.run(["modprobe", "nf_conntrack"], check=True)
    saved = {name: read(name) for name in NAMES}
    yield
    for name, value in saved.items():
        write(name, value)


def run_once(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "svc.yaml").write_text(SERVICE)
    ran = subprocess.run(
        agent_command("--once", "--manifests", str(tmp_path), min_sync_period=None,
                      health=None, metrics=None, more=flags),
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    return ran


def test_run_sets_kube_proxys_conntrack_values_and_leaves_zeros_alone(clean, conntrack, tmp_path):
    write("nf_conntrack_max", 65536)  # a small VM's default, below kube-proxy's min
    write("nf_conntrack_tcp_timeout_established", 432000)  # the kernel's 5 days
    write("nf_conntrack_tcp_timeout_close_wait", 60)
    write("nf_conntrack_udp_timeout", 30)
    run_once(tmp_path)
    cpus = os.cpu_count() or 1
    wanted = min(32768 * cpus, 1_048_576) if 32768 * cpus > 131072 else 131072
    assert read("nf_conntrack_max") == wanted
    assert int(HASHSIZE.read_text()) >= wanted // 4
    assert read("nf_conntrack_tcp_timeout_established") == 86400
    assert read("nf_conntrack_tcp_timeout_close_wait") == 3600
    assert read("nf_conntrack_udp_timeout") == 30  # --conntrack-udp-timeout 0: left alone

    # a larger max than kube-proxy's is kept; 0 leaves a setting; the flags reach the kernel
    write("nf_conntrack_max", wanted * 2)
    run_once(
        tmp_path, "--conntrack-tcp-timeout-established", "0", "--conntrack-udp-timeout", "45s",
        "--conntrack-tcp-timeout-close-wait", "30m",
    )  # fmt: skip
    assert read("nf_conntrack_max") == wanted * 2
    assert read("nf_conntrack_tcp_timeout_established") == 86400
    assert read("nf_conntrack_tcp_timeout_close_wait") == 1800
    assert read("nf_conntrack_udp_timeout") == 45


# ---- the flow a UDP client cached before the first endpoint goes with it
#
# Measured on the 6.1 test kernel (vs.conntrack=1, conntrack active as the firewall rules
# make it): a datagram to a virtual server with no destination is dropped by IPVS before
# conntrack confirms an entry, so nothing is cached. A datagram to a VIP port with no virtual
# server yet (the port is new to the Service, or the Service's first sync is still to come)
# is refused by the local stack, and its entry IS confirmed: UNREPLIED, the VIP itself as reply
# source. IPVS, which NATs by its own table, then answers the client anyway, but conntrack
# keeps the stale tuple for the flow's life, so every iptables NAT decision tied to it (the
# firewall's masquerade, kube-proxy's NodePort SNAT) stays the one made for "no endpoint".

CT_RULE = ["INPUT", "-m", "conntrack", "--ctstate", "NEW",
           "-m", "comment", "--comment", "ipvsproxy-test: conntrack on"]  # fmt: skip


@pytest.fixture
def lab(clean, conntrack) -> Iterator[Lab]:
    sysctls.ensure(sysctls.required(os.uname().release))  # vs.conntrack=1, as the agent
    subprocess.run(["iptables", "-I", *CT_RULE], check=True)  # conntrack hooks on, as on a node
    try:
        with built(1) as lab:
            yield lab
    finally:
        subprocess.run(["iptables", "-D", *CT_RULE], check=False)


def dns(*, udp_endpoint: str = "") -> list[dict[str, Any]]:
    """A Service on VIP with a TCP port; with `udp_endpoint`, also UDP 53 served by it."""
    ports = [port("t", 80, "TCP", PORT)] + ([port("p", 53, "UDP", PORT)] if udp_endpoint else [])
    endpoints = [ep(udp_endpoint)] if udp_endpoint else []
    slice_ports = (("t", PORT, "TCP"), ("p", PORT, "UDP"))
    return [node(addresses=(NODE_IP,)), service("dns", cluster_ips=(VIP,), ports=ports),
            slice_("dns", ports=slice_ports, endpoints=endpoints)]  # fmt: skip


def sync_and_forget(kernel: NetlinkKernel, objects: list[dict[str, Any]]) -> int:
    """One full pass of the proxier, then the UDP conntrack deletions it makes with its
    firewall rules (left out here: their VIP port filter would reject the datagram this
    case is about), planned from the table as it was before the pass."""
    before = kernel.observe()
    result = Synced(Proxier(kernel=kernel, config=CONFIG)).sync(objects)
    assert result.sync.report.failures == ()
    return forget_udp(Commands(), udp_gone(result.sync.plan, set(), before=before))


def flows_to_vip() -> list[str]:
    listed = subprocess.run(
        ["conntrack", "-L", "-p", "udp", "--orig-dst", VIP, "--orig-port-dst", "53"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return [line.split(maxsplit=3)[3] for line in listed.splitlines() if line.strip()]


def test_the_flow_cached_before_the_first_udp_endpoint_is_replaced_after_it(lab):
    backend = lab.backends[0]
    with NetlinkKernel() as kernel:
        sync_and_forget(kernel, dns())  # the VIP is bound; UDP 53 has no virtual server yet
        with inside(lab.clients[0]):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with sock:  # one socket, one source port: a resolver's
            sock.settimeout(1)

            def ask() -> str:
                sock.sendto(b"?", (VIP, 53))
                try:
                    return sock.recv(64).decode()
                except OSError as exc:
                    return f"no answer: {exc}"

            assert ask().startswith("no answer")
            (stale,) = flows_to_vip()
            assert "[UNREPLIED]" in stale
            assert f"src={VIP} dst=10.250.1.2 sport=53" in stale  # the VIP answered: no one
            assert sync_and_forget(kernel, dns(udp_endpoint=backend.address)) == 1
            assert ask() == backend.name  # the very next datagram from the same socket
            (flow,) = flows_to_vip()
            assert f"src={backend.address} dst=10.250.1.2 sport={PORT}" in flow  # NATed
            assert "[UNREPLIED]" not in flow
