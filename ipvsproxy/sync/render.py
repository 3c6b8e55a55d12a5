"""Show a plan the way a reviewer wants to read it: ipvsadm terms, one line per change.

Owns: `render_text(plan, ...)` (`+`/`-`/`~` lines with the causing Service, then a summary)
and `to_json(plan, ...)` for machines. Operations are described once, in `describe()`; for log
records, `facts()` (the fields of one operation, with the same kinds and Service names) and
`sentence()` (those fields in words).

Imports: model, kernel, saved_table, logs (escape).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ipvsproxy.logs import escape
from ipvsproxy.model import (
    AddDest,
    AddService,
    BindAddress,
    DeleteDest,
    DeleteService,
    IpvsState,
    Op,
    UnbindAddress,
    UpdateDest,
    UpdateService,
    VirtualServer,
    VSKey,
)
from ipvsproxy.saved_table import dest_args, key_args, service_args

STALE = "(no longer wanted)"


@dataclass(frozen=True, slots=True)
class Line:
    """One operation in words: its sign, kind, ipvsadm command and what caused it."""

    sign: str  # + add, ~ change, - delete
    kind: str  # e.g. "add-service"
    command: str  # e.g. "ipvsadm -A -t 10.96.0.10:53 -s rr"
    cause: str  # "namespace/name:port", or STALE
    before: str = ""  # for changes: the current settings


# The kind of each operation: in `diff -o json` ("op") and in log records ("op").
KINDS: Mapping[type, str] = {
    AddService: "add-service",
    UpdateService: "update-service",
    DeleteService: "delete-service",
    AddDest: "add-dest",
    UpdateDest: "update-dest",
    DeleteDest: "delete-dest",
    BindAddress: "bind-address",
    UnbindAddress: "unbind-address",
}


def describe(op: Op, origins: Mapping[VSKey, str], observed: IpvsState, device: str) -> Line:
    """The words for one operation."""
    kind = KINDS[type(op)]
    match op:
        case AddService(vs):
            return Line("+", kind, f"ipvsadm -A {service_args(vs)}", _cause(vs.key, origins))
        case UpdateService(vs):
            seen = observed.services.get(vs.key)
            before = f"was: {service_args(seen)}" if seen else ""
            cmd = f"ipvsadm -E {service_args(vs)}"
            return Line("~", kind, cmd, _cause(vs.key, origins), before)
        case DeleteService(key):
            return Line("-", kind, f"ipvsadm -D {key_args(key)}", STALE)
        case AddDest(key, rs):
            return Line("+", kind, f"ipvsadm -a {dest_args(key, rs)}", _cause(key, origins))
        case UpdateDest(key, rs):
            seen_rs = observed.dests.get(key, {}).get(rs.key)
            before = f"was: {dest_args(key, seen_rs)}" if seen_rs else ""
            cmd = f"ipvsadm -e {dest_args(key, rs)}"
            return Line("~", kind, cmd, _cause(key, origins), before)
        case DeleteDest(key, rs_key):
            cmd = f"ipvsadm -d {key_args(key)} -r {rs_key}"
            return Line("-", kind, cmd, _cause(key, origins))
        case BindAddress(address):
            prefix = 32 if address.version == 4 else 128
            return Line("+", kind, f"ip addr add {address}/{prefix} dev {device}", "")
        case UnbindAddress(address):
            prefix = 32 if address.version == 4 else 128
            return Line("-", kind, f"ip addr del {address}/{prefix} dev {device}", "")
    raise TypeError(f"not an operation: {op!r}")  # pragma: no cover


def _cause(key: VSKey, origins: Mapping[VSKey, str]) -> str:
    return origins.get(key, STALE)


Facts = dict[str, str | int]


def facts(op: Op, origins: Mapping[VSKey, str], *tables: Mapping[VSKey, VirtualServer]) -> Facts:
    """The fields of a log record about one operation (docs/logging.md): `op` (its kind),
    `service` (the Service port it is for; absent when no Service wants the virtual server),
    the virtual server (`vip`, `port`, `protocol`, `fwmark` if any, and `scheduler`, from
    the first of `tables` that has it when the operation does not carry it), and for a
    destination `endpoint` (ip:port) and `weight` (absent for a delete)."""
    out: Facts = {"op": KINDS[type(op)]}
    seen: VirtualServer | None
    match op:
        case BindAddress(address) | UnbindAddress(address):
            out["vip"] = str(address)
            return out
        case AddService(vs) | UpdateService(vs):
            key, seen = vs.key, vs
        case DeleteService(key) | DeleteDest(key, _) | AddDest(key, _) | UpdateDest(key, _):
            seen = next((table[key] for table in tables if key in table), None)
    if key in origins:
        out["service"] = origins[key]
    out |= {"vip": str(key.address), "port": key.port, "protocol": key.proto.name}
    if key.fwmark:
        out["fwmark"] = key.fwmark
    if seen is not None:
        out["scheduler"] = str(seen.scheduler)
    match op:
        case AddDest(_, rs) | UpdateDest(_, rs):
            out |= {"endpoint": str(rs.key), "weight": rs.weight}
        case DeleteDest(_, rs_key):
            out["endpoint"] = str(rs_key)
    return out


def sentence(fields: Facts) -> str:
    """`facts()` in words, for the message of a log record, e.g. `add-dest: Service
    demo/web:http, virtual server TCP 10.96.0.10:80 rr, real server 10.244.1.1:8080 weight 1`."""
    if "protocol" not in fields:  # an address of the dummy device
        return f"{fields['op']}: {fields['vip']}"
    service = f"Service {fields['service']}" if "service" in fields else f"no Service {STALE}"
    vip, port = str(fields["vip"]), fields["port"]
    if "fwmark" in fields:
        server = f"FWM {fields['fwmark']}"
    else:  # as host_port(): [fd00::1]:80 for IPv6
        server = f"{fields['protocol']} " + (f"[{vip}]:{port}" if ":" in vip else f"{vip}:{port}")
    text = f"{fields['op']}: {service}, virtual server {server}"
    if "scheduler" in fields:
        text += f" {fields['scheduler']}"
    if "endpoint" in fields:
        text += f", real server {fields['endpoint']}"
        if "weight" in fields:
            text += f" weight {fields['weight']}"
    return text


def summarize(lines: Sequence[Line]) -> dict[str, int]:
    counts = Counter(line.kind for line in lines)
    return {kind: counts.get(kind, 0) for kind in _KINDS}


_KINDS = (
    "add-service",
    "update-service",
    "delete-service",
    "add-dest",
    "update-dest",
    "delete-dest",
    "bind-address",
    "unbind-address",
    "firewall",  # ipset entries and iptables chains of IPVS mode's firewall rules
)


def render_text(
    lines: Sequence[Line], *, notes: Sequence[str] = (), repairs: Sequence[str] = ()
) -> str:
    """Readable plan: one line per change, then a summary line."""
    width = max((len(line.command) for line in lines), default=0)
    out = []
    for line in lines:
        text = f"{line.sign} {line.command:<{width}}"
        if line.cause:
            text += f"  # {line.cause}"
        if line.before:
            text += f" ({line.before})"
        out.append(text.rstrip())
    out += [f"! repair: {repair}" for repair in repairs]
    out += [f"note: {note}" for note in notes]
    out.append(summary_line(lines))
    if repairs:
        out.append(f"Repairs: {len(repairs)} (ipvsproxy's own rules were changed behind its back).")
    return "".join(escape(line) + "\n" for line in out)  # a name forges no line


def summary_line(lines: Sequence[Line]) -> str:
    if not lines:
        return "In sync: no changes."
    signs = Counter(line.sign for line in lines)
    return (
        f"Plan: {signs['+']} to add, {signs['~']} to change, {signs['-']} to delete "
        f"({len(lines)} operations)."
    )


def to_json(
    lines: Sequence[Line],
    *,
    warnings: Sequence[str],
    notes: Sequence[str] = (),
    repairs: Sequence[str] = (),
) -> str:
    doc: dict[str, Any] = {
        "in_sync": not lines and not repairs,
        "repairs": list(repairs),
        "summary": summarize(lines),
        "operations": [
            {
                "op": line.kind,
                "command": line.command,
                "cause": line.cause,
                **({"before": line.before.removeprefix("was: ")} if line.before else {}),
            }
            for line in lines
        ],
        "warnings": list(warnings),
        "notes": list(notes),
    }
    return json.dumps(doc, indent=2) + "\n"
