"""Real-kernel tests, run by the README's test command. Markers choose the environment:
`netns` (integration/netns/, `scripts/test` runs `-m netns`) on this host's own kernel in
throw-away network namespaces, `vm` (integration/ipvs/, test_node.py, test_conntrack_vm.py)
inside the IPVS VM (`scripts/vm-test` runs `-m vm`). Every test carries exactly one of the
two, or collection fails: no test can fall outside both suites.

IPVS tests need root and a kernel with IPVS; netns tests root, iptables and namespaces.
Elsewhere they skip, except under CI=true, where a missing prerequisite is a failure: CI
must never go green by skipping.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from integration.host import clean_ipvs, require


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cluster",
        action="store_true",
        help="integration/test_node.py checks remote nodes (--hosts, --ssh-config: the "
        "Vagrant cluster), not a local agent",
    )


ENVIRONMENTS = ("vm", "netns")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each real-kernel test runs in exactly one environment, named by its module's marker."""
    for item in items:
        marked = [m for m in ENVIRONMENTS if item.get_closest_marker(m) is not None]
        if len(marked) != 1 and item.path.is_relative_to(Path(__file__).parent):
            raise pytest.UsageError(f"{item.nodeid}: marked {marked}, needs one of {ENVIRONMENTS}")


@pytest.fixture(autouse=True)
def _prerequisites(request: pytest.FixtureRequest) -> None:
    """IPVS tests need the VM's kernel; `netns` tests need root, namespaces and iptables;
    node checks against a cluster need nothing local."""
    if request.config.getoption("--cluster"):
        if request.node.get_closest_marker("node") is None:
            pytest.skip("--cluster runs only the node checks (integration/test_node.py)")
        return
    require(netns=request.node.get_closest_marker("netns") is not None)


@pytest.fixture
def clean() -> Iterator[None]:
    clean_ipvs()
    yield
    clean_ipvs()
