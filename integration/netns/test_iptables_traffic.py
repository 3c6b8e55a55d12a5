"""Real traffic through the iptables fallback on this host's kernel: a "node" namespace holds
ipvsproxy's rules and routes between client and backend namespaces; nothing of the host's
own network changes."""

from __future__ import annotations

import socket
import subprocess
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from integration.lab import PORT, Lab, alive, built, connect, request, sctp_available, udp_request
from integration.services import NODE_IP, program, svc
from ipvsproxy.fallback import IptablesKernel
from ipvsproxy.host.commands import Commands
from tests.factories import ep, node, slice_

pytestmark = pytest.mark.netns
NODE = "ipvsp-node"


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with built(3, extra_client_addresses=8, node=NODE, node_routes_to_client=True) as lab:
        yield lab


@pytest.fixture(scope="module")
def kernel(lab) -> IptablesKernel:
    kernel = IptablesKernel(commands=Commands(prefix=("ip", "netns", "exec", NODE)))
    kernel.check()
    return kernel


def client(lab: Lab) -> str:
    return lab.clients[0]


def test_rr_spreads_exactly_evenly_over_tcp_and_udp(kernel, lab):
    program(kernel, lab, svc("rr", "10.96.0.1"), svc("dns", "10.96.0.10", proto="UDP"))
    got = Counter(request(client(lab), "10.96.0.1", 80) for _ in range(30))
    assert got == {"b1": 10, "b2": 10, "b3": 10}
    got = Counter(udp_request(client(lab), "10.96.0.10", 80) for _ in range(6))
    assert got == {"b1": 2, "b2": 2, "b3": 2}


def test_the_node_itself_reaches_a_cluster_ip(kernel, lab):
    """Locally generated traffic (host-network pods) goes through OUTPUT."""
    program(kernel, lab, svc("local", "10.96.0.14"))
    assert {request(NODE, "10.96.0.14", 80) for _ in range(6)} == {"b1", "b2", "b3"}


def test_sh_pins_each_client_address_and_spreads_clients(kernel, lab):
    program(kernel, lab, svc("sh", "10.96.0.6", scheduler="sh"))
    chosen = {}
    for source in [f"10.250.1.{n}" for n in range(2, 11)]:
        answers = {request(client(lab), "10.96.0.6", 80, source=source) for _ in range(3)}
        assert len(answers) == 1, (source, answers)
        chosen[source] = answers.pop()
    assert len(set(chosen.values())) >= 2


def test_dh_sends_each_destination_to_one_backend(kernel, lab):
    program(kernel, lab, svc("dh1", "10.96.0.7", scheduler="dh"))
    answers = {request(client(lab), "10.96.0.7", 80, source=f"10.250.1.{n}") for n in range(2, 11)}
    assert len(answers) == 1


def test_session_affinity_holds_within_the_timeout_and_ends_after_it(kernel, lab):
    sticky = {"sessionAffinity": "ClientIP"}
    program(
        kernel,
        lab,
        svc(
            "sticky",
            "10.96.0.9",
            **sticky,
            sessionAffinityConfig={"clientIP": {"timeoutSeconds": 300}},
        ),
        svc(
            "brief",
            "10.96.0.15",
            **sticky,
            sessionAffinityConfig={"clientIP": {"timeoutSeconds": 1}},
        ),
    )
    for source in ("10.250.1.2", "10.250.1.3"):
        answers = Counter(request(client(lab), "10.96.0.9", 80, source=source) for _ in range(9))
        assert len(answers) == 1, answers
    # timeout 1 s: requests 1.2 s apart are free to move (rr underneath, so they do)
    seen = set()
    for _ in range(4):
        seen.add(request(client(lab), "10.96.0.15", 80, source="10.250.1.4"))
        time.sleep(1.2)
    assert len(seen) >= 2


def test_random_spread_for_schedulers_iptables_cannot_imitate(kernel, lab, caplog):
    program(kernel, lab, svc("lc", "10.96.0.3", scheduler="lc"))
    assert {request(client(lab), "10.96.0.3", 80) for _ in range(30)} == {"b1", "b2", "b3"}
    assert "scheduler lc is not available on the iptables backend" in caplog.text


def test_nodeport_answers_on_the_node_address(kernel, lab):
    program(kernel, lab, svc("np", "10.96.0.12", type="NodePort", node_port=30080))
    got = Counter(request(client(lab), NODE_IP, 30080) for _ in range(6))
    assert got == {"b1": 2, "b2": 2, "b3": 2}


def test_sctp_is_programmed_and_answers_if_the_kernel_has_sctp(kernel, lab):
    program(kernel, lab, svc("sig", "10.96.0.11", proto="SCTP"))
    saved = subprocess.run(
        ["ip", "netns", "exec", NODE, "iptables-save", "-t", "nat"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "-d 10.96.0.11/32 -p sctp" in saved
    if sctp_available():  # this host's kernel has no SCTP sockets; the VM suite sends SCTP
        got = {request(client(lab), "10.96.0.11", 80, proto=socket.IPPROTO_SCTP) for _ in range(3)}
        assert got == {"b1", "b2", "b3"}


def test_a_removed_endpoint_gets_no_new_connections_and_old_ones_live_on(kernel, lab):
    synced = program(kernel, lab, svc("shrink", "10.96.0.13"))
    held = dict(connect(client(lab), "10.96.0.13", 80) for _ in range(3))
    objects = [
        node(addresses=(NODE_IP,)),
        svc("shrink", "10.96.0.13"),
        slice_(
            "shrink",
            ports=(("p", PORT, "TCP"),),
            endpoints=[ep(b.address) for b in lab.backends[:2]],
        ),
    ]
    assert synced.sync(objects).sync.report.failures == ()
    got = Counter(request(client(lab), "10.96.0.13", 80) for _ in range(10))
    assert got == {"b1": 5, "b2": 5}
    assert alive(held["b3"])  # conntrack keeps the established connection on its backend
    for sock in held.values():
        sock.close()
