"""One agent per node: an exclusive lock per network namespace, taken before anything changes.

Owns `hold()`, the lock every command that writes the node's Service state takes first
(`run`, `run --once`, `cleanup`), and `NodeBusy`, what a second one gets: the holder named
(its pid as the caller sees it, its command, version and start time).

The lock is a listening UNIX socket bound to a name in the *abstract* namespace
(`@ipvsproxy/agent`), which the kernel scopes to the network namespace, exactly the scope of
the state an agent owns (IPVS table, iptables, the dummy device): agents in different
namespaces never see each other's lock, two in one namespace always do, whatever their
mount or PID namespaces (containers, `kubectl debug node`, systemd on the host). It needs no
file system (the agent's root is read-only, and a container's /run is not the host's), and
it cannot go stale: the kernel frees the name when the last descriptor closes, `kill -9`
included. The socket is close-on-exec, so no child (iptables-restore, modprobe) keeps it.

Whoever finds the name taken connects to it: the kernel gives the holder's pid and uid
(SO_PEERCRED, as seen from the caller's PID namespace: 0 when it is not visible there), and
the holder's "lock" thread answers each connection with one JSON line describing itself.

The limit: an abstract name has no permissions, so any process in the namespace may bind it
first and keep ipvsproxy from starting, as it may bind the health port (10256) today. It
fails closed (exit 2) and names that process and its uid.

Imports: errors, the standard library.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from ipvsproxy.errors import IpvsproxyError

log = logging.getLogger(__name__)

NAME = "ipvsproxy/agent"  # shown as @ipvsproxy/agent in `ss -xl`; tests use their own
ANSWER_TIMEOUT = 1.0  # seconds the holder has to describe itself
_STARTED = time.time()


class NodeBusy(IpvsproxyError):
    """Another process holds this network namespace's lock (an agent, or a cleanup)."""


@dataclass(frozen=True, slots=True)
class Holder:
    """What a lock's holder says about itself, and what the kernel says about it."""

    pid: int  # as the caller sees it (0: in a PID namespace the caller cannot see)
    uid: int
    described: dict[str, object]  # the holder's own answer ({} if it gave none)

    def __str__(self) -> str:
        said = self.described
        if not said:
            return f"pid {self.pid}, uid {self.uid}, which did not answer as ipvsproxy"
        parts = [
            f"pid {self.pid}" if self.pid else f"pid {said.get('pid')} (in its own PID namespace)"
        ]
        parts.append(f"`ipvsproxy {said.get('command')}`, version {said.get('version')}")
        started = said.get("started")
        if isinstance(started, int | float):
            parts.append("started " + time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)))
        return ", ".join(parts)


@contextlib.contextmanager
def hold(command: str, *, advice: str = "stop it first") -> Iterator[None]:
    """Hold the lock of this network namespace while the block runs; `NodeBusy` at once
    (naming the holder, then `advice`) if another process holds it."""
    listener = _bind(command, advice)
    answering = threading.Thread(target=_answer, args=(listener, command), name="lock", daemon=True)
    answering.start()
    try:
        yield
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes the thread's accept()
        answering.join(timeout=2)
        listener.close()


def holder() -> Holder | None:
    """Who holds this network namespace's lock, or None when nobody does."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(ANSWER_TIMEOUT)
        try:
            client.connect("\0" + NAME)
        except (ConnectionRefusedError, FileNotFoundError):
            return None
        pid, uid, _ = struct.unpack(
            "3i", client.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        )
        return Holder(pid, uid, _read_answer(client))


def _bind(command: str, advice: str) -> socket.socket:
    for _ in range(3):  # the holder may exit between our bind and our connect
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # close-on-exec
        try:
            listener.bind("\0" + NAME)
            listener.listen(16)
            return listener
        except OSError as exc:
            listener.close()
            if exc.errno != errno.EADDRINUSE:
                raise NodeBusy(f"cannot take this node's lock @{NAME}: {exc}") from exc
        found = holder()  # refused: between the holder's bind and listen, or it just left
        if found is not None:
            raise NodeBusy(
                f"another process holds this node's lock (one agent per network namespace, "
                f"abstract socket @{NAME}): {found}; {advice}"
            )
        time.sleep(0.05)
    raise NodeBusy(f"this node's lock @{NAME} is taken and released again and again; {advice}")


def _answer(listener: socket.socket, command: str) -> None:
    """Tell whoever connects who holds the lock (one JSON line), until the lock is let go."""
    from ipvsproxy import __version__

    line = (
        json.dumps(
            {"pid": os.getpid(), "command": command, "version": __version__, "started": _STARTED}
        ).encode()
        + b"\n"
    )
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:  # shut down: released
            return
        with conn:
            conn.settimeout(ANSWER_TIMEOUT)
            with contextlib.suppress(OSError):
                conn.sendall(line)


def _read_answer(client: socket.socket) -> dict[str, object]:
    data = b""
    try:
        while b"\n" not in data and len(data) < 4096:
            chunk = client.recv(4096)
            if not chunk:
                break
            data += chunk
        answer = json.loads(data.partition(b"\n")[0])
    except (OSError, ValueError):
        return {}
    return answer if isinstance(answer, dict) else {}
