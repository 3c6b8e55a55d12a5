"""Hashing schedulers (sh, mh) during a rolling update, with real traffic: an endpoint that
leaves while it still carries a connection is drained at weight 0, and no new connection may
fail because its hash points at the draining endpoint."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from ipaddress import ip_address

import pytest

from integration.lab import PORT, Lab, connect, ipvs_lab, request
from integration.services import CONFIG, NODE_IP, program, svc
from ipvsproxy.model import Proto, VSKey
from ipvsproxy.netlink import NetlinkKernel
from ipvsproxy.proxier import Proxier
from ipvsproxy.sync.drain import Drainer
from tests.factories import ep, node, slice_
from tests.support import Synced

pytestmark = pytest.mark.vm

SOURCES = 24  # client addresses: each one's hash lands on the draining endpoint with p = 1/3


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with ipvs_lab(3, extra_client_addresses=SOURCES - 1) as lab:
        yield lab


@pytest.fixture(scope="module")
def kernel(lab) -> Iterator[NetlinkKernel]:
    with NetlinkKernel() as k:
        yield k


def sources() -> list[str]:
    return [f"10.250.1.{n}" for n in range(2, 2 + SOURCES)]


@pytest.mark.parametrize("scheduler", ["sh", "mh"])
def test_no_new_connection_fails_on_a_draining_endpoint_under_a_hashing_scheduler(
    kernel, lab, scheduler
):
    vip = {"sh": "10.96.1.1", "mh": "10.96.1.2"}[scheduler]
    service = svc(scheduler, vip, scheduler=scheduler)
    program(kernel, lab, service)  # the table as a first pass writes it
    # the agent's proxier drains (agent.proxier: a Drainer with the drain timeout)
    synced = Synced(Proxier(kernel=kernel, config=CONFIG, drainer=Drainer(timeout=60)))
    before = {source: request(lab.clients[0], vip, 80, source=source) for source in sources()}
    # a connection held open to one endpoint, which then leaves the EndpointSlice (as a rolling
    # update's old pod does): ipvsproxy keeps it at weight 0 while the connection lasts
    victim_name, held = connect(lab.clients[0], vip, 80, source=sources()[0])
    victim = next(b for b in lab.backends if b.name == victim_name)
    try:
        synced.sync(
            [
                node(addresses=(NODE_IP,)),
                service,
                slice_(
                    scheduler,
                    ports=(("p", PORT, "TCP"),),
                    endpoints=[ep(b.address) for b in lab.backends if b is not victim],
                ),
            ]
        )
        key = VSKey(ip_address(vip), 80, Proto.TCP)
        weights = {str(rs.key.address): rs.weight for rs, _, _ in kernel.destinations(key)}
        assert weights[victim.address] == 0, weights  # draining, not deleted

        failed: list[str] = []
        after: dict[str, Counter[str]] = {}
        for source in sources():
            for _ in range(3):  # mh hashes the source port too (mh-port): several each
                try:
                    answer = request(lab.clients[0], vip, 80, source=source, timeout=3)
                except OSError as exc:
                    failed.append(f"{source}: {exc.strerror or exc}")
                    continue
                after.setdefault(source, Counter())[answer] += 1
        hashed_to_victim = [s for s, b in before.items() if b == victim_name]
        assert hashed_to_victim, "no client hashed to the draining endpoint: more SOURCES"
        assert failed == [], (failed, hashed_to_victim)
        assert all(victim_name not in c for c in after.values()), after
    finally:
        held.close()
