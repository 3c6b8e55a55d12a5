"""Ownership by exact names and rules read by tokens, on this host's real iptables and ipset
(issue 28, items 1 and 4), each in a throw-away network namespace: a chain or set of someone
else named like ours is never touched; a rule of someone else that jumps into a chain of
ours no longer wanted keeps that chain (emptied) while the rest of the pass goes in; a
comment is never read as a jump by `cleanup --kube-proxy`."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from integration.lab import IPVSPROXY
from ipvsproxy.firewall.host_firewall import Firewall, plan_firewall
from ipvsproxy.firewall.rules import Options
from ipvsproxy.firewall.sets import wanted
from ipvsproxy.host.commands import Commands
from ipvsproxy.model import IpvsState
from tests.factories import ep, node, service, slice_

pytestmark = pytest.mark.netns


def in_ns(ns: str, *args: str, stdin: str | None = None, check: bool = True) -> str:
    done = subprocess.run(
        ["ip", "netns", "exec", ns, *args], input=stdin, capture_output=True, text=True
    )
    assert done.returncode == 0 or not check, done.stderr
    return done.stdout + done.stderr


def save(ns: str, table: str = "nat") -> str:
    text = in_ns(ns, "iptables-save", "-t", table)
    return "\n".join(line for line in text.splitlines() if not line.startswith("#"))


def manifest(path: Path, *names: str, first: int = 1) -> Path:
    objects = [node()]
    for n, name in enumerate(names, start=first):
        objects += [
            service(name, cluster_ips=(f"10.96.0.{n}",)),
            slice_(name, endpoints=[ep(f"10.244.0.{n}")]),
        ]
    path.write_text(yaml.safe_dump_all(objects))
    return path


def run_once(ns: str, path: Path) -> str:
    args = ("run", "--once", "--backend", "iptables", "--manifests", str(path))
    return in_ns(ns, IPVSPROXY, *args)


FOREIGN_NAT = """*nat
:IPVSPX-X - [0:0]
:IPVSPX-SVC-mine - [0:0]
-A PREROUTING -s 192.0.2.0/24 -j IPVSPX-X
-A IPVSPX-X -s 192.0.2.7/32 -j RETURN
COMMIT
"""


def test_a_foreign_chain_named_like_ours_is_never_claimed(netns: str, tmp_path: Path) -> None:
    """The issue's node: before, `run --once` tried to delete IPVSPX-X (CHAIN_DEL busy), the
    one transaction wrote no Service rule, and exit 1."""
    in_ns(netns, "iptables-restore", "--noflush", stdin=FOREIGN_NAT)
    run_once(netns, manifest(tmp_path / "m.yaml", "web"))
    nat = save(netns)
    assert "-A IPVSPX-SERVICES -d 10.96.0.1/32 -p tcp" in nat
    assert "-A PREROUTING -s 192.0.2.0/24 -j IPVSPX-X" in nat
    assert "-A IPVSPX-X -s 192.0.2.7/32 -j RETURN" in nat
    assert ":IPVSPX-SVC-mine" in nat
    done = in_ns(netns, IPVSPROXY, "cleanup")
    assert "IPVSPX-X" not in done
    assert "IPVSPX-SVC-mine" not in done
    nat = save(netns)
    assert "IPVSPX-SERVICES" not in nat
    assert "-A IPVSPX-X -s 192.0.2.7/32 -j RETURN" in nat
    assert "-A PREROUTING -s 192.0.2.0/24 -j IPVSPX-X" in nat
    assert ":IPVSPX-SVC-mine" in nat


def test_a_foreign_jump_into_a_chain_of_ours_keeps_it_and_the_rest_goes_in(
    netns: str, tmp_path: Path
) -> None:
    """Before, deleting the Service's chain made iptables refuse the whole transaction:
    the new Service was not written either, on every pass."""
    run_once(netns, manifest(tmp_path / "one.yaml", "web"))
    (chain,) = re.findall(r"-d 10\.96\.0\.1/32 .* -j (IPVSPX-SVC-\w+)", save(netns))
    in_ns(netns, "iptables", "-t", "nat", "-N", "OTHER")
    in_ns(netns, "iptables", "-t", "nat", "-A", "OTHER", "-j", chain)
    out = run_once(netns, manifest(tmp_path / "two.yaml", "api", first=2))  # web gone, api new
    nat = save(netns)
    assert "-A IPVSPX-SERVICES -d 10.96.0.2/32" in nat
    assert "-A IPVSPX-SERVICES -d 10.96.0.1/32" not in nat
    assert f":{chain} - [0:0]" in nat
    assert f"-A {chain} " not in nat  # emptied, kept for the rule of others
    assert f"-A OTHER -j {chain}" in nat
    assert out.count(f"still jumped to by '-A OTHER -j {chain}'") == 1, out
    in_ns(netns, "iptables", "-t", "nat", "-F", "OTHER")  # the other owner lets go
    run_once(netns, manifest(tmp_path / "two.yaml", "api", first=2))
    assert f":{chain} " not in save(netns)


FILTER = r"""*filter
:KUBE-FORWARD - [0:0]
-A INPUT -s 192.0.2.0/24 -m comment --comment "-j KUBE-FORWARD via" -j DROP
-A FORWARD -m comment --comment "a\" -j ACCEPT \"b" -j KUBE-FORWARD
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
COMMIT
"""


def test_cleanup_reads_comments_as_comments(netns: str) -> None:
    """Before, the DROP rule was taken for a jump and deleted (opening the firewall), and
    the real jump was missed: CHAIN_DEL busy, exit 2."""
    in_ns(netns, "iptables-restore", "--noflush", stdin=FILTER)
    in_ns(netns, IPVSPROXY, "cleanup", "--kube-proxy", "--force")  # no agent here
    rules = save(netns, "filter")
    assert '-A INPUT -s 192.0.2.0/24 -m comment --comment "-j KUBE-FORWARD via" -j DROP' in rules
    assert "KUBE-FORWARD -" not in rules.replace('"-j KUBE-FORWARD via"', "")
    assert ":KUBE-FORWARD" not in rules


def test_the_firewall_claims_only_its_exact_names(netns: str) -> None:
    """IPVS mode's rules and sets beside IPVSPROXY-X (with a jump into it) and IPVSPROXY-MINE:
    written and cleaned up, the others untouched (before: claimed by prefix)."""
    nat = FOREIGN_NAT.replace("IPVSPX-SVC-mine", "IPVSPROXY-SERVICES-X").replace(
        "IPVSPX-X", "IPVSPROXY-X"
    )
    in_ns(netns, "iptables-restore", "--noflush", stdin=nat)
    in_ns(netns, "ipset", "create", "IPVSPROXY-MINE", "hash:ip")
    firewall = Firewall(commands=Commands(prefix=("ip", "netns", "exec", netns)), versions=(4,))
    firewall.check()
    firewall.versions = (4,)
    options = Options()
    firewall.apply(plan_firewall(wanted(IpvsState(), {}), firewall.observe(), options, (4,)))
    assert "-A IPVSPROXY-SERVICES" in save(netns)
    firewall.cleanup()
    after = save(netns)
    assert ":IPVSPROXY-SERVICES " not in after
    assert "-A PREROUTING -s 192.0.2.0/24 -j IPVSPROXY-X" in after
    assert "-A IPVSPROXY-X -s 192.0.2.7/32 -j RETURN" in after
    assert ":IPVSPROXY-SERVICES-X" in after
    assert in_ns(netns, "ipset", "list", "-n").split() == ["IPVSPROXY-MINE"]
