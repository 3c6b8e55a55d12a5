"""The pass's firewall step (IPVS mode): the sets and rules around the IPVS table, the
record of what ipvsproxy made, and the UDP flows to forget.

Owns `FirewallStep`: the firewall, its set index (the sets' entries kept per virtual
server, so that a partial pass recomputes only those it looks at) and the kube-proxy
NodePorts read once at the first full observation (ownership rule 6).

Imports: firewall, sync (the IPVS step's plan, the desired state), kernel, model, policy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, replace

from ipvsproxy.config import Config
from ipvsproxy.errors import KernelError, RestoreFailed
from ipvsproxy.firewall.conntrack import forget_udp
from ipvsproxy.firewall.firewall_plan import FirewallPlan, HostFirewall, Observed
from ipvsproxy.firewall.ipset import BULK, host_after
from ipvsproxy.firewall.kube_proxy import read_adopted
from ipvsproxy.firewall.set_index import SetIndex
from ipvsproxy.firewall.sets import is_record, record_of
from ipvsproxy.firewall.sets import recorded as recorded_by
from ipvsproxy.kernel import ApplyReport
from ipvsproxy.model import DeleteService, IPAddress, IPNetwork, VSKey
from ipvsproxy.policy import node_policy
from ipvsproxy.proxier.pass_plan import PassPlan, UdpFlows, touched
from ipvsproxy.sync.desired import Access, Desired

log = logging.getLogger("ipvsproxy.sync")


@dataclass(frozen=True, slots=True)
class Written:
    """What one pass's firewall step did."""

    changes: int = 0  # set entries and rules written
    error: str = ""  # why it failed ("" = it did not)
    restore_failed: tuple[int, ...] = ()  # the IP version of its iptables-restore that failed
    seconds: float = 0.0
    forgotten: int = 0  # conntrack deletions asked for


class FirewallStep:
    """The firewall's part of a pass, and the state it keeps between passes."""

    def __init__(self, firewall: HostFirewall, config: Config, clock: Callable[[], float]) -> None:
        self.firewall = firewall
        self.config = config
        self.clock = clock
        self._sets: SetIndex | None = None
        # (bound addresses, this node's endpoints) when the set index was last rebuilt whole
        self._basis: tuple[frozenset[IPAddress], frozenset[IPAddress]] | None = None
        self._adopted: frozenset[VSKey] | None = None  # kube-proxy's NodePorts (None: unread)

    @property
    def sets(self) -> SetIndex:
        """The set index: made at the first pass, when the firewall knows its IP versions."""
        if self._sets is None:
            self._sets = SetIndex(versions=self.firewall.versions)
        return self._sets

    def observe(self) -> tuple[Observed | None, str]:
        """The host's sets and chains, or why they could not be read (the IPVS step is
        planned all the same)."""
        try:
            return self.firewall.observe(), ""
        except KernelError as exc:
            return None, str(exc)

    def recorded(
        self, seen: Observed, services: Mapping[VSKey, object], nodeports: frozenset[IPAddress]
    ) -> frozenset[VSKey]:
        """What the CREATED sets record as made by ipvsproxy (ownership rule 5), with
        kube-proxy's NodePorts (rule 6) on the node addresses `nodeports`: read at the first
        full observation of this process only. On a node that has just moved from
        kube-proxy that pass deletes the stale ones and records the wanted ones as
        ipvsproxy's; kept for the process's life, so a deletion the kernel refuses is tried
        again."""
        if self._adopted is None:
            self._adopted, warning = read_adopted(self.firewall.commands, services, nodeports)
            if warning:
                log.warning("%s", warning)
            elif self._adopted:
                log.info(
                    "kube-proxy's NodePort ipsets list %d virtual servers on node addresses: "
                    "taken over as kube-proxy's NodePorts",
                    len(self._adopted),
                )
        return recorded_by(seen.sets) | self._adopted

    def plan_full(
        self,
        planned: PassPlan,
        desired: Desired,
        seen: Observed,
        pod_cidrs: tuple[IPNetwork, ...],
        *,
        changed: set[VSKey],
    ) -> PassPlan:
        """`planned` with every set and rule, against what the host holds. The set index is
        brought up to the whole desired state: from scratch the first time and when this
        node's endpoints or the bound addresses changed (they shape every virtual server's
        entries); otherwise only for the virtual servers that may have changed since: those
        `changed` (fed since the last pass, or refused), those this plan touches (drift
        repaired, drains ended), and those gone. An idle resync at 1000 Services then
        recomputes no entry."""
        firewall = self.firewall
        firewall.options = node_policy(self.config, pod_cidrs)  # for NodeCIDR: its pod CIDRs
        state, local = planned.ipvs.state, desired.local_endpoints
        try:
            basis = (frozenset(state.bound), local)
            if basis != self._basis:
                self.sets.reset(state, desired.access, local=local)
                self._basis = basis
            else:
                keys = changed | touched(planned.ipvs.plan)[0]
                keys |= self.sets.keys().difference(state.services)
                self.sets.update_from(keys, state, desired.access, local=local)
            wanted = firewall.plan(self.sets.wanted(), seen)
            return replace(planned, firewall=wanted, firewall_seen=seen)
        except KernelError as exc:
            return replace(planned, firewall_error=str(exc))

    def plan_first(
        self,
        planned: PassPlan,
        access: Mapping[VSKey, Access],
        local: Container[IPAddress],
        pod_cidrs: tuple[IPNetwork, ...],
    ) -> PassPlan:
        """`planned` (Proxier.plan_first: a few Services before the first full pass) with
        the rules and those Services' set entries, added to what the host holds: nothing is
        deleted or swapped (the other entries are the full pass's). The set index is left
        alone: the full pass that follows builds it from what it observes."""
        firewall = self.firewall
        firewall.options = node_policy(self.config, pod_cidrs)
        try:
            index = SetIndex(versions=firewall.versions)
            index.reset(planned.ipvs.state, access, local=local)
            whole = firewall.plan(index.wanted(), firewall.observe())
        except KernelError as exc:
            return replace(planned, firewall_error=str(exc))
        adds = []
        for change in whole.sets:  # at most BULK entries a change: never swapped in whole
            for start in range(0, max(len(change.add), 1), BULK):
                create = change.create and not start
                if not (create or change.add):
                    continue
                part = change.add[start : start + BULK]
                wanted = frozenset(part) if create else frozenset()
                adds.append(replace(change, create=create, add=part, delete=(), rebuild=False,
                                    wanted=wanted))  # fmt: skip
        return replace(planned, firewall=replace(whole, sets=tuple(adds), stale_sets=()))

    def plan_partial(
        self, planned: PassPlan, access: Mapping[VSKey, Access], local: Container[IPAddress]
    ) -> PassPlan:
        """`planned` with the sets of the virtual servers it looked at; nothing is read
        from the host."""
        keys = planned.keys or frozenset()
        try:
            self.sets.update_from(keys, planned.ipvs.state, access, local=local)
            return replace(planned, firewall=FirewallPlan(self.sets.take()))
        except KernelError as exc:
            return replace(planned, firewall_error=str(exc))

    def records_first(self, planned: PassPlan) -> PassPlan:
        """Writes the record of the virtual servers this pass creates on node addresses (the
        CREATED sets' additions) before the IPVS step creates them; their deletions wait for
        the firewall step, after the IPVS step (`_keeping_records`). So no moment exists at
        which such a virtual server is in the kernel but not in the record: an agent killed
        between the two steps, whose Service is deleted before it restarts, still deletes it.
        The firewall step writes the additions again (ipset's -exist: no change).

        A refused record write fails the firewall step (the next pass is a full one), and the
        IPVS step still runs: Services work, and the record is written by the next pass."""
        plan = planned.firewall
        if plan is None or planned.firewall_error:
            return planned
        early = tuple(
            replace(change, delete=(), wanted=change.wanted | frozenset(change.delete))
            for change in plan.sets
            if is_record(change.name) and (change.add or change.create)
        )
        if not early:
            return planned
        try:
            self.firewall.write_sets(early)
        except KernelError as exc:
            return replace(planned, firewall_error=f"record of node-address virtual servers: {exc}")
        return planned

    def apply(self, planned: PassPlan, report: ApplyReport, gone: UdpFlows) -> Written:
        """Write the firewall's plan (keeping the record of what the kernel refused to
        delete), then forget the UDP flows `gone`. After an error the set index no longer
        knows the host: the caller makes the next pass a full one."""
        started = self.clock()
        plan, error = _keeping_records(planned, report).firewall, planned.firewall_error
        failed: tuple[int, ...] = ()
        try:
            if plan and not error:
                self.firewall.apply(plan)
            if planned.firewall_seen is not None and plan is not None and not error:
                self.sets.seed(host_after(planned.firewall_seen.sets, plan.sets))
        except KernelError as exc:
            error = str(exc)
            failed = (exc.version,) if isinstance(exc, RestoreFailed) else ()
        changes = len(plan.describe()) if plan and not error else 0
        forgotten = forget_udp(self.firewall.commands, gone)
        return Written(changes, error, failed, self.clock() - started, forgotten)


def _keeping_records(planned: PassPlan, report: ApplyReport) -> PassPlan:
    """The plan with the record entries (sets.CREATED) of the virtual servers whose deletion
    the kernel refused kept: still there, they stay recorded as ipvsproxy's, so that a
    restart still deletes them."""
    plan = planned.firewall
    if plan is None or report.ok:
        return planned
    keep: dict[str, set[str]] = {}
    for failure in report.failures:
        if isinstance(failure.op, DeleteService):
            name, entry = record_of(failure.op.key)
            keep.setdefault(name, set()).add(entry)
    if not keep:
        return planned
    changes = []
    for change in plan.sets:
        held = keep.get(change.name, set()).intersection(change.delete)
        if held:
            change = replace(  # noqa: PLW2901 - the same change, those entries kept
                change,
                delete=tuple(e for e in change.delete if e not in held),
                wanted=change.wanted | held,
            )
        changes.append(change)
    return replace(planned, firewall=replace(plan, sets=tuple(changes)))
