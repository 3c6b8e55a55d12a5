"""A Service asking for a scheduler this kernel lacks (twos: Linux 6.2+, the VM runs Debian's
6.1) is served by the node's default scheduler, and /healthz stays 200 over several sync
periods: the real console script (`run --manifests`, as a daemon), the real kernel's refusal
(ENOENT from IPVS_CMD_NEW_SERVICE), real traffic through the virtual IP."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from integration.host import clean_ipvs, kernel_missing_schedulers
from integration.lab import PORT, Lab, agent_command, request
from ipvsproxy.schedulers import SCHEDULER_ANNOTATION, Scheduler
from tests.factories import ep, node, port, service, slice_
from tests.support import free_port

pytestmark = pytest.mark.vm

SYNC_PERIOD = 2.0
VIP = "10.96.7.7"


def test_a_scheduler_the_kernel_lacks_is_served_with_the_default_and_health_stays_up(
    tmp_path: Path,
) -> None:
    if Scheduler.TWOS not in kernel_missing_schedulers():
        pytest.skip("this kernel has ip_vs_twos: nothing is refused")
    clean_ipvs()
    lab = Lab()
    proc: subprocess.Popen[bytes] | None = None
    try:
        backend = lab.add_backend()
        client = lab.add_client()
        svc = service(
            "fancy",
            cluster_ips=(VIP,),
            ports=[port("http", 80, target=PORT)],
            annotations={SCHEDULER_ANNOTATION: "twos"},
        )
        endpoints = slice_("fancy", ports=(("http", PORT, "TCP"),), endpoints=[ep(backend.address)])
        objects = [node("node-a", ["10.250.1.1"]), svc, endpoints]
        manifests = tmp_path / "manifests"
        manifests.mkdir()
        (manifests / "all.json").write_text(json.dumps({"kind": "List", "items": objects}))
        health = free_port()
        log = tmp_path / "agent.log"
        args = agent_command("--manifests", str(manifests), health=health, sync_period=SYNC_PERIOD)
        with log.open("wb") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=out)
        deadline = time.monotonic() + 120
        while f"-A -t {VIP}:80 -s rr" not in _ipvsadm():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, (
                f"not served with rr:\n{_ipvsadm()}\n{log.read_text()[-3000:]}"
            )
            time.sleep(0.5)
        assert request(client, VIP, 80) == backend.name  # served, through the VIP
        codes = []
        until = time.monotonic() + 4 * SYNC_PERIOD  # over several sync periods
        while time.monotonic() < until:
            codes.append(_healthz(health))
            time.sleep(0.5)
        assert set(codes) == {200}, codes
        text = log.read_text()
        warnings = [
            line for line in text.splitlines() if "twos" in line and "default/fancy" in line
        ]
        assert len(warnings) == 1, text[-3000:]
        assert text.count("operation failed") == 0, text[-3000:]  # a refusal, not a failure
        assert f"-A -t {VIP}:80 -s rr" in _ipvsadm()  # never retried with twos, never flapping
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
        lab.close()
        clean_ipvs()


def _ipvsadm() -> str:
    return subprocess.run(["ipvsadm", "-S", "-n"], capture_output=True, text=True).stdout


def _healthz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
