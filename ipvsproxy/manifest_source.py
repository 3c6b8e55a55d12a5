"""The manifest source: objects from files on disk instead of the API, re-read when the files
change.

Owns: `ManifestSource`. It feeds the same `Tracker` as the API watchers do, so `run
--manifests` is the same agent with no cluster at all. Files are polled (name, mtime, size)
and each file keeps its last good content: one that stops parsing, dangles (a symbolic link
whose target went, as a ConfigMap volume's links do for a moment), or cannot be read keeps
it, with a warning naming it, until it parses again; one that reads empty (size 0: a write
half done) or is gone from its directory keeps it for one more poll, and is taken as meant
when still so then. A file that parses as an empty List is taken at once. A path given on
the command line that goes, or a directory that cannot be listed, keeps every file's.

Imports: manifests, api (types), sync.tracker, errors.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from ipvsproxy import manifests
from ipvsproxy.api import RawJson, RawObject
from ipvsproxy.errors import ConfigError
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, Tracker

log = logging.getLogger(__name__)

Objects = list[RawObject | RawJson]
Fingerprint = tuple[tuple[str, int, int], ...]


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
        self._seen: Fingerprint | None = None
        self._good: dict[Path, Objects] = {}  # each file's last good objects
        self._doubtful: dict[Path, str] = {}  # "empty" or "gone" at the last poll
        self._warned: dict[Path, str] = {}  # the last warning about each file
        self._last_error = ""

    def load(self, *, quiet: bool = False) -> None:
        """Read every file and replace the tracker's view; ConfigError if any is unreadable."""
        seen = manifests.fingerprint(self._paths)
        self._good = {file: manifests.read(file) for file in manifests.files(self._paths)}
        self._doubtful.clear()
        self._seen = seen
        self._publish(quiet=quiet)

    def run(self) -> None:
        """Poll for changes until stopped."""
        while not self._stop.wait(self._interval):
            self.poll()

    def poll(self) -> None:
        """One look at the files: re-read them if any changed (or one was in doubt)."""
        try:
            current = manifests.fingerprint(self._paths)
            if current == self._seen and not self._doubtful:
                return
            self._seen = current  # a bad edit is reported once, not every poll
            self._reread(current)
            self._last_error = ""
        except ConfigError as exc:
            if str(exc) != self._last_error:
                log.error("manifests not reloaded, keeping the last good ones: %s", exc)
            self._last_error = str(exc)

    def _reread(self, current: Fingerprint) -> None:
        sizes = {Path(name): size for name, _, size in current}
        good: dict[Path, Objects] = {}
        for file in [*sizes, *(file for file in self._good if file not in sizes)]:
            state = "gone" if file not in sizes else "empty" if sizes[file] == 0 else ""
            if not state:
                try:
                    good[file] = manifests.read(file)
                    self._settled(file)
                    continue
                except ConfigError as exc:
                    state = str(exc)
            if state not in ("gone", "empty"):
                self._warn(file, f"{state}; keeping its last good content")
            elif self._doubtful.get(file) == state or file not in self._good:
                self._settled(file)  # still so one poll later (or nothing to keep): meant
                if state == "empty":
                    good[file] = []
                continue
            else:
                self._doubtful[file] = state
                self._warn(file, f"{file}: {state}; keeping its last good content for a poll")
            if file in self._good:
                good[file] = self._good[file]
        self._good = good
        self._publish()

    def _settled(self, file: Path) -> None:
        self._doubtful.pop(file, None)
        self._warned.pop(file, None)

    def _warn(self, file: Path, text: str) -> None:
        if self._warned.get(file) != text:
            log.warning("manifest %s", text)
        self._warned[file] = text

    def _publish(self, *, quiet: bool = False) -> None:
        by_kind: dict[str, Objects] = defaultdict(list)
        count = 0
        for objects in self._good.values():
            count += len(objects)
            for obj in objects:
                kind = obj.kind if isinstance(obj, RawJson) else str(obj.get("kind"))
                by_kind[kind].append(obj)
        for kind in (SERVICE, SLICE, NODE):
            self._sink.replace(kind, by_kind.get(kind, []))
        if not quiet:
            log.info("read %d objects from %s", count, ", ".join(map(str, self._paths)))
