"""--config against hostile and unlucky files (issue 28, item 7): one set of checks for flags
and the file, durations capped, and for any YAML or JSON shape a Loaded value or one
ConfigError line naming the file (and the field), never a traceback."""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ipvsproxy import agent, kpconfig
from ipvsproxy.cli import main
from ipvsproxy.errors import ConfigError

HEAD = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"


def run(monkeypatch, *args: str) -> Any:
    """`ipvsproxy run ARGS` with the agent replaced: what the CLI makes of its input."""
    monkeypatch.setattr(agent, "run", lambda config, *, source: None)
    monkeypatch.delenv("NODE_NAME", raising=False)
    return CliRunner().invoke(main, ["run", *args])


def one_line_error(result: Any, *fragments: str) -> None:
    assert result.exit_code == 2, (result.output, result.exception)
    assert "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr


def refused(result: Any, fragment: str) -> None:
    """A flag click refuses: exit 2, its usage and one error line naming it."""
    assert result.exit_code == 2, (result.output, result.exception)
    assert "Traceback" not in result.output
    assert fragment in result.stderr


def test_an_empty_int_tag_is_one_line_naming_the_file(monkeypatch, tmp_path):
    path = tmp_path / "kp.yaml"
    path.write_text(HEAD + "conntrack:\n  min: !!int ''\n")
    one_line_error(run(monkeypatch, "--config", str(path)), f"--config {path}: ")


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_a_config_nested_100k_deep_is_one_line(monkeypatch, tmp_path, suffix):
    path = tmp_path / f"kp{suffix}"
    path.write_text("[" * 100_000 + "]" * 100_000)
    one_line_error(run(monkeypatch, "--config", str(path)), f"--config {path}: ")


@pytest.mark.timeout(10)
def test_a_fifo_as_config_is_refused_by_name(monkeypatch, tmp_path):
    path = tmp_path / "kp.yaml"
    os.mkfifo(path)
    one_line_error(run(monkeypatch, "--config", str(path)), f"{path}: not a regular file (a FIFO)")


def test_an_alias_bomb_as_config_is_refused(monkeypatch, tmp_path):
    lines = [HEAD.rstrip(), "x0: &a0 [x]"]
    lines += [f"x{n}: &a{n} [{', '.join([f'*a{n - 1}'] * 10)}]" for n in range(1, 10)]
    path = tmp_path / "kp.yaml"
    path.write_text("\n".join(lines) + "\n")
    one_line_error(run(monkeypatch, "--config", str(path)), "alias")


@pytest.mark.parametrize(
    ("field", "flag", "value"),
    [
        ("syncPeriod", "--sync-period", "99999999999h"),
        ("minSyncPeriod", "--min-sync-period", "99999999999h"),
        ("tcpTimeout", "--tcp-timeout", "10000h"),
        ("udpTimeout", "--udp-timeout", "1" + "0" * 300 + "s"),
    ],
)
def test_durations_are_capped_in_the_flag_and_the_file(monkeypatch, tmp_path, field, flag, value):
    one_line_error(run(monkeypatch, "--manifests", str(tmp_path), flag, value), flag, "longer than")
    path = tmp_path / "kp.yaml"
    path.write_text(HEAD + f"ipvs:\n  {field}: {value!r}\n")
    one_line_error(
        run(monkeypatch, "--manifests", str(tmp_path), "--config", str(path)),
        f"--config {path}: field ipvs.{field}: ",
        "longer than",
    )


def test_conntrack_counts_are_capped_in_the_flag_and_the_file(monkeypatch, tmp_path):
    refused(run(monkeypatch, "--conntrack-min", str(2**40)), "--conntrack-min")
    path = tmp_path / "kp.yaml"
    path.write_text(HEAD + f"conntrack:\n  maxPerCore: {2**40}\n")
    one_line_error(
        run(monkeypatch, "--config", str(path)), f"--config {path}: field conntrack.maxPerCore"
    )


def test_the_masquerade_bit_from_the_file_is_checked_as_the_flag(monkeypatch, tmp_path):
    refused(run(monkeypatch, "--masquerade-bit", "99"), "--masquerade-bit")
    path = tmp_path / "kp.yaml"
    path.write_text(HEAD + "iptables:\n  masqueradeBit: 99\n")
    one_line_error(
        run(monkeypatch, "--config", str(path)), f"--config {path}: field iptables.masqueradeBit"
    )


# Any shape: YAML's own scalars (dates, binary, sets) included, and the fields the loader
# knows as keys so that random trees reach the checks of real fields.
KNOWN = sorted({name for _, name in kpconfig.MEANINGFUL} | {name for _, name in kpconfig.IGNORED})
KEYS = st.sampled_from(KNOWN + sorted(kpconfig.SECTIONS)) | st.text(max_size=5)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([0, -1, 14, 31, 32, 99, 2**31, 2**64, 10**30])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["30s", "0s", "1m30s", "99999999999h", "1e300s", "ipvs", "rr", "json",
                       "10.0.0.0/8", "0.0.0.0:10256", "primary", "", "-1s", "nan"])
    | st.just(dt.date(2024, 1, 1))
    | st.just(b"\x00")
)  # fmt: skip
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=4),
    max_leaves=12,
)
DOCS = (
    st.fixed_dictionaries(
        {"apiVersion": st.just(kpconfig.API_VERSION), "kind": st.just(kpconfig.KIND)},
        optional={
            "mode": st.sampled_from(["", "ipvs", "iptables"]) | SCALARS,
            **{
                section: st.dictionaries(KEYS, VALUES, max_size=4) | VALUES
                for section in sorted(kpconfig.SECTIONS)
            },  # fmt: skip
        },
    )
    | st.dictionaries(KEYS, VALUES, max_size=4)
    | VALUES
)


def loads_or_refuses(path: Path) -> None:
    try:
        loaded: object = kpconfig.load(path)
    except ConfigError as exc:  # anything else fails the test
        loaded = str(exc)
    if isinstance(loaded, str):
        assert loaded.startswith(f"--config {path}: "), loaded
        assert "\n" not in loaded
    else:
        assert isinstance(loaded, kpconfig.Loaded)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=DOCS, as_json=st.booleans())
@example(  # found by the property: a field's name with a newline made a two-line error
    doc={"apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
         "clientConnection": {"\n": None}},
    as_json=False,
)  # fmt: skip
@example(doc={"apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
              "kind": "KubeProxyConfiguration", "x\ny": 1}, as_json=True)  # fmt: skip
def test_any_shape_loads_or_is_one_config_error(tmp_path_factory, doc, as_json):
    folder = tmp_path_factory.mktemp("kp")
    if as_json:
        path = folder / "kp.json"
        path.write_text(json.dumps(doc, default=str))
    else:
        path = folder / "kp.yaml"
        path.write_text(yaml.safe_dump(doc))
    loads_or_refuses(path)


YAMLISH = st.text(alphabet="{}[]:,-!&*#'\"\n \t0123456789abefkilnstx.?|>%@`+_:^~", max_size=60)


@settings(max_examples=300, deadline=None)
@given(text=YAMLISH | st.sampled_from(["a: !!int ''", "a: !!timestamp 2020-02-30", "a: !!float x"]))
@example(text="?")  # a null key: its name in the error is "None", not a crash
@example(text="1: x")  # an int key
def test_any_text_loads_or_is_one_config_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("kp") / "kp.yaml"
    path.write_text(HEAD + text)
    loads_or_refuses(path)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=DOCS)
def test_any_shape_through_the_cli_runs_or_exits_2_in_one_line(tmp_path_factory, doc):
    """The values kpconfig lets through meet their flags' checks: exit 0, or 2 and one line
    naming the file; never a traceback."""
    folder = tmp_path_factory.mktemp("kp")
    path = folder / "kp.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.MonkeyPatch.context() as monkeypatch:
        result = run(monkeypatch, "--manifests", str(folder), "--config", str(path))
    if result.exit_code == 0:
        return
    one_line_error(result, f"--config {path}: ")
