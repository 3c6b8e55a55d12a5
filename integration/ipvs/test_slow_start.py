"""Slow start in the real kernel: a new endpoint's weight rises step by step while new
connections favour the old endpoints at first. The real console script (`run --manifests`,
as a daemon, with a full resync in the middle of the ramp), the real IPVS table, real
traffic through the virtual IP (wrr: the scheduler that spreads exactly by weight)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from integration.host import clean_ipvs
from integration.lab import PORT, Lab, agent_command, request
from ipvsproxy.schedulers import SCHEDULER_ANNOTATION
from ipvsproxy.sync.slowstart import FULL_WEIGHT, SLOW_START_ANNOTATION
from tests.factories import ep, node, port, service, slice_

pytestmark = pytest.mark.vm

VIP = "10.96.8.8"
WINDOW = 15.0  # five steps of 3 s: weights 1, 2, 4, 6, 8, then 10
SYNC_PERIOD = 4.0  # full resyncs during the ramp: they must neither restart nor finish it


def objects(*backends: str) -> list[dict[str, Any]]:
    annotations = {SCHEDULER_ANNOTATION: "wrr", SLOW_START_ANNOTATION: f"{WINDOW:.0f}s"}
    return [
        node("node-a", ["10.250.1.1"]),
        service("warm", cluster_ips=(VIP,), ports=[port("http", 80, target=PORT)],
                annotations=annotations),
        slice_("warm", ports=(("http", PORT, "TCP"),), endpoints=[ep(b) for b in backends]),
    ]  # fmt: skip


def write(manifests: Path, items: list[dict[str, Any]]) -> None:
    """Replace the manifest at once (the agent polls it; never a half-written file)."""
    part = manifests.parent / "all.json.part"
    part.write_text(json.dumps({"kind": "List", "items": items}))
    os.replace(part, manifests / "all.json")


def weights() -> dict[str, int]:
    """The kernel's weight of each destination of the virtual server, by address."""
    text = subprocess.run(["ipvsadm", "-S", "-n"], capture_output=True, text=True).stdout
    found = re.findall(rf"-a -t {re.escape(VIP)}:80 -r ([\d.]+):{PORT} -m -w (\d+)", text)
    return {address: int(weight) for address, weight in found}


def wait_for(check, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: {weights()}\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def test_a_new_endpoint_ramps_up_in_the_kernel_and_gets_few_connections_at_first(
    tmp_path: Path,
) -> None:
    clean_ipvs()
    lab = Lab()
    proc: subprocess.Popen[bytes] | None = None
    try:
        b1, b2, b3 = (lab.add_backend() for _ in range(3))
        client = lab.add_client()
        manifests = tmp_path / "manifests"
        manifests.mkdir()
        write(manifests, objects(b1.address, b2.address))
        log = tmp_path / "agent.log"
        args = agent_command("--manifests", str(manifests), sync_period=SYNC_PERIOD)
        with log.open("wb") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=out)
        full = {b1.address: FULL_WEIGHT, b2.address: FULL_WEIGHT}
        wait_for(lambda: weights() == full, 120, "the first endpoints at full weight", log)

        write(manifests, objects(b1.address, b2.address, b3.address))
        wait_for(lambda: b3.address in weights(), 30, "the new endpoint added", log)
        added = time.monotonic()
        assert weights()[b3.address] == 1
        # at weight 1 against 10 and 10, wrr gives b3 one new connection in 21
        first = Counter(request(client, VIP, 80) for _ in range(21))
        assert first[b3.name] <= 3, first
        assert min(first[b1.name], first[b2.name]) >= 8, first

        seen = [1]
        while seen[-1] < FULL_WEIGHT:
            # the ramp ends (a deadline far beyond its window, not a figure)
            assert time.monotonic() - added < WINDOW + 120, (seen, log.read_text()[-3000:])
            now = weights()
            assert now[b1.address] == now[b2.address] == FULL_WEIGHT, now
            if now[b3.address] != seen[-1]:
                seen.append(now[b3.address])
            time.sleep(0.25)
        ramped = time.monotonic() - added
        assert seen == sorted(seen), seen  # never down: the resyncs kept the ramp
        assert set(seen) <= {1, 2, 4, 6, 8, 10}, seen
        assert len(seen) >= 4, seen  # step by step, not at once
        assert ramped >= WINDOW - 1, ramped  # not finished early

        # full weight: an equal share
        last = Counter(request(client, VIP, 80) for _ in range(30))
        assert last == {b1.name: 10, b2.name: 10, b3.name: 10}, last
        assert "Traceback" not in log.read_text()
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
        lab.close()
        clean_ipvs()
