"""Fixtures of the namespace suite."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


@contextmanager
def namespace(prefix: str) -> Iterator[str]:
    """A throw-away network namespace (its name), removed with everything in it."""
    name = f"{prefix}{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)


@pytest.fixture
def netns() -> Iterator[str]:
    with namespace("ipvsp-t") as name:
        yield name


@pytest.fixture
def other_netns() -> Iterator[str]:
    """A second one, e.g. another host beside the node."""
    with namespace("ipvsp-o") as name:
        yield name
