"""The pass's IPVS step: plan the virtual servers against the table, apply the plan.

Owns `KnownTable` (the kernel's table as far as this process knows it) and `IpvsStep`: the
kernel backend, what it refused (served plainer: sync/failures.py `Refusals`), what failed
(retried one by one with backoff: `Failing`), the drains and slow-start ramps that keep
virtual servers on the next pass's list.

Imports: sync (planner, drains, ramps, failures), kernel, model, errors.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ipvsproxy.config import Config
from ipvsproxy.errors import AlreadyExists, NotFound, RestoreFailed
from ipvsproxy.firewall.conntrack import udp_gone
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
    part_of,
)
from ipvsproxy.proxier.pass_plan import PassPlan, UdpFlows, touched
from ipvsproxy.sync.drain import Drainer
from ipvsproxy.sync.failures import Failing, Refusals
from ipvsproxy.sync.ipvs_pass import IpvsPlan, IpvsResult, apply_pass, plan_pass
from ipvsproxy.sync.ownership import Ownership
from ipvsproxy.sync.slowstart import SlowStart


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
        self._frozen: IpvsState | None = None  # `frozen()`'s copy, until the table changes

    def seed(self, state: IpvsState) -> None:
        self.services = dict(state.services)
        self.dests = dict(state.dests)
        self.bound = set(state.bound)
        self._frozen = None

    def frozen(self) -> IpvsState:
        """The table now, as a value no later change reaches: shallow copies (the maps in
        it are never changed in place), made again only after the table changed."""
        if self._frozen is None:
            self._frozen = IpvsState(dict(self.services), dict(self.dests), frozenset(self.bound))
        return self._frozen

    def advance(self, ops: Sequence[Op]) -> None:
        """Record operations the kernel executed."""
        if ops:
            self._frozen = None
            self._advance(ops)

    def _advance(self, ops: Sequence[Op]) -> None:
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
        return part_of(self.services, self.dests, self.bound, keys, addresses)


@dataclass(frozen=True, slots=True)
class IpvsApplied:
    """What the IPVS step of one pass did."""

    result: IpvsResult
    gone: UdpFlows  # the UDP flows to forget (with a firewall)
    deleted: frozenset[VSKey]  # virtual servers the kernel deleted
    refused: frozenset[VSKey]  # settings refused: tried again at once, served plainer
    recovered: frozenset[VSKey]  # failing before, done now
    stale: bool  # the kernel contradicted the known table: a full pass is needed
    restore_failed: tuple[int, ...]  # the IP version of each backend transaction refused


@dataclass
class IpvsStep:
    """The IPVS table's part of a pass, and the state it keeps between passes."""

    kernel: Kernel
    config: Config
    drainer: Drainer | None = None
    # ramps new endpoints' weights (the agent only: a one-off pass could not finish a ramp);
    # `slow_start.ramps()` is what the ramps are doing now
    slow_start: SlowStart | None = None
    manage_addresses: bool = True  # False: observed state from a saved ipvsadm file
    clock: Callable[[], float] = time.monotonic
    table: KnownTable = field(default_factory=KnownTable)
    observed_once: bool = False  # False: the next pass must be a full one
    retry: frozenset[VSKey] = frozenset()  # refused settings: looked at again at once
    retry_addresses: set[IPAddress] = field(default_factory=set)  # a failed bind or unbind
    failed_addresses: tuple[Op, ...] = ()  # the binds and unbinds the last pass could not do
    refusals: Refusals = field(init=False)  # settings the kernel refused, served plainer
    backoff: Failing = field(init=False)  # failed virtual servers, retried one by one

    def __post_init__(self) -> None:
        self.refusals = Refusals(default=self.config.scheduler)
        self.backoff = Failing(policy=self.config.retry, clock=self.clock)

    def due(self) -> set[VSKey]:
        """The virtual servers a partial pass looks at whatever changed: refused and
        failing ones due for a retry, draining ones, ramping ones."""
        keys = set(self.retry) | self.backoff.due()
        keys |= self.drainer.keys() if self.drainer else set()
        keys |= self.slow_start.keys() if self.slow_start else set()
        return keys

    def plan(
        self,
        desired: IpvsState,
        names: Mapping[VSKey, str],
        observed: IpvsState,
        *,
        whole: bool,
        ownership: Ownership,
        windows: Mapping[VSKey, float],
    ) -> IpvsPlan:
        """The operations from `observed` to `desired`, with what the kernel refused served
        plainer (`whole`: `desired` is the whole table, not the virtual servers looked at)."""
        return plan_pass(
            self.kernel,
            self.refusals.served(desired, names, whole=whole),
            observed,
            ownership=ownership,
            drainer=self.drainer,
            slow_start=self.slow_start,
            windows=windows,
            manage_addresses=self.manage_addresses,
        )

    def apply(
        self,
        planned: PassPlan,
        *,
        forget: bool,
        before_binds: Callable[[ApplyReport, UdpFlows], object] | None = None,
    ) -> IpvsApplied:
        """Carry out the IPVS part of `planned`; the table advanced by what the kernel took.
        `forget`: name the UDP flows whose destination or virtual server went.

        `before_binds` (the firewall step) is called with what the kernel did and the UDP
        flows gone once every operation but the binds is applied; the VIPs are bound after
        it returns. So a new VIP answers only once its virtual servers, destinations and
        firewall entries are all in place: bound earlier, a connection to it would meet
        the node's own stack, or IPVS without its masquerade or port-filter rules."""
        ipvs = planned.ipvs
        if planned.full:
            self.table.seed(ipvs.observed)
            self.observed_once = True
        binds: tuple[Op, ...] = ()
        first = ipvs
        if before_binds is not None:
            binds = tuple(op for op in ipvs.plan if op.__class__ is BindAddress)
            if binds:
                rest = tuple(op for op in ipvs.plan if op.__class__ is not BindAddress)
                first = replace(ipvs, plan=rest)
        result = apply_pass(
            self.kernel,
            first,
            names=planned.names,
            access=planned.access,
            repair=bool(planned.repairs),
        )
        report = result.report
        failed = {failure.op for failure in report.failures}
        gone = udp_gone(first.plan, failed, before=ipvs.observed) if forget else []
        if before_binds is not None:
            before_binds(report, gone)
        if binds:
            late = apply_pass(self.kernel, replace(ipvs, plan=binds), names=planned.names)
            report = ApplyReport(
                report.applied + late.report.applied,
                (*report.failures, *late.report.failures),
                (*report.refused, *late.report.refused),
            )
            result = replace(result, plan=ipvs.plan, report=report)
            failed |= {failure.op for failure in late.report.failures}
        self.table.advance(_applied(ipvs.plan, failed))
        refused = self.refusals.record(report.failures, planned.names)
        _, self.retry_addresses = touched(failure.op for failure in report.failures)
        self.failed_addresses = tuple(
            f.op for f in report.failures if isinstance(f.op, BindAddress | UnbindAddress)
        )
        failed_ops: dict[VSKey, list[Op]] = {}
        for failure in report.failures:
            for key in touched((failure.op,))[0] - refused:
                failed_ops.setdefault(key, []).append(failure.op)
        recovered = self.backoff.settle(planned.keys, failed_ops)
        self.retry = frozenset(refused)
        restores = {  # one failed run fails every operation it carried: counted once
            id(error): error.version
            for error in (*(f.error for f in report.failures), *report.refused)
            if isinstance(error, RestoreFailed)
        }
        return IpvsApplied(
            result,
            gone=gone,
            deleted=frozenset(
                op.key for op in ipvs.plan if isinstance(op, DeleteService) and op not in failed
            ),
            refused=frozenset(refused),
            recovered=frozenset(recovered),
            stale=any(
                isinstance(f.error, NotFound | AlreadyExists)
                and not (touched((f.op,))[0] & refused)
                for f in report.failures
            ),
            restore_failed=tuple(restores.values()),
        )


def _applied(plan: Sequence[Op], failed: set[Op]) -> Sequence[Op]:
    """The operations of `plan` not in `failed` (without hashing each when none failed)."""
    return [op for op in plan if op not in failed] if failed else plan
