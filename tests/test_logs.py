"""The log formats (ipvsproxy/logs.py): RFC 3339 times with milliseconds in both, and in JSON
one object a line with the record's extra fields."""

from __future__ import annotations

import io
import json
import logging
import re
import sys
from collections.abc import Iterator

import pytest

from ipvsproxy import logs
from ipvsproxy.errors import ConfigError

RFC3339_MS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def record(msg: str = "hello %s", *args: object, **extra: object) -> logging.LogRecord:
    rec = logging.makeLogRecord(
        {"name": "ipvsproxy.sync", "levelno": logging.DEBUG, "levelname": "DEBUG"}
    )
    rec.msg, rec.args, rec.created = msg, args or ("world",), 1795661701.1234
    rec.__dict__.update(extra)
    return rec


def test_json_has_rfc3339_millisecond_time_level_logger_msg_and_the_extra_fields():
    line = logs.JsonFormatter().format(
        record(service="demo/web:http", vip="10.96.0.10", port=80, op="add-dest")
    )
    entry = json.loads(line)
    assert entry == {
        "time": "2026-11-26T02:55:01.123Z",
        "level": "debug",
        "logger": "ipvsproxy.sync",
        "msg": "hello world",
        "service": "demo/web:http",
        "vip": "10.96.0.10",
        "port": 80,
        "op": "add-dest",
    }


def test_an_extra_field_never_replaces_a_standard_one_and_odd_values_become_strings():
    entry = json.loads(logs.JsonFormatter().format(record(level="forged", error=ValueError("x"))))
    assert entry["level"] == "debug"
    assert entry["error"] == "x"


def test_json_carries_the_traceback():
    try:
        raise RuntimeError("a bug")
    except RuntimeError:
        rec = logging.LogRecord("ipvsproxy", logging.ERROR, __file__, 1, "boom", (), sys.exc_info())
    entry = json.loads(logs.JsonFormatter().format(rec))
    assert entry["msg"] == "boom"
    assert "RuntimeError: a bug" in entry["exc"]


def test_text_is_rfc3339_with_milliseconds_then_level_then_message():
    line = logs.TextFormatter().format(record(service="demo/web:http"))
    assert line == "2026-11-26T02:55:01.123Z DEBUG hello world"


@pytest.mark.usefixtures("restore_root")
def test_configure_then_set_format_switch_what_is_written():
    out = io.StringIO()
    logs.configure("debug", "text", stream=out)
    logging.getLogger("ipvsproxy.test").debug("one", extra={"op": "add-service"})
    logs.set_format("json")
    logging.getLogger("ipvsproxy.test").info("two", extra={"op": "delete-service"})
    first, second = out.getvalue().splitlines()
    stamp, level, msg = first.split(" ", 2)
    assert RFC3339_MS.match(stamp)
    assert (level, msg) == ("DEBUG", "one")
    entry = json.loads(second)
    assert RFC3339_MS.match(entry["time"])
    assert (entry["level"], entry["msg"], entry["op"]) == ("info", "two", "delete-service")
    assert logging.getLogger("urllib3").level == logging.WARNING


def test_an_unknown_format_is_a_config_error():
    with pytest.raises(ConfigError, match="expected text or json"):
        logs.set_format("yaml")
