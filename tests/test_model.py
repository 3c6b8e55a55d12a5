"""transition(): the kernel's semantics, which FakeKernel executes."""

from __future__ import annotations

import dataclasses
from ipaddress import ip_address

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ipvsproxy.errors import AlreadyExists, NotFound
from ipvsproxy.model import (
    EMPTY,
    AddDest,
    AddService,
    BindAddress,
    DeleteDest,
    DeleteService,
    Proto,
    RealServer,
    RSKey,
    UnbindAddress,
    UpdateDest,
    UpdateService,
    VirtualServer,
    VSKey,
    parse_host_port,
    transition,
)
from ipvsproxy.schedulers import Scheduler
from ipvsproxy.testing import FakeKernel

KEY = VSKey(ip_address("10.96.0.10"), 80, Proto.TCP)
VS = VirtualServer(KEY)
RS = RealServer(RSKey(ip_address("10.244.1.1"), 8080))


def test_add_then_delete_service_drops_its_destinations():
    s = transition(transition(EMPTY, AddService(VS)), AddDest(KEY, RS))
    assert s.dests[KEY] == {RS.key: RS}
    s = transition(s, DeleteService(KEY))
    assert s.services == {}
    assert s.dests == {}


@pytest.mark.parametrize(
    ("ops", "error"),
    [
        ([AddService(VS), AddService(VS)], AlreadyExists),
        ([UpdateService(VS)], NotFound),
        ([DeleteService(KEY)], NotFound),
        ([AddDest(KEY, RS)], NotFound),
        ([AddService(VS), AddDest(KEY, RS), AddDest(KEY, RS)], AlreadyExists),
        ([AddService(VS), UpdateDest(KEY, RS)], NotFound),
        ([AddService(VS), DeleteDest(KEY, RS.key)], NotFound),
        ([BindAddress(KEY.address), BindAddress(KEY.address)], AlreadyExists),
        ([UnbindAddress(KEY.address)], NotFound),
    ],
)
def test_transition_fails_like_the_kernel(ops, error):
    state = EMPTY
    for op in ops[:-1]:
        state = transition(state, op)
    with pytest.raises(error):
        transition(state, ops[-1])


def test_update_changes_settings_in_place():
    s = transition(transition(EMPTY, AddService(VS)), AddDest(KEY, RS))
    sh = VirtualServer(KEY, Scheduler.SH)
    drained = RealServer(RS.key, weight=0)
    s = transition(transition(s, UpdateService(sh)), UpdateDest(KEY, drained))
    assert s.services[KEY] == sh
    assert s.dests[KEY] == {RS.key: drained}


def test_fake_kernel_reports_failures_per_op_and_goes_on():
    kernel = FakeKernel()
    other = VirtualServer(VSKey(ip_address("10.96.0.11"), 80, Proto.TCP))
    kernel.errors[AddService(other)] = NotFound("injected")
    report = kernel.apply([AddDest(KEY, RS), AddService(other), AddService(VS)])
    assert [type(f.error) for f in report.failures] == [NotFound, NotFound]
    assert report.applied == 1
    assert kernel.applied == [AddService(VS)]
    assert set(kernel.state.services) == {KEY}


def test_keys_of_both_families_sort_ipv4_first():
    v6 = VSKey(ip_address("::1"), 1, Proto.TCP)
    v4 = VSKey(ip_address("255.255.255.255"), 1, Proto.TCP)
    assert sorted([v6, v4]) == [v4, v6]
    assert str(v6) == "TCP [::1]:1"


@pytest.mark.parametrize("text", ["10.0.0.1", "[::1]80", "::1:80", "10.0.0.1:70000", "x:1"])
def test_parse_host_port_rejects(text):
    with pytest.raises(ValueError):  # noqa: PT011
        parse_host_port(text)


@given(st.sampled_from(["10.0.0.1", "10.0.0.2", "::a00:1", "2001:db8::1"]), st.integers(0, 2))
def test_equal_destination_keys_hash_equal_and_others_stay_apart(address, port):
    key = RSKey(ip_address(address), port)
    same = RSKey(ip_address(address), port)
    assert key == same
    assert hash(key) == hash(same)
    # ::a00:1 and 10.0.0.1 share an integer (and a hash): a dict still tells them apart
    table = {RSKey(ip_address(a), p): (a, p) for a in ("10.0.0.1", "::a00:1") for p in range(3)}
    assert len(table) == 6
    if key in table:
        assert table[key] == (address, port)


ADDRESSES = st.sampled_from(["10.0.0.1", "10.0.0.2", "::a00:1", "2001:db8::1"]).map(ip_address)
SMALL = st.integers(0, 2)


def fields_of(obj: object) -> tuple[object, ...]:
    """What the generated dataclass __eq__ compares: the fields, keys by their fields."""
    values = tuple(getattr(obj, f.name) for f in dataclasses.fields(obj) if f.compare)  # type: ignore[arg-type]
    return tuple(fields_of(v) if isinstance(v, RSKey | VSKey) else v for v in values)
