"""What each IPVS scheduler buys, with real traffic in the IPVS VM (scripts/bench-schedulers).

The table is programmed by ipvsproxy's own pass (a Proxier fed Services and EndpointSlices, as
the agent runs it); the pods are the lab's backend namespaces (integration/lab.py), the clients
one namespace with many source addresses. One table per scenario, rr the baseline; every figure
is a count or a ratio from this one run (the VM emulates every instruction: absolute latencies
are the emulator's, their ratios are not).

  hot spot       NODES freshly written tables (each a node that just started), each node's first
                 connection and its first 100 from its own address: the spread over 3 endpoints
                 as max/mean (1.0 = even); kubernetes#121591 (rr: every node's first connection
                 to the same API server)
  scale-out      3 endpoints holding HELD long-lived connections each, 3 new endpoints added,
                 then NEW new connections (held too): the new endpoints' share (even = 0.50);
                 kubernetes#75556 (lc piles new connections on new pods)
  rolling update sh and mh, default flags and kube-proxy's: one of 3 endpoints replaced while it
                 still holds a connection (ipvsproxy drains it at weight 0), SOURCES client
                 addresses: the share that keep their endpoint, connections refused
  slow pod       one of 3 endpoints delayed DELAY_MS on each packet (netem on its link), WORKERS
                 concurrent clients making short connections: p50/p99 and the slow pod's share
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

from integration.host import clean_ipvs
from integration.lab import PORT, Backend, Lab, connect, ipvs_lab, request
from integration.services import CONFIG, NODE_IP
from ipvsproxy.netlink import NetlinkKernel
from ipvsproxy.proxier import Proxier
from ipvsproxy.schedulers import FLAGS_ANNOTATION, SCHEDULER_ANNOTATION
from ipvsproxy.sync.drain import Drainer
from ipvsproxy.sync.slowstart import SLOW_START_ANNOTATION, SlowStart
from tests.factories import ep, node, port, service, slice_
from tests.support import Synced

VIP = "10.96.20.1"
SOURCES = 24
NODES = 10
HELD = 6
NEW = 30
WORKERS = 6
REQUESTS = 30  # per worker
DELAY_MS = 40


# ---- pure figures (tests/test_bench_schedulers.py) -----------------------------------------


def spread(counts: Counter[str], names: Sequence[str]) -> float:
    """max/mean of the connections per endpoint, endpoints that got none included."""
    values = [counts.get(n, 0) for n in names]
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank q-th percentile (q in 0..100)."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), -(-len(ordered) * q // 100)))
    return ordered[int(rank) - 1]


def kept(before: dict[str, str], after: dict[str, str]) -> float:
    """The share of clients whose endpoint after is the one before."""
    same = sum(1 for source, name in before.items() if after.get(source) == name)
    return same / len(before) if before else 0.0


def markdown(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |"]
    lines.append("|" + "---|" * len(header))
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# ---- the table, as the agent writes it -------------------------------------------------------


def objects(
    backends: Sequence[Backend], scheduler: str, flags: str | None = None, slow_start: str = ""
) -> list[dict[str, Any]]:
    annotations = {SCHEDULER_ANNOTATION: scheduler}
    if flags is not None:
        annotations[FLAGS_ANNOTATION] = flags
    if slow_start:
        annotations[SLOW_START_ANNOTATION] = slow_start
    return [
        node(addresses=(NODE_IP,)),
        service("bench", cluster_ips=(VIP,), ports=[port("p", 80, "TCP", PORT)],
                annotations=annotations),
        slice_("bench", ports=(("p", PORT, "TCP"),), endpoints=[ep(b.address) for b in backends]),
    ]  # fmt: skip


def proxier(kernel: NetlinkKernel, *, slow_start: bool = False) -> Synced:
    """A node's proxier as the agent builds it: drains removed endpoints, ramps new ones."""
    return Synced(
        Proxier(
            kernel=kernel,
            config=CONFIG,
            drainer=Drainer(timeout=60),
            slow_start=SlowStart() if slow_start else None,
        )
    )


def write(synced: Synced, objs: list[dict[str, Any]]) -> None:
    result = synced.sync(objs)
    if not result.ok or result.sync.report.failures:
        raise SystemExit(f"the pass failed: {result.sync.report.failures}")


def sources() -> list[str]:
    return [f"10.250.1.{n}" for n in range(2, 2 + SOURCES)]


# ---- scenarios -------------------------------------------------------------------------------


def hot_spot(kernel: NetlinkKernel, lab: Lab) -> str:
    pods = lab.backends[:3]
    names = [b.name for b in pods]
    rows = []
    for scheduler in ("rr", "wrr", "sh", "mh"):
        first: Counter[str] = Counter()
        hundred: Counter[str] = Counter()
        for source in sources()[:NODES]:
            clean_ipvs()  # node n starts: its table written from nothing
            write(proxier(kernel), objects(pods, scheduler))
            for i in range(100):
                answer = request(lab.clients[0], VIP, 80, source=source)
                hundred[answer] += 1
                if i == 0:
                    first[answer] += 1
        rows.append((scheduler, f"{spread(first, names):.2f}",
                     " / ".join(str(first[n]) for n in names),
                     f"{spread(hundred, names):.2f}"))  # fmt: skip
    clean_ipvs()
    return markdown(
        f"Hot spot: {NODES} nodes, each one's table written fresh, 3 endpoints",
        ["scheduler", "first connections max/mean", "per endpoint", "first 100 each max/mean"],
        rows,
    )  # fmt: skip


def scale_out(kernel: NetlinkKernel, lab: Lab) -> str:
    old, new = lab.backends[:3], lab.backends[3:6]
    new_names = {b.name for b in new}
    rows = []
    variants = [("rr", ""), ("wrr", ""), ("lc", ""), ("wlc", ""), ("wlc", "60s"), ("lc", "60s")]
    for scheduler, ramp in variants:
        clean_ipvs()
        synced = proxier(kernel, slow_start=bool(ramp))
        write(synced, objects(old, scheduler, slow_start=ramp))
        with ExitStack() as socks:  # the held connections, closed when the variant ends
            for i in range(HELD * len(old)):
                source = sources()[i % SOURCES]
                socks.enter_context(connect(lab.clients[0], VIP, 80, source=source)[1])
            write(synced, objects(old + new, scheduler, slow_start=ramp))
            got: Counter[str] = Counter()
            for i in range(NEW):
                name, sock = connect(lab.clients[0], VIP, 80, source=sources()[i % SOURCES])
                socks.enter_context(sock)
                got[name] += 1
        share = sum(c for n, c in got.items() if n in new_names) / NEW
        label = f"{scheduler} + slow start {ramp}" if ramp else scheduler
        rows.append((label, f"{share:.2f}", " / ".join(str(got[b.name]) for b in old + new)))
    clean_ipvs()
    return markdown(
        f"Scale-out 3 -> 6: {HELD} long-lived connections per old endpoint, {NEW} new (held)",
        ["scheduler", "new endpoints' share (even: 0.50)", "per endpoint (old 3 / new 3)"],
        rows,
    )  # fmt: skip


def rolling_update(kernel: NetlinkKernel, lab: Lab) -> str:
    pods, replacement = lab.backends[:3], lab.backends[3]
    rows = []
    variants: list[tuple[str, str | None, str]] = [
        ("rr", None, ""),
        ("sh", None, "ipvsproxy's default: sh-fallback"),
        ("sh", "", "kube-proxy's: no flags"),
        ("mh", None, "ipvsproxy's default: mh-fallback,mh-port"),
        ("mh", "mh-fallback", "mh-fallback, no mh-port"),
        ("mh", "mh-port", "kube-proxy's: mh-port"),
    ]
    for scheduler, flags, label in variants:
        clean_ipvs()
        synced = proxier(kernel)
        write(synced, objects(pods, scheduler, flags))
        before = {s: request(lab.clients[0], VIP, 80, source=s) for s in sources()}
        victim_name, hold = connect(lab.clients[0], VIP, 80, source=sources()[0])
        victim = next(b for b in pods if b.name == victim_name)
        try:  # the old pod leaves, holding a connection (drained at weight 0); a new one comes
            write(
                synced,
                objects([b for b in pods if b is not victim] + [replacement], scheduler, flags),
            )
            after: dict[str, str] = {}
            refused = 0
            for s in sources():
                try:
                    after[s] = request(lab.clients[0], VIP, 80, source=s, timeout=3)
                except OSError:
                    refused += 1
            unaffected = {s: n for s, n in before.items() if n != victim_name}
        finally:
            hold.close()
        rows.append((scheduler, label, f"{kept(before, after):.2f}",
                     f"{kept(unaffected, after):.2f}", f"{refused}/{SOURCES}"))  # fmt: skip
    clean_ipvs()
    return markdown(
        f"Rolling update: 1 of 3 endpoints replaced, holding a connection; {SOURCES} clients",
        ["scheduler", "flags", "clients keeping their endpoint", "of those not on it", "refused"],
        rows,
    )  # fmt: skip


def load(lab: Lab, workers: int, requests: int) -> tuple[list[float], Counter[str]]:
    """`workers` clients at once, each making `requests` short connections one after another:
    each connection's time to the endpoint's answer, and who answered."""
    latencies: list[float] = []
    got: Counter[str] = Counter()
    lock = threading.Lock()

    def worker(source: str) -> None:
        for _ in range(requests):
            t0 = time.monotonic()
            answer = request(lab.clients[0], VIP, 80, source=source)
            with lock:
                latencies.append(time.monotonic() - t0)
                got[answer] += 1

    threads = [threading.Thread(target=worker, args=(s,)) for s in sources()[:workers]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, got


def slow_pod(kernel: NetlinkKernel, lab: Lab) -> str:
    pods = lab.backends[:3]
    slow = pods[0]
    link = f"vb{lab.backends.index(slow) + 1}"  # its root-side veth (Lab.add_backend)
    subprocess.run(
        ["tc", "qdisc", "add", "dev", link, "root", "netem", "delay", f"{DELAY_MS}ms"], check=True
    )
    rows = []
    baseline = 0.0
    try:
        for scheduler in ("rr", "wrr", "lc", "wlc", "sed", "nq"):
            clean_ipvs()
            write(proxier(kernel), objects(pods, scheduler))
            latencies, got = load(lab, WORKERS, REQUESTS)
            p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
            mean = statistics.fmean(latencies)
            baseline = baseline or mean
            rows.append((scheduler, f"{got[slow.name] / len(latencies):.2f}", f"{p50 * 1000:.0f}",
                         f"{percentile(latencies, 90) * 1000:.0f}", f"{p99 * 1000:.0f}",
                         f"{mean / baseline:.2f}"))  # fmt: skip
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", link, "root"], check=False)
        clean_ipvs()
    return markdown(
        f"Slow pod: 1 of 3 endpoints {DELAY_MS} ms slower per packet, "
        f"{WORKERS} concurrent clients x {REQUESTS} short connections",
        ["scheduler", "slow pod's share", "p50 ms", "p90 ms", "p99 ms", "mean / rr's"],
        rows,
    )  # fmt: skip


SCENARIOS = {
    "hot-spot": hot_spot,
    "scale-out": scale_out,
    "rolling-update": rolling_update,
    "slow-pod": slow_pod,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--only", choices=sorted(SCENARIOS), action="append")
    parser.add_argument("--out", help="also write the tables to this file")
    args = parser.parse_args()
    tables = []
    with ipvs_lab(6, extra_client_addresses=SOURCES - 1) as lab, NetlinkKernel() as kernel:
        for name in args.only or SCENARIOS:
            t0 = time.monotonic()
            tables.append(SCENARIOS[name](kernel, lab))
            print(tables[-1], flush=True)
            print(f"({name}: {time.monotonic() - t0:.0f} s)\n", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(tables))


if __name__ == "__main__":
    main()
