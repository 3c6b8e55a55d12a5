"""Read Kubernetes objects from YAML/JSON files, as `kubectl get ... -o yaml` prints them.

Owns: walking files and directories, multi-document YAML, `kind: List` (and typed lists such
as `ServiceList`, whose items carry no kind). Unreadable files and invalid YAML raise
ConfigError naming the file; judging the objects is api.py's job.

Imports: errors, api (types only), PyYAML, the standard library.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from ipvsproxy.api import RawObject
from ipvsproxy.errors import ConfigError

SUFFIXES = (".yaml", ".yml", ".json")


def load(paths: Sequence[Path]) -> list[RawObject]:
    """Every object in these files and directories (recursively, in name order)."""
    objects: list[RawObject] = []
    for path in paths:
        for file in _files(path):
            objects.extend(_objects(file))
    return objects


def fingerprint(paths: Sequence[Path]) -> tuple[tuple[str, int, int], ...]:
    """What changes when any input file is added, removed or written: name, mtime, size."""
    out = []
    for path in paths:
        for file in _files(path):
            try:
                stat = file.stat()
            except OSError:  # removed between listing and stat: the next look sees it
                continue
            out.append((str(file), stat.st_mtime_ns, stat.st_size))
    return tuple(out)


def _files(path: Path) -> Iterator[Path]:
    if path.is_dir():
        yield from sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
    elif path.is_file():
        yield path
    else:
        raise ConfigError(f"{path}: no such file or directory")


def _objects(file: Path) -> Iterator[RawObject]:
    try:
        text = file.read_text(encoding="utf-8")
        documents = list(yaml.safe_load_all(text))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{file}: cannot read: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{file}: invalid YAML: {exc}".replace("\n", " ")) from exc
    for index, doc in enumerate(documents):
        if doc is None:
            continue
        if not isinstance(doc, dict):
            raise ConfigError(f"{file}: document {index + 1} is not a Kubernetes object")
        yield from _expand(doc, f"{file}: document {index + 1}")


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
