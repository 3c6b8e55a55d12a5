"""The iptables backend against this host's real iptables, in a throw-away network namespace:
the Kernel contract, idempotence, drift repair, foreign rules, hostile names, cleanup."""

from __future__ import annotations

import random
import re
import subprocess
import uuid
from dataclasses import dataclass, field, replace
from ipaddress import ip_address, ip_network
from pathlib import Path

import pytest

from ipvsproxy import manifests
from ipvsproxy.config import Config
from ipvsproxy.fallback import IptablesKernel
from ipvsproxy.fallback.chains import SERVICES, sep_chain, svc_chain
from ipvsproxy.host.commands import Commands
from ipvsproxy.model import (
    AddDest,
    AddService,
    BindAddress,
    IpvsState,
    Proto,
    RealServer,
    RSKey,
    VirtualServer,
    VSKey,
)
from ipvsproxy.proxier import Proxier
from ipvsproxy.schedulers import Scheduler
from ipvsproxy.sync.ownership import Ownership, ownership_for
from ipvsproxy.sync.plan import plan
from tests.contract.kernel_contract import KernelContract
from tests.factories import desired_from_manifests
from tests.support import Synced

pytestmark = pytest.mark.netns
EXAMPLES = Path(__file__).parent.parent.parent / "examples"
FOREIGN = (
    "-A PREROUTING -d 192.0.2.1/32 -p tcp -m tcp --dport 22 -j DNAT --to-destination 192.0.2.2:22"
)


def run(ns: str, *args: str, stdin: str | None = None) -> str:
    return subprocess.run(
        ["ip", "netns", "exec", ns, *args], input=stdin, capture_output=True, text=True, check=True
    ).stdout


def save(ns: str) -> str:
    """Both families' nat tables, without the timestamp comment lines."""
    text = run(ns, "iptables-save", "-t", "nat") + run(ns, "ip6tables-save", "-t", "nat")
    return "\n".join(line for line in text.splitlines() if not line.startswith("#"))


def make_kernel(ns: str) -> IptablesKernel:
    kernel = IptablesKernel(commands=Commands(prefix=("ip", "netns", "exec", ns)))
    kernel.check()
    return kernel


class TestIptablesKernel(KernelContract):
    @pytest.fixture
    def kernel(self, netns) -> IptablesKernel:
        return make_kernel(netns)

    @pytest.fixture
    def has_counters(self) -> bool:
        return False


def example_sync(kernel: IptablesKernel, config: Config) -> tuple[int, int]:
    """One full pass of a new proxier (a restarted agent) over the bundled example."""
    result = Synced(Proxier(kernel=kernel, config=config)).sync(manifests.load([EXAMPLES]))
    return len(result.sync.plan), len(result.sync.report.failures)


CONFIG = Config(node_name="node-a")


def test_a_second_sync_changes_nothing(netns):
    kernel = make_kernel(netns)
    ops, failed = example_sync(kernel, CONFIG)
    assert ops > 20
    assert failed == 0
    before = save(netns)
    fresh = make_kernel(netns)  # a restarted agent reads everything back from iptables-save
    assert example_sync(fresh, CONFIG) == (0, 0)
    assert fresh.damage() == ()
    assert save(netns) == before


def test_drift_is_repaired_by_the_next_sync(netns):
    kernel = make_kernel(netns)
    example_sync(kernel, CONFIG)
    good = save(netns)
    dispatch = next(line for line in good.splitlines() if line.startswith(f"-A {SERVICES} "))
    svc = dispatch.rsplit(" ", 1)[1]
    first_rule = next(line for line in good.splitlines() if line.startswith(f"-A {svc} "))
    run(netns, "iptables", "-t", "nat", "-D", *first_rule[3:].replace('"', "").split())
    run(netns, "iptables", "-t", "nat", "-A", svc, "-s", "203.0.113.9", "-j", "RETURN")
    run(netns, "iptables", "-t", "nat", "-D", "OUTPUT", "1")  # our jump
    assert save(netns) != good
    fresh = make_kernel(netns)
    fresh.observe()
    damage = fresh.damage()
    assert any(svc in d for d in damage), damage
    assert any("jumps from OUTPUT" in d for d in damage), damage
    assert example_sync(fresh, CONFIG)[1] == 0
    assert save(netns) == good
    assert make_kernel(netns).observe() is not None


def test_foreign_rules_survive_syncs_and_cleanup(netns):
    run(
        netns,
        "iptables-restore",
        "--noflush",
        stdin=f"*nat\n{FOREIGN}\n:MINE - [0:0]\n-A MINE -j RETURN\nCOMMIT\n",
    )
    kernel = make_kernel(netns)
    example_sync(kernel, CONFIG)
    example_sync(kernel, Config(node_name="node-b"))  # other endpoints are local: changes
    assert FOREIGN in save(netns)
    assert "-A MINE -j RETURN" in save(netns)
    removed = kernel.cleanup()
    assert any(SERVICES in r for r in removed)
    after = save(netns)
    assert "IPVSPX" not in after
    assert FOREIGN in after
    assert "-A MINE -j RETURN" in after
    assert kernel.cleanup() == []


def test_cleanup_dry_run_changes_nothing(netns):
    kernel = make_kernel(netns)
    example_sync(kernel, CONFIG)
    before = save(netns)
    assert kernel.cleanup(dry_run=True)
    assert save(netns) == before


HOSTILE = "we\"ird' name $(touch /tmp/pwned) `id`; \n-A INPUT -j DROP\r\n#\\ --comment x"


def test_hostile_names_give_valid_harmless_rules(netns):
    kernel = make_kernel(netns)
    key = VSKey(ip_address("10.96.7.7"), 80, Proto.TCP)
    rs = RealServer(RSKey(ip_address("10.244.7.7"), 8080))
    report = kernel.apply(
        [AddService(VirtualServer(key, Scheduler.LC)), AddDest(key, rs), BindAddress(key.address)],
        names={key: HOSTILE},
    )
    assert report.failures == ()
    text = save(netns)
    assert not Path("/tmp/pwned").exists()
    rules = [line for line in text.splitlines() if line.startswith("-A ")]
    assert all(line.count('"') in (0, 2) for line in rules)
    outside_comments = [re.sub(r'"[^"]*"', "", line) for line in rules]
    assert not any("INPUT" in line or "DROP" in line for line in outside_comments)
    assert all("IPVSPX" in line for line in rules)
    fresh = make_kernel(netns)
    assert fresh.observe().services[key].scheduler is Scheduler.LC
    assert fresh.damage() == ()
    assert svc_chain(key) in text
    assert sep_chain(key, rs.key) in text


def test_plan_on_the_example_converges_and_names_the_services(netns):
    kernel = make_kernel(netns)
    desired, node = desired_from_manifests([EXAMPLES], CONFIG)
    own = ownership_for(CONFIG, node.addresses)
    ops = plan(desired.state, kernel.observe(), ownership=own)
    assert kernel.apply(ops, names=desired.origins).failures == ()
    text = save(netns)
    for origin in set(desired.origins.values()):
        assert origin in text


def test_hostile_service_objects_through_the_whole_path(netns):
    """Names, namespaces, port names and annotations from the API, as hostile as they come."""
    from tests.factories import ep, node, port, service, slice_

    name = 'x" -j DROP; $(reboot)\n-A INPUT -j ACCEPT'
    svc = service(
        name,
        ns='ns"\n*filter',
        cluster_ips=("10.96.9.9",),
        ports=[port('p"\n', 80, "TCP", 8080)],
        annotations={"ipvsproxy.io/scheduler": 'sh"\nCOMMIT', "other": '"; rm -rf /'},
    )
    slice_obj = slice_(name, ns='ns"\n*filter', ports=(('p"\n', 8080, "TCP"),),
                       endpoints=[ep("10.244.9.9")])  # fmt: skip
    objects = [node(), svc, slice_obj]
    kernel = make_kernel(netns)
    result = Synced(Proxier(kernel=kernel, config=CONFIG)).sync(objects).sync
    assert result.report.failures == ()
    assert len(result.plan) >= 3
    text = save(netns)
    rules = [line for line in text.splitlines() if line.startswith("-A ")]
    assert all(line.count('"') in (0, 2) for line in rules)
    outside_comments = [re.sub(r'"[^"]*"', "", line) for line in rules]
    assert not any(w in line for line in outside_comments for w in ("INPUT", "DROP", "ACCEPT"))
    assert "*filter" not in text
    again = Synced(Proxier(kernel=make_kernel(netns), config=CONFIG)).sync(objects)
    assert again.sync.plan == ()


@dataclass(frozen=True)
class Counting(Commands):
    tools: list[str] = field(default_factory=list)

    def run(self, args, *, stdin=None):
        self.tools.append(args[0])
        return super().run(args, stdin=stdin)


EVERYTHING = Ownership(service_cidrs=(ip_network("0.0.0.0/0"), ip_network("::/0")))


def changed(state: IpvsState, rng: random.Random, n: int) -> IpvsState:
    """One random change: a weight, an endpoint added or removed, a Service added or
    removed, a VIP bound or unbound (a ClusterIP becoming a NodePort's address)."""
    services, dests = dict(state.services), {k: dict(v) for k, v in state.dests.items()}
    bound = set(state.bound)
    key = rng.choice(sorted(services, key=str))
    kind = n % 6
    if kind == 0 and dests[key]:
        rs = rng.choice(sorted(dests[key].values(), key=str))
        dests[key][rs.key] = replace(rs, weight=rng.randint(0, 3))
    elif kind == 1:
        rs = RealServer(RSKey(ip_address(f"10.244.9.{n % 250}"), 8080 + n))
        dests[key][rs.key] = rs
    elif kind == 2 and dests[key]:
        del dests[key][rng.choice(sorted(dests[key], key=str))]
    elif kind == 3:
        new = VSKey(ip_address(f"10.96.8.{n % 250}"), 80, Proto.TCP)
        services[new] = VirtualServer(new, Scheduler.WRR)
        dests[new] = {RS.key: RS for RS in [RealServer(RSKey(ip_address("10.244.8.1"), 80))]}
        bound.add(new.address)
    elif kind == 4:
        del services[key], dests[key]
    else:
        bound ^= {key.address}
    return IpvsState(services, dests, frozenset(bound))


def ours(text: str) -> list[str]:
    return [line for line in text.splitlines() if "IPVSPX" in line]


def others(text: str) -> list[str]:
    return [line for line in text.splitlines() if "IPVSPX" not in line]


def test_partial_syncs_then_a_full_observation_agree(netns):
    """After a full sync and N partial ones (no iptables-save in between), a full
    observation reads back exactly what the partial syncs produced, the chains are the
    text a from-scratch load of that state gives, and nothing else in the tables moved."""
    run(netns, "iptables-restore", "--noflush", stdin=f"*nat\n{FOREIGN}\nCOMMIT\n")
    commands = Counting(prefix=("ip", "netns", "exec", netns))
    kernel = IptablesKernel(commands=commands)
    kernel.check()
    state = IpvsState(
        {vs.key: vs for vs in (VirtualServer(k) for k in KEYS)},
        {k: {rs.key: rs for rs in DESTS} for k in KEYS},
        frozenset(k.address for k in KEYS[::2]),
    )
    assert kernel.apply(plan(state, kernel.observe(), ownership=EVERYTHING)).failures == ()
    before = save(netns)
    commands.tools.clear()
    rng = random.Random(13)
    for n in range(30):
        new = changed(state, rng, n)
        assert kernel.apply(plan(new, state, ownership=EVERYTHING)).failures == ()
        state = new
    assert "iptables-save" not in commands.tools
    assert "ip6tables-save" not in commands.tools
    assert commands.tools.count("iptables-restore") <= 30
    fresh = make_kernel(netns)
    assert fresh.observe() == state
    assert fresh.damage() == ()
    after = save(netns)
    assert others(after) == others(before)
    scratch = f"ipvsp-s{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", scratch], check=True)
    try:
        reference = make_kernel(scratch)
        assert reference.apply(plan(state, reference.observe(), ownership=EVERYTHING)).ok
        assert sorted(ours(after)) == sorted(ours(save(scratch)))
    finally:
        subprocess.run(["ip", "netns", "del", scratch], check=True)


KEYS = [VSKey(ip_address(f"10.96.7.{n}"), 80 + n % 3, Proto.TCP) for n in range(12)]
DESTS = [RealServer(RSKey(ip_address(f"10.244.7.{n}"), 8080), weight=1 + n % 2) for n in range(4)]
