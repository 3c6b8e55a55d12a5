"""One agent per node, as operators start them: in one network namespace a second
`ipvsproxy run` exits 2 at once naming the first, having changed nothing (not a setting, not a
rule), whatever its ports; agents in two namespaces both run; `cleanup` refuses while an
agent runs unless --force. SIGHUP is logged and makes the next pass a full one. A running
agent, and one killed -9, leaves its kubeconfig's client key in no file."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trustme
import yaml

from integration.lab import IPVSPROXY, agent_command, inside
from tests.factories import ep, node, port, service, slice_
from tests.support import eventually, free_port

pytestmark = pytest.mark.netns
ARP_IGNORE = "/proc/sys/net/ipv4/conf/all/arp_ignore"


@contextmanager
def namespace() -> Iterator[str]:
    name = f"ipvsp-l{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)


def in_ns(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", ns, *args], capture_output=True, text=True, check=check
    )


def nat(ns: str) -> str:
    text = in_ns(ns, "iptables-save", "-t", "nat").stdout
    return "\n".join(line for line in text.splitlines() if not line.startswith("#"))


def arp_ignore(ns: str) -> str:
    return in_ns(ns, "cat", ARP_IGNORE).stdout.strip()


def manifest(path: Path, vip: str) -> Path:
    path.write_text(
        yaml.safe_dump_all([
            node("node-a", addresses=("10.250.1.1",)),
            service("web", cluster_ips=(vip,), ports=[port("http", 80, "TCP", 8000)]),
            slice_("web", ports=(("http", 8000, "TCP"),), endpoints=[ep("10.244.1.2")]),
        ])
    )  # fmt: skip
    return path


def ports(ns: str) -> tuple[int, int]:
    """Free metrics and health ports in `ns`."""
    with inside(ns):
        return free_port(), free_port()


class Agent:
    """`ipvsproxy run --manifests` in a namespace, its JSON log in a file."""

    def __init__(self, ns: str, tmp: Path, name: str, *extra: str) -> None:
        self.log = tmp / f"{name}.log"
        self.manifest = manifest(tmp / f"{name}.yaml", extra[0] if extra else "10.96.0.20")
        metrics, health = ports(ns)
        args = agent_command(
            "--manifests", str(self.manifest), netns=ns, service_cidr=None,
            min_sync_period="100ms", health=health, metrics=metrics,
            more=("--log-format", "json", "--v", "2", *extra[1:]),
        )  # fmt: skip
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=out)

    def lines(self) -> list[dict[str, object]]:
        out = []
        for line in self.log.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                out.append({"msg": line})
        return out

    def syncs(self) -> list[dict[str, object]]:
        return [r for r in self.lines() if str(r.get("msg", "")).startswith("sync:")]

    def synced(self) -> None:
        def done() -> bool:
            assert self.proc.poll() is None, self.log.read_text()
            return bool(self.syncs())

        eventually(done, 60, "the agent synced", interval=0.1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture
def ns() -> Iterator[str]:
    with namespace() as name:
        yield name


def test_a_second_agent_in_the_namespace_exits_2_at_once_naming_the_first_changing_nothing(
    ns, tmp_path
):
    first = Agent(ns, tmp_path, "first")
    try:
        first.synced()
        rules, arp = nat(ns), arp_ignore(ns)
        assert arp == "0"
        # other ports, another Service, --strict-arp (arp_ignore=1): anything it wrote shows
        second = Agent(ns, tmp_path, "second", "10.96.0.99", "--strict-arp")
        try:
            # it exits at once (nothing it waits for): the deadline is one a loaded machine meets
            assert second.proc.wait(timeout=60) == 2, second.log.read_text()
        finally:
            second.stop()
        said = second.log.read_text()
        assert f"pid {first.proc.pid}" in said, said
        assert "`ipvsproxy run`" in said
        assert "started " in said
        assert "one agent per network namespace" in said
        assert "sync" not in said
        assert "backend" not in said
        assert nat(ns) == rules
        assert "10.96.0.99" not in rules
        assert arp_ignore(ns) == "0"
        assert first.proc.poll() is None
    finally:
        assert first.stop() == 0


def test_agents_in_two_namespaces_both_run(tmp_path):
    with namespace() as one, namespace() as two:
        a, b = Agent(one, tmp_path, "a"), Agent(two, tmp_path, "b")
        try:
            a.synced()
            b.synced()
            assert "10.96.0.20" in nat(one)
            assert "10.96.0.20" in nat(two)
        finally:
            assert a.stop() == 0
            assert b.stop() == 0


def test_cleanup_refuses_while_an_agent_runs_unless_forced(ns, tmp_path):
    agent = Agent(ns, tmp_path, "agent")
    try:
        agent.synced()
        rules = nat(ns)
        refused = in_ns(ns, IPVSPROXY, "cleanup", check=False)
        assert refused.returncode == 2, refused
        assert f"pid {agent.proc.pid}" in refused.stderr
        assert "--force" in refused.stderr
        assert nat(ns) == rules
        listed = in_ns(ns, IPVSPROXY, "cleanup", "--dry-run", check=False)
        assert listed.returncode == 0, listed
        assert "would remove" in listed.stdout
        forced = in_ns(ns, IPVSPROXY, "cleanup", "--force", check=False)
        assert forced.returncode == 0, forced
        assert "IPVSPX-SERVICES" not in nat(ns)
        assert "lock is held" in forced.stderr
    finally:
        assert agent.stop() == 0
    done = in_ns(ns, IPVSPROXY, "cleanup", check=False)  # stopped: cleanup runs
    assert done.returncode == 0, done


def test_sighup_is_logged_and_makes_a_full_pass(ns, tmp_path):
    agent = Agent(ns, tmp_path, "agent")
    try:
        agent.synced()
        agent.manifest.write_text(agent.manifest.read_text().replace("10.244.1.2", "10.244.1.3"))
        eventually(lambda: len(agent.syncs()) >= 2, 30, "a partial pass", interval=0.1)
        assert agent.syncs()[-1]["pass"] == "partial"
        seen = len(agent.syncs())
        agent.proc.send_signal(signal.SIGHUP)
        eventually(lambda: len(agent.syncs()) > seen, 30, "a pass after SIGHUP", interval=0.1)
        assert agent.proc.poll() is None, agent.log.read_text()
        after = agent.syncs()[seen]
        assert after["pass"] == "full"
        assert any("received SIGHUP" in str(r["msg"]) for r in agent.lines())
    finally:
        assert agent.stop() == 0


def test_the_agent_leaves_its_client_key_in_no_file_even_after_kill_9(ns, tmp_path):
    ca = trustme.CA()
    issued = ca.issue_cert("node-a.example")
    key = issued.private_key_pem.bytes()
    cert = b"".join(blob.bytes() for blob in issued.cert_chain_pems)
    b64 = lambda data: base64.b64encode(data).decode()  # noqa: E731
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {
            "server": "https://127.0.0.1:1", "certificate-authority-data": b64(ca.cert_pem.bytes()),
        }}],
        "users": [{"name": "u", "user": {"client-certificate-data": b64(cert),
                                         "client-key-data": b64(key)}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))  # fmt: skip
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    log = tmp_path / "agent.log"
    metrics, health = ports(ns)
    args = agent_command("--kubeconfig", str(kubeconfig), netns=ns, service_cidr=None,
                         min_sync_period=None, health=health, metrics=metrics)  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=out, env={**os.environ, "TMPDIR": str(tmpdir)}
        )
    try:
        eventually(lambda: "running: Kubernetes API" in log.read_text(), 60, "started")
        assert proc.poll() is None, log.read_text()
        assert [p for p in tmpdir.rglob("*") if p.is_file() and key in p.read_bytes()] == []
        proc.kill()
        proc.wait(timeout=10)
        assert [p for p in tmpdir.rglob("*") if p.is_file() and key in p.read_bytes()] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
