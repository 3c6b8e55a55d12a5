"""Per-Service traffic (`--service-metrics`, opt-in): `ServiceTraffic`, a prometheus_client
collector that reads the kernel's IPVS counters when scraped (through the agent's
`traffic.TrafficReader`, on its own kernel connection) and names each virtual server by the
Service port it serves, from a snapshot the sync thread hands over (`use_names`). One series
set per virtual server, at most `max_series` sample lines per scrape (docs/monitoring.md says
why and what they cost).

Imports: prometheus_client, errors, model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ipvsproxy.errors import KernelError
from ipvsproxy.model import Counters, RSKey, Traffic, VSKey

log = logging.getLogger(__name__)

SERVICE_LABELS = ("namespace", "service", "port", "protocol", "address")
ENDPOINT_LABELS = (*SERVICE_LABELS, "endpoint")
# sample lines per virtual server (or endpoint): connections, packets and bytes in and out,
# active and inactive connections; the cap drops whole groups, never half of one
GROUP = 7
Family = CounterMetricFamily | GaugeMetricFamily
# one virtual server's or endpoint's lines: level, label values, counters, (active, inactive)
_Group = tuple[str, tuple[str, ...], Counters, tuple[int, int]]


class ServiceTraffic:
    """A prometheus_client collector: the IPVS counters of every virtual server ipvsproxy
    programs, labelled with the Service port it serves (and, with `endpoints`, of each of its
    destinations), read by `read` at every collection. Virtual servers without a name (not
    ipvsproxy's, or added since the last pass) are skipped.

    At most `max_series` sample lines: the virtual servers sorted by their labels, all of them
    before any endpoint, whole groups of GROUP lines; what does not fit is counted in
    `dropped` (lines) and said once in the log."""

    def __init__(
        self,
        read: Callable[[], Mapping[VSKey, Traffic]],
        *,
        endpoints: bool,
        max_series: int,
        dropped: Counter,
        errors: Counter,
    ) -> None:
        self._read = read
        self.endpoints = endpoints
        self.max_series = max_series
        self._dropped = dropped
        self._errors = errors
        self._names: Mapping[VSKey, str] = {}
        self._warned_cap = False
        self._failing = False

    def use_names(self, names: Mapping[VSKey, str]) -> None:
        """Each virtual server's origin ("ns/name:port"): a mapping the caller never changes
        again (the sync thread hands over a new one; a scrape keeps reading the one it took)."""
        self._names = names

    def describe(self) -> Iterable[Family]:
        """The families, empty: registering must not read the kernel."""
        return _families(self.endpoints).values()

    def collect(self) -> Iterable[Family]:
        families = _families(self.endpoints)
        traffic = self._traffic()
        if traffic is None:
            return families.values()
        names = self._names
        rows = sorted(
            (_labels(origin, key), counters)
            for key, counters in traffic.items()
            if (origin := names.get(key)) is not None
        )
        groups: list[_Group] = [
            ("service", labels, vs.counters, _connections(vs)) for labels, vs in rows
        ]
        if self.endpoints:
            groups += [
                ("endpoint", (*labels, _address(rs)), d.counters, (d.active, d.inactive))
                for labels, vs in rows
                for rs, d in sorted(vs.dests.items())
            ]
        kept = self.max_series // GROUP
        for level, labels, counters, (active, inactive) in groups[:kept]:
            _add(families, level, labels, counters, active, inactive)
        if len(groups) > kept:
            self._dropped_lines((len(groups) - kept) * GROUP)
        return families.values()

    def _traffic(self) -> Mapping[VSKey, Traffic] | None:
        """The counters, or None when the kernel cannot be read (counted; said once for
        each run of failures)."""
        try:
            traffic = self._read()
        except KernelError as exc:
            self._errors.inc()
            if not self._failing:
                log.warning("service metrics: cannot read the traffic counters: %s", exc)
            self._failing = True
            return None
        self._failing = False
        return traffic

    def _dropped_lines(self, dropped: int) -> None:
        self._dropped.inc(dropped)
        if not self._warned_cap:
            log.warning(
                "service metrics: %d series left out of a scrape, more than "
                "--service-metrics-max-series %d (counted in "
                "ipvsproxy_service_metrics_dropped_series_total; said once)",
                dropped,
                self.max_series,
            )
            self._warned_cap = True


def _connections(vs: Traffic) -> tuple[int, int]:
    """A virtual server's active and inactive connections: its destinations' sums."""
    return sum(d.active for d in vs.dests.values()), sum(d.inactive for d in vs.dests.values())


def _families(endpoints: bool) -> dict[str, Family]:
    out: dict[str, Family] = {}
    for level, labels in (("service", SERVICE_LABELS), ("endpoint", ENDPOINT_LABELS)):
        if level == "endpoint" and not endpoints:
            break
        whose = "virtual server of a Service port" if level == "service" else "endpoint"
        direction = [*labels, "direction"]
        out[f"{level}_connections"] = CounterMetricFamily(
            f"ipvsproxy_{level}_connections",
            f"Connections scheduled to each {whose}",
            labels=labels,
        )
        out[f"{level}_packets"] = CounterMetricFamily(
            f"ipvsproxy_{level}_packets", f"Packets through each {whose}", labels=direction
        )
        out[f"{level}_bytes"] = CounterMetricFamily(
            f"ipvsproxy_{level}_bytes", f"Bytes through each {whose}", labels=direction
        )
        out[f"{level}_active"] = GaugeMetricFamily(
            f"ipvsproxy_{level}_active_connections",
            f"Active (established TCP) connections of each {whose}",
            labels=labels,
        )
        out[f"{level}_inactive"] = GaugeMetricFamily(
            f"ipvsproxy_{level}_inactive_connections",
            f"Inactive connections (other states, UDP) of each {whose}",
            labels=labels,
        )
    return out


def _add(
    families: Mapping[str, Family],
    level: str,
    labels: tuple[str, ...],
    counters: Counters,
    active: int,
    inactive: int,
) -> None:
    """One group of GROUP sample lines."""
    families[f"{level}_connections"].add_metric(labels, counters.connections)
    for family, into, out in (
        ("packets", counters.packets_in, counters.packets_out),
        ("bytes", counters.bytes_in, counters.bytes_out),
    ):
        families[f"{level}_{family}"].add_metric([*labels, "in"], into)
        families[f"{level}_{family}"].add_metric([*labels, "out"], out)
    families[f"{level}_active"].add_metric(labels, active)
    families[f"{level}_inactive"].add_metric(labels, inactive)


def _labels(origin: str, key: VSKey) -> tuple[str, str, str, str, str]:
    """namespace, service, port (the Service port's name, else its number), protocol and
    the virtual server's address:port, from an origin "ns/name:port" (neither a namespace
    nor a name holds "/" or ":")."""
    namespace, _, rest = origin.partition("/")
    service, _, port = rest.rpartition(":")
    return namespace, service, port, key.proto.name, _address(key)


def _address(key: VSKey | RSKey) -> str:
    host = f"[{key.address}]" if key.address.version == 6 else str(key.address)
    return f"{host}:{key.port}"
