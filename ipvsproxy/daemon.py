"""The long-running agent's sync pass: what the runner calls, with its bookkeeping.

Owns: `SyncPass`. Each call: wait until every required kind has listed (never program a
partial view), snapshot the tracker, translate, `engine.sync()` (observe, hold draining
endpoints, plan, apply), then record metrics and health, log one summary line and ask the
runner for an early retry when an operation failed or endpoints are draining.

Imports: sync.*, kernel, metrics, serve, config, errors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ipvsproxy.companion.kernel import Companion
from ipvsproxy.companion.step import CompanionResult, after_sync, options_for
from ipvsproxy.config import Config
from ipvsproxy.errors import KernelError
from ipvsproxy.kernel import Kernel
from ipvsproxy.metrics import Metrics
from ipvsproxy.serve import Health
from ipvsproxy.sync.desired import from_objects
from ipvsproxy.sync.drain import Drainer
from ipvsproxy.sync.engine import SyncResult, sync
from ipvsproxy.sync.runner import Runner
from ipvsproxy.sync.tracker import Tracker

log = logging.getLogger("ipvsproxy.sync")

DRAIN_POLL = 1.0  # seconds between connection-count checks while endpoints drain


class SyncPass:
    def __init__(
        self,
        *,
        kernel: Kernel,
        config: Config,
        tracker: Tracker,
        metrics: Metrics,
        health: Health,
        companion: Companion | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._kernel = kernel
        self._companion = companion
        self._config = config
        self._tracker = tracker
        self._metrics = metrics
        self._health = health
        self._clock = clock
        self._drainer = Drainer(timeout=config.drain_timeout, clock=clock)
        self._warned: frozenset[str] = frozenset()
        self._failures_in_row = 0
        self._waiting_logged = False
        self.runner: Runner | None = None  # set by the agent; asked for retries
        self.last: SyncResult | None = None

    def __call__(self) -> None:
        if not self._tracker.synced():
            if not self._waiting_logged:
                log.info("waiting for Services and EndpointSlices to be listed before any sync")
                self._waiting_logged = True
            return
        started = self._clock()
        snapshot = self._tracker.snapshot()
        desired, node = from_objects(snapshot.objects, self._config)
        self._warn(desired.warnings)
        try:
            result = sync(self._kernel, desired, node, self._config, drainer=self._drainer)
        except KernelError as exc:
            log.error("sync failed: %s", exc)
            self._metrics.sync_error()
            self._retry(failed=True)
            return
        # Metrics describe the IPVS table as soon as it is programmed (the companion rules,
        # next, only add masquerading and filtering around it).
        ipvs_seconds = self._clock() - started
        report = result.report
        self._metrics.synced(
            seconds=ipvs_seconds,
            plan=result.plan,
            report=report,
            state=result.state,
            draining=result.draining,
            triggers=snapshot.trigger_times,
        )
        extra = CompanionResult()
        if self._companion is not None:
            options = options_for(self._config, node)
            extra = after_sync(self._companion, result, desired, options)
            if extra.error:
                log.error("companion rules: %s", extra.error)
        seconds = self._clock() - started
        if report.ok and not extra.error:
            self._health.updated()
        for failure in report.failures:
            log.error("operation failed: %s", failure.error)
        log.info(
            "sync: %d operations (%d failed), %d virtual servers, %d real servers, "
            "%d draining, %d companion changes, %.3fs",
            len(result.plan),
            len(report.failures),
            len(result.state.services),
            sum(len(d) for d in result.state.dests.values()),
            result.draining,
            extra.changes,
            seconds,
        )
        self.last = result
        failed = not report.ok or bool(extra.error)
        self._retry(failed=failed, draining=result.draining > 0)

    def _warn(self, warnings: tuple[str, ...]) -> None:
        """Log each input warning once, when it first appears (not on every sync)."""
        current = frozenset(warnings)
        for warning in sorted(current - self._warned):
            log.warning("%s", warning)
        self._warned = current

    def _retry(self, *, failed: bool, draining: bool = False) -> None:
        self._failures_in_row = self._failures_in_row + 1 if failed else 0
        if self.runner is None:
            return
        if failed:  # 1, 2, 4, ... seconds, at most the sync period
            delay = min(2.0 ** (self._failures_in_row - 1), self._config.sync_period)
            self.runner.retry_after(max(delay, self._config.min_sync_period))
        elif draining:
            self.runner.retry_after(max(DRAIN_POLL, self._config.min_sync_period))
