"""One persistent generic-netlink socket to the kernel's IPVS family, with batched writes.

Why hand-written (see codec.py for the encoding side): a sync writes thousands of requests.
`ipvsadm -R` opens a socket and resolves the family per line; one request+ack at a time
costs a round trip each. Here many requests go out in one `send()` with the ack flag only
on the last one (nlsocket.py, shared with rtnl.py's address changes): a first sync writes a
whole table in a fraction of `ipvsadm -R`'s time (docs/performance.md).

Imports: codec, nlsocket, errors, the standard library.
"""

from __future__ import annotations

import errno
import struct
from collections.abc import Sequence

from ipvsproxy.errors import KernelError, KernelUnavailable
from ipvsproxy.netlink import codec
from ipvsproxy.netlink.nlsocket import BATCH_BYTES, NetlinkSocket, io_error, os_error

__all__ = ["BATCH_BYTES", "GenlSocket", "os_error"]

NETLINK_GENERIC = 16
# genlmsghdr (cmd, version, reserved) per command, packed once
_GENL_HEADS = tuple(struct.pack("=BBH", cmd, codec.IPVS_GENL_VERSION, 0) for cmd in range(256))


class GenlSocket(NetlinkSocket):
    """Requests and dumps for one generic-netlink family (here: "IPVS")."""

    WHAT = "generic netlink"

    def __init__(self, family_name: str = "IPVS") -> None:
        super().__init__(NETLINK_GENERIC, "generic netlink")
        try:
            self.family = self._resolve(family_name)
        except OSError as exc:
            self._sock.close()
            raise KernelUnavailable(
                f"resolving family {family_name!r}: {io_error(exc, 'generic netlink')}"
            ) from exc
        except BaseException:
            self._sock.close()
            raise

    def _resolve(self, name: str) -> int:
        seq = self._next_seq()
        self._sock.send(codec.getfamily_request(name, seq=seq))
        for kind, _, _, payload in self._replies(seq):
            if kind == codec.NLMSG_ERROR:
                code = codec.error_code(payload)
                if code == errno.ENOENT:
                    raise KernelUnavailable(
                        f"the kernel has no {name} (generic netlink family {name!r} not found;"
                        " is the ip_vs module loaded?)"
                    )
                raise KernelUnavailable(f"resolving family {name!r}: {os_error(code)}")
            found = codec.genl_attrs(payload)
            if codec.CTRL_ATTR_FAMILY_ID in found:
                return codec.u16(found[codec.CTRL_ATTR_FAMILY_ID])
        raise KernelUnavailable(f"no answer resolving generic netlink family {name!r}")

    def batch(self, requests: Sequence[tuple[int, bytes]]) -> list[int]:
        """Send (command, attributes) requests in order; the errno of each (0 = done)."""
        family, request, heads = self.family, codec.NLM_F_REQUEST, _GENL_HEADS
        return self.send_batch([(family, request, heads[cmd], attrs) for cmd, attrs in requests])

    def request(self, cmd: int, attrs: bytes) -> None:
        """One request; KernelError if the kernel refuses it."""
        (code,) = self.batch([(cmd, attrs)])
        if code:
            raise KernelError(os_error(code))

    def dump_raw(self, cmd: int, attrs: bytes = b"") -> list[bytes]:
        """The received datagrams of a dump (see NetlinkSocket.dump)."""
        return self.dump(self.family, _GENL_HEADS[cmd] + attrs)
