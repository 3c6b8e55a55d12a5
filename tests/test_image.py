"""The image's pinned dependencies (requirements.lock, requirements-build.lock; scripts/lock) agree
with pyproject.toml, and the development venv runs exactly the versions the image ships.
integration/ipvs/test_image.py runs the image itself."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def pins(name: str) -> dict[str, str]:
    """{package: version} of a lock file; every pin carries at least one hash."""
    text = (ROOT / name).read_text()
    found: dict[str, str] = {}
    for block in re.split(r"\n(?=[A-Za-z])", text):
        match = re.match(r"([A-Za-z0-9_.-]+)==(\S+)", block)
        if match:
            assert "--hash=sha256:" in block, f"{name}: {match.group(1)} has no hash"
            found[canonicalize_name(match.group(1))] = match.group(2)
    return found


def test_the_lock_pins_every_dependency_within_pyproject_s_range():
    locked = pins("requirements.lock")
    for spec in PYPROJECT["project"]["dependencies"]:
        requirement = Requirement(spec)
        version = locked.get(canonicalize_name(requirement.name))
        assert version is not None, f"{requirement.name} is not in requirements.lock: scripts/lock"
        assert requirement.specifier.contains(version), f"{spec}: locked {version}; scripts/lock"


def test_the_build_lock_pins_the_wheel_s_build_requirements():
    locked = pins("requirements-build.lock")
    for spec in PYPROJECT["build-system"]["requires"]:
        requirement = Requirement(spec)
        version = locked.get(canonicalize_name(requirement.name))
        assert version is not None, spec
        assert requirement.specifier.contains(version), spec


def test_the_tests_run_the_versions_the_image_ships():
    wrong = {
        name: (version, metadata.version(name))
        for name, version in pins("requirements.lock").items()
        if metadata.version(name) != version
    }
    assert not wrong, f"installed versions differ from requirements.lock: {wrong}"


def test_no_module_of_ipvsproxy_imports_the_asyncio_client_the_image_leaves_out():
    """The Containerfile drops kubernetes/aio: importing every module (and building a client)
    must not need it."""
    code = (
        "import pkgutil, importlib, sys, ipvsproxy\n"
        "for m in pkgutil.walk_packages(ipvsproxy.__path__, 'ipvsproxy.'):\n"
        "    m.name.endswith('__main__') or importlib.import_module(m.name)\n"
        "from ipvsproxy import kubeclient\n"
        "kubeclient.client(kubeconfig=None, context=None, master='https://127.0.0.1:1').close()\n"
        "print(sorted(n for n in sys.modules if n.startswith(('kubernetes.aio', 'aiohttp'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    assert out.strip() == "[]"


# Every tool the product runs on a node, and the Debian package the image gets it from. On the
# real node, an image without nft made `cleanup --kube-proxy` pass kube-proxy's nftables-mode
# tables by, and their DNAT rules, in front of IPVS, kept sending new connections to deleted pods.
TOOLS = {
    "ip": "iproute2",  # the dummy device's fallback path, operators
    "iptables": "iptables",  # the firewall's rules, the fallback backend, kube-proxy's clean-up
    "ipset": "ipset",  # the firewall's sets (the tool's fallback path), kube-proxy's clean-up
    "nft": "nftables",  # kube-proxy's nftables-mode tables (cleanup --kube-proxy)
    "modprobe": "kmod",  # prepare: the IPVS modules
    "sysctl": "procps",  # operators; prepare writes /proc/sys itself
    "conntrack": "conntrack",  # the UDP flows of removed endpoints
    "ipvsadm": "ipvsadm",  # operators: ipvsadm -Ln (docs/migration.md's way back)
}


def test_the_image_installs_every_tool_the_product_runs():
    text = (ROOT / "Containerfile").read_text()
    final = text[text.rindex("\nFROM ") :]  # the image's own stage, not the build stage's
    command = re.search(r"apt-get install ([^&]*)", final)
    assert command is not None
    installed = set(command.group(1).replace("\\", " ").split())
    missing = {tool: package for tool, package in TOOLS.items() if package not in installed}
    assert not missing, f"the image lacks {missing}"
