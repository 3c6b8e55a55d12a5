"""A node as kube-proxy v1.36's IPVS mode programs it, made with the tools (ip, ipvsadm, ipset,
iptables-restore) under kube-proxy's own names: the dummy device kube-ipvs0 holding the VIPs,
the virtual servers, its 17 ipsets and its chains with their rules and jumps, as
pkg/proxy/ipvs/proxier.go writes them (`ipsetInfo`, `iptablesChains`, `iptablesJumpChain`,
`writeIptablesRules`, `acceptIPVSTraffic`) for ClusterIP and NodePort Services, with
`detectLocalMode: ClusterCIDR`. For the migration tests: ipvsproxy must take this over in place.

`apply` is what kube-proxy's sync does on a node where the table may already exist (its own, or
the one ipvsproxy leaves on the way back): virtual servers found are edited in place
(`UpdateVirtualServer`), the others added; sets and chains are made if missing.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

DEVICE = "kube-ipvs0"
MARK = "0x4000"  # --masquerade-bit 14

# ipsetInfo: (name, type), in kube-proxy's order
SETS = (
    ("KUBE-LOOP-BACK", "hash:ip,port,ip"), ("KUBE-CLUSTER-IP", "hash:ip,port"),
    ("KUBE-EXTERNAL-IP", "hash:ip,port"), ("KUBE-EXTERNAL-IP-LOCAL", "hash:ip,port"),
    ("KUBE-LOAD-BALANCER", "hash:ip,port"), ("KUBE-LOAD-BALANCER-FW", "hash:ip,port"),
    ("KUBE-LOAD-BALANCER-LOCAL", "hash:ip,port"),
    ("KUBE-LOAD-BALANCER-SOURCE-IP", "hash:ip,port,ip"),
    ("KUBE-LOAD-BALANCER-SOURCE-CIDR", "hash:ip,port,net"),
    ("KUBE-NODE-PORT-TCP", "bitmap:port"), ("KUBE-NODE-PORT-LOCAL-TCP", "bitmap:port"),
    ("KUBE-NODE-PORT-UDP", "bitmap:port"), ("KUBE-NODE-PORT-LOCAL-UDP", "bitmap:port"),
    ("KUBE-NODE-PORT-SCTP-HASH", "hash:ip,port"),
    ("KUBE-NODE-PORT-LOCAL-SCTP-HASH", "hash:ip,port"),
    ("KUBE-HEALTH-CHECK-NODE-PORT", "bitmap:port"), ("KUBE-IPVS-IPS", "hash:ip"),
)  # fmt: skip
NAT_CHAINS = ("KUBE-SERVICES", "KUBE-POSTROUTING", "KUBE-NODE-PORT", "KUBE-LOAD-BALANCER",
              "KUBE-MARK-MASQ")  # fmt: skip
FILTER_CHAINS = (
    "KUBE-FORWARD", "KUBE-NODE-PORT", "KUBE-PROXY-FIREWALL", "KUBE-SOURCE-RANGES-FIREWALL",
    "KUBE-IPVS-FILTER", "KUBE-IPVS-OUT-FILTER",
)  # fmt: skip
# iptablesJumpChain: (table, from, to, comment); each is prepended (EnsureRule Prepend)
JUMPS = (
    ("nat", "OUTPUT", "KUBE-SERVICES", "kubernetes service portals"),
    ("nat", "PREROUTING", "KUBE-SERVICES", "kubernetes service portals"),
    ("nat", "POSTROUTING", "KUBE-POSTROUTING", "kubernetes postrouting rules"),
    ("filter", "FORWARD", "KUBE-FORWARD", "kubernetes forwarding rules"),
    ("filter", "INPUT", "KUBE-NODE-PORT", "kubernetes health check rules"),
    ("filter", "INPUT", "KUBE-PROXY-FIREWALL", "kube-proxy firewall rules"),
    ("filter", "FORWARD", "KUBE-PROXY-FIREWALL", "kube-proxy firewall rules"),
    ("filter", "INPUT", "KUBE-IPVS-FILTER", "kubernetes ipvs access filter"),
    ("filter", "OUTPUT", "KUBE-IPVS-OUT-FILTER", "kubernetes ipvs access filter"),
)


@dataclass(frozen=True)
class Port:
    """One TCP Service port: its ClusterIP virtual server, and a NodePort one if node_port."""

    vip: str
    port: int
    endpoints: tuple[str, ...]  # ip:port
    node_port: int = 0
    scheduler: str = "rr"


def sh(*args: str, stdin: str | None = None) -> str:
    done = subprocess.run(args, input=stdin, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"{' '.join(args)}: {done.stderr}"
    return done.stdout


def _virtual_servers(ports: tuple[Port, ...], node_ip: str) -> None:
    """One ipvsadm call per change, as kube-proxy makes one netlink request per change
    (`ipvsadm -R` refuses -E and -e lines: "No such service")."""
    table = sh("ipvsadm-save", "-n")
    for p in ports:
        for address, number in ((p.vip, p.port), (node_ip, p.node_port)):
            if not number:
                continue
            service = f"{address}:{number}"
            verb = "-E" if f"-A -t {service} " in table else "-A"
            sh("ipvsadm", verb, "-t", service, "-s", p.scheduler)
            for endpoint in p.endpoints:
                known = f"-a -t {service} -r {endpoint} " in table
                sh("ipvsadm", "-e" if known else "-a", "-t", service, "-r", endpoint, "-m",
                   "-w", "1")  # fmt: skip


def _sets(ports: tuple[Port, ...]) -> None:
    script = []
    for name, kind in SETS:
        extra = " range 0-65535" if kind == "bitmap:port" else " family inet hashsize 1024"
        script.append(f"create {name} {kind}{extra} -exist")
    for p in ports:
        script.append(f"add KUBE-CLUSTER-IP {p.vip},tcp:{p.port} -exist")
        script.append(f"add KUBE-IPVS-IPS {p.vip} -exist")
        if p.node_port:
            script.append(f"add KUBE-NODE-PORT-TCP {p.node_port} -exist")
    sh("ipset", "restore", stdin="\n".join(script) + "\n")


def _rules(cluster_cidr: str) -> str:
    """writeIptablesRules for a node with ClusterIP and TCP NodePort Services."""
    mark = f"{MARK}/{MARK}"
    nat = ["*nat", *(f":{c} - [0:0]" for c in NAT_CHAINS),
           "-A KUBE-SERVICES -s 127.0.0.0/8 -j RETURN",
           '-A KUBE-NODE-PORT -p tcp -m comment --comment "Kubernetes nodeport TCP port for '
           'masquerade purpose" -m set --match-set KUBE-NODE-PORT-TCP dst -j KUBE-MARK-MASQ',
           '-A KUBE-SERVICES -m comment --comment "Kubernetes service cluster ip + port for '
           f'masquerade purpose" -m set --match-set KUBE-CLUSTER-IP dst,dst ! -s {cluster_cidr} '
           "-j KUBE-MARK-MASQ",
           "-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT",
           "-A KUBE-LOAD-BALANCER -j KUBE-MARK-MASQ",
           "-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT",
           f"-A KUBE-POSTROUTING -m mark ! --mark {mark} -j RETURN",
           f"-A KUBE-POSTROUTING -j MARK --xor-mark {MARK}",
           '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring '
           'SNAT" -j MASQUERADE --random-fully',
           f"-A KUBE-MARK-MASQ -j MARK --or-mark {MARK}",
           "COMMIT"]  # fmt: skip
    filter_ = ["*filter", *(f":{c} - [0:0]" for c in FILTER_CHAINS),
               "-A KUBE-SOURCE-RANGES-FIREWALL -j DROP",
               '-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark '
               f"--mark {mark} -j ACCEPT",
               '-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m '
               "conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
               '-A KUBE-NODE-PORT -m comment --comment "Kubernetes health check node port" -m '
               "set --match-set KUBE-HEALTH-CHECK-NODE-PORT dst -j ACCEPT",
               *(f"-A KUBE-IPVS-FILTER -m set --match-set {s} dst,dst -j RETURN"
                 for s in ("KUBE-LOAD-BALANCER", "KUBE-CLUSTER-IP", "KUBE-EXTERNAL-IP",
                           "KUBE-EXTERNAL-IP-LOCAL")),
               "-A KUBE-IPVS-FILTER -m set --match-set KUBE-HEALTH-CHECK-NODE-PORT dst -j RETURN",
               "-A KUBE-IPVS-FILTER -m conntrack --ctstate NEW -m set --match-set KUBE-IPVS-IPS "
               "dst -j REJECT",
               "COMMIT"]  # fmt: skip
    return "\n".join(filter_ + nat) + "\n"


def _jumps() -> None:
    for table, source, target, comment in JUMPS:
        rule = ["-m", "comment", "--comment", comment, "-j", target]
        check = subprocess.run(["iptables", "-t", table, "-C", source, *rule], capture_output=True)
        if check.returncode != 0:
            sh("iptables", "-t", table, "-I", source, *rule)


def apply(ports: tuple[Port, ...], *, node_ip: str, cluster_cidr: str) -> None:
    """kube-proxy's sync: device and VIPs, virtual servers, sets, then chains and jumps (with
    the sysctls its IPVS mode sets at start)."""
    for setting in (
        "net.ipv4.ip_forward=1",
        "net.ipv4.vs.conntrack=1",
        "net.ipv4.vs.expire_nodest_conn=1",
        "net.ipv4.vs.expire_quiescent_template=1",
    ):
        sh("sysctl", "-qw", setting)  # fmt: skip
    if subprocess.run(["ip", "link", "show", DEVICE], capture_output=True).returncode != 0:
        sh("ip", "link", "add", DEVICE, "type", "dummy")
    for p in ports:
        sh("ip", "addr", "replace", f"{p.vip}/32", "dev", DEVICE)
    _virtual_servers(ports, node_ip)
    _sets(ports)
    sh("iptables-restore", "--noflush", stdin=_rules(cluster_cidr))
    _jumps()


def chains() -> set[str]:
    """kube-proxy's IPVS chains present now, as `table/chain`."""
    found = set()
    for table, names in (("nat", NAT_CHAINS), ("filter", FILTER_CHAINS)):
        saved = sh("iptables-save", "-t", table)
        found |= {f"{table}/{n}" for n in names if f":{n} " in saved}
    return found


def sets() -> set[str]:
    listed = set(sh("ipset", "list", "-n").split())
    return {name for name, _ in SETS} & listed
