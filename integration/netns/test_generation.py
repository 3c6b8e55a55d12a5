"""nf_tables' generation against this host's kernel, in a throw-away network namespace: a
save does not move it, any rule change does (another family's and another table's too), and
the firewall's chains are re-read, and their drift planned for repair, after a rule was
added behind its back (the tools here are iptables-nft)."""

from __future__ import annotations

import subprocess

import pytest

from integration.lab import inside
from ipvsproxy.firewall.host_firewall import Firewall, Observed, plan_firewall
from ipvsproxy.firewall.rules import Options
from ipvsproxy.firewall.sets import wanted
from ipvsproxy.host.commands import Commands
from ipvsproxy.iptables.generation import RulesetGeneration
from ipvsproxy.model import IpvsState

pytestmark = pytest.mark.netns


def in_ns(netns: str, *args: str) -> str:
    done = subprocess.run(["ip", "netns", "exec", netns, *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_generation_moves_with_every_rule_change_and_only_then(netns: str) -> None:
    if "nf_tables" not in in_ns(netns, "iptables", "-V"):
        pytest.skip("the iptables tools here are not the nf_tables variant")
    with inside(netns):
        generation = RulesetGeneration.open()
    try:
        start = generation.current()
        assert start is not None
        in_ns(netns, "iptables-save")
        in_ns(netns, "ip6tables-save")
        assert generation.current() == start
        in_ns(netns, "iptables", "-t", "nat", "-N", "SOMEONE")
        moved = generation.current()
        assert moved is not None
        assert moved != start
        in_ns(netns, "ip6tables", "-t", "filter", "-N", "ELSE")
        assert generation.current() not in (None, moved)
    finally:
        generation.close()


class Counting(Commands):
    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "saves", [])

    def run(self, args, *, stdin=None):
        if args[0].endswith("-save"):
            self.saves.append(list(args))  # type: ignore[attr-defined]
        return super().run(args, stdin=stdin)


def test_an_idle_observation_saves_nothing_and_drift_is_still_seen(netns: str) -> None:
    if "nf_tables" not in in_ns(netns, "iptables", "-V"):
        pytest.skip("the iptables tools here are not the nf_tables variant")
    commands = Counting()
    with inside(netns):
        firewall = Firewall(commands=commands, generation=RulesetGeneration.open())
        firewall.check()
        try:
            options, sets = Options(), wanted(IpvsState(), {})
            firewall.apply(firewall.plan(sets))
            seen = firewall.observe()
            assert not plan_firewall(sets, seen, options, firewall.versions)
            saves = len(commands.saves)  # type: ignore[attr-defined]
            for _ in range(3):
                assert firewall.observe_chains() == seen.chains
            assert len(commands.saves) == saves  # type: ignore[attr-defined]
            chain = next(c for (v, t), s in seen.chains.items() if v == 4 for c in s.chains)
            table = next(t for (v, t), s in seen.chains.items() if v == 4 and chain in s.chains)
            in_ns(netns, "iptables", "-t", table, "-A", chain, "-j", "RETURN")
            drifted = Observed(seen.sets, firewall.observe_chains())
            assert len(commands.saves) > saves  # type: ignore[attr-defined]
            repair = plan_firewall(sets, drifted, options, firewall.versions)
            assert any(t == table for _, t, _ in repair.restores)
        finally:
            firewall.close()


def test_sets_are_decoded_again_only_when_their_dump_changed(
    netns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ipvsproxy.firewall import set_reader

    decoded: list[bytes] = []
    real = set_reader.decode_entry

    def counting(data: bytes) -> str:
        decoded.append(data)
        return real(data)

    monkeypatch.setattr(set_reader, "decode_entry", counting)
    name = "IPVSPROXY-CLUSTER-IP"  # one of ipvsproxy's names: only those are read
    in_ns(netns, "ipset", "create", name, "hash:ip,port")
    script = "".join(f"add {name} 10.0.0.{port % 7},tcp:{port}\n" for port in range(100))
    subprocess.run(
        ["ip", "netns", "exec", netns, "ipset", "restore"], input=script, text=True, check=True
    )
    with inside(netns):
        reader = set_reader.SetReader()
    try:
        first = reader.observe().sets[name][2]
        assert len(first) == 100
        assert len(decoded) == 100
        assert reader.observe().sets[name][2] == first
        assert len(decoded) == 100  # the same bytes: nothing decoded
        in_ns(netns, "ipset", "del", name, "10.0.0.0,tcp:0")  # the same count, other entries
        in_ns(netns, "ipset", "add", name, "10.9.9.9,udp:53")
        after = reader.observe().sets[name][2]
        assert after == (first - {"10.0.0.0,tcp:0"}) | {"10.9.9.9,udp:53"}
    finally:
        reader.close()


def test_the_fallback_s_idle_observation_saves_nothing_and_still_finds_damage(
    netns: str,
) -> None:
    from ipaddress import ip_address

    from ipvsproxy.fallback import IptablesKernel
    from ipvsproxy.model import AddDest, AddService, Proto, RealServer, RSKey, VirtualServer, VSKey

    if "nf_tables" not in in_ns(netns, "iptables", "-V"):
        pytest.skip("the iptables tools here are not the nf_tables variant")
    commands = Counting()
    key = VSKey(ip_address("10.96.0.10"), 80, Proto.TCP)
    with inside(netns):
        kernel = IptablesKernel(commands=commands)
        kernel.check()
        kernel.observe()
        rs = RealServer(RSKey(ip_address("10.244.0.1"), 8080))
        assert kernel.apply([AddService(VirtualServer(key)), AddDest(key, rs)]).ok
        state = kernel.observe()  # after our own write: saved again
        saves = len(commands.saves)  # type: ignore[attr-defined]
        for _ in range(3):
            assert kernel.observe() == state
            assert kernel.damage() == ()
        assert len(commands.saves) == saves  # type: ignore[attr-defined]
        chain = next(
            line.split()[1]
            for line in in_ns(netns, "iptables-save", "-t", "nat").splitlines()
            if line.startswith("-A IPVSPX-SVC-")
        )
        in_ns(netns, "iptables", "-t", "nat", "-I", chain, "-j", "RETURN")
        kernel.observe()
        assert len(commands.saves) > saves  # type: ignore[attr-defined]
        assert kernel.damage()
