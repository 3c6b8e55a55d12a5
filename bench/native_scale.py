"""The sync proxier at a large cluster's size, natively, with the fake kernel.

Runs on any machine (no root, no IPVS): the pure part of every sync, which is what grows
with the cluster. Prints a table. A generated cluster (bench/common.py `cluster()`; default
10,000 Services x 10 endpoints) goes through the same objects the agent uses: the Tracker
(parse once on arrival), the Proxier (DesiredIndex, partial and full passes) and
`testing.FakeKernel` (the kernel's semantics, in memory).

  row                              what is measured
  first sync                       replace() of every object + one full pass (seconds)
  RSS after the first sync         the process's resident memory, raw objects dropped
  one endpoint change              tracker event -> partial pass: plan + apply (seconds),
                                   and the operations it sent
  idle full resync                 a full pass with nothing to change (observe + plan)
  soak: N changes/s for T s        endpoint changes as watch events, a partial pass every
                                   second, a full one every 30 s; at the end the kernel's
                                   table equals a from-scratch translation; RSS drift

    python bench/native_scale.py [--services 10000] [--dests 10] [--soak 300 --rate 100]
                                 [--load-balancer-every 20]
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import NODES, _service, _slice, cluster_node, pod_ip  # noqa: E402
from ipvsproxy.agent_loop import freeze_heap  # noqa: E402
from ipvsproxy.api import EndpointSliceView, NodeView, ServiceView  # noqa: E402
from ipvsproxy.api import read as parse  # noqa: E402
from ipvsproxy.config import Config  # noqa: E402
from ipvsproxy.proxier import Proxier  # noqa: E402
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, Tracker  # noqa: E402
from ipvsproxy.testing import FakeKernel  # noqa: E402
from tests.factories import desired_state  # noqa: E402

CONFIG = Config(node_name="node-0", min_sync_period=1.0, sync_period=30.0)


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def from_scratch(tracker: Tracker) -> Any:
    nodes = [n for n in tracker.views(NODE) if isinstance(n, NodeView)]
    return desired_state(
        [v for v in tracker.views(SERVICE) if isinstance(v, ServiceView)],
        [v for v in tracker.views(SLICE) if isinstance(v, EndpointSliceView)],
        next(n for n in nodes if n.name == CONFIG.node_name),
        CONFIG,
    ).state


class Rollouts:
    """New versions of random slices: one endpoint replaced by a new pod (a rollout step).
    Only the pod numbers are kept (not the raw objects, which would dwarf the agent), in a
    table made whole before the first sync: the bench's own bookkeeping does not grow during
    the soak (a dict filled as slots were first replaced was 1-7 % of the blocks there)."""

    def __init__(self, services: int, dests: int) -> None:
        self.services, self.dests = services, dests
        self.pods = [[i * dests + j for j in range(dests)] for i in range(services)]
        self.rng = random.Random(1)

    def next(self, serial: int) -> dict[str, Any]:
        i = self.rng.randrange(self.services)
        pods = self.pods[i]
        pods[self.rng.randrange(self.dests)] = 10_000_000 + serial
        raw = _slice(i, self.dests, i * self.dests)
        for j, g in enumerate(pods):
            if g != i * self.dests + j:
                ep = raw["endpoints"][j]
                raw["endpoints"][j] = {
                    **ep,
                    "addresses": [pod_ip(g)],
                    "nodeName": f"node-{g % NODES}",
                }
        return raw


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--services", type=int, default=10_000)
    parser.add_argument("--dests", type=int, default=10)
    parser.add_argument("--soak", type=float, default=300.0, help="seconds (0: no soak)")
    parser.add_argument("--rate", type=int, default=100, help="changes per second in the soak")
    parser.add_argument(
        "--load-balancer-every", type=int, default=0,
        help="one Service in N a LoadBalancer with an ingress IP (0: none)",
    )  # fmt: skip
    args = parser.parse_args()
    rows: list[tuple[str, str]] = []
    base = rss_mib()

    rollouts = Rollouts(args.services, args.dests)
    tracker = Tracker(required=(SERVICE, SLICE, NODE), node_name=CONFIG.node_name)
    kernel = FakeKernel(record=False)  # a kernel keeps no record of operations in our memory
    proxier = Proxier(kernel=kernel, config=CONFIG)
    started = time.perf_counter()
    # as the agent lists: raw objects arrive a page (500) at a time and are parsed at once
    generators: dict[str, Callable[[int], Any]] = {
        NODE: lambda k: cluster_node(k),
        SERVICE: lambda i: _service(i, args.load_balancer_every),
        SLICE: lambda i: _slice(i, args.dests, i * args.dests),
    }
    for kind, make in generators.items():
        count = NODES if kind == NODE else args.services
        parsed = []
        for first_of_page in range(0, count, 500):
            page = [make(n) for n in range(first_of_page, min(count, first_of_page + 500))]
            parsed += [parse(kind, raw) for raw in page]
        tracker.replace(kind, parsed)
        del parsed, page
    result = proxier.sync(tracker.take(), full=True)
    first = time.perf_counter() - started
    assert result.ok
    del result
    freeze_heap()  # as the agent does after its first full pass
    rows.append((f"first sync, {args.services}x{args.dests}", f"{first:.2f} s"))
    rows.append(
        (
            "RSS after the first sync",
            f"{rss_mib():.0f} MiB ({rss_mib() - base:.0f} MiB above start; "
            f"{len(proxier.index)} virtual servers, {proxier.index.dest_count} real servers)",
        )
    )

    times, sent = [], []
    for n in range(20):
        tracker.event(SLICE, "MODIFIED", rollouts.next(n))
        t0 = time.perf_counter()
        result = proxier.sync(tracker.take(), full=False)
        times.append(time.perf_counter() - t0)
        sent.append(len(result.sync.plan))
    times.sort()
    rows.append(
        (
            "one endpoint change (median of 20)",
            f"{times[10] * 1000:.2f} ms, {sorted(sent)[10]} operations sent (max {max(sent)})",
        )
    )
    t0, cpu0 = time.perf_counter(), time.process_time()
    result = proxier.sync(tracker.take(), full=True)
    idle, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    share = 100 * cpu / CONFIG.sync_period
    rows.append(
        (
            "idle full resync",
            f"{idle:.2f} s, {cpu:.2f} s CPU ({share:.2f} % of a core per "
            f"{CONFIG.sync_period:g} s sync period), {len(result.sync.plan)} ops",
        )
    )
    # The pass's result holds its observation (a copy of the whole table): kept through the
    # soak, it would keep every replaced endpoint's old objects alive, which measured the
    # bench's memory, not the agent's (blocks grew ~5 per change until this was dropped)
    del result

    if args.soak > 0:
        rows += soak(tracker, proxier, kernel, rollouts, args)
    print(f"ipvsproxy proxier at scale, natively with FakeKernel (Python {sys.version.split()[0]})")
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def soak(
    tracker: Tracker,
    proxier: Proxier,
    kernel: FakeKernel,
    rollouts: Rollouts,
    args: argparse.Namespace,
) -> list[tuple[str, str]]:
    gc.collect()
    samples: list[float] = []
    blocks: list[int] = []  # Python objects' memory blocks in use: live data, not the arenas
    serial, passes, slowest, last_full = 1000, 0, 0.0, time.monotonic()
    end = time.monotonic() + args.soak
    next_tick = time.monotonic()
    while time.monotonic() < end:
        for _ in range(args.rate):
            serial += 1
            tracker.event(SLICE, "MODIFIED", rollouts.next(serial))
        full = time.monotonic() - last_full >= CONFIG.sync_period
        t0 = time.perf_counter()
        result = proxier.sync(tracker.take(), full=full)
        slowest = max(slowest, 0.0 if full else time.perf_counter() - t0)
        assert result.ok, result.sync.report.failures[:3]
        passes += 1
        if full:
            last_full = time.monotonic()
            gc.collect()
            samples.append(rss_mib())
            blocks.append(sys.getallocatedblocks())
        next_tick += 1.0
        time.sleep(max(0.0, next_tick - time.monotonic()))
    proxier.sync(tracker.take(), full=False)
    want = from_scratch(tracker)
    got = kernel.state
    equal = (got.services, got.dests, got.bound) == (want.services, want.dests, want.bound)
    drift = (max(samples) - min(samples)) / min(samples) * 100 if samples else float("nan")
    return [
        (
            f"soak: {args.rate} changes/s for {args.soak:.0f} s",
            f"{serial - 1000} changes, {passes} passes, slowest partial {slowest * 1000:.0f} ms, "
            f"table equal to a fresh translation: {equal}",
        ),
        (
            "soak: RSS at each full resync",
            f"{min(samples):.0f}-{max(samples):.0f} MiB ({drift:.1f} % spread, "
            f"{len(samples)} samples: {', '.join(f'{x:.0f}' for x in samples)})",
        ),
        (
            "soak: allocated blocks at each full resync",
            f"{min(blocks)}-{max(blocks)} ({spread(blocks):.1f} % spread)",
        ),
    ]


def spread(values: list[int]) -> float:
    return (max(values) - min(values)) / min(values) * 100 if values else float("nan")


if __name__ == "__main__":
    main()
