"""Dumped IPVS messages laid out exactly as the kernel writes them (ip_vs_genl_fill_dest,
Linux 5.3 and later: the tunnel attributes, the address family, then the 32-bit and 64-bit
statistics; the nest opened without NLA_F_NESTED), for the codec's tests and bench/kept.py."""

from __future__ import annotations

import socket
from ipaddress import ip_address

from ipvsproxy.model import Counters, RealServer
from ipvsproxy.netlink import codec

FAMILY = 0x1D
ZERO = Counters()
_RATES = b"".join(codec.nla(kind, bytes(8)) for kind in range(6, 11))  # cps .. outbps


def kernel_dest(
    rs: RealServer,
    *,
    active: int = 0,
    inactive: int = 0,
    flags: int = 0,
    counters: Counters = ZERO,
) -> bytes:
    """One GET_DEST reply message. `flags`: connection flags beside the forwarding method."""
    af = socket.AF_INET6 if rs.key.address.version == 6 else socket.AF_INET
    c = counters
    stats32 = b"".join(
        codec.nla(kind, value.to_bytes(size, "little"))
        for kind, value, size in (
            (1, c.connections & 0xFFFFFFFF, 4),
            (2, c.packets_in & 0xFFFFFFFF, 4),
            (3, c.packets_out & 0xFFFFFFFF, 4),
            (4, c.bytes_in, 8),
            (5, c.bytes_out, 8),
            *((kind, 0, 4) for kind in range(6, 11)),  # the kernel's rate estimates
        )
    )
    stats64 = codec.pack(
        codec.STATS64,
        [
            ("conns", c.connections),
            ("inpkts", c.packets_in),
            ("outpkts", c.packets_out),
            ("inbytes", c.bytes_in),
            ("outbytes", c.bytes_out),
        ],
    )
    attrs = codec.pack(
        codec.DEST,
        [
            ("addr", ip_address(rs.key.address.packed.ljust(16, b"\0"))),
            ("port", rs.key.port),
            ("fwd_method", int(rs.forward) | flags),
            ("weight", rs.weight),
            ("tun_type", 0),
            ("tun_port", 0),
            ("tun_flags", 0),
            ("u_thresh", rs.upper_threshold),
            ("l_thresh", rs.lower_threshold),
            ("active_conns", active),
            ("inact_conns", inactive),
            ("persist_conns", 0),
            ("addr_family", af),
            ("stats", stats32),
            ("stats64", stats64 + _RATES),
        ],
    )
    return codec.message(FAMILY, 5, codec.nla(codec.COMMAND["dest"].kind, attrs), seq=2, flags=2)
