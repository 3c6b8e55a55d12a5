"""Issue 46: the agent as the kubeadm overlay runs it (a kubeconfig naming the Pod's token
file), a process in a throw-away "node" namespace, the test API server beside it: the token
file rotated under it with the old token refused, the node keeps following; a token refused
for good is said (warning, /readyz 503, /healthz 200 with the detail) past 2 sync periods, and
a rotation mends it. The iptables fallback serves; real HTTP to the health port."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from integration.lab import agent_command, inside
from integration.netns.test_healthcheck_agent import get
from tests.factories import node, service
from tests.kubeapi import ApiServer
from tests.support import eventually

pytestmark = pytest.mark.netns


def rotate(token: Path, value: str) -> None:
    """As the kubelet swaps a projected token: a new file renamed over the old."""
    new = token.with_name("token.new")
    new.write_text(value + "\n")
    new.replace(token)


def test_a_rotated_token_file_is_followed_by_the_agent_process(netns: str, tmp_path: Path) -> None:
    subprocess.run(["ip", "-n", netns, "link", "set", "lo", "up"], check=True)
    with inside(netns):
        api = ApiServer(token="first", bookmark_interval=1.0).start()
    token = tmp_path / "token"
    token.write_text("first\n")
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    doc = json.loads(kubeconfig.read_text())
    doc["users"][0]["user"] = {"tokenFile": str(token)}  # as kubeadm's kubeconfig.conf
    kubeconfig.write_text(json.dumps(doc))
    log = tmp_path / "agent.log"
    proc = None

    def nat() -> str:
        return subprocess.run(["ip", "netns", "exec", netns, "iptables-save", "-t", "nat"],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip

    def ready() -> int:
        assert proc is not None
        assert proc.poll() is None, log.read_text()
        return get(netns, "127.0.0.1", 10256, "/readyz")[0]

    try:
        api.put(node("node-a"))
        api.put(service("web", cluster_ips=("10.96.0.10",)))
        with log.open("wb") as out:
            proc = subprocess.Popen(
                agent_command("--kubeconfig", str(kubeconfig), netns=netns, service_cidr=None,
                              backend="iptables", min_sync_period="100ms", sync_period=1.0,
                              health=10256, metrics=10249),
                stdout=out, stderr=out,
            )  # fmt: skip
        eventually(lambda: ready() == 200, 60, "/readyz 200", interval=0.2)
        # every kind's watch open: none in flight with the old token when it is refused
        eventually(lambda: len(api.watched()) >= 3, 60, "the three watches open", interval=0.1)

        api.also_accepted = {"second"}  # the new token is valid at once, the old one after
        rotate(token, "second")
        api.token, api.also_accepted = "second", set()
        api.end_watches()
        api.put(service("db", cluster_ips=("10.96.0.11",)))
        eventually(lambda: "10.96.0.11" in nat(), 30, "the new Service is programmed")
        assert api.refused_for_good() == [], log.read_text()

        api.token = "third"  # refused for good until the file says so
        api.end_watches()
        eventually(lambda: ready() == 503, 60, "/readyz 503: not following", interval=0.2)
        code, _, body = get(netns, "127.0.0.1", 10256, "/healthz")
        assert code == 200
        assert body["api"]["following"] is False
        assert "401" in body["api"]["error"]
        assert "not read for" in log.read_text()

        rotate(token, "third")
        eventually(lambda: ready() == 200, 60, "/readyz 200 again", interval=0.2)
        assert "read again after" in log.read_text()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        api.stop()
