"""What kube-proxy's IPVS mode leaves on a node, removed: `ipvsproxy cleanup --kube-proxy`.

Owns: `cleanup_kube_proxy()`. kube-proxy's own `--cleanup` (pkg/proxy/ipvs/proxier.go
`CleanupLeftovers`) removes its iptables chains (`iptablesCleanupChains`) and the jumps into
them, its ipsets (`ipsetInfo`, IPv6 ones named `KUBE-6-...`), every IPVS virtual server on
the host, and the kube-ipvs0 device. This does the same, in both IP families, except that
it never touches what is not kube-proxy's: other chains (kubelet's KUBE-FIREWALL and
KUBE-KUBELET-CANARY stay, and so do kube-proxy's iptables-mode chains, which its IPVS mode
never made), other sets, and, with `ipvs=True`, only the virtual servers the ownership rule
gives to the proxy of this node (VIPs on the dummy device, `--service-cidr`, NodePorts on
this host's addresses: docs/ownership.md), with the dummy device and its addresses.

Without `ipvs` the IPVS table and kube-ipvs0 stay: ipvsproxy, started next with the same
dummy device, takes their virtual servers over in place (it owns them by the same rule),
so a migration from kube-proxy drops no connection. `dry_run` lists, changes nothing.

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
from ipvsproxy.firewall.kube_proxy import NodePort, node_ports
from ipvsproxy.iptables.kernel import TOOLS, Commands, restore
from ipvsproxy.iptables.parse import Saved, parse_save
from ipvsproxy.iptables.transaction import removal

log = logging.getLogger(__name__)

# kube-proxy's IPVS proxier: iptablesCleanupChains, by table
CHAINS = {
    "nat": ("KUBE-SERVICES", "KUBE-POSTROUTING", "KUBE-NODE-PORT", "KUBE-LOAD-BALANCER",
            "KUBE-MARK-MASQ"),
    "filter": ("KUBE-FORWARD", "KUBE-NODE-PORT", "KUBE-PROXY-FIREWALL",
               "KUBE-SOURCE-RANGES-FIREWALL", "KUBE-IPVS-FILTER", "KUBE-IPVS-OUT-FILTER"),
}  # fmt: skip
# kube-proxy's IPVS proxier: ipsetInfo (pkg/proxy/ipvs/ipset.go); IPv6: KUBE-6-...
SETS = ("KUBE-LOOP-BACK", "KUBE-CLUSTER-IP", "KUBE-EXTERNAL-IP", "KUBE-EXTERNAL-IP-LOCAL",
        "KUBE-LOAD-BALANCER", "KUBE-LOAD-BALANCER-FW", "KUBE-LOAD-BALANCER-LOCAL",
        "KUBE-LOAD-BALANCER-SOURCE-IP", "KUBE-LOAD-BALANCER-SOURCE-CIDR",
        "KUBE-NODE-PORT-TCP", "KUBE-NODE-PORT-LOCAL-TCP", "KUBE-NODE-PORT-UDP",
        "KUBE-NODE-PORT-LOCAL-UDP", "KUBE-NODE-PORT-SCTP-HASH",
        "KUBE-NODE-PORT-LOCAL-SCTP-HASH", "KUBE-HEALTH-CHECK-NODE-PORT",
        "KUBE-IPVS-IPS")  # fmt: skip
ALL_SETS = frozenset(SETS) | {"KUBE-6-" + name.removeprefix("KUBE-") for name in SETS}
DUMMY = "kube-ipvs0"


def cleanup_kube_proxy(
    config: Config, *, dry_run: bool, ipvs: bool = False, commands: Commands | None = None
) -> list[str]:
    """Remove (or list, with dry_run) kube-proxy's chains and sets, and with `ipvs` its
    virtual servers and dummy device; what was (would be) removed, in words."""
    commands = commands or Commands()
    listed: frozenset[NodePort] | None = None
    if ipvs:  # kube-proxy's record of its NodePorts, read before its sets go
        try:
            listed = node_ports(commands)
        except KernelError as exc:
            log.warning("cannot read kube-proxy's NodePort ipsets: %s", exc)
    removed = _chains(commands, dry_run=dry_run)
    removed += _sets(commands, dry_run=dry_run)  # after the rules that match them
    if ipvs:
        kube = dataclasses.replace(config, dummy_device=DUMMY)
        removed += backends.ipvs_cleanup(kube, dry_run=dry_run, listed=listed)
    return removed


def selected(text: str, table: str) -> Saved:
    """Of one table of `iptables-save` output, kube-proxy's IPVS mode's chains (exact names)
    and every rule elsewhere whose target (read by tokens: a comment naming a chain is no
    jump) is one of them."""
    return parse_save(text, table=table, owns=frozenset(CHAINS[table]).__contains__)


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


def _sets(commands: Commands, *, dry_run: bool) -> list[str]:
    if shutil.which("ipset") is None:
        return []
    names = sorted(n for n in commands.run(["ipset", "list", "-n"]).split() if n in ALL_SETS)
    if names and not dry_run:
        commands.run(["ipset", "restore"], stdin=render_script(destroy_commands(names)))
    return [f"ipset {name}" for name in names]
