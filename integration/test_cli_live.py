"""`ipvsproxy run --once` and live `ipvsproxy diff` against the real kernel."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from ipvsproxy.cli import main

EXAMPLES = str(Path(__file__).parent.parent / "examples")
NODE = ["--hostname-override", "node-a", "--service-cidr", "10.96.0.0/16"]


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def test_diff_run_once_diff(clean):
    subprocess.run(["ipvsadm", "-A", "-t", "192.168.99.1:443", "-s", "wlc"], check=True)
    before = invoke("diff", "-o", "json", "--manifests", EXAMPLES, *NODE)
    assert before.exit_code == 1, before.output
    doc = json.loads(before.stdout)
    assert doc["summary"]["bind-address"] == 10
    assert doc["summary"]["add-service"] == 13
    assert "192.168.99.1" not in before.stdout

    # the real console script, once: what an operator runs
    ran = subprocess.run(
        [
            str(Path(sys.executable).parent / "ipvsproxy"),
            "run",
            "--once",
            "--manifests",
            EXAMPLES,
            *NODE,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    assert "failed" not in ran.stdout
    assert "applied" in ran.stdout

    after = invoke("diff", "--manifests", EXAMPLES, *NODE)
    assert after.exit_code == 0, after.output
    assert "In sync: no changes." in after.stdout
    saved = subprocess.run(
        ["ipvsadm-save", "-n"], capture_output=True, text=True, check=True
    ).stdout
    assert "-A -t 192.168.99.1:443 -s wlc" in saved


def test_run_once_reports_failed_operations(clean, tmp_path):
    (tmp_path / "svc.yaml").write_text(
        "kind: Service\nmetadata:\n  name: s\n  namespace: x\n"
        "  annotations: {ipvsproxy.io/scheduler: twos}\n"
        "spec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n"
    )
    from integration.conftest import kernel_missing_schedulers
    from ipvsproxy.schedulers import Scheduler

    result = invoke("run", "--once", "--manifests", str(tmp_path), *NODE)
    if Scheduler.TWOS in kernel_missing_schedulers():
        assert result.exit_code == 1
        assert "ip_vs_twos not available" in result.stderr
    else:
        assert result.exit_code == 0
