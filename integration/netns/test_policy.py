"""The node's NAT/filter policy on the iptables fallback, with real traffic on this host's
kernel (no IPVS here) inside a throw-away "node" namespace; the root namespace's firewall is
never touched.

- loadBalancerSourceRanges: a client address inside the range connects to the LoadBalancer
  IP, one outside does not; both still reach the ClusterIP and the NodePort of the same
  Service (the ranges guard the LoadBalancer frontend only).
- --cluster-cidr / --masquerade-all: whether a backend sees the client's address or the
  node's, seen from the backend (its peer address).
- the xtables lock: every iptables-restore ipvsproxy runs carries `-w 5 -W 100000` (argv
  recorded by a wrapper first on PATH), and with the lock held by someone else for a while
  the write waits for it instead of failing.

The sync runs through the agent's Proxier, which hands the fallback each virtual server's
access with every observation and pass.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator
from ipaddress import ip_network
from pathlib import Path
from typing import Any

import pytest

from integration.lab import PORT, Lab, built, inside, request
from ipvsproxy.config import Config
from ipvsproxy.fallback import IptablesKernel
from ipvsproxy.host.commands import Commands
from ipvsproxy.policy import node_policy
from ipvsproxy.proxier import Proxier
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, Tracker
from tests.factories import ep, node, port, service, slice_

pytestmark = pytest.mark.netns
NODE_NS = "ipvsp-pol"
NODE_IP = "10.250.1.1"  # the node's address on the client's link
CLUSTER_IP, LB_IP, NODE_PORT = "10.96.0.50", "203.0.113.50", 30050
INSIDE, OUTSIDE = "10.250.1.2", "10.250.1.3"  # one client namespace, two source addresses
ALLOWED = f"{INSIDE}/32"


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with built(1, extra_client_addresses=1, node=NODE_NS, tag="pol") as lab:  # 10.250.1.2, .3
        yield lab


def objects(lab: Lab, cluster_ip: str = CLUSTER_IP, **spec: Any) -> list[dict[str, Any]]:
    return [
        node(addresses=(NODE_IP,)),
        service(
            "lb",
            type="LoadBalancer",
            cluster_ips=(cluster_ip,),
            ports=[port("http", 80, "TCP", PORT, NODE_PORT)],
            status={"loadBalancer": {"ingress": [{"ip": LB_IP}]}},
            **spec,
        ),
        slice_(
            "lb", ports=(("http", PORT, "TCP"),), endpoints=[ep(b.address) for b in lab.backends]
        ),
    ]


def sync(
    config: Config, objs: list[dict[str, Any]], *, prefix: tuple[str, ...] = ()
) -> IptablesKernel:
    """One full pass of the agent's proxier on the fallback inside the node namespace."""
    commands = Commands(prefix=(*prefix, "ip", "netns", "exec", NODE_NS))
    kernel = IptablesKernel(commands=commands, node=node_policy(config))
    kernel.check()
    proxier = Proxier(kernel=kernel, config=config)
    tracker = Tracker(node_name=config.node_name)
    for kind in (SERVICE, SLICE, NODE):
        tracker.replace(kind, [o for o in objs if o["kind"] == kind])
    result = proxier.sync(tracker.take(), full=True)
    assert result.ok, result.sync.report.failures
    assert kernel.observe() is not None
    assert kernel.damage() == ()  # what was written reads back exactly as rendered
    return kernel


def reaches(lab: Lab, source: str, address: str, number: int) -> bool:
    try:
        return bool(request(lab.clients[0], address, number, source=source, timeout=2))
    except OSError:
        return False


def test_source_ranges_admit_only_their_sources_to_the_load_balancer_ip(lab):
    sync(Config(node_name="node-a"), objects(lab, loadBalancerSourceRanges=[ALLOWED]))
    assert reaches(lab, INSIDE, LB_IP, 80)
    assert not reaches(lab, OUTSIDE, LB_IP, 80)
    # the same Service's other frontends are not guarded by the ranges
    for address, number in ((CLUSTER_IP, 80), (NODE_IP, NODE_PORT)):
        assert reaches(lab, OUTSIDE, address, number), (address, number)
        assert reaches(lab, INSIDE, address, number), (address, number)


def test_without_source_ranges_everyone_reaches_the_load_balancer_ip(lab):
    sync(Config(node_name="node-a"), objects(lab))
    assert reaches(lab, OUTSIDE, LB_IP, 80)
    assert reaches(lab, INSIDE, LB_IP, 80)


def backend_sees(lab: Lab, source: str, address: str, number: int) -> str:
    """Which source address the backend's accepted connection came from."""
    with inside(lab.backends[0].ns):
        probe = socket.create_server(("0.0.0.0", 18080))
    try:
        with inside(lab.clients[0]):
            client = socket.socket()
        client.settimeout(3)
        with client:
            client.bind((source, 0))
            client.connect((address, number))
            probe.settimeout(3)
            conn, (seen, _) = probe.accept()
            conn.close()
        return str(seen)
    finally:
        probe.close()


def probed(lab: Lab, **spec: Any) -> list[dict[str, Any]]:
    """The Service on a second port (18080) that a test-owned socket answers."""
    objs = objects(lab, **spec)
    objs[1]["spec"]["ports"].append(port("probe", 8080, "TCP", 18080, 30051))
    objs[2]["ports"].append({"name": "probe", "port": 18080, "protocol": "TCP"})
    return objs


def test_masquerading_follows_cluster_cidr_and_masquerade_all(lab):
    backend_side = lab.backends[0].address.rsplit(".", 1)[0] + ".1"  # the node on its link
    # no flags: ClusterIP traffic keeps the client's address, NodePort traffic is masqueraded
    sync(Config(node_name="node-a"), probed(lab))
    assert backend_sees(lab, OUTSIDE, CLUSTER_IP, 8080) == OUTSIDE
    assert backend_sees(lab, OUTSIDE, NODE_IP, 30051) == backend_side
    # --cluster-cidr covering the client: it is "a pod", not masqueraded; outside it: masqueraded
    pods = Config(
        node_name="node-a",
        cluster_cidrs=(ip_network("10.250.1.0/24"),),
        detect_local_mode="ClusterCIDR",
    )
    sync(pods, probed(lab))
    assert backend_sees(lab, OUTSIDE, CLUSTER_IP, 8080) == OUTSIDE
    elsewhere = Config(
        node_name="node-a",
        cluster_cidrs=(ip_network("10.244.0.0/16"),),
        detect_local_mode="ClusterCIDR",
    )
    sync(elsewhere, probed(lab))
    assert backend_sees(lab, OUTSIDE, CLUSTER_IP, 8080) == backend_side
    # --masquerade-all: every ClusterIP connection, pods too; with another mark bit
    everything = Config(
        node_name="node-a",
        cluster_cidrs=(ip_network("10.250.1.0/24"),),
        detect_local_mode="ClusterCIDR",
        masquerade_all=True,
        masquerade_bit=12,
    )
    kernel = sync(everything, probed(lab))
    assert backend_sees(lab, OUTSIDE, CLUSTER_IP, 8080) == backend_side
    saved = subprocess.run(
        ["ip", "netns", "exec", NODE_NS, "iptables-save", "-t", "nat"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--set-xmark 0x1000/0x1000" in saved
    assert "0x4000" not in saved
    assert kernel.node.masquerade_bit == 12


@pytest.fixture
def recording_path(tmp_path: Path) -> tuple[tuple[str, ...], Path]:
    """An `env PATH=...` prefix whose iptables-restore records its argv, then runs the real one."""
    log = tmp_path / "argv"
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for tool in ("iptables-restore", "ip6tables-restore"):
        real = subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True, text=True)
        wrapper = bin_ / tool
        wrapper.write_text(
            f'#!/bin/sh\necho "{tool} $*" >> {log}\nexec {real.stdout.strip()} "$@"\n'
        )
        wrapper.chmod(0o755)
    path = f"{bin_}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
    return ("env", f"PATH={path}"), log


def test_every_restore_waits_for_the_xtables_lock(lab, recording_path):
    prefix, log = recording_path
    sync(
        Config(node_name="node-a"), objects(lab, loadBalancerSourceRanges=[ALLOWED]), prefix=prefix
    )
    lines = log.read_text().splitlines()
    assert lines
    for line in lines:
        assert line.split()[1:] == ["-w", "5", "-W", "100000", "--noflush"], line


def test_a_held_xtables_lock_is_waited_for_and_the_wait_is_bounded(lab, tmp_path):
    """With iptables-legacy, whose tools take the xtables lock (here a private lock file,
    XTABLES_LOCKFILE, never the host's): held by another process for 1.5 s, the fallback's
    sync waits and succeeds; held for 8 s, it gives up after -w's 5 s with the lock named,
    rather than hanging the sync (measured on iptables 1.8.9: legacy restore without -w
    blocks on the lock for as long as it is held)."""
    bin_ = tmp_path / "legacy"
    bin_.mkdir()
    for family in ("iptables", "ip6tables"):
        for verb in ("save", "restore"):
            real = subprocess.run(
                ["sh", "-c", f"command -v {family}-legacy-{verb}"], capture_output=True, text=True
            ).stdout.strip()
            if not real:
                pytest.skip(f"{family}-legacy-{verb} is not installed")
            (bin_ / f"{family}-{verb}").symlink_to(real)
    lock = tmp_path / "xtables.lock"
    lock.touch()
    path = f"{bin_}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
    prefix = ("env", f"PATH={path}", f"XTABLES_LOCKFILE={lock}")

    def held(seconds: float, objs: list[dict[str, Any]]) -> tuple[bool, str, float]:
        holder = subprocess.Popen(["flock", str(lock), "sleep", str(seconds)])
        try:
            time.sleep(0.3)  # the holder has the lock
            commands = Commands(prefix=(*prefix, "ip", "netns", "exec", NODE_NS))
            kernel = IptablesKernel(commands=commands)
            proxier = Proxier(kernel=kernel, config=Config(node_name="node-a"))
            tracker = Tracker(node_name="node-a")
            for kind in (SERVICE, SLICE, NODE):
                tracker.replace(kind, [o for o in objs if o["kind"] == kind])
            started = time.monotonic()
            result = proxier.sync(tracker.take(), full=True)
            took = time.monotonic() - started
        finally:
            holder.terminate()  # the pass has returned: the rest of the hold is not needed
            holder.wait()
        errors = " ".join(str(f.error) for f in result.sync.report.failures)
        return result.ok, errors, took

    ok, errors, took = held(1.5, objects(lab))
    assert ok, errors
    assert took >= 1.0  # it waited for the holder
    ok, errors, took = held(60, objects(lab, "10.96.0.51"))  # a new ClusterIP to write
    assert not ok, took
    assert "xtables lock" in errors.lower()
    # -w 5: it gave up after its own wait, long before the holder's 60 s would end
    assert 4.5 <= took < 45
