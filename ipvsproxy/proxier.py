"""The one sync proxier: changed Services in, IPVS table and firewall rules out.

Owns: `Proxier`, `PassPlan`, `PassResult`. `diff`, `run --once` and the agent all use it and
differ only in what they do with a plan: `diff` renders it, `run --once` applies one full
pass, the agent (agent_loop.py) runs passes in a loop.

A pass is full or partial:
- **full** (the first, every `--sync-period`, after the node changed): the kernel is observed
  (IPVS table, addresses, the fallback's chains, the firewall's sets and chains), the whole
  desired state is planned against it, and drift is repaired;
- **partial** (on a change, between full ones): only the virtual servers of the Services that
  changed (plus those with endpoints draining or ramping up, and those whose last operation
  failed) are planned, against the table as last observed and since changed by what this
  proxier applied (`KnownTable`). Nothing is read from the kernel but the draining servers'
  connection counts, so a partial pass costs what changed, not what exists.

The tracker (sync/tracker.py) hands over the changed Services already parsed; each one is
translated (`translate_service`) into the `DesiredIndex`, which says which virtual servers
may have changed. The full and the partial path plan with the same functions (sync/ipvs_pass.py).

Imports: firewall, iptables (the fallback's access hooks), sync.*, kernel, model, config,
api, errors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ipvsproxy.api import NodeView
from ipvsproxy.config import Config
from ipvsproxy.errors import AlreadyExists, KernelError, NotFound, RestoreFailed
from ipvsproxy.firewall.conntrack import forget_udp, udp_gone
from ipvsproxy.firewall.index import SetIndex
from ipvsproxy.firewall.ipset import host_after
from ipvsproxy.firewall.kernel import Firewall, FirewallPlan, Observed, plan_firewall
from ipvsproxy.firewall.kube_proxy import read_adopted
from ipvsproxy.firewall.sets import is_record, record_of
from ipvsproxy.firewall.sets import recorded as recorded_by
from ipvsproxy.iptables import IptablesKernel
from ipvsproxy.kernel import ApplyReport, Kernel
from ipvsproxy.model import (
    AddDest,
    AddService,
    BindAddress,
    DeleteDest,
    DeleteService,
    IPAddress,
    IpvsState,
    Op,
    RealServer,
    RSKey,
    UnbindAddress,
    UpdateDest,
    UpdateService,
    VirtualServer,
    VSKey,
)
from ipvsproxy.policy import node_policy
from ipvsproxy.sync.desired import (
    Access,
    Contribution,
    Desired,
    Entry,
    local_ready_endpoints,
    node_warnings,
    translate_service,
)
from ipvsproxy.sync.drain import Drainer
from ipvsproxy.sync.failures import Failing, Refusals
from ipvsproxy.sync.index import DesiredIndex
from ipvsproxy.sync.ipvs_pass import IpvsPlan, IpvsResult, apply_pass, plan_pass
from ipvsproxy.sync.ownership import Ownership, ownership_for
from ipvsproxy.sync.slowstart import SlowStart
from ipvsproxy.sync.tracker import Changes

log = logging.getLogger("ipvsproxy.sync")


class KnownTable:
    """The kernel's IPVS table and bound addresses as far as this process knows them: what
    the last full observation saw, advanced by every operation applied since.

    A destination map is never changed in place: an operation on a virtual server replaces
    its map with a changed copy. So the table shares maps with the observation it was
    seeded from and hands out its own to partial plans, and none of them ever sees
    another's change."""

    def __init__(self) -> None:
        self.services: dict[VSKey, VirtualServer] = {}
        self.dests: dict[VSKey, Mapping[RSKey, RealServer]] = {}
        self.bound: set[IPAddress] = set()

    def seed(self, state: IpvsState) -> None:
        self.services = dict(state.services)
        self.dests = dict(state.dests)
        self.bound = set(state.bound)

    def advance(self, ops: Iterable[Op]) -> None:
        """Record operations the kernel executed."""
        changed: dict[VSKey, dict[RSKey, RealServer]] = {}  # the new maps of this call

        def copy_of(key: VSKey) -> dict[RSKey, RealServer]:
            if key not in changed:
                changed[key] = dict(self.dests.get(key, {}))
                self.dests[key] = changed[key]
            return changed[key]

        for op in ops:
            match op:
                case AddDest(key, rs) | UpdateDest(key, rs):
                    copy_of(key)[rs.key] = rs
                case AddService(vs) | UpdateService(vs):
                    self.services[vs.key] = vs
                    copy_of(vs.key)
                case DeleteService(key):
                    self.services.pop(key, None)
                    self.dests.pop(key, None)
                    changed.pop(key, None)
                case DeleteDest(key, rs_key):
                    if key in self.dests:
                        copy_of(key).pop(rs_key, None)
                case BindAddress(address) | UnbindAddress(address):
                    (self.bound.add if isinstance(op, BindAddress) else self.bound.discard)(address)

    def state_for(self, keys: Iterable[VSKey], addresses: Iterable[IPAddress]) -> IpvsState:
        services = {k: vs for k in keys if (vs := self.services.get(k)) is not None}
        return IpvsState(
            services,
            {k: self.dests.get(k, {}) for k in services},
            frozenset(a for a in addresses if a in self.bound),
        )


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


@dataclass
class Proxier:
    """Keeps one node's desired state and plans/applies passes against its kernel."""

    kernel: Kernel
    config: Config
    firewall: Firewall | None = None
    drainer: Drainer | None = None
    # ramps new endpoints' weights (the agent only: a one-off pass could not finish a ramp);
    # `slow_start.ramps()` is what the ramps are doing now
    slow_start: SlowStart | None = None
    manage_addresses: bool = True  # False: observed state from a saved ipvsadm file
    index: DesiredIndex = field(default_factory=DesiredIndex)
    table: KnownTable = field(default_factory=KnownTable)
    node: NodeView | None = None
    warnings: tuple[str, ...] = ()
    # per Service ("namespace/name") that wants one, its health-check node port and local
    # ready endpoints (kube-proxy's HealthCheckNodePorts and LocalReadyEndpoints)
    health_checks: dict[str, tuple[int, int]] = field(default_factory=dict)
    _keys: set[VSKey] = field(default_factory=set)  # to look at in the next partial pass
    _addresses: set[IPAddress] = field(default_factory=set)
    _ownership: Ownership | None = None
    _observed_once: bool = False
    _known: set[VSKey] = field(default_factory=set)  # wanted by this process, maybe still there
    # made by ipvsproxy, as the kernel's record said at the last full observation
    _recorded: frozenset[VSKey] = frozenset()
    _adopted: frozenset[VSKey] | None = None  # kube-proxy's NodePorts (None: not read yet)
    _sets: SetIndex | None = None  # the firewall's sets, kept per virtual server
    # (bound addresses, this node's endpoints) when the set index was last rebuilt whole
    _sets_basis: tuple[frozenset[IPAddress], frozenset[IPAddress]] | None = None
    clock: Callable[[], float] = time.monotonic
    # This host's own addresses (netlink/links.py node_addresses), read on the node: they,
    # not the Node object's, are the NodePort addresses and tell a node address from a VIP,
    # as in kube-proxy. None (a saved table, tests): the Node object's addresses.
    node_addresses: Callable[[], tuple[IPAddress, ...]] | None = None
    _host: tuple[IPAddress, ...] | None = None
    refusals: Refusals = field(init=False)  # settings the kernel refused, served plainer
    backoff: Failing = field(init=False)  # failed virtual servers, retried one by one
    _input_warnings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.refusals = Refusals(default=self.config.scheduler)
        self.backoff = Failing(policy=self.config.retry, clock=self.clock)
        if isinstance(self.kernel, IptablesKernel):
            # The fallback renders each virtual server's access (source ranges, traffic
            # policy) through policy.py, as the firewall does: it looks them up here.
            self.kernel.use_access(self.index.access_of)

    def refresh_host(self) -> bool:
        """Read this host's addresses again (full passes: an address added or removed is
        followed without a restart); whether they changed, so that every Service must be
        translated again (the caller takes everything from the tracker)."""
        if self.node_addresses is None:
            return False
        try:
            found = self.node_addresses()
        except KernelError as exc:
            log.warning("cannot list this host's addresses (the last ones are kept): %s", exc)
            return False
        if self._host is None:
            self._host = found
            return True
        gained, lost = set(found) - set(self._host), set(self._host) - set(found)
        self._host = found
        if gained or lost:  # the order of a dump is no change
            log.info(
                "this host's addresses changed (gained %s, lost %s): every Service is "
                "translated again",
                ", ".join(map(str, sorted(gained, key=str))) or "none",
                ", ".join(map(str, sorted(lost, key=str))) or "none",
            )
        return bool(gained or lost)

    def feed(self, changes: Changes) -> None:
        """Translate the changed Services into the desired state."""
        if changes.everything or self.node is None:
            node = changes.node or NodeView(self.config.node_name)
            if self._host is not None:
                node = replace(node, addresses=self._host)
            if node != self.node:
                self.node, self._ownership = node, None
        assert self.node is not None
        for ref, svc in changes.services.items():
            slices = changes.slices.get(ref, ())
            contribution = (
                translate_service(svc, slices, self.node, self.config) if svc is not None else None
            )
            if svc is not None and svc.health_check_node_port:
                local = local_ready_endpoints(svc, slices, self.config.node_name)
                self.health_checks[svc.ref] = (svc.health_check_node_port, local)
            else:
                self.health_checks.pop("/".join(ref), None)
            if contribution is not None:
                contribution = _reusing(contribution, self.index)
            keys = self.index.update(ref, contribution)
            self._keys |= keys
            self._known |= keys
        self._input_warnings = (
            *changes.warnings,
            *node_warnings(changes.node, self.config),
            *self.index.warnings(),
        )
        self.warnings = (*self._input_warnings, *self.refusals.warnings())

    @property
    def ownership(self) -> Ownership:
        if self._ownership is None:
            addresses = self.node.addresses if self.node is not None else ()
            self._ownership = replace(
                ownership_for(self.config, addresses),
                known=self._known,
                recorded=self._recorded,
                range_claims=not self._keeps_record,
            )
        return self._ownership

    @property
    def _keeps_record(self) -> bool:
        """Whether the kernel holds a record of what ipvsproxy made (ownership rule 5): the
        fallback's chains, or IPVS's CREATED sets (with the firewall; not a saved table)."""
        return isinstance(self.kernel, IptablesKernel) or (
            self.firewall is not None and self.manage_addresses
        )

    def families(self) -> set[int]:
        """The IP versions of the virtual servers this node serves (4 when none)."""
        return {key.address.version for key in self.index.services} or {4}

    def plan(self, *, full: bool, observed: IpvsState | None = None) -> PassPlan:
        """What one pass would change; `observed` replaces a full observation of the IPVS
        table (diff of a saved table). A partial pass before any full one is a full one."""
        full = full or not self._observed_once or observed is not None
        if full:
            return self._plan_full(self._observe(observed, firewall=self.node is not None))
        keys = self._keys | self.backoff.due() | (self.drainer.keys() if self.drainer else set())
        keys |= self.slow_start.keys() if self.slow_start else set()
        addresses = {k.address for k in keys} | self._addresses
        names = self.index.names(keys)
        ipvs = plan_pass(
            self.kernel,
            self._served(self.index.state_for(keys, addresses), names, whole=False),
            self.table.state_for(keys, addresses),
            ownership=self.ownership,
            drainer=self.drainer,
            slow_start=self.slow_start,
            windows=self.index.slow_start,
            manage_addresses=self.manage_addresses,
        )
        plan = PassPlan(False, ipvs, names, keys=frozenset(keys))
        if self.firewall is None:
            return plan
        sets = self._set_index()
        try:  # only the sets of the virtual servers looked at; nothing read from the host
            sets.update_from(keys, ipvs.state, self.index.access_of(keys), local=self.index.local)
            return replace(plan, firewall=FirewallPlan(sets.take()))
        except KernelError as exc:
            return replace(plan, firewall_error=str(exc))

    def sync(self, changes: Changes, *, full: bool) -> PassResult:
        """One pass: `plan_from()` the changes, then `apply()` the plan."""
        return self.apply(self.plan_from(changes, full=full))

    def plan_from(self, changes: Changes, *, full: bool) -> PassPlan:
        """`feed()` the changes, then `plan()`. Nothing is written to the host."""
        self.feed(changes)
        return self.plan(full=full)

    def _observe(self, observed: IpvsState | None, *, firewall: bool) -> _Observation:
        """What a full pass plans against: the IPVS table (`observed` instead, if given)
        and, with a `firewall`, its sets and chains. The firewall's reading fails on its
        own (its plan carries the error, the IPVS plan is made)."""
        ipvs, repairs = self._observe_ipvs(observed)
        if self.firewall is None or not firewall:
            return _Observation(ipvs, repairs, firewall=None)
        try:
            return _Observation(ipvs, repairs, firewall=self.firewall.observe())
        except KernelError as exc:
            return _Observation(ipvs, repairs, firewall=None, firewall_error=str(exc))

    def _observe_ipvs(self, observed: IpvsState | None) -> tuple[IpvsState, tuple[str, ...]]:
        if observed is not None:
            return observed, ()
        return self.kernel.observe(), self.kernel.damage()

    def _plan_full(self, observation: _Observation) -> PassPlan:
        self._read_record(observation)
        plan, desired = self._plan_ipvs(observation.ipvs, observation.repairs)
        if observation.firewall_error:
            return replace(plan, firewall_error=observation.firewall_error)
        firewall, seen = self.firewall, observation.firewall
        if firewall is None or seen is None or self.node is None:
            return plan
        # the rules' options: the node's policy (for NodeCIDR, its pod CIDRs)
        firewall.options = node_policy(self.config, tuple(self.node.pod_cidrs))
        try:  # every set, against what the host holds (sets and chains)
            sets = self._refreshed_sets(plan.ipvs, desired.access, desired.local_endpoints)
            wanted = plan_firewall(sets.wanted(), seen, firewall.options, firewall.versions)
            return replace(plan, firewall=wanted, firewall_seen=seen)
        except KernelError as exc:
            return replace(plan, firewall_error=str(exc))

    def _read_record(self, observation: _Observation) -> None:
        """What the kernel records as made by ipvsproxy (ownership rule 5), as a full
        observation found it: the fallback's chains hold nothing else; with IPVS, the
        firewall's CREATED sets (not readable this pass, or no firewall: no record, so
        nothing more is claimed than the other rules give)."""
        if isinstance(self.kernel, IptablesKernel):
            recorded = frozenset(observation.ipvs.services)
        elif observation.firewall is not None:
            recorded = recorded_by(observation.firewall.sets) | self._adopt(observation)
        else:
            recorded = frozenset()
        if recorded != self._recorded:
            self._recorded, self._ownership = recorded, None

    def _adopt(self, observation: _Observation) -> frozenset[VSKey]:
        """kube-proxy's NodePorts (ownership rule 6), read at the first full observation of
        this process only: on a node that has just moved from kube-proxy that pass deletes
        the stale ones and records the wanted ones as ipvsproxy's; kept for the process's
        life, so a deletion the kernel refuses is tried again."""
        if self._adopted is None:
            assert self.firewall is not None
            addresses = self.ownership.nodeport_addresses
            keys = observation.ipvs.services
            self._adopted, warning = read_adopted(self.firewall.commands, keys, addresses)
            if warning:
                log.warning("%s", warning)
            elif self._adopted:
                log.info(
                    "kube-proxy's NodePort ipsets list %d virtual servers on node addresses: "
                    "taken over as kube-proxy's NodePorts",
                    len(self._adopted),
                )
        return self._adopted

    def _plan_ipvs(self, observed: IpvsState, repairs: tuple[str, ...]) -> tuple[PassPlan, Desired]:
        desired = self.index.desired()
        ipvs = plan_pass(
            self.kernel,
            self._served(desired.state, desired.origins, whole=True),
            observed,
            ownership=self.ownership,
            drainer=self.drainer,
            slow_start=self.slow_start,
            windows=self.index.slow_start,
            manage_addresses=self.manage_addresses,
        )
        return PassPlan(True, ipvs, desired.origins, repairs), desired

    def _refreshed_sets(
        self, ipvs: IpvsPlan, access: Mapping[VSKey, Access], local: frozenset[IPAddress]
    ) -> SetIndex:
        """The set index brought up to the whole desired state of a full pass. From scratch
        the first time and when this node's endpoints or the bound addresses changed (they
        shape every virtual server's entries); otherwise only the virtual servers that may
        have changed since it was last brought up: those fed since the last pass or whose
        last operation failed (`_keys`), those this plan touches (drift repaired, drains
        ended), and those gone. An idle resync at 1000 Services then recomputes no entry."""
        sets = self._set_index()
        state = ipvs.state
        basis = (frozenset(state.bound), local)
        if basis != self._sets_basis:
            sets.reset(state, access, local=local)
            self._sets_basis = basis
            return sets
        keys = set(self._keys)
        keys |= touched(ipvs.plan)[0]
        keys |= sets.keys().difference(state.services)
        sets.update_from(keys, state, access, local=local)
        return sets

    def _served(self, state: IpvsState, names: Mapping[VSKey, str], *, whole: bool) -> IpvsState:
        """The desired state with what the kernel refused replaced (sync/failures.py)."""
        served = self.refusals.served(state, names, whole=whole)
        self.warnings = (*self._input_warnings, *self.refusals.warnings())
        return served

    def _set_index(self) -> SetIndex:
        assert self.firewall is not None
        if self._sets is None:
            self._sets = SetIndex(versions=self.firewall.versions)
        return self._sets

    def apply(self, planned: PassPlan) -> PassResult:
        """Carry out a plan: IPVS first, then the firewall sets and rules, then conntrack."""
        ipvs = planned.ipvs
        if planned.full:
            self.table.seed(ipvs.observed)
            self._observed_once = True

        planned = self._records_first(planned)
        result = apply_pass(self.kernel, ipvs, names=planned.names, repair=bool(planned.repairs))
        gone = self._record(ipvs, result, forget=self.firewall is not None)
        if isinstance(self.kernel, IptablesKernel) and planned.keys:
            self._refresh_fallback(planned.keys)
        refused = self.refusals.record(result.report.failures, planned.names)
        failed_keys, self._addresses = _retry_set(result.report)
        recovered = self.backoff.settle(planned.keys, failed_keys - refused)
        self._keys = refused  # tried again at once, with what is served instead
        stale = any(
            isinstance(f.error, NotFound | AlreadyExists) and not (touched((f.op,))[0] & refused)
            for f in result.report.failures
        )
        written = _Written(error=planned.firewall_error)
        forgotten = 0
        if self.firewall is not None:
            written = self._timed_firewall(_keeping_records(planned, result.report))
            started = self.clock()
            forgotten = forget_udp(self.firewall.commands, gone)
            written = replace(written, seconds=written.seconds + self.clock() - started)
        restores = {  # one failed run fails every operation it carried: counted once
            id(error): error.version
            for error in (*(f.error for f in result.report.failures), *result.report.refused)
            if isinstance(error, RestoreFailed)
        }
        return PassResult(
            planned.full,
            result,
            written.changes,
            written.error,
            forgotten,
            len(self.index),
            self.index.dest_count,
            written.seconds,
            stale=stale,
            refused=frozenset(refused),
            recovered=frozenset(recovered),
            restore_failed=(*written.restore_failed, *restores.values()),
        )

    def _records_first(self, planned: PassPlan) -> PassPlan:
        """Writes the record of the virtual servers this pass creates on node addresses (the
        CREATED sets' additions) before the IPVS step creates them; their deletions wait for
        the firewall step, after the IPVS step (`_keeping_records`). So no moment exists at
        which such a virtual server is in the kernel but not in the record: an agent killed
        between the two steps, whose Service is deleted before it restarts, still deletes it.
        The firewall step writes the additions again (ipset's -exist: no change).

        A refused record write fails the firewall step (the next pass is a full one), and the
        IPVS step still runs: Services work, and the record is written by the next pass."""
        plan = planned.firewall
        if self.firewall is None or plan is None or planned.firewall_error:
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

    def _record(self, ipvs: IpvsPlan, result: IpvsResult, *, forget: bool) -> UdpFlows:
        """The table advanced by what the kernel took of the IPVS operations; with `forget`,
        the UDP flows to forget."""
        failed = {failure.op for failure in result.report.failures}
        self.table.advance(_applied(ipvs.plan, failed))
        gone = udp_gone(ipvs.plan, failed, before=ipvs.observed) if forget else []
        self._known -= {
            op.key for op in ipvs.plan if isinstance(op, DeleteService) and op not in failed
        }
        return gone

    def _refresh_fallback(self, keys: frozenset[VSKey]) -> None:
        """A partial pass on the fallback: a Service whose access changed with no IPVS
        operation (it only gained or lost source ranges) gets its chains rewritten now, not
        at the next full sync. Refused: logged, and the next pass is a full one."""
        assert isinstance(self.kernel, IptablesKernel)
        try:
            self.kernel.refresh(keys)
        except KernelError as exc:
            log.error("fallback rules of changed access: %s", exc)
            self._observed_once = False

    def _timed_firewall(self, planned: PassPlan) -> _Written:
        started = self.clock()
        written = self._apply_firewall(planned)
        return replace(written, seconds=self.clock() - started)

    def _apply_firewall(self, planned: PassPlan) -> _Written:
        """Write the firewall's plan. After an error the set index no longer knows the
        host: the next pass must be a full one."""
        assert self.firewall is not None
        plan, error = planned.firewall, planned.firewall_error
        failed: tuple[int, ...] = ()
        try:
            if plan and not error:
                self.firewall.apply(plan)
            if planned.firewall_seen is not None and plan is not None and not error:
                self._set_index().seed(host_after(planned.firewall_seen.sets, plan.sets))
        except KernelError as exc:
            error = str(exc)
            failed = (exc.version,) if isinstance(exc, RestoreFailed) else ()
        if error:
            self._observed_once = False
        changes = len(plan.describe()) if plan and not error else 0
        return _Written(changes, error, failed)


UdpFlows = list[tuple[VSKey, RSKey | None]]  # conntrack.udp_gone(): UDP flows to forget


@dataclass(frozen=True, slots=True)
class _Observation:
    """What a full pass plans against (Proxier._observe)."""

    ipvs: IpvsState
    repairs: tuple[str, ...]  # the backend's damage to rewrite (Kernel.damage)
    firewall: Observed | None  # None: no firewall this pass, or its reading failed
    firewall_error: str = ""  # why the firewall's sets and chains could not be read


@dataclass(frozen=True, slots=True)
class _Written:
    """What one pass's firewall step did."""

    changes: int = 0  # set entries and rules written
    error: str = ""  # why it failed ("" = it did not)
    restore_failed: tuple[int, ...] = ()  # the IP version of its iptables-restore that failed
    seconds: float = 0.0


def _reusing(contribution: Contribution, index: DesiredIndex) -> Contribution:
    """The contribution with the objects the index already holds where they are equal.

    A changed Service is translated whole: one endpoint replaced makes ten new destination
    objects, and the kernel's table (which gets only the one that changed) keeps the nine
    old ones. Without this, desired state and table drift into separate copies of every
    destination touched since start (at 10,000 Services x 10 a soak of 100 changes a second
    grew the heap by a quarter in 3 minutes before every Service had been touched; flat at
    1,000). Equal objects shared, the planner's comparisons also hit the identity fast path."""
    entries: dict[VSKey, Entry] = {}
    shared = False
    for key, entry in contribution.entries.items():
        held, vs = index.dests.get(key), index.services.get(key)
        if held is None or vs is None:
            entries[key] = entry
            continue
        shared = True
        dests = {}
        for rs in entry.dests.values():
            old = held.get(rs.key)
            if old == rs:
                rs = old  # noqa: PLW2901 - the held object, its key and address with it
            dests[rs.key] = rs
        if vs != entry.vs:
            vs = entry.vs
        entries[vs.key] = replace(entry, vs=vs, dests=dests)
    if not shared:  # a new Service (every one in a first sync): nothing held to share
        return contribution
    return replace(contribution, entries=entries)


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


def _applied(plan: Sequence[Op], failed: set[Op]) -> Sequence[Op]:
    """The operations of `plan` not in `failed` (without hashing each when none failed)."""
    return [op for op in plan if op not in failed] if failed else plan


def _retry_set(report: ApplyReport) -> tuple[set[VSKey], set[IPAddress]]:
    """What the next partial pass must look at again: whatever a failed operation touched."""
    return touched(failure.op for failure in report.failures)


def touched(ops: Iterable[Op]) -> tuple[set[VSKey], set[IPAddress]]:
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
