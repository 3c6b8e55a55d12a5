"""Hostile and unlucky manifests (issue 28, items 5 and 6): input whose cost is bounded, files
that are not files, and files that vanish or read empty for a moment."""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from ipvsproxy import cli, manifests
from ipvsproxy.errors import ConfigError
from ipvsproxy.manifest_source import ManifestSource
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, Tracker


def service(name: str) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80, "protocol": "TCP"}]},
    }


def alias_bomb(levels: int = 9, fan: int = 10) -> str:
    """The issue's 870-byte file: nested `kind: List` aliases, fan**levels Services."""
    lines = ["kind: List", "x0: &a0 {kind: Service, metadata: {name: x}}"]
    for level in range(1, levels + 1):
        refs = ", ".join([f"*a{level - 1}"] * fan)
        lines.append(f"x{level}: &a{level} {{kind: List, items: [{refs}]}}")
    lines.append(f"items: [*a{levels}]")
    return "\n".join(lines) + "\n"


@pytest.mark.timeout(10)
def test_an_alias_bomb_is_refused_at_once(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    assert len(path.read_bytes()) < 1000
    with pytest.raises(ConfigError, match=f"{path}: .*alias"):
        manifests.load([path])


@pytest.mark.timeout(10)
def test_diff_refuses_an_alias_bomb_in_one_line(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    result = CliRunner().invoke(cli.main, ["diff", "--manifests", str(path)])
    assert result.exit_code == 2, result.output
    assert "alias" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_recursive_alias_is_refused(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("kind: List\nitems: &a [{kind: List, items: *a}]\n")
    with pytest.raises(ConfigError, match=f"{path}: "):
        manifests.load([path])


def test_a_few_aliases_are_read(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text(
        "kind: List\nitems:\n"
        "- {kind: Service, metadata: {name: a, labels: &l {app: web}}}\n"
        "- {kind: Service, metadata: {name: b, labels: *l}}\n"
    )
    objects = manifests.load([path])
    assert [o["metadata"]["labels"] for o in objects] == [{"app": "web"}] * 2


def test_too_many_documents_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(manifests, "MAX_DOCUMENTS", 10)
    path = tmp_path / "many.yaml"
    path.write_text("---\n{}\n" * 11)
    with pytest.raises(ConfigError, match=f"{path}: more than 10 documents"):
        manifests.load([path])
    path.write_text("---\n{}\n" * 10)
    assert manifests.load([path]) == [{}] * 10


def test_a_file_too_large_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(manifests, "MAX_FILE_BYTES", 100)
    path = tmp_path / "big.json"
    path.write_text(" " * 101 + "{}")
    with pytest.raises(ConfigError, match=f"{path}: larger than 100 bytes"):
        manifests.load([path])


def test_an_object_too_large_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(manifests, "MAX_OBJECT_BYTES", 200)
    path = tmp_path / "list.json"
    big = service("a" * 300)
    path.write_text(json.dumps({"kind": "List", "items": [big]}))
    with pytest.raises(ConfigError, match=f"{path}: .*larger than 200 bytes"):
        manifests.load([path])


@pytest.mark.timeout(10)
@pytest.mark.parametrize("where", ["given", "in a directory"])
def test_a_fifo_is_refused_by_name_never_read(tmp_path, where):
    fifo = tmp_path / "svc.yaml"
    os.mkfifo(fifo)
    path = fifo if where == "given" else tmp_path
    with pytest.raises(ConfigError, match=f"{fifo}: not a regular file \\(a FIFO\\)"):
        manifests.load([path])
    result = CliRunner().invoke(cli.main, ["diff", "--manifests", str(path)])
    assert result.exit_code == 2, result.output
    assert "not a regular file (a FIFO)" in result.stderr


@pytest.mark.timeout(10)
def test_devices_and_sockets_are_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="/dev/null: not a regular file \\(a character device\\)"):
        manifests.load([Path("/dev/null")])
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(tmp_path / "s.yaml"))
        with pytest.raises(ConfigError, match="s.yaml: not a regular file \\(a socket\\)"):
            manifests.load([tmp_path])
    finally:
        sock.close()


# --- files that vanish, dangle or read empty keep their last good content --------------


def source_for(path: Path) -> tuple[ManifestSource, Tracker]:
    tracker = Tracker(required=(SERVICE, SLICE, NODE), on_change=lambda kind: None)
    source = ManifestSource([path], sink=tracker, stop=threading.Event(), interval=0.01)
    return source, tracker


def services(tracker: Tracker) -> int:
    return tracker.counts()[SERVICE]


def test_a_dangling_symlink_keeps_its_services_with_a_warning(tmp_path, caplog):
    real = tmp_path / "real"
    real.mkdir()
    (real / "a.yaml").write_text(yaml.safe_dump(service("a")))
    folder = tmp_path / "manifests"
    folder.mkdir()
    (folder / "a.yaml").symlink_to(real / "a.yaml")
    (folder / "b.yaml").write_text(yaml.safe_dump(service("b")))
    source, tracker = source_for(folder)
    source.load()
    assert services(tracker) == 2
    (real / "a.yaml").unlink()
    source.poll()
    source.poll()
    assert services(tracker) == 2
    assert f"{folder / 'a.yaml'}" in caplog.text
    assert "keeping its last good content" in caplog.text
    (real / "a.yaml").write_text(yaml.safe_dump(service("a2")))
    source.poll()
    assert services(tracker) == 2


def test_a_file_truncated_to_empty_keeps_its_services_until_it_stays_empty(tmp_path, caplog):
    folder = tmp_path / "m"
    folder.mkdir()
    path = folder / "svc.yaml"
    path.write_text(yaml.safe_dump_all([service("a"), service("b")]))
    source, tracker = source_for(folder)
    source.load()
    assert services(tracker) == 2
    path.write_text("")
    source.poll()
    assert services(tracker) == 2  # mid-write: kept
    assert f"{path}: empty" in caplog.text
    source.poll()
    assert services(tracker) == 0  # still empty one poll later: meant


def test_an_empty_list_is_accepted_at_once(tmp_path):
    path = tmp_path / "svc.yaml"
    path.write_text(yaml.safe_dump(service("a")))
    source, tracker = source_for(path)
    source.load()
    path.write_text("kind: List\nitems: []\n")
    source.poll()
    assert services(tracker) == 0


def test_an_unparsable_file_keeps_its_services_and_the_others_change(tmp_path, caplog):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "a.yaml").write_text(yaml.safe_dump(service("a")))
    (folder / "b.yaml").write_text(yaml.safe_dump(service("b")))
    source, tracker = source_for(folder)
    source.load()
    (folder / "a.yaml").write_text("kind: [broken")
    (folder / "c.yaml").write_text(yaml.safe_dump(service("c")))
    source.poll()
    assert services(tracker) == 3
    assert f"{folder / 'a.yaml'}" in caplog.text
    (folder / "a.yaml").write_text(yaml.safe_dump(service("a")))
    (folder / "b.yaml").unlink()
    source.poll()
    source.poll()
    assert services(tracker) == 2  # a file removed from the directory (two polls) is meant


def test_a_file_that_disappears_keeps_its_services_for_a_poll(tmp_path, caplog):
    folder = tmp_path / "m"
    folder.mkdir()
    path = folder / "a.yaml"
    path.write_text(yaml.safe_dump(service("a")))
    source, tracker = source_for(folder)
    source.load()
    path.unlink()
    source.poll()
    assert services(tracker) == 1
    assert f"{path}: gone" in caplog.text
    path.write_text(yaml.safe_dump(service("a")))
    source.poll()
    assert services(tracker) == 1


def test_a_yaml_object_too_large_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(manifests, "MAX_OBJECT_BYTES", 200)
    path = tmp_path / "list.yaml"
    small, big = service("a"), service("b" * 300)
    path.write_text(yaml.safe_dump({"kind": "List", "items": [small, big]}))
    with pytest.raises(ConfigError, match=f"{path}: line \\d+: an object larger than 200 bytes"):
        manifests.load([path])
    path.write_text(yaml.safe_dump_all([small, big]))
    with pytest.raises(ConfigError, match=f"{path}: line \\d+: an object larger than 200 bytes"):
        manifests.load([path])
    path.write_text(yaml.safe_dump({"kind": "List", "items": [small] * 5}))
    assert len(manifests.load([path])) == 5  # a List may be larger than one object


@pytest.mark.timeout(10)
def test_the_running_agent_keeps_its_services_when_a_file_turns_into_a_bomb(tmp_path, caplog):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "a.yaml").write_text(yaml.safe_dump(service("a")))
    source, tracker = source_for(folder)
    source.load()
    (folder / "a.yaml").write_text(alias_bomb())
    (folder / "b.yaml").write_text(yaml.safe_dump(service("b")))
    source.poll()
    assert services(tracker) == 2
    assert f"{folder / 'a.yaml'}: invalid YAML: aliases expand it" in caplog.text
