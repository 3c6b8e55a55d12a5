"""A socket that answers batched netlink requests like the kernel, for GenlSocket and
RtnlSocket tests: an NLMSG_ERROR for every refused request (by its position among all the
requests it has seen), then the ack the last request of each send asked for."""

from __future__ import annotations

import struct
from collections.abc import Callable

from ipvsproxy.netlink import codec


def error(seq: int, errno: int) -> bytes:
    return struct.pack("=IHHIIi", 36, codec.NLMSG_ERROR, 0, seq, 0, -errno) + bytes(16)


class ScriptedKernel:
    """`answer(position, type, payload)` is the errno of each request (0: done)."""

    def __init__(self, answer: Callable[[int, int, memoryview], int]) -> None:
        self.answer, self.seen = answer, 0
        self.sends: list[bytes] = []
        self._queue: list[bytes] = []

    def send(self, data: bytes) -> int:
        self.sends.append(data)
        replies = []
        for kind, flags, seq, payload in codec.messages(data):
            assert flags & codec.NLM_F_REQUEST
            code = self.answer(self.seen, kind, payload)
            self.seen += 1
            if code or flags & codec.NLM_F_ACK:
                replies.append(error(seq, code))
        self._queue.append(b"".join(replies))
        return len(data)

    def recv_into(self, buf: bytearray) -> int:
        data = self._queue.pop(0)
        buf[: len(data)] = data
        return len(data)

    def close(self) -> None:
        pass
