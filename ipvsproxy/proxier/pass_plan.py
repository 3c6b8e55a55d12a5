"""What one pass would do (`PassPlan`) and what it did (`PassResult`): the values the pass's
steps hand each other and its callers (`diff` renders a plan, the agent loop reads results).

Imports: firewall (its plan and observation), sync (the IPVS step's plan and result), kernel,
model, errors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ipvsproxy.firewall.firewall_plan import FirewallPlan, Observed
from ipvsproxy.model import (
    AddDest,
    AddService,
    BindAddress,
    DeleteDest,
    DeleteService,
    IPAddress,
    RSKey,
    UnbindAddress,
    UpdateDest,
    UpdateService,
    VSKey,
)
from ipvsproxy.sync.desired import Access
from ipvsproxy.sync.ipvs_pass import IpvsPlan, IpvsResult

UdpFlows = list[tuple[VSKey, RSKey | None]]  # conntrack.udp_gone(): UDP flows to forget


@dataclass(frozen=True, slots=True)
class PassPlan:
    """Everything one pass would do, for `diff` to render or `apply()` to carry out."""

    full: bool
    ipvs: IpvsPlan
    names: Mapping[VSKey, str]
    repairs: tuple[str, ...] = ()  # damage to the backend's own objects, rewritten by apply
    firewall: FirewallPlan | None = None
    firewall_error: str = ""  # why the firewall could not be planned ("" = it could)
    firewall_seen: Observed | None = None  # the host's sets and chains (full passes)
    keys: frozenset[VSKey] | None = None  # the virtual servers looked at (None: all)
    # the access (frontend, traffic policy, source ranges) of the virtual servers looked at:
    # what a backend that renders each one's rules itself needs (Kernel.apply's `access`)
    access: Mapping[VSKey, Access] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PassResult:
    full: bool
    sync: IpvsResult
    firewall_changes: int = 0
    firewall_error: str = ""  # why the firewall part failed ("" = it did not)
    forgotten: int = 0  # conntrack deletions asked for
    virtual_servers: int = 0  # desired, in the whole table
    real_servers: int = 0
    firewall_seconds: float = 0.0  # of the pass's time, what the firewall step took
    # The kernel contradicted what this process believed it holds (an object missing or
    # already there): someone changed it behind our back; a full pass is needed.
    stale: bool = False
    refused: frozenset[VSKey] = frozenset()  # settings refused: served plainer from now on
    recovered: frozenset[VSKey] = frozenset()  # failing before, done now
    # the IP version of each iptables-restore run that failed (the firewall's or the
    # fallback's): kube-proxy's iptables_restore_failures_total
    restore_failed: tuple[int, ...] = ()

    @property
    def ok(self) -> bool:
        return self.sync.report.ok and not self.firewall_error

    @property
    def transaction_error(self) -> str:
        """Why the backend refused a transaction of this pass as a whole (the fallback's
        iptables-restore: nothing of it written), or "" when none was: such a pass failed,
        however many operations it carried (none, for a repair)."""
        return "; ".join(dict.fromkeys(str(error) for error in self.sync.report.refused))


def touched(ops: Iterable[object]) -> tuple[set[VSKey], set[IPAddress]]:
    """The virtual servers and addresses these operations touch."""
    keys: set[VSKey] = set()
    addresses: set[IPAddress] = set()
    for op in ops:
        match op:
            case AddService(vs) | UpdateService(vs):
                keys.add(vs.key)
            case DeleteService(key) | AddDest(key, _) | UpdateDest(key, _) | DeleteDest(key, _):
                keys.add(key)
            case BindAddress(address) | UnbindAddress(address):
                addresses.add(address)
    return keys, addresses
