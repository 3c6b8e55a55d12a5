"""The shell blocks of a Markdown page, as written: what the tests, the IPVS VM's migration test
and the Vagrant cluster run from the operator's pages (docs/migration.md, docs/deployment.md),
so that each runs the page's own commands, not a copy of them.

`blocks(text, section)` is every ```sh block, or those under the `## ` heading that starts
with `section` (up to the next `## `). As a command (the Vagrant cluster's nodes run it with
their own python3; nothing but the standard library):

    python3 integration/docblocks.py docs/migration.md "## 3."   # the blocks, one after another
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

FENCE = re.compile(r"^```sh\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)


def section_of(text: str, heading: str) -> str:
    """The part of `text` under the `## ` heading that starts with `heading`, to the next."""
    parts = re.split(r"^(?=## )", text, flags=re.MULTILINE)
    found = [p for p in parts if p.startswith(heading)]
    if len(found) != 1:
        raise ValueError(f"{len(found)} sections start with {heading!r}")
    return found[0]


def blocks(text: str, section: str | None = None) -> list[str]:
    """The ```sh blocks of `text`, or of one of its sections."""
    return FENCE.findall(text if section is None else section_of(text, section))


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print("usage: docblocks.py PAGE.md [SECTION-HEADING-START]", file=sys.stderr)
        return 2
    text = Path(argv[1]).read_text()
    try:
        found = blocks(text, argv[2] if len(argv) == 3 else None)
    except ValueError as exc:
        print(f"docblocks.py: {argv[1]}: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write("".join(found))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
