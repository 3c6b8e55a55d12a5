from __future__ import annotations

import pytest

from ipvsproxy import manifests
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
