"""A node as kube-proxy v1.36 programs it in each of its modes, made with the tools (ip,
ipvsadm, ipset, iptables-restore, nft) under kube-proxy's own names, for ClusterIP and TCP
NodePort Services with `detectLocalMode: ClusterCIDR`. For the migration tests: ipvsproxy
must take each over without dropping a connection.

- `ipvs`: the dummy device kube-ipvs0 holding the VIPs, the virtual servers, its 17 ipsets
  and its chains with their rules and jumps, as pkg/proxy/ipvs/proxier.go writes them
  (`ipsetInfo`, `iptablesChains`, `iptablesJumpChain`, `writeIptablesRules`,
  `acceptIPVSTraffic`);
- `iptables`: pkg/proxy/iptables/proxier.go's chains (KUBE-SERVICES, KUBE-NODEPORTS,
  KUBE-SVC-/KUBE-SEP-/KUBE-EXT-<hash> named by `portProtoHash` and
  `servicePortEndpointChainName`, the statistic-mode random DNAT, KUBE-POSTROUTING,
  KUBE-MARK-MASQ, KUBE-FORWARD, KUBE-PROXY-FIREWALL, KUBE-EXTERNAL-SERVICES, KUBE-FIREWALL),
  the jumps from the built-in chains (`iptablesJumpChains`, `iptablesKubeletJumpChains`) and
  the KUBE-PROXY-CANARY chains of its monitor, as its proxier_test.go
  `TestOverallIPTablesRules` expects them, on a kernel without nfacct (kube-proxy leaves the
  `-m nfacct` matches out there);
- `nftables`: `table ip kube-proxy` (pkg/proxy/nftables/proxier.go: the sets, verdict maps and
  chains of proxier_test.go `baseRules`, service-/external-/endpoint- chains named by
  `servicePortChainNameBase`) and `table ip6 kube-proxy` with the base chains only (the
  lab's Services are IPv4).

`apply` is what a starting kube-proxy does on a node where a table may already exist (its
own, or what ipvsproxy leaves on the way back): first the start-up clean-up of the other
modes (cmd/kube-proxy/app/server_linux.go `platformCleanup`: iptables and IPVS modes remove
the nftables tables; nftables mode flushes the whole IPVS table and deletes kube-ipvs0),
then its sync: IPVS virtual servers found are edited in place (`UpdateVirtualServer`), the
others added; sets and chains are made if missing; nftables mode replaces its table in one
transaction.
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
from dataclasses import dataclass

DEVICE = "kube-ipvs0"
MARK = "0x4000"  # --masquerade-bit 14
MODES = ("ipvs", "iptables", "nftables")
SERVICE_CIDR = "10.96.0.0/16"

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
# iptablesJumpChain: (table, from, to, comment, match); each is prepended (EnsureRule Prepend)
JUMPS = (
    ("nat", "OUTPUT", "KUBE-SERVICES", "kubernetes service portals", ""),
    ("nat", "PREROUTING", "KUBE-SERVICES", "kubernetes service portals", ""),
    ("nat", "POSTROUTING", "KUBE-POSTROUTING", "kubernetes postrouting rules", ""),
    ("filter", "FORWARD", "KUBE-FORWARD", "kubernetes forwarding rules", ""),
    ("filter", "INPUT", "KUBE-NODE-PORT", "kubernetes health check rules", ""),
    ("filter", "INPUT", "KUBE-PROXY-FIREWALL", "kube-proxy firewall rules", ""),
    ("filter", "FORWARD", "KUBE-PROXY-FIREWALL", "kube-proxy firewall rules", ""),
    ("filter", "INPUT", "KUBE-IPVS-FILTER", "kubernetes ipvs access filter", ""),
    ("filter", "OUTPUT", "KUBE-IPVS-OUT-FILTER", "kubernetes ipvs access filter", ""),
)
NEW = "-m conntrack --ctstate NEW"
# the iptables proxier's iptablesJumpChains, then iptablesKubeletJumpChains (no comment)
IPTABLES_JUMPS = (
    ("filter", "INPUT", "KUBE-EXTERNAL-SERVICES",
     "kubernetes externally-visible service portals", NEW),
    ("filter", "FORWARD", "KUBE-EXTERNAL-SERVICES",
     "kubernetes externally-visible service portals", NEW),
    ("filter", "INPUT", "KUBE-NODEPORTS", "kubernetes health check service ports", ""),
    ("filter", "FORWARD", "KUBE-SERVICES", "kubernetes service portals", NEW),
    ("filter", "OUTPUT", "KUBE-SERVICES", "kubernetes service portals", NEW),
    ("filter", "FORWARD", "KUBE-FORWARD", "kubernetes forwarding rules", ""),
    ("filter", "INPUT", "KUBE-PROXY-FIREWALL", "kubernetes load balancer firewall", NEW),
    ("filter", "OUTPUT", "KUBE-PROXY-FIREWALL", "kubernetes load balancer firewall", NEW),
    ("filter", "FORWARD", "KUBE-PROXY-FIREWALL", "kubernetes load balancer firewall", NEW),
    ("nat", "OUTPUT", "KUBE-SERVICES", "kubernetes service portals", ""),
    ("nat", "PREROUTING", "KUBE-SERVICES", "kubernetes service portals", ""),
    ("nat", "POSTROUTING", "KUBE-POSTROUTING", "kubernetes postrouting rules", ""),
    ("filter", "INPUT", "KUBE-FIREWALL", "", ""),
    ("filter", "OUTPUT", "KUBE-FIREWALL", "", ""),
)  # fmt: skip
IPTABLES_NAT = ("KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ")
IPTABLES_FILTER = ("KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES", "KUBE-FORWARD",
                   "KUBE-NODEPORTS", "KUBE-PROXY-FIREWALL")  # fmt: skip
KUBELET_FIREWALL = "KUBE-FIREWALL"  # kubelet's chain, which iptables mode writes too
CANARY = "KUBE-PROXY-CANARY"  # iptables.Monitor's, in mangle, nat and filter


@dataclass(frozen=True)
class Port:
    """One TCP Service port: its ClusterIP virtual server, and a NodePort one if node_port."""

    vip: str
    port: int
    endpoints: tuple[str, ...]  # ip:port
    node_port: int = 0
    scheduler: str = "rr"
    name: str = "default/web:http"  # the ServicePortName, which names the chains

    @property
    def nft_name(self) -> str:
        """servicePortChainNameBase's readable part: namespace/name/protocol/port."""
        service, _, port = self.name.rpartition(":")
        return f"{service}/tcp/{port}"


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


def _jumps(jumps: tuple[tuple[str, str, str, str, str], ...], tool: str = "iptables") -> None:
    for table, source, target, comment, match in jumps:
        rule = [*match.split(), *(["-m", "comment", "--comment", comment] if comment else [])]
        rule += ["-j", target]
        check = subprocess.run([tool, "-t", table, "-C", source, *rule], capture_output=True)
        if check.returncode != 0:
            sh(tool, "-t", table, "-I", source, *rule)


def _ipvs_mode(ports: tuple[Port, ...], *, node_ip: str, cluster_cidr: str) -> None:
    """The IPVS proxier's sync: device and VIPs, virtual servers, sets, then chains and jumps
    (with the sysctls its IPVS mode sets at start)."""
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
    _jumps(JUMPS)


def _hash(text: str, length: int) -> str:
    """kube-proxy's chain-name hash: base32 of the SHA-256, cut (portProtoHash: 16)."""
    return base64.b32encode(hashlib.sha256(text.encode()).digest()).decode()[:length]


def _iptables_service(p: Port, cluster_cidr: str) -> tuple[list[str], list[str]]:
    """One Service port's nat chains and rules (proxier.go syncProxyRules)."""
    svc, ext = (f"KUBE-{kind}-{_hash(p.name + 'tcp', 16)}" for kind in ("SVC", "EXT"))
    seps = [f"KUBE-SEP-{_hash(p.name + 'tcp' + e, 16)}" for e in p.endpoints]
    comment, match = f'"{p.name} cluster IP"', f"-m tcp -p tcp -d {p.vip} --dport {p.port}"
    chains = [svc, *seps, *([ext] if p.node_port else [])]
    rules = [f"-A KUBE-SERVICES -m comment --comment {comment} {match} -j {svc}",
             f"-A {svc} -m comment --comment {comment} {match} ! -s {cluster_cidr} "
             "-j KUBE-MARK-MASQ"]  # fmt: skip
    for i, (endpoint, sep) in enumerate(zip(p.endpoints, seps, strict=True)):
        left = len(p.endpoints) - i  # the statistic rule's chance: 1 in the endpoints left
        chance = f"-m statistic --mode random --probability {1 / left:.10f} " if left > 1 else ""
        rules += [f'-A {svc} -m comment --comment "{p.name} -> {endpoint}" {chance}-j {sep}',
                  f"-A {sep} -m comment --comment {p.name} -s {endpoint.split(':')[0]} "
                  "-j KUBE-MARK-MASQ",
                  f"-A {sep} -m comment --comment {p.name} -m tcp -p tcp -j DNAT "
                  f"--to-destination {endpoint}"]  # fmt: skip
    if p.node_port:
        to_ext = f"-m comment --comment {p.name} -m tcp -p tcp"
        rules += [f"-A KUBE-NODEPORTS {to_ext} -d 127.0.0.0/8 --dport {p.node_port} -j {ext}",
                  f"-A KUBE-NODEPORTS {to_ext} --dport {p.node_port} -j {ext}",
                  f'-A {ext} -m comment --comment "masquerade traffic for {p.name} external '
                  'destinations" -j KUBE-MARK-MASQ', f"-A {ext} -j {svc}"]  # fmt: skip
    return chains, rules


def iptables_rules(ports: tuple[Port, ...], cluster_cidr: str) -> str:
    """The iptables proxier's restore payload for these Service ports (IPv4)."""
    nat_chains, nat_rules = list(IPTABLES_NAT), []
    for p in ports:
        chains, rules = _iptables_service(p, cluster_cidr)
        nat_chains += chains
        nat_rules += rules
    filter_ = ["*filter", *(f":{c} - [0:0]" for c in (*IPTABLES_FILTER, KUBELET_FIREWALL)),
               '-A KUBE-FIREWALL -m comment --comment "block incoming localnet connections" '
               "-d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate "
               "RELATED,ESTABLISHED,DNAT -j DROP",
               "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP",
               '-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark '
               f"--mark {MARK}/{MARK} -j ACCEPT",
               '-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" '
               "-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT", "COMMIT"]  # fmt: skip
    nat = ["*nat", *(f":{c} - [0:0]" for c in nat_chains), *nat_rules,
           '-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this '
           'must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS',
           f"-A KUBE-MARK-MASQ -j MARK --or-mark {MARK}",
           f"-A KUBE-POSTROUTING -m mark ! --mark {MARK}/{MARK} -j RETURN",
           f"-A KUBE-POSTROUTING -j MARK --xor-mark {MARK}",
           '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring '
           'SNAT" -j MASQUERADE --random-fully', "COMMIT"]  # fmt: skip
    return "\n".join(filter_ + nat) + "\n"


def _iptables_mode(ports: tuple[Port, ...], *, node_ip: str, cluster_cidr: str) -> None:
    sh("sysctl", "-qw", "net.ipv4.ip_forward=1")
    sh("sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1")  # localhostNodePorts
    sh("iptables-restore", "--noflush", stdin=iptables_rules(ports, cluster_cidr))
    _jumps(IPTABLES_JUMPS)
    for table in ("mangle", "nat", "filter"):
        if f":{CANARY} " not in sh("iptables-save", "-t", table):
            sh("iptables", "-t", table, "-N", CANARY)


def _nft_base(family: str, node_ip: str) -> list[str]:
    """baseRules of the nftables proxier's tests, for one family of `table <family>
    kube-proxy` (IPv6: no Service CIDR, no node address in this lab)."""
    t = f"{family} kube-proxy"
    lines = _nft_declarations(family) + [f"add rule {t} {r}" for r in _nft_base_rules(family)]
    if family == "ip":
        lines.append(f"add element {t} nodeport-ips {{ {node_ip} }}")
    return lines


def _nft_declarations(family: str) -> list[str]:
    """The table, its sets, verdict maps and chains (base chains with their hooks)."""
    t, addr = f"{family} kube-proxy", "ipv4_addr" if family == "ip" else "ipv6_addr"
    key = f"{addr} . inet_proto . inet_service : verdict"
    lines = [f'add table {t} {{ comment "rules for kube-proxy" ; }}',
             f'add set {t} cluster-ips {{ type {addr} ; comment "Active ClusterIPs" ; }}',
             f'add set {t} nodeport-ips {{ type {addr} ; comment "IPs that accept NodePort '
             'traffic" ; }']  # fmt: skip
    for name, kind, comment in (
        ("firewall-ips", key, "destinations that are subject to LoadBalancerSourceRanges"),
        ("no-endpoint-nodeports", "inet_proto . inet_service : verdict",
         "vmap to drop or reject packets to service nodeports with no endpoints"),
        ("no-endpoint-services", key,
         "vmap to drop or reject packets to services with no endpoints"),
        ("service-ips", key, "ClusterIP, ExternalIP and LoadBalancer IP traffic"),
        ("service-nodeports", "inet_proto . inet_service : verdict", "NodePort traffic"),
    ):  # fmt: skip
        lines.append(f'add map {t} {name} {{ type {kind} ; comment "{comment}" ; }}')
    hooks = {"filter-prerouting-pre-dnat": "filter hook prerouting priority -110",
             "filter-output-pre-dnat": "filter hook output priority -110",
             "filter-forward": "filter hook forward priority 0",
             "filter-input": "filter hook input priority 0",
             "filter-output": "filter hook output priority 0",
             "nat-output": "nat hook output priority -100",
             "nat-postrouting": "nat hook postrouting priority 100",
             "nat-prerouting": "nat hook prerouting priority -100"}  # fmt: skip
    for chain in ("cluster-ips-check", "firewall-check", "mark-for-masquerade", "masquerading",
                  "nodeport-endpoints-check", "services", "service-endpoints-check"):  # fmt: skip
        lines.append(f"add chain {t} {chain}")
    lines += [f"add chain {t} {c} {{ type {h} ; }}" for c, h in hooks.items()]
    lines.append(f'add chain {t} reject-chain {{ comment "helper for @no-endpoint-services / '
                 '@no-endpoint-nodeports" ; }')  # fmt: skip
    return lines


def _nft_base_rules(ip: str) -> list[str]:
    """The rules of the base chains (`ip` or `ip6`: the family, as a match too)."""
    return [f'cluster-ips-check {ip} daddr @cluster-ips reject comment "Reject traffic to '
             'invalid ports of ClusterIPs"',
             *([f'cluster-ips-check {ip} daddr {{ {SERVICE_CIDR} }} drop comment "Drop '
                'traffic to unallocated ClusterIPs"'] if ip == "ip" else []),
             "filter-prerouting-pre-dnat ct state new jump firewall-check",
             "filter-forward ct state new jump service-endpoints-check",
             "filter-forward ct state new jump cluster-ips-check",
             "filter-input ct state new jump nodeport-endpoints-check",
             "filter-input ct state new jump service-endpoints-check",
             "filter-output ct state new jump service-endpoints-check",
             "filter-output-pre-dnat ct state new jump firewall-check",
             "filter-output ct state new jump cluster-ips-check",
             f"firewall-check {ip} daddr . meta l4proto . th dport vmap @firewall-ips",
             f"mark-for-masquerade mark set mark or {MARK}",
             f"masquerading mark and {MARK} == 0 return",
             f"masquerading mark set mark xor {MARK}", "masquerading masquerade fully-random",
             "nat-output jump services", "nat-postrouting jump masquerading",
             "nat-prerouting jump services",
             f"nodeport-endpoints-check {ip} daddr @nodeport-ips meta l4proto . th dport vmap "
             "@no-endpoint-nodeports", "reject-chain reject",
             f"services {ip} daddr . meta l4proto . th dport vmap @service-ips",
             f"services {ip} daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports",
             f"service-endpoints-check {ip} daddr . meta l4proto . th dport vmap "
             "@no-endpoint-services"]  # fmt: skip


def _nft_service(p: Port, cluster_cidr: str) -> list[str]:
    """One Service port's chains and map elements in `table ip kube-proxy`."""
    t, base = "ip kube-proxy", p.nft_name
    svc, ext = (f"{kind}-{_hash(base, 8)}-{base}" for kind in ("service", "external"))
    eps = [(e, f"{base}__{e.replace(':', '/')}") for e in p.endpoints]
    chains = [(e, f"endpoint-{_hash(name, 8)}-{name}") for e, name in eps]
    vmap = " , ".join(f"{i} : goto {chain}" for i, (_, chain) in enumerate(chains))
    # every chain first: a rule may only name a chain that exists (as kube-proxy adds them)
    lines = [f"add chain {t} {chain}" for _, chain in chains]
    lines += [f"add chain {t} {svc}",
             f"add rule {t} {svc} ip daddr {p.vip} ip saddr != {cluster_cidr} jump "
             "mark-for-masquerade",
             f"add rule {t} {svc} numgen random mod {len(chains)} vmap {{ {vmap} }}"]  # fmt: skip
    if p.node_port:
        lines += [f"add chain {t} {ext}", f"add rule {t} {ext} jump mark-for-masquerade",
                  f"add rule {t} {ext} goto {svc}"]  # fmt: skip
    for endpoint, chain in chains:
        lines += [f"add rule {t} {chain} ip saddr {endpoint.split(':')[0]} jump "
                  "mark-for-masquerade",
                  f"add rule {t} {chain} meta l4proto tcp dnat to {endpoint}"]  # fmt: skip
    lines += [
        f"add element {t} cluster-ips {{ {p.vip} }}",
        f"add element {t} service-ips {{ {p.vip} . tcp . {p.port} : goto {svc} }}",
    ]
    if p.node_port:
        lines.append(f"add element {t} service-nodeports {{ tcp . {p.node_port} : goto {ext} }}")
    return lines


def nft_ruleset(ports: tuple[Port, ...], *, node_ip: str, cluster_cidr: str) -> str:
    """Both families' tables, replaced in one transaction (a restarted kube-proxy's full
    sync: whatever the table held before is gone, the new one is complete)."""
    lines = []
    for family in ("ip", "ip6"):
        lines += [f"add table {family} kube-proxy", f"delete table {family} kube-proxy"]
        lines += _nft_base(family, node_ip)
    lines += [line for p in ports for line in _nft_service(p, cluster_cidr)]
    return "\n".join(lines) + "\n"


def _nftables_mode(ports: tuple[Port, ...], *, node_ip: str, cluster_cidr: str) -> None:
    sh("sysctl", "-qw", "net.ipv4.ip_forward=1")
    sh("nft", "-f", "-", stdin=nft_ruleset(ports, node_ip=node_ip, cluster_cidr=cluster_cidr))


def start_cleanup(mode: str) -> None:
    """platformCleanup for `mode`: iptables and IPVS modes remove the nftables tables
    (nftables.CleanupLeftovers); nftables mode runs the iptables and IPVS modes'
    CleanupLeftovers, whose IPVS part flushes every virtual server (ipvs.Flush) and deletes
    kube-ipvs0. Their chains and sets must already be gone here (the migration removed them):
    the lab checks that instead of removing them a second time."""
    if mode != "nftables":
        for family in ("ip", "ip6"):
            subprocess.run(["nft", "delete", "table", family, "kube-proxy"], capture_output=True)
        return
    assert not chains("ipvs") | chains("iptables"), "another mode's chains left"
    sh("ipvsadm", "-C")
    subprocess.run(["ip", "link", "del", DEVICE], capture_output=True)


def apply(mode: str, ports: tuple[Port, ...], *, node_ip: str, cluster_cidr: str) -> None:
    """A kube-proxy in `mode` starts on this node: its start-up clean-up, then its sync."""
    start_cleanup(mode)
    sync = {"ipvs": _ipvs_mode, "iptables": _iptables_mode, "nftables": _nftables_mode}[mode]
    sync(ports, node_ip=node_ip, cluster_cidr=cluster_cidr)


def forget() -> None:
    """Undo what `cleanup --kube-proxy` rightly leaves (kubelet's KUBE-FIREWALL, which
    iptables mode writes too, and route_localnet), so that the next test finds the host as
    it was."""
    for source in ("INPUT", "OUTPUT"):
        subprocess.run(["iptables", "-D", source, "-j", "KUBE-FIREWALL"], capture_output=True)
    for step in ("-F", "-X"):
        subprocess.run(["iptables", step, "KUBE-FIREWALL"], capture_output=True)
    sh("sysctl", "-qw", "net.ipv4.conf.all.route_localnet=0")


def chains(mode: str) -> set[str]:
    """kube-proxy's fixed chains of `mode` present now, as `table/chain` (nftables: its
    tables, as `family/kube-proxy`)."""
    if mode == "nftables":
        listed = sh("nft", "list", "tables").splitlines()
        return {f"{f}/kube-proxy" for f in ("ip", "ip6") if f"table {f} kube-proxy" in listed}
    tables = (("nat", NAT_CHAINS), ("filter", FILTER_CHAINS)) if mode == "ipvs" else (
        ("nat", (*IPTABLES_NAT, CANARY)), ("filter", (*IPTABLES_FILTER, CANARY)),
        ("mangle", (CANARY,)))  # fmt: skip
    found = set()
    for table, names in tables:
        saved = sh("iptables-save", "-t", table)
        found |= {f"{table}/{n}" for n in names if f":{n} " in saved}
    return found


def sets() -> set[str]:
    listed = set(sh("ipset", "list", "-n").split())
    return {name for name, _ in SETS} & listed
