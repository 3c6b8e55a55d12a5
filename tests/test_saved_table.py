"""ipvsadm-save text: parsing real-format samples and round trips."""

from __future__ import annotations

import contextlib
from ipaddress import ip_address
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipvsproxy.errors import ConfigError, KernelUnavailable, NotFound, StateParseError
from ipvsproxy.model import (
    DeleteService,
    Forward,
    Proto,
    RealServer,
    RSKey,
    ServiceFlags,
    VirtualServer,
    VSKey,
)
from ipvsproxy.saved_table import SavedTable, parse_save, render_save
from ipvsproxy.schedulers import Scheduler
from tests.strategies import foreign_states, merge, states

DATA = Path(__file__).parent / "data"


def test_parse_a_mixed_table():
    state = parse_save((DATA / "ipvsadm-save-mixed.txt").read_text())
    udp = VSKey(ip_address("10.96.0.10"), 53, Proto.UDP)
    assert state.services[udp] == VirtualServer(udp, Scheduler.RR, ServiceFlags.PERSISTENT, 10800)
    assert state.dests[udp][RSKey(ip_address("10.244.0.3"), 53)].weight == 0
    sctp = VSKey(ip_address("10.96.0.70"), 5060, Proto.SCTP)
    assert state.services[sctp].flags == ServiceFlags.SCHED1 | ServiceFlags.SCHED2
    v6 = VSKey(ip_address("fd00:96::60"), 80, Proto.TCP)
    assert state.services[v6].scheduler is Scheduler.MH
    assert state.dests[v6] == {
        RSKey(ip_address("fd00:244:1::2"), 8000): RealServer(
            RSKey(ip_address("fd00:244:1::2"), 8000), 3
        )
    }
    foreign = VSKey(ip_address("192.168.7.100"), 443, Proto.TCP)
    dr = state.dests[foreign][RSKey(ip_address("192.168.7.11"), 443)]
    assert dr.forward == Forward.ROUTE
    assert state.dests[foreign][RSKey(ip_address("192.168.7.12"), 443)].forward == Forward.TUNNEL
    mark = VSKey(ip_address("0.0.0.0"), 0, Proto.TCP, fwmark=100)
    assert state.services[mark].scheduler is Scheduler.RR
    mark6 = VSKey(ip_address("::"), 0, Proto.TCP, fwmark=7)
    assert state.services[mark6].flags == ServiceFlags.ONEPACKET
    assert list(state.dests[mark6]) == [RSKey(ip_address("2001:db8::5"), 0)]
    assert len(state.services) == 7


def test_thresholds_are_read_as_ipvsadm_restore_input_takes_them():
    # ipvsadm-save never prints -x/-y, but `ipvsadm -R` input may carry them
    state = parse_save(
        "-A -t 10.0.0.1:80 -s rr\n-a -t 10.0.0.1:80 -r 10.0.1.1:80 -m -w 1 -x 100 -y 50\n"
    )
    (rs,) = state.dests[VSKey(ip_address("10.0.0.1"), 80, Proto.TCP)].values()
    assert (rs.upper_threshold, rs.lower_threshold) == (100, 50)


def test_render_prints_the_sample_back_except_unmodelled_options():
    text = (DATA / "ipvsadm-save-mixed.txt").read_text()
    state = parse_save(text)
    assert parse_save(render_save(state)) == state
    expected = text.replace(" -M 255.255.255.0", "")
    assert sorted(render_save(state).splitlines()) == sorted(expected.splitlines())


@settings(max_examples=200, deadline=None)
@given(state=states(), foreign=foreign_states())
def test_round_trip(state, foreign):
    # ipvsadm prints "local" forwarding as -g (direct routing), so it cannot round-trip
    whole = merge(state, foreign)
    for dests in whole.dests.values():
        if any(rs.forward is Forward.LOCAL for rs in dests.values()):
            return
    assert parse_save(render_save(whole)) == whole.__class__(whole.services, whole.dests)


@given(st.text(max_size=80))
def test_garbage_never_escapes_as_anything_but_a_parse_error(text):
    with contextlib.suppress(StateParseError):
        parse_save(text)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("-A -t 10.0.0.1:80 -s nosuch\n", "line 1"),
        ("-A -t 10.0.0.1:80 -s rr\n-a -t 10.0.0.2:80 -r 10.1.1.1:80 -m -w 1\n", "undefined"),
        ("-A -t 10.0.0.1:80 -s rr\n-A -t 10.0.0.1:80 -s rr\n", "twice"),
        ("-X -t 10.0.0.1:80\n", "expected -A or -a"),
        ("-A -t 10.0.0.1 -s rr\n", "bad address"),
        ("-A -s rr\n", "exactly one"),
        ("-A -t 10.0.0.1:80 -s rr -Z 3\n", "unknown option"),
        ("-A -t 10.0.0.1:80 -s\n", "line 1"),
    ],
)
def test_errors_name_the_line(text, fragment):
    with pytest.raises(StateParseError, match=fragment):
        parse_save(text)


def test_a_saved_table_is_a_read_only_kernel():
    state = parse_save((DATA / "ipvsadm-save-mixed.txt").read_text())
    kernel = SavedTable(state)
    assert kernel.observe() == state
    assert kernel.damage() == ()
    assert kernel.traffic() == {}
    udp = VSKey(ip_address("10.96.0.10"), 53, Proto.UDP)
    assert kernel.connections(udp) == {}  # the file records no connections
    with pytest.raises(NotFound):
        kernel.connections(VSKey(ip_address("10.96.0.99"), 53, Proto.UDP))
    with pytest.raises(KernelUnavailable, match="read-only"):
        kernel.apply((DeleteService(udp),))
    assert kernel.observe() == state


def test_reading_a_saved_table_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match="missing.txt: cannot read"):
        SavedTable.read(tmp_path / "missing.txt")
    (tmp_path / "table.txt").write_text(
        render_save(parse_save(DATA.joinpath("ipvsadm-save-mixed.txt").read_text()))
    )
    assert SavedTable.read(tmp_path / "table.txt").observe().services
