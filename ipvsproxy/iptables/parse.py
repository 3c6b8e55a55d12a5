"""`iptables-save` text -> the chains of one owner -> IPVS state (pure).

Owns: the one reader of `iptables-save` rules, `tokens()` and `target()` (a rule read word
by word as iptables-restore reads it: double quotes and backslash escapes respected, the
argument of a free-text option such as `--comment` never taken for an option, so a comment
saying `-j KUBE-FORWARD` is no jump and a comment holding `a" -j ACCEPT "b` hides none);
`parse_save()` (the chains an `owns` predicate claims, by exact name, and the rules
elsewhere whose target is one of them; every other chain and rule is skipped, never
interpreted; kpcleanup.py and firewall/ use it too), and `read_state()` (the
virtual servers and destinations those chains encode, read best-effort: whatever cannot be
read is left out, so the planner puts it back; `transaction.damage()` finds the rest).

Imports: iptables.rules, model, schedulers, the standard library.
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from ipaddress import ip_address

from ipvsproxy.iptables.rules import (
    SERVICES,
    SVC_PREFIX,
    VIP_COMMENT,
    group_of,
    is_sep,
    owned,
)
from ipvsproxy.model import (
    IPAddress,
    IpvsState,
    Proto,
    RealServer,
    RSKey,
    ServiceFlags,
    VirtualServer,
    VSKey,
    parse_host_port,
)
from ipvsproxy.schedulers import Scheduler


@dataclass(frozen=True, slots=True)
class Saved:
    """What `iptables-save` shows of ipvsproxy in one family's nat table."""

    chains: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    jumps: tuple[tuple[str, str], ...] = ()  # (chain, rule spec) into our chains from others


_COMMENT = r'--comment (?:"(?P<c>[^"]*)"|(?P<bare>\S+))'
_DISPATCH = re.compile(
    rf"-A {SERVICES} -d (?P<addr>[0-9a-f.:]+)/(?:32|128) -p (?P<proto>tcp|udp|sctp) "
    rf"-m comment {_COMMENT} -m (?P=proto) --dport (?P<port>\d+) -j (?P<svc>{SVC_PREFIX}\w+)$"
)
_VIP = re.compile(
    rf"-A {SERVICES} -d (?P<addr>[0-9a-f.:]+)/(?:32|128) "
    rf'-m comment --comment "{VIP_COMMENT}" -j RETURN$'
)
_SERVICE = re.compile(
    r"(?P<name>\S+) sched=(?P<sched>\w+) flags=(?P<flags>0x[0-9a-f]+) timeout=(?P<timeout>\d+)$"
)
_DNAT = re.compile(rf"-m comment {_COMMENT} -j DNAT --to-destination (?P<to>\S+)$")
_WEIGHT = re.compile(r"\S+ weight=(?P<weight>\d+)$")


# One word of a rule: runs of plain characters, backslash escapes and double-quoted parts
# (iptables-save quotes a value holding anything but letters, digits, `_` and `-`, and
# escapes `"`, `\\` and `'` inside with a backslash: libxtables' xtables_save_string()).
_WORD = re.compile(r'(?:[^\s"\\]+|\\.|"[^"\\]*(?:\\.[^"\\]*)*")+')
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"|\\(.)')
_ESCAPE = re.compile(r"\\(.)")
# Options whose argument is free text (may read like an option): skipped whole.
FREE_TEXT = frozenset(
    {"--comment", "--string", "--hex-string", "--log-prefix", "--nflog-prefix", "--name"}
)
_TARGET = frozenset({"-j", "--jump", "-g", "--goto"})


def tokens(rule: str) -> list[str]:
    """A rule's words as iptables-restore reads them (quotes removed, escapes resolved;
    a quote left open, which iptables-save never prints, is dropped)."""
    words = _WORD.findall(rule)
    return [_unquote(w) if '"' in w or "\\" in w else w for w in words]


def _unquote(word: str) -> str:
    return _QUOTED.sub(lambda m: _ESCAPE.sub(r"\1", m[1]) if m[1] is not None else m[2], word)


def target(rule: str | list[str]) -> str:
    """The target a rule jumps or goes to (`-j`/`-g`, as an option, never inside the
    argument of `--comment` and the like); "" when it has none."""
    # Options and targets are never quoted: the raw words will do, unquoted only if needed
    # (a rule render() writes is read here too: _load_order(), thousands per pass).
    words = (
        (rule.split() if '"' not in rule and "\\" not in rule else _WORD.findall(rule))
        if isinstance(rule, str)
        else rule
    )
    skip = False
    for i, word in enumerate(words):
        if skip:
            skip = False
        elif word in FREE_TEXT:
            skip = True
        elif word in _TARGET and i + 1 < len(words):
            found = words[i + 1]
            return _unquote(found) if '"' in found or "\\" in found else found
    return ""


def parse_save(text: str, *, table: str = "nat", owns: Callable[[str], bool] = owned) -> Saved:
    """The chains `owns` claims (rules in order, as printed) and the rules elsewhere whose
    target is one of them (chain, rule spec), in one table of `iptables-save` output.
    Ownership is by exact name: a chain `owns` does not claim is never read, whatever its
    name looks like, and a rule is a jump only when its target (`target()`) is claimed."""
    chains: dict[str, list[str]] = {}
    others: list[tuple[str, str]] = []
    claims = functools.cache(owns)  # asked once per chain name
    current = ""
    for line in text.splitlines():
        if line.startswith("*"):
            current = line[1:].strip()
        elif current != table:
            continue
        elif line.startswith(":"):
            name = line[1:].split(" ", 1)[0]
            if claims(name):
                chains.setdefault(name, [])
        elif line.startswith("-A "):
            chain, _, spec = line[3:].partition(" ")
            if claims(chain):
                chains.setdefault(chain, []).append(line)
            else:
                others.append((chain, spec))
    jumps = [(chain, spec) for chain, spec in others if claims(target(spec))]
    return Saved({k: tuple(v) for k, v in chains.items()}, tuple(jumps))


def read_state(saved: Saved) -> tuple[IpvsState, dict[VSKey, str]]:
    """The virtual servers, destinations and VIPs the chains encode, and each one's name."""
    services: dict[VSKey, VirtualServer] = {}
    names: dict[VSKey, str] = {}
    svc_of: dict[str, VSKey] = {}
    bound: set[IPAddress] = set()
    for line in saved.chains.get(SERVICES, ()):
        if vip := _VIP.match(line):
            bound.add(ip_address(vip["addr"]))
        elif parsed := _service(line):
            vs, name, chain = parsed
            services[vs.key], names[vs.key], svc_of[group_of(chain)] = vs, name, vs.key
    dests: dict[VSKey, dict[RSKey, RealServer]] = defaultdict(dict)
    for chain, lines in saved.chains.items():
        key = svc_of.get(group_of(chain)) if is_sep(chain) else None
        rs = _dest(lines) if key is not None else None
        if key is not None and rs is not None:
            dests[key][rs.key] = rs
    state = IpvsState(
        services=services,
        dests={key: dests.get(key, {}) for key in services},
        bound=frozenset(bound),
    )
    return state, names


def _service(line: str) -> tuple[VirtualServer, str, str] | None:
    m = _DISPATCH.match(line)
    meta = _SERVICE.match(m["c"] or m["bare"]) if m else None
    if m is None or meta is None:
        return None
    try:
        key = VSKey(ip_address(m["addr"]), int(m["port"]), Proto[m["proto"].upper()])
        vs = VirtualServer(
            key,
            scheduler=Scheduler(meta["sched"]),
            flags=ServiceFlags(int(meta["flags"], 16)),
            timeout_s=int(meta["timeout"]),
        )
    except ValueError:
        return None
    return vs, meta["name"], m["svc"]


def _dest(lines: tuple[str, ...]) -> RealServer | None:
    for line in lines:
        m = _DNAT.search(line)
        weight = _WEIGHT.match(m["c"] or m["bare"]) if m else None
        if m is not None and weight is not None:
            try:
                address, port = parse_host_port(m["to"])
            except ValueError:
                return None
            return RealServer(RSKey(address, port), weight=int(weight["weight"]))
    return None
