"""ipset's text formats for the firewall sets (pure): the restore script, the save output.

Owns: `SetChange` (what to do to one set), `ipset_script()` (changes -> `ipset restore`
input), `parse_ipset_save()`, `parse_names()` and the sizing (`maxelem_for()`,
`hashsize_for()`). No process is run here.

Sizing: ipset's defaults (hashsize 1024, maxelem 65536) hold a fixed number of entries; a
set is created with room for twice what is wanted (never below the defaults), and one whose
capacity gets too small is rebuilt bigger as a temporary set swapped in (swap takes sets of
the same type and family, whatever their sizes).

Writes spell protocols by number (`10.244.1.2,6:8080,10.244.1.2`; `ipset save` still prints
`tcp:8080`): the ipset tool resolves a protocol name with getprotobyname(), which opens and reads
/etc/protocols for every entry: numbers make several times fewer system calls per entry, which
matters on a node whose root filesystem is slow (a network or overlay filesystem) and at 12,000
entries (1000 Services x 10 endpoints), where names could outlast the 60 s limit of `Commands`.

Imports: firewall.sets, the standard library.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ipvsproxy.firewall.sets import OWNED_SETS, TEMPORARY, SetState

BULK = 64  # more changes than this to one set: build a temporary set and swap it in
DEFAULT_MAXELEM = 65536  # ipset's default capacity
DEFAULT_HASHSIZE = 1024  # ipset's default initial number of buckets
PROTOCOL_NUMBERS = {"tcp": 6, "udp": 17, "sctp": 132}  # IANA, as in /etc/protocols


def maxelem_for(count: int) -> int:
    """The capacity a set holding `count` entries is created with: room to double."""
    return max(DEFAULT_MAXELEM, 1 << (2 * count - 1).bit_length()) if count else DEFAULT_MAXELEM


def hashsize_for(count: int) -> int:
    """The initial number of buckets: about one per entry, so filling never resizes."""
    return max(DEFAULT_HASHSIZE, 1 << (max(count, 1) - 1).bit_length())


def too_small(maxelem: int, count: int) -> bool:
    """Whether a set of capacity `maxelem` must be rebuilt to hold `count` entries."""
    return maxelem < count or maxelem_for(count) > max(maxelem, DEFAULT_MAXELEM)


@dataclass(frozen=True, slots=True)
class SetChange:
    name: str
    kind: str
    version: int
    create: bool = False
    add: tuple[str, ...] = ()
    delete: tuple[str, ...] = ()
    wanted: frozenset[str] = frozenset()  # all entries, for a swap
    rebuild: bool = False  # too small: rebuilt bigger and swapped in, whatever the changes

    @property
    def swap(self) -> bool:
        return not self.create and (self.rebuild or len(self.add) + len(self.delete) > BULK)


@dataclass(frozen=True, slots=True)
class SetCommand:
    """One line of an `ipset restore -exist` script; what the netlink writer sends too.
    `entries` (add, del) are spelt as `ipset save` prints them; `other`: swap's second set."""

    verb: str  # create | add | del | swap | flush | destroy
    name: str
    kind: str = ""
    version: int = 4
    hashsize: int = 0
    maxelem: int = 0
    entries: tuple[str, ...] = ()
    other: str = ""

    def lines(self) -> list[str]:
        if self.verb in ("add", "del"):
            return [f"{self.verb} {self.name} {_numeric(entry)}" for entry in self.entries]
        if self.verb == "create":
            family = "inet" if self.version == 4 else "inet6"
            return [
                f"create {self.name} {self.kind} family {family} hashsize {self.hashsize} "
                f"maxelem {self.maxelem}"
            ]
        if self.verb == "swap":
            return [f"swap {self.name} {self.other}"]
        return [f"{self.verb} {self.name}"]


def set_commands(changes: Iterable[SetChange]) -> list[SetCommand]:
    """Creates, small changes in place, big ones filled into a temporary set swapped in."""
    out: list[SetCommand] = []
    for change in changes:
        size = len(change.wanted) if change.create or change.swap else 0
        shape = (change.kind, change.version, hashsize_for(size), maxelem_for(size))
        if change.create:
            out.append(SetCommand("create", change.name, *shape))
        if change.swap:
            temporary = change.name + TEMPORARY
            # a leftover temporary set (a crash between create and swap) may have other
            # sizes, which `create -exist` refuses: destroy it first
            out.append(SetCommand("destroy", temporary))
            out.append(SetCommand("create", temporary, *shape))
            out.append(_entries("add", temporary, change, tuple(change.wanted)))
            out.append(SetCommand("swap", temporary, other=change.name))
            out.append(SetCommand("destroy", temporary))
            continue
        if change.add:
            out.append(_entries("add", change.name, change, change.add))
        if change.delete:
            out.append(_entries("del", change.name, change, change.delete))
    return out


def destroy_commands(names: Iterable[str]) -> list[SetCommand]:
    return [SetCommand("destroy", name) for name in names]


def _entries(verb: str, name: str, change: SetChange, entries: tuple[str, ...]) -> SetCommand:
    return SetCommand(verb, name, change.kind, change.version, entries=entries)


def render_script(commands: Iterable[SetCommand]) -> str:
    """`ipset restore -exist` input for these commands."""
    return "".join(line + "\n" for command in commands for line in command.lines())


def ipset_script(changes: Iterable[SetChange]) -> str:
    """`ipset restore -exist` input: creates, small changes in place, big ones swapped in."""
    return render_script(set_commands(changes))


def _numeric(entry: str) -> str:
    """An entry with its protocol as a number (`ip,tcp:80` -> `ip,6:80`), which ipset parses
    without reading /etc/protocols."""
    address, comma, rest = entry.partition(",")
    proto, colon, tail = rest.partition(":")
    number = PROTOCOL_NUMBERS.get(proto)
    if number is None or not colon:
        return entry  # hash:ip: no protocol
    return f"{address}{comma}{number}:{tail}"


def host_after(before: SetState, changes: Iterable[SetChange]) -> SetState:
    """What the host holds once these changes are written over `before` (pure): what a
    full sync seeds a `SetIndex` with, without observing the host again."""
    sets = dict(before.sets)
    maxelem = dict(before.maxelem)
    for change in changes:
        if change.create or change.swap:
            sets[change.name] = (change.kind, change.version, change.wanted)
            maxelem[change.name] = maxelem_for(len(change.wanted))
            continue
        _, _, entries = sets[change.name]
        entries = (entries | frozenset(change.add)) - frozenset(change.delete)
        sets[change.name] = (change.kind, change.version, entries)
    return SetState(sets, maxelem)


Header = tuple[str, int, int, int]  # type, IP version, maxelem, number of entries


def parse_headers(text: str) -> dict[str, Header]:
    """ipvsproxy's sets from `ipset list -t` (headers only: no entry is printed, so ipset
    looks up no protocol name): name -> (type, IP version, maxelem, number of entries)."""
    found: dict[str, Header] = {}
    name, kind, version, maxelem = "", "", 4, DEFAULT_MAXELEM
    for line in text.splitlines():
        key, _, value = line.partition(": ")
        if key == "Name":
            name = value.strip()
        elif key == "Type":
            kind = value.strip()
        elif key == "Header":
            words = value.split()
            options = dict(zip(words[::2], words[1::2], strict=False))
            version = 6 if options.get("family") == "inet6" else 4
            maxelem = int(options.get("maxelem", DEFAULT_MAXELEM))
        elif key == "Number of entries" and name in OWNED_SETS:
            found[name] = (kind, version, maxelem, int(value))
    return found


def parse_names(text: str) -> list[str]:
    """ipvsproxy's set names (exactly `sets.OWNED_SETS`) from `ipset list -n`."""
    return [name for name in text.split() if name in OWNED_SETS]


def save_script(names: Iterable[str]) -> str:
    """`ipset restore` input that saves only these sets (one process for all of them)."""
    return "".join(f"save {name}\n" for name in names)


def parse_ipset_save(text: str) -> SetState:
    """ipvsproxy's sets (exactly `sets.OWNED_SETS`) from `ipset save`, with their maxelem."""
    sets: dict[str, tuple[str, int, set[str]]] = {}
    maxelem: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3 or parts[1] not in OWNED_SETS:
            continue
        if parts[0] == "create":
            version = 6 if "inet6" in parts[3:5] else 4
            sets[parts[1]] = (parts[2], version, set())
            options = dict(zip(parts[3::2], parts[4::2], strict=False))
            maxelem[parts[1]] = int(options.get("maxelem", DEFAULT_MAXELEM))
        elif parts[0] == "add" and parts[1] in sets:
            sets[parts[1]][2].add(parts[2])
    return SetState(
        {name: (kind, v, frozenset(found)) for name, (kind, v, found) in sets.items()}, maxelem
    )
