"""Whether this node still follows the API server: when each resource was last read.

Owns `Following`: the watchers record every successful read of their resource (a list, a watch
stream opened, an event or bookmark) and every failed attempt; readers (`/healthz`, `/readyz`,
the metrics) get an `Unread` snapshot. A quiet API is not an unread one: a watch stream that is
open reads nothing until something changes, and it follows until an attempt fails (a refused
token, a connection lost, an inactivity timeout): the count starts at the first failure since
the last read, so a silent stream timed out and opened again at once was never unread.

A node that cannot read the API keeps its rules and serves traffic with them, but no longer
follows Service and endpoint changes. Past `bound` seconds (counted from the first full pass:
before it, `/readyz` already says what the node waits for) that is said once, as a warning
(`on_stale`), and when the resource is read again once more (`on_recovered`).

Imports: the standard library only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Unread:
    """A resource failing for `seconds` (from its first failed attempt since it was last read,
    at `last_read` wall-clock seconds; from the first full pass at the earliest), the last
    attempt failing with `error`."""

    kind: str
    seconds: float
    last_read: float | None
    error: str
    stale: bool  # longer than the bound


class Following:
    """The watchers' reads and failures per resource; see the module's docstring."""

    def __init__(
        self,
        *,
        bound: float,
        clock: Callable[[], float] = time.time,
        on_stale: Callable[[Unread], None] = lambda unread: None,
        on_recovered: Callable[[str, float], None] = lambda kind, seconds: None,
    ) -> None:
        self.bound = bound
        self._clock = clock
        self._on_stale = on_stale
        self._on_recovered = on_recovered
        self._lock = threading.Lock()
        self._read: dict[str, float] = {}  # kind -> when it was last read
        self._failing: dict[str, str] = {}  # kind -> the error of its last attempt
        self._since: dict[str, float] = {}  # kind -> its first failure since its last read
        self._served: float | None = None  # when the first full pass completed
        self._warned: set[str] = set()  # kinds whose staleness has been said

    def read(self, kind: str) -> None:
        """`kind` was read from the API: a list, a stream opened, an event."""
        now = self._clock()
        with self._lock:
            since = self._start(kind, now)  # before this read
            self._read[kind] = now
            self._failing.pop(kind, None)
            self._since.pop(kind, None)
            warned = kind in self._warned
            self._warned.discard(kind)
        if warned:
            self._on_recovered(kind, now - since)

    def failed(self, kind: str, error: str) -> None:
        """An attempt to read `kind` failed with `error`."""
        with self._lock:
            self._failing[kind] = error
            self._since.setdefault(kind, self._clock())
        self.check()

    def served(self) -> None:
        """The first full pass completed: the bound counts from here at the earliest."""
        with self._lock:
            if self._served is None:
                self._served = self._clock()
        self.check()

    def unread(self) -> Unread | None:
        """The resource unread the longest, if any attempt of one is failing now. A stale one
        seen here is said first (`check`): no reader shows staleness the log has not said."""
        found = self._unread()
        self._warn(found)
        return max(found, key=lambda u: u.seconds, default=None)

    def check(self) -> None:
        """Say once per outage that a resource has been unread for longer than the bound."""
        self._warn(self._unread())

    def _warn(self, found: list[Unread]) -> None:
        for unread in found:
            if not unread.stale:
                continue
            with self._lock:
                if unread.kind in self._warned:
                    continue
                self._warned.add(unread.kind)
            self._on_stale(unread)

    def _unread(self) -> list[Unread]:
        now = self._clock()
        with self._lock:
            found = []
            for kind, error in self._failing.items():
                seconds = now - self._start(kind, now)
                stale = self._served is not None and seconds > self.bound
                found.append(Unread(kind, seconds, self._read.get(kind), error, stale))
            return found

    def _start(self, kind: str, now: float) -> float:
        """Since when `kind` counts as unread (under the lock): its first failure since its
        last read, or the first full pass if that came later; now if it is not failing."""
        since = self._since.get(kind)
        if since is None:
            return now
        return max(since, self._served) if self._served is not None else since
