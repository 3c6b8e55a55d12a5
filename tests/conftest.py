"""Unit tests never touch this host's firewall: the iptables and nftables tools may run only
inside a network namespace (`ip netns exec NS ...`, as integration/netns/ does), and
libnftables is never loaded."""

from __future__ import annotations

import pytest

from ipvsproxy.errors import KernelUnavailable
from ipvsproxy.host.commands import Commands


@pytest.fixture(autouse=True)
def _no_host_firewall(monkeypatch: pytest.MonkeyPatch) -> None:
    real = Commands.run

    def guarded(self: Commands, args, *, stdin=None):
        if self.prefix[:3] != ("ip", "netns", "exec"):
            raise KernelUnavailable("unit tests may not run iptables on the host")
        return real(self, args, stdin=stdin)

    monkeypatch.setattr(Commands, "run", guarded)
    # nor nftables through its library (which Commands would not see): the tool, guarded
    from ipvsproxy.firewall.nft_runner import Libnftables

    monkeypatch.setattr(Libnftables, "open", classmethod(lambda cls: None))


@pytest.fixture(autouse=True)
def _own_node_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test its own agent lock name: test runs side by side on one host (and an agent
    running there) never see each other's lock."""
    import uuid

    from ipvsproxy import nodelock

    monkeypatch.setattr(nodelock, "NAME", f"ipvsproxy-test/{uuid.uuid4().hex}")
