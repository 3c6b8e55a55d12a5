"""agent.run_once's order: the manifests are parsed first, and nothing on the node changes
(settings, leftovers, the sync) before the input is known good, nor without a backend; bad
input is reported before a missing backend."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from ipvsproxy import agent
from ipvsproxy.backends import IPVS, Backend
from ipvsproxy.config import Config
from ipvsproxy.errors import ConfigError, KernelUnavailable
from ipvsproxy.testing import FakeKernel
from tests.factories import ep, node, service, slice_

CONFIG = Config(node_name="node-a")


class Node:
    """The fakes' record of what happened on the node, in order."""

    def __init__(self, *, leftovers: tuple[str, ...] = ()) -> None:
        self.steps: list[str] = []
        self.kernel = FakeKernel()
        self.leftovers = list(leftovers)


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> Node:
    host = Node()

    @contextmanager
    def open_backend(config: Config) -> Iterator[Backend]:
        host.steps.append("open backend")
        yield Backend(host.kernel, IPVS, "test")

    def remove_leftovers(backend: Backend, config: Config, *, dry_run: bool = False) -> list[str]:
        host.steps.append("look for leftovers" if dry_run else "remove leftovers")
        found = list(host.leftovers)
        if not dry_run:
            host.leftovers.clear()
        return found

    monkeypatch.setattr(agent, "open_backend", open_backend)
    monkeypatch.setattr(agent, "prepare", lambda backend, config: host.steps.append("prepare"))
    monkeypatch.setattr(agent, "remove_leftovers", remove_leftovers)
    monkeypatch.setattr(agent, "_node_addresses", lambda config: None)
    return host


def good_changes(monkeypatch: pytest.MonkeyPatch, host: Node) -> None:
    """changes_from as the real one, recorded among the steps."""
    real = agent.changes_from

    def parse(source: agent.Source, config: Config) -> Any:
        host.steps.append("parsed")
        return real(source, config)

    monkeypatch.setattr(agent, "changes_from", parse)


def manifest(tmp_path: Path) -> Path:
    import json

    objs = [node("node-a"), service("web", cluster_ips=("10.96.0.10",))]
    objs.append(slice_("web", endpoints=[ep("10.244.0.5", node="node-a")]))
    path = tmp_path / "objects.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}))
    return path


def test_the_input_is_parsed_before_the_backend_opens_and_the_node_is_prepared(
    host, monkeypatch, tmp_path
):
    good_changes(monkeypatch, host)
    result = agent.run_once(CONFIG, manifest_paths=[manifest(tmp_path)])
    assert result.ok
    assert host.steps == ["parsed", "open backend", "prepare", "remove leftovers"]
    assert len(host.kernel.state.services) == 1


def test_leftovers_found_are_removed_after_the_input_is_known_good(host, monkeypatch, tmp_path):
    host.leftovers = ["iptables: chain IPVSPX-SERVICES"]
    good_changes(monkeypatch, host)
    agent.run_once(CONFIG, manifest_paths=[manifest(tmp_path)])
    assert host.steps == ["parsed", "open backend", "prepare", "remove leftovers"]
    assert host.leftovers == []


def test_bad_input_changes_nothing_on_the_node(host, tmp_path):
    host.leftovers = ["iptables: chain IPVSPX-SERVICES"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: [unclosed\n")
    with pytest.raises(ConfigError):
        agent.run_once(CONFIG, manifest_paths=[bad])
    assert "prepare" not in host.steps
    assert "remove leftovers" not in host.steps
    assert host.kernel.applied == []


def test_bad_input_is_reported_before_a_missing_backend(host, monkeypatch, tmp_path):
    @contextmanager
    def no_backend(config: Config) -> Iterator[Backend]:
        raise KernelUnavailable("the kernel has no IPVS")
        yield  # pragma: no cover

    monkeypatch.setattr(agent, "open_backend", no_backend)
    bad = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match="missing.yaml"):
        agent.run_once(CONFIG, manifest_paths=[bad])
    with pytest.raises(KernelUnavailable):  # good input: the backend's error
        agent.run_once(CONFIG, manifest_paths=[manifest(tmp_path)])
