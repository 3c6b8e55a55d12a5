"""The fast codec paths must equal the reference codec exactly."""

from __future__ import annotations

import socket
import struct
from ipaddress import ip_address

from hypothesis import given, settings
from hypothesis import strategies as st

from ipvsproxy.model import (
    AddDest,
    AddService,
    DeleteDest,
    DeleteService,
    Proto,
    RealServer,
    RSKey,
    UpdateDest,
    UpdateService,
    VSKey,
)
from ipvsproxy.netlink import codec, fast
from tests.strategies import real_servers, virtual_servers

FORWARDS = st.sampled_from([0, 1, 2, 3])


@st.composite
def dest_ops(draw):
    vs = draw(virtual_servers())
    rs = draw(real_servers(vs.key.address.version))
    kind = draw(
        st.sampled_from([AddDest, UpdateDest, DeleteDest, AddService, UpdateService, DeleteService])
    )
    if kind is DeleteDest:
        return DeleteDest(vs.key, rs.key)
    if kind in (AddService, UpdateService):
        return kind(vs)
    if kind is DeleteService:
        return DeleteService(vs.key)
    return kind(vs.key, rs)


@settings(max_examples=300, deadline=None)
@given(st.lists(dest_ops(), max_size=20))
def test_encode_ops_equals_the_reference(ops):
    assert fast.encode_ops(ops) == [codec.encode_op(op) for op in ops]


def u32(kind: int, value: int) -> bytes:
    return codec.nla(kind, struct.pack("=I", value))


def kernel_dest(rs: RealServer, *, layout: str, active: int = 0, inactive: int = 0) -> bytes:
    """A dumped destination as a kernel fills it: 6.1 (tunnel attributes, family) or 4.19.

    "swapped" is 6.1 with weight before forwarding method: a layout of the same size that
    no decoder may take for the learnt one.
    """
    af = socket.AF_INET6 if rs.key.address.version == 6 else socket.AF_INET
    head = codec.nla(codec.DEST_ADDR, rs.key.address.packed.ljust(16, b"\0")) + codec.nla(
        codec.DEST_PORT, struct.pack("!H", rs.key.port)
    )
    pair = [u32(codec.DEST_FWD_METHOD, rs.forward), u32(codec.DEST_WEIGHT, rs.weight)]
    if layout == "swapped":
        layout = "6.1"
        pair.reverse()
    head += b"".join(pair)
    if layout == "6.1":
        head += codec.nla(13, b"\0") + codec.nla(14, b"\0\0") + codec.nla(15, b"\0\0")
    head += u32(codec.DEST_U_THRESH, rs.upper_threshold) + u32(
        codec.DEST_L_THRESH, rs.lower_threshold
    )
    head += u32(codec.DEST_ACTIVE_CONNS, active) + u32(codec.DEST_INACT_CONNS, inactive)
    head += u32(9, 0)
    if layout == "6.1":
        head += codec.nla(codec.DEST_ADDR_FAMILY, struct.pack("=H", af))
    stats = codec.nest(10, b"".join(u32(i, i) for i in range(1, 11)))
    return codec.message(
        0x20, codec.CMD_GET_DEST, codec.nest(codec.CMD_ATTR_DEST, head + stats), seq=9, flags=2
    )


DONE = struct.pack("=IHHII", 20, codec.NLMSG_DONE, 2, 9, 0) + b"\0" * 4


@settings(max_examples=200, deadline=None)
@given(
    version=st.sampled_from([4, 6]),
    data=st.data(),
    layouts=st.lists(st.sampled_from(["6.1", "4.19"]), min_size=1, max_size=8),
)
def test_dest_decoder_equals_the_reference_whatever_the_layout(version, data, layouts):
    rss = [
        data.draw(real_servers(version, st.sampled_from(list(range(4))).map(_forward)))
        for _ in layouts
    ]
    counts = [data.draw(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 9))) for _ in layouts]
    af = socket.AF_INET6 if version == 6 else socket.AF_INET
    messages = [
        kernel_dest(rs, layout=lay, active=a, inactive=i)
        for rs, lay, (a, i) in zip(rss, layouts, counts, strict=True)
    ]
    # split across receive buffers like the kernel may
    cut = data.draw(st.integers(0, len(messages)))
    chunks = [b"".join(messages[:cut]), b"".join(messages[cut:]) + DONE]
    decoder = fast.DestDecoder()
    got = decoder.decode(chunks, af)
    want = [
        codec.decode_dest(codec.genl_attrs(payload)[codec.CMD_ATTR_DEST], af)
        for chunk in chunks
        for kind, _, _, payload in codec.messages(chunk)
        if kind != codec.NLMSG_DONE
    ]
    assert got == want
    assert [rs for rs, _, _ in got] == rss
    assert [(a, i) for _, a, i in got] == counts


@settings(max_examples=200, deadline=None)
@given(
    version=st.sampled_from([4, 6]),
    data=st.data(),
    layouts=st.lists(st.sampled_from(["6.1", "4.19"]), min_size=1, max_size=8),
)
def test_mapping_equals_the_reference_whatever_the_layout(version, data, layouts):
    """A first observation decodes settings bytes alone; a foreign layout falls back."""
    layouts = [data.draw(st.sampled_from(["6.1", "4.19", "swapped"])) for _ in layouts]
    rss = data.draw(
        st.lists(
            real_servers(version, st.sampled_from(list(range(4))).map(_forward)),
            min_size=len(layouts),
            max_size=len(layouts),
            unique_by=lambda r: r.key,
        )
    )
    af = socket.AF_INET6 if version == 6 else socket.AF_INET
    messages = [kernel_dest(rs, layout=lay) for rs, lay in zip(rss, layouts, strict=True)]
    decoder = fast.DestDecoder()
    decoder.start_round()
    if data.draw(st.booleans(), label="layout learnt before"):
        teacher = RealServer(RSKey(ip_address("192.0.2.1" if version == 4 else "2001:db8::1"), 1))
        assert decoder.mapping([kernel_dest(teacher, layout="6.1") + DONE], af) == {
            teacher.key: teacher
        }
    # cut into datagrams as the kernel may: runs of whole messages, DONE at the end
    cuts = sorted(data.draw(st.lists(st.integers(0, len(messages)), max_size=3)))
    bounds = [0, *cuts, len(messages)]
    chunks = [b"".join(messages[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    chunks[-1] += DONE
    assert decoder.mapping(chunks, af) == {rs.key: rs for rs in rss}


def _forward(n: int):
    from ipvsproxy.model import Forward

    return Forward(n)


@settings(max_examples=100, deadline=None)
@given(
    version=st.sampled_from([4, 6]),
    data=st.data(),
    rounds=st.integers(2, 4),
)
def test_mapping_across_observations_equals_the_reference(version, data, rounds):
    """Reused objects must never hide a change: weights and counters change between rounds."""
    af = socket.AF_INET6 if version == 6 else socket.AF_INET
    decoder = fast.DestDecoder()
    pool = data.draw(
        st.lists(real_servers(version), min_size=1, max_size=6, unique_by=lambda r: r.key)
    )
    for _ in range(rounds):
        chosen = data.draw(st.lists(st.sampled_from(pool), unique_by=lambda r: r.key, max_size=6))
        reweighted = [RealServer(rs.key, data.draw(st.integers(0, 3)), rs.forward) for rs in chosen]
        chunk = (
            b"".join(
                kernel_dest(rs, layout="6.1", active=data.draw(st.integers(0, 5)))
                for rs in reweighted
            )
            + DONE
        )
        decoder.start_round()
        assert decoder.mapping([chunk], af) == {rs.key: rs for rs in reweighted}


def test_service_decoder_reuses_only_identical_services():
    from ipaddress import ip_address

    from ipvsproxy.model import Proto, ServiceFlags, VirtualServer, VSKey
    from ipvsproxy.schedulers import Scheduler

    def dumped(vs):
        flags = int(vs.flags) | ServiceFlags.HASHED
        attrs = codec.service_key_attrs(vs.key) + codec.nla(
            codec.SVC_SCHED_NAME, vs.scheduler.value.encode() + b"\0"
        )
        attrs += codec.nla(codec.SVC_FLAGS, struct.pack("=II", flags, 0xFFFFFFFF))
        attrs += u32(codec.SVC_TIMEOUT, vs.timeout_s) + u32(codec.SVC_NETMASK, 0xFFFFFFFF)
        attrs += codec.nest(codec.SVC_STATS, u32(1, 99))
        return codec.message(0x20, 1, codec.nest(codec.CMD_ATTR_SERVICE, attrs), seq=3, flags=2)

    key = VSKey(ip_address("10.96.0.1"), 80, Proto.TCP)
    a, b = VirtualServer(key, Scheduler.RR), VirtualServer(key, Scheduler.SH)
    decoder = fast.ServiceDecoder()
    assert decoder.decode([dumped(a) + DONE]) == [a]
    assert decoder.decode([dumped(a) + DONE]) == [a]
    assert decoder.decode([dumped(b) + DONE]) == [b]
    unknown = dumped(a).replace(b"rr\0", b"zz\0")
    assert decoder.decode([unknown + DONE]) == []


def test_unlisted_skips_exactly_the_services_getsockopt_lists():
    """IPv4 address/port services are skipped undecoded; IPv6 and firewall-mark ones (of
    either family) are decoded (the real kernel's layout: integration/test_netlink.py)."""

    def dumped(key: VSKey) -> bytes:
        attrs = codec.service_key_attrs(key) + codec.nla(codec.SVC_SCHED_NAME, b"rr\0")
        attrs += codec.nla(codec.SVC_FLAGS, struct.pack("=II", 0, 0xFFFFFFFF))
        attrs += u32(codec.SVC_TIMEOUT, 0)
        return codec.message(0x20, 1, codec.nest(codec.CMD_ATTR_SERVICE, attrs), seq=3, flags=2)

    keys = [
        VSKey(ip_address("10.96.0.1"), 80, Proto.TCP),
        VSKey(ip_address("fd00::1"), 80, Proto.TCP),
        VSKey(ip_address("0.0.0.0"), 0, Proto.TCP, fwmark=7),
        VSKey(ip_address("::"), 0, Proto.TCP, fwmark=8),
        VSKey(ip_address("10.96.0.2"), 53, Proto.UDP),
    ]
    chunk = b"".join(map(dumped, keys)) + DONE
    assert [vs.key for vs in fast.ServiceDecoder().decode([chunk])] == keys
    unlisted = fast.ServiceDecoder().decode([chunk], unlisted=True)
    assert [vs.key for vs in unlisted] == [keys[1], keys[2], keys[3]]
