"""SockoptReader against a fake of the kernel's getsockopt handler (ip_vs_ctl.c
do_ip_vs_get_ctl): exact buffer lengths, entries written from the first slot, only AF_INET
services, ESRCH for an unknown service. The layouts themselves are checked on a real kernel
(integration/test_netlink.py)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
from dataclasses import dataclass, field
from ipaddress import IPv4Address

import pytest

from ipvsproxy.model import Forward, Proto, RealServer, RSKey, ServiceFlags, VirtualServer, VSKey
from ipvsproxy.netlink import sockopt
from ipvsproxy.schedulers import Scheduler


@dataclass
class Dest:
    addr: str
    port: int
    conn_flags: int = 0
    weight: int = 1
    upper: int = 0
    lower: int = 0
    active: int = 0
    inactive: int = 0


@dataclass
class Service:
    addr: str
    port: int
    protocol: int = 6
    fwmark: int = 0
    sched: bytes = b"rr"
    flags: int = 0x2  # the kernel reports HASHED on every service
    timeout: int = 0
    dests: list[Dest] = field(default_factory=list)
    af: int = 2


class FakeKernel:
    """The getsockopt side of IPVS, as ip_vs_ctl.c answers it."""

    def __init__(self, services: list[Service]) -> None:
        self.services = services
        self.refuse = 0  # an errno for every call
        self.info_short_by = 0  # GET_INFO undercounts this many times (the table "grows")
        self.calls: list[int] = []

    def __call__(self, fd, level, option, buf, size_ref) -> int:
        self.calls.append(option)
        size = size_ref._obj.value
        if self.refuse:
            return self._fail(self.refuse)
        if option == sockopt.IP_VS_SO_GET_INFO:
            info = sockopt._GetInfo.from_buffer(buf)
            info.num_services = len(self.services) - (
                len(self.services) if self.info_short_by else 0
            )
            self.info_short_by = max(0, self.info_short_by - 1)
            return 0
        if option == sockopt.IP_VS_SO_GET_SERVICES:
            want = sockopt._GetServices.from_buffer(buf).num_services
            if size != sockopt._SERVICES_HEAD + want * sockopt._SERVICE_SIZE:
                return self._fail(errno.EINVAL)
            v4 = [s for s in self.services if s.af == 2]
            for i, svc in enumerate(v4[:want]):
                self._service(buf, sockopt._SERVICES_HEAD + i * sockopt._SERVICE_SIZE, svc)
            return 0
        return self._entries(option, buf, size)

    def _entries(self, option, buf, size) -> int:
        if option == sockopt.IP_VS_SO_GET_SERVICE:
            svc = self._find(sockopt._ServiceEntry.from_buffer(buf))
            if svc is None:
                return self._fail(errno.ESRCH)
            self._service(buf, 0, svc)
            return 0
        if option == sockopt.IP_VS_SO_GET_DESTS:
            get = sockopt._GetDests.from_buffer(buf)
            if size != sockopt._DESTS_HEAD + get.num_dests * sockopt._DEST_SIZE:
                return self._fail(errno.EINVAL)
            svc = self._find(get)
            if svc is None:
                return self._fail(errno.ESRCH)
            for i, d in enumerate(svc.dests[: get.num_dests]):
                entry = sockopt._DestEntry.from_buffer(
                    buf, sockopt._DESTS_HEAD + i * sockopt._DEST_SIZE
                )
                entry.addr = _be32(d.addr)
                entry.port = _be16(d.port)
                entry.conn_flags, entry.weight = d.conn_flags, d.weight
                entry.u_threshold, entry.l_threshold = d.upper, d.lower
                entry.activeconns, entry.inactconns = d.active, d.inactive
            return 0
        return self._fail(errno.EINVAL)

    def _find(self, get) -> Service | None:
        for s in self.services:
            if s.af != 2:
                continue
            if get.fwmark and s.fwmark == get.fwmark:
                return s
            if not get.fwmark and (s.protocol, _be32(s.addr), _be16(s.port)) == (
                get.protocol,
                get.addr,
                get.port,
            ):
                return s
        return None

    def _service(self, buf, offset: int, svc: Service) -> None:
        ctypes.memset(ctypes.addressof(buf) + offset, 0, sockopt._SERVICE_SIZE)  # as the kernel
        entry = sockopt._ServiceEntry.from_buffer(buf, offset)
        entry.protocol, entry.addr, entry.port = svc.protocol, _be32(svc.addr), _be16(svc.port)
        entry.fwmark, entry.sched_name = svc.fwmark, svc.sched
        entry.flags, entry.timeout, entry.netmask = svc.flags, svc.timeout, 0xFFFFFFFF
        entry.num_dests = len(svc.dests)

    @staticmethod
    def _fail(code: int) -> int:
        ctypes.set_errno(code)
        return -1


def _be32(addr: str) -> int:
    return int.from_bytes(IPv4Address(addr).packed, "little")  # network order in memory


def _be16(port: int) -> int:
    return int.from_bytes(port.to_bytes(2, "big"), "little")


@pytest.fixture
def fake(monkeypatch):
    kernel = FakeKernel(
        [
            Service(
                "10.96.0.1",
                80,
                dests=[Dest("10.244.0.1", 8080), Dest("10.244.0.2", 8080, weight=0)],
            ),
            Service("10.96.0.2", 53, protocol=17, sched=b"sh", flags=0x2 | 0x8 | 0x10),
            Service("10.96.0.3", 443, flags=0x2 | 0x1, timeout=10800, sched=b"wlc"),
            Service("10.96.0.4", 8, flags=0x2, timeout=300),  # a timeout without PERSISTENT
            Service("0.0.0.0", 0, fwmark=7),  # read over netlink
            Service("10.96.0.5", 80, sched=b"nope"),  # a scheduler ipvsproxy does not know
            Service("10.96.0.6", 80, protocol=99),  # a protocol ipvsproxy does not model
            Service("fd00::1", 80, af=10),  # not on this interface at all
        ]
    )
    monkeypatch.setattr(sockopt, "_getsockopt", kernel)
    return kernel


@pytest.fixture
def reader(fake):
    with contextlib.closing(sockopt.SockoptReader()) as reader:
        yield reader


def key(addr: str, port: int, proto: Proto = Proto.TCP) -> VSKey:
    return VSKey(IPv4Address(addr), port, proto)


def test_services_as_the_netlink_decoder_reads_them(fake, reader):
    assert reader.services() == [
        (VirtualServer(key("10.96.0.1", 80)), 2),
        (
            VirtualServer(
                key("10.96.0.2", 53, Proto.UDP),
                Scheduler.SH,
                ServiceFlags.SCHED1 | ServiceFlags.SCHED2,
            ),
            0,
        ),
        (VirtualServer(key("10.96.0.3", 443), Scheduler.WLC, ServiceFlags.PERSISTENT, 10800), 0),
        (VirtualServer(key("10.96.0.4", 8)), 0),
    ]


def test_a_table_grown_since_get_info_is_asked_for_again(fake, reader):
    fake.info_short_by = 1
    assert len(reader.services()) == 4
    assert fake.calls.count(sockopt.IP_VS_SO_GET_INFO) == 2


def test_destinations_forward_method_weights_thresholds(fake, reader):
    fake.services[0].dests = [
        Dest("10.244.0.1", 8080, conn_flags=0x10000 | 2, weight=0, upper=100, lower=10),
        Dest("10.244.0.2", 8081, conn_flags=0x80 | 3, weight=65535),
        Dest("10.244.0.3", 8082, conn_flags=0, weight=1),
    ]
    reader.start_round()
    got = reader.mapping(key("10.96.0.1", 80), 3)
    want = [
        RealServer(RSKey(IPv4Address("10.244.0.1"), 8080), 0, Forward.TUNNEL, 100, 10),
        RealServer(RSKey(IPv4Address("10.244.0.2"), 8081), 65535, Forward.ROUTE),
        RealServer(RSKey(IPv4Address("10.244.0.3"), 8082), 1, Forward.MASQ),
    ]
    assert got == {rs.key: rs for rs in want}
    assert list(got) == [rs.key for rs in want]


def test_an_unchanged_destination_is_the_same_object_next_round(fake, reader):
    reader.start_round()
    first = reader.mapping(key("10.96.0.1", 80), 2)
    reader.start_round()
    second = reader.mapping(key("10.96.0.1", 80), 2)
    assert first == second
    assert all(first[k] is second[k] for k in first)


def test_a_changed_array_is_decoded_again_and_an_unchanged_one_is_a_fresh_copy(fake, reader):
    """A resync reuses a service's last decoding only when its destination array is
    byte-equal; a weight changed behind our back (drift) or traffic (the counters) is read."""
    vs = key("10.96.0.1", 80)
    a, b = (RSKey(IPv4Address(f"10.244.0.{i}"), 8080) for i in (1, 2))
    reader.start_round()
    first = reader.mapping(vs, 2)
    assert first is not None
    first.clear()  # the caller's dict: the reader's record of the array is not touched
    for _ in range(2):
        reader.start_round()
        again = reader.mapping(vs, 2)
        assert again == {a: RealServer(a), b: RealServer(b, weight=0)}
        again.clear()
    fake.services[0].dests[1].weight = 5  # drift
    reader.start_round()
    assert reader.mapping(vs, 2) == {a: RealServer(a), b: RealServer(b, weight=5)}
    fake.services[0].dests[0].active = 3  # traffic: only the counters change
    fake.services[0].dests[0].weight = 2
    reader.start_round()
    assert reader.mapping(vs, 2) == {a: RealServer(a, weight=2), b: RealServer(b, weight=5)}


@pytest.mark.parametrize("listed", [0, 1, 3, 5])
def test_a_count_other_than_listed_means_ask_netlink(fake, reader, listed):
    assert reader.mapping(key("10.96.0.1", 80), listed) is None


def test_a_service_gone_since_listed(fake, reader):
    with pytest.raises(LookupError):
        reader.mapping(key("10.96.9.9", 80), 2)
    assert reader.entries(key("10.96.9.9", 80)) == []


def test_entries_carry_connection_counts(fake, reader):
    fake.services[0].dests[0].active, fake.services[0].dests[0].inactive = 3, 4
    got = reader.entries(key("10.96.0.1", 80))
    assert got == [
        (RealServer(RSKey(IPv4Address("10.244.0.1"), 8080)), 3, 4),
        (RealServer(RSKey(IPv4Address("10.244.0.2"), 8080), weight=0), 0, 0),
    ]


def test_ipv6_and_fwmark_services_are_not_asked_for(fake, reader):
    from ipaddress import IPv6Address

    assert reader.entries(VSKey(IPv6Address("fd00::1"), 80, Proto.TCP)) is None
    assert reader.entries(VSKey(IPv4Address(0), 0, Proto.TCP, fwmark=7)) is None
    assert fake.calls == []


@pytest.mark.parametrize("code", [errno.EPERM, errno.ENOPROTOOPT])
def test_a_refusal_is_unavailable(fake, reader, code):
    fake.refuse = code
    with pytest.raises(sockopt.Unavailable, match=errno.errorcode[code]):
        reader.services()


def test_objects_written_are_returned_in_place_of_equal_decoded_ones(fake, reader):
    """What ipvsproxy wrote comes back as the very objects (the planner compares desired
    and observed by identity first); an object that differs from what the kernel holds
    does not replace it, and only the next observation takes the written objects."""
    vs = VirtualServer(key("10.96.0.1", 80))
    a = RealServer(RSKey(IPv4Address("10.244.0.1"), 8080))
    b = RealServer(RSKey(IPv4Address("10.244.0.2"), 8080), weight=7)  # the kernel has 0
    reader.wrote([vs, a, b])
    reader.start_round()
    listed = dict(reader.services())
    got = reader.mapping(vs.key, 2)
    assert got is not None
    assert [s for s in listed if s == vs][0] is vs
    assert got[a.key] is a
    assert got[b.key] == RealServer(b.key, weight=0)
    reader.start_round()  # the written objects stay what this table decodes to
    assert reader.mapping(vs.key, 2)[a.key] is a
    assert [s for s in dict(reader.services()) if s == vs][0] is vs


def test_written_objects_wait_for_the_next_observation(fake, reader):
    reader.start_round()
    vs = VirtualServer(key("10.96.0.1", 80))
    a = RealServer(RSKey(IPv4Address("10.244.0.1"), 8080))
    reader.wrote([a])
    assert reader.mapping(vs.key, 2)[a.key] is not a  # in this round: not yet
