"""UDP conntrack entries of removed endpoints, deleted so clients move on at once.

Owns: `forget_udp()`. A UDP "connection" lives in conntrack until it times out; a client that
keeps sending from the same port (a DNS resolver) would keep reaching the removed endpoint,
or nothing, for that long (the DNS-rollout black hole kube-proxy users hit). After a sync
removes a UDP destination, its entries (original destination = the VIP and port, reply
source = the endpoint) are deleted with the `conntrack` tool, which speaks ctnetlink.

Imports: iptables (Commands), model, errors.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ipvsproxy.errors import KernelError
from ipvsproxy.iptables.kernel import Commands
from ipvsproxy.model import RSKey, VSKey

log = logging.getLogger(__name__)


def forget_udp(commands: Commands, gone: Iterable[tuple[VSKey, RSKey | None]]) -> int:
    """Delete the conntrack entries of each (UDP virtual server, removed endpoint or None
    for all of them); how many deletions were asked. Failures are logged, never raised."""
    asked = 0
    for key, rs in gone:
        args = ["conntrack", "-D", "-f", "ipv4" if key.address.version == 4 else "ipv6"]
        args += ["-p", "udp", "--orig-dst", str(key.address), "--orig-port-dst", str(key.port)]
        if rs is not None:
            args += ["--reply-src", str(rs.address), "--reply-port-src", str(rs.port)]
        asked += 1
        try:
            commands.run(args)
        except KernelError as exc:
            if "0 flow entries" not in str(exc):  # nothing to delete: exit status 1
                log.warning("cannot delete UDP conntrack entries of %s: %s", key, exc)
    return asked
