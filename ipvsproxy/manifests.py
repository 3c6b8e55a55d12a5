"""Read Kubernetes objects from YAML/JSON files, as `kubectl get ... -o yaml|json` prints them.

Owns: walking files and directories, multi-document YAML, `kind: List` (and typed lists such
as `ServiceList`, whose items carry no kind). A `.json` file is one JSON document read with
`json` (for 1000 Services x 10 endpoints, 4.5 MB: 0.05 s, where libyaml takes 4.7 s and
PyYAML's pure-Python loader 36 s); anything else is YAML, read with libyaml's `CSafeLoader`
when PyYAML was built with it, else with `SafeLoader` (the same documents, only slower).
Unreadable files, directories that cannot be listed (never skipped: their objects would
vanish from the desired state), invalid JSON or YAML (values PyYAML's constructors refuse
included), and YAML nested too deeply for libyaml raise ConfigError naming the file, never
another exception; judging the objects is the api package's job.

Input is bounded (issue 28): a file is read only if it is a regular file (a FIFO, a device
or a socket, given or found in a directory, is refused by name, never opened for a blocking
read), of at most MAX_FILE_BYTES, with at most MAX_DOCUMENTS documents; an object (a JSON
List item, a YAML document or List item) spans at most MAX_OBJECT_BYTES (the API server's own
request limit); YAML aliases may add at most MAX_ALIAS_NODES nodes to what the file spells
out, and a recursive alias is refused (an 870-byte file of nested `kind: List` aliases would
otherwise expand to 10**9 objects).

Imports: errors, api (types only), PyYAML, msgspec, the standard library.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import yaml

from ipvsproxy.api import RawJson, RawObject
from ipvsproxy.errors import ConfigError

SUFFIXES = (".yaml", ".yml", ".json")

# libyaml's loader when PyYAML has it: same results as SafeLoader, several times faster
YAML_LOADER: type[yaml.SafeLoader] | type[yaml.CSafeLoader] = getattr(
    yaml, "CSafeLoader", yaml.SafeLoader
)
# Kubernetes objects nest about 10 deep. PyYAML's C composer recurses without a limit and
# crashes the interpreter (SIGSEGV) somewhere between 10,000 and 30,000 levels: refuse
# anything deeper than this before composing.
MAX_DEPTH = 1000
MAX_FILE_BYTES = 256 * 2**20  # 10,000 Services x 10 endpoints as YAML: about 45 MB
MAX_DOCUMENTS = 100_000
MAX_OBJECT_BYTES = 3 * 2**20  # the API server refuses larger requests
# What aliases may add beyond the nodes a file spells out: anchors shared for labels or
# ports cost a few nodes per use; a billion laughs costs billions.
MAX_ALIAS_NODES = 100_000


def load(paths: Sequence[Path]) -> list[RawObject]:
    """Every object in these files and directories (recursively, in name order)."""
    return [_decoded(obj) if isinstance(obj, RawJson) else obj for obj in items(paths)]


def items(paths: Sequence[Path]) -> list[RawObject | RawJson]:
    """As `load()`, but the items of a JSON List come as their JSON text, by kind: the
    tracker decodes what it reads of them straight into views (api.read), and an object of
    a kind nobody reads is never decoded."""
    objects: list[RawObject | RawJson] = []
    for file in files(paths):
        objects.extend(read(file))
    return objects


def files(paths: Sequence[Path]) -> list[Path]:
    """The manifest files these paths name: each path that is not a directory, and every
    name with a manifest suffix under each directory (dangling symbolic links, FIFOs and
    the like included: reading them names the problem)."""
    return [file for path in paths for file in _files(path)]


def read(file: Path) -> list[RawObject | RawJson]:
    """The objects of one manifest file; ConfigError naming it."""
    return list(_objects(file))


def fingerprint(paths: Sequence[Path]) -> tuple[tuple[str, int, int], ...]:
    """What changes when any input file is added, removed or written: name, mtime, size."""
    out = []
    for file in files(paths):
        try:
            found = file.stat()
        except OSError:  # dangling, or removed since the listing: reading it says which
            out.append((str(file), -1, -1))
            continue
        out.append((str(file), found.st_mtime_ns, found.st_size))
    return tuple(out)


def _files(path: Path) -> Iterator[Path]:
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file or directory") from None
    except (OSError, ValueError) as exc:  # EACCES on a parent, ELOOP; a NUL in the name
        raise ConfigError(f"{path}: cannot read: {exc}") from exc
    if stat.S_ISDIR(mode):
        yield from sorted(_walk(path))
    else:
        yield path  # a file, or what reading it will name (a FIFO, a socket)


def _walk(top: Path) -> Iterator[Path]:
    """The manifest files under `top`, as `rglob("*")` finds them (symbolic links to
    directories not followed), except that a directory that cannot be listed is an error:
    rglob skips it silently, and its objects would vanish from the desired state."""

    def refuse(exc: OSError) -> None:
        raise ConfigError(f"{exc.filename}: cannot list: {exc.strerror or exc}") from exc

    for folder, _, names in os.walk(top, onerror=refuse):
        for name in names:
            file = Path(folder, name)
            if file.suffix in SUFFIXES:  # os.walk lists directories (and links to them) apart
                yield file


_KINDS_OF_FILE = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


def read_bytes(file: Path) -> bytes:
    """The file's bytes if it is a regular file of at most MAX_FILE_BYTES. Opened without
    blocking, so that a FIFO put in its place after the listing is refused, not waited on."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        if os.path.islink(file):
            raise ConfigError(f"{file}: a dangling symbolic link") from exc
        raise ConfigError(f"{file}: no such file") from exc
    except (OSError, ValueError) as exc:  # ENXIO: a socket; a NUL in the name
        if (kind := _special(file)) is not None:
            raise ConfigError(f"{file}: not a regular file ({kind})") from exc
        raise ConfigError(f"{file}: cannot read: {exc}") from exc
    with os.fdopen(fd, "rb") as stream:
        kind = _special_mode(os.fstat(fd).st_mode)
        if kind is not None:
            raise ConfigError(f"{file}: not a regular file ({kind})")
        os.set_blocking(fd, True)
        try:
            data = stream.read(MAX_FILE_BYTES + 1)
        except OSError as exc:
            raise ConfigError(f"{file}: cannot read: {exc}") from exc
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{file}: larger than {MAX_FILE_BYTES} bytes")
    return data


def _special(file: Path) -> str | None:
    try:
        return _special_mode(file.stat().st_mode)
    except (OSError, ValueError):
        return None


def _special_mode(mode: int) -> str | None:
    return next((kind for test, kind in _KINDS_OF_FILE if test(mode)), None)


def _objects(file: Path) -> Iterator[RawObject | RawJson]:
    data = read_bytes(file)
    if file.suffix == ".json":
        listed = _json_items(data.removeprefix(b"\xef\xbb\xbf"))
        if listed is not None:
            for item in listed:
                if len(item.data) > MAX_OBJECT_BYTES:
                    raise ConfigError(f"{file}: a {item.kind} larger than {MAX_OBJECT_BYTES} bytes")
            yield from listed
            return
    for index, doc in enumerate(parse(file, data)):
        if doc is None:
            continue
        if not isinstance(doc, dict):
            raise ConfigError(f"{file}: document {index + 1} is not a Kubernetes object")
        yield from _expand(doc, f"{file}: document {index + 1}")


def parse(file: Path, data: bytes) -> list[Any]:
    """The documents in a file's bytes: one JSON document if its name ends in .json, else
    YAML's, within the bounds above; ConfigError naming the file (kpconfig reads --config
    with this too)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{file}: cannot read: {exc}") from exc
    return _json(file, text) if file.suffix == ".json" else _yaml(file, text)


class _List(msgspec.Struct):
    """A JSON document that is a List, its items not decoded."""

    kind: str
    items: list[msgspec.Raw] | None = None


class _Kind(msgspec.Struct):
    """A List item that names its kind."""

    kind: str


_LIST = msgspec.json.Decoder(_List)
_KIND = msgspec.json.Decoder(_Kind)


def _json_items(data: bytes) -> list[RawJson] | None:
    """The items of a JSON document that is a `kind: ...List` whose every item is an object
    naming its own kind (what `kubectl get -o json` prints), as their JSON text; None for
    any other document (a single object, a typed list, a nested list, invalid JSON), which
    `_json()` reads whole as before. msgspec splits the items without decoding them."""
    try:
        document = _LIST.decode(data)
        if not document.kind.endswith("List"):
            return None
        out = []
        for item in document.items or ():
            kind = _KIND.decode(item).kind
            if kind.endswith("List"):
                return None
            out.append(RawJson(kind, bytes(item)))
        return out
    except (msgspec.MsgspecError, RecursionError):
        return None


def _decoded(obj: RawJson) -> RawObject:
    """A List item decoded as `json.loads` reads it (it was valid JSON as a part of its
    document, so this fails only past Python's recursion limit)."""
    try:
        decoded: RawObject = json.loads(obj.data)
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"a {obj.kind} in the manifests: invalid JSON: {exc}") from exc
    return decoded


def _json(file: Path, text: str) -> list[Any]:
    try:
        return [json.loads(text.removeprefix("\ufeff"))]  # a BOM, as YAML allows
    except ValueError as exc:  # json.JSONDecodeError
        raise ConfigError(f"{file}: invalid JSON: {exc}") from exc
    except RecursionError as exc:
        raise ConfigError(f"{file}: invalid JSON: nested too deeply") from exc


def _yaml(file: Path, text: str) -> list[Any]:
    try:
        if _depth(text) > MAX_DEPTH:
            raise ConfigError(f"{file}: invalid YAML: nested deeper than {MAX_DEPTH} levels")
        return _documents(file, text)
    except (yaml.YAMLError, ValueError, LookupError, TypeError, ArithmeticError) as exc:
        # PyYAML's constructors let Python's own errors through for values they refuse: an
        # integer of over 4300 digits, a 13th month, `!!float x` (ValueError), `!!int ''`
        # (IndexError). tests/test_manifests.py fuzzes this.
        raise ConfigError(f"{file}: invalid YAML: {exc}".replace("\n", " ")) from exc


def _documents(file: Path, text: str) -> list[Any]:
    """`yaml.load_all`, each document's node graph checked before it is constructed."""
    # Without an anchor there is no alias (libyaml refuses an undefined one): the check,
    # which about doubles a load's time, runs only when the text has both characters
    aliases = "&" in text and "*" in text
    loader = YAML_LOADER(text)
    try:
        documents: list[Any] = []
        while loader.check_node():
            if len(documents) == MAX_DOCUMENTS:
                raise ConfigError(f"{file}: more than {MAX_DOCUMENTS} documents")
            node = loader.get_node()
            if aliases and node is not None:
                _check_aliases(file, node)
            if node is not None:
                _check_sizes(file, node)
            documents.append(loader.construct_document(node))
        return documents
    finally:
        loader.dispose()


def _check_aliases(file: Path, root: yaml.Node) -> None:
    """Refuse a node graph whose aliases expand it by more than MAX_ALIAS_NODES nodes, or
    nest it deeper than MAX_DEPTH, or make it a cycle. Nodes an alias names are shared
    (the composer keeps one node per anchor), so each is measured once: linear in the nodes
    the file spells out, without recursion."""
    measured: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded nodes, depth)
    open_: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        children = _children(node)
        if finished:
            open_.discard(key)
            size = 1 + sum(measured[id(child)][0] for child in children)
            depth = 1 + max((measured[id(child)][1] for child in children), default=0)
            measured[key] = (size, depth)
            if size > len(measured) + MAX_ALIAS_NODES:
                raise ConfigError(
                    f"{file}: invalid YAML: aliases expand it by more than "
                    f"{MAX_ALIAS_NODES} nodes (line {node.start_mark.line + 1})"
                )
            if depth > MAX_DEPTH:
                raise ConfigError(
                    f"{file}: invalid YAML: aliases nest it deeper than {MAX_DEPTH} levels"
                )
        elif key in open_:
            raise ConfigError(
                f"{file}: invalid YAML: a recursive alias (line {node.start_mark.line + 1})"
            )
        elif key not in measured:
            open_.add(key)
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in measured)


def _check_sizes(file: Path, root: yaml.Node) -> None:
    """Refuse an object (a document, or an item of a List, nested) spelled out in more than
    MAX_OBJECT_BYTES of the text (libyaml counts characters: bytes for ASCII)."""
    stack, seen = [root], set()
    while stack:
        node = stack.pop()
        if id(node) in seen or not isinstance(node, yaml.MappingNode):
            continue  # (what is not an object is refused once constructed)
        seen.add(id(node))
        items = _list_items(node)
        if items is not None:
            stack.extend(items)
        elif node.end_mark.index - node.start_mark.index > MAX_OBJECT_BYTES:
            raise ConfigError(
                f"{file}: line {node.start_mark.line + 1}: an object larger than "
                f"{MAX_OBJECT_BYTES} bytes"
            )


def _list_items(node: yaml.MappingNode) -> list[yaml.Node] | None:
    """The item nodes of a `kind: ...List` mapping node; None if it is not a List."""
    fields = {key.value: value for key, value in node.value if isinstance(key, yaml.ScalarNode)}
    kind = fields.get("kind")
    if not isinstance(kind, yaml.ScalarNode) or not str(kind.value).endswith("List"):
        return None
    items = fields.get("items")
    return list(items.value) if isinstance(items, yaml.SequenceNode) else []


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _depth(text: str) -> int:
    """An upper bound of the documents' nesting depth, exact when the quick bound is high.

    Quick bound (a few milliseconds for megabytes): a block collection nests at most one level
    per column of its line (a sequence may start at its key's column, its items' content two
    columns right), and a flow collection at most one level per `[` or `{` not immediately
    closed. When that allows more than MAX_DEPTH (long lines, much flow style), count the
    parser's events instead (its C scanner keeps explicit stacks; about a seventh of a load).
    """
    longest = max((len(line) for line in text.splitlines()), default=0)
    flow = text.count("[") - text.count("[]") + text.count("{") - text.count("{}")
    if 2 * longest + flow + 2 <= MAX_DEPTH:
        return 2 * longest + flow + 2
    depth = deepest = 0
    for event in yaml.parse(text, Loader=YAML_LOADER):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                break  # enough to refuse; the rest may take long to parse
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
    return deepest


def _expand(doc: dict[str, Any], where: str) -> Iterator[RawObject]:
    kind = doc.get("kind")
    if not isinstance(kind, str) or not kind.endswith("List"):
        yield doc
        return
    items = doc.get("items") or []
    if not isinstance(items, list):
        raise ConfigError(f"{where}: {kind}.items is not a list")
    item_kind = kind.removesuffix("List") or None
    for item in items:
        if not isinstance(item, dict):
            raise ConfigError(f"{where}: an item of {kind} is not an object")
        if "kind" not in item and item_kind:
            item = {**item, "kind": item_kind}
        yield from _expand(item, where)
