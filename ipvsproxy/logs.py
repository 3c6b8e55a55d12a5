"""The process's log output: one handler on stderr, as text or as one JSON object a line.

Owns: `configure(level, fmt)` (the CLI calls it once, before anything logs), `set_format(fmt)`
(a configuration file's `logging.format` switches it later), `TextFormatter`, `JsonFormatter`,
`error_line(text)` (the CLI's last line on an error, in the log's format), `Verbosity` and
`set_verbosity(n)` (klog's `--v`: info records logged with `extra={"v": N}` need N or more).
docs/logging.md lists the fields.

Text lines escape control characters (`escape()`): a name from input forges no line.
Both formats stamp RFC 3339 times in UTC with milliseconds (2026-11-26T02:55:01.123Z). A
record's facts are passed with logging's `extra=` (e.g. `service`, `vip`, `op`, `error`): the
JSON format writes each as a field of its own, the text format shows only the message, which
the code logging it words to say the same facts.

Imports: errors, the standard library.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

from ipvsproxy.errors import ConfigError

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")
# Libraries whose debug lines would drown ours: at warning or above, whatever our level.
NOISY = ("urllib3", "kubernetes")

# What every LogRecord has of its own; anything else on a record came with `extra=`.
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


# Control characters (C0, DEL, C1), the Unicode line and paragraph separators and the
# bidirectional overrides: what could end a line, move the cursor or reorder the text shown.
_SHOWN = {
    **{c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)]},
    **{ord(c): e for c, e in (("\t", "\\t"), ("\n", "\\n"), ("\r", "\\r"))},
    **{c: f"\\u{c:04x}" for c in [0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]},
}


def escape(text: str) -> str:
    """`text` with its control characters as escapes (\\n, \\x1b, \\u2028), so that text from
    input (a Service name in a manifest) cannot forge a line or colour a terminal. The one
    implementation: the text log format, `diff`'s text output and the CLI's error lines use it
    (JSON escapes by itself)."""
    return text.translate(_SHOWN)


class Verbosity(logging.Filter):
    """klog's verbosity for records at info: one logged with `extra={"v": N}` is written only
    when the verbosity (`--v`, or `logging.verbosity` of `--config`) is N or more, as
    kube-proxy's `klog.V(N).Info` (its per-sync line is V(2)). Records without `v` pass."""

    level = 0

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "v", 0) <= Verbosity.level


def set_verbosity(verbosity: int) -> None:
    """`--v N`: records of verbosity up to N are written; 4 or more also means debug."""
    Verbosity.level = verbosity
    if verbosity >= 4:
        logging.getLogger().setLevel(logging.DEBUG)


def configure(level: str, fmt: str, *, stream: TextIO | None = None) -> None:
    """Log records at `level` and above to `stream` (stderr) in format `fmt` (text or json),
    replacing any handler set before."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(formatter(fmt))
    handler.addFilter(Verbosity())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    set_level(level)


def set_level(level: str) -> None:
    """Log records at `level` and above (the libraries in NOISY: warning and above, whatever
    the level)."""
    logging.getLogger().setLevel(level.upper())
    for name in NOISY:
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))


def set_format(fmt: str) -> None:
    """Switch every handler of the root logger to format `fmt` (text or json)."""
    chosen = formatter(fmt)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(chosen)


def error_line(text: str) -> str:
    """The line a command ends with on an error: `ipvsproxy: error: TEXT` (escaped), or,
    while the log format is json, one JSON object as a log record's (level error), so that
    a collector parsing the log reads it too."""
    if any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers):
        record = logging.makeLogRecord(
            {"name": "ipvsproxy", "levelno": logging.ERROR, "levelname": "ERROR", "msg": text}
        )
        return JsonFormatter().format(record)
    return f"ipvsproxy: error: {escape(text)}"


def formatter(fmt: str) -> logging.Formatter:
    if fmt not in FORMATS:
        raise ConfigError(f"logging.format {fmt!r}: expected text or json")
    return JsonFormatter() if fmt == "json" else TextFormatter()


def timestamp(record: logging.LogRecord) -> str:
    """RFC 3339, UTC, milliseconds: 2026-11-26T02:55:01.123Z."""
    when = datetime.fromtimestamp(record.created, tz=UTC)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def fields(record: logging.LogRecord) -> dict[str, Any]:
    """The facts a record carries beyond the standard attributes (its `extra=`)."""
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD}


class TextFormatter(logging.Formatter):
    """`2026-11-26T02:55:01.123Z INFO message` (and a traceback, if any), the message's
    control characters escaped: one record, one line (a traceback's own lines follow it)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802
        record.message = escape(record.message)
        return super().formatMessage(record)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        return timestamp(record)


class JsonFormatter(logging.Formatter):
    """`{"time", "level", "logger", "msg"}`, the record's extra fields, and `exc` (a
    traceback) when there is one. An extra field never replaces one of the four."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in fields(record).items():
            entry.setdefault(key, value)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)
