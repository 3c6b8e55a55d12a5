"""Reading the kernel's traffic counters for `status` and the per-Service metrics.

Owns: `Sample` (one reading of `Kernel.traffic()` and when it was taken), `TrafficReader`
(readings for the HTTP routes: its own kernel connection, one reading at a time, shared by
every caller for `min_interval` seconds) and `rates` (per-second figures from two samples).

The sync thread's netlink socket is never used here: a dump from another thread on the same
socket would interleave with the pass's messages. A reader opens its own connection the
first time it is asked, so an agent that nobody asks pays nothing.

Imports: model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from ipvsproxy.model import Counters, RSKey, Traffic, VSKey

# The kernel exports its counters as its rate estimator last summed them (estimation_timer,
# ip_vs_est.c: every 2 seconds, per CPU into one): a reading is up to this old, so rates over a
# shorter window come out as 0 or double. Readings for rates are at least this far apart.
KERNEL_REFRESH = 2.0


class Counted(Protocol):
    """What a reader reads: `Kernel.traffic()` (every backend has it; the IPVS one reads
    through a `netlink.CounterReader` of its own)."""

    def traffic(self) -> Mapping[VSKey, Traffic]: ...


@dataclass(frozen=True, slots=True)
class Sample:
    """One reading of every counter, and the monotonic time it was taken."""

    at: float
    traffic: Mapping[VSKey, Traffic] = field(default_factory=dict)


class TrafficReader:
    """Readings of `Kernel.traffic()` from a kernel connection of its own.

    `read()` blocks while the kernel is read (at 10,000 Services x 10 a dump is most of a
    second): call it from a worker thread, never the event loop. Callers within
    `min_interval` seconds of the last reading share it, and a caller arriving while a
    reading is under way waits for that one, so a scrape storm reads the kernel at most
    once a `min_interval`.
    """

    def __init__(
        self,
        open_kernel: Callable[[], Counted],
        *,
        min_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._open = open_kernel
        self._kernel: Counted | None = None
        self.min_interval = min_interval
        self._clock = clock
        self._lock = threading.Lock()
        self._last: Sample | None = None

    def read(self) -> Sample:
        """The latest sample, taken now unless one is under `min_interval` seconds old.
        Raises what the kernel raises (KernelError); the next call tries again."""
        with self._lock:
            last = self._last
            if last is not None and self._clock() - last.at < self.min_interval:
                return last
            if self._kernel is None:
                self._kernel = self._open()
            sample = Sample(self._clock(), self._kernel.traffic())
            self._last = sample
            return sample

    def close(self) -> None:
        with self._lock:
            kernel, self._kernel = self._kernel, None
        close = getattr(kernel, "close", None)
        if close is not None:
            close()


@dataclass(frozen=True, slots=True)
class Rates:
    """Per second, between two samples."""

    connections: float = 0.0
    packets: float = 0.0  # in + out
    bytes: float = 0.0  # in + out


def rate(before: Counters, after: Counters, seconds: float) -> Rates:
    """Rates from two readings of one object's counters, `seconds` apart. A counter that went
    down (the object was deleted and added again between them) counts from zero."""
    if seconds <= 0:
        return Rates()

    def per_second(old: int, new: int) -> float:
        return (new - old if new >= old else new) / seconds

    return Rates(
        per_second(before.connections, after.connections),
        per_second(before.packets_in + before.packets_out, after.packets_in + after.packets_out),
        per_second(before.bytes_in + before.bytes_out, after.bytes_in + after.bytes_out),
    )


def rates(
    before: Sample, after: Sample
) -> tuple[dict[VSKey, Rates], dict[tuple[VSKey, RSKey], Rates]]:
    """Rates per virtual server and per destination present in `after`; an object new since
    `before` counts from zero."""
    seconds = after.at - before.at
    services: dict[VSKey, Rates] = {}
    dests: dict[tuple[VSKey, RSKey], Rates] = {}
    for key, now in after.traffic.items():
        then = before.traffic.get(key, Traffic())
        services[key] = rate(then.counters, now.counters, seconds)
        for rs, dest in now.dests.items():
            old = then.dests.get(rs)
            dests[key, rs] = rate(old.counters if old else Counters(), dest.counters, seconds)
    return services, dests
