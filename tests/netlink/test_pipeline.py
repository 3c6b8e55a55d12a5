"""observe() of a large table: the destination dumps run in a second thread (no kernel needed:
a fake generic-netlink socket answers with bytes as the kernel lays them out)."""

from __future__ import annotations

import threading
from ipaddress import ip_address

import pytest

from ipvsproxy.errors import KernelError
from ipvsproxy.model import Proto, RealServer, RSKey, VirtualServer, VSKey
from ipvsproxy.netlink.kernel import PIPELINE_MIN, NetlinkKernel
from tests.netlink.test_fast import DONE, kernel_dest


class FakeGenl:
    """Answers destination dumps in order; optionally fails the n-th one."""

    def __init__(self, answers: list[list[bytes]], fail_at: int = -1) -> None:
        self.answers, self.fail_at, self.calls = answers, fail_at, 0
        self.threads: set[str] = set()

    def dump_raw(self, cmd: int, attrs: bytes = b"") -> list[bytes]:
        self.threads.add(threading.current_thread().name)
        index, self.calls = self.calls, self.calls + 1
        if index == self.fail_at:
            raise KernelError("dump failed: EBUSY (Device or resource busy)")
        return self.answers[index]

    def close(self) -> None:
        pass


def table(n: int) -> tuple[dict[VSKey, VirtualServer], dict[VSKey, dict[RSKey, RealServer]]]:
    services, dests = {}, {}
    for i in range(n):
        key = VSKey(ip_address(f"10.96.{i // 250}.{i % 250 + 1}"), 80, Proto.TCP)
        services[key] = VirtualServer(key)
        rss = [
            RealServer(RSKey(ip_address(f"10.244.{i % 250}.{d + 1}"), 8080), d) for d in range(3)
        ]
        dests[key] = {rs.key: rs for rs in rss}
    return services, dests


def kernel_for(genl: FakeGenl, services: dict[VSKey, VirtualServer], monkeypatch) -> NetlinkKernel:
    kernel = NetlinkKernel(device="ipvsp-none0", genl=genl)  # type: ignore[arg-type]
    monkeypatch.setattr(kernel, "services", lambda: services)
    return kernel


def test_a_large_table_is_dumped_in_another_thread_and_decoded_in_order(monkeypatch):
    services, dests = table(PIPELINE_MIN + 10)
    answers = [[b"".join(kernel_dest(rs, layout="6.1") for rs in d.values()) + DONE]
               for d in dests.values()]  # fmt: skip
    genl = FakeGenl(answers)
    with kernel_for(genl, services, monkeypatch) as kernel:
        state = kernel.observe()
    assert state.services == services
    assert state.dests == dests
    assert genl.threads == {"ipvs-dumps"}


def test_a_small_table_is_dumped_inline(monkeypatch):
    services, dests = table(3)
    answers = [[b"".join(kernel_dest(rs, layout="4.19") for rs in d.values()) + DONE]
               for d in dests.values()]  # fmt: skip
    genl = FakeGenl(answers)
    with kernel_for(genl, services, monkeypatch) as kernel:
        assert kernel.observe().dests == dests
    assert genl.threads == {threading.current_thread().name}


def test_a_failed_dump_fails_the_observation_and_the_thread_ends(monkeypatch):
    services, dests = table(PIPELINE_MIN + 10)
    answers = [[b"".join(kernel_dest(rs, layout="6.1") for rs in d.values()) + DONE]
               for d in dests.values()]  # fmt: skip
    genl = FakeGenl(answers, fail_at=PIPELINE_MIN)
    with (
        kernel_for(genl, services, monkeypatch) as kernel,
        pytest.raises(KernelError, match="EBUSY"),
    ):
        kernel.observe()
    assert not [t for t in threading.enumerate() if t.name == "ipvs-dumps"]
    assert genl.calls == PIPELINE_MIN + 1  # nothing dumped after the failure
