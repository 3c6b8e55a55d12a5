"""The long-running agent's sync pass: what the runner calls, with its bookkeeping.

Owns: `SyncPass`. Each call: wait until every required kind has listed (never program a
partial view), take the changed Services from the tracker, run one pass of the pipeline
(pipeline.py: full every `--sync-period` or after the node changed, partial in between),
record metrics and health, log one summary line, and ask the runner for an early retry
when an operation failed or endpoints are draining.

Imports: pipeline, sync.*, kernel, metrics, serve, config, errors.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Callable

from ipvsproxy.companion.kernel import Companion
from ipvsproxy.config import Config
from ipvsproxy.errors import KernelError
from ipvsproxy.kernel import Kernel
from ipvsproxy.metrics import Metrics
from ipvsproxy.pipeline import PassResult, Pipeline
from ipvsproxy.serve import Health
from ipvsproxy.sync.drain import Drainer
from ipvsproxy.sync.runner import Runner
from ipvsproxy.sync.tracker import Tracker

log = logging.getLogger("ipvsproxy.sync")

DRAIN_POLL = 1.0  # seconds between connection-count checks while endpoints drain
# A full pass is due once a sync period has passed since the last one (the runner's
# periodic run comes exactly then; the margin absorbs clock rounding).
FULL_DUE = 0.99


def freeze_heap() -> None:
    """After the first full pass: the views, the desired and the applied table (a million
    objects at 10,000 Services) live as long as the process and hold no reference cycles,
    so the cyclic collector's full collections would only walk them again and again (seconds
    each, stalling syncs). Moved out of its sight; freed by reference counting as usual."""
    gc.collect()
    gc.freeze()


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
        self._config = config
        self._tracker = tracker
        self._metrics = metrics
        self._health = health
        self._clock = clock
        self.pipeline = Pipeline(
            kernel=kernel,
            config=config,
            companion=companion,
            drainer=Drainer(timeout=config.drain_timeout, clock=clock),
        )
        self._warned: frozenset[str] = frozenset()
        self._failures_in_row = 0
        self._waiting_logged: bool | None = False  # None: the first sync has started
        self._last_full = -math.inf
        self._frozen = False
        self.runner: Runner | None = None  # set by the agent; asked for retries
        self.last: PassResult | None = None

    def request_full(self) -> None:
        """Make the next pass a full one (observe everything, repair drift)."""
        self._last_full = -math.inf

    def _ready(self) -> bool:
        """Whether every required kind has listed (said once each way in the log)."""
        if not self._tracker.synced():
            if not self._waiting_logged:
                log.info("waiting for Services and EndpointSlices to be listed before any sync")
                self._waiting_logged = True
            return False
        if self._waiting_logged is not None:
            counts = ", ".join(f"{n} {kind}s" for kind, n in sorted(self._tracker.counts().items()))
            log.info("listed %s: first sync", counts)
            self._waiting_logged = None
        return True

    def __call__(self) -> None:
        if not self._ready():
            return
        started = self._clock()
        full = started - self._last_full >= self._config.sync_period * FULL_DUE
        changes = self._tracker.take()
        self.pipeline.feed(changes)
        self._warn(self.pipeline.warnings)
        try:
            result = self.pipeline.apply(self.pipeline.plan(full=full))
        except KernelError as exc:
            log.error("sync failed: %s", exc)
            self._metrics.sync_error()
            self.request_full()  # what the kernel holds is unknown now
            self._retry(failed=True)
            return
        if result.full:
            if not self._frozen:
                freeze_heap()
                self._frozen = True
            self._last_full = started
        if result.stale:
            self.request_full()
        seconds = self._clock() - started
        report = result.sync.report
        self._metrics.synced(
            seconds=seconds,
            plan=result.sync.plan,
            report=report,
            virtual_servers=result.virtual_servers,
            real_servers=result.real_servers,
            draining=result.sync.draining,
            triggers=changes.trigger_times,
        )
        if result.companion_error:
            log.error("companion rules: %s", result.companion_error)
        if result.ok:
            self._health.updated()
        for failure in report.failures:
            log.error("operation failed: %s", failure.error)
        log.info(
            "sync: %d operations (%d failed), %d virtual servers, %d real servers, "
            "%d draining, %d companion changes, %.3fs (%s, %d Services changed, "
            "companion %.3fs)",
            len(result.sync.plan),
            len(report.failures),
            result.virtual_servers,
            result.real_servers,
            result.sync.draining,
            result.companion_changes,
            seconds,
            "full" if result.full else "partial",
            len(changes.services),
            result.companion_seconds,
        )
        self.last = result
        self._retry(failed=not result.ok, draining=result.sync.draining > 0)

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
