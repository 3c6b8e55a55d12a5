"""The Kernel contract against FakeKernel."""

from __future__ import annotations

import pytest

from ipvsproxy.testing import FakeKernel
from tests.contract.kernel_contract import KernelContract


class TestFakeKernel(KernelContract):
    @pytest.fixture
    def kernel(self) -> FakeKernel:
        return FakeKernel()
