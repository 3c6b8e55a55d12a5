"""The status document as text: a block per Service port, sized to a terminal's width.

Owns: `render(doc, width=, wide=)`. Each block: the Service port (protocol, scheduler,
persistence, traffic policies, in sync or not), its virtual servers (one line; `wide`: one
each, with counters, rates and drift), then a row per endpoint. Columns that do not fit are
cut ("~" marks a cut), the widest first; a value the document has not (no counters in
the iptables fallback, no rates from one sample) is "-"; the footer says where the document
comes from, the last passes, the rates' window and whether the kernel is in sync. Pure: the
CLI passes the width.

Imports: logs (escape), the standard library.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ipvsproxy.logs import escape

Json = Mapping[str, Any]
GAP = "  "


@dataclass(frozen=True, slots=True)
class Column:
    title: str
    floor: int = 0  # cut down to this width at most (0: never cut)
    right: bool = False  # numbers


COLUMNS = {
    "ENDPOINT": Column("ENDPOINT", 15),
    "POD": Column("POD", 8),
    "NODE": Column("NODE", 6),
    "ZONE": Column("ZONE", 6),
    "STATE": Column("STATE", 5),
    "WEIGHT": Column("WEIGHT", right=True),
    "ACT": Column("ACT", right=True),
    "INACT": Column("INACT", right=True),
    "CONN/S": Column("CONN/S", right=True),
    "PKT/S": Column("PKT/S", right=True),
    "B/S": Column("B/S", right=True),
    "WHY NOT HERE": Column("WHY NOT HERE", 20),
}
NARROW = ("ENDPOINT", "POD", "NODE", "STATE", "WEIGHT", "ACT", "CONN/S", "B/S", "WHY NOT HERE")
WIDE = tuple(COLUMNS)


def render(doc: Json, *, width: int, wide: bool = False) -> str:
    """The document as lines of at most `width` characters."""
    out: list[str] = []
    for svc in doc["services"]:
        out += _block(svc, width=width, wide=wide)
        out.append("")
    if doc.get("otherDrift"):
        out.append("drift of no Service port (stale):")
        out += [f"  {line}" for line in doc["otherDrift"]]
        out.append("")
    if not doc["services"]:
        out += ["no Service matches", ""]
    out += _footer(doc)
    return "".join(_cut(escape(line), width) + "\n" for line in out)


def _block(svc: Json, *, width: int, wide: bool) -> list[str]:
    name = f"{svc['namespace']}/{svc['name']}"
    if svc["skipped"]:
        return [f"{name}  {svc['type']}  not programmed: {_SKIPPED[svc['skipped']]}"]
    head = f"{name}:{svc['port']}  {svc['protocol']}  {svc['scheduler']}"
    if svc["persistenceSeconds"]:
        head += f"  persistence {svc['persistenceSeconds']}s"
    policies = svc["trafficPolicies"]
    local = [f"{scope}TrafficPolicy: Local" for scope in ("internal", "external")
             if policies[scope] == "Local"]  # fmt: skip
    if local:
        head += "  " + ", ".join(local)
    if svc["pending"]:
        head += "  PENDING: changed since the last pass"
    if any(vs["drift"] for vs in svc["virtualServers"]):
        head += "  DRIFT"
    elif svc["inSync"]:
        head += "  in sync"
    lines = [head]
    if svc["fellBack"]:
        fell = " and ".join(svc["fellBack"])
        lines.append(
            f"  no local endpoint: {fell} virtual servers use the cluster's (for pods here)"
        )
    lines += _servers(svc["virtualServers"], wide=wide)
    names = WIDE if wide else NARROW
    rows = [_row(ep, svc, wide=wide) for ep in svc["endpoints"]]
    lines += ["  " + line for line in _table(names, rows, width - 2)]
    return lines


_SKIPPED = {
    "Headless": "headless (clusterIP: None): DNS answers with the pods",
    "ExternalName": "ExternalName: DNS answers with a name",
    "OtherProxy": "labelled service.kubernetes.io/service-proxy-name: another proxy's",
}


def _servers(servers: Sequence[Json], *, wide: bool) -> list[str]:
    if not wide:
        text = ", ".join(f"{_vs(vs)} {vs['kind']}{_flag(vs)}" for vs in servers)
        lines = [f"  virtual servers: {text or '(none)'}"]
        drift = [line for vs in servers for line in vs["drift"]]
        return lines + [f"  drift: {line}" for line in drift]
    lines = []
    for vs in servers:
        t = vs["traffic"]
        rates = t["rates"] if t else None
        counts = (
            f"  conns {t['connections']}  in {t['packetsIn']}p/{_num(t['bytesIn'])}B"
            f"  out {t['packetsOut']}p/{_num(t['bytesOut'])}B"
            if t
            else ""
        )
        if rates:
            counts += (f"  {_num(rates['connectionsPerSecond'])} conn/s"
                       f"  {_num(rates['bytesPerSecond'])} B/s")  # fmt: skip
        lines.append(f"  {vs['family']} {_vs(vs)} {vs['kind']}{_flag(vs)}{counts}")
        lines += [f"    drift: {line}" for line in vs["drift"]]
    return lines


def _vs(vs: Json) -> str:
    address = vs["address"]
    host = f"[{address}]" if ":" in address else address
    return f"{host}:{vs['port']}"


def _flag(vs: Json) -> str:
    if vs["claimedBy"]:
        return f" (used by {vs['claimedBy']})"
    return "" if vs["inKernel"] else " (not in the kernel)"


def _row(ep: Json, svc: Json, *, wide: bool) -> dict[str, str]:
    t = ep["traffic"]
    rates = t["rates"] if t else None
    address = ep["address"]
    host = f"[{address}]" if ":" in address else address
    return {
        "ENDPOINT": f"{host}:{ep['port']}" if ep["port"] else f"{host}:?",
        "POD": ep["pod"] or "-",
        "NODE": ep["node"] or "-",
        "ZONE": ep["zone"] or "-",
        "STATE": _state(ep),
        "WEIGHT": _weight(ep),
        "ACT": str(t["activeConnections"]) if t else "-",
        "INACT": str(t["inactiveConnections"]) if t else "-",
        "CONN/S": _num(rates["connectionsPerSecond"]) if rates else "-",
        "PKT/S": _num(rates["packetsPerSecond"]) if rates else "-",
        "B/S": _num(rates["bytesPerSecond"]) if rates else "-",
        "WHY NOT HERE": _why(ep, svc, wide=wide),
    }


def _state(ep: Json) -> str:
    if not ep["inSlice"]:
        return "removed"
    if ep["ready"]:
        return "ready"
    if ep["terminating"]:
        return "terminating" if ep["serving"] else "terminating,not-serving"
    return "not-ready"


def _weight(ep: Json) -> str:
    weights = sorted({p["weight"] for p in ep["programmed"]})
    if not weights:
        return "-"
    text = "/".join(map(str, weights))
    if ep["ramp"] is not None:
        text += " ramp"
    return text + " draining" if ep["draining"] else text


def _why(ep: Json, svc: Json, *, wide: bool) -> str:
    """The reasons, each with its scope unless it holds for every scope of the port."""
    left = ep["notProgrammed"]
    if not left:
        return "" if ep["programmed"] or not ep["inSlice"] else "not in the kernel (drift)"
    scopes = {vs["scope"] for vs in svc["virtualServers"]}
    by_reason: dict[str, list[str]] = {}
    for item in left:
        text = item["message"] if wide else item["reason"]
        by_reason.setdefault(text, []).append(item["scope"])
    parts = []
    for text, where in by_reason.items():
        parts.append(text if set(where) >= scopes else f"{text} ({', '.join(where)})")
    return "; ".join(parts)


def _table(names: Sequence[str], rows: Sequence[Mapping[str, str]], width: int) -> list[str]:
    """Rows under a title line, columns cut to fit `width` (the most cuttable first)."""
    widths = {n: max([len(n), *(len(r[n]) for r in rows)]) for n in names}
    _fit(widths, width - len(GAP) * (len(names) - 1))
    cols = [COLUMNS[n] for n in names]
    lines = []
    for cells in [{n: n for n in names}, *rows]:
        parts = []
        for col in cols:
            w = widths[col.title]
            text = _cut(cells[col.title], w)
            parts.append(text.rjust(w) if col.right else text.ljust(w))
        lines.append(GAP.join(parts).rstrip())
    return lines


def _fit(widths: dict[str, int], room: int) -> None:
    """Cut the widest cuttable column by one until the columns fit `room` (or none can be
    cut further: the line is then cut at the terminal's edge)."""
    excess = sum(widths.values()) - room
    while excess > 0:
        cuttable = [n for n in widths if COLUMNS[n].floor and widths[n] > COLUMNS[n].floor]
        if not cuttable:
            return
        widest = max(cuttable, key=lambda n: widths[n] - COLUMNS[n].floor)
        widths[widest] -= 1
        excess -= 1


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + "~"


def _num(value: float) -> str:
    """1234 -> 1.2k, 0.5 -> 0.5, 3 -> 3."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.1f}{unit}"
    return f"{value:.1f}".removesuffix(".0") if value != int(value) else str(int(value))


def _footer(doc: Json) -> list[str]:
    zone = f" (zone {doc['zone']})" if doc["zone"] else ""
    firewall = f" (firewall {doc['firewall']})" if doc.get("firewall") else ""
    where = (
        f"node {doc['node']}{zone}, backend {doc['backend'] or '-'}{firewall}, from {doc['source']}"
    )
    passes = (
        f"last full pass {doc['lastFullPass'] or '-'}, "
        f"last partial pass {doc['lastPartialPass'] or '-'}"
    )
    window = doc["rateWindowSeconds"]
    counted = any(vs["traffic"] for s in doc["services"] for vs in s["virtualServers"])
    rates = "rates: - (one sample)" if counted else "no counters"
    if window is not None:
        rates = f"rates over {window:g}s"
    if doc["inSync"]:
        state = "in sync"
    elif doc["otherDrift"] or any(
        vs["drift"] for s in doc["services"] for vs in s["virtualServers"]
    ):
        state = "DRIFT: the kernel differs from what is wanted"
    else:
        state = "PENDING: Services changed since the last pass (the next one applies them)"
    lines = [where, f"{passes}; {rates}", state]
    if doc["truncated"]:
        lines.append("(truncated: give NAMESPACE/NAME for one Service)")
    return lines + [f"warning: {w}" for w in doc["warnings"]]
