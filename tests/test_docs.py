"""The documentation: the CLI reference is current, the README short, every relative link good
(its file there, its #anchor a heading of that file)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def cli_docs() -> ModuleType:
    """scripts/cli-docs as a module (it has no .py suffix); it imports only ipvsproxy.cli."""
    path = ROOT / "scripts" / "cli-docs"
    loader = importlib.machinery.SourceFileLoader("cli_docs", str(path))
    spec = importlib.util.spec_from_loader("cli_docs", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_the_cli_reference_is_generated_from_the_current_help():
    script = cli_docs()
    current = script.DOC.read_text()
    assert script.splice(current, script.generate()) == current, (
        "docs/cli.md's command reference is stale: run scripts/cli-docs"
    )


def test_the_readme_has_at_most_200_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"


def test_every_relative_link_points_to_a_file_that_exists():
    broken = []
    for doc in DOCS:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.DOTALL)  # code is not links
        for target in LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL (https:, mailto:) or an anchor in the same page
            path = target.split("#", 1)[0]
            if not (doc.parent / path).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def anchors(doc: Path) -> set[str]:
    """The `#fragment` of each heading of a page, as GitHub makes them: lower case, without
    punctuation but hyphens and underscores, spaces as hyphens; a repeated one gets `-1`, ..."""
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.DOTALL)
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def test_every_anchor_of_a_relative_link_is_a_heading_there():
    """Pages link to each other's sections (README.md to deployment.md#install-on-kubeadm,
    ...): a renamed heading breaks them silently on GitHub."""
    broken = []
    for doc in DOCS:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.DOTALL)
        for target in LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or "#" not in target:
                continue
            path, anchor = target.split("#", 1)
            page = doc.parent / path if path else doc
            if page.suffix == ".md" and page.exists() and anchor not in anchors(page):
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, "links to missing headings:\n" + "\n".join(broken)


def package_strings() -> list[tuple[str, str]]:
    """Every string literal of the package (log lines, errors, `--help` texts, docstrings),
    with where it is."""
    import ast

    found = []
    for path in sorted((ROOT / "ipvsproxy").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.append((f"{path.relative_to(ROOT)}:{node.lineno}", node.value))
    return found


def test_every_doc_reference_in_the_packages_strings_exists():
    """What the agent tells an operator to read (a warning's "see docs/fallback.md#schedulers",
    a README section) is there: the page, its anchor, the README's heading."""
    readme = {t.lower() for t in re.findall(r"^#+\s+(.*?)\s*$", (ROOT / "README.md").read_text(),
                                            flags=re.MULTILINE)}  # fmt: skip
    broken = []
    for where, text in package_strings():
        for page, anchor in re.findall(r"\bdocs/([\w.-]+\.md)(?:#([\w-]+))?", text):
            doc = ROOT / "docs" / page
            if not doc.is_file() or (anchor and anchor not in anchors(doc)):
                broken.append(f"{where}: docs/{page}{'#' + anchor if anchor else ''}")
        for section in re.findall(r"README(?:'s)?,?\s+[\"']([^\"']+)[\"']", text):
            if section.lower() not in readme:
                broken.append(f"{where}: README section {section!r}")
        if re.search(r"README(?!(?:'s)?,?\s+[\"'])", text):
            broken.append(f"{where}: README without a section")
    assert not broken, "references to missing docs:\n" + "\n".join(broken)
