"""Show a plan the way a reviewer wants to read it: ipvsadm terms, one line per change.

Owns: `render_text(plan, ...)` (`+`/`-`/`~` lines with the causing Service, then a summary)
and `to_json(plan, ...)` for machines. Operations are described once, in `describe()`.

Imports: model, kernel, ipvsadm.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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


def describe(op: Op, origins: Mapping[VSKey, str], observed: IpvsState, device: str) -> Line:
    """The words for one operation."""
    match op:
        case AddService(vs):
            return Line(
                "+", "add-service", f"ipvsadm -A {service_args(vs)}", _cause(vs.key, origins)
            )
        case UpdateService(vs):
            seen = observed.services.get(vs.key)
            before = f"was: {service_args(seen)}" if seen else ""
            cmd = f"ipvsadm -E {service_args(vs)}"
            return Line("~", "update-service", cmd, _cause(vs.key, origins), before)
        case DeleteService(key):
            return Line("-", "delete-service", f"ipvsadm -D {key_args(key)}", STALE)
        case AddDest(key, rs):
            return Line("+", "add-dest", f"ipvsadm -a {dest_args(key, rs)}", _cause(key, origins))
        case UpdateDest(key, rs):
            seen_rs = observed.dests.get(key, {}).get(rs.key)
            before = f"was: {dest_args(key, seen_rs)}" if seen_rs else ""
            cmd = f"ipvsadm -e {dest_args(key, rs)}"
            return Line("~", "update-dest", cmd, _cause(key, origins), before)
        case DeleteDest(key, rs_key):
            cmd = f"ipvsadm -d {key_args(key)} -r {rs_key}"
            return Line("-", "delete-dest", cmd, _cause(key, origins))
        case BindAddress(address):
            prefix = 32 if address.version == 4 else 128
            return Line("+", "bind-address", f"ip addr add {address}/{prefix} dev {device}", "")
        case UnbindAddress(address):
            prefix = 32 if address.version == 4 else 128
            return Line("-", "unbind-address", f"ip addr del {address}/{prefix} dev {device}", "")
    raise TypeError(f"not an operation: {op!r}")  # pragma: no cover


def _cause(key: VSKey, origins: Mapping[VSKey, str]) -> str:
    return origins.get(key, STALE)


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
    return "\n".join(out) + "\n"


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
