#!/usr/bin/env python3
"""e2e_results.py - the e2e suite's results, per spec (the standard library only).

e2e_results.py tsv OUT                     OUT/junit*.xml -> OUT/results.tsv (spec, result,
                                           seconds, first failure line); prints the counts
e2e_results.py table A_DIR B_DIR LA LB     Markdown: every spec either run did not skip, the
                                           result and seconds of each, then each failure
"""

from __future__ import annotations

import collections
import glob
import re
import sys
import xml.etree.ElementTree as ET


def tsv(out: str) -> None:
    rows = []
    for path in sorted(glob.glob(f"{out}/junit*.xml")):
        for case in ET.parse(path).getroot().iter("testcase"):
            name = case.get("name", "").replace("[It] ", "")
            if not name or name.startswith(("[SynchronizedBeforeSuite]", "[ReportAfterSuite]")):
                continue
            skipped, failed = case.find("skipped"), case.find("failure")
            if failed is None:
                failed = case.find("error")
            if skipped is not None:
                result, message = "skipped", skipped.get("message") or ""
            elif failed is not None:
                result, message = "FAILED", failed.get("message") or failed.text or ""
            else:
                result, message = "passed", ""
            rows.append((name, result, case.get("time", "0"), " ".join(message.split())[:300]))
    with open(f"{out}/results.tsv", "w") as f:
        f.writelines("\t".join(row) + "\n" for row in rows)
    print(dict(collections.Counter(row[1] for row in rows)))


def from_log(out: str) -> None:
    rows: list[tuple[str, str, str, str]] = []
    spec, started, message = "", False, ""
    ended = re.compile(r"^(•|S) (?:\[(FAILED|SKIPPED)\] )?\[([0-9.]+) seconds\]$")
    with open(f"{out}/e2e.log") as f:
        lines = [line.rstrip("\n") for line in f]
    for i, line in enumerate(lines):
        if line.startswith("[sig-") and lines[i - 1].startswith("-----"):
            spec, started, message = line.rsplit(" [sig-", 1)[0], True, ""
        elif line.startswith("  [FAILED] ") and not line.startswith("  [FAILED] in ["):
            message = line.strip()[len("[FAILED] ") :]
        elif (m := ended.match(line)) and started:
            result = {"FAILED": "FAILED", "SKIPPED": "skipped"}.get(m[2] or "", "passed")
            rows.append((spec, result, m[3], " ".join(message.split())[:300]))
            started = False
    if started:
        rows.append((spec, "interrupted", "", "the run was stopped during this spec"))
    with open(f"{out}/results.tsv", "w") as f:
        f.writelines("\t".join(row) + "\n" for row in rows)
    print(dict(collections.Counter(row[1] for row in rows)))


def load(out: str) -> dict[str, tuple[str, str, str]]:
    rows = {}
    with open(f"{out}/results.tsv") as f:
        for line in f:
            name, result, seconds, message = (line.rstrip("\n").split("\t") + ["", "", ""])[:4]
            rows[name] = (result, seconds, message)
    return rows


def table(a_dir: str, b_dir: str, la: str, lb: str) -> None:
    a, b = load(a_dir), load(b_dir)

    def cell(row: tuple[str, str, str] | None) -> str:
        if row is None:
            return "-"
        return row[0] if row[0] == "skipped" else f"{row[0]} ({float(row[1] or 0):.0f} s)"

    print(f"| spec | {la} | {lb} |\n|---|---|---|")
    for name in sorted(set(a) | set(b)):
        ra, rb = a.get(name), b.get(name)
        if all(r is None or r[0] == "skipped" for r in (ra, rb)):
            continue
        print(f"| {name} | {cell(ra)} | {cell(rb)} |")
    for label, rows in ((la, a), (lb, b)):
        counts = collections.Counter(r[0] for r in rows.values())
        print(f"\n{label}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print("\nFailures:")
    for name in sorted(set(a) | set(b)):
        for label, rows in ((la, a), (lb, b)):
            if rows.get(name, ("",))[0] == "FAILED":
                print(f"- {label}: {name}: {rows[name][2][:240]}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["tsv"] and len(sys.argv) == 3:
        tsv(sys.argv[2])
    elif sys.argv[1:2] == ["log"] and len(sys.argv) == 3:
        from_log(sys.argv[2])
    elif sys.argv[1:2] == ["table"] and len(sys.argv) == 6:
        table(*sys.argv[2:6])
    else:
        sys.exit(__doc__)
