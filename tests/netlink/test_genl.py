"""GenlSocket's dump loop against scripted datagrams (a datagram socket pair as the kernel)."""

from __future__ import annotations

import socket
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipvsproxy.errors import KernelError
from ipvsproxy.netlink import codec
from ipvsproxy.netlink import genl as genl_module
from ipvsproxy.netlink.genl import GenlSocket
from tests.support import ScriptedKernel, error


@pytest.fixture
def scripted():
    """A GenlSocket whose kernel sends the given datagrams, in order."""
    pairs: list[socket.socket] = []

    def make(*datagrams: bytes) -> GenlSocket:
        ours, kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        pairs.extend((ours, kernel))
        for datagram in datagrams:
            kernel.send(datagram)
        genl = GenlSocket.__new__(GenlSocket)
        genl._sock, genl._seq, genl._recv, genl.family = ours, 0, bytearray(65536), 0x20
        return genl

    yield make
    for sock in pairs:
        sock.close()


def data(seq: int, n: int) -> bytes:
    return b"".join(
        codec.message(0x20, codec.CMD_NEW_DEST, struct.pack("=HHI", 8, 1, i), seq=seq, flags=2)
        for i in range(n)
    )


def done(seq: int, errno: int = 0, *, extra: bytes = b"") -> bytes:
    return struct.pack("=IHHIIi", 20 + len(extra), codec.NLMSG_DONE, 2, seq, 0, -errno) + extra


@pytest.mark.parametrize(
    "datagrams",
    [
        [done(1)],  # an empty dump
        [data(1, 3), done(1)],  # the kernel's usual two datagrams
        [data(1, 3) + done(1)],  # DONE after data in one datagram
        [data(1, 2), data(1, 5), done(1)],
        [done(1, extra=b"\0" * 8)],  # a DONE longer than 20 bytes (extended ack)
    ],
)
def test_a_dump_ends_at_its_done_and_keeps_every_datagram(scripted, datagrams):
    genl = scripted(*datagrams, data(9, 1))  # what follows belongs to no dump
    assert genl.dump_raw(codec.CMD_GET_DEST) == datagrams


def test_a_refused_dump_and_a_failed_dump_are_errors(scripted):
    with pytest.raises(KernelError, match="EINVAL"):
        scripted(error(1, 22)).dump_raw(codec.CMD_GET_DEST)
    # DONE carries the dump's -errno
    with pytest.raises(KernelError, match="EMSGSIZE"):
        scripted(data(1, 2), done(1, 90)).dump_raw(codec.CMD_GET_DEST)


@settings(max_examples=60, deadline=None)
@given(
    count=st.integers(1, 3000),
    start=st.sampled_from([0, 7, 0xFFFFFFFF - 5, 0xFFFFFFFE]),  # incl. wrapping past 0
    data=st.data(),
)
def test_every_refusal_maps_back_to_its_request_across_sends(count, start, data):
    refuse = data.draw(st.dictionaries(st.integers(0, count - 1), st.sampled_from([2, 3, 17])))

    def answer(position: int, kind: int, _: memoryview) -> int:
        assert kind == 0x20
        return int(refuse.get(position, 0))

    kernel = ScriptedKernel(answer)
    genl = GenlSocket.__new__(GenlSocket)
    genl._sock = kernel  # type: ignore[assignment]
    genl._seq, genl._recv, genl.family = start, bytearray(65536), 0x20
    requests = [(codec.CMD_NEW_DEST, struct.pack("=HHI", 8, 1, i) * 20) for i in range(count)]
    assert genl.batch(requests) == [refuse.get(i, 0) for i in range(count)]
    assert kernel.seen == count
    assert all(len(sent) <= genl_module.BATCH_BYTES for sent in kernel.sends)
    assert len(kernel.sends) == -(-count * 180 // genl_module.BATCH_BYTES)  # full sends
    seqs = [seq for sent in kernel.sends for _, _, seq, _ in codec.messages(sent)]
    assert 0 not in seqs
    assert len(set(seqs)) == count
