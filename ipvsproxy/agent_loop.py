"""The long-running agent's sync pass: what the runner calls, with its bookkeeping.

Owns: `AgentLoop` and its `runner` (sync/runner.py: when the pass runs, from the sync
periods; the agent's thread calls its `loop()`). Each call: wait until every required kind
has listed (never program a partial view), take the changed Services from the tracker, run
one pass of the proxier (proxier/: full every `--sync-period` or after the node changed,
partial in between), record metrics and health, log a summary line (at the default verbosity
only for a pass that wrote or failed something; every pass at --v 2), and ask the runner for
an early retry when an operation failed, endpoints are draining, or a slow-start ramp takes
its next step.

After each completed pass it also tells the health server whether this node is eligible
(kube-proxy's SyncNode), hands the health-check node ports their Services and local
endpoint counts (healthcheck.py), and publishes the pass's `Snapshot` for `status` (read in
another thread, without a lock: `snapshot`, `passes` and `pending()`).

Imports: status (Passes), proxier, healthcheck, sync.*, kernel, metrics, serve, config, errors.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

from ipvsproxy.api import Ref
from ipvsproxy.errors import KernelError
from ipvsproxy.healthcheck import ServiceHealth
from ipvsproxy.metrics import Metrics
from ipvsproxy.model import AddDest, DeleteDest, IPAddress, Op, UpdateDest, VSKey
from ipvsproxy.proxier import PassResult, Proxier, Snapshot, snapshot_of, touched
from ipvsproxy.serve import Health
from ipvsproxy.status.document import Passes
from ipvsproxy.sync.render import sentence
from ipvsproxy.sync.runner import Runner
from ipvsproxy.sync.tracker import Changes, Tracker

log = logging.getLogger("ipvsproxy.sync")

DRAIN_POLL = 1.0  # seconds between connection-count checks while endpoints drain
SAME_ERROR_LINES = 5  # failures of one pass with the same error named one by one; then counted
# A full pass is due once a sync period has passed since the last one ended (the runner's
# periodic run comes exactly then; the margin absorbs clock rounding).
FULL_DUE = 0.99


def split(changes: Changes, refs: Iterable[Ref]) -> tuple[Changes, Changes]:
    """`changes` as two: those of the Services `refs`, and the others (each with the Node,
    the warnings; the slices' trigger times go with the others)."""
    first = set(refs).intersection(changes.services)
    early = replace(
        changes,
        services={ref: changes.services[ref] for ref in first},
        slices={ref: changes.slices[ref] for ref in first if ref in changes.slices},
        trigger_times=(),
    )
    if not first:
        return early, changes
    rest = replace(
        changes,
        services={ref: svc for ref, svc in changes.services.items() if ref not in first},
        slices={ref: found for ref, found in changes.slices.items() if ref not in first},
    )
    return early, rest


def freeze_heap() -> None:
    """After the first full pass: the views, the desired and the applied table (a million
    objects at 10,000 Services) live as long as the process and hold no reference cycles,
    so the cyclic collector's full collections would only walk them again and again (seconds
    each, stalling syncs). Moved out of its sight; freed by reference counting as usual."""
    gc.collect()
    gc.freeze()


class AgentLoop:
    def __init__(
        self,
        *,
        proxier: Proxier,
        tracker: Tracker,
        metrics: Metrics,
        health: Health,
        clock: Callable[[], float] = time.monotonic,
        service_health: ServiceHealth | None = None,
        node_required: bool = False,
        wall_clock: Callable[[], float] = time.time,
        on_names: Callable[[Mapping[VSKey, str]], None] | None = None,
        after_first_full: Callable[[], object] | None = None,
        early: Tracker | None = None,
    ) -> None:
        self.proxier = proxier
        # the first Services' own lists (Agent: `kube.first_lists`), when they come before
        # the whole lists: their pass runs on them at once (`_first_services`)
        self._early = early
        # called once, after the first full pass whose firewall step was written
        self._after_first_full = after_first_full
        # for `status` (HTTP worker thread), replaced whole at the end of each completed pass:
        # the state it left, and when the last full and partial passes completed
        self.snapshot: Snapshot | None = None
        self.passes = Passes()
        self._in_pass: frozenset[Ref] = frozenset()  # taken by passes not completed yet
        self._wall_clock = wall_clock
        self._config = proxier.config
        self._service_health = service_health
        # from the API the Node must exist for /healthz to be 200 (kube-proxy); manifests
        # may hold none
        self._node_required = node_required
        self._tracker = tracker
        self._metrics = metrics
        self._health = health
        self._clock = clock
        self._warned: frozenset[str] = frozenset()
        self._logged: dict[object, str] = {}  # per failing object: the error last logged
        self._failed_passes = 0  # passes in a row that did not complete
        self._waiting_logged: bool | None = False  # None: the first sync has started
        self._last_full = -math.inf
        # asked for (a failed or stale pass; SIGHUP, from another thread): consumed when a
        # pass starts, so a request made during a full pass is not swallowed by its end
        self._full_asked = False
        self._frozen = False
        self._first_done = False  # the first Services' pass (Proxier.plan_first), tried once
        # when the pass runs: at most every --min-sync-period, at least every --sync-period,
        # soon after a change; one thread calls its `loop()`, others `request()` or `stop()`
        self.runner = Runner(
            self,
            min_interval=self._config.min_sync_period,
            max_interval=self._config.sync_period,
            clock=clock,
        )
        # with --service-metrics: handed every virtual server's origin ("ns/name:port") after
        # each completed pass, as a snapshot it may keep
        self._on_names = on_names
        self.last: PassResult | None = None

    def request_full(self) -> None:
        """Make the next pass a full one (observe everything, repair drift); safe from any
        thread."""
        self._full_asked = True

    def resync(self) -> None:
        """A full pass now (SIGHUP): asked for, and the runner woken; from any thread."""
        self.request_full()
        self.runner.request()

    def _ready(self) -> bool:
        """Whether every required kind has listed (said once each way in the log)."""
        if not self._tracker.synced():
            unlisted = ", ".join(f"{kind}s" for kind in sorted(self._tracker.unlisted()))
            self._health.waiting(f"the first list of {unlisted} from the API")
            if not self._waiting_logged:
                log.info("waiting for Services and EndpointSlices to be listed before any sync")
                self._waiting_logged = True
            return False
        if self._waiting_logged is not None:
            counts = ", ".join(f"{n} {kind}s" for kind, n in sorted(self._tracker.counts().items()))
            log.info("listed %s: first sync", counts)
            self._health.waiting(f"the first full pass (listed {counts})")
            self._waiting_logged = None
        return True

    def __call__(self) -> bool:
        """One pass; False when none could run (not every kind listed yet): the runner does
        not count it, and the pass after the lists comes at once."""
        if not self._ready():
            if not self._first_done and self._early is not None and self._early.synced():
                self._first_done = True  # before the whole lists: on the first Services' own
                self.proxier.desired.refresh_host()
                self._first_services(self._early.take(everything=True))
            return False
        self._pass()
        return True

    def pending(self) -> frozenset[Ref]:
        """The Services changed since the last completed pass (the next pass applies them);
        from any thread."""
        return self._tracker.changed() | self._in_pass

    def _pass(self) -> None:
        started = self._clock()
        full = self._full_asked or started - self._last_full >= self._config.sync_period * FULL_DUE
        self._full_asked = False
        moved = full and self.proxier.desired.refresh_host()  # this host's addresses changed
        changes = self._tracker.take(everything=moved)
        self._in_pass |= changes.services.keys()
        node = changes.node
        self._health.node_eligible(node.eligible if node else not self._node_required)
        steps: dict[str, float] = {}
        if not self._first_done:
            self._first_done = True
            changes = self._first_services(changes)
            steps["first Services"] = self._clock() - started
        self.proxier.feed(changes)
        self._warn(self.proxier.warnings)
        fed = self._clock()
        try:
            planned = self.proxier.plan(full=full)
            steps |= {"feed": fed - started - sum(steps.values()), "plan": self._clock() - fed}
            result = self.proxier.apply(planned)
        except KernelError as exc:
            self._pass_failed(f"sync failed: {exc}", traceback=False, started=started, full=full)
            return
        except Exception:  # noqa: BLE001 - the agent never dies of one bad pass
            self._pass_failed(
                "sync failed with an unexpected error", traceback=True, started=started, full=full
            )
            return
        self._completed(result, changes, started, steps)

    def _first_services(self, changes: Changes) -> Changes:
        """Before the first full pass, the first Services alone (`--first-services`), when
        the kernel does not serve them yet: translated, planned and applied before the other
        Services are even translated (at 5,000 Services x 50 endpoints that translation
        takes seconds). Returns the other changes, for the full pass that follows at once;
        a failure here is a warning (the full pass writes them all the same)."""
        early, rest = split(changes, self._config.first_services)
        self.proxier.feed(early)
        try:
            first = self.proxier.plan_first(self._config.first_services)
            if first is None:
                return rest
            result = self.proxier.apply(first)
        except KernelError as exc:
            log.warning("the first Services could not be served before the rest: %s", exc)
            return rest
        except Exception:  # noqa: BLE001 - the full pass still runs
            log.exception("the first Services' pass failed with an unexpected error")
            return rest
        names = sorted({name.rpartition(":")[0] or name for name in first.names.values()})
        failed = len(result.sync.report.failures)
        log.info(
            "first Services served before the rest of the table: %s (%d operations, %d "
            "failed, %d firewall changes%s)",
            ", ".join(names), len(result.sync.plan), failed, result.firewall_changes,
            f"; firewall rules: {result.firewall_error}" if result.firewall_error else "",
        )  # fmt: skip
        return rest

    def _completed(
        self, result: PassResult, changes: Changes, started: float, steps: dict[str, float]
    ) -> None:
        """A pass that completed: metrics, health, the log line (and, at --v 3, the seconds
        of each step: `steps`, the ones before the writes), early retries."""
        steps["apply"] = self._clock() - started - sum(steps.values())
        if result.full:
            self._metrics.families(self.proxier.desired.families())
            then = self._after_first_full
            if then is not None and not result.firewall_error:
                self._after_first_full = None
                then()
                steps["retire other firewall"] = self._clock() - started - sum(steps.values())
            if not self._frozen:
                freeze_heap()
                self._frozen = True
                steps["freeze heap"] = self._clock() - started - sum(steps.values())
        if result.stale:
            self.request_full()
        seconds = self._clock() - started
        report = result.sync.report
        restore_failures = result.restore_failed
        self._metrics.synced(
            seconds=seconds,
            plan=result.sync.plan,
            report=report,
            virtual_servers=result.virtual_servers,
            real_servers=result.real_servers,
            draining=result.sync.draining,
            triggers=changes.trigger_times,
            full=result.full,
            # as kube-proxy's syncProxyRules returning after a failed restore: timed, but no
            # last-sync time and no programming latency
            restored=not result.firewall_error and not restore_failures,
        )
        if self._on_names is not None:  # copied only when a name came, went or changed
            self._on_names(self.proxier.index.origins())
        fell_back = self.proxier.index.no_local_endpoints()
        self._metrics.no_local({(str(p), v): n for (p, v), n in fell_back.items()})
        for version in restore_failures:
            self._metrics.restore_failed(version)
        failed = self._health_after(result)
        if self._service_health is not None:
            self._service_health.sync(self.proxier.health_checks, self._listen_on())
        self._log_failures(result)
        self._warn(self.proxier.warnings)  # substitutes for refused settings, named
        counts = {
            "operations": len(result.sync.plan),
            "failed": len(report.failures),
            "virtual_servers": result.virtual_servers,
            "real_servers": result.real_servers,
            "draining": result.sync.draining,
            "firewall_changes": result.firewall_changes,
            "seconds": round(seconds, 3),
            "pass": "full" if result.full else "partial",
            "services_changed": len(changes.services),
            "firewall_seconds": round(result.firewall_seconds, 3),
        }
        # At the default verbosity a pass is logged when it wrote or failed something (a
        # Service programmed, an endpoint drained or removed, a refusal): an idle resync, or a
        # pass that only polls a drain, says nothing; every pass at --v 2 (kube-proxy's V(2)).
        wrote = report.failures or result.sync.plan or result.firewall_changes
        log.info(
            "sync: %(operations)d operations (%(failed)d failed), %(virtual_servers)d virtual "
            "servers, %(real_servers)d real servers, %(draining)d draining, %(firewall_changes)d "
            "firewall changes, %(seconds).3fs (%(pass)s, %(services_changed)d Services changed, "
            "firewall %(firewall_seconds).3fs)",
            counts,
            extra=counts if wrote else {**counts, "v": 2},
        )
        self.last = result
        now = self._wall_clock()
        self.snapshot = snapshot_of(self.proxier)
        steps["after"] = self._clock() - started - sum(steps.values())
        # --v 3: where a pass's time went (the sync line gives only its whole and the
        # firewall's); not --v 4, which also logs every operation
        fields = {k.replace(" ", "_"): round(v, 3) for k, v in steps.items()}
        text = ", ".join(f"{k} {v:.3f}s" for k, v in steps.items())
        log.info("pass steps: %s", text, extra={"v": 3, **fields})
        self.passes = replace(self.passes, **{"full" if result.full else "partial": now})
        self._in_pass = frozenset()
        if result.full:  # the period counts from its end, as the runner's does
            self._last_full = self._clock()
        if result.transaction_error:
            self.request_full()  # what the kernel holds is unknown
        self._retry(failed=failed, draining=result.sync.draining > 0)

    def _health_after(self, result: PassResult) -> bool:
        """Health is kube-proxy's: the loop is alive and completes passes. A refused
        operation is a metric, a log line and a retry, never the node's health; a pass
        whose firewall step failed or whose transaction the backend refused whole (nothing
        of it written) did not complete: said once, with its cause, and /healthz is not
        refreshed. Whether the pass failed so."""
        refused = result.transaction_error
        if result.firewall_error:
            log.error("firewall rules: %s", result.firewall_error)
        if refused:
            log.error("sync failed: the backend refused the pass, nothing of it was written: %s",
                      refused, extra={"error": refused})  # fmt: skip
        if result.firewall_error or refused:
            self._not_served(f"firewall rules: {result.firewall_error}" if result.firewall_error
                             else f"the backend refused the pass: {refused}")  # fmt: skip
            return True
        self._health.updated(full=result.full)
        return False

    def _not_served(self, failure: str) -> None:
        """Before the node is served (/readyz), what the last failed pass said."""
        if not self._health.served:
            self._health.waiting(f"a full pass to complete; the last one failed: {failure}")

    def _listen_on(self) -> tuple[IPAddress, ...]:
        """Where health-check node ports listen: kube-proxy's nodePortAddresses when they
        restrict (CIDRs, or `primary`), else everywhere (empty)."""
        node, config = self.proxier.node, self._config
        if node is None or not (config.nodeport_cidrs or config.nodeport_primary):
            return ()
        chosen = node.primary if config.nodeport_primary else node.addresses
        return tuple(a for a in chosen if config.selects_nodeport_address(a))

    def _pass_failed(self, message: str, *, traceback: bool, started: float, full: bool) -> None:
        """A pass that did not complete: logged (with the traceback when unexpected),
        counted and timed (kube-proxy times every pass, however it ends), the next pass full
        (what the kernel holds is unknown), retried soon."""
        log.error("%s", message, exc_info=traceback)
        self._not_served(message)
        self._metrics.sync_error(seconds=self._clock() - started, full=full)
        self.request_full()
        self._failed_passes += 1
        delay = self._config.retry.delay(self._failed_passes)
        self.runner.retry_after(max(delay, self._config.min_sync_period))

    def _log_failures(self, result: PassResult) -> None:
        """One line per failing object per change of its error (not one per pass while
        it backs off), and one when it recovers. Failures sharing one error are named up
        to SAME_ERROR_LINES times, then counted in one line. Those of a transaction refused
        whole (an iptables-restore fails every object it carried: 140,000 at 10,000
        Services) are not named at all: the pass failed, and `_completed()` says why."""
        same: Counter[str] = Counter()
        whole = {id(error) for error in result.sync.report.refused}
        for failure in result.sync.report.failures:
            what = _object_of(failure.op)
            if touched((failure.op,))[0] & result.refused or id(failure.error) in whole:
                # warned about as a refusal (served plainer at once), or the pass failed
                # whole (said once, with its cause)
                continue
            text = str(failure.error)
            if self._logged.get(what) != text:
                self._logged[what] = text
                same[text] += 1
                if same[text] > SAME_ERROR_LINES:
                    continue
                fields = result.sync.facts(failure.op)
                log.error(
                    "operation failed: %s: %s",
                    sentence(fields),
                    text,
                    extra={**fields, "error": text},
                )
        for text, count in same.items():
            if count > SAME_ERROR_LINES:
                log.error(
                    "operation failed: %d more operations: %s",
                    count - SAME_ERROR_LINES,
                    text,
                    extra={"error": text, "count": count - SAME_ERROR_LINES},
                )
        for key in result.recovered:
            logged = [w for w in self._logged if w == key or (isinstance(w, tuple) and w[0] == key)]
            for what in logged:
                del self._logged[what]
            if logged:
                service = result.sync.names.get(key)
                log.info(
                    "%s%s: programmed after earlier failures",
                    key,
                    f" (Service {service})" if service else "",
                    extra={"vip": str(key.address), "port": key.port, "protocol": key.proto.name}
                    | ({"service": service} if service else {}),
                )

    def _warn(self, warnings: tuple[str, ...]) -> None:
        """Log each input warning once, when it first appears (not on every sync)."""
        current = frozenset(warnings)
        for warning in sorted(current - self._warned):
            log.warning("%s", warning)
        self._warned = current

    def _retry(self, *, failed: bool, draining: bool = False) -> None:
        """Ask the runner for an early pass: when the first failing virtual server is due
        again (proxier backoff: 1, 2, 4, ... s, at most the sync period), after a failed
        firewall step or a transaction refused whole (the same doubling), in a second
        while endpoints drain, or at the next step of a slow-start ramp."""
        self._failed_passes = self._failed_passes + 1 if failed else 0
        delays = []
        if failed:
            delays.append(self._config.retry.delay(self._failed_passes))
        if (due := self.proxier.backoff.next_in()) is not None:
            delays.append(due)
        if draining:
            delays.append(DRAIN_POLL)
        ramp = self.proxier.slow_start
        if ramp is not None and (step := ramp.next_in()) is not None:
            delays.append(step)
        if delays:
            self.runner.retry_after(max(min(delays), self._config.min_sync_period))


def _object_of(op: Op) -> object:
    """The object an operation is about (a virtual server, one of its destinations, an
    address), for per-object logging."""
    match op:
        case AddDest(key, rs) | UpdateDest(key, rs):
            return key, rs.key
        case DeleteDest(key, rs_key):
            return key, rs_key
    keys, addresses = touched((op,))
    return next(iter(keys or addresses), op)
