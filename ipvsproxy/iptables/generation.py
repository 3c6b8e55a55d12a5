"""nf_tables' ruleset generation: has any rule of this network namespace changed since?

Owns: `RulesetGeneration` (one request, NFT_MSG_GETGEN, answered with NFTA_GEN_ID) and
`SavedAt`, what was read from `iptables-save` kept while the generation stays (the firewall's
chains and the fallback's saves both use it).

Why: a periodic resync must notice a firewall chain changed behind ipvsproxy's back, and
reading the chains back is four `iptables-save` processes (two families, two tables), each
printing the node's whole ruleset (kubelet's, the CNI plugin's), every sync period, for
chains that hardly ever change. The iptables-nft tools write
through nf_tables, whose every committed transaction (any table, any family, anyone's) raises
one counter per network namespace (net/netfilter/nf_tables_api.c, `nft_net->base_seq`,
reported by NFT_MSG_GETGEN). Read before a save, the counter says whether a later save
could differ: equal -> nothing was committed since, the saved chains still hold. Any
other agent's write (kubelet, a CNI plugin, our own restores) merely costs a real save.

Only meaningful when the iptables tools are the nf_tables variant (their save output says
`(nf_tables)`, `nf_tables()`); legacy xtables tables do not move the counter, so nothing
read from their saves is kept.

Imports: netlink.nlsocket (the one netlink socket), netlink.codec (framing), errors.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from ipvsproxy.errors import KernelError
from ipvsproxy.netlink import codec
from ipvsproxy.netlink.nlsocket import NetlinkSocket

NETLINK_NETFILTER = 12
NFNL_SUBSYS_NFTABLES = 10
NFT_MSG_NEWGEN, NFT_MSG_GETGEN = 15, 16
NFTA_GEN_ID = 1
_NFGEN = struct.Struct("=BBH")  # nfgenmsg: family, version, res_id (big-endian)

T = TypeVar("T")


class RulesetGeneration:
    """The nf_tables generation id of the network namespace this was opened in."""

    def __init__(self, sock: NetlinkSocket | None) -> None:
        self._sock = sock

    @classmethod
    def open(cls) -> RulesetGeneration:
        """Never fails: without a socket `current()` answers None (always save)."""
        try:
            return cls(NetlinkSocket(NETLINK_NETFILTER, "netfilter netlink"))
        except KernelError:
            return cls(None)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def current(self) -> int | None:
        """The generation id, or None when it cannot be read (nf_tables not loaded, ...)."""
        if self._sock is None:
            return None
        kind = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETGEN
        request = (kind, codec.NLM_F_REQUEST, _NFGEN.pack(socket.AF_UNSPEC, 0, 0), b"")
        try:
            code, answers = self._sock.ask(request)
        except KernelError:
            return None
        return None if code else generation_of(answers)


def generation_of(answers: Sequence[tuple[int, bytes]]) -> int | None:
    """NFTA_GEN_ID of the NFT_MSG_NEWGEN among a request's answers (None: none)."""
    for kind, payload in answers:
        if kind != (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWGEN:
            continue
        found = codec.attrs(memoryview(payload), _NFGEN.size).get(NFTA_GEN_ID)
        if found is not None and len(found) >= 4:
            return int(struct.unpack_from("!I", found)[0])
    return None


def nf_tables(save: str) -> bool:
    """Whether an `iptables-save` output comes from the nf_tables variant of the tools (its
    first line says so): only then does the generation move with its rules."""
    return "(nf_tables)" in save[: save.find("\n") + 1]


class SavedAt(Generic[T]):
    """What was read from `iptables-save` outputs, kept with the nf_tables generation read
    before the saves: asked again at the same generation, nothing was committed since and
    it still holds, so no tool runs."""

    def __init__(self) -> None:
        self._kept: tuple[int, T] | None = None

    def read(self, generation: int | None, save: Callable[[], tuple[T, bool]]) -> T:
        """The value kept at `generation` (read before calling this), else `save()`'s.
        `save` returns its value and whether every output it read was `nf_tables()`'s; the
        value is kept only then, and only with a generation (None: it could not be read)."""
        if generation is not None and self._kept is not None and self._kept[0] == generation:
            return self._kept[1]
        value, nft = save()
        self._kept = (generation, value) if generation is not None and nft else None
        return value
