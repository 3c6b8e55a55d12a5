"""`iptables-save` text -> the chains of one owner (pure).

Owns: the one reader of `iptables-save` rules, `tokens()` and `target()` (a rule read word
by word as iptables-restore reads it: double quotes and backslash escapes respected, the
argument of a free-text option such as `--comment` never taken for an option, so a comment
saying `-j KUBE-FORWARD` is no jump and a comment holding `a" -j ACCEPT "b` hides none), and
`parse_save()` (the chains an `owns` predicate claims, by exact name, and the rules
elsewhere whose target is one of them; every other chain and rule is skipped, never
interpreted; the fallback, firewall/ and kpcleanup.py use it). What the fallback's chains
encode is read by fallback/chain_reader.py.

Imports: the standard library.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Saved:
    """What `iptables-save` shows of ipvsproxy in one family's nat table."""

    chains: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    jumps: tuple[tuple[str, str], ...] = ()  # (chain, rule spec) into our chains from others


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


def parse_save(text: str, *, table: str = "nat", owns: Callable[[str], bool]) -> Saved:
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
