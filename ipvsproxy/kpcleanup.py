"""What kube-proxy leaves on a node, in any of its three modes, removed:
`ipvsproxy cleanup --kube-proxy`.

Owns: `cleanup_kube_proxy()` and the names of what kube-proxy makes, each from kube-proxy's
own clean-up code (v1.36), which `kube-proxy --cleanup` runs for every mode
(cmd/kube-proxy/app/server_linux.go `platformCleanup`):
- IPVS mode (pkg/proxy/ipvs/proxier.go `CleanupLeftovers`): its iptables chains
  (`iptablesCleanupChains`) and the jumps into them, its ipsets (`ipsetInfo`; IPv6 ones named
  `KUBE-6-...` and cut to the kernel's 31 characters, pkg/proxy/ipvs/ipset.go `NewIPSet`),
  every IPVS virtual server on the host, and the kube-ipvs0 device;
- iptables mode (pkg/proxy/iptables/cleanup.go `CleanupLeftovers`): its fixed chains in nat,
  filter and mangle (KUBE-PROXY-CANARY), its per-Service chains in nat (`isServiceChainName`:
  KUBE-SVC-, KUBE-SVL-, KUBE-SEP-, KUBE-FW-, KUBE-EXT-), and the jumps into them;
- nftables mode (pkg/proxy/nftables/cleanup.go): its `kube-proxy` table in the ip and ip6
  families.
This does the same, in both IP families, except that it never touches what is not
kube-proxy's: other chains (kubelet's KUBE-FIREWALL, KUBE-KUBELET-CANARY and
KUBE-IPTABLES-HINT stay), other sets, other nftables tables (firewalld's, a CNI's), and,
with `ipvs=True`, only the virtual servers the ownership rule gives to the proxy of this
node (VIPs on the dummy device, `--service-cidr`, NodePorts on this host's addresses:
docs/ownership.md), with the dummy device and its addresses.

Without `ipvs` the IPVS table and kube-ipvs0 stay: ipvsproxy, started next with the same
dummy device, takes their virtual servers over in place (it owns them by the same rule),
so a migration from kube-proxy's IPVS mode drops no connection. `dry_run` lists, changes
nothing.

Imports: iptables, firewall, backends, config, errors, the standard library.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil

from ipvsproxy import backends
from ipvsproxy.config import Config
from ipvsproxy.errors import KernelError
from ipvsproxy.firewall.ipset import destroy_commands, render_script
from ipvsproxy.firewall.kube_proxy import NodePort, ipv6_set_name, node_ports
from ipvsproxy.host.commands import Commands
from ipvsproxy.iptables.parse import Saved, parse_save
from ipvsproxy.iptables.tools import TOOLS, restore
from ipvsproxy.iptables.transaction import removal

log = logging.getLogger(__name__)

# kube-proxy's IPVS proxier: iptablesCleanupChains, by table
IPVS_CHAINS = {
    "nat": ("KUBE-SERVICES", "KUBE-POSTROUTING", "KUBE-NODE-PORT", "KUBE-LOAD-BALANCER",
            "KUBE-MARK-MASQ"),
    "filter": ("KUBE-FORWARD", "KUBE-NODE-PORT", "KUBE-PROXY-FIREWALL",
               "KUBE-SOURCE-RANGES-FIREWALL", "KUBE-IPVS-FILTER", "KUBE-IPVS-OUT-FILTER"),
}  # fmt: skip
# kube-proxy's iptables proxier: the chains its CleanupLeftovers names, by table
IPTABLES_CHAINS = {
    "nat": ("KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ",
            "KUBE-PROXY-CANARY"),
    "filter": ("KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES", "KUBE-FORWARD", "KUBE-NODEPORTS",
               "KUBE-PROXY-FIREWALL", "KUBE-PROXY-CANARY"),
    "mangle": ("KUBE-PROXY-CANARY",),
}  # fmt: skip
# ... and its per-Service chains, nat only (isServiceChainName)
SERVICE_CHAIN_PREFIXES = ("KUBE-SVC-", "KUBE-SVL-", "KUBE-SEP-", "KUBE-FW-", "KUBE-EXT-")
CHAINS = {
    table: frozenset(IPVS_CHAINS.get(table, ())) | frozenset(IPTABLES_CHAINS.get(table, ()))
    for table in ("nat", "filter", "mangle")
}
# kube-proxy's IPVS proxier: ipsetInfo (pkg/proxy/ipvs/ipset.go); IPv6: ipv6_set_name()
SETS = ("KUBE-LOOP-BACK", "KUBE-CLUSTER-IP", "KUBE-EXTERNAL-IP", "KUBE-EXTERNAL-IP-LOCAL",
        "KUBE-LOAD-BALANCER", "KUBE-LOAD-BALANCER-FW", "KUBE-LOAD-BALANCER-LOCAL",
        "KUBE-LOAD-BALANCER-SOURCE-IP", "KUBE-LOAD-BALANCER-SOURCE-CIDR",
        "KUBE-NODE-PORT-TCP", "KUBE-NODE-PORT-LOCAL-TCP", "KUBE-NODE-PORT-UDP",
        "KUBE-NODE-PORT-LOCAL-UDP", "KUBE-NODE-PORT-SCTP-HASH",
        "KUBE-NODE-PORT-LOCAL-SCTP-HASH", "KUBE-HEALTH-CHECK-NODE-PORT",
        "KUBE-IPVS-IPS")  # fmt: skip
ALL_SETS = frozenset(SETS) | {ipv6_set_name(name) for name in SETS}
NFT_TABLE = "kube-proxy"  # pkg/proxy/nftables/proxier.go kubeProxyTable
NFT_FAMILIES = ("ip", "ip6")
DUMMY = "kube-ipvs0"


def cleanup_kube_proxy(
    config: Config, *, dry_run: bool, ipvs: bool = False, commands: Commands | None = None
) -> list[str]:
    """Remove (or list, with dry_run) kube-proxy's chains, sets and nftables tables, and with
    `ipvs` its virtual servers and dummy device; what was (would be) removed, in words."""
    commands = commands or Commands()
    listed: frozenset[NodePort] | None = None
    if ipvs:  # kube-proxy's record of its NodePorts, read before its sets go
        try:
            listed = node_ports(commands)
        except KernelError as exc:
            log.warning("cannot read kube-proxy's NodePort ipsets: %s", exc)
    removed = _chains(commands, dry_run=dry_run)
    removed += _sets(commands, dry_run=dry_run)  # after the rules that match them
    removed += _nft(commands, dry_run=dry_run)
    if ipvs:
        kube = dataclasses.replace(config, dummy_device=DUMMY)
        removed += backends.ipvs_cleanup(kube, dry_run=dry_run, listed=listed)
    return removed


def kube_proxys(chain: str, table: str) -> bool:
    """Whether kube-proxy (any mode) made this chain of this table: by exact name, or by a
    per-Service prefix in nat, as its CleanupLeftovers decides."""
    if chain in CHAINS[table]:
        return True
    return table == "nat" and chain.startswith(SERVICE_CHAIN_PREFIXES)


def selected(text: str, table: str) -> Saved:
    """Of one table of `iptables-save` output, kube-proxy's chains (`kube_proxys`) and every
    rule elsewhere whose target (read by tokens: a comment naming a chain is no jump) is
    one of them."""
    return parse_save(text, table=table, owns=lambda chain: kube_proxys(chain, table))


def _chains(commands: Commands, *, dry_run: bool) -> list[str]:
    removed: list[str] = []
    for version, (save, _) in TOOLS.items():
        if shutil.which(save) is None:
            continue
        for table in CHAINS:
            try:
                text = commands.run([save, "-t", table])
            except KernelError as exc:
                log.debug("cleanup: no IPv%d %s table: %s", version, table, exc)
                continue
            saved = selected(text, table)
            tool = "iptables" if version == 4 else "ip6tables"
            removed += [f"{tool} -t {table}: rule -A {c} {spec}" for c, spec in saved.jumps]
            removed += [f"{tool} -t {table}: chain {c}" for c in sorted(saved.chains)]
            payload = removal(saved, table=table)
            if payload and not dry_run:
                restore(commands, version, payload)
    return removed


def nft_tables(listed: str) -> list[tuple[str, str]]:
    """Of `nft list tables` output, kube-proxy's nftables-mode tables as (family, name):
    `kube-proxy` in ip or ip6 only (an inet or another family's table of that name is
    someone else's)."""
    tables = (line.split() for line in listed.splitlines())
    return [
        (words[1], words[2])
        for words in tables
        if len(words) == 3 and words[0] == "table"
        if words[1] in NFT_FAMILIES and words[2] == NFT_TABLE
    ]


def _nft(commands: Commands, *, dry_run: bool) -> list[str]:
    if shutil.which("nft") is None:  # said: kube-proxy's nftables mode would stay unseen
        log.warning(
            "nft is not installed: kube-proxy's nftables tables (its nftables mode) are not "
            "looked for, and would stay"
        )
        return []
    try:
        found = nft_tables(commands.run(["nft", "list", "tables"]))
    except KernelError as exc:  # a kernel without nf_tables: nothing of that mode here
        log.debug("cleanup: cannot list nftables tables: %s", exc)
        return []
    if found and not dry_run:  # one transaction: both tables go, or neither
        script = "".join(f"delete table {family} {name}\n" for family, name in found)
        commands.run(["nft", "-f", "-"], stdin=script)
    return [f"nft: table {family} {name}" for family, name in found]


def _sets(commands: Commands, *, dry_run: bool) -> list[str]:
    if shutil.which("ipset") is None:
        return []
    names = sorted(n for n in commands.run(["ipset", "list", "-n"]).split() if n in ALL_SETS)
    if names and not dry_run:
        commands.run(["ipset", "restore"], stdin=render_script(destroy_commands(names)))
    return [f"ipset {name}" for name in names]
