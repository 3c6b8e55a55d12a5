"""What both benchmarks share: the S x D table, throw-away namespaces, timing."""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from ipaddress import IPv4Address

from ipvsproxy.model import IpvsState, Proto, RealServer, RSKey, VirtualServer, VSKey
from ipvsproxy.schedulers import Scheduler

_counter = 0


def table(services: int, dests: int, scheduler: Scheduler = Scheduler.RR) -> IpvsState:
    vss = {}
    rss = {}
    for s in range(services):
        key = VSKey(IPv4Address(0x0A600000 + s), 80, Proto.TCP)  # 10.96.x.y
        vss[key] = VirtualServer(key, scheduler)
        rss[key] = {
            rs.key: rs
            for d in range(dests)
            for rs in [RealServer(RSKey(IPv4Address(0x0AF40000 + d * 4096 + s), 8080))]
        }
    return IpvsState(vss, rss)


@contextmanager
def fresh_netns() -> Iterator[str]:
    global _counter
    _counter += 1
    name = f"bench{_counter}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    # IPVS rejects destinations whose address type it cannot resolve: lo must be up.
    subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median(fn: Callable[[], float], repeat: int) -> float:
    return statistics.median(fn() for _ in range(repeat))
