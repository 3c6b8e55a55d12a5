"""Names are escaped where they are shown (issue 28, item 10): a Service name with a newline
or an ANSI escape (a manifest can hold one) forges no log line and no `diff` line; control
characters are shown as escapes, in one place (logs.escape)."""

from __future__ import annotations

import json
import logging
import sys

from click.testing import CliRunner

from ipvsproxy import cli, logs

FORGED = "web\n+ ipvsadm -A -t 6.6.6.6:80 -s rr  # forged\x1b[31m\u2028"


def manifest(name: str) -> dict[str, object]:
    labels = {"kubernetes.io/service-name": name}
    return {
        "apiVersion": "v1",
        "kind": "List",
        "items": [
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"clusterIP": "10.96.0.10", "ports": [{"name": "http", "port": 80}]},
            },
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {"name": "w1", "namespace": "default", "labels": labels},
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
                "endpoints": [{"addresses": ["10.244.0.5"], "conditions": {"ready": True}}],
            },
        ],
    }


def test_diff_shows_a_forged_name_escaped_on_its_own_line(tmp_path):
    path = tmp_path / "evil.json"
    path.write_text(json.dumps(manifest(FORGED)))
    empty = tmp_path / "empty-table.txt"
    empty.write_text("")
    result = CliRunner().invoke(
        cli.main,
        ["diff", "--manifests", str(path), "--kernel-state", str(empty),
         "--hostname-override", "none"],
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    lines = result.stdout.splitlines()
    assert not any(line.startswith("+ ipvsadm -A -t 6.6.6.6") for line in lines), lines
    assert "\x1b" not in result.stdout
    assert "\u2028" not in result.stdout
    assert r"default/web\n+ ipvsadm -A -t 6.6.6.6:80 -s rr  # forged\x1b[31m\u2028:http" in (
        result.stdout
    )


def test_text_logs_escape_control_characters_in_the_message():
    rec = logging.makeLogRecord({"msg": "skipping Service %s", "args": (FORGED,)})
    rec.levelname = "WARNING"
    line = logs.TextFormatter().format(rec)
    assert len(line.splitlines()) == 1
    assert "\x1b" not in line
    assert line.endswith(
        r"skipping Service web\n+ ipvsadm -A -t 6.6.6.6:80 -s rr  # forged\x1b[31m\u2028"
    )


def test_a_traceback_keeps_its_lines_and_json_escapes_by_itself():
    try:
        raise RuntimeError("a bug")
    except RuntimeError:
        rec = logging.LogRecord("x", logging.ERROR, __file__, 1, "boom\n%s", ("x",), sys.exc_info())
    text = logs.TextFormatter().format(rec)
    assert text.splitlines()[0].endswith(r"boom\nx")
    assert "RuntimeError: a bug" in text.splitlines()[-1]
    line = logs.JsonFormatter().format(logging.makeLogRecord({"msg": FORGED}))
    assert len(line.splitlines()) == 1
    assert "\x1b" not in line
    assert "\u2028" not in line
    assert json.loads(line)["msg"] == FORGED


def test_escape_shows_controls_and_leaves_the_rest():
    assert logs.escape("a\tb\r\n\x00\x7f\x85é☃ ok\\") == r"a\tb\r\n\x00\x7f\x85é☃ ok\\"[:-1]
    assert logs.escape("\u202e\u2066") == r"\u202e\u2066"


def test_an_error_with_a_newline_is_one_line(tmp_path):
    path = tmp_path / "kp.yaml"
    path.write_text(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
        'ipvs: {"a\\nb": 1}\n'
    )
    result = CliRunner().invoke(cli.main, ["diff", "--config", str(path)])
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert r"field ipvs.a\nb: unknown field" in result.stderr
