"""The firewall's rules (firewall/rules.py): the node's own
connections from a VIP are masqueraded without local detection, and the filter table's
forwarding chain lets Service traffic through a host whose FORWARD policy is DROP."""

from __future__ import annotations

from ipaddress import ip_network

from ipvsproxy.firewall.host_firewall import JUMPS, Observed, plan_firewall
from ipvsproxy.firewall.rules import FORWARD, OUTPUT, OWNED, SERVICES, LocalMode, Options, render
from ipvsproxy.firewall.sets import SetState
from ipvsproxy.iptables.parse import Saved, parse_save
from ipvsproxy.iptables.transaction import removal

VIP_SOURCE = (
    "-A IPVSPROXY-OUTPUT -m set --match-set IPVSPROXY-CLUSTER-IP src,dst -j IPVSPROXY-MARK-MASQ"
)


def nat(options: Options, version: int = 4) -> dict[str, tuple[str, ...]]:
    return dict(render(version, options)["nat"].chains)


def test_without_detection_the_node_s_connections_from_a_vip_are_marked_in_output_only():
    chains = nat(Options())
    assert VIP_SOURCE in chains[OUTPUT]
    assert not any("src,dst" in rule for rule in chains[SERVICES])  # never from PREROUTING
    six = nat(Options(), 6)[OUTPUT]
    assert VIP_SOURCE.replace("CLUSTER-IP", "CLUSTER-IP-6") in six


def test_with_detection_or_masquerade_all_every_node_connection_is_marked_instead():
    cidr = Options(local_mode=LocalMode.CLUSTER_CIDR, local_cidrs=(ip_network("10.244.0.0/16"),))
    for options in (cidr, Options(masquerade_all=True)):
        output = nat(options)[OUTPUT]
        assert VIP_SOURCE not in output
        assert output[0].endswith("IPVSPROXY-CLUSTER-IP dst,dst -j IPVSPROXY-MARK-MASQ")
    # a detector without a range of this family detects nothing there: the VIP rule is back
    assert VIP_SOURCE.replace("CLUSTER-IP", "CLUSTER-IP-6") in nat(cidr, 6)[OUTPUT]


def test_the_forward_chain_is_kube_proxy_s_kube_forward():
    for version in (4, 6):
        chains = render(version, Options())["filter"].chains
        assert chains[FORWARD] == (
            "-A IPVSPROXY-FORWARD -m conntrack --ctstate INVALID -j DROP",
            '-A IPVSPROXY-FORWARD -m comment --comment "ipvsproxy forwarding rules" '
            "-m mark --mark 0x4000/0x4000 -j ACCEPT",
            '-A IPVSPROXY-FORWARD -m comment --comment "ipvsproxy forwarding conntrack rule" '
            "-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
        )
    marked = render(4, Options(masquerade_bit=12))["filter"].chains[FORWARD]
    assert "-m mark --mark 0x1000/0x1000 -j ACCEPT" in marked[1]
    liberal = render(4, Options(conntrack_tcp_liberal=True))["filter"].chains[FORWARD]
    assert not any("INVALID" in rule for rule in liberal)  # as kube-proxy with be_liberal


def test_a_cold_host_gets_the_forward_chain_and_its_jump_inserted_at_the_top():
    plan = plan_firewall(SetState({}), Observed(SetState({}), {}), Options())
    filters = [payload for _, table, payload in plan.restores if table == "filter"]
    assert len(filters) == 2  # both families
    for payload in filters:
        lines = payload.splitlines()
        assert ":IPVSPROXY-FORWARD - [0:0]" in lines
        jump = '-I FORWARD 1 -m comment --comment "ipvsproxy ipvs forward" -j IPVSPROXY-FORWARD'
        assert jump in lines
    described = [line for _, line in plan.describe()]
    assert any("-I FORWARD 1" in line for line in described)


def test_a_deleted_forward_rule_or_jump_is_repaired_and_cleanup_removes_both():
    rendered = {v: render(v, Options()) for v in (4, 6)}
    whole = {(v, t): Saved(rs.chains, JUMPS[t]) for v in (4, 6) for t, rs in rendered[v].items()}
    assert not plan_firewall(SetState({}), Observed(SetState({}), whole), Options()).restores
    chains = dict(rendered[4]["filter"].chains)
    chains[FORWARD] = chains[FORWARD][1:]
    damaged = dict(whole)
    damaged[4, "filter"] = Saved(chains, JUMPS["filter"][:1])  # a rule and the jump gone
    plan = plan_firewall(SetState({}), Observed(SetState({}), damaged), Options())
    ((version, table, payload),) = plan.restores
    assert (version, table) == (4, "filter")
    assert "-A IPVSPROXY-FORWARD -m conntrack --ctstate INVALID -j DROP" in payload
    assert '-I FORWARD 1 -m comment --comment "ipvsproxy ipvs forward"' in payload
    # cleanup: what iptables-save shows is removed, the jump before the chain
    save = "\n".join(
        [
            "*filter",
            ":FORWARD DROP [0:0]",
            ":IPVSPROXY-FORWARD - [0:0]",
            '-A FORWARD -m comment --comment "ipvsproxy ipvs forward" -j IPVSPROXY-FORWARD',
            '-A FORWARD -m comment --comment "docker" -j DOCKER-USER',
            *rendered[4]["filter"].chains[FORWARD],
            "COMMIT",
        ]
    )
    gone = removal(
        parse_save(save, table="filter", owns=OWNED["filter"].__contains__), table="filter"
    )
    lines = gone.splitlines()
    jump = '-D FORWARD -m comment --comment "ipvsproxy ipvs forward" -j IPVSPROXY-FORWARD'
    assert lines.index(jump) < lines.index("-X IPVSPROXY-FORWARD")
    assert "DOCKER-USER" not in gone


def test_conntrack_tcp_be_liberal_leaves_invalid_packets_alone_as_kube_proxy():
    from ipvsproxy.config import Config
    from ipvsproxy.policy import node_policy

    strict = node_policy(Config(node_name="n"))
    liberal = node_policy(Config(node_name="n", conntrack_tcp_be_liberal=True))
    assert any("INVALID" in r for r in render(4, strict)["filter"].chains[FORWARD])
    assert not any("INVALID" in r for r in render(4, liberal)["filter"].chains[FORWARD])
