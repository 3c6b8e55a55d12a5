"""The composition root: wires sources, the pure core and a kernel into the CLI's commands.

Owns: `diff()` (desired state from manifests or the API, observed state from a saved ipvsadm
file or the live kernel, the plan in words; never changes anything), `run_once()` (prepare
the node, one sync of manifests) and `run()` over `Agent` (the long-running agent, built,
started, run and stopped: sources feeding a tracker, a bounded-frequency runner calling the
sync pass, metrics and health endpoints, signals). Its threads (docs/architecture.md): one
per API watch (or the manifest poller), the one asyncio loop serving HTTP (serve.py), and
the caller's thread, which runs the sync pass, the only one that writes the kernel.

`run()`, `run_once()` and `cleanup()` hold the node's lock (nodelock.py) from their first
step: a second agent in the same network namespace stops before it touches anything.

Imports: everything below it; never click.
"""

from __future__ import annotations

import functools
import gc
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from ipvsproxy import backends, nodelock
from ipvsproxy.backends import (
    BACKENDS,
    FIREWALLS,
    IPTABLES,
    open_backend,
    prepare,
    remove_leftovers,
)
from ipvsproxy.config import Config
from ipvsproxy.errors import ConfigError, IpvsproxyError, KernelError
from ipvsproxy.following import Following, Unread
from ipvsproxy.model import IPAddress, VSKey
from ipvsproxy.proxier import PassPlan, PassResult, Proxier
from ipvsproxy.saved_table import SavedTable
from ipvsproxy.status.compute import Sampler, from_plan
from ipvsproxy.status.document import Selector, build
from ipvsproxy.status.endpoint import PATH as STATUS_PATH
from ipvsproxy.status.endpoint import status_route
from ipvsproxy.sync.drain import Drainer
from ipvsproxy.sync.render import Line, describe
from ipvsproxy.sync.slowstart import SlowStart
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, Changes, Tracker
from ipvsproxy.traffic import TrafficReader

if TYPE_CHECKING:
    from ipvsproxy.agent_loop import AgentLoop
    from ipvsproxy.metrics import Metrics
    from ipvsproxy.serve import Health, HttpServer, InThread

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


def _exclusive(command: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """The command holds this node's lock (nodelock.py) from its first step to its last:
    a second agent in the same network namespace gets `NodeBusy` (exit 2) before it reads
    its input or touches a setting, a module, a device, IPVS or iptables."""

    def wrap(func: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(func)
        def locked(*args: P.args, **kwargs: P.kwargs) -> R:
            with nodelock.hold(command):
                return func(*args, **kwargs)

        return locked

    return wrap


@dataclass(frozen=True, slots=True)
class Manifests:
    """Objects from YAML/JSON files and directories."""

    paths: tuple[Path, ...]


@dataclass(frozen=True, slots=True)
class Cluster:
    """Objects from the Kubernetes API (kubeconfig, else in-cluster, else the default)."""

    kubeconfig: Path | None = None
    context: str | None = None
    master: str | None = None  # overrides the kubeconfig's server (kube-proxy's --master)
    # where `kubeconfig` came from, as errors name it ("--config FILE: field ...")
    origin: str = field(default="--kubeconfig", compare=False)


Source = Manifests | Cluster


@dataclass(frozen=True, slots=True)
class DiffResult:
    lines: tuple[Line, ...]
    warnings: tuple[str, ...]
    notes: tuple[str, ...]
    repairs: tuple[str, ...] = ()  # damage to ipvsproxy's own rules that `run` rewrites

    @property
    def exit_code(self) -> int:
        """0 in sync, 1 changes pending (errors are exceptions: the CLI maps them to 2)."""
        return 1 if self.lines or self.repairs else 0


def changes_from(source: Source, config: Config) -> Changes:
    """One read of the source (for the API: one list of each kind), every Service in it."""
    tracker = Tracker(node_name=config.node_name)
    if isinstance(source, Manifests):
        from ipvsproxy.manifest_source import ManifestSource

        ManifestSource(source.paths, sink=tracker, stop=threading.Event()).load(quiet=True)
        return tracker.take(everything=True)
    from ipvsproxy import kube

    with kube.connect(
        kubeconfig=source.kubeconfig,
        context=source.context,
        master=source.master,
        origin=source.origin,
    ) as client:
        kube.list_once(client, (SERVICE, SLICE, NODE), node_name=config.node_name, sink=tracker)
    return tracker.take(everything=True)


def diff(config: Config, *, source: Source, kernel_state: Path | None) -> DiffResult:
    """The plan `run` would apply, in words; changes nothing.

    Observed state comes from `kernel_state` (a saved `ipvsadm-save -n`) or, without it,
    from the live kernel (root on a host with IPVS); there, removed endpoints that still have
    connections are shown going to weight 0 first, as `run` drains them.
    """
    changes = changes_from(source, config)
    if kernel_state is not None:
        proxier = _saved(config, SavedTable.read(kernel_state))
        proxier.feed(changes)
        planned = proxier.plan(full=True)
        notes: tuple[str, ...] = (
            f"addresses on {config.dummy_device} are not compared: {kernel_state} is a saved "
            "ipvsadm table, which does not record them",
            "connection counts are unknown: removed endpoints are shown deleted, not drained",
        )
        return _diff_result(planned, proxier, config, notes)
    with open_backend(config) as backend:
        proxier = build_proxier(config, backend, drain=True)
        proxier.desired.refresh_host()
        planned = proxier.plan_from(changes, full=True)
        notes = ()
        if backend.name == IPTABLES:
            notes = (
                "backend iptables: operations are shown in ipvsadm terms; `run` writes "
                "them as rules in ipvsproxy's nat chains (IPVSPX-*), and VIP addresses "
                "as records in IPVSPX-SERVICES instead of on a dummy device",
            )
        return _diff_result(planned, proxier, config, notes)


def _diff_result(
    planned: PassPlan, proxier: Proxier, config: Config, notes: tuple[str, ...]
) -> DiffResult:
    if planned.firewall_error:
        raise KernelError(f"firewall rules: {planned.firewall_error}")
    observed = planned.ipvs.observed
    lines = tuple(
        describe(op, planned.names, observed, config.dummy_device) for op in planned.ipvs.plan
    )
    if planned.firewall is not None:
        lines += tuple(
            Line(sign, "firewall", command, "") for sign, command in planned.firewall.describe()
        )
    return DiffResult(lines, proxier.warnings, notes, planned.repairs)


class LocalStatus:
    """`status` without an agent (a context manager): each `document()` reads the source
    again and plans a full pass over the live kernel (or a saved ipvsadm table) as `diff`
    does, applying nothing; counters come from the backend's kernel, rates from the last
    two documents' readings."""

    def __init__(
        self,
        config: Config,
        *,
        source: Source,
        kernel_state: Path | None,
    ) -> None:
        self.config = config
        self.source = source
        self.kernel_state = kernel_state
        self._stack = ExitStack()
        self._backend: backends.Backend | None = None
        self._sampler: Sampler | None = None

    def __enter__(self) -> LocalStatus:
        if self.kernel_state is None:
            backend = self._backend = self._stack.enter_context(open_backend(self.config))
            self._sampler = Sampler(TrafficReader(lambda: backend.kernel), max_age=math.inf)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def document(self, selector: Selector | None) -> dict[str, Any]:
        changes = changes_from(self.source, self.config)
        if self.kernel_state is not None:
            proxier = _saved(self.config, SavedTable.read(self.kernel_state))
            proxier.feed(changes)
            planned = proxier.plan(full=True)
        else:
            assert self._backend is not None  # opened by __enter__ without a saved table
            proxier = build_proxier(self.config, self._backend, drain=True)
            proxier.desired.refresh_host()
            planned = proxier.plan_from(changes, full=True)
        services = [svc for svc in changes.services.values() if svc is not None]
        slices = [s for group in changes.slices.values() for s in group]
        inputs = from_plan(services, slices, planned, proxier, selector)
        observed = inputs.observed
        if self._sampler is not None:
            observed = self._sampler.observe(observed)
        warnings = inputs.warnings
        if planned.firewall_error:
            warnings += (f"firewall rules: {planned.firewall_error}",)
        return build(
            inputs.explained,
            node=inputs.node,
            owners=inputs.owners,
            observed=observed,
            source="kernel-state" if self.kernel_state is not None else "local",
            backend=self._backend.name if self._backend is not None else None,
            now=time.time(),
            warnings=warnings,
            device=self.config.dummy_device,
            selector=selector,
        )


@_exclusive("run --once")
def run_once(config: Config, *, manifest_paths: Sequence[Path]) -> PassResult:
    """Prepare the node (sysctls, timeouts) and sync the manifests into the live kernel once."""
    # A short process that builds a large, acyclic heap: the cyclic collector would only
    # walk it again and again while it is built; reference counting frees what is dropped.
    gc.disable()
    # Nothing on the node changes before the input is known good, nor without a backend.
    changes = changes_from(Manifests(tuple(manifest_paths)), config)
    with open_backend(config) as backend:
        prepare(backend, config)
        remove_leftovers(backend, config)
        proxier = build_proxier(config, backend)
        proxier.desired.refresh_host()
        planned = proxier.plan_from(changes, full=True)
        for warning in proxier.warnings:
            log.warning("%s", warning)
        result = proxier.apply(planned)
        if not result.firewall_error:
            _retiring(backend)()
    if result.firewall_error:
        log.error("firewall rules: %s", result.firewall_error)
    log.info(
        "sync done: %d operations, %d failed, %d firewall changes",
        len(result.sync.plan),
        len(result.sync.report.failures),
        result.firewall_changes,
    )
    return result


def _retiring(backend: backends.Backend) -> Callable[[], object]:
    """What to do once the first full pass wrote the firewall rules: remove the other
    firewall implementation's (backends.retire_other_firewall)."""
    firewall = backend.firewall
    if firewall is None:
        return lambda: None
    return functools.partial(backends.retire_other_firewall, firewall)


@_exclusive("run")
def run(config: Config, *, source: Source, stop: threading.Event | None = None) -> None:
    """The agent: keep the kernel in sync with the source until SIGTERM/SIGINT or `stop`.

    Kernel rules are left in place when it stops, so traffic keeps flowing across restarts.
    Raises KernelUnavailable (no IPVS) before touching anything, ConfigError for bad input
    or busy ports, WatchError when the API refuses us for good.
    """
    with Agent(config, source=source, stop=stop) as agent:
        agent.start()
        agent.run()


class Agent:
    """The long-running agent (`run`), as a lifecycle: built, `start()`, `run()`, `stop()`.

    - Built (`Agent(config, source=..., stop=...)`): what needs nothing opened, the metrics,
      the health answers, the Services' health-check ports (none open yet) and the tracker
      the source feeds. Nothing on the node changes.
    - `start()` opens, in this order: the health port (it answers from the first moment:
      /livez alive, /readyz 503 until the first full pass), the source (ConfigError for
      what retrying cannot fix, the node untouched) and its watcher threads, the backend
      (the node prepared, leftovers removed), the kernel's traffic reader, the host's
      addresses, the sync pass, the `stop` thread and the metrics port. On failure what
      it opened is released and the error raised.
    - `run()` (in the thread that calls it: the main thread takes SIGTERM/SIGINT/SIGHUP)
      runs the sync pass until stopped, then releases everything; raises the first fatal
      error of a watcher, else logs that it stopped, the rules left in place.
    - `stop()`: from any thread, at any time (before `start()`: `run()` returns at once),
      any number of times; the pass in progress finishes first. A watcher's fatal error
      stops it too. `stop=`, an event set by the caller, stops it as `stop()` does.
    - `close()` (also on leaving a `with`): releases what `start()` opened, in reverse
      order; again, nothing.
    """

    def __init__(
        self, config: Config, *, source: Source, stop: threading.Event | None = None
    ) -> None:
        from ipvsproxy.healthcheck import ServiceHealth
        from ipvsproxy.metrics import Metrics
        from ipvsproxy.serve import Health

        self.config = config
        self.source = source
        self._stopped = stop or threading.Event()
        self._lock = threading.Lock()
        self._fatal: IpvsproxyError | None = None  # the first, under the lock
        self._metrics = Metrics()
        # whether the watchers still read the API (warned once past 2 sync periods)
        self._following = Following(
            bound=2 * config.sync_period, on_stale=_api_stale, on_recovered=_api_recovered
        )
        self._metrics.following(self._following.unread)
        self._health = Health(
            timeout=2 * config.sync_period,
            on_answer=self._metrics.health_answered,
            following=self._following,
        )
        self._service_health = ServiceHealth(
            healthy=self._health.healthy, on_bind_error=self._metrics.bind_failed
        )
        self._tracker = Tracker(
            required=(SERVICE, SLICE, NODE), on_change=self._changed, node_name=config.node_name
        )
        self._metrics.pending(self._tracker.pending)
        # From an API server, the first Services (--first-services) are listed alone too,
        # beside the whole lists: a node joining a large cluster serves the API's Service and
        # the cluster DNS before its lists of Services and slices have arrived.
        self._early = (
            Tracker(
                required=(SERVICE, SLICE, NODE),
                on_change=self._early_listed,
                node_name=config.node_name,
            )  # fmt: skip
            if isinstance(source, Cluster) and config.first_services
            else None
        )
        self._stack = ExitStack()
        # opened by start(): the pass once the backend is (read by other threads: set once)
        self._sync: AgentLoop | None = None
        self._backend: backends.Backend | None = None
        self._api_server: str | None = None
        self._watchers: list[threading.Thread] = []
        self._started = False  # start() has opened everything

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Open everything, in the order the class says; on failure release it and raise."""
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        from ipvsproxy.agent_loop import AgentLoop
        from ipvsproxy.netlink.links import NodeAddresses

        config, stack, metrics = self.config, self._stack, self._metrics
        # Nothing on the node changes (not even the backend's probe) before the input is
        # known good: the source is opened first, so a missing or malformed kubeconfig (or
        # unreadable manifests) fails with the node untouched. Reaching the API is not
        # required: the watchers retry that, and a node keeps its rules while the API server
        # is down. The health port answers from the first moment: a start-up that waits (an
        # API server out of reach, a slow node) must not look dead to the kubelet's liveness
        # probe.
        stack.callback(_serve_health(config, self._health).close)
        start_sources, close_source, self._api_server = _open_source(
            self.source,
            config,
            self._tracker,
            self._stopped,
            metrics,
            early=self._early,
            following=self._following,
        )
        stack.callback(close_source)
        # the secure metrics port before the node is touched: a certificate that cannot be
        # loaded is a ConfigError with the node as it was
        stack.callback(_serve_secure_metrics(config, self.source, metrics))
        stack.callback(self._stopped.set)  # the watchers end with the agent, whatever stops it
        # The lists go out now, while the node is prepared: reading the API and preparing
        # the node overlap, and the first pass starts as soon as both are done.
        self._watchers = start_sources(self._halt)
        backend = self._backend = stack.enter_context(open_backend(config))
        prepare(backend, config)
        remove_leftovers(backend, config)
        metrics.use_backend(backend.name, others=BACKENDS)
        if backend.firewall is not None:
            metrics.use_firewall(backend.firewall.name, others=FIREWALLS)
        self._health.use_backend(backend.detail)
        log.info("backend: %s (%s)", backend.name, backend.reason)
        # The kernel's traffic counters for /metrics (--service-metrics) and the status: one
        # reader for both, on a kernel connection of its own (never the sync pass's),
        # opened when first asked: an agent nobody asks reads nothing.
        traffic_reader = TrafficReader(functools.partial(backends.traffic_kernel, backend))
        stack.callback(traffic_reader.close)
        # read again only after rtnetlink announces a change (links.NodeAddresses)
        host_addresses = stack.enter_context(closing(NodeAddresses(config.dummy_device)))
        stack.callback(self._join_watchers)
        on_names = _service_metrics(config, metrics, traffic_reader, backend.name)
        sync = self._sync = AgentLoop(
            proxier=build_proxier(
                config, backend, drain=True, ramp=True, node_addresses=host_addresses
            ),
            tracker=self._tracker,
            metrics=metrics,
            health=self._health,
            service_health=self._service_health,
            node_required=isinstance(self.source, Cluster),
            on_names=on_names,
            after_first_full=_retiring(backend),
            early=self._early,
        )
        # a caller's `stop` (an embedding program, a test) ends the loop like a signal
        threading.Thread(target=self._stop_on_request, name="stop", daemon=True).start()
        status = status_route(
            snapshot=lambda: sync.snapshot,
            pending=sync.pending,
            tracker=self._tracker,
            passes=lambda: sync.passes,
            sampler=Sampler(traffic_reader),
            backend=backend.name,
            config=config,
            firewall=backend.firewall.name if backend.firewall is not None else None,
        )
        stack.callback(self._service_health.close)
        server = _serve_metrics(
            config, metrics.render, mode=backend.name, in_thread=on_names is not None, status=status
        )
        stack.callback(server.close)
        stack.callback(self._stopped.set)
        self._started = True

    def run(self) -> None:
        """The sync pass until stopped; then everything released (the rules left in place)."""
        sync, backend = self._sync, self._backend
        if not self._started or sync is None or backend is None:
            raise RuntimeError("Agent.run() before start() has succeeded")
        try:
            with _signals(self.stop, resync=sync.resync):
                if not self._stopped.is_set():
                    log.info("running: %s", describe_source(self.source, server=self._api_server))
                    sync.runner.loop()
        finally:
            self.close()
        if self._fatal is not None:
            raise self._fatal
        log.info("stopped; %s rules left in place", backend.name)

    def stop(self) -> None:
        """What SIGTERM does: the agent stops after the sync pass in progress."""
        self._halt()

    def close(self) -> None:
        """Release what `start()` opened, in reverse order (idempotent)."""
        self._stack.close()

    def _halt(self, error: IpvsproxyError | None = None) -> None:
        """What stops the agent: `stop()`, a signal, a watcher's fatal error (the first kept,
        raised by `run()`), before or after the loop has started."""
        if error is not None:
            with self._lock:
                if self._fatal is None:
                    self._fatal = error
        self._stopped.set()
        if self._sync is not None:
            self._sync.runner.stop()

    def _stop_on_request(self) -> None:
        """The `stop` thread: the event set (by `stop=`'s owner, or on the way out) ends the
        loop as `stop()` does."""
        self._stopped.wait()
        if self._sync is not None:
            self._sync.runner.stop()

    def _changed(self, kind: str) -> None:
        """The tracker saw a change (a watcher's thread): counted, and the pass woken."""
        self._metrics.changed(kind)
        self._metrics.queued()
        self._health.queued()
        if self._sync is not None:  # none yet while the source is opened: the first is due
            self._sync.runner.request()

    def _early_listed(self, kind: str) -> None:
        """The first Services' own lists arrived (agent_loop: `early`): the pass woken."""
        if self._sync is not None:  # none yet: the loop's first call finds them
            self._sync.runner.request()

    def _join_watchers(self) -> None:
        """On the way out, after the ports: the watchers told to end (already, after `run()`;
        not yet, when `start()` failed after them) and given half a second each."""
        self._stopped.set()
        for thread in self._watchers:
            thread.join(timeout=0.5)  # watchers blocked in a read are daemons: not waited for


def build_proxier(
    config: Config,
    backend: backends.Backend,
    *,
    drain: bool = False,
    ramp: bool = False,
    node_addresses: Callable[[], tuple[IPAddress, ...]] | None = None,
) -> Proxier:
    """The one way the commands (and the integration lab) build their pass: on the backend's
    kernel, with its firewall rules, draining removed endpoints (`drain`: the agent, and
    `diff`, which shows what it would drain), ramping new endpoints' weights (`ramp`: the
    agent alone, whose later passes take the steps; `diff` and `run --once` show and write
    full weights), this host's addresses read over rtnetlink unless given (in the thread's
    network namespace at each full pass)."""
    return Proxier(
        kernel=backend.kernel,
        config=config,
        firewall=backend.firewall,
        drainer=Drainer(timeout=config.drain_timeout) if drain else None,
        slow_start=SlowStart() if ramp else None,
        node_addresses=node_addresses or _node_addresses(config),
    )


def _saved(config: Config, saved: SavedTable) -> Proxier:
    """The pass of `diff` and `status` on a saved ipvsadm table: planned against it alone,
    its addresses not compared (the file records none)."""
    return Proxier(kernel=saved, config=config, manage_addresses=False)


def _node_addresses(config: Config) -> Callable[[], tuple[IPAddress, ...]]:
    """This host's own addresses, read over rtnetlink (netlink/links.py), for a proxier
    that reads them once (diff, run --once)."""
    from ipvsproxy.netlink.links import node_addresses

    return lambda: node_addresses(config.dummy_device)


def _service_metrics(
    config: Config, metrics: Metrics, reader: TrafficReader, backend: str
) -> Callable[[Mapping[VSKey, str]], None] | None:
    """With --service-metrics on IPVS: the per-Service traffic metrics registered, read
    through `reader` at scrape time, and what the sync pass hands its Service names to
    (each pass's snapshot); None without them. With them /metrics reads the kernel (and
    must be rendered off the event loop)."""
    if not config.service_metrics:
        return None
    if backend == IPTABLES:
        log.info("--service-metrics: the iptables fallback keeps no traffic counters: no series")
        return None
    collector = metrics.service_traffic(
        lambda: reader.read().traffic,
        endpoints=config.endpoint_metrics,
        max_series=config.service_metrics_max_series,
    )
    return collector.use_names


def _serve_metrics(
    config: Config,
    metrics: Callable[[], bytes],
    *,
    mode: str,
    in_thread: bool = False,
    status: InThread | None = None,
) -> HttpServer:
    """The metrics port: /metrics, /proxyMode as kube-proxy answers it (the backend in use,
    `ipvs` or `iptables`) and `status`'s /status, answered to the node's loopback only
    unless --status-remote (it shows every Service, endpoint, pod and node: what RBAC would
    refuse an anonymous client; the port itself is scraped from other hosts). `in_thread`:
    /metrics reads the kernel (--service-metrics), so it is rendered in the `http-slow`
    worker while the event loop goes on answering the probes."""
    from ipvsproxy.serve import HttpServer, InThread, LoopbackOnly, Route

    text = "text/plain; version=0.0.4; charset=utf-8"
    plain = "text/plain; charset=utf-8"

    def render() -> tuple[int, str, bytes]:
        return 200, text, metrics()

    routes: dict[str, Route | InThread | LoopbackOnly] = {
        "/metrics": InThread(render) if in_thread else render,
        "/proxyMode": lambda: (200, plain, mode.encode()),
    }
    if status is not None:
        routes[STATUS_PATH] = status if config.status_remote else LoopbackOnly(status)
    return HttpServer(config.metrics_bind_address, routes).start()


SECURE_REQUEST_TIMEOUT = 10.0  # seconds for a request on the secure port: its reviews (5 s each
# at most, most answered from the cache) and the answer (Prometheus' scrape timeout is 10 s)


def _serve_secure_metrics(config: Config, source: Source, metrics: Metrics) -> Callable[[], None]:
    """The secure metrics port (--secure-metrics-bind-address; docs/monitoring.md): /metrics
    over HTTPS to a client whose bearer token a TokenReview authenticates and whose user a
    SubjectAccessReview allows to get /metrics (delegation.py), reviewed with the agent's
    own credentials on a client of its own (a review never waits behind a list). What
    closes it (nothing to close when off)."""
    address = config.secure_metrics_bind_address
    if address is None:
        return lambda: None
    if not isinstance(source, Cluster):
        raise ConfigError(
            "--secure-metrics-bind-address needs the Kubernetes API (each request is reviewed "
            "there): not with --manifests"
        )
    from ipvsproxy import kube
    from ipvsproxy.delegation import Delegation
    from ipvsproxy.serve import HttpServer, Protected
    from ipvsproxy.servingcert import server_context

    names = [config.node_name] + ([] if address[0] in ("0.0.0.0", "::") else [address[0]])
    tls = server_context(config.tls_cert_file, config.tls_private_key_file, names=names)
    client = kube.connect(
        kubeconfig=source.kubeconfig, context=source.context, master=source.master,
        origin=source.origin, observe=metrics.api_request,
    )  # fmt: skip
    check = Delegation(kube.reviewer(client)).check

    def render() -> tuple[int, str, bytes]:
        return 200, "text/plain; version=0.0.4; charset=utf-8", metrics.render()

    try:
        server = HttpServer(
            address, {"/metrics": Protected(render, check)},
            request_timeout=SECURE_REQUEST_TIMEOUT, tls=tls,
        ).start()  # fmt: skip
    except BaseException:
        client.close()
        raise
    log.info("secure metrics: https://%s:%d/metrics (TokenReview, SubjectAccessReview)", *address)

    def close() -> None:
        server.close()
        client.close()

    return close


def _serve_health(config: Config, health: Health) -> HttpServer:
    """The health port: kube-proxy's /healthz and /livez, and /readyz (serve.Health)."""
    from ipvsproxy.serve import HttpServer

    routes = {"/healthz": health.healthz, "/livez": health.livez, "/readyz": health.readyz}
    return HttpServer(config.healthz_bind_address, routes).start()


def _open_source(
    source: Source,
    config: Config,
    tracker: Tracker,
    stop: threading.Event,
    metrics: Any,
    *,
    early: Tracker | None = None,
    following: Following | None = None,
) -> tuple[
    Callable[[Callable[[IpvsproxyError | None], None]], list[threading.Thread]],
    Callable[[], None],
    str | None,
]:
    """Open the source, failing (ConfigError) on what retrying cannot fix: manifests that
    cannot be read, a kubeconfig (or in-cluster credentials) that cannot be loaded. Returns
    what starts its threads feeding the tracker (a fatal error in one halts the agent), what
    closes it and the API server's URL (None for manifests). `early`: fed the first
    Services' own lists (`kube.first_lists`) by a thread of its own; a failure there is a
    warning (the whole lists serve them as well)."""

    def guarded(
        name: str, target: Callable[[], None], halt: Callable[[IpvsproxyError | None], None]
    ) -> threading.Thread:
        def body() -> None:
            try:
                target()
            except IpvsproxyError as exc:
                log.error("%s: %s", name, exc)
                halt(exc)
            except Exception as exc:  # a bug must stop the agent loudly, not leave it deaf
                log.exception("%s crashed", name)
                halt(IpvsproxyError(f"{name} crashed: {exc!r}"))

        thread = threading.Thread(target=body, name=name, daemon=True)
        thread.start()
        return thread

    if isinstance(source, Manifests):
        from ipvsproxy.manifest_source import ManifestSource

        poller = ManifestSource(source.paths, sink=tracker, stop=stop)
        poller.load()  # unreadable at start: a ConfigError, exit 2
        return (lambda halt: [guarded("manifests", poller.run, halt)]), lambda: None, None

    from ipvsproxy import kube

    client = kube.connect(
        kubeconfig=source.kubeconfig,
        context=source.context,
        master=source.master,
        origin=source.origin,
        observe=metrics.api_request,
    )
    watchers = [
        kube.Watcher(
            kind,
            api=client,
            node_name=config.node_name,
            sink=tracker,
            stop=stop,
            on_restart=lambda k, reason: metrics.watch_restarts.labels(k, reason).inc(),
            following=following,
        )
        for kind in (SERVICE, SLICE, NODE)
    ]

    def start(halt: Callable[[IpvsproxyError | None], None]) -> list[threading.Thread]:
        if early is not None:  # a few short requests; never joined (a daemon)
            first = functools.partial(_list_first, client, config, early)
            threading.Thread(target=first, name="first-services", daemon=True).start()
        return [guarded(f"watch-{w.kind}", w.run, halt) for w in watchers]

    return start, client.close, client.configuration.host


def _api_stale(unread: Unread) -> None:
    log.warning(
        "API: %ss not read for %.0fs (longer than 2 sync periods), last error: %s; the node "
        "keeps its rules but does not follow changes until it reads them again",
        unread.kind, unread.seconds, unread.error,
        extra={"resource": unread.kind, "unreadSeconds": round(unread.seconds, 1)},
    )  # fmt: skip


def _api_recovered(kind: str, seconds: float) -> None:
    log.info("API: %ss read again after %.0fs", kind, seconds)


def _list_first(client: Any, config: Config, early: Tracker) -> None:
    """The first Services' own lists into `early` (kube.first_lists); a failure is a
    warning: the whole lists serve them as well."""
    from ipvsproxy import kube

    try:
        kube.first_lists(client, config.first_services, node_name=config.node_name, sink=early)
    except IpvsproxyError as exc:
        log.warning("the first Services could not be listed alone: %s", exc)
    except Exception:  # noqa: BLE001 - a bug here must not stop the agent
        log.exception("listing the first Services alone failed with an unexpected error")


@contextmanager
def _signals(
    halt: Callable[[], None], *, resync: Callable[[], None] = lambda: None
) -> Iterator[None]:
    """SIGTERM/SIGINT stop the agent after the sync in progress; SIGHUP (whose default
    would end it mid-pass) asks for a full resync: the next pass observes everything and
    repairs drift, as every sync period; old handlers come back.

    The handler runs in the main thread between two bytecodes, possibly while that thread
    holds a lock (an Event's, the runner's, a logging handler's): taking any of them again
    would deadlock. So it only writes the signal's number to a pipe (a self-pipe: no lock,
    never blocks); a thread reads it, logs and halts.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    import os

    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)

    def handler(signum: int, frame: object) -> None:
        try:
            os.write(write_end, bytes([signum]))
        except OSError:  # the pipe is full: a stop (or a resync) is already on its way
            return

    def notice() -> None:
        while received := os.read(read_end, 1):  # b"": the write end closed, we are done
            if received[0] == signal.SIGHUP:
                log.info("received SIGHUP: full resync")
                resync()
                continue
            log.info("received %s: stopping", signal.Signals(received[0]).name)
            halt()

    watcher = threading.Thread(target=notice, name="signals", daemon=True)
    watcher.start()
    caught = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {sig: signal.signal(sig, handler) for sig in caught}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        os.close(write_end)
        watcher.join(timeout=5)
        os.close(read_end)


def describe_source(source: Source, *, server: str | None = None) -> str:
    """The source in words: the files, or the API server's URL (`server`: the client's, once
    connected; else --master's, if given) and the configuration it came from."""
    if isinstance(source, Manifests):
        return "manifests from " + ", ".join(map(str, source.paths))
    if source.kubeconfig:
        via = f"via {source.kubeconfig}"
    elif source.master:
        via = "(--master, no credentials)"
    else:
        via = "via in-cluster or default kubeconfig"
    server = server or source.master
    return f"Kubernetes API at {server} {via}" if server else f"Kubernetes API {via}"


def cleanup(config: Config, *, dry_run: bool, ipvs: bool = True, force: bool = False) -> list[str]:
    """Remove (or, with dry_run, list) everything ipvsproxy owns in both backends (without
    `ipvs`: all but its IPVS table and dummy device). Holding the node's lock: while an
    agent runs it would rewrite what this removes, so `NodeBusy` unless `force` (then a
    warning naming the agent). A dry run changes nothing and takes no lock."""
    if dry_run:
        return backends.cleanup(config, dry_run=True, ipvs=ipvs)
    try:
        with nodelock.hold("cleanup", advice="stop it first, or give --force"):
            return backends.cleanup(config, dry_run=False, ipvs=ipvs)
    except nodelock.NodeBusy:
        if not force:
            raise
        log.warning(
            "cleanup --force: this node's lock is held (%s): what is removed may be written again",
            nodelock.holder() or "released meanwhile",
        )
        return backends.cleanup(config, dry_run=False, ipvs=ipvs)


class NotServed(IpvsproxyError):
    """`cleanup --kube-proxy` before this node's agent has taken the node over."""


def cleanup_kube_proxy(
    config: Config, *, dry_run: bool, ipvs: bool, force: bool = False
) -> list[str]:
    """Remove (or list) what kube-proxy left, in any of its modes (kpcleanup.py). Only once
    the agent on this
    node (its health port, `config.healthz_bind_address`) answers /readyz: until its first
    full pass it has not read kube-proxy's table nor written its own rules, and kube-proxy's
    are what serves the node. `NotServed` naming what it waits for, unless `force` (then a
    warning). A dry run asks nothing."""
    from ipvsproxy.kpcleanup import cleanup_kube_proxy as remove
    from ipvsproxy.status.client import agent_url, waiting_for

    if not dry_run:
        url = agent_url(*config.healthz_bind_address)
        waiting = waiting_for(url)
        if waiting is not None and not force:
            raise NotServed(
                f"ipvsproxy on this node is not serving it yet (waiting for {waiting}): "
                f"kube-proxy's rules stay until {url}/readyz answers 200; --force removes them"
            )
        if waiting is not None:
            log.warning("cleanup --kube-proxy --force: the agent waits for %s", waiting)
    return remove(config, dry_run=dry_run, ipvs=ipvs)


def prepare_host(config: Config) -> list[str]:
    """Load the IPVS modules, set the kernel settings either backend needs; what was done."""
    prepared = backends.prepare_node(config, ipvs=None, load_modules=True)
    return [*prepared.changed, *prepared.unchanged]
