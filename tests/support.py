"""Helpers shared by the unit and real-kernel tests.

`Synced` drives the product's own pass (proxier.Proxier, as `diff`, `run --once` and the
agent do) from lists of raw objects, the way the agent's watchers feed it: through a Tracker.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ipvsproxy.proxier import PassResult, Proxier
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, Tracker


@dataclass
class Synced:
    """A proxier fed from lists of raw objects: each `sync()` hands over the whole list (what
    is missing from it is gone) and runs one pass."""

    proxier: Proxier
    tracker: Tracker = field(init=False)

    def __post_init__(self) -> None:
        self.tracker = Tracker(node_name=self.proxier.config.node_name)

    def feed(self, objects: Sequence[Mapping[str, Any]]) -> None:
        for kind in (SERVICE, SLICE, NODE):
            self.tracker.replace(kind, [o for o in objects if o.get("kind") == kind])

    def sync(self, objects: Sequence[Mapping[str, Any]], *, full: bool = True) -> PassResult:
        self.feed(objects)
        return self.proxier.sync(self.tracker.take(), full=full)
