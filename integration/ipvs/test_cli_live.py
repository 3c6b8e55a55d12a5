"""`ipvsproxy run --once` and live `ipvsproxy diff` against the real kernel."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from ipvsproxy.cli import main

pytestmark = pytest.mark.vm

EXAMPLES = str(Path(__file__).parents[2] / "examples")
NODE = ["--hostname-override", "node-a", "--service-cidr", "10.96.0.0/16"]


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture
def node_address() -> Iterator[None]:
    """node-a's address (examples/cluster.yaml) on a link of this host: NodePorts listen on
    the host's own addresses, as kube-proxy's (not on the Node object's)."""
    subprocess.run(["ip", "link", "add", "ipvsp-node", "type", "dummy"], check=True)
    subprocess.run(["ip", "addr", "add", "172.31.0.10/32", "dev", "ipvsp-node"], check=True)
    try:
        yield
    finally:
        subprocess.run(["ip", "link", "del", "ipvsp-node"], check=True)


def test_diff_run_once_diff(clean, node_address):
    subprocess.run(["ipvsadm", "-A", "-t", "192.168.99.1:443", "-s", "wlc"], check=True)
    before = invoke("diff", "-o", "json", "--manifests", EXAMPLES, *NODE)
    assert before.exit_code == 1, before.output
    doc = json.loads(before.stdout)
    assert doc["summary"]["bind-address"] == 10
    assert doc["summary"]["add-service"] == 13
    assert "192.168.99.1" not in before.stdout

    # the real console script, once: what an operator runs
    ran = subprocess.run(
        [
            str(Path(sys.executable).parent / "ipvsproxy"),
            "run",
            "--once",
            "--manifests",
            EXAMPLES,
            *NODE,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    assert "failed" not in ran.stdout
    assert "applied" in ran.stdout

    after = invoke("diff", "--manifests", EXAMPLES, *NODE)
    assert after.exit_code == 0, after.output
    assert "In sync: no changes." in after.stdout
    saved = subprocess.run(
        ["ipvsadm-save", "-n"], capture_output=True, text=True, check=True
    ).stdout
    assert "-A -t 192.168.99.1:443 -s wlc" in saved


def test_run_once_reports_failed_operations(clean, tmp_path):
    (tmp_path / "svc.yaml").write_text(
        "kind: Service\nmetadata:\n  name: s\n  namespace: x\n"
        "  annotations: {ipvsproxy.io/scheduler: twos}\n"
        "spec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n"
    )
    from integration.host import kernel_missing_schedulers
    from ipvsproxy.schedulers import Scheduler

    result = invoke("run", "--once", "--manifests", str(tmp_path), *NODE)
    if Scheduler.TWOS in kernel_missing_schedulers():
        assert result.exit_code == 1
        assert "ip_vs_twos not available" in result.stderr
    else:
        assert result.exit_code == 0


def _nat() -> str:
    return subprocess.run(
        ["iptables-save", "-t", "nat"], capture_output=True, text=True, check=True
    ).stdout


def _ipvs() -> str:
    return subprocess.run(["ipvsadm-save", "-n"], capture_output=True, text=True, check=True).stdout


def test_switching_backends_removes_the_other_ones_leftovers_and_cleanup_removes_all(clean):
    """IPVS (its firewall in nftables) -> iptables -> IPVS with its firewall in iptables ->
    IPVS in nftables again, then cleanup: each switch removes what the other left, and only
    ipvsproxy's objects go."""
    foreign_rule = "-A POSTROUTING -s 192.0.2.0/24 -j MASQUERADE"
    subprocess.run(["iptables", "-t", "nat", "-A", "POSTROUTING", "-s", "192.0.2.0/24",
                    "-j", "MASQUERADE"], check=True)  # fmt: skip
    subprocess.run(["nft", "add", "table", "inet", "someone"], check=True)
    subprocess.run(["ipvsadm", "-A", "-t", "192.168.99.1:443", "-s", "wlc"], check=True)
    # the example's node-a address, local here as on a real node: its NodePorts are ours
    subprocess.run(["ip", "addr", "add", "172.31.0.10/32", "dev", "lo"], check=True)
    try:
        assert invoke("run", "--once", "--manifests", EXAMPLES, *NODE).exit_code == 0
        assert "-A -t 10.96.0.10:80" in _ipvs()
        assert "@cluster-ip" in _nft()  # auto: IPVS mode's firewall rules in nftables
        assert "IPVSPROXY-SERVICES" not in _nat()

        ran = invoke("run", "--once", "--manifests", EXAMPLES, *NODE, "--backend", "iptables")
        assert ran.exit_code == 0, ran.output
        assert "10.96.0.10" not in _ipvs()  # the IPVS leftovers went ...
        assert "192.168.99.1:443" in _ipvs()  # ... and nothing else
        assert subprocess.run(["ip", "link", "show", "kube-ipvs0"], capture_output=True).returncode
        assert "-d 10.96.0.10/32" in _nat()
        assert _nft() == ""  # IPVS mode's firewall rules went too

        ran = invoke("run", "--once", "--manifests", EXAMPLES, *NODE, "--firewall", "iptables")
        assert ran.exit_code == 0, ran.output
        assert "IPVSPX" not in _nat()
        assert "IPVSPROXY-SERVICES" in _nat()  # IPVS mode's firewall rules, in iptables
        assert "172.31.0.10,tcp:30080" in _created()  # its record of the node's NodePort

        ran = invoke("run", "--once", "--manifests", EXAMPLES, *NODE)  # auto: nftables again
        assert ran.exit_code == 0, ran.output
        assert "IPVSPROXY" not in _nat()  # the iptables firewall went ...
        assert "172.31.0.10 . tcp . 30080" in _nft()  # ... the record now in nftables
        assert foreign_rule in _nat()
        assert "-A -t 10.96.0.10:80" in _ipvs()

        done = invoke("cleanup", "--service-cidr", "10.96.0.0/16")  # ownership: no node name
        assert done.exit_code == 0, done.output
        assert "removed: IPVS: ipvsadm -D -t 10.96.0.10:80" in done.stdout
        assert _ipvs().strip().splitlines() == ["-A -t 192.168.99.1:443 -s wlc"]
        assert foreign_rule in _nat()
        filter_rules = subprocess.run(
            ["iptables-save", "-t", "filter"], capture_output=True, text=True, check=True
        ).stdout
        assert "IPVSPROXY" not in _nat() + filter_rules  # the firewall rules went too ...
        sets = subprocess.run(["ipset", "list", "-n"], capture_output=True, text=True).stdout
        assert "IPVSPROXY" not in sets  # ... and then their sets
        assert _nft() == ""
        tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
        assert "table inet someone" in tables  # someone else's table stays
        assert subprocess.run(["ip", "link", "show", "kube-ipvs0"], capture_output=True).returncode
    finally:
        subprocess.run(["ip", "addr", "del", "172.31.0.10/32", "dev", "lo"], check=False)
        subprocess.run(["nft", "delete", "table", "inet", "someone"], check=False)
        subprocess.run(["iptables", "-t", "nat", "-D", "POSTROUTING", "-s", "192.0.2.0/24",
                        "-j", "MASQUERADE"], check=False)  # fmt: skip


def _nft() -> str:
    """ipvsproxy's nftables table as `nft list` prints it ("": not there)."""
    listed = subprocess.run(["nft", "list", "table", "inet", "ipvsproxy"], capture_output=True,
                            text=True)  # fmt: skip
    return listed.stdout if listed.returncode == 0 else ""


def _created() -> str:
    listed = subprocess.run(["ipset", "list", "IPVSPROXY-CREATED"], capture_output=True, text=True)
    return listed.stdout
