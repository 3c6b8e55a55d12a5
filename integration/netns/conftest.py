"""Fixtures of the namespace suite."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator

import pytest


@pytest.fixture
def netns() -> Iterator[str]:
    """A throw-away network namespace (its name), removed with everything in it."""
    name = f"ipvsp-t{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    yield name
    subprocess.run(["ip", "netns", "del", name], check=True)
