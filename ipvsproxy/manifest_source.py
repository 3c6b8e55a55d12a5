"""The manifest source: objects from files on disk instead of the API, re-read when the files
change.

Owns: `ManifestSource`. It feeds the same `Tracker` as the API watchers do, so `run
--manifests` is the same agent with no cluster at all. Files are polled (name, mtime, size);
a change that does not parse is logged and the last good objects stay in force.

Imports: manifests, api (types), sync.tracker, errors.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ipvsproxy import manifests
from ipvsproxy.api import RawJson, RawObject
from ipvsproxy.errors import ConfigError
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, Tracker

log = logging.getLogger(__name__)


class ManifestSource:
    def __init__(
        self,
        paths: Sequence[Path],
        *,
        sink: Tracker,
        stop: threading.Event,
        interval: float = 1.0,
    ) -> None:
        self._paths = tuple(paths)
        self._sink = sink
        self._stop = stop
        self._interval = interval
        self._seen: tuple[Any, ...] | None = None

    def load(self, *, quiet: bool = False) -> None:
        """Read every file and replace the tracker's view; ConfigError if unreadable."""
        seen = manifests.fingerprint(self._paths)
        objects = manifests.items(self._paths)
        by_kind: dict[str, list[RawObject | RawJson]] = defaultdict(list)
        for obj in objects:
            by_kind[obj.kind if isinstance(obj, RawJson) else str(obj.get("kind"))].append(obj)
        for kind in (SERVICE, SLICE, NODE):
            self._sink.replace(kind, by_kind.get(kind, []))
        self._seen = seen
        if not quiet:
            log.info("read %d objects from %s", len(objects), ", ".join(map(str, self._paths)))

    def run(self) -> None:
        """Poll for changes until stopped."""
        last_error = ""
        while not self._stop.wait(self._interval):
            try:
                current = manifests.fingerprint(self._paths)
                if current != self._seen:
                    self._seen = current  # a bad edit is reported once, not every poll
                    self.load()
                last_error = ""
            except ConfigError as exc:
                if str(exc) != last_error:
                    log.error("manifests not reloaded, keeping the last good ones: %s", exc)
                last_error = str(exc)
