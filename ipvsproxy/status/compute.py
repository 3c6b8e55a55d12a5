"""The inputs of a status document: from the agent's last pass, or from a plan built as `diff`
builds it.

Owns: `explained()` (the Services shown, each run through `explain_service`: the translation
with its reasons), `from_plan()` (a full pass's plan, not applied: `status` without an agent,
as `diff` computes) and `from_agent()` (the `Snapshot` the agent's last completed pass
published, read by the HTTP worker thread without a lock: the table as that pass left it,
drift what it could not do, and the Services changed since shown pending), `Sampler` (rates
from the last two distinct traffic samples).

Imports: proxier, sync, traffic, model, api, config.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ipvsproxy.api import EndpointSliceView, NodeView, Ref, ServiceView
from ipvsproxy.config import Config
from ipvsproxy.model import RSKey, VSKey, part_of
from ipvsproxy.proxier import PassPlan, Proxier, Snapshot
from ipvsproxy.status.document import MAX_PORTS, Observed, Selector
from ipvsproxy.sync.desired import Explanation, explain_service
from ipvsproxy.sync.desired_index import DesiredIndex
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
    pending: frozenset[Ref] = frozenset()  # Services shown changed since the agent's last pass


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
    snapshot: Snapshot,
    services: Iterable[ServiceView],
    slices: Iterable[EndpointSliceView],
    selector: Selector | None,
    config: Config,
    *,
    pending: Container[Ref] = frozenset(),
) -> Inputs:
    """The agent's view: the Services shown explained as their latest objects ask, against
    the node as the agent's last completed pass left it (`snapshot`): its table, and as
    drift what that pass could not do. Services changed since (`pending`) are not in sync
    until the next pass. Nothing of the agent's live state is read, and nothing planned."""
    node = snapshot.node or NodeView(config.node_name)
    shown = explained(services, slices, node, config, selector, limit=MAX_PORTS)
    index = DesiredIndex()  # who wins each key among the Services shown
    for svc, explanation in shown:
        index.update((svc.namespace, svc.name), explanation.contribution)
    ours = index.names(index.services)  # the Service port of each key among those shown
    owners = {**ours, **{k: snapshot.owners[k] for k in ours if k in snapshot.owners}}
    mine = {key for key in ours if owners[key] == ours[key]}
    kernel = part_of(
        snapshot.table.services,
        snapshot.table.dests,
        snapshot.table.bound,
        mine,
        {key.address for key in mine},
    )
    observed = Observed(kernel=kernel, drift=snapshot.undone)
    ramps = {at: ramp for at, ramp in snapshot.ramps.items() if at[0] in mine}
    refs = {(svc.namespace, svc.name) for svc, _ in shown}
    changed = frozenset(ref for ref in refs if ref in pending)
    return Inputs(shown, node, owners, observed, snapshot.warnings, ramps, changed)


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
