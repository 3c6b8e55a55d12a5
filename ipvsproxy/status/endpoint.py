"""The agent's `/status` route on the metrics port (served by serve.py's worker thread).

Owns: `status_route()`. A request reads the `Snapshot` the agent's last completed pass
published (no lock: a pass in progress is neither waited for nor seen), the Services changed
since (`pending`), the latest objects (to explain them), then the kernel's counters through
the agent's `TrafficReader` (a connection of its own, never the sync thread's socket).
`?service=NAMESPACE/NAME[:PORT]` shows one Service or port; without it the document holds at
most `document.MAX_PORTS` Service ports. A bad filter is a 400, a request before the first
pass or a failed kernel read a 503, each with one line of text.

Imports: status.document, status.compute, proxier, sync.tracker, serve, traffic, config,
errors.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from urllib.parse import parse_qs

from ipvsproxy.api import EndpointSliceView, Ref, ServiceView
from ipvsproxy.config import Config
from ipvsproxy.errors import ConfigError, KernelError
from ipvsproxy.proxier import Snapshot
from ipvsproxy.serve import JSON_HEADERS, Headed, InThread
from ipvsproxy.status.compute import Sampler, from_agent, ramp_of
from ipvsproxy.status.document import Passes, Selector, build
from ipvsproxy.sync.tracker import SERVICE, SLICE, Tracker

PATH = "/status"


def status_route(
    *,
    snapshot: Callable[[], Snapshot | None],
    pending: Callable[[], frozenset[Ref]],
    tracker: Tracker,
    passes: Callable[[], Passes],
    sampler: Sampler,
    backend: str,
    config: Config,
    firewall: str | None = None,
    clock: Callable[[], float] = time.time,
    monotonic: Callable[[], float] = time.monotonic,  # the slow-start ramps' clock
) -> InThread:
    """`/status` for the agent."""

    def route(query: str) -> Headed:
        try:
            selector = selector_of(query)
        except ConfigError as exc:
            return 400, "text/plain; charset=utf-8", f"{exc}\n".encode(), {}
        done, last = passes(), snapshot()
        if last is None:
            text = "no sync pass has completed yet: the agent waits for its first\n"
            return 503, "text/plain; charset=utf-8", text.encode(), {}
        changed = pending()
        services = [
            v
            for v in tracker.views(SERVICE)
            if isinstance(v, ServiceView) and (selector is None or selector.matches(v))
        ]
        slices = [v for v in tracker.views(SLICE) if isinstance(v, EndpointSliceView)]
        inputs = from_agent(last, services, slices, selector, config, pending=changed)
        try:
            observed = sampler.observe(inputs.observed)
        except KernelError as exc:
            text = f"cannot read the kernel's counters: {exc}\n"
            return 503, "text/plain; charset=utf-8", text.encode(), {}
        doc = build(
            inputs.explained,
            node=inputs.node,
            owners=inputs.owners,
            observed=observed,
            source="agent",
            backend=backend,
            firewall=firewall,
            now=clock(),
            passes=done,
            warnings=inputs.warnings,
            device=config.dummy_device,
            selector=selector,
            ramp=ramp_of(inputs.ramps, monotonic()),
            pending=inputs.pending,
        )
        return 200, "application/json", json.dumps(doc).encode() + b"\n", JSON_HEADERS

    return InThread(route, query=True)


def selector_of(query: str) -> Selector | None:
    """`service=NAMESPACE/NAME[:PORT]` of a query string (None: every Service)."""
    values = parse_qs(query, keep_blank_values=True).get("service", [])
    if len(values) > 1:
        raise ConfigError("service= given more than once")
    return Selector.parse(values[0]) if values else None
