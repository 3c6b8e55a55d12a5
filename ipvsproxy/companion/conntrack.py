"""UDP conntrack entries of removed endpoints, deleted so clients move on at once.

Owns: `forget_udp()`, `deletions()`. A UDP "connection" lives in conntrack until it times
out; a client that keeps sending from the same port (a DNS resolver) would keep reaching the
removed endpoint, or nothing, for that long (the DNS-rollout black hole kube-proxy users hit).
After a sync removes UDP destinations, their entries (original destination = the VIP and port,
reply source = the endpoint) are deleted with the `conntrack` tool, which speaks ctnetlink:
all of a sync's deletions in ONE process, `conntrack -R -` (conntrack-tools >= 1.4.6; Debian
bookworm has 1.4.7), which reads one `-D ...` command per line from stdin; a line that
matches no flow is not an error there.

Imports: iptables (Commands), model, errors.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Iterable

from ipvsproxy.errors import KernelError
from ipvsproxy.iptables.kernel import Commands
from ipvsproxy.model import DeleteDest, DeleteService, Op, Proto, RSKey, VSKey

log = logging.getLogger(__name__)


def deletions(gone: Iterable[tuple[VSKey, RSKey | None]]) -> list[str]:
    """`conntrack -R` lines: per (UDP virtual server, removed endpoint or None for all of
    them), delete the flows to the VIP and port answered by that endpoint."""
    lines = []
    for key, rs in gone:
        args = ["-D", "-f", "ipv4" if key.address.version == 4 else "ipv6", "-p", "udp"]
        args += ["--orig-dst", str(key.address), "--orig-port-dst", str(key.port)]
        if rs is not None:
            args += ["--reply-src", str(rs.address), "--reply-port-src", str(rs.port)]
        lines.append(" ".join(args))
    return lines


def forget_udp(commands: Commands, gone: Iterable[tuple[VSKey, RSKey | None]]) -> int:
    """Delete the conntrack entries of each (UDP virtual server, removed endpoint or None
    for all of them) with one `conntrack -R -`; how many deletions were asked. Failures are
    logged, never raised (the flows then time out as without this)."""
    lines = deletions(gone)
    if not lines:
        return 0
    try:
        commands.run(["conntrack", "-R", "-"], stdin="".join(line + "\n" for line in lines))
    except KernelError as exc:
        log.warning("cannot delete UDP conntrack entries (%d deletions): %s", len(lines), exc)
    return len(lines)


def udp_gone(ops: Iterable[Op], failed: Container[Op]) -> list[tuple[VSKey, RSKey | None]]:
    """UDP destinations and virtual servers a sync removed (their flows must go); the
    operations in `failed` were refused, so those objects are still there."""
    gone: list[tuple[VSKey, RSKey | None]] = []
    for op in ops:
        if op in failed:
            continue
        if isinstance(op, DeleteDest) and op.service.proto is Proto.UDP:
            gone.append((op.service, op.key))
        elif isinstance(op, DeleteService) and op.key.proto is Proto.UDP:
            gone.append((op.key, None))
    return gone
