"""The `host` fixture of the status tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from ipvsproxy import agent
from ipvsproxy.backends import IPVS, Backend
from ipvsproxy.config import Config
from ipvsproxy.testing import FakeKernel
from tests.status.scene import programmed


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> FakeKernel:
    """`status` without an agent runs over this FakeKernel (as `diff` would over the live
    one), the host's addresses those of the Node object."""
    kernel = programmed()

    @contextmanager
    def open_backend(config: Config) -> Iterator[Backend]:
        yield Backend(kernel, IPVS, "test")

    monkeypatch.setattr(agent, "open_backend", open_backend)
    monkeypatch.setattr(agent, "_node_addresses", lambda config: None)
    return kernel
