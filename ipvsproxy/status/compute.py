"""The inputs of a status document, from a proxier: the agent's, or one built as `diff` builds it.

Owns: `explained()` (the Services shown, each run through `explain_service`: the translation
with its reasons), `from_plan()` (a full pass's plan, not applied: `status` without an agent,
as `diff` computes) and `from_agent()` (the agent's proxier, read under the agent loop's lock
by the HTTP worker thread: the desired table as the latest objects ask for it, against the
kernel's table as the agent knows it, so drift is what its next pass would change),
`Sampler` (rates from the last two distinct traffic samples).

Imports: proxier, sync, traffic, model, api, config.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any

from ipvsproxy.api import EndpointSliceView, NodeView, Ref, ServiceView
from ipvsproxy.config import Config
from ipvsproxy.model import IpvsState, RealServer, RSKey, VSKey
from ipvsproxy.proxier import PassPlan, Proxier
from ipvsproxy.status.document import MAX_PORTS, Observed, Selector
from ipvsproxy.sync.desired import Explanation, explain_service
from ipvsproxy.sync.index import DesiredIndex
from ipvsproxy.sync.plan import plan
from ipvsproxy.sync.slowstart import Ramp
from ipvsproxy.traffic import Sample, TrafficReader, rates

Explained = list[tuple[ServiceView, Explanation]]


@dataclass(frozen=True, slots=True)
class Inputs:
    """Everything `document.build` needs but the traffic."""

    explained: Explained
    node: NodeView
    owners: Mapping[VSKey, str]
    observed: Observed
    warnings: tuple[str, ...] = ()
    # the agent's slow-start ramps of the destinations shown (times on its monotonic clock)
    ramps: Mapping[tuple[VSKey, RSKey], Ramp] = field(default_factory=dict)


def explained(
    services: Iterable[ServiceView],
    slices: Iterable[EndpointSliceView],
    node: NodeView,
    config: Config,
    selector: Selector | None,
    *,
    limit: int | None = None,
) -> Explained:
    """The Services shown (all, or the selected one), by namespace and name, explained;
    with `limit`, only until they have more than that many ports (a document's bound)."""
    by_service: dict[Ref, list[EndpointSliceView]] = {}
    for s in slices:
        if s.service_name:
            by_service.setdefault((s.namespace, s.service_name), []).append(s)
    chosen = sorted(
        (s for s in services if selector is None or selector.matches(s)),
        key=lambda s: (s.namespace, s.name),
    )
    out: Explained = []
    ports = 0
    for svc in chosen:
        explanation = explain_service(
            svc, by_service.get((svc.namespace, svc.name), ()), node, config
        )
        out.append((svc, explanation))
        ports += max(1, len(explanation.ports))
        if limit is not None and ports > limit:
            break
    return out


def from_plan(
    services: Iterable[ServiceView],
    slices: Iterable[EndpointSliceView],
    planned: PassPlan,
    proxier: Proxier,
    selector: Selector | None,
) -> Inputs:
    """`status` without an agent: a full pass planned (never applied) over every Service;
    the kernel as observed, drift its plan."""
    node = proxier.node or NodeView(proxier.config.node_name)
    shown = explained(services, slices, node, proxier.config, selector)
    observed = Observed(kernel=planned.ipvs.observed, drift=planned.ipvs.plan)
    return Inputs(shown, node, planned.names, observed, proxier.warnings)


def from_agent(
    proxier: Proxier,
    services: Iterable[ServiceView],
    slices: Iterable[EndpointSliceView],
    selector: Selector | None,
    *,
    lock: AbstractContextManager[object],
) -> Inputs:
    """The agent's view: the latest objects translated (what its next pass will ask for:
    Services changed since the last pass show as drift), its draining destinations held at
    weight 0, what the kernel refused served plainer, planned against the table it knows.
    The agent's state is read under the agent loop's `lock` (never mid-pass); translating
    the Services shown happens outside it, so the loop waits only for the reads."""
    with lock:
        node = proxier.node or NodeView(proxier.config.node_name)
    shown = explained(services, slices, node, proxier.config, selector, limit=MAX_PORTS)
    index = DesiredIndex()
    for svc, explanation in shown:
        index.update((svc.namespace, svc.name), explanation.contribution)
    keys = set(index.services)
    ours = index.names(keys)  # the Service port of each key among those shown
    with lock:
        owners = {**ours, **proxier.index.names(keys)}  # the node's winners first
        mine = {key for key in keys if owners[key] == ours[key]}
        addresses = {key.address for key in mine}
        ramps = {
            (ramp.key, ramp.endpoint): ramp
            for ramp in (proxier.slow_start.ramps() if proxier.slow_start else ())
            if ramp.key in mine
        }
        wanted = _ramping(_holding(index.state_for(mine, addresses), proxier), ramps)
        wanted = proxier.refusals.serving(wanted)  # changes nothing of the pass
        kernel = proxier.table.state_for(mine, addresses)
        ownership, manage = proxier.ownership, proxier.manage_addresses
        warnings = proxier.warnings
    drift = plan(wanted, kernel, ownership=ownership, manage_addresses=manage)
    observed = Observed(kernel=kernel, drift=drift)
    return Inputs(shown, node, owners, observed, warnings, ramps)


def _holding(state: IpvsState, proxier: Proxier) -> IpvsState:
    """`state` with the destinations the agent drains kept at weight 0, as its pass does."""
    if proxier.drainer is None:
        return state
    dests = dict(state.dests)
    for key, rs_key in proxier.drainer.draining():
        if key in dests and rs_key not in dests[key]:
            dests[key] = {**dests[key], rs_key: RealServer(rs_key, 0)}
    return replace(state, dests=dests)


def _ramping(state: IpvsState, ramps: Mapping[tuple[VSKey, RSKey], Ramp]) -> IpvsState:
    """`state` with each ramping destination at the weight its ramp asked of the kernel
    at the last pass (a ramp is no drift)."""
    if not ramps:
        return state
    dests = dict(state.dests)
    for (key, rs_key), ramp in ramps.items():
        rs = dests.get(key, {}).get(rs_key)
        if rs is not None:
            dests[key] = {**dests[key], rs_key: replace(rs, weight=ramp.weight)}
    return replace(state, dests=dests)


def ramp_of(
    ramps: Mapping[tuple[VSKey, RSKey], Ramp], now: float
) -> Callable[[VSKey, RSKey], Mapping[str, Any] | None]:
    """The `ramp` of each destination in the document: `now` on the ramps' clock."""

    def ramp(key: VSKey, rs: RSKey) -> Mapping[str, Any] | None:
        found = ramps.get((key, rs))
        if found is None:
            return None
        return {
            "weight": found.weight,
            "fullWeight": found.target,
            "startedSecondsAgo": round(max(0.0, now - found.started), 1),
            "endsInSeconds": round(max(0.0, found.ends - now), 1),
        }

    return ramp


class Sampler:
    """Rates for documents: from the last two distinct samples of a `TrafficReader` (its
    readings are at least `min_interval` apart). Two samples more than `max_age` apart are
    no base for rates: the document has none, and the CLI asks again a second later."""

    def __init__(self, reader: TrafficReader, *, max_age: float = 10.0) -> None:
        self.reader = reader
        self.max_age = max_age
        self._samples: list[Sample] = []

    def observe(self, observed: Observed) -> Observed:
        """`observed` with the counters of a reading now, and rates since the one before."""
        sample = self.reader.read()
        if not self._samples or sample.at != self._samples[-1].at:
            self._samples = [*self._samples[-1:], sample]
        if len(self._samples) < 2 or sample.at - self._samples[0].at > self.max_age:
            return replace(observed, traffic=sample.traffic)
        return with_rates(observed, self._samples[0], sample)


def with_rates(observed: Observed, before: Sample | None, after: Sample) -> Observed:
    """`observed` with `after`'s counters and, given `before`, the rates between them."""
    if before is None or after.at <= before.at:
        return replace(observed, traffic=after.traffic)
    return replace(
        observed,
        traffic=after.traffic,
        rates=rates(before, after),
        window=round(after.at - before.at, 3),
    )
