"""Kernel settings the IPVS backend needs, each with its reason (as kube-proxy sets them).

Owns: `required(release, strict_arp=...)` (pure: which settings for which kernel) and
`ensure(...)` (writes them under /proc/sys, returns what changed).

Imports: errors, the standard library.
"""

from __future__ import annotations

import errno
import re
from dataclasses import dataclass
from pathlib import Path

from ipvsproxy.errors import KernelUnavailable


@dataclass(frozen=True, slots=True)
class Sysctl:
    name: str  # dotted, e.g. net.ipv4.vs.conntrack
    value: int
    why: str

    @property
    def path(self) -> str:
        return self.name.replace(".", "/")


BASE = (
    Sysctl(
        "net.ipv4.vs.conntrack",
        1,
        "keep conntrack entries for IPVS connections, which iptables NAT/masquerade rules "
        "(hairpin, NodePort SNAT) match on",
    ),
    Sysctl(
        "net.ipv4.vs.expire_nodest_conn",
        1,
        "drop connections to a deleted destination at the next packet instead of "
        "black-holing them until they time out",
    ),
    Sysctl(
        "net.ipv4.vs.expire_quiescent_template",
        1,
        "expire persistence templates of weight-0 (draining) destinations, so session "
        "affinity stops sending new connections to them",
    ),
    Sysctl("net.ipv4.ip_forward", 1, "IPVS NAT forwards to endpoints on other hosts and pods"),
)
STRICT_ARP = (
    Sysctl(
        "net.ipv4.conf.all.arp_ignore",
        1,
        "--strict-arp: answer ARP only for addresses of "
        "the receiving interface, never for VIPs on the dummy device",
    ),
    Sysctl("net.ipv4.conf.all.arp_announce", 2, "--strict-arp: never use a VIP as ARP source"),
)
CONN_REUSE = Sysctl(
    "net.ipv4.vs.conn_reuse_mode",
    0,
    "kernels 4.1-5.8 stall new connections reusing a port of a connection in TIME_WAIT "
    "(kubernetes#81775); from 5.9 the default is fixed and left alone (kubernetes#93297)",
)


def kernel_version(release: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", release)
    return (int(match[1]), int(match[2])) if match else (0, 0)


def required(release: str, *, strict_arp: bool = False) -> tuple[Sysctl, ...]:
    """The settings for a kernel release string (as `uname -r` prints it)."""
    out = list(BASE)
    if (4, 1) <= kernel_version(release) < (5, 9):
        out.append(CONN_REUSE)
    if strict_arp:
        out += STRICT_ARP
    return tuple(out)


def ensure(settings: tuple[Sysctl, ...], root: Path = Path("/proc/sys")) -> list[Sysctl]:
    """Write each setting that differs; the ones changed. KernelUnavailable if one cannot be."""
    changed = []
    for setting in settings:
        path = root / setting.path
        try:
            if int(path.read_text().split()[0]) != setting.value:
                path.write_text(f"{setting.value}\n")
                changed.append(setting)
        except (OSError, ValueError, IndexError) as exc:
            hint = _where_it_belongs(setting, exc)
            raise KernelUnavailable(
                f"cannot set {setting.name}={setting.value}: {exc}{hint}"
            ) from exc
    return changed


def _where_it_belongs(setting: Sysctl, exc: Exception) -> str:
    """For --strict-arp refused by a read-only /proc/sys (the agent's unprivileged
    container): where the setting belongs instead."""
    refused = isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
    if setting not in STRICT_ARP or not refused:
        return ""
    return (
        "; /proc/sys is read-only here (the agent's unprivileged container): --strict-arp "
        "belongs to the privileged init container, `ipvsproxy prepare --strict-arp` (in the "
        "kubeadm overlay, ipvs.strictARP: true in config.conf, which both containers read)"
    )
