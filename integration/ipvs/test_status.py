"""`ipvsproxy status` against a running agent on the real IPVS kernel: real connections
through a ClusterIP show up as connections, packets and bytes on the endpoint that served
them, in the agent's /status read by the CLI (`-o json`), with rates once two samples exist.
Run by scripts/vm-test inside the IPVS VM (one agent from manifests, two backends: ~20 s)."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from integration.host import STUCK, clean_ipvs
from integration.lab import IPVSPROXY, PORT, Lab, agent_command, built, request
from ipvsproxy.status.client import fetch
from ipvsproxy.status.document import Selector
from tests.factories import ep, node, port, service, slice_
from tests.status.scene import SCHEMA
from tests.support import eventually, free_port

pytestmark = pytest.mark.vm
VIP = "10.96.0.40"


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[Lab, str]]:
    """An agent programming one ClusterIP Service over two backends; (lab, its URL)."""
    clean_ipvs()
    metrics, health = free_port(), free_port()
    log = tmp_path / "agent.log"
    with built(2) as lab:
        objects = [
            node(addresses=("10.250.1.1",)),
            service("web", cluster_ips=(VIP,), ports=[port("http", 80, "TCP", PORT)]),
            slice_("web", ports=(("http", PORT, "TCP"),),
                   endpoints=[ep(b.address) for b in lab.backends]),
        ]  # fmt: skip
        manifest = tmp_path / "cluster.yaml"
        manifest.write_text(yaml.safe_dump_all(objects))
        with log.open("wb") as out:
            proc = subprocess.Popen(
                agent_command("--manifests", str(manifest), health=health, metrics=metrics),
                stdout=out, stderr=out,
            )  # fmt: skip
        try:
            eventually(
                lambda: proc.poll() is None and subprocess.run(
                    ["ipvsadm", "-Ln", "-t", f"{VIP}:80"], capture_output=True
                ).returncode == 0,
                STUCK, "the agent programmed the VIP", interval=0.3,
                detail=lambda: log.read_text()[-3000:],
            )  # fmt: skip
            yield lab, f"http://127.0.0.1:{metrics}"
        finally:
            proc.terminate()
            proc.wait(timeout=60)
            clean_ipvs()


def status(url: str) -> dict[str, Any]:
    done = subprocess.run(
        [IPVSPROXY, "status", "--agent", url, "-o", "json", "default/web"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc: dict[str, Any] = json.loads(done.stdout)
    jsonschema.validate(doc, SCHEMA)
    return doc


def by_address(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    (web,) = doc["services"]
    return {e["address"]: e["traffic"] for e in web["endpoints"]}


def agent_doc(url: str) -> dict[str, Any]:
    """The agent's /status for default/web, read in this process (no CLI start between
    two readings: the rates are between the agent's last two samples, which must span the
    traffic whatever the machine's speed)."""
    doc = fetch(url, Selector.parse("default/web"))
    jsonschema.validate(doc, SCHEMA)
    return doc


def test_connections_and_bytes_go_up_on_the_endpoint_that_served_them(agent):
    lab, url = agent
    names = {b.name: b.address for b in lab.backends}
    status(url)  # the CLI reads the agent's document
    before = by_address(agent_doc(url))  # the agent's sample before the traffic
    served = Counter(names[request(lab.clients[0], VIP, 80)] for _ in range(6))
    doc: dict[str, Any] = {}
    after: dict[str, dict[str, Any]] = {}

    def counted() -> bool:  # the kernel refreshes the counters it reports every 2 s
        nonlocal doc, after
        doc = agent_doc(url)
        after = by_address(doc)
        return all(
            after[a]["connections"] - before[a]["connections"] >= n for a, n in served.items()
        )

    eventually(counted, STUCK, "the connections in the counters", interval=0.5)
    assert doc["backend"] == "ipvs"
    for address, n in served.items():
        assert after[address]["connections"] - before[address]["connections"] == n
        assert after[address]["bytesIn"] > before[address]["bytesIn"]
        assert after[address]["bytesOut"] > before[address]["bytesOut"]
        assert after[address]["packetsIn"] > before[address]["packetsIn"]
    assert doc["rateWindowSeconds"] is not None
    assert sum(t["rates"]["connectionsPerSecond"] for t in after.values()) > 0
