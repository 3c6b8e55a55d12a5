"""SetWriter against this host's kernel, in throw-away network namespaces: every command for
each set type and family leaves what `ipset restore -exist` leaves (`ipset save`, minus the
random initval), at 10,000 entries too, and the firewall's full and partial paths through
the writer leave the same sets as through the tool."""

from __future__ import annotations

import re
import subprocess
import uuid
from collections.abc import Iterator
from ipaddress import ip_address

import pytest

from integration.lab import inside
from ipvsproxy.errors import KernelError
from ipvsproxy.firewall.host_firewall import Firewall, plan_firewall
from ipvsproxy.firewall.ipset import SetChange, SetCommand, ipset_script, set_commands
from ipvsproxy.firewall.rules import Options
from ipvsproxy.firewall.set_index import SetIndex
from ipvsproxy.firewall.set_writer import SetWriter
from ipvsproxy.firewall.sets import wanted
from ipvsproxy.host.commands import Commands
from ipvsproxy.model import IpvsState, Proto, RealServer, RSKey, VirtualServer, VSKey
from tests.factories import state_of

pytestmark = pytest.mark.netns


@pytest.fixture
def pair() -> Iterator[tuple[str, str]]:
    """Two namespaces: the writer's and the tool's."""
    names = (f"ipvsp-w{uuid.uuid4().hex[:8]}", f"ipvsp-t{uuid.uuid4().hex[:8]}")
    for name in names:
        subprocess.run(["ip", "netns", "add", name], check=True)
    yield names
    for name in names:
        subprocess.run(["ip", "netns", "del", name], check=True)


def save(ns: str) -> list[str]:
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "ipset", "save"], capture_output=True, text=True, check=True
    ).stdout
    return sorted(re.sub(r" initval 0x[0-9a-f]+", "", line) for line in out.splitlines())


def tool(ns: str, changes: list[SetChange]) -> None:
    script = ipset_script(changes)
    subprocess.run(
        ["ip", "netns", "exec", ns, "ipset", "restore", "-exist"],
        input=script,
        text=True,
        check=True,
    )


def writer_in(ns: str) -> SetWriter:
    with inside(ns):
        return SetWriter()


def entry(kind: str, version: int, i: int) -> str:
    ip = f"10.{i // 65536}.{i // 256 % 256}.{i % 256}" if version == 4 else f"fd00::{i:x}"
    proto = ("tcp", "udp", "sctp")[i % 3]
    if kind == "hash:ip":
        return ip
    if kind == "hash:ip,port":
        return f"{ip},{proto}:{i % 50000 + 1}"
    if kind == "hash:ip,port,ip":
        return f"{ip},{proto}:{i % 50000 + 1},{ip}"
    net = ("10.8.0.0/16" if version == 4 else "fd01::/64") if i % 2 else ip
    return f"{ip},{proto}:{i % 50000 + 1},{net}"


KINDS = ("hash:ip", "hash:ip,port", "hash:ip,port,ip", "hash:ip,port,net")


@pytest.mark.parametrize("version", [4, 6])
@pytest.mark.parametrize("kind", KINDS)
def test_each_command_leaves_what_the_tool_leaves(pair, kind, version):
    mine, theirs = pair
    writer = writer_in(mine)
    name = f"IPVSPROXY-{kind.replace(':', '-').replace(',', '-').upper()}"
    first = frozenset(entry(kind, version, i) for i in range(10))
    bigger = frozenset(entry(kind, version, i) for i in range(5, 200))
    steps = [
        [SetChange(name, kind, version, create=True, add=tuple(sorted(first)), wanted=first)],
        [
            SetChange(
                name,
                kind,
                version,
                add=(entry(kind, version, 10),),
                delete=tuple(sorted(first)[:3]),
            )
        ],
        [SetChange(name, kind, version, add=tuple(sorted(bigger)), wanted=bigger)],  # swapped
        [SetChange(name, kind, version, wanted=bigger, rebuild=True)],  # bigger, swapped
        [SetChange(name, kind, version, create=True, wanted=bigger)],  # exists: -exist
        [
            SetChange(
                name,
                kind,
                version,
                add=(entry(kind, version, 6),),
                delete=(entry(kind, version, 300),),
            )
        ],
    ]
    for step in steps:
        writer.write(set_commands(step))
        tool(theirs, step)
        assert save(mine) == save(theirs)
    assert len(save(mine)) == 1 + len(bigger)
    for command in ("flush", "destroy"):
        writer.write([SetCommand(command, name)])
        subprocess.run(["ip", "netns", "exec", theirs, "ipset", command, name], check=True)
        assert save(mine) == save(theirs)
    assert save(mine) == []
    writer.close()


def test_ten_thousand_entries_in_a_few_sends(pair):
    mine, theirs = pair
    writer = writer_in(mine)
    entries = frozenset(entry("hash:ip,port,ip", 4, i) for i in range(10000))
    change = [
        SetChange(
            "IPVSPROXY-LOOP-BACK",
            "hash:ip,port,ip",
            4,
            create=True,
            add=tuple(entries),
            wanted=entries,
        )
    ]
    assert writer.write(set_commands(change)) <= 5
    tool(theirs, change)
    assert save(mine) == save(theirs)
    assert len(save(mine)) == 10001
    writer.close()


def test_the_kernel_refusal_names_the_entry_and_the_rest_is_as_with_the_tool(pair):
    mine, _ = pair
    writer = writer_in(mine)
    made = [SetChange("IPVSPROXY-VIPS", "hash:ip", 4, create=True, wanted=frozenset())]
    writer.write(set_commands(made))
    bad = [SetChange("IPVSPROXY-VIPS", "hash:ip", 4, add=("10.0.0.1", "fd00::1", "10.0.0.2"))]
    with pytest.raises(KernelError, match="ipset add IPVSPROXY-VIPS fd00::1"):
        writer.write(set_commands(bad))
    added = [line for line in save(mine) if line.startswith("add")]
    assert added == ["add IPVSPROXY-VIPS 10.0.0.1"]  # as `ipset restore` stops there
    writer.close()


def state(services: int, endpoints: int) -> IpvsState:
    found = {}
    for i in range(services):
        key = VSKey(ip_address(f"10.97.{i // 250}.{i % 250 + 1}"), 80, Proto.TCP)
        found[VirtualServer(key)] = [
            RealServer(RSKey(ip_address(f"10.244.{k // 250}.{k % 250 + 2}"), 8080))
            for k in range(i * endpoints, (i + 1) * endpoints)
        ]
    return state_of(found, bound=frozenset(vs.key.address for vs in found))


def test_the_firewalls_full_and_partial_paths_leave_the_tools_sets(pair):
    mine, theirs = pair
    writer = writer_in(mine)
    firewalls = [
        Firewall(commands=Commands(prefix=("ip", "netns", "exec", ns)), versions=(4,), writer=w)
        for ns, w in ((mine, writer), (theirs, None))
    ]
    everyone = state(100, 3)
    local = frozenset(rs.address for dests in everyone.dests.values() for rs in dests)
    want = wanted(everyone, {}, local=local)
    for firewall in firewalls:  # the full path: observe, plan, apply
        firewall.apply(plan_firewall(want, firewall.observe(), Options(), (4,)))
    assert save(mine) == save(theirs)
    assert (
        len(save(mine)) == 9 + 3 * 100 + 300
    )  # 9 creates (CREATED, the record, among them); CLUSTER-IP, SERVICE-PORTS, VIPS; LOOP-BACK
    fewer = state(40, 2)  # the partial path: a SetIndex's changes, swapped and in place
    for firewall in firewalls:
        index = SetIndex(versions=(4,))
        index.seed(firewall.observe_sets())
        index.reset(fewer, {}, local=local)
        assert firewall.write_sets(index.take()) > 0
    assert save(mine) == save(theirs)
    for firewall in firewalls:  # and a full sync after it: nothing to do
        assert not plan_firewall(
            wanted(fewer, {}, local=local), firewall.observe(), Options(), (4,)
        ).sets
    writer.close()
