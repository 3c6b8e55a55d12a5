"""The agent's path never imports pyroute2: 11.5 s of start-up in the emulated IPVS VM
(0.23 s natively, notes/kernel-vm.md), paid by every `ipvsproxy run` and `run --once`.
pyroute2 stays a test dependency (golden bytes in test_codec.py, test_rtnl.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

AGENT_PATH = [
    "ipvsproxy.netlink",
    "ipvsproxy.netlink.links",
    "ipvsproxy.netlink.rtnl",
    "ipvsproxy.backends",
    "ipvsproxy.agent",
    "ipvsproxy.cli",
]


@pytest.mark.parametrize("module", AGENT_PATH)
def test_importing_the_agent_path_does_not_import_pyroute2(module):
    code = (
        f"import sys, {module}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'pyroute2'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
