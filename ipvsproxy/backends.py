"""Which kernel backend to use, opening it, and removing what either backend left behind.

Owns: `open_backend()` (`--backend ipvs|iptables|auto`: auto probes IPVS for real, with the
configured scheduler, and falls back to iptables loudly: a WARNING that says why, the
reason kept for /healthz and the metric, or, with `--no-fallback`, `FallbackRefused`; with
IPVS, the firewall rules opened and checked at once: without their tools the node refuses
to start, `FirewallUnavailable`, unless `--allow-no-firewall-rules` says to go on without
them),
`prepare()` (the node settings the backend needs), `remove_leftovers()` (when the backend
changed between runs, the other one's objects go) and `cleanup()` (everything ipvsproxy
owns in both backends, and nothing else).

Imports: netlink, fallback, firewall, sync, kernel, policy, model, config, errors.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ipvsproxy.config import Config
from ipvsproxy.errors import FallbackRefused, KernelError, KernelUnavailable, Unsupported
from ipvsproxy.fallback import IptablesKernel
from ipvsproxy.firewall.firewall_plan import HostFirewall
from ipvsproxy.firewall.host_firewall import Firewall
from ipvsproxy.firewall.ipset import SetChange
from ipvsproxy.firewall.kube_proxy import NodePort, adopted
from ipvsproxy.firewall.nft_firewall import NftFirewall
from ipvsproxy.firewall.set_reader import SetReader
from ipvsproxy.firewall.set_writer import SetWriter
from ipvsproxy.firewall.sets import CREATED, record_of, recorded
from ipvsproxy.host.commands import Commands
from ipvsproxy.kernel import AccessMap, ApplyReport, Failure, Kernel
from ipvsproxy.model import (
    EMPTY,
    AddDest,
    AddService,
    BindAddress,
    IPAddress,
    IpvsState,
    Op,
    RSKey,
    Traffic,
    UpdateDest,
    UpdateService,
    VSKey,
)
from ipvsproxy.policy import LocalMode, node_policy
from ipvsproxy.sync.ownership import ownership_for
from ipvsproxy.sync.plan import plan

if TYPE_CHECKING:
    from ipvsproxy.netlink import NetlinkKernel
    from ipvsproxy.traffic import Counted

log = logging.getLogger(__name__)

IPVS, IPTABLES = "ipvs", "iptables"
BACKENDS = (IPVS, IPTABLES)
NFTABLES = "nftables"
FIREWALLS = (NFTABLES, IPTABLES)  # --firewall: IPVS mode's firewall rules


LOST_WITHOUT_COMPANION = (
    "no VIP port filter, no loadBalancerSourceRanges, no masquerade (Services then work "
    "only for clients on this node)"
)


class FirewallUnavailable(KernelUnavailable):
    """IPVS is usable but the firewall rules are not (a tool missing): refusing to start,
    since IPVS alone fails open (no source ranges, no VIP port filter)."""


@dataclass(frozen=True, slots=True)
class Backend:
    """The kernel backend in use and why."""

    kernel: Kernel
    name: str  # "ipvs" or "iptables"
    reason: str
    fallback: bool = False  # iptables because IPVS is not usable here
    firewall: HostFirewall | None = None  # IPVS: its firewall rules (None: none)
    firewall_missing: str = ""  # IPVS without them (--allow-no-firewall-rules): why
    firewall_reason: str = ""  # why this implementation of them (--firewall)

    @property
    def detail(self) -> dict[str, object]:
        """What /healthz reports about the backend."""
        detail: dict[str, object] = {"backend": self.name, "backendReason": self.reason}
        if self.fallback:
            detail["fallback"] = True
        if self.firewall is not None:
            detail["firewall"] = self.firewall.name
            detail["firewallReason"] = self.firewall_reason
        if self.firewall_missing:
            detail["firewallRules"] = f"disabled: {self.firewall_missing}"
        return detail


@contextmanager
def open_backend(config: Config, *, commands: Commands | None = None) -> Iterator[Backend]:
    """The backend `config.backend` asks for; KernelUnavailable (FallbackRefused) if none,
    FirewallUnavailable for IPVS without the firewall's tools. The firewall, if any,
    is closed at the end. Its sockets are opened in this thread's network namespace, its
    tools run by `commands` (the integration lab: `ip netns exec` of a node's namespace)."""
    if config.backend == IPTABLES:
        yield Backend(_iptables(config), IPTABLES, "--backend iptables")
        return
    if config.backend == IPVS:
        with _ipvs_backend(config, "--backend ipvs", commands) as backend:
            yield backend
        return
    from ipvsproxy.netlink.probe import probe

    result = probe(config.scheduler)
    if result.usable:
        with _ipvs_backend(config, result.reason, commands) as backend:
            yield backend
        return
    if not config.fallback:
        raise FallbackRefused(
            f"IPVS is not usable here ({result.reason}) and --no-fallback forbids the "
            "iptables fallback"
        )
    log.warning(
        "IPVS is not usable here (%s): FALLING BACK to the iptables backend "
        "(schedulers are approximated: docs/fallback.md#schedulers)",
        result.reason,
    )
    yield Backend(
        _iptables(config), IPTABLES, f"IPVS is not usable: {result.reason}", fallback=True
    )


@contextmanager
def _ipvs_backend(
    config: Config, reason: str, commands: Commands | None = None
) -> Iterator[Backend]:
    """IPVS with its firewall rules, both checked before anything on the node changes
    (opening them changes nothing). A family the firewall cannot protect (IPv6 without
    ip6tables) gets no virtual server or VIP at all: `FailClosed`."""
    with _ipvs(config) as ipvs:
        firewall, why = _firewall(config, commands)
        missing = why if firewall is None else ""
        kernel: Kernel = ipvs
        if firewall is not None and firewall.versions != (4, 6):
            kernel = FailClosed(ipvs, firewall.versions)
        try:
            yield Backend(
                kernel,
                IPVS,
                reason,
                firewall=firewall,
                firewall_missing=missing,
                firewall_reason=why if firewall is not None else "",
            )
        finally:
            if firewall is not None:
                firewall.close()


class FailClosed:
    """The IPVS kernel, refusing to program the IP families the firewall rules do not
    cover (IPv6 on a node without ip6tables): there a VIP would have no port filter and a
    LoadBalancer no loadBalancerSourceRanges. Adds, updates and binds of such a family fail
    as `Unsupported` (counted in `ipvsproxy_kernel_operations_total{result="error"}`, one
    WARNING per virtual server); deletions pass, so nothing stale stays. kube-proxy does the
    same: without ip6tables it runs IPv4 only."""

    owns_table = False

    def __init__(self, kernel: NetlinkKernel, versions: tuple[int, ...]) -> None:
        self.kernel = kernel
        self.versions = versions
        self._warned: set[object] = set()

    def observe(self, *, access: AccessMap | None = None) -> IpvsState:
        return self.kernel.observe()

    def damage(self) -> tuple[str, ...]:
        return self.kernel.damage()

    def connections(self, key: VSKey) -> Mapping[RSKey, tuple[int, int]]:
        return self.kernel.connections(key)

    def traffic(self) -> Mapping[VSKey, Traffic]:
        return self.kernel.traffic()

    def apply(
        self,
        plan: Sequence[Op],
        *,
        names: Mapping[VSKey, str] | None = None,
        access: AccessMap | None = None,
    ) -> ApplyReport:
        allowed: list[Op] = []
        refused: list[Failure] = []
        for op in plan:
            match op:
                case AddService(vs) | UpdateService(vs) if (
                    vs.key.address.version not in self.versions
                ):
                    subject: object = vs.key
                case AddDest(key, _) | UpdateDest(key, _) if (
                    key.address.version not in self.versions
                ):
                    subject = key
                case BindAddress(address) if address.version not in self.versions:
                    subject = address
                case _:
                    allowed.append(op)
                    continue
            why = (
                f"{subject}: not programmed (fail closed): the firewall rules cannot cover "
                "this IP family here (no ip6tables), so it would have no VIP port filter "
                "and no loadBalancerSourceRanges"
            )
            if subject not in self._warned:
                self._warned.add(subject)
                log.warning("%s", why)
            refused.append(Failure(op, Unsupported(why)))
        report = (
            self.kernel.apply(allowed, names=names, access=access) if allowed else ApplyReport()
        )
        return ApplyReport(report.applied, (*report.failures, *refused), report.refused)


def prepare(backend: Backend, config: Config) -> None:
    """What the backend needs of the node before its first sync: `prepare_node()`'s kernel
    settings, and IPVS's connection timeouts."""
    from ipvsproxy.netlink.ipvs_kernel import NetlinkKernel

    for line in prepare_node(config, ipvs=backend.name == IPVS).changed:
        log.info("%s", line)
    kernel = backend.kernel.kernel if isinstance(backend.kernel, FailClosed) else backend.kernel
    if isinstance(kernel, NetlinkKernel):
        kernel.set_timeouts(
            tcp=config.tcp_timeout, tcp_fin=config.tcp_fin_timeout, udp=config.udp_timeout
        )


@dataclass(frozen=True, slots=True)
class Prepared:
    """What `prepare_node()` did, in words."""

    changed: tuple[str, ...]  # modules loaded, settings written
    unchanged: tuple[str, ...]  # settings that already had their value


def prepare_node(config: Config, *, ipvs: bool | None, load_modules: bool = False) -> Prepared:
    """The kernel settings a backend needs: sysctls (the IPVS ones only for `ipvs`; None:
    when the kernel has IPVS) and conntrack's, as kube-proxy sets them. With `load_modules`,
    the IPVS modules are loaded first: the DaemonSet's init container does this with
    privileges the agent itself need not have. A conntrack setting that cannot be written
    is a warning, not a failure (see conntrack_settings)."""
    from ipvsproxy.host import conntrack_settings, sysctl

    changed = _load_modules(config) if load_modules else []
    if ipvs is None:
        ipvs = os.path.isdir("/proc/sys/net/ipv4/vs")
    settings = sysctl.required(os.uname().release, strict_arp=config.strict_arp)
    if not ipvs:  # the IPVS settings do not exist without IPVS
        settings = tuple(s for s in settings if ".vs." not in s.name)
    written = sysctl.ensure(settings)
    changed += [f"set {s.name}={s.value}: {s.why}" for s in written]
    unchanged = [f"{s.name}={s.value} already" for s in settings if s not in written]
    conntrack = conntrack_settings.ensure(conntrack_settings.settings_of(config))
    changed += [f"set {w.name}={w.value} (conntrack, as kube-proxy)" for w in conntrack.changed]
    for warning in conntrack.warnings:
        log.warning("%s", warning)
    return Prepared(tuple(changed), tuple(unchanged))


def _load_modules(config: Config) -> list[str]:
    done = []
    for module in ("ip_vs", config.scheduler.module, "dummy"):
        try:
            loaded = subprocess.run(["modprobe", module], capture_output=True, text=True)
        except OSError as exc:
            log.warning("cannot run modprobe: %s", exc)
            break
        if loaded.returncode:
            log.warning("modprobe %s: %s", module, loaded.stderr.strip() or "failed")
        else:
            done.append(f"module {module} loaded")
    return done


def remove_leftovers(backend: Backend, config: Config, *, dry_run: bool = False) -> list[str]:
    """The other backend's objects, removed: the backend changed since the last run (with
    `dry_run`, only found and listed, the other firewall implementation's among them). With
    IPVS, the other firewall implementation's record of node-address virtual servers is
    copied into this one's; its rules stay until this one's are written
    (`retire_other_firewall()`, after the first full pass), so the node is never without."""
    if backend.name == IPVS:
        removed = _iptables_cleanup(dry_run=dry_run)
    else:
        removed = _ipvs_cleanup(config, dry_run=dry_run)
    if dry_run:
        other = [] if backend.firewall is None else _firewall_cleanup(
            dry_run=True, keep=backend.firewall.name
        )  # fmt: skip
        return removed + other
    for item in removed:
        log.warning("removed a leftover of the %s backend: %s", _other(backend.name), item)
    if backend.firewall is not None:
        adopt_records(backend.firewall)
    return removed


def retire_other_firewall(firewall: HostFirewall) -> list[str]:
    """The other firewall implementation's rules and sets, removed (the choice changed since
    the last run): called once `firewall`'s rules are written, after the first full pass."""
    removed = _firewall_cleanup(dry_run=False, keep=firewall.name)
    for item in removed:
        log.warning("removed a leftover of the other firewall implementation: %s", item)
    return removed


def cleanup(config: Config, *, dry_run: bool, ipvs: bool = True) -> list[str]:
    """Everything ipvsproxy owns in both backends, removed (or listed, with dry_run); without
    `ipvs`, its IPVS virtual servers and dummy device stay (for kube-proxy's IPVS mode to take
    over in place: the way back from a migration), only its iptables rules and sets go."""
    if not ipvs:
        return _firewall_cleanup(dry_run=dry_run) + _iptables_cleanup(dry_run=dry_run)
    return _ipvs_cleanup(config, dry_run=dry_run) + _iptables_cleanup(dry_run=dry_run)


def _firewall(config: Config, commands: Commands | None = None) -> tuple[HostFirewall | None, str]:
    """The firewall rules `config.firewall` asks for, checked: (firewall, why this one).
    auto: nftables where the kernel takes ipvsproxy's table and `nft` works, else iptables
    and ipsets. Without what they need: FirewallUnavailable naming it, or, with
    `config.allow_no_firewall`, (None, why) and an ERROR saying what is lost."""
    commands = commands or Commands()
    refused = ""
    if config.firewall == "auto" and _forward_drops(commands):
        refused = (
            "nftables: the iptables FORWARD policy is DROP, and only an iptables rule can "
            "accept IPVS's forwarded replies there (docs/firewall.md#forward)"
        )
    elif config.firewall in ("auto", NFTABLES):
        nft = NftFirewall(commands=commands)
        try:
            nft.check()
        except KernelError as exc:
            nft.close()
            refused = f"nftables: {exc}"
        else:
            why = f"--firewall {config.firewall}"
            if config.firewall == "auto":
                why += ": the kernel takes ipvsproxy's nftables table"
            log.info("firewall rules: nftables, table %s (%s)", "inet ipvsproxy", why)
            if config.firewall == NFTABLES and _forward_drops(commands):
                log.warning(
                    "--firewall nftables on a node whose iptables FORWARD policy is DROP: "
                    "replies IPVS forwards back to pods are dropped there unless another rule "
                    "accepts them (docs/firewall.md#forward)"
                )
            return nft, why
        if config.firewall == NFTABLES:
            why = refused.removeprefix("nftables: ")
            return _no_firewall(config, f"the firewall nftables table cannot be used: {why}")
    firewall = iptables_firewall(commands)
    try:
        firewall.check()
    except KernelError as exc:
        firewall.close()
        why = f"the firewall iptables/ipset rules cannot be used: {exc}"
        return _no_firewall(config, f"{why}; {refused}" if refused else why)
    why = f"--firewall {config.firewall}"
    if refused:
        why += f": {refused}"
        log.warning("firewall rules: iptables and ipsets, as nftables is refused (%s)", refused)
    else:
        log.info("firewall rules: iptables and ipsets (%s)", why)
    return firewall, why


def _forward_drops(commands: Commands) -> bool:
    """Whether the host's iptables filter FORWARD chain has policy DROP (Docker sets it):
    an ACCEPT in ipvsproxy's nftables table cannot overrule another table's drop, so the
    replies IPVS forwards back to a pod would be lost. False without the iptables tool."""
    if shutil.which("iptables") is None:
        return False
    try:
        listed = commands.run(["iptables", "-w", "-t", "filter", "-S", "FORWARD"])
    except KernelError:
        return False
    return listed.startswith("-P FORWARD DROP")


def _no_firewall(config: Config, why: str) -> tuple[None, str]:
    """FirewallUnavailable, or with --allow-no-firewall-rules (None, why) and an ERROR."""
    if not config.allow_no_firewall:
        raise FirewallUnavailable(
            f"{why}; IPVS without them would mean {LOST_WITHOUT_COMPANION}. Install "
            "the missing tool, or pass --allow-no-firewall-rules to run without them"
        )
    log.error(
        "%s; running without them as --allow-no-firewall-rules asks: %s",
        why,
        LOST_WITHOUT_COMPANION,
    )
    return None, why


def iptables_firewall(commands: Commands) -> Firewall:
    """The iptables firewall, its sets read and written over netlink where it can."""
    try:  # the sets read over netlink: `ipset save` is slow where /etc is (see nlread.py)
        reader: SetReader | None = SetReader()
    except KernelError as exc:
        log.info("ipsets read with the ipset tool, not over netlink: %s", exc)
        reader = None
    try:  # ...and written over netlink: `ipset restore` is slow there too (see nlwrite.py)
        writer: SetWriter | None = SetWriter()
    except KernelError as exc:
        log.info("ipsets written with the ipset tool, not over netlink: %s", exc)
        writer = None
    return Firewall(commands=commands, reader=reader, writer=writer)


def _firewall_cleanup(*, dry_run: bool, keep: str = "") -> list[str]:
    """Both implementations' firewall rules and sets (all but `keep`'s, by name)."""
    removed: list[str] = []
    for firewall in _both_firewalls():
        if firewall.name == keep:
            continue
        try:
            firewall.check()
            removed += firewall.cleanup(dry_run=dry_run)
        except KernelError as exc:
            log.debug("no %s firewall rules to clean up: %s", firewall.name, exc)
        finally:
            firewall.close()
    return removed


def _both_firewalls() -> tuple[HostFirewall, ...]:
    return (NftFirewall(), Firewall())


def adopt_records(firewall: HostFirewall) -> frozenset[VSKey]:
    """The other firewall implementation's record of the virtual servers ipvsproxy made on
    node addresses (its CREATED sets), copied into `firewall`'s before the first pass reads
    it, so that none of them is ever in neither record (an agent killed at any moment
    still knows them). What was copied."""
    found: frozenset[VSKey] = frozenset()
    for other in _both_firewalls():
        if other.name == firewall.name:
            continue
        try:
            other.check()
            found |= recorded(other.observe_sets())
        except KernelError as exc:
            log.debug("no %s firewall to take a record from: %s", other.name, exc)
        finally:
            other.close()
    entries: dict[int, list[str]] = {}
    for key in found:
        entries.setdefault(key.address.version, []).append(record_of(key)[1])
    firewall.write_sets(
        SetChange(CREATED.name(v), CREATED.kind, v, True, tuple(sorted(e)), wanted=frozenset(e))
        for v, e in sorted(entries.items())
        if v in firewall.versions
    )
    return found


def traffic_kernel(backend: Backend) -> Counted:
    """What `traffic.TrafficReader` reads the counters from: for IPVS a netlink connection
    of its own (a dump from another thread on the sync pass's socket would interleave with
    the pass's messages); the fallback's kernel as it is (its traffic() is {}, read from
    nowhere)."""
    if backend.name != IPVS:
        return backend.kernel
    from ipvsproxy.netlink import CounterReader

    return CounterReader()


def _ipvs(config: Config) -> NetlinkKernel:
    from ipvsproxy.netlink import NetlinkKernel

    return NetlinkKernel(device=config.dummy_device)


def _iptables(config: Config) -> IptablesKernel:
    """The fallback, masquerading as the node's policy says. Each virtual server's access
    (loadBalancerSourceRanges, traffic policy) comes from the desired state, with each
    observation and pass (`Kernel.observe`/`apply`'s `access`)."""
    if config.detect_local_mode == LocalMode.NODE_CIDR:
        log.warning(
            "--detect-local-mode NodeCIDR: the iptables fallback does not know this Node's "
            "pod CIDRs; ClusterIP traffic is masqueraded only with --masquerade-all"
        )
    kernel = IptablesKernel(node=node_policy(config))
    kernel.check()
    return kernel


def _iptables_cleanup(*, dry_run: bool) -> list[str]:
    try:
        kernel = IptablesKernel()
        kernel.check()
        return kernel.cleanup(dry_run=dry_run)
    except KernelUnavailable as exc:
        log.debug("no iptables to clean up: %s", exc)
        return []


def _ipvs_cleanup(config: Config, *, dry_run: bool) -> list[str]:
    """ipvsproxy's firewall rules and sets (first: they match IPVS VIPs), then its IPVS
    table and dummy device (`ipvs_cleanup`), with the virtual servers its record set
    (IPVSPROXY-CREATED) lists, read before the sets go."""
    recorded = _recorded()
    return _firewall_cleanup(dry_run=dry_run) + ipvs_cleanup(
        config, dry_run=dry_run, recorded=recorded
    )


def _recorded() -> frozenset[VSKey] | None:
    """The virtual servers ipvsproxy's record sets list, in either implementation of the
    firewall (None when neither can be read)."""
    found: frozenset[VSKey] | None = None
    for firewall in _both_firewalls():
        try:
            firewall.check()
            found = (found or frozenset()) | recorded(firewall.observe_sets())
        except KernelError as exc:
            log.debug("no record of ipvsproxy's virtual servers in %s: %s", firewall.name, exc)
        finally:
            firewall.close()
    return found


def ipvs_cleanup(
    config: Config,
    *,
    dry_run: bool,
    recorded: frozenset[VSKey] | None = None,
    listed: frozenset[NodePort] | None = None,
) -> list[str]:
    """The virtual servers the ownership rule gives the proxy of this node (as for any
    sync), with `config.dummy_device` and its VIPs. Node-address virtual servers are those a
    record lists: `recorded`, ipvsproxy's record (rule 5), or `listed`, the NodePorts
    kube-proxy's sets list (rule 6); with neither readable (both None), those in the NodePort
    range of this host's addresses (rule 3c)."""
    from ipvsproxy.netlink import NetlinkKernel
    from ipvsproxy.sync.render import describe

    removed: list[str] = []
    try:
        kernel = NetlinkKernel(device=config.dummy_device)
    except KernelUnavailable as exc:
        log.debug("no IPVS to clean up: %s", exc)
        return removed
    with kernel:
        observed = kernel.observe()
        own = ownership_for(config, _host_addresses())
        kube_proxys = adopted(listed or frozenset(), observed.services, own.nodeport_addresses)
        own = replace(
            own,
            recorded=(recorded or frozenset()) | kube_proxys,
            range_claims=recorded is None and listed is None,
        )
        ops = plan(EMPTY, observed, ownership=own)
        removed += [
            "IPVS: " + describe(op, {}, observed, config.dummy_device).command for op in ops
        ]
        device = kernel.has_device()
        if device:
            removed.append(f"IPVS: the dummy device {config.dummy_device}")
        if not dry_run:
            report = kernel.apply(ops)
            for failure in report.failures:
                log.error("cleanup: %s", failure.error)
            if device:
                kernel.remove_device()
    return removed


def _host_addresses() -> tuple[IPAddress, ...]:
    from ipvsproxy.netlink.links import host_addresses

    try:
        return host_addresses()
    except KernelError as exc:
        log.warning("cannot list this host's addresses (NodePorts are not recognised): %s", exc)
        return ()


def _other(name: str) -> str:
    return IPTABLES if name == IPVS else IPVS
