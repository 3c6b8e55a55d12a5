"""What the proxier does about operations the kernel refused: serve the Service anyway, and
retry the rest one object at a time, with backoff.

Owns: `Refusals` and `Failing`.

- `Refusals`: a virtual server whose add or update the kernel refuses for its settings (a
  scheduler whose module this kernel lacks: `Unsupported`, from ENOENT; a flag or value it
  rejects) is served with plain settings instead: the node's default scheduler, persistence
  kept. Found out once, by the first refusal: the refused settings are remembered for that
  virtual server (tried again only when its desired settings change), and a scheduler
  refused on its own is known missing for every other Service from then on. Each
  substitution is a warning naming the Service. kube-proxy's IPVS mode logs the failed add
  and leaves the Service unserved on every sync; this is the difference.
- `Failing`: any other failed operation is retried for its virtual server alone, 1, 2, 4 ...
  seconds after the failure (at most `cap`), instead of holding up every sync or failing
  the node's health.

Imports: model, schedulers, errors, the standard library.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ipvsproxy.backoff import Backoff
from ipvsproxy.errors import AlreadyExists, NotFound
from ipvsproxy.kernel import Failure
from ipvsproxy.model import (
    AddService,
    IpvsState,
    Op,
    ServiceFlags,
    UpdateService,
    VirtualServer,
    VSKey,
)
from ipvsproxy.schedulers import Scheduler

_KEPT = ServiceFlags.PERSISTENT  # ClientIP affinity: the one flag a plain server keeps


@dataclass
class Refusals:
    """Settings the kernel refused, per virtual server, and schedulers it lacks."""

    default: Scheduler
    _refused: dict[VSKey, tuple[VirtualServer, VirtualServer]] = field(default_factory=dict)
    _missing: dict[Scheduler, str] = field(default_factory=dict)  # -> the kernel's answer
    _notes: dict[VSKey, str] = field(default_factory=dict)  # warnings of current substitutes

    def record(self, failures: Iterable[Failure], names: Mapping[VSKey, str]) -> set[VSKey]:
        """Remember the refusals among `failures`; the virtual servers to retry at once
        (with their substitutes). Failures with nothing plainer to fall back to are not
        refusals: they are retried with backoff like any other."""
        retry: set[VSKey] = set()
        for failure in failures:
            op, error = failure.op, failure.error
            if not isinstance(op, AddService | UpdateService):
                continue
            if isinstance(error, NotFound | AlreadyExists):
                continue  # the table is not what this process believed: not a refusal
            vs, plain = op.vs, self.plain(op.vs)
            if plain == vs:
                continue
            if vs.scheduler != plain.scheduler and vs.flags & ~_KEPT == plain.flags & ~_KEPT:
                self._missing.setdefault(vs.scheduler, str(error))  # only the scheduler differs
            self._refused[vs.key] = (vs, plain)
            self._notes[vs.key] = (
                f"{names.get(vs.key, str(vs.key))}: the kernel refused {_describe(vs)} "
                f"({error}): served with {_describe(plain)} instead"
            )
            retry.add(vs.key)
        return retry

    def plain(self, vs: VirtualServer) -> VirtualServer:
        return VirtualServer(vs.key, self.default, vs.flags & _KEPT, vs.timeout_s)

    def served(self, state: IpvsState, names: Mapping[VSKey, str], *, whole: bool) -> IpvsState:
        """`state` with every refused virtual server replaced by what is served instead.
        `whole`: the state is the whole desired table (forget notes of the others)."""
        if whole:
            self._notes = {k: v for k, v in self._notes.items() if k in state.services}
        if not self._refused and not self._missing:
            return state
        services: dict[VSKey, VirtualServer] | None = None
        for key, vs in state.services.items():
            served = self._substitute(vs, names)
            if served is not vs:
                if services is None:
                    services = dict(state.services)
                services[key] = served
        return state if services is None else replace(state, services=services)

    def serving(self, state: IpvsState) -> IpvsState:
        """What `served()` would serve for `state`, changing nothing: for readers outside
        the pass (`status`), which must not move the pass's notes or forget a refusal."""
        if not self._refused and not self._missing:
            return state
        services = dict(state.services)
        for key, vs in state.services.items():
            refused = self._refused.get(key)
            if refused is not None and refused[0] == vs:
                services[key] = refused[1]
            elif vs.scheduler in self._missing:
                services[key] = replace(vs, scheduler=self.default)
        return replace(state, services=services)

    def _substitute(self, vs: VirtualServer, names: Mapping[VSKey, str]) -> VirtualServer:
        refused = self._refused.get(vs.key)
        if refused is not None:
            if refused[0] == vs:
                return refused[1]
            del self._refused[vs.key]  # other settings wanted now: tried as they are
            self._notes.pop(vs.key, None)
        answer = self._missing.get(vs.scheduler)
        if answer is None:
            return vs
        plain = replace(vs, scheduler=self.default)
        self._notes[vs.key] = (
            f"{names.get(vs.key, str(vs.key))}: scheduler {vs.scheduler} is not available "
            f"in this kernel ({answer}): served with {self.default} instead"
        )
        return plain

    def warnings(self) -> tuple[str, ...]:
        return tuple(sorted(self._notes.values()))


def _describe(vs: VirtualServer) -> str:
    flags = vs.flags & ~_KEPT
    return f"scheduler {vs.scheduler}" + (f" with flags {flags!r}" if flags else "")


@dataclass
class Failing:
    """Per virtual server: how many passes in a row failed it, when to try again, and the
    operations its last attempt could not do (what it still lacks: `undone`)."""

    policy: Backoff  # the wait after each failure in a row
    clock: Callable[[], float] = time.monotonic
    _failing: dict[VSKey, tuple[int, float]] = field(default_factory=dict)
    _undone: dict[VSKey, tuple[Op, ...]] = field(default_factory=dict)

    def settle(
        self, looked: Iterable[VSKey] | None, failed: Mapping[VSKey, Sequence[Op]]
    ) -> set[VSKey]:
        """After a pass that looked at `looked` (None: at everything): the keys of `failed`
        (each with the operations that failed for it) wait longer (by the policy: 1, 2, 4 ...
        s after this failure), the others that were failing are forgotten and returned
        (recovered)."""
        candidates = self._failing.keys() if looked is None else looked
        recovered = {key for key in candidates if key in self._failing and key not in failed}
        for key in recovered:
            del self._failing[key]
            self._undone.pop(key, None)
        now = self.clock()
        for key, ops in failed.items():
            count = self._failing.get(key, (0, 0.0))[0] + 1
            self._failing[key] = (count, now + self.policy.delay(count))
            self._undone[key] = tuple(ops)
        return recovered

    def undone(self) -> tuple[Op, ...]:
        """The operations the last attempt of each failing virtual server could not do."""
        return tuple(op for ops in self._undone.values() for op in ops)

    def due(self) -> set[VSKey]:
        now = self.clock()
        return {key for key, (_, at) in self._failing.items() if at <= now}

    def next_in(self) -> float | None:
        """Seconds until the next retry is due (None: nothing failing)."""
        if not self._failing:
            return None
        return max(0.0, min(at for _, at in self._failing.values()) - self.clock())

    def __contains__(self, key: object) -> bool:
        return key in self._failing

    def __len__(self) -> int:
        return len(self._failing)
