"""The one netlink socket, with batched requests, single requests and raw dumps: what genl.py
(IPVS), rtnl.py (addresses, the dummy link), the firewall's ipset reader and writer and the
nf_tables generation check (netfilter netlink) share.

Why batched: a sync can write thousands of requests, and one request + ack at a time costs a
round trip each. Here many requests go out in one `send()` (up to BATCH_BYTES), the ack
flag set only on the last one: the kernel processes them in order and answers every failed
request with an NLMSG_ERROR carrying its sequence number (netlink_rcv_skb acks on error even
without NLM_F_ACK), so each failure maps back to its request.

Dumps cannot be batched: one dump may be in flight per socket (EBUSY otherwise).

Imports: codec, errors, the standard library.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
from collections.abc import Callable, Sequence
from typing import Concatenate, ParamSpec, TypeVar

from ipvsproxy.errors import KernelError, KernelUnavailable
from ipvsproxy.netlink import codec

SOL_NETLINK = 270
NETLINK_CAP_ACK = 10  # acks without the original request: shorter replies
BATCH_BYTES = 256 * 1024
_HEADER = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_ERRNO = struct.Struct("=i")
RCVBUF = 32 * 1024 * 1024
SNDBUF = 8 * 1024 * 1024
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33

Request = tuple[int, int, bytes, bytes]
"""(message type, flags, fixed header after nlmsghdr, attributes): both parts a multiple of
4 bytes long (netlink attributes are padded), so messages need no padding between them."""


_P = ParamSpec("_P")
_R = TypeVar("_R")
_S = TypeVar("_S", bound="NetlinkSocket")


def _mapped_io(
    method: Callable[Concatenate[_S, _P], _R],
) -> Callable[Concatenate[_S, _P], _R]:
    """A request method whose failed send() or recv() (ENOBUFS, EPERM, a closed socket)
    raises the project's error, the OSError chained: callers handle KernelError alone."""

    def mapped(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return method(self, *args, **kwargs)
        except OSError as exc:
            raise io_error(exc, f"{self.WHAT} {method.__name__}") from exc

    mapped.__name__, mapped.__doc__ = method.__name__, method.__doc__
    return mapped


def io_error(exc: OSError, what: str) -> KernelError:
    """The project's error for an OSError of a netlink socket's own calls (not an errno
    the kernel answered a request with): KernelUnavailable when we may not use it at all."""
    code = exc.errno or 0
    text = f"{what}: {os_error(code) if code else exc}"
    if code in (errno.EPERM, errno.EACCES, errno.EPROTONOSUPPORT, errno.EAFNOSUPPORT):
        return KernelUnavailable(text)
    return KernelError(text)


class NetlinkSocket:
    """A bound netlink socket of one protocol (NETLINK_GENERIC, NETLINK_ROUTE, ...).

    Its request methods raise KernelError (never OSError) when the socket itself fails."""

    WHAT = "netlink"  # names the socket in errors (each socket's own `what` once opened)

    def __init__(self, protocol: int, what: str, *, echo: bool = False) -> None:
        """`what` names the socket in errors ("rtnetlink", "ipset over netlink"). `echo`:
        error replies carry the refused request (the kernel's default; ipset writes the
        number of the refused entry into it); otherwise they are cut short."""
        self.WHAT = what
        try:
            self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, protocol)
        except OSError as exc:
            raise KernelUnavailable(f"cannot open a {what} socket: {exc}") from exc
        self._seq = 0
        self._recv = bytearray(4 * 1024 * 1024)
        try:
            self._buffers(echo=echo)
            self._sock.bind((0, 0))
        except OSError as exc:
            self._sock.close()
            raise io_error(exc, f"cannot open a {what} socket") from exc
        except BaseException:
            self._sock.close()
            raise

    def close(self) -> None:
        self._sock.close()

    def _buffers(self, *, echo: bool) -> None:
        for force, plain, size in (
            (SO_RCVBUFFORCE, socket.SO_RCVBUF, RCVBUF),
            (SO_SNDBUFFORCE, socket.SO_SNDBUF, SNDBUF),
        ):
            try:  # needs CAP_NET_ADMIN; fall back to what the sysctl maximum allows
                self._sock.setsockopt(socket.SOL_SOCKET, force, size)
            except OSError:
                self._sock.setsockopt(socket.SOL_SOCKET, plain, size)
        if not echo:
            with contextlib.suppress(OSError):  # older kernels: full acks, still correct
                self._sock.setsockopt(SOL_NETLINK, NETLINK_CAP_ACK, 1)

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) & 0xFFFFFFFF or 1
        return self._seq

    def _replies(self, last_seq: int) -> list[tuple[int, int, int, memoryview]]:
        """Messages up to and including the final answer to `last_seq` (error/ack or DONE)."""
        out = []
        while True:
            size = self._sock.recv_into(self._recv)
            data = bytes(self._recv[:size])
            for kind, flags, seq, payload in codec.messages(data):
                out.append((kind, flags, seq, payload))
                if seq == last_seq and (
                    kind in (codec.NLMSG_ERROR, codec.NLMSG_DONE) or not flags & codec.NLM_F_MULTI
                ):
                    return out

    @_mapped_io
    def send_batch(
        self, requests: Sequence[Request], *, refused: dict[int, bytes] | None = None
    ) -> list[int]:
        """Send requests in order; the errno of each (0 = done). With `refused`, the error
        reply's payload of each refused request, by its index.

        Each send carries up to BATCH_BYTES of requests with consecutive sequence numbers,
        the last one asking for an ack; an error's sequence number gives its request's
        position. One loop with the header packed inline: a cold sync sends 10,000s.
        """
        results = [0] * len(requests)
        pack, total, ack = _HEADER.pack, len(requests), codec.NLM_F_ACK
        start = 0
        while start < total:
            parts: list[bytes] = []
            size, index, seq = 0, start, self._seq
            first = (seq + 1) & 0xFFFFFFFF or 1
            while index < total:
                kind, flags, head, attrs = requests[index]
                length = 16 + len(head) + len(attrs)
                if parts and size + length > BATCH_BYTES:
                    break
                seq = (seq + 1) & 0xFFFFFFFF or 1  # 0 is never a request's sequence number
                parts += (pack(length, kind, flags, seq, 0), head, attrs)
                size += length
                index += 1
            kind, flags, head, attrs = requests[index - 1]  # the last asks for the ack
            parts[-3] = pack(16 + len(head) + len(attrs), kind, flags | ack, seq, 0)
            self._seq = seq
            self._sock.send(b"".join(parts))
            count = index - start
            for kind, _, got, payload in self._replies(seq):
                if kind == codec.NLMSG_ERROR:
                    offset = (got - first) & 0xFFFFFFFF
                    if got < first:
                        offset -= 1  # the numbers wrapped past 0, which is skipped
                    if 0 <= offset < count:
                        results[start + offset] = code = codec.error_code(payload)
                        if code and refused is not None:
                            refused[start + offset] = bytes(payload)
            start = index
        return results

    @_mapped_io
    def ask(self, request: Request) -> tuple[int, list[tuple[int, bytes]]]:
        """One request that asks for its ack (as pyroute2 sends every request): its errno
        (0 = done) and the (type, payload) of each message answering it before the ack,
        e.g. the link an RTM_GETLINK asks for. Read up to the ack, so that no late reply is
        left on the socket for the next batch or dump."""
        kind, flags, head, attrs = request
        seq = self._next_seq()
        header = _HEADER.pack(16 + len(head) + len(attrs), kind, flags | codec.NLM_F_ACK, seq, 0)
        self._sock.send(header + head + attrs)
        answers: list[tuple[int, bytes]] = []
        while True:
            size = self._sock.recv_into(self._recv)
            for got, _, got_seq, payload in codec.messages(bytes(self._recv[:size])):
                if got_seq != seq:
                    continue  # not ours (nothing else is in flight on this socket)
                if got == codec.NLMSG_ERROR:
                    code = codec.error_code(payload)
                    return code, answers if not code else []
                answers.append((got, bytes(payload)))

    @_mapped_io
    def dump(self, kind: int, body: bytes) -> list[bytes]:
        """The received datagrams of a dump request (`body`: what follows the nlmsghdr),
        each holding whole messages (the last: DONE).

        A dump is one request and at least two datagrams (the data, then DONE: the kernel
        sends what a dump callback wrote before calling it again). observe() runs one dump
        per service, so this loop looks at two headers per datagram, never at every message:
        the last 20 bytes (DONE, whose payload is 0 or the dump's -errno) and the first
        (an NLMSG_ERROR when the kernel refused the request itself).
        """
        seq = self._next_seq()
        flags = codec.NLM_F_REQUEST | codec.NLM_F_DUMP
        self._sock.send(_HEADER.pack(16 + len(body), kind, flags, seq, 0) + body)
        chunks = []
        view, recv_into, unpack = memoryview(self._recv), self._sock.recv_into, _HEADER.unpack_from
        while True:
            size = recv_into(view)
            data = bytes(view[:size])
            if size < 16 or unpack(data, 0)[3] != seq:
                continue  # late replies to an earlier request that failed midway: not ours
            chunks.append(data)
            if size >= 20:
                length, kind, _, got_seq, _ = unpack(data, size - 20)
                if length == 20 and kind == codec.NLMSG_DONE and got_seq == seq:
                    code = -_ERRNO.unpack_from(data, size - 4)[0]
                    if code > 0:
                        raise KernelError(f"{self.WHAT} dump: {os_error(code)}")
                    return chunks
            if size >= 20:
                length, kind, _, got_seq, _ = unpack(data, 0)
                if got_seq == seq and kind in (codec.NLMSG_ERROR, codec.NLMSG_DONE):
                    code = codec.error_code(memoryview(data)[16:length])
                    if code > 0:
                        raise KernelError(f"{self.WHAT} dump: {os_error(code)}")
                    return chunks


def os_error(code: int) -> str:
    """`ESRCH (No such process)` for an errno."""
    return f"{errno.errorcode.get(code, str(code))} ({os.strerror(code)})"
