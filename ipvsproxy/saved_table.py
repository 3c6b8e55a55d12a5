"""The text of `ipvsadm-save -n`: parse it into an `IpvsState`, print state as it, and
answer a Kernel's reads from a saved table (`SavedTable`).

Owns: the ipvsadm rule syntax (`-A -t 10.96.0.10:53 -s rr -p 10800`, `-a ... -r ... -m -w 1`),
used to read a saved kernel table (`ipvsproxy diff --kernel-state FILE`) and to show plans
in terms an ipvsadm user reads at a glance. Forwarding switches follow ipvsadm's
`fwd_switch()`: -m masquerade, -i tunnel, -g direct routing (and local, which it prints as -g).
Options of foreign services ipvsproxy does not model (-M netmask, --pe, --tun-*) are
accepted and not kept. Destination thresholds (-x, -y) are read and printed as `ipvsadm -R`
takes them, although `ipvsadm-save` itself never prints them (checked on a real kernel).

`SavedTable` is the kernel `diff --kernel-state` and `status --kernel-state` plan against:
it observes the saved table and refuses every write (the product never builds its pass on
the tests' `FakeKernel`).

Imports: kernel, model, schedulers, errors.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from ipaddress import IPv4Address, IPv6Address, ip_address
from pathlib import Path
from typing import TYPE_CHECKING

from ipvsproxy.errors import ConfigError, KernelUnavailable, NotFound, StateParseError
from ipvsproxy.kernel import AccessMap, ApplyReport, Kernel
from ipvsproxy.model import (
    EMPTY,
    SCHED_FLAGS,
    Forward,
    IpvsState,
    Op,
    Proto,
    RealServer,
    RSKey,
    ServiceFlags,
    Traffic,
    VirtualServer,
    VSKey,
    host_port,
    parse_host_port,
)
from ipvsproxy.schedulers import SchedFlag, Scheduler, format_flags, parse_saved_flags

_PROTO_SWITCH = {"-t": "TCP", "-u": "UDP", "--sctp-service": "SCTP"}
_LONG_SWITCH = {"--tcp-service": "-t", "--udp-service": "-u", "--fwmark-service": "-f"}
_FWD_SWITCH = {"-m": Forward.MASQ, "-i": Forward.TUNNEL, "-g": Forward.ROUTE}
_SKIPPED_WITH_VALUE = {"-M", "--netmask", "--pe", "--tun-type", "--tun-port"}
_SKIPPED_ALONE = {"--tun-nocsum", "--tun-csum", "--tun-remcsum"}


# ---- printing ---------------------------------------------------------------------------


def key_args(key: VSKey) -> str:
    """`-t 10.0.0.1:80`, `-u [fd00::1]:53`, `--sctp-service ...`, `-f 7` (`-f 7 -6`)."""
    if key.fwmark:
        return f"-f {key.fwmark}" + (" -6" if key.address.version == 6 else "")
    switch = {"TCP": "-t", "UDP": "-u", "SCTP": "--sctp-service"}[key.proto.name]
    return f"{switch} {host_port(key.address, key.port)}"


def service_args(vs: VirtualServer) -> str:
    """The options of `ipvsadm -A`/`-E` for this virtual server."""
    out = f"{key_args(vs.key)} -s {vs.scheduler}"
    if vs.flags & ServiceFlags.PERSISTENT:
        out += f" -p {vs.timeout_s}"
    if vs.flags & ServiceFlags.ONEPACKET:
        out += " -o"
    sched = format_flags(vs.scheduler, SchedFlag(int(vs.flags & SCHED_FLAGS)))
    if sched:
        out += f" -b {sched}"
    return out


def dest_args(service: VSKey, rs: RealServer) -> str:
    """The options of `ipvsadm -a`/`-e` for this destination."""
    fwd = {Forward.MASQ: "-m", Forward.TUNNEL: "-i"}.get(rs.forward, "-g")
    out = f"{key_args(service)} -r {rs.key} {fwd} -w {rs.weight}"
    if rs.forward is Forward.TUNNEL:
        out += " --tun-type ipip"  # ipvsproxy does not model tunnel types; ipip is the default
    if rs.upper_threshold:
        out += f" -x {rs.upper_threshold}"
    if rs.lower_threshold:
        out += f" -y {rs.lower_threshold}"
    return out


def render_save(state: IpvsState) -> str:
    """The state as `ipvsadm-save -n` prints it (services sorted, each followed by its dests)."""
    lines = []
    for key in sorted(state.services):
        lines.append(f"-A {service_args(state.services[key])}")
        for rs_key in sorted(state.dests.get(key, {})):
            lines.append(f"-a {dest_args(key, state.dests[key][rs_key])}")
    return "".join(line + "\n" for line in lines)


# ---- parsing ----------------------------------------------------------------------------


def parse_save(text: str) -> IpvsState:
    """Parse `ipvsadm-save -n` output; StateParseError names the line that is wrong."""
    services: dict[VSKey, VirtualServer] = {}
    dests: dict[VSKey, dict[RSKey, RealServer]] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        try:
            if words[0] == "-A":
                vs = _parse_service(words[1:])
                if vs.key in services:
                    raise ValueError(f"service {vs.key} defined twice")
                services[vs.key], dests[vs.key] = vs, {}
            elif words[0] == "-a":
                key, rs = _parse_dest(words[1:])
                if key not in services:
                    raise ValueError(f"destination for undefined service {key}")
                dests[key][rs.key] = rs
            else:
                raise ValueError(f"expected -A or -a, got {words[0]!r}")
        except (ValueError, IndexError) as exc:
            raise StateParseError(f"line {number}: {exc}: {line.strip()!r}") from None
    return IpvsState(services, dests)


def _options(words: list[str]) -> Iterator[tuple[str, str]]:
    """(switch, value) pairs; value "" for switches that take none."""
    alone = {"-6", "-o", "-m", "-i", "-g", *_SKIPPED_ALONE}
    i = 0
    while i < len(words):
        switch = _LONG_SWITCH.get(words[i], words[i])
        if switch in alone:
            yield switch, ""
            i += 1
        else:
            yield switch, words[i + 1]
            i += 2


def _parse_key(switch: str, value: str, ipv6: bool) -> VSKey:
    if switch == "-f":
        mark = int(value)
        if not 0 < mark < 2**32:
            raise ValueError(f"bad fwmark {value!r}")
        unspecified: IPv4Address | IPv6Address = ip_address("::" if ipv6 else "0.0.0.0")
        return VSKey(unspecified, 0, Proto.TCP, fwmark=mark)
    address, port = parse_host_port(value)
    return VSKey(address, port, Proto[_PROTO_SWITCH[switch]])


def _parse_service(words: list[str]) -> VirtualServer:
    opts = list(_options(words))
    key = _service_key(opts)
    scheduler, flags, timeout, sched_text = Scheduler.WLC, ServiceFlags(0), 0, ""
    for switch, value in opts:
        if switch == "-s":
            scheduler = Scheduler(value)
        elif switch == "-p":
            flags, timeout = flags | ServiceFlags.PERSISTENT, int(value)
        elif switch == "-o":
            flags |= ServiceFlags.ONEPACKET
        elif switch == "-b":
            sched_text = value
        elif switch not in (*_PROTO_SWITCH, "-f", "-6", *_SKIPPED_WITH_VALUE, *_SKIPPED_ALONE):
            raise ValueError(f"unknown option {switch!r}")
    flags |= ServiceFlags(int(parse_saved_flags(scheduler, sched_text)))
    return VirtualServer(key, scheduler, flags, timeout)


def _parse_dest(words: list[str]) -> tuple[VSKey, RealServer]:
    opts = list(_options(words))
    key = _service_key(opts)
    address, forward, numbers = "", Forward.ROUTE, {"-w": 1, "-x": 0, "-y": 0}
    for switch, value in opts:
        if switch == "-r":
            address = value
        elif switch in numbers:
            numbers[switch] = int(value)
        elif switch in _FWD_SWITCH:
            forward = _FWD_SWITCH[switch]
        elif switch not in (*_PROTO_SWITCH, "-f", "-6", *_SKIPPED_WITH_VALUE, *_SKIPPED_ALONE):
            raise ValueError(f"unknown option {switch!r}")
    if not address:
        raise ValueError("destination without -r")
    try:
        host, port = parse_host_port(address)
    except ValueError:
        if not key.fwmark:  # fwmark destinations may omit the port
            raise
        host, port = ip_address(address.strip("[]")), 0
    rs = RealServer(RSKey(host, port), numbers["-w"], forward, numbers["-x"], numbers["-y"])
    return key, rs


def _service_key(opts: list[tuple[str, str]]) -> VSKey:
    ipv6 = any(switch == "-6" for switch, _ in opts)
    keys = [(s, v) for s, v in opts if s in _PROTO_SWITCH or s == "-f"]
    if len(keys) != 1:
        raise ValueError("expected exactly one of -t, -u, --sctp-service, -f")
    return _parse_key(*keys[0], ipv6=ipv6)


# ---- a saved table as a kernel ----------------------------------------------------------


class SavedTable:
    """A read-only Kernel over a saved `ipvsadm-save -n` table: it observes the table, knows
    no connections or counters (the file records none) and refuses every write."""

    owns_table = False  # a table of the kernel's IPVS, shared as the kernel's is

    def __init__(self, state: IpvsState) -> None:
        self.state = state

    @classmethod
    def read(cls, path: Path) -> SavedTable:
        """The table in the file; ConfigError if unreadable, StateParseError if malformed."""
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read: {exc}") from exc
        return cls(parse_save(text))

    def observe(self, *, access: AccessMap | None = None) -> IpvsState:
        return self.state

    def damage(self) -> tuple[str, ...]:
        return ()

    def connections(self, key: VSKey) -> Mapping[RSKey, tuple[int, int]]:
        if key not in self.state.services:
            raise NotFound(f"no virtual server {key}")
        return {}

    def traffic(self) -> Mapping[VSKey, Traffic]:
        return {}

    def apply(
        self,
        plan: Sequence[Op],
        *,
        names: Mapping[VSKey, str] | None = None,
        access: AccessMap | None = None,
    ) -> ApplyReport:
        raise KernelUnavailable("a saved ipvsadm table is read-only")


if TYPE_CHECKING:
    _conforms: Kernel = SavedTable(EMPTY)
