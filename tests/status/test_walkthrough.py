"""docs/status.md's three cases, produced by the code: each example manifest
(docs/status-examples/) programmed into a FakeKernel by the agent's pass (draining what leaves),
traffic counted, then `ipvsproxy status` at 100 columns, without an agent. The output is
golden (tests/data/walkthrough-*.txt, UPDATE_GOLDEN=1 rewrites) and must appear verbatim in
docs/status.md."""

from __future__ import annotations

import copy
import os
from ipaddress import ip_address
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from ipvsproxy.cli import main
from ipvsproxy.model import RSKey, VSKey
from tests.status.scene import count, on_a_fake_clock
from tests.support import Synced, agent_proxier

ROOT = Path(__file__).parents[2]
EXAMPLES = ROOT / "docs" / "status-examples"
DATA = ROOT / "tests" / "data"


def key(text: str) -> VSKey:
    from tests.factories import V

    address, _, number = text.rpartition(":")
    return V(address, int(number)).key


def rs(text: str) -> RSKey:
    address, _, number = text.rpartition(":")
    return RSKey(ip_address(address), int(number))


CASES = {
    # (example, Service, traffic: (virtual server, endpoint, active connections); rollout:
    # the old pod draining keeps 2 connections and gets no new ones)
    "local-no-endpoint": ("demo/shop", [("10.96.0.30:80", "10.244.2.11:8080", 2)]),
    "zone-hints": ("demo/catalog", [("10.96.0.31:9090", "10.244.1.21:9090", 3),
                                    ("10.96.0.31:9090", "10.244.3.22:9090", 1)]),
    "rollout": ("demo/checkout", [("10.96.0.32:80", "10.244.2.32:8080", 4)]),
}  # fmt: skip


def before_the_rollout(objects):
    """The rollout's objects a moment earlier: the old pod ready, the new ones absent."""
    earlier = copy.deepcopy(objects)
    for obj in earlier:
        if obj["kind"] == "EndpointSlice":
            old = obj["endpoints"][0]
            old["conditions"] = {"ready": True, "serving": True, "terminating": False}
            obj["endpoints"] = [old]
    return earlier


@pytest.mark.parametrize("name", CASES)
def test_walkthrough(name, host, monkeypatch):
    service, traffic = CASES[name]
    path = EXAMPLES / f"{name}.yaml"
    objects = list(yaml.safe_load_all(path.read_text()))
    synced = Synced(agent_proxier(host))
    if name == "rollout":
        synced.sync(before_the_rollout(objects))
        host.conns[key("10.96.0.32:80")] = {rs("10.244.1.31:8080"): (2, 1)}
    synced.sync(objects)  # the old pod leaves the table: drained at weight 0
    clock = on_a_fake_clock(monkeypatch)
    for vs, ep, conns in traffic:
        count(host, key(vs), rs(ep), conns=conns)

    def sleep(seconds: float) -> None:  # the second reading, 1 s on, 10x the traffic
        clock.now += seconds
        for vs, ep, conns in traffic:
            count(host, key(vs), rs(ep), conns=conns, scale=11)

    monkeypatch.setattr("time.sleep", sleep)
    result = CliRunner().invoke(
        main,
        ["status", service, "--manifests", str(path.relative_to(ROOT)),
         "--hostname-override", "node-a", "--agent", "http://127.0.0.1:1"],
        env={"COLUMNS": "100"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    text = result.stdout
    golden = DATA / f"walkthrough-{name}.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()
    assert text in (ROOT / "docs" / "status.md").read_text(), "docs/status.md shows another output"
