"""The NAT/filter policy (ipvsproxy/policy.py) as both backends render it: the iptables
fallback's chains, traced like kube-proxy's packet-flow tests, and the IPVS firewall's sets
agree on who is masqueraded and who may reach a LoadBalancer; source ranges guard the
LoadBalancer frontend only, never the ClusterIP, externalIP or NodePort of the same Service.
Through the proxier, the ranges hold from the first sync, and a Service that only gains or
loses ranges is rewritten by the next partial pass."""

from __future__ import annotations

import copy
from ipaddress import ip_address, ip_network
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ipvsproxy.config import Config
from ipvsproxy.fallback import IptablesKernel
from ipvsproxy.fallback.chains import EXT_PREFIX, MARK_MASQ, POSTROUTING, SERVICES, svc_chain
from ipvsproxy.firewall.sets import wanted
from ipvsproxy.model import IPAddress, Proto, VSKey
from ipvsproxy.policy import (
    DEFAULT_NODE,
    Frontend,
    LocalMode,
    Masquerade,
    NodePolicy,
    frontend_policy,
    node_policy,
)
from ipvsproxy.proxier import Proxier
from ipvsproxy.sync.desired import Access, Desired
from ipvsproxy.sync.ownership import Ownership
from ipvsproxy.sync.plan import plan
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, Tracker
from tests.factories import ep, node, port, service, slice_, translate
from tests.support import FakeIptables

EVERYTHING = Ownership(service_cidrs=(ip_network("0.0.0.0/0"), ip_network("::/0")))
CLUSTER_IP, LB_IP, EXTERNAL_IP = "10.96.0.30", "203.0.113.7", "198.51.100.9"
NODE_IP = "192.168.0.10"
INSIDE, OUTSIDE, POD = "192.0.2.10", "100.64.0.1", "10.244.1.5"


def key(address: str, number: int = 80) -> VSKey:
    return VSKey(ip_address(address), number, Proto.TCP)


def balanced(**spec: Any) -> Desired:
    """A LoadBalancer Service with loadBalancerSourceRanges, an externalIP and a NodePort."""
    spec = {"loadBalancerSourceRanges": ["192.0.2.0/24", "2001:db8::/32"], **spec}
    return translate(
        node(addresses=(NODE_IP,)),
        service(
            "lb",
            type="LoadBalancer",
            cluster_ips=(CLUSTER_IP,),
            ports=[port("http", 80, "TCP", 8080, 30080)],
            externalIPs=[EXTERNAL_IP],
            status={"loadBalancer": {"ingress": [{"ip": LB_IP}]}},
            **spec,
        ),
        slice_("lb", ports=(("http", 8080, "TCP"),), endpoints=[ep("10.244.1.9")]),
    )


def fallback(desired: Desired, policy: NodePolicy = DEFAULT_NODE) -> dict[str, list[str]]:
    """The IPv4 nat chains the fallback writes for `desired`, given its access."""
    commands = FakeIptables()
    kernel = IptablesKernel(commands=commands, node=policy)
    ops = plan(desired.state, kernel.observe(access=desired.access), ownership=EVERYTHING)
    assert kernel.apply(ops, names=desired.origins, access=desired.access).ok
    return commands.tables[4]


def _matches(rule: str, src: IPAddress) -> bool:
    """Whether a rule's source match admits `src` (other matches are taken as possible)."""
    words = rule.split()
    for flag in ("-s",):
        if flag in words:
            at = words.index(flag)
            inside = src in ip_network(words[at + 1])
            negated = words[at - 1] == "!"
            if inside == negated:
                return False
    return True


def reaches(chains: dict[str, list[str]], src: str, vs: VSKey) -> bool:
    """Can a new connection from `src` to `vs` be DNATed to an endpoint? (A walk of the
    chains from the dispatch rule: statistic, recent and mark matches may all match.)"""
    address = ip_address(src)

    def walk(chain: str, depth: int = 0) -> bool:
        assert depth < 5, chain
        for rule in chains.get(chain, []):
            if not _matches(rule, address):
                continue
            if "-j DNAT" in rule:
                return True
            target = f" {rule}".rsplit(" -j ", 1)[-1].split()[0]
            if target in chains and target != MARK_MASQ and walk(target, depth + 1):
                return True
        return False

    dispatch = [
        r for r in chains[SERVICES] if f"-d {vs.address}/32 " in r and f"--dport {vs.port} " in r
    ]
    assert len(dispatch) == 1, chains[SERVICES]
    return walk(dispatch[0].rsplit(" -j ", 1)[1])


def masquerades(chains: dict[str, list[str]], src: str, vs: VSKey) -> bool:
    """Does a connection from `src` (not an endpoint) to `vs` get the masquerade mark?"""
    address = ip_address(src)
    seps = [c for c in chains if c.startswith(svc_chain(vs)[:19] + "-")]
    assert seps
    return all(
        any(f"-j {MARK_MASQ}" in r and _matches(r, address) for r in chains[sep][1:])
        for sep in seps  # [0] is the hairpin rule (source = the endpoint itself)
    )


def test_source_ranges_guard_the_load_balancer_frontend_only():
    desired = balanced()
    chains = fallback(desired)
    lb = key(LB_IP)
    assert reaches(chains, INSIDE, lb)
    assert not reaches(chains, OUTSIDE, lb)
    assert not reaches(chains, POD, lb)
    for other in (key(CLUSTER_IP), key(EXTERNAL_IP), key(NODE_IP, 30080)):
        assert reaches(chains, OUTSIDE, other), other  # never filtered by the ranges
        assert reaches(chains, INSIDE, other), other
    assert [c for c in chains if c.startswith(EXT_PREFIX)] == [EXT_PREFIX + svc_chain(lb)[11:]]
    # the firewall: only the LB frontend is in LB-FW, with the range of its family
    sets = wanted(desired.state, desired.access)
    assert sets.sets["IPVSPROXY-LB-FW"][2] == {f"{LB_IP},tcp:80"}
    assert sets.sets["IPVSPROXY-LB-SOURCE"][2] == {f"{LB_IP},tcp:80,192.0.2.0/24"}


@pytest.mark.parametrize("reach", [Frontend.CLUSTER_IP, Frontend.EXTERNAL_IP, Frontend.NODE_PORT])
def test_the_policy_itself_never_filters_other_frontends(reach):
    """Even given source ranges (desired.py passes them for LoadBalancers only), the
    policy applies them to no other frontend: the second line of defence."""
    ranges = (ip_network("192.0.2.0/24"),)
    policy = frontend_policy(Access(reach, source_ranges=ranges), bound=True)
    assert not policy.firewalled
    assert policy.allowed(4) == ()


def test_ranges_of_the_other_family_only_let_no_one_in():
    desired = balanced(loadBalancerSourceRanges=["2001:db8::/32"])
    chains = fallback(desired)
    assert not reaches(chains, INSIDE, key(LB_IP))
    assert chains[svc_chain(key(LB_IP))] == []  # fail closed: nothing is DNATed
    assert wanted(desired.state, desired.access).sets["IPVSPROXY-LB-SOURCE"][2] == set()


def test_an_all_addresses_range_is_written_as_iptables_save_prints_it():
    chains = fallback(balanced(loadBalancerSourceRanges=["0.0.0.0/0"]))
    lb = svc_chain(key(LB_IP))
    assert chains[lb] == [f"-j {EXT_PREFIX}{lb[11:]}"]  # no "-s 0.0.0.0/0"
    assert reaches(chains, OUTSIDE, key(LB_IP))


def test_without_flags_external_traffic_is_masqueraded_cluster_ip_traffic_is_not():
    chains = fallback(balanced())
    for external in (key(LB_IP), key(EXTERNAL_IP), key(NODE_IP, 30080)):
        assert masquerades(chains, OUTSIDE, external), external
    assert not masquerades(chains, OUTSIDE, key(CLUSTER_IP))
    assert chains[MARK_MASQ] == ["-j MARK --set-xmark 0x4000/0x4000"]


def test_cluster_cidr_masquerades_cluster_ip_traffic_from_outside_the_pods():
    policy = NodePolicy(
        local_mode=LocalMode.CLUSTER_CIDR, local_cidrs=(ip_network("10.244.0.0/16"),)
    )
    chains = fallback(balanced(), policy)
    assert masquerades(chains, OUTSIDE, key(CLUSTER_IP))
    assert not masquerades(chains, POD, key(CLUSTER_IP))


def test_masquerade_all_and_the_masquerade_bit():
    chains = fallback(balanced(), NodePolicy(masquerade_all=True, masquerade_bit=12))
    assert masquerades(chains, POD, key(CLUSTER_IP))
    assert chains[MARK_MASQ] == ["-j MARK --set-xmark 0x1000/0x1000"]
    assert chains[POSTROUTING][0] == "-m mark ! --mark 0x1000/0x1000 -j RETURN"
    assert chains[POSTROUTING][1] == "-j MARK --set-xmark 0x0/0x1000"


def test_interface_detection_and_external_traffic_policy_local():
    policy = NodePolicy(local_mode=LocalMode.INTERFACE_NAME_PREFIX, interface="veth")
    chains = fallback(balanced(externalTrafficPolicy="Local"), policy)
    sep = next(c for c in chains if c.startswith(svc_chain(key(CLUSTER_IP))[:19] + "-"))
    assert f"! -i veth+ -j {MARK_MASQ}" in chains[sep]
    for external in (key(LB_IP), key(EXTERNAL_IP), key(NODE_IP, 30080)):
        assert not masquerades(chains, OUTSIDE, external), external  # the client's address
    assert reaches(chains, INSIDE, key(LB_IP))
    assert not reaches(chains, OUTSIDE, key(LB_IP))


def test_node_policy_from_the_flags():
    from ipvsproxy.config import Config

    config = Config(
        cluster_cidrs=(ip_network("10.244.0.0/16"),),
        detect_local_mode="ClusterCIDR",
        masquerade_bit=3,
    )
    policy = node_policy(config)
    assert policy.mark == "0x8/0x8"
    assert policy.outside(4) == "! -s 10.244.0.0/16 "
    assert policy.outside(6) is None
    pods = (ip_network("10.244.7.0/24"),)
    by_node = node_policy(Config(detect_local_mode="NodeCIDR"), pods)
    assert by_node.outside(4) == "! -s 10.244.7.0/24 "


def test_an_access_change_without_an_operation_is_repaired_by_the_next_full_sync():
    """A Service that gains loadBalancerSourceRanges changes no IPVS operation: the next
    full observation finds the firewall missing and the apply after it writes it."""
    open_ = balanced(loadBalancerSourceRanges=[])
    closed = balanced()
    commands = FakeIptables()
    kernel = IptablesKernel(commands=commands)
    ops = plan(open_.state, kernel.observe(access=open_.access), ownership=EVERYTHING)
    assert kernel.apply(ops, access=open_.access).ok
    assert reaches(commands.tables[4], OUTSIDE, key(LB_IP))
    observed = kernel.observe(access=closed.access)
    assert not plan(closed.state, observed, ownership=EVERYTHING)  # no IPVS operation
    assert kernel.damage()
    assert kernel.apply([], access=closed.access).ok
    assert not reaches(commands.tables[4], OUTSIDE, key(LB_IP))
    assert reaches(commands.tables[4], INSIDE, key(LB_IP))


ACCESS = st.builds(
    Access,
    st.sampled_from(list(Frontend)),
    st.booleans(),
    st.lists(st.sampled_from(["192.0.2.0/24", "0.0.0.0/0", "2001:db8::/32"]), max_size=2).map(
        lambda nets: tuple(ip_network(n) for n in nets)
    ),
)


@given(ACCESS, st.booleans(), st.booleans())
def test_both_backends_decide_alike(access, masquerade_all, cidr):
    """The firewall's sets and the fallback's chains say the same of any access."""
    nodes = NodePolicy(
        masquerade_all=masquerade_all,
        local_mode=LocalMode.CLUSTER_CIDR if cidr else LocalMode.NONE,
        local_cidrs=(ip_network("10.244.0.0/16"),),
    )
    policy = frontend_policy(access, bound=True)
    assert policy.frontend is Frontend(access.reach.value)
    assert policy.firewalled == (
        access.reach is Frontend.LOAD_BALANCER and bool(access.source_ranges)
    )
    if access.reach is Frontend.CLUSTER_IP:
        assert policy.masquerade is Masquerade.OUTSIDE
    else:
        assert policy.masquerade is (Masquerade.NEVER if access.local else Masquerade.ALWAYS)
    assert nodes.cluster_ip_masquerade(4) == (
        "" if masquerade_all else ("! -s 10.244.0.0/16 " if cidr else None)
    )


def test_a_pass_with_an_access_change_rewrites_only_what_it_alters():
    """A partial pass hands the fallback the access of what it looked at, with no operation
    when only the access changed: the Service gains its ranges, the apply writes the
    LoadBalancer's chains (one restore) and nothing else."""
    open_ = balanced(loadBalancerSourceRanges=[])
    closed = balanced()
    commands = FakeIptables()
    kernel = IptablesKernel(commands=commands)
    ops = plan(open_.state, kernel.observe(access=open_.access), ownership=EVERYTHING)
    assert kernel.apply(ops, access=open_.access).ok
    commands.calls.clear()
    assert kernel.apply([], access=open_.access).ok  # nothing changed: nothing written
    assert commands.calls == []
    assert kernel.apply([], access=closed.access).ok
    assert commands.tools() == ["iptables-restore"]
    lb = svc_chain(key(LB_IP))
    assert commands.declared() == {lb, EXT_PREFIX + lb[11:]}
    assert not reaches(commands.tables[4], OUTSIDE, key(LB_IP))
    assert reaches(commands.tables[4], INSIDE, key(LB_IP))
    assert kernel.observe(access=closed.access) is not None
    assert kernel.damage() == ()


# ---- through the proxier: source ranges from the first sync, then by partial passes ------
# The fallback in the proxier: the agent's Proxier hands the iptables backend each virtual
# server's access, so loadBalancerSourceRanges are enforced from the first sync, and a Service
# that only gains or loses ranges (no IPVS operation) is rewritten by the next partial pass.


CONFIG = Config(node_name="node-a", service_cidrs=())


def lb(ranges: list[str]) -> Any:
    return service(
        "lb",
        type="LoadBalancer",
        cluster_ips=(CLUSTER_IP,),
        ports=[port("http", 80, "TCP", 8080, 30080)],
        status={"loadBalancer": {"ingress": [{"ip": LB_IP}]}},
        loadBalancerSourceRanges=ranges,
    )


def test_the_agents_fallback_enforces_source_ranges_and_follows_a_change_at_once():
    tracker = Tracker(required=(SERVICE, SLICE, NODE), node_name="node-a")
    tracker.replace(NODE, [node(addresses=(NODE_IP,))])
    tracker.replace(SERVICE, [lb(["192.0.2.0/24"])])
    tracker.replace(
        SLICE, [slice_("lb", ports=(("http", 8080, "TCP"),), endpoints=[ep("10.244.1.9")])]
    )
    commands = FakeIptables()
    proxier = Proxier(kernel=IptablesKernel(commands=commands), config=CONFIG)
    assert proxier.sync(tracker.take(), full=True).sync.report.ok
    chains = commands.tables[4]
    assert reaches(chains, INSIDE, key(LB_IP))
    assert not reaches(chains, OUTSIDE, key(LB_IP))  # closed from the first sync
    assert reaches(chains, OUTSIDE, key(CLUSTER_IP))  # the ranges guard the LB IP only
    tracker.event(SERVICE, "MODIFIED", copy.deepcopy(lb([])))  # ranges removed: no operation
    result = proxier.sync(tracker.take(), full=False)
    assert not result.sync.plan
    assert reaches(commands.tables[4], OUTSIDE, key(LB_IP))  # open at once, not next period
    tracker.event(SERVICE, "MODIFIED", lb(["192.0.2.0/24"]))
    proxier.sync(tracker.take(), full=False)
    assert not reaches(commands.tables[4], OUTSIDE, key(LB_IP))
