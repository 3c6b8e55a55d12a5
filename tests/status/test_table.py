"""The table, screenshot-free: golden output at fixed widths (tests/data/status-*.txt) of a
document with counters, rates over 2 s, drift, a drain, every reason and a skipped Service.
UPDATE_GOLDEN=1 rewrites the files (read the diff before committing it)."""

from __future__ import annotations

import json
import os
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import pytest

from ipvsproxy import agent
from ipvsproxy.model import AddDest, RealServer, RSKey, UpdateDest
from ipvsproxy.status.document import Selector
from ipvsproxy.status.table import render
from tests.status.scene import (
    CONFIG,
    HERE,
    OBJECTS,
    THERE,
    WEB_NODEPORT,
    WEB_VIP,
    count,
    on_a_fake_clock,
    valid,
)

DATA = Path(__file__).parents[1] / "data"


def document(host, tmp_path: Path, monkeypatch, selector: str | None = None):
    """Two readings 2 s apart; drift (a weight changed behind the agent's back) and a
    removed endpoint draining."""
    path = tmp_path / "objects.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": OBJECTS}))
    gone = RealServer(RSKey(ip_address("10.244.3.3"), 8080), 0)
    host.apply([AddDest(WEB_VIP, gone), UpdateDest(WEB_NODEPORT, RealServer(HERE, 3))])
    host.conns[WEB_VIP] = {gone.key: (1, 0)}
    clock = on_a_fake_clock(monkeypatch)
    source = agent.Manifests((path,))
    with agent.LocalStatus(CONFIG, source=source, kernel_state=None) as st:
        count(host, WEB_VIP, HERE, conns=3)
        count(host, WEB_VIP, THERE, conns=1)
        st.document(None)
        clock.now += 2.0
        count(host, WEB_VIP, HERE, conns=3, scale=41)
        count(host, WEB_VIP, THERE, conns=1, scale=3)
        doc = st.document(Selector.parse(selector) if selector else None)
    return valid(doc)


@pytest.mark.parametrize(
    ("name", "width", "wide"),
    [("status-100.txt", 100, False), ("status-60.txt", 60, False),
     ("status-wide-160.txt", 160, True)],
)  # fmt: skip
def test_golden(host, tmp_path, monkeypatch, name, width, wide):
    text = render(document(host, tmp_path, monkeypatch), width=width, wide=wide)
    assert all(len(line) <= width for line in text.splitlines())
    golden = DATA / name
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()


def test_nothing_matches(host, tmp_path, monkeypatch):
    text = render(document(host, tmp_path, monkeypatch, "demo/none"), width=100)
    assert text.startswith("no Service matches\n")


def test_names_from_input_cannot_forge_lines():
    doc: dict[str, Any] = {
        "services": [{"namespace": "a\nb", "name": "x\x1b[2J", "skipped": "Headless",
                      "type": "ClusterIP", "virtualServers": []}],
        "node": "n", "zone": None, "backend": None, "source": "local", "lastFullPass": None,
        "lastPartialPass": None, "rateWindowSeconds": None, "inSync": True,
        "truncated": False, "warnings": [],
    }  # fmt: skip
    text = render(doc, width=100)
    assert "\x1b" not in text
    assert text.splitlines()[0].startswith("a\\nb/x\\x1b[2J")
