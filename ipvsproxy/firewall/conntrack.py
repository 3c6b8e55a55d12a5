"""Stale UDP conntrack entries, deleted so clients move on at once.

Owns: `udp_gone()`, `udp_first_endpoint()` (pure: a pass's operations in, what must go out),
`deletions()`, `forget_udp()`. A UDP "connection" lives in conntrack until it times out; a
client that keeps sending from the same port (a DNS resolver) keeps its entry for that long.
Two cases make such an entry a black hole, as kube-proxy's `CleanStaleEntries`
(pkg/proxy/conntrack/cleanup.go) knows:
- a removed endpoint: after a sync removes UDP destinations, their entries (original
  destination = the VIP and port, reply source = the endpoint) are deleted;
- a first endpoint: a datagram to a virtual server with no usable destination (none, or
  only weight-0 draining ones) is refused, and its entry stays with the VIP itself as reply
  source; IPVS does not rewrite a confirmed entry, so the client's later datagrams keep
  missing the endpoint that has appeared since. When a UDP virtual server (a ClusterIP,
  externalIP or LoadBalancer IP, or a node address and NodePort: each is its own virtual
  server here) gets its first usable destination, every entry to its address and port is
  deleted: there was no endpoint, so none of them is a working flow.
All of a sync's deletions go to the `conntrack` tool, which speaks ctnetlink, in ONE
process, `conntrack -R -` (conntrack-tools >= 1.4.6; Debian bookworm has 1.4.7), which
reads one `-D ...` command per line from stdin; a line that matches no flow is not an error
there.

Imports: host.commands (Commands), model, errors.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Iterable

from ipvsproxy.errors import KernelError
from ipvsproxy.host.commands import Commands
from ipvsproxy.model import (
    DEST_WRITES,
    DeleteDest,
    DeleteService,
    IpvsState,
    Op,
    Proto,
    RSKey,
    VSKey,
)

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


def udp_gone(
    ops: Iterable[Op], failed: Container[Op], *, before: IpvsState | None = None
) -> list[tuple[VSKey, RSKey | None]]:
    """UDP destinations and virtual servers a sync removed (their flows must go); the
    operations in `failed` were refused, so those objects are still there. Given `before`,
    the table the operations were planned from, also every UDP virtual server that got its
    first usable destination (all of its flows must go: `udp_first_endpoint()`)."""
    gone: list[tuple[VSKey, RSKey | None]] = []
    for op in ops:  # a cold sync has 10,000s: the class first, hashing only the few deletes
        if op.__class__ is not DeleteDest and op.__class__ is not DeleteService:
            continue
        if failed and op in failed:
            continue
        if isinstance(op, DeleteDest) and op.service.proto is Proto.UDP:
            gone.append((op.service, op.key))
        elif isinstance(op, DeleteService) and op.key.proto is Proto.UDP:
            gone.append((op.key, None))
    if before is not None:
        gone += [(key, None) for key in udp_first_endpoint(ops, before, failed)]
    return gone


def udp_first_endpoint(ops: Iterable[Op], before: IpvsState, failed: Container[Op]) -> list[VSKey]:
    """UDP virtual servers that had no usable destination in `before` (none, or only
    weight-0 ones, which IPVS never schedules) and got one from an operation that was not
    refused: a new destination, or a draining one given weight again. In plan order, once."""
    revived: dict[VSKey, None] = {}  # ordered, and O(1) to ask
    for op in ops:
        if not isinstance(op, DEST_WRITES) or op.service.proto is not Proto.UDP:
            continue
        key = op.service
        if (failed and op in failed) or op.rs.weight <= 0 or key in revived:
            continue
        if not any(rs.weight > 0 for rs in before.dests.get(key, {}).values()):
            revived[key] = None
    return list(revived)
