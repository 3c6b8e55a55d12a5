"""The IPVS codec: golden bytes against pyroute2's encoding of the same messages, and dumps
decoded back as the kernel writes them (16-byte addresses, HASHED set, statistics nests)."""

from __future__ import annotations

import socket
from dataclasses import replace
from ipaddress import ip_address
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyroute2.netlink.generic.ipvs import ipvsmsg

from ipvsproxy.model import (
    AddDest,
    AddService,
    Counters,
    DeleteService,
    DestTraffic,
    Forward,
    Proto,
    RealServer,
    RSKey,
    ServiceFlags,
    VirtualServer,
    VSKey,
)
from ipvsproxy.netlink import codec
from ipvsproxy.schedulers import Scheduler
from tests.netlink.dumps import kernel_dest
from tests.strategies import real_servers, virtual_servers

FAMILY = 0x1D


def pyroute2_bytes(cmd: int, attrs: list[Any], seq: int = 7, flags: int = 5) -> bytes:
    msg = ipvsmsg()
    msg["cmd"] = cmd
    msg["version"] = 1
    msg["attrs"] = attrs
    msg["header"]["type"] = FAMILY
    msg["header"]["flags"] = flags
    msg["header"]["sequence_number"] = seq
    msg.encode()
    return bytes(msg.data)


def service_nla(vs: VirtualServer) -> list[Any]:
    af = socket.AF_INET6 if vs.key.address.version == 6 else socket.AF_INET
    return [
        ("IPVS_SVC_ATTR_AF", af),
        ("IPVS_SVC_ATTR_PROTOCOL", int(vs.key.proto)),
        ("IPVS_SVC_ATTR_ADDR", str(vs.key.address)),
        ("IPVS_SVC_ATTR_PORT", vs.key.port),
        ("IPVS_SVC_ATTR_SCHED_NAME", vs.scheduler.value),
        ("IPVS_SVC_ATTR_FLAGS", {"flags": int(vs.flags), "mask": 0xFFFFFFFF}),
        ("IPVS_SVC_ATTR_TIMEOUT", vs.timeout_s),
    ]


def strip_nested_flag(data: bytes) -> bytes:
    """pyroute2 does not set NLA_F_NESTED on the top-level nests; we do (both are accepted)."""
    buf = bytearray(data)
    offset = 20
    while offset < len(buf):
        length = int.from_bytes(buf[offset : offset + 2], "little")
        buf[offset + 3] &= 0x7F
        offset += (length + 3) & ~3
    return bytes(buf)


def ours(cmd: int, attrs: bytes) -> bytes:
    return strip_nested_flag(codec.message(FAMILY, cmd, attrs, seq=7, flags=5))


def test_new_service_ipv4_matches_pyroute2_byte_for_byte():
    vs = VirtualServer(
        VSKey(ip_address("10.96.0.10"), 53, Proto.UDP),
        Scheduler.SH,
        ServiceFlags.PERSISTENT | ServiceFlags.SCHED2,
        10800,
    )
    # pyroute2 types NETMASK as an IPv4 address: same bytes as our u32 0xffffffff
    theirs = pyroute2_bytes(
        1,
        [
            (
                "IPVS_CMD_ATTR_SERVICE",
                {"attrs": [*service_nla(vs), ("IPVS_SVC_ATTR_NETMASK", "255.255.255.255")]},
            )
        ],
    )
    cmd, attrs = codec.encode_op(AddService(vs))
    assert cmd == codec.CMD_NEW_SERVICE
    assert ours(cmd, attrs) == theirs


def test_new_dest_matches_pyroute2_byte_for_byte():
    key = VSKey(ip_address("10.96.0.10"), 80, Proto.TCP)
    rs = RealServer(RSKey(ip_address("10.244.1.5"), 8080), weight=3, forward=Forward.MASQ)
    theirs = pyroute2_bytes(
        5,
        [
            (
                "IPVS_CMD_ATTR_SERVICE",
                {
                    "attrs": [
                        ("IPVS_SVC_ATTR_AF", 2),
                        ("IPVS_SVC_ATTR_PROTOCOL", 6),
                        ("IPVS_SVC_ATTR_ADDR", "10.96.0.10"),
                        ("IPVS_SVC_ATTR_PORT", 80),
                    ]
                },
            ),
            (
                "IPVS_CMD_ATTR_DEST",
                {
                    "attrs": [
                        ("IPVS_DEST_ATTR_ADDR_FAMILY", 2),
                        ("IPVS_DEST_ATTR_ADDR", "10.244.1.5"),
                        ("IPVS_DEST_ATTR_PORT", 8080),
                        ("IPVS_DEST_ATTR_FWD_METHOD", 0),
                        ("IPVS_DEST_ATTR_WEIGHT", 3),
                        ("IPVS_DEST_ATTR_U_THRESH", 0),
                        ("IPVS_DEST_ATTR_L_THRESH", 0),
                    ]
                },
            ),
        ],
    )
    cmd, attrs = codec.encode_op(AddDest(key, rs))
    assert cmd == codec.CMD_NEW_DEST
    assert ours(cmd, attrs) == theirs


def dumped_service(
    vs: VirtualServer, *, sched_name: str | None = None, stats64: bytes | None = None
) -> bytes:
    """One GET_SERVICE reply as the kernel writes it (ip_vs_genl_fill_service)."""
    key = vs.key
    af = socket.AF_INET6 if key.address.version == 6 else socket.AF_INET
    attrs = codec.pack(
        codec.SERVICE,
        [
            ("af", af),
            ("protocol", int(key.proto)),
            ("addr", ip_address(key.address.packed.ljust(16, b"\0"))),  # always 16 bytes
            ("port", key.port),
            ("sched_name", sched_name or vs.scheduler.value),
            ("flags", (int(vs.flags) | ServiceFlags.HASHED, 0xFFFFFFFF)),
            ("timeout", vs.timeout_s),
            ("netmask", 0xFFFFFFFF),
            ("stats", codec.pack(codec.DEST, [("port", 1), ("weight", 99)])),
            *([("stats64", stats64)] if stats64 is not None else []),
        ],
    )
    return codec.message(FAMILY, 1, codec.pack(codec.COMMAND, [("service", attrs)]), seq=1, flags=2)


@settings(max_examples=200, deadline=None)
@given(vs=virtual_servers())
def test_a_dumped_service_decodes_back(vs):
    (payload,) = codec.dumped([dumped_service(vs)])
    assert codec.decode_service(payload) == vs


def test_a_service_with_an_unknown_scheduler_is_left_out():
    vs = VirtualServer(VSKey(ip_address("10.96.0.1"), 80, Proto.TCP))
    (payload,) = codec.dumped([dumped_service(vs, sched_name="nosuch")])
    assert codec.decode_service(payload) is None


@settings(max_examples=200, deadline=None)
@given(
    version=st.sampled_from([4, 6]),
    data=st.data(),
    counts=st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)),
    family_attr=st.booleans(),
)
def test_a_dumped_destination_decodes_back(version, data, counts, family_attr):
    """As ip_vs_genl_fill_dest writes one: a 16-byte address, the forwarding method with the
    connection flags beside it, counters and statistics; ADDR_FAMILY only on newer kernels
    (else the service's family applies)."""
    rs = data.draw(real_servers(version))
    af = socket.AF_INET6 if version == 6 else socket.AF_INET
    values: list[tuple[str, Any]] = [("addr_family", af)] if family_attr else []
    values += [
        ("addr", ip_address(rs.key.address.packed.ljust(16, b"\0"))),
        ("port", rs.key.port),
        ("fwd_method", int(rs.forward) | 0x0100),  # a connection flag beside the method
        ("weight", rs.weight),
        ("u_thresh", rs.upper_threshold),
        ("l_thresh", rs.lower_threshold),
        ("active_conns", counts[0]),
        ("inact_conns", counts[1]),
        ("stats", codec.pack(codec.DEST, [("port", 7)])),
    ]
    nest = codec.pack(codec.COMMAND, [("dest", codec.pack(codec.DEST, values))])
    (payload,) = codec.dumped([codec.message(FAMILY, 5, nest, seq=2, flags=2)])
    assert codec.decode_dest(payload, af) == (rs, *counts)


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(st.integers(0, 2**64 - 1), min_size=5, max_size=5),
    counts=st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)),
)
def test_a_dumped_destination_decodes_its_counters(values, counts):
    """The 64-bit STATS64 nest, with the kernel's rate estimates and the PAD attribute beside
    the counters (nla_put_u64_64bit), and the 32-bit STATS nest before it, ignored."""
    stats64 = codec.pack(codec.STATS64, list(zip(codec.STATS64, values, strict=True)))
    stats64 += codec.nla(6, (7).to_bytes(8, "little")) + codec.nla(11, b"")
    attrs = [
        ("addr", ip_address("10.244.0.5")),
        ("port", 8080),
        ("fwd_method", 0),
        ("weight", 1),
        ("u_thresh", 0),
        ("l_thresh", 0),
        ("active_conns", counts[0]),
        ("inact_conns", counts[1]),
        ("stats", codec.nla(1, (99).to_bytes(4, "little"))),
        ("addr_family", socket.AF_INET),
        ("stats64", stats64),
    ]
    nest = codec.pack(codec.COMMAND, [("dest", codec.pack(codec.DEST, attrs))])
    (payload,) = codec.dumped([codec.message(FAMILY, 5, nest, seq=2, flags=2)])
    key, traffic = codec.decode_dest_traffic(payload, socket.AF_INET)
    assert key == RSKey(ip_address("10.244.0.5"), 8080)
    assert traffic == DestTraffic(counts[0], counts[1], Counters(*values))


def test_a_dumped_service_decodes_its_counters():
    vs = VirtualServer(VSKey(ip_address("10.96.0.1"), 80, Proto.TCP))
    stats64 = codec.pack(codec.STATS64, [("conns", 3), ("inbytes", 2**40)])
    (payload,) = codec.dumped([dumped_service(vs, stats64=stats64)])
    assert codec.decode_service_traffic(payload) == (vs.key, Counters(3, 0, 0, 2**40, 0))
    (payload,) = codec.dumped([dumped_service(vs)])
    assert codec.decode_service_traffic(payload) == (vs.key, Counters())


def test_delete_service_carries_only_the_key():
    key = VSKey(ip_address("fd00::1"), 443, Proto.SCTP)
    cmd, attrs = codec.encode_op(DeleteService(key))
    inner = codec.unpack(codec.SERVICE, codec.unpack(codec.COMMAND, memoryview(attrs))["service"])
    assert cmd == codec.CMD_DEL_SERVICE
    assert set(inner) == {"af", "protocol", "addr", "port"}
    assert bytes(inner["addr"]) == key.address.packed


@pytest.mark.parametrize(("version", "mask"), [(4, 0xFFFFFFFF), (6, 128)])
def test_netmask_by_family(version, mask):
    addr = ip_address("10.0.0.1" if version == 4 else "fd00::1")
    attrs = codec.service_attrs(VirtualServer(VSKey(addr, 1, Proto.TCP)))
    assert codec.unpack(codec.SERVICE, memoryview(attrs))["netmask"] == mask


def test_messages_and_errors_parse():
    ack = (
        codec._NLMSGHDR.pack(36, codec.NLMSG_ERROR, 0, 9, 0)
        + (-3).to_bytes(4, "little", signed=True)
        + b"\0" * 16
    )
    ((kind, _, seq, payload),) = list(codec.messages(ack))
    assert (kind, seq, codec.error_code(payload)) == (codec.NLMSG_ERROR, 9, 3)


@settings(max_examples=300, deadline=None)
@given(
    version=st.sampled_from([4, 6]),
    data=st.data(),
    counts=st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)),
    flags=st.sampled_from([0, 0x0100, 0x1000]),
)
def test_a_destination_as_the_kernel_dumps_it_decodes_in_one_run(version, data, counts, flags):
    """The kernel's own layout takes the compiled run (`Run.unpack`); it decodes to what the
    attribute-by-attribute path gives, which any other layout takes."""
    rs = data.draw(real_servers(version, forwards=st.sampled_from(list(Forward))))
    thresholds = data.draw(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)))
    rs = replace(rs, upper_threshold=thresholds[0], lower_threshold=thresholds[1])
    af = socket.AF_INET6 if version == 6 else socket.AF_INET
    (payload,) = codec.dumped([kernel_dest(rs, active=counts[0], inactive=counts[1], flags=flags)])
    assert codec._DUMPED_DEST_RUN.unpack(payload, 4) is not None
    assert codec.decode_dest(payload, af) == (rs, *counts)
    assert codec._decode_dest_attributes(payload, af) == (rs, *counts)


def test_a_destination_in_another_layout_is_decoded_attribute_by_attribute():
    """An older kernel (no tunnel attributes), another order, a longer address: not the run."""
    rs = RealServer(RSKey(ip_address("10.244.0.7"), 8080), weight=3)
    old = [
        ("addr", ip_address(rs.key.address.packed.ljust(16, b"\0"))),
        ("port", 8080),
        ("fwd_method", 0),
        ("weight", 3),
        ("u_thresh", 0),
        ("l_thresh", 0),
        ("active_conns", 2),
        ("inact_conns", 1),
    ]
    for attrs in (old, old[::-1]):
        nest = codec.nla(codec.COMMAND["dest"].kind, codec.pack(codec.DEST, attrs))
        (payload,) = codec.dumped([codec.message(FAMILY, 5, nest, seq=2, flags=2)])
        assert codec._DUMPED_DEST_RUN.unpack(payload, 4) is None
        assert codec.decode_dest(payload, socket.AF_INET) == (rs, 2, 1)
    (payload,) = codec.dumped([kernel_dest(rs)[:-200]])  # cut short: never read past the end
    assert codec._DUMPED_DEST_RUN.unpack(payload[:40], 4) is None


def test_the_kernel_layout_carries_the_counters():
    rs = RealServer(RSKey(ip_address("fd00::7"), 53))
    counters = Counters(7, 2**33, 5, 2**40, 9)
    (payload,) = codec.dumped([kernel_dest(rs, active=1, counters=counters)])
    assert codec.decode_dest_traffic(payload, socket.AF_INET6) == (
        rs.key,
        DestTraffic(1, 0, counters),
    )
