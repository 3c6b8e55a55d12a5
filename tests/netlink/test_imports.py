"""The product never imports pyroute2 (a dev dependency only: the golden bytes of
test_codec.py and test_rtnl.py), so an installed ipvsproxy runs without it."""

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
