"""The conntrack settings kube-proxy makes at start-up, made the same way.

Owns: `Settings` (the `--conntrack-*` flags, in seconds and counts), `conntrack_max()`
(pure: max(per-core x CPUs, min), capped at 1M), `plan()` (pure: current values in, the
writes out) and `ensure()` (reads and writes them under /proc/sys and /sys; what changed
and what could not be set).

As kube-proxy (pkg/proxy/conntrack/sysctls.go, v1.36):
- `net.netfilter.nf_conntrack_max` = max(max_per_core x CPUs, min), the product capped at
  1,048,576 ("to avoid excessive memory usage on high-core machines"); max_per_core 0 leaves it
  (and min) alone. It is only ever raised: a larger value the admin set is kept.
- `/sys/module/nf_conntrack/parameters/hashsize` raised to max/4 when below it (the
  kernel allows that write only from the initial network namespace).
- `nf_conntrack_tcp_timeout_established`, `nf_conntrack_tcp_timeout_close_wait`,
  `nf_conntrack_udp_timeout`, `nf_conntrack_udp_timeout_stream`: written when they differ;
  0 leaves the kernel's value. `nf_conntrack_tcp_be_liberal=1` only when asked for.
- CPUs: the host's, not this process's affinity (kube-proxy's `cpuset.NumCPU()`): the
  table is host-wide.

Where kube-proxy differs: a setting it cannot write makes it exit ("could not set conntrack
parameters"; older releases only sent a Node event when /sys was read-only, docker#24000).
Here it is a warning and the agent goes on: ipvsproxy's agent is meant to run with a
read-only /proc/sys behind a privileged `ipvsproxy prepare` init container that makes these
same writes, and no packet path depends on them (only how many flows fit and how long they
live), unlike the IPVS settings in `sysctl.py`, whose failure stops the start.

Imports: config, the standard library.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ipvsproxy.config import Config

MAX_LIMIT = 1_048_576  # kube-proxy's cap on the scaled nf_conntrack_max
HASHSIZE = "module/nf_conntrack/parameters/hashsize"  # under /sys
MAX = "net/netfilter/nf_conntrack_max"  # under /proc/sys


@dataclass(frozen=True, slots=True)
class Settings:
    """kube-proxy's KubeProxyConntrackConfiguration; its defaults. 0 = leave it."""

    max_per_core: int = 32768
    min: int = 131072
    tcp_established: int = 86400  # seconds
    tcp_close_wait: int = 3600
    tcp_be_liberal: bool = False
    udp: int = 0
    udp_stream: int = 0


def settings_of(config: Config) -> Settings:
    return Settings(
        max_per_core=config.conntrack_max_per_core,
        min=config.conntrack_min,
        tcp_established=config.conntrack_tcp_timeout_established,
        tcp_close_wait=config.conntrack_tcp_timeout_close_wait,
        tcp_be_liberal=config.conntrack_tcp_be_liberal,
        udp=config.conntrack_udp_timeout,
        udp_stream=config.conntrack_udp_timeout_stream,
    )


@dataclass(frozen=True, slots=True)
class Write:
    path: str  # relative to /proc/sys, or to /sys for the hashsize
    value: int
    sysfs: bool = False

    @property
    def name(self) -> str:
        return f"/sys/{self.path}" if self.sysfs else self.path.replace("/", ".")


def conntrack_max(max_per_core: int, minimum: int, cpus: int) -> int:
    """The nf_conntrack_max kube-proxy wants; 0 = leave the kernel's. As kube-proxy's
    getConntrackMax, the cap applies to the scaled value only (a larger min stays)."""
    if max_per_core <= 0:
        return 0
    scaled = max_per_core * cpus
    return MAX_LIMIT if scaled > MAX_LIMIT else max(scaled, minimum)


def wanted_timeouts(settings: Settings) -> dict[str, int]:
    """The timeouts (and be_liberal) to enforce, by path under /proc/sys."""
    values = {
        "nf_conntrack_tcp_timeout_established": settings.tcp_established,
        "nf_conntrack_tcp_timeout_close_wait": settings.tcp_close_wait,
        "nf_conntrack_tcp_be_liberal": 1 if settings.tcp_be_liberal else 0,
        "nf_conntrack_udp_timeout": settings.udp,
        "nf_conntrack_udp_timeout_stream": settings.udp_stream,
    }
    return {f"net/netfilter/{name}": value for name, value in values.items() if value > 0}


def plan(settings: Settings, current: Mapping[str, int | None], *, cpus: int) -> list[Write]:
    """The writes that make `current` (path -> value, None when unreadable) what kube-proxy
    would leave: max and hashsize only raised, the others written when they differ."""
    writes = []
    limit = conntrack_max(settings.max_per_core, settings.min, cpus)
    if limit:
        seen = current.get(MAX)
        if seen is None or seen < limit:
            writes.append(Write(MAX, limit))
        hashsize = current.get(HASHSIZE)
        if hashsize is None or hashsize < limit // 4:
            writes.append(Write(HASHSIZE, limit // 4, sysfs=True))
    for path, value in wanted_timeouts(settings).items():
        if current.get(path) != value:
            writes.append(Write(path, value))
    return writes


@dataclass(frozen=True, slots=True)
class Outcome:
    changed: tuple[Write, ...] = ()
    warnings: tuple[str, ...] = ()  # settings that could not be written, and why


def host_cpus() -> int:
    """The host's CPUs (online ones), not the ones this process may use."""
    return os.cpu_count() or 1


def _read(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def ensure(
    settings: Settings,
    *,
    cpus: int | None = None,
    proc_sys: Path = Path("/proc/sys"),
    sys_root: Path = Path("/sys"),
) -> Outcome:
    """Make the writes `plan()` says; a write that fails (read-only /proc/sys or /sys, no
    nf_conntrack module, not the initial network namespace) is a warning, never raised."""
    paths = [MAX, *wanted_timeouts(settings)]
    current = {path: _read(proc_sys / path) for path in paths}
    current[HASHSIZE] = _read(sys_root / HASHSIZE)
    changed, warnings = [], []
    for write in plan(settings, current, cpus=cpus or host_cpus()):
        target = (sys_root if write.sysfs else proc_sys) / write.path
        try:
            target.write_text(f"{write.value}\n")
        except OSError as exc:
            seen = current.get(write.path)
            warnings.append(
                f"cannot set {write.name}={write.value} (it is {seen if seen is not None else '?'}"
                f"): {exc.strerror or exc}"
            )
        else:
            changed.append(write)
    return Outcome(tuple(changed), tuple(warnings))
