"""Sets read over netlink (firewall/set_reader.py): entries decoded as `ipset save` prints them."""

from __future__ import annotations


def nla(kind: int, payload: bytes, flags: int = 0) -> bytes:
    size = 4 + len(payload)
    return (size.to_bytes(2, "little") + (kind | flags).to_bytes(2, "little") + payload
            + b"\0" * (-size % 4))  # fmt: skip


NESTED, NET = 0x8000, 0x4000


def test_entries_decoded_as_ipset_save_prints_them():
    """Attributes as the 6.18 kernel dumped them (captured from a throw-away netns)."""
    from ipvsproxy.firewall.set_reader import decode_entry

    def ip(hexa: str, family: int = 1) -> bytes:
        return nla(family, bytes.fromhex(hexa))

    loop = (nla(1, ip("0af40103"), NESTED) + nla(20, ip("0af40103"), NESTED)
            + nla(4, bytes.fromhex("0035"), NET) + nla(7, b"\x11"))  # fmt: skip
    assert decode_entry(loop) == "10.244.1.3,udp:53,10.244.1.3"
    net = (nla(1, ip("cb00710a"), NESTED) + nla(20, ip("c0000200"), NESTED)
           + nla(4, bytes.fromhex("01bb"), NET) + nla(21, b"\x18") + nla(7, b"\x06"))  # fmt: skip
    assert decode_entry(net) == "203.0.113.10,tcp:443,192.0.2.0/24"
    host = (nla(1, ip("cb00710a"), NESTED) + nla(20, ip("c6336407"), NESTED)
            + nla(4, bytes.fromhex("01bb"), NET) + nla(21, b"\x20") + nla(7, b"\x84"))  # fmt: skip
    assert decode_entry(host) == "203.0.113.10,sctp:443,198.51.100.7"  # /32 printed bare
    v6 = nla(1, ip("fd000096000000000000000000000001", 2), NESTED)
    assert decode_entry(v6) == "fd00:96::1"
    cluster = nla(1, ip("0a600001"), NESTED) + nla(4, bytes.fromhex("0050"), NET) + nla(7, b"\x06")
    assert decode_entry(cluster) == "10.96.0.1,tcp:80"
