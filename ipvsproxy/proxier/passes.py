"""The pass: its three steps composed in their safe order.

Owns `Proxier`. Each step keeps its own state (proxier/desired_step.py, ipvs_step.py,
firewall_step.py); the pass only decides the order and hands each step what the one before
made:

1. **desired** (`DesiredStep.feed`): the changed Services translated into the index;
2. **observe** (full passes only): the IPVS table and, with a firewall, its sets and chains;
   the record of what ipvsproxy made (`_read_record`) and so who owns what (`ownership`);
3. **plan**: the IPVS operations (`IpvsStep.plan`), then the firewall's sets and rules for
   the state those operations leave (`FirewallStep.plan_full` / `plan_partial`);
4. **apply** (`apply`): the record of virtual servers about to be made first, then IPVS
   but for the new VIPs' binds, then the firewall's sets and rules and the UDP flows to
   forget, then the binds: a VIP answers once all that serves it is in place.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from ipvsproxy.api import NodeView, Ref
from ipvsproxy.config import Config
from ipvsproxy.firewall.firewall_plan import HostFirewall, Observed
from ipvsproxy.kernel import ApplyReport, Kernel
from ipvsproxy.model import IPAddress, IpvsState, VSKey, part_of
from ipvsproxy.proxier.desired_step import DesiredStep
from ipvsproxy.proxier.firewall_step import FirewallStep, Written
from ipvsproxy.proxier.ipvs_step import IpvsStep, KnownTable
from ipvsproxy.proxier.pass_plan import PassPlan, PassResult, UdpFlows
from ipvsproxy.sync.desired_index import DesiredIndex
from ipvsproxy.sync.drain import Drainer
from ipvsproxy.sync.failures import Failing, Refusals
from ipvsproxy.sync.ownership import Ownership, ownership_for
from ipvsproxy.sync.slowstart import SlowStart
from ipvsproxy.sync.tracker import Changes


@dataclass
class Proxier:
    """Keeps one node's desired state and plans/applies passes against its kernel."""

    kernel: Kernel
    config: Config
    firewall: HostFirewall | None = None
    drainer: Drainer | None = None
    # ramps new endpoints' weights (the agent only: a one-off pass could not finish a ramp)
    slow_start: SlowStart | None = None
    manage_addresses: bool = True  # False: observed state from a saved ipvsadm file
    clock: Callable[[], float] = time.monotonic
    # this host's own addresses (DesiredStep.node_addresses); None: the Node object's
    node_addresses: Callable[[], tuple[IPAddress, ...]] | None = None
    desired: DesiredStep = field(init=False)
    ipvs: IpvsStep = field(init=False)
    firewall_step: FirewallStep | None = field(init=False)
    # the steps' own objects, named here for the agent loop, status and tests
    index: DesiredIndex = field(init=False)
    table: KnownTable = field(init=False)
    health_checks: dict[str, tuple[int, int]] = field(init=False)
    refusals: Refusals = field(init=False)
    backoff: Failing = field(init=False)
    _ownership: Ownership | None = None
    # made by ipvsproxy, as the kernel's record said at the last full observation
    _recorded: frozenset[VSKey] = frozenset()
    # the kernel as plan_first() read it, when it then changed nothing: the full pass that
    # follows plans against it rather than reading the whole table again (a restart)
    _unchanged: IpvsState | None = None

    def __post_init__(self) -> None:
        self.desired = DesiredStep(self.config, self.node_addresses)
        self.ipvs = IpvsStep(
            self.kernel,
            self.config,
            drainer=self.drainer,
            slow_start=self.slow_start,
            manage_addresses=self.manage_addresses,
            clock=self.clock,
        )
        self.firewall_step = (
            FirewallStep(self.firewall, self.config, self.clock) if self.firewall else None
        )
        self.index, self.table = self.desired.index, self.ipvs.table
        self.health_checks = self.desired.health_checks
        self.refusals, self.backoff = self.ipvs.refusals, self.ipvs.backoff

    @property
    def node(self) -> NodeView | None:
        return self.desired.node

    @property
    def warnings(self) -> tuple[str, ...]:
        """The input's warnings, then the substitutes for settings the kernel refused."""
        return (*self.desired.warnings, *self.refusals.warnings())

    @property
    def ownership(self) -> Ownership:
        """Who owns what in the kernel's table (sync/ownership.py), for this node."""
        if self._ownership is None:
            addresses = self.node.addresses if self.node is not None else ()
            # the kernel holds a record of what ipvsproxy made (rule 5): the backend's own
            # table, or the firewall's CREATED sets (not when planning a saved table)
            keeps_record = self.kernel.owns_table or (
                self.firewall is not None and self.manage_addresses
            )
            self._ownership = replace(
                ownership_for(self.config, addresses),
                known=self.desired.known,
                recorded=self._recorded,
                range_claims=not keeps_record,
            )
        return self._ownership

    def feed(self, changes: Changes) -> None:
        """Translate the changed Services into the desired state."""
        if self.desired.feed(changes):
            self._ownership = None

    def plan(self, *, full: bool) -> PassPlan:
        """What one pass would change. A partial pass before any full one is a full one."""
        if full or not self.ipvs.observed_once:
            return self._plan_full()
        return self._plan_partial()

    def plan_from(self, changes: Changes, *, full: bool) -> PassPlan:
        """`feed()` the changes, then `plan()`. Nothing is written to the host."""
        self.feed(changes)
        return self.plan(full=full)

    def sync(self, changes: Changes, *, full: bool) -> PassResult:
        """One pass: `plan_from()` the changes, then `apply()` the plan."""
        return self.apply(self.plan_from(changes, full=full))

    def plan_first(self, services: Iterable[Ref]) -> PassPlan | None:
        """Before a node's first full pass: the pass of `services` alone (the API's own
        Service, the cluster DNS: `--first-services`), so that a node joining a large cluster
        talks to the API and resolves names within seconds, not after the whole table. It
        plans against the kernel as observed now and adds or updates what they need, and
        their firewall entries and the rules; it deletes nothing of anyone else's (a partial
        pass). None when the kernel already serves them (a restart): nothing to put first.
        The full pass comes next, as the first pass would."""
        keys = self.index.keys_of(services)
        if not keys:
            return None
        addresses = {k.address for k in keys}
        names, access = self.index.names(keys), self.index.access_of(keys)
        whole = self.kernel.observe(access=access)
        ipvs = self.ipvs.plan(
            self.index.state_for(keys, addresses),
            names,
            part_of(whole.services, whole.dests, whole.bound, keys, addresses),
            whole=False,
            ownership=self.ownership,
            windows=self.index.slow_start,
        )
        if not ipvs.plan:
            self._unchanged = whole if not self.kernel.owns_table else None
            return None
        planned = PassPlan(False, ipvs, names, keys=frozenset(keys), access=access)
        if self.firewall_step is None or self.node is None:
            return planned
        pods = tuple(self.node.pod_cidrs)
        return self.firewall_step.plan_first(planned, access, self.index.local, pods)

    def _plan_full(self) -> PassPlan:
        """Everything against the kernel as observed now."""
        observed, self._unchanged = self._unchanged, None  # only for the pass right after it
        desired = self.index.desired()
        if observed is None:
            observed = self.kernel.observe(access=desired.access)
        repairs = self.kernel.damage()
        step, seen, error = self.firewall_step, None, ""
        if step is not None and self.node is not None:
            seen, error = step.observe()
        self._read_record(observed, seen)
        ipvs = self.ipvs.plan(
            desired.state,
            desired.origins,
            observed,
            whole=True,
            ownership=self.ownership,
            windows=self.index.slow_start,
        )
        planned = PassPlan(True, ipvs, desired.origins, repairs, access=desired.access)
        if error:
            return replace(planned, firewall_error=error)
        if step is None or seen is None or self.node is None:
            return planned
        changed = self.desired.changed | self.ipvs.retry
        return step.plan_full(planned, desired, seen, tuple(self.node.pod_cidrs), changed=changed)

    def _plan_partial(self) -> PassPlan:
        """Only the virtual servers that changed or must be looked at again, against the
        table as known: nothing is read from the kernel but draining connection counts."""
        keys = self.desired.changed | self.ipvs.due()
        addresses = {k.address for k in keys} | self.ipvs.retry_addresses
        names, access = self.index.names(keys), self.index.access_of(keys)
        ipvs = self.ipvs.plan(
            self.index.state_for(keys, addresses),
            names,
            self.table.state_for(keys, addresses),
            whole=False,
            ownership=self.ownership,
            windows=self.index.slow_start,
        )
        planned = PassPlan(False, ipvs, names, keys=frozenset(keys), access=access)
        if self.firewall_step is None:
            return planned
        return self.firewall_step.plan_partial(planned, access, self.index.local)

    def _read_record(self, observed: IpvsState, seen: Observed | None) -> None:
        """What the kernel records as made by ipvsproxy (ownership rule 5), as a full
        observation found it: a backend that owns its whole table (the fallback's chains)
        holds nothing else; with IPVS, the firewall's CREATED sets (not readable this pass,
        or no firewall: no record, so nothing more is claimed than the other rules give)."""
        if self.kernel.owns_table:
            recorded = frozenset(observed.services)
        elif seen is not None and self.firewall_step is not None:
            nodeports = self.ownership.nodeport_addresses
            recorded = self.firewall_step.recorded(seen, observed.services, nodeports)
        else:
            recorded = frozenset()
        if recorded != self._recorded:
            self._recorded, self._ownership = recorded, None

    def apply(self, planned: PassPlan) -> PassResult:
        """Carry out a plan: IPVS first, then the firewall sets and rules and conntrack, then
        the binds of new VIPs (`IpvsStep.apply`'s `before_binds`)."""
        step = self.firewall_step
        written = Written(error=planned.firewall_error)
        if step is None:
            done = self.ipvs.apply(planned, forget=False)
        else:
            firewall_plan = step.records_first(planned)

            def firewall(report: ApplyReport, gone: UdpFlows) -> None:
                nonlocal written
                written = step.apply(firewall_plan, report, gone)

            done = self.ipvs.apply(firewall_plan, forget=True, before_binds=firewall)
        self.desired.known -= done.deleted
        self.desired.changed = set()
        if written.error:
            self.ipvs.observed_once = False  # the set index no longer knows the host
        return PassResult(
            planned.full,
            done.result,
            written.changes,
            written.error,
            written.forgotten,
            len(self.index),
            self.index.dest_count,
            written.seconds,
            stale=done.stale,
            refused=done.refused,
            recovered=done.recovered,
            restore_failed=(*written.restore_failed, *done.restore_failed),
        )
