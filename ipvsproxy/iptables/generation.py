"""nf_tables' ruleset generation: has any rule of this network namespace changed since?

Owns: `RulesetGeneration` (one request, NFT_MSG_GETGEN, answered with NFTA_GEN_ID).

Why: a periodic resync must notice a firewall chain changed behind ipvsproxy's back, and
reading the chains back is four `iptables-save` processes (two families, two tables): about
3 s in the test VM at 1,000 Services, most of an idle resync. The iptables-nft tools write
through nf_tables, whose every committed transaction (any table, any family, anyone's) raises
one counter per network namespace (net/netfilter/nf_tables_api.c, `nft_net->base_seq`,
reported by NFT_MSG_GETGEN). Read before a save, the counter says whether a later save
could differ: equal -> nothing was committed since, the saved chains still hold. Any
other agent's write (kubelet, a CNI plugin, our own restores) merely costs a real save.

Only meaningful when the iptables tools are the nf_tables variant (their save output says
`(nf_tables)`); legacy xtables tables do not move the counter, so callers check that first.

Imports: the standard library only.
"""

from __future__ import annotations

import socket
import struct

NETLINK_NETFILTER = 12
NFNL_SUBSYS_NFTABLES = 10
NFT_MSG_NEWGEN, NFT_MSG_GETGEN = 15, 16
NFTA_GEN_ID = 1
NLM_F_REQUEST, NLM_F_ACK = 0x1, 0x4
NLMSG_ERROR = 2
_HEADER = struct.Struct("=IHHII")  # nlmsghdr
_NFGEN = struct.Struct("=BBH")  # nfgenmsg: family, version, res_id (big-endian)
_ATTR = struct.Struct("=HH")


class RulesetGeneration:
    """The nf_tables generation id of the network namespace this was opened in."""

    def __init__(self, sock: socket.socket | None) -> None:
        self._sock = sock
        self._seq = 0

    @classmethod
    def open(cls) -> RulesetGeneration:
        """Never fails: without a socket `current()` answers None (always save)."""
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        except OSError:
            return cls(None)
        try:
            sock.bind((0, 0))
            sock.settimeout(5.0)
        except OSError:
            sock.close()
            return cls(None)
        return cls(sock)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def current(self) -> int | None:
        """The generation id, or None when it cannot be read (nf_tables not loaded, ...)."""
        if self._sock is None:
            return None
        self._seq += 1
        body = _NFGEN.pack(socket.AF_UNSPEC, 0, 0)
        kind = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETGEN
        request = _HEADER.pack(_HEADER.size + len(body), kind, NLM_F_REQUEST, self._seq, 0)
        try:
            self._sock.send(request + body)
            while True:
                data = self._sock.recv(65536)
                found = _parse(data, self._seq)
                if found != "other":
                    return found if isinstance(found, int) else None
        except OSError:
            return None


def _parse(data: bytes, seq: int) -> int | str | None:
    """The generation id in a reply to `seq`; None: an error reply; "other": not ours."""
    at = 0
    while at + _HEADER.size <= len(data):
        size, kind, _, got, _ = _HEADER.unpack_from(data, at)
        if size < _HEADER.size:
            return None
        message = data[at + _HEADER.size : at + size]
        at += (size + 3) & ~3
        if got != seq:
            continue
        if kind == NLMSG_ERROR:
            return None
        if kind != (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWGEN:
            continue
        pos = _NFGEN.size
        while pos + _ATTR.size <= len(message):
            length, attr = _ATTR.unpack_from(message, pos)
            if length < _ATTR.size:
                return None
            if attr & 0x3FFF == NFTA_GEN_ID and length >= _ATTR.size + 4:
                return int(struct.unpack_from("!I", message, pos + _ATTR.size)[0])
            pos += (length + 3) & ~3
        return None
    return "other"
