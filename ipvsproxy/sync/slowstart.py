"""Slow start: a newly serving endpoint's weight ramps from 1 to full over a window.

Owns: the annotation (`ipvsproxy.io/slow-start: <duration>`) and its reading (`window_of`),
the weight of a slow-start Service's destinations (`FULL_WEIGHT`), the ramp's steps
(`ramp_weight`), and `SlowStart`, the agent's ramps in progress (`ramps()` for a reader).

The translation stays pure: a Service with a window gets its destinations at
`FULL_WEIGHT` (10, not 1: a ramp needs room below full) and its window on each virtual
server's entry. The ramp is the time-dependent part, applied by `SlowStart.hold()` to the
desired state of each pass (full or partial), as the drainer holds removed endpoints: it
lowers the weight of each ramping destination to its step's weight.

New is what the table did not serve: a destination missing from the table the pass plans
against (or there at weight 0, draining) while its virtual server already has a
destination of weight > 0. So a Service's first endpoints get full weight at once, a
restarted agent ramps nothing (the kernel's table says what was already serving), and an
endpoint that stops serving and comes back ramps again. A ramp is keyed by virtual server
and destination and lives in this object, not in the table: a full resync reads the
ramp's own weight back from the kernel and goes on with the ramp, neither restarting nor
finishing it.

Steps: `STEPS` equal parts of the window; in part k (0..STEPS-1) the weight is
`max(1, full * k // STEPS)` (1, 2, 4, 6, 8 for full 10), then full. The agent's loop wakes
at each step (`next_in()`), and a partial pass looks at the ramping virtual servers
(`keys()`), as it does at the draining ones.

Imports: config, errors, schedulers, model, the standard library.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ipvsproxy.config import parse_duration
from ipvsproxy.errors import ConfigError
from ipvsproxy.model import IpvsState, RealServer, RSKey, VSKey
from ipvsproxy.schedulers import SCHEDULER_ANNOTATION, Scheduler

SLOW_START_ANNOTATION = "ipvsproxy.io/slow-start"
MAX_WINDOW = 3600.0  # an hour: a longer warm-up is a deployment problem, not a weight's
FULL_WEIGHT = 10  # the weight of every destination of a slow-start Service
STEPS = 5


def window_of(
    annotations: Mapping[str, str], default: float, scheduler: Scheduler, ref: str
) -> tuple[float, str]:
    """A Service's slow-start window in seconds (0: off) and a warning ("" when none).

    The annotation overrides the node-wide default (`0s` turns it off). A bad value is
    off, with a warning naming the Service. With a scheduler that ignores weights it is off
    too, warned about when the Service chose the window or the scheduler itself (the
    node-wide pair is warned about once at start)."""
    text = annotations.get(SLOW_START_ANNOTATION)
    window = default
    if text is not None:
        try:
            window = parse_duration(
                text, option=SLOW_START_ANNOTATION, maximum=MAX_WINDOW, bare_seconds=True
            )
        except ConfigError as exc:
            return 0.0, f"Service {ref}: {exc}; slow start is off"
    if window and not scheduler.honours_weights:
        chosen = text is not None or SCHEDULER_ANNOTATION in annotations
        return 0.0, f"Service {ref}: {ignored(scheduler)}; slow start is off" if chosen else ""
    return window, ""


def ignored(scheduler: Scheduler) -> str:
    """Why slow start is off with this scheduler."""
    honouring = ", ".join(s.value for s in Scheduler if s.honours_weights)
    return (
        f"slow start has no effect with scheduler {scheduler}, which ignores weights "
        f"(it needs one of {honouring})"
    )


def ramp_weight(full: int, elapsed: float, window: float) -> int:
    """The weight `elapsed` seconds into a ramp to `full` over `window` (full when done)."""
    step = _step(elapsed, window)
    return full if step >= STEPS else max(1, full * step // STEPS)


def _step(elapsed: float, window: float) -> int:
    """The step `elapsed` seconds into a window: 0 .. STEPS (done). A pass woken at a
    step's time is in that step, whatever the rounding of the clock's arithmetic."""
    return int(STEPS * max(elapsed, 0.0) / window + 1e-9)


@dataclass(frozen=True, slots=True)
class Ramp:
    """One destination's ramp, as a reader (`status`) sees it. Times are on the ramp's
    clock (`time.monotonic` in the agent)."""

    key: VSKey
    endpoint: RSKey
    started: float
    ends: float  # when it reaches `target`
    target: int  # the full weight
    weight: int  # the weight asked of the kernel by the last pass


class SlowStart:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._ramps: dict[VSKey, dict[RSKey, Ramp]] = {}

    def keys(self) -> set[VSKey]:
        """The virtual servers with a destination ramping (a partial pass looks at them)."""
        return set(self._ramps)

    def ramps(self) -> tuple[Ramp, ...]:
        """Every ramp in progress, by virtual server and destination."""
        return tuple(
            ramp for key in sorted(self._ramps) for _, ramp in sorted(self._ramps[key].items())
        )

    def next_in(self) -> float | None:
        """Seconds until the next step of any ramp (None: nothing ramps)."""
        now, soonest = self._clock(), math.inf
        for ramp in (r for ramps in self._ramps.values() for r in ramps.values()):
            window = ramp.ends - ramp.started
            step = _step(now - ramp.started, window) + 1
            soonest = min(soonest, ramp.started + window * step / STEPS - now)
        return None if soonest == math.inf else max(soonest, 0.0)

    def hold(
        self, desired: IpvsState, observed: IpvsState, windows: Mapping[VSKey, float]
    ) -> IpvsState:
        """The desired state with each ramping destination at its step's weight.

        `windows`: the slow-start window of each virtual server that has one (a partial
        pass's desired state holds every ramping virtual server: what it does not hold is
        gone, and so is its ramp)."""
        if not windows and not self._ramps:
            return desired
        now = self._clock()
        ramps: dict[VSKey, dict[RSKey, Ramp]] = {}
        for key in windows.keys() & desired.dests.keys():  # walks the smaller of the two
            found = self._ramps_of(key, desired.dests[key], observed, windows[key], now)
            if found:
                ramps[key] = found
        self._ramps = ramps
        if not ramps:
            return desired
        dests = dict(desired.dests)
        for key, found in ramps.items():
            dests[key] = {
                rk: dataclasses.replace(rs, weight=found[rk].weight) if rk in found else rs
                for rk, rs in desired.dests[key].items()
            }
        return IpvsState(desired.services, dests, desired.bound)

    def _ramps_of(
        self,
        key: VSKey,
        wanted: Mapping[RSKey, RealServer],
        observed: IpvsState,
        window: float,
        now: float,
    ) -> dict[RSKey, Ramp]:
        """The ramps of one virtual server after this pass: those going on, and those of
        destinations new to a virtual server that already serves."""
        have = observed.dests.get(key, {})
        going = self._ramps.get(key, {})
        if not going and (have is wanted or have == wanted):
            return {}  # the steady state: nothing new, nothing ramping
        serving = key in observed.services and any(rs.weight > 0 for rs in have.values())
        out = {}
        for rk, rs in wanted.items():
            ramp = going.get(rk)
            if ramp is None:
                old = have.get(rk)
                if not serving or (old is not None and old.weight > 0):
                    continue  # a first endpoint, or one the table already serves
                ramp = Ramp(key, rk, now, now + window, rs.weight, 1)
            weight = ramp_weight(rs.weight, now - ramp.started, window)
            if weight < rs.weight:
                out[rk] = dataclasses.replace(
                    ramp, ends=ramp.started + window, target=rs.weight, weight=weight
                )
        return out
