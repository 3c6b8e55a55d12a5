"""Manifest files (manifests.py): YAML and JSON documents, lists and directories read into
objects; a bad file, path or nesting is one clear error naming it, never a silent gap."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from ipvsproxy import cli, manifests
from ipvsproxy.api import RawJson
from ipvsproxy.errors import ConfigError


def test_multi_document_lists_typed_lists_and_directories(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.yaml").write_text(
        "kind: Service\nmetadata: {name: a}\n---\n---\n"
        "apiVersion: v1\nkind: List\nitems:\n- {kind: Node, metadata: {name: n}}\n"
    )
    (tmp_path / "sub" / "b.json").write_text(
        '{"kind": "ServiceList", "items": [{"metadata": {"name": "b"}}]}'
    )
    (tmp_path / "notes.txt").write_text("not a manifest")
    objects = manifests.load([tmp_path])
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("Service", "a"),
        ("Node", "n"),
        ("Service", "b"),
    ]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("kind: Service\n  bad: [indent\n", "invalid YAML"),
        ("- just\n- a list\n", "not a Kubernetes object"),
        ("kind: List\nitems: 3\n", "not a list"),
    ],
)
def test_bad_files_name_the_file(tmp_path, text, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=fragment) as info:
        manifests.load([path])
    assert "bad.yaml" in str(info.value)


def test_missing_path(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        manifests.load([tmp_path / "nope"])


def names(objects):
    return [(o["kind"], o["metadata"]["name"]) for o in objects]


@pytest.mark.parametrize(
    ("doc", "want"),
    [
        ({"kind": "Service", "metadata": {"name": "a"}}, [("Service", "a")]),
        (
            {
                "apiVersion": "v1",
                "kind": "List",
                "items": [
                    {"kind": "Service", "metadata": {"name": "a"}},
                    {"kind": "EndpointSlice", "metadata": {"name": "a-x"}},
                ],
            },
            [("Service", "a"), ("EndpointSlice", "a-x")],
        ),
        (
            {"kind": "EndpointSliceList", "items": [{"metadata": {"name": "s"}}]},
            [("EndpointSlice", "s")],
        ),
        (None, []),
    ],
)
def test_json_files_are_read_as_json_with_the_same_meaning(tmp_path, doc, want):
    path = tmp_path / "objects.json"
    path.write_text(json.dumps(doc, indent=1))
    assert names(manifests.load([path])) == want
    yaml_path = tmp_path / "objects.yaml"  # the same document as YAML reads the same
    yaml_path.write_text(yaml.safe_dump(doc))
    assert names(manifests.load([yaml_path])) == want


def test_json_is_not_parsed_as_yaml(tmp_path, monkeypatch):
    def no_yaml(*args, **kwargs):
        raise AssertionError("YAML parser used for a .json file")

    monkeypatch.setattr(yaml, "load_all", no_yaml)
    path = tmp_path / "s.json"
    path.write_text('\ufeff{"kind": "Service", "metadata": {"name": "a"}}')  # a BOM too
    assert names(manifests.load([path])) == [("Service", "a")]


LIST_SHAPES = {
    "kubectl's List": {
        "kind": "List",
        "items": [
            {"kind": "Service", "metadata": {"name": "a"}, "spec": {"x": [1, 2.5, None, True]}},
            {"kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"k": "v\u00e9"}},
        ],
    },
    "an empty List": {"kind": "List", "items": None},
    "a typed list (items without kind)": {"kind": "ServiceList", "items": [{"metadata": {}}]},
    "a nested List": {"kind": "List", "items": [{"kind": "List", "items": [{"kind": "Node"}]}]},
    "a List with an item not an object": {"kind": "List", "items": [{"kind": "Node"}, 5]},
    "a List of kind not a string": {"kind": 5, "items": []},
    "a single object": {"kind": "Service", "metadata": {"name": "a"}},
}


@pytest.mark.parametrize("doc", LIST_SHAPES.values(), ids=LIST_SHAPES.keys())
@pytest.mark.parametrize("bom", ["", "\ufeff"])
def test_json_list_items_come_as_their_text_and_decode_as_json_reads_them(tmp_path, doc, bom):
    """A JSON List whose items name their kind comes as each item's text (the tracker
    decodes what it reads of it: api.read); every other document as before. Either
    way load() gives what json.loads gives."""
    path = tmp_path / "objects.json"
    path.write_text(bom + json.dumps(doc))
    try:
        want = list(manifests._expand(doc, "x"))
    except ConfigError:
        with pytest.raises(ConfigError, match="objects.json"):
            manifests.load([path])
        return
    assert manifests.load([path]) == want
    items = manifests.items([path])
    listed = isinstance(doc["kind"], str) and doc["kind"] == "List"
    listed = listed and all(isinstance(i, dict) and "kind" in i for i in doc["items"] or ())
    listed = listed and not any(i["kind"].endswith("List") for i in doc["items"] or ())
    assert all(isinstance(i, RawJson) for i in items) == listed
    if listed:
        texts = [i for i in items if isinstance(i, RawJson)]
        assert [(i.kind, json.loads(i.data)) for i in texts] == [(o["kind"], o) for o in want]


def test_an_invalid_json_list_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "objects.json"
    path.write_text('{"kind": "List", "items": [{"kind": "Service"}, NaN')
    with pytest.raises(ConfigError, match="objects.json: invalid JSON"):
        manifests.items([path])


def test_yaml_uses_libyaml_when_present():
    if yaml.__with_libyaml__:
        assert manifests.YAML_LOADER is yaml.CSafeLoader
    else:
        assert manifests.YAML_LOADER is yaml.SafeLoader


def test_pure_python_loader_reads_the_same(tmp_path, monkeypatch):
    path = tmp_path / "a.yaml"
    path.write_text(
        "kind: Service\nmetadata: {name: a, labels: {x: 'on'}}\nspec: {ports: [{port: 080}]}\n"
        "---\nkind: List\nitems:\n- {kind: Node, metadata: {name: n}}\n"
    )
    fast = manifests.load([path])
    monkeypatch.setattr(manifests, "YAML_LOADER", yaml.SafeLoader)
    assert manifests.load([path]) == fast
    # YAML 1.1 as PyYAML reads it either way: 'on' quoted stays a string, 080 is a number
    assert fast[0]["metadata"]["labels"] == {"x": "on"}


TOO_DEEP = "nested deeper than 1000|exceeded maximum nesting depth"


def _nested_lists(depth: int) -> str:
    """A Service inside `depth` nested Lists, as JSON text."""
    inner = '{"kind": "Service", "metadata": {"name": "deep"}}'
    return '{"kind": "List", "items": [' * depth + inner + "]}" * depth


@pytest.mark.parametrize(
    ("name", "content", "fragment"),
    [
        ("bad.json", b'{"kind": "Service",', "invalid JSON"),
        ("bad.json", b"kind: Service\n", "invalid JSON"),  # YAML in a .json file
        ("bad.json", b"", "invalid JSON"),
        ("bad.json", b'[{"kind": "Service"}]', "not a Kubernetes object"),
        ("bad.json", b'{"kind": "List", "items": {"a": 1}}', "not a list"),
        ("bad.json", b'{"kind": "List", "items": [3]}', "not an object"),
        ("bad.json", b"[" * 100_000, "invalid JSON"),
        ("bad.json", b"\xff\xfe{}", "cannot read"),
        ("bad.yaml", b"\xff\xfekind: x", "cannot read"),
        # ours, or libyaml's own limit (1000 too) where PyYAML bundles libyaml 0.2.6+ (6.0.4)
        ("bad.yaml", b"[" * 100_000 + b"]" * 100_000, TOO_DEEP),
        ("bad.yaml", b"a:\n" + b"- " * 100_000 + b"x\n", TOO_DEEP),
        ("bad.yaml", b"a: [1, 2\n", "invalid YAML"),
        # values PyYAML's constructors refuse with ValueError, not YAMLError
        ("bad.yaml", b"kind: Service\nx: " + b"9" * 5000 + b"\n", "invalid YAML"),
        ("bad.yaml", b"a: 2020-13-45\n", "invalid YAML"),
        ("bad.yaml", b"a: !!float x\n", "invalid YAML"),
        ("bad.yaml", b"a: 2020-01-01 00:00:00+99:00\n", "invalid YAML"),
        # Lists nested deeper than the JSON parser goes: one clear error
        ("bad.json", _nested_lists(2000).encode(), "invalid JSON"),
    ],
)
def test_bad_files_give_one_clear_error(tmp_path, name, content, fragment):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=fragment) as info:
        manifests.load([path])
    assert str(info.value).startswith(f"{path}: ")
    assert "\n" not in str(info.value)


def test_a_directory_named_like_a_manifest_is_walked_not_read(tmp_path):
    (tmp_path / "d.yaml").mkdir()
    (tmp_path / "d.yaml" / "s.json").write_text('{"kind": "Service", "metadata": {"name": "a"}}')
    assert names(manifests.load([tmp_path / "d.yaml"])) == [("Service", "a")]


def test_nesting_up_to_the_limit_is_read(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("kind: Service\nmetadata: {name: a}\nx: " + "[" * 990 + "]" * 990 + "\n")
    assert names(manifests.load([path])) == [("Service", "a")]


def test_cli_reports_a_bad_json_file_in_one_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{oops}")
    result = CliRunner().invoke(
        cli.main, ["diff", "--manifests", str(path), "--kernel-state", str(path)]
    )
    assert result.exit_code == 2
    assert result.output.startswith(f"ipvsproxy: error: {path}: invalid JSON: ")
    assert "Traceback" not in result.output


def test_nested_lists_within_the_depth_limit_are_expanded(tmp_path):
    path = tmp_path / "lists.json"
    path.write_text(_nested_lists(400))  # 1200 JSON levels: the C parser's limit
    assert names(manifests.load([path])) == [("Service", "deep")]


def test_an_unreadable_directory_is_an_error_not_a_silent_gap(tmp_path, monkeypatch):
    """A subdirectory that cannot be listed would drop its objects from the desired state
    (and their rules with them): refuse it, naming it."""
    (tmp_path / "a.json").write_text('{"kind": "Service", "metadata": {"name": "a"}}')
    hidden = tmp_path / "team"
    hidden.mkdir()
    (hidden / "b.json").write_text('{"kind": "Service", "metadata": {"name": "b"}}')
    real = os.scandir

    def scandir(path=".", *args):
        if os.fspath(path) == str(hidden):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *args)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(ConfigError, match=f"{hidden}: cannot list: .*Permission denied"):
        manifests.load([tmp_path])


def test_a_path_that_cannot_be_looked_at_is_an_error(tmp_path, monkeypatch):
    path = tmp_path / "svc.yaml"
    real = Path.stat

    def stat(self, **kwargs):
        if self == path:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self, **kwargs)

    monkeypatch.setattr(Path, "stat", stat)
    with pytest.raises(ConfigError, match=f"{path}: cannot read: .*Permission denied"):
        manifests.load([path])
    with pytest.raises(ConfigError, match=f"{path}: cannot read"):
        manifests.fingerprint([path])


YAMLISH = st.text(alphabet="{}[]:,-!&*#'\"\n \t0123456789abefkilnstx.?|>%@`+_:^~", max_size=60)


@settings(max_examples=300, deadline=None)
@given(text=YAMLISH | st.sampled_from(["a: !!timestamp 2020-02-30", "a: !!int x", "a: !!binary ?"]))
def test_any_yaml_text_is_objects_or_one_clear_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "f.yaml"
    path.write_text("kind: Service\nmetadata: {name: a}\n" + text)
    error = None
    try:
        objects = manifests.load([path])
    except ConfigError as exc:  # anything else fails the test
        error, objects = str(exc), []
    assert all(isinstance(obj, dict) for obj in objects)
    if error is not None:
        assert error.startswith(f"{path}: ")
        assert "\n" not in error
