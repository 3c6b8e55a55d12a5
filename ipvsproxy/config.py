"""The agent's configuration: one frozen object, validated once, built by the CLI.

Owns: `Config` and the parsers for its textual forms (CIDR lists, port ranges). Also
`ownership()`, the precise rule for which virtual servers ipvsproxy may change
(docs/ownership.md).

Imports: schedulers, model, errors, the standard library.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass, field
from ipaddress import ip_network
from pathlib import Path

from ipvsproxy.backoff import Backoff
from ipvsproxy.errors import ConfigError
from ipvsproxy.model import IPAddress, IPNetwork
from ipvsproxy.schedulers import Scheduler

DEFAULT_NODEPORT_RANGE = (30000, 32767)
DEFAULT_SERVICE_METRICS_MAX_SERIES = 10000  # sample lines of the per-Service traffic metrics


@dataclass(frozen=True, slots=True)
class Config:
    """Everything the agent needs to know that does not come from the API."""

    node_name: str = field(default_factory=socket.gethostname)
    scheduler: Scheduler = Scheduler.RR
    nodeport_cidrs: tuple[IPNetwork, ...] = ()  # per family; none of a family: all of it
    nodeport_primary: bool = False  # --nodeport-addresses primary: the Node's primary IPs
    service_cidrs: tuple[IPNetwork, ...] = ()  # VIP ranges ipvsproxy owns outright
    exclude_cidrs: tuple[IPNetwork, ...] = ()  # never touched, whatever else says
    # --external-ip-cidrs: the ranges a Service's spec.externalIPs may use (None: any, as
    # kube-proxy; (): none). Both families: a family with no range here gets none.
    external_ip_cidrs: tuple[IPNetwork, ...] | None = None
    nodeport_range: tuple[int, int] = DEFAULT_NODEPORT_RANGE
    dummy_device: str = "kube-ipvs0"
    backend: str = "auto"  # ipvs | iptables | auto (IPVS when usable, else iptables)
    cluster_cidrs: tuple[IPNetwork, ...] = ()  # pod network(s): traffic from elsewhere is SNATed
    masquerade_all: bool = False  # SNAT all ClusterIP traffic
    masquerade_bit: int = 14  # fwmark bit for "masquerade me" (0x4000)
    detect_local_mode: str = ""  # ClusterCIDR | NodeCIDR | InterfaceNamePrefix | BridgeInterface
    local_interface: str = ""  # the prefix or bridge of the interface modes
    fallback: bool = True  # auto may fall back to iptables (--no-fallback: it may not)
    # IPVS may run without the firewall rules' tools (--allow-no-firewall-rules): no VIP
    # port filter, no loadBalancerSourceRanges, no masquerade. Default: refuse to start.
    allow_no_firewall: bool = False
    # IPVS mode's firewall rules: nftables | iptables | auto (nftables where the kernel takes
    # ipvsproxy's table and `nft` works, else iptables and ipsets)
    firewall: str = "auto"
    # served before the rest of the table on a node's first pass (namespace, name)
    first_services: tuple[tuple[str, str], ...] = (
        ("default", "kubernetes"),
        ("kube-system", "kube-dns"),
    )
    strict_arp: bool = False
    tcp_timeout: int = 0  # IPVS connection timeouts in seconds; 0 leaves the kernel's value
    tcp_fin_timeout: int = 0
    udp_timeout: int = 0
    # conntrack settings at start, kube-proxy's --conntrack-* and defaults (seconds; 0 leaves
    # the kernel's value; max_per_core 0 leaves nf_conntrack_max and ignores min)
    conntrack_max_per_core: int = 32768
    conntrack_min: int = 131072
    conntrack_tcp_timeout_established: int = 86400
    conntrack_tcp_timeout_close_wait: int = 3600
    conntrack_tcp_be_liberal: bool = False
    conntrack_udp_timeout: int = 0
    conntrack_udp_timeout_stream: int = 0
    min_sync_period: float = 1.0  # seconds: at most one sync per this
    sync_period: float = 30.0  # seconds: at least one full resync per this
    drain_timeout: float = 30.0  # seconds a removed endpoint may keep its connections
    # seconds a newly serving endpoint's weight ramps over (0: off), unless a Service's
    # annotation says otherwise (sync/slowstart.py)
    slow_start: float = 0.0
    metrics_bind_address: tuple[str, int] = ("127.0.0.1", 10249)
    healthz_bind_address: tuple[str, int] = ("0.0.0.0", 10256)  # load balancers probe it
    # per-Service traffic metrics, read from the kernel at scrape time (docs/monitoring.md)
    service_metrics: bool = False
    endpoint_metrics: bool = False  # and per endpoint (needs service_metrics)
    service_metrics_max_series: int = DEFAULT_SERVICE_METRICS_MAX_SERIES
    # /status to clients on other hosts too (off: the node's loopback only)
    status_remote: bool = False
    # /metrics over HTTPS with delegated authentication and authorization (delegation.py);
    # None: off. The pair, or None for a self-signed one made at start (servingcert.py)
    secure_metrics_bind_address: tuple[str, int] | None = None
    tls_cert_file: Path | None = None
    tls_private_key_file: Path | None = None

    @property
    def retry(self) -> Backoff:
        """How a failed pass, firewall step or virtual server is retried: 1, 2, 4 ... s
        after each failure in a row, at most a sync period (the next full pass)."""
        return Backoff(first=1.0, cap=self.sync_period)

    def selects_nodeport_address(self, address: IPAddress) -> bool:
        """Whether NodePorts listen on this node address (`--nodeport-addresses`): as
        kube-proxy, per IP family, a family with no CIDR keeps all of its addresses."""
        same = [net for net in self.nodeport_cidrs if net.version == address.version]
        return not same or any(address in net for net in same)

    def allows_external_ip(self, address: IPAddress) -> bool:
        """Whether a Service's externalIP may be programmed (`--external-ip-cidrs`)."""
        allowed = self.external_ip_cidrs
        return allowed is None or any(address in net for net in allowed)


def parse_external_ip_cidrs(text: str, *, option: str) -> tuple[IPNetwork, ...] | None:
    """`--external-ip-cidrs`: empty -> None (any externalIP), `none` -> () (no externalIP),
    else the CIDRs (ConfigError naming the option for a bad one)."""
    if not text.strip():
        return None
    if text.strip() == "none":
        return ()
    return parse_cidrs(text, option=option)


def parse_cidrs(text: str, *, option: str) -> tuple[IPNetwork, ...]:
    """`10.0.0.0/8,fd00::/8` -> networks; ConfigError naming the option otherwise."""
    nets = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            nets.append(ip_network(part, strict=False))
        except ValueError:
            raise ConfigError(f"{option}: {part!r} is not a CIDR") from None
    return tuple(nets)


def parse_port_range(text: str, *, option: str) -> tuple[int, int]:
    """`30000-32767` -> (30000, 32767)."""
    low, sep, high = text.partition("-")
    try:
        lo, hi = int(low), int(high if sep else low)
    except ValueError:
        raise ConfigError(f"{option}: {text!r} is not a port range like 30000-32767") from None
    if not 1 <= lo <= hi <= 65535:
        raise ConfigError(f"{option}: {text!r} is not a valid port range")
    return lo, hi


IFNAMSIZ = 16  # include/uapi/linux/if.h: names hold at most 15 bytes and a NUL
# The kernel refuses "/" and ":"; iptables-restore's tokenizer reads quotes, backslash and "#" as
# quoting, escaping or a comment, and iptables "!" as inversion: none in a name we write.
_NOT_IN_NAMES = frozenset("/:\"'\\#!")


def parse_interface_name(text: str, *, option: str, prefix: bool = False) -> str:
    """An interface name checked as the kernel checks it (`dev_valid_name()`: 1 to 15 bytes,
    not `.` or `..`, no `/`, `:` or whitespace), printable and free of what iptables-restore
    would read as quoting, a comment or an inversion. A `prefix` becomes an iptables
    wildcard (`veth` -> `-i veth+`): it is given without the `+`, and with it fits in
    iptables' 15 characters. ConfigError naming the option otherwise."""
    size = len(text.encode())
    limit = IFNAMSIZ - 1 - (1 if prefix else 0)
    what = "an interface name prefix" if prefix else "an interface name"
    if not text:
        raise ConfigError(f"{option}: must not be empty")
    if size > limit:
        raise ConfigError(f"{option}: {text!r} is {size} bytes; {what} holds at most {limit}")
    if text in (".", ".."):
        raise ConfigError(f"{option}: {text!r} is not a valid interface name")
    bad = sorted({c for c in text if c in _NOT_IN_NAMES or c.isspace() or not c.isprintable()})
    if bad:
        raise ConfigError(f"{option}: {text!r} contains {''.join(bad)!r}, not allowed in {what}")
    if prefix and text.endswith("+"):
        raise ConfigError(f"{option}: give the prefix without the '+' ({text[:-1]!r})")
    return text


def parse_scheduler(text: str, *, option: str) -> Scheduler:
    try:
        return Scheduler(text.strip().lower())
    except ValueError:
        known = ", ".join(s.value for s in Scheduler)
        raise ConfigError(f"{option}: {text!r} is not an IPVS scheduler ({known})") from None


# The longest duration taken: a year. Longer periods mean "never", and past threading's
# TIMEOUT_MAX (292 years) a wait raises OverflowError (issue 28).
MAX_DURATION = 365 * 86400.0
# The longest kernel timeout (IPVS, conntrack): the kernel keeps them in jiffies in an int,
# and refuses (conntrack) or overflows (IPVS) past INT_MAX / HZ seconds at HZ=1000.
MAX_KERNEL_TIMEOUT = float((2**31 - 1) // 1000)
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def parse_duration(
    text: str, *, option: str, maximum: float = MAX_DURATION, bare_seconds: bool = False
) -> float:
    """A Go-style duration as kube-proxy takes it (`1s`, `500ms`, `1m30s`), at most `maximum`
    seconds. As Go's time.ParseDuration (kube-proxy's flags, and its file's metav1.Duration),
    a number needs a unit: `30` is refused, only `0` may go without; `bare_seconds` takes a
    number as seconds (the slow-start annotation always has)."""
    value = text.strip()
    number = _NUMBER.fullmatch(value) is not None
    if value == "0" or (number and bare_seconds):
        seconds = float(value)
    else:
        parts = _DURATION.findall(value)
        if not parts or "".join(n + u for n, u in parts) != value:
            why = "has no unit: give" if number else "is not"
            raise ConfigError(f"{option}: {text!r} {why} a duration like 30s, 500ms or 1m30s")
        seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    if seconds < 0 or seconds != seconds or seconds == float("inf"):
        raise ConfigError(f"{option}: {text!r} must be a finite, non-negative duration")
    if seconds > maximum:
        raise ConfigError(f"{option}: {text!r} is longer than {maximum:.0f}s, the most it takes")
    return seconds
