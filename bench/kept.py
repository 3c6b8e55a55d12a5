"""What each kept optimisation buys, natively, at a large cluster's size: with it, without it.

Runs as root on this host's kernel, everything that touches the kernel in a throw-away
network namespace; prints one table. "Without" is what the code would do in the
optimisation's place. Default: 10,000 Services x 10 endpoints (bench/common.py `cluster()`),
the Tracker + Proxier + FakeKernel of bench/native_scale.py after its first full pass.

  row                  with                                 without
  partial passes       one endpoint change, partial pass    the same change through a full
                                                            pass (full=True)
  parse once           a full pass over parsed views        the same + parsing every Service
                       RSS holding the views                and EndpointSlice again; RSS
                                                            holding the raw objects (a fresh
                                                            process each)
  rtnetlink events     AddressEvents.changed() x2 (the      RtnlSocket.addresses() of the
                       device's and the node's), nothing    device (N /32s on a veth) +
                       changed                              node_addresses()
  nf_tables generation RulesetGeneration.current()          iptables-save + ip6tables-save,
                                                            -t nat and -t filter, of the
                                                            fallback's chains for N x D
                                                            (and of a nearly empty ruleset:
                                                            a node with a handful of rules)
  gc.freeze            full gc.collect() with the heap      the same, not frozen; and the
                       frozen (freeze_heap()); automatic    automatic generation-2 collections
                       generation-2 collections in an hour  in the same hour (gc.callbacks)
                       of 1 change/s (3600 passes of one
                       change each, every 30th full; run
                       back to back, not in real time)

Figures are medians; "per hour" is one full resync's cost x 120 (a 30 s sync period); the
gc hour is run, not extrapolated (fewer --passes are scaled up to an hour). CPU is this
process's (and its tools'). The full passes are FakeKernel's: a real kernel's dump of the
IPVS table adds to both sides of "partial passes" and "parse once", and to the hour's CPU
(the last row: what a gain is a share of).

    python bench/kept.py [--services 10000] [--dests 10] [--passes 3600] [--repeat 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import NODES, _service, _slice, cluster_node, fresh_netns, table  # noqa: E402
from bench.native_scale import CONFIG, Rollouts, rss_mib  # noqa: E402
from integration.lab import inside  # noqa: E402
from ipvsproxy.agent_loop import freeze_heap  # noqa: E402
from ipvsproxy.api import read as parse  # noqa: E402
from ipvsproxy.fallback.chains import JUMPS, render  # noqa: E402
from ipvsproxy.iptables.generation import RulesetGeneration  # noqa: E402
from ipvsproxy.iptables.parse import Saved  # noqa: E402
from ipvsproxy.iptables.transaction import transaction  # noqa: E402
from ipvsproxy.model import IPAddress  # noqa: E402
from ipvsproxy.netlink import codec  # noqa: E402
from ipvsproxy.netlink.links import node_addresses  # noqa: E402
from ipvsproxy.netlink.rtnl import AddressEvents, RtnlSocket  # noqa: E402
from ipvsproxy.proxier import Proxier  # noqa: E402
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, Tracker  # noqa: E402
from ipvsproxy.testing import FakeKernel  # noqa: E402
from tests.netlink.dumps import kernel_dest  # noqa: E402

RESYNCS_PER_HOUR = 3600 / CONFIG.sync_period
Row = tuple[str, str, str, str]


def cpu() -> float:
    tools = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + tools.ru_utime + tools.ru_stime


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one call."""
    c, t = cpu(), time.perf_counter()
    fn()
    return time.perf_counter() - t, cpu() - c


def median(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    runs = [timed(fn) for _ in range(repeat)]
    return statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.3g} ms" if seconds < 1 else f"{seconds:.2f} s"


def pages(kind: str, count: int, dests: int) -> Iterator[list[dict[str, Any]]]:
    """The raw objects of `kind` as the API lists them: pages of 500, decoded from JSON, one
    page alive at a time."""
    make: Callable[[int], dict[str, Any]] = {
        NODE: cluster_node,
        SERVICE: lambda i: _service(i),
        SLICE: lambda i: _slice(i, dests, i * dests),
    }[kind]
    for first in range(0, count, 500):
        yield json.loads(json.dumps([make(n) for n in range(first, min(count, first + 500))]))


# ---- the agent's state after its first full pass (bench/native_scale.py) ---------------------


class State:
    def __init__(self, services: int, dests: int) -> None:
        self.rollouts = Rollouts(services, dests)
        self.tracker = Tracker(required=(SERVICE, SLICE, NODE), node_name=CONFIG.node_name)
        self.proxier = Proxier(kernel=FakeKernel(), config=CONFIG)
        self.serial = 0
        self.parse_seconds = 0.0  # parsing every Service and EndpointSlice, once
        for kind in (NODE, SERVICE, SLICE):
            count = NODES if kind == NODE else services
            views = []
            for page in pages(kind, count, dests):
                started = time.perf_counter()
                views += [parse(kind, raw) for raw in page]
                if kind != NODE:
                    self.parse_seconds += time.perf_counter() - started
            self.tracker.replace(kind, views)
        assert self.proxier.sync(self.tracker.take(), full=True).ok

    def change(self) -> None:
        self.serial += 1
        self.tracker.event(SLICE, "MODIFIED", self.rollouts.next(self.serial))

    def sync(self, *, full: bool) -> None:
        result = self.proxier.sync(self.tracker.take(), full=full)
        assert result.ok
        kernel = self.proxier.kernel
        assert isinstance(kernel, FakeKernel)
        kernel.applied.clear()  # the fake's record of every operation, not the agent's memory

    def one_change(self, *, full: bool) -> float:
        self.change()
        return timed(lambda: self.sync(full=full))[0]


@dataclass
class Hour:
    """An hour of passes, back to back, and the automatic generation-2 collections in it."""

    collections: list[float] = field(default_factory=list)  # seconds each
    in_partial: int = 0  # of them, during a partial pass
    slowest_partial: float = 0.0  # the slowest one-change (partial) pass, seconds
    cpu: float = 0.0  # the whole hour's passes


def an_hour(state: State, passes: int) -> Hour:
    """`passes` passes of one endpoint change each (1 change/s), every 30th a full pass (a
    30 s sync period), back to back (not in real time)."""
    hour, started = Hour(), [0.0]
    partial = [False]

    def watch(phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            hour.collections.append(time.perf_counter() - started[0])
            hour.in_partial += partial[0]

    gc.callbacks.append(watch)
    begun = cpu()
    try:
        for n in range(1, passes + 1):
            partial[0] = n % int(CONFIG.sync_period) != 0
            seconds = state.one_change(full=not partial[0])
            if partial[0]:
                hour.slowest_partial = max(hour.slowest_partial, seconds)
    finally:
        gc.callbacks.remove(watch)
    hour.cpu = cpu() - begun
    return hour


def gc_rows(state: State, passes: int) -> list[Row]:
    gc.collect()
    loose_full = median(gc.collect, 3)[1]
    loose = an_hour(state, passes)
    freeze_heap()  # as the agent does after its first full pass
    frozen_full = median(gc.collect, 3)[1]
    frozen = an_hour(state, passes)
    scale = 3600 / passes  # 1: the default runs the hour itself

    def collections(h: Hour) -> str:
        worst = max(h.collections, default=0.0)
        return f"{len(h.collections)} ({h.in_partial} in partial passes), worst {ms(worst)}"

    return [
        (
            "gc.freeze: one full gc.collect()",
            f"{ms(frozen_full)} CPU",
            f"{ms(loose_full)} CPU",
            f"a pass that meets one: +{ms(frozen_full)} vs +{ms(loose_full)}",
        ),
        (
            f"gc.freeze: automatic gen-2, {passes} passes",
            collections(frozen),
            collections(loose),
            f"gc CPU: {sum(frozen.collections) * scale:.2g} vs "
            f"{sum(loose.collections) * scale:.2g} s/hour at 1 change/s",
        ),
        (
            "gc.freeze: that hour, all passes",
            f"{frozen.cpu * scale:.1f} s CPU",
            f"{loose.cpu * scale:.1f} s CPU",
            f"slowest one-change pass {ms(frozen.slowest_partial)} vs {ms(loose.slowest_partial)}",
        ),
    ]


def partial_rows(state: State, repeat: int) -> list[Row]:
    partial = statistics.median(state.one_change(full=False) for _ in range(4 * repeat))
    full = statistics.median(state.one_change(full=True) for _ in range(repeat))
    return [
        (
            "partial passes: one endpoint change",
            ms(partial),
            ms(full),
            f"one-change latency {ms(partial)} vs {ms(full)}",
        )
    ]


def parse_rows(state: State, args: argparse.Namespace) -> list[Row]:
    full = median(lambda: state.sync(full=True), args.repeat)[0]
    again = full + state.parse_seconds
    rss = {variant: held(variant, args) for variant in ("views", "raw")}
    return [
        (
            "parse once: full resync",
            ms(full),
            f"{ms(again)} (+{ms(state.parse_seconds)} parsing)",
            f"full resync {ms(full)} vs {ms(again)}",
        ),
        (
            "parse once: memory held",
            f"{rss['views']:.0f} MiB views",
            f"{rss['raw']:.0f} MiB raw",
            f"RSS {rss['views']:.0f} vs {rss['raw']:.0f} MiB above an empty process",
        ),
    ]


def held(variant: str, args: argparse.Namespace) -> float:
    """RSS (MiB, above the interpreter with ipvsproxy imported) of a fresh process holding
    every Service and EndpointSlice: raw (decoded JSON) or parsed (views)."""
    command = [sys.executable, __file__, "--services", str(args.services)]
    command += ["--dests", str(args.dests), "--hold", variant]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return float(out.split()[-1])


def hold(variant: str, services: int, dests: int) -> None:
    for kind, first in ((SERVICE, _service(0)), (SLICE, _slice(0, dests, 0))):
        parse(kind, first)  # the parser's own first-use costs, in the base
    gc.collect()
    base = rss_mib()
    kept: list[object] = []
    for kind in (SERVICE, SLICE):
        for page in pages(kind, services, dests):
            kept += page if variant == "raw" else [parse(kind, raw) for raw in page]
            del page
    gc.collect()
    print(f"{rss_mib() - base:.1f}")


# ---- the kernel, in throw-away namespaces ----------------------------------------------------


def address_rows(services: int, repeat: int) -> list[Row]:
    vips: list[IPAddress] = [key.address for key in table(services, 1).services]
    with fresh_netns() as ns, inside(ns):
        rtnl = RtnlSocket()
        index = rtnl.link_index("node0")
        assert index is not None
        for first in range(0, len(vips), 1000):
            codes = rtnl.change(index, [(a, True) for a in vips[first : first + 1000]])
            assert not any(codes), codes[:3]
        assert len(rtnl.addresses(index)) == len(vips) + 1
        device, node = AddressEvents(), AddressEvents()
        device.changed()
        node.changed()  # the first look always says yes

        def dumps() -> None:
            rtnl.addresses(index)
            node_addresses("node0")

        def events() -> None:
            assert not device.changed()
            assert not node.changed()

        without = median(dumps, repeat)
        with_ = median(events, 10 * repeat)
        device.close()
        node.close()
        rtnl.close()
    return resync_row(f"rtnetlink events: {len(vips)} addresses", with_, without)


def resync_row(name: str, with_: tuple[float, float], without: tuple[float, float]) -> list[Row]:
    return [
        (
            name,
            f"{ms(with_[0])} ({ms(with_[1])} CPU)",
            f"{ms(without[0])} ({ms(without[1])} CPU)",
            f"idle CPU: {with_[1] * RESYNCS_PER_HOUR:.2g} vs "
            f"{without[1] * RESYNCS_PER_HOUR:.2g} s/hour",
        )
    ]


def generation_rows(services: int, dests: int, repeat: int, what: str) -> list[Row]:
    base = table(services, dests)
    desired = replace(base, bound=frozenset(k.address for k in base.services))
    payload = transaction(Saved(), render(desired, {}, version=4), jumps=JUMPS)
    rules = sum(1 for line in payload.splitlines() if line.startswith("-"))
    with fresh_netns() as ns:
        subprocess.run(
            ["ip", "netns", "exec", ns, "iptables-restore", "--noflush"],
            input=payload,
            text=True,
            check=True,
        )
        with inside(ns):
            generation = RulesetGeneration.open()
            first = generation.current()
            assert first is not None, "no nf_tables generation here"

            def saves() -> None:
                for tool in ("iptables-save", "ip6tables-save"):
                    for which in ("nat", "filter"):
                        subprocess.run([tool, "-t", which], capture_output=True, check=True)

            without = median(saves, repeat)
            with_ = median(generation.current, 10 * repeat)
            assert generation.current() == first
            generation.close()
    return resync_row(f"nf_tables generation: {rules} rules ({what})", with_, without)


def decode_rows(services: int, dests: int, repeat: int) -> list[Row]:
    """An idle resync's decoding of the destination dumps (the services' are 1/dests of it):
    every destination as the kernel lays it out, in datagrams as a dump returns them."""
    base = table(services, dests)
    messages = [kernel_dest(rs) for by_key in base.dests.values() for rs in by_key.values()]
    chunks = [b"".join(messages[i : i + 40]) for i in range(0, len(messages), 40)]

    def decoding(decode: Callable[[memoryview, int], object]) -> Callable[[], object]:
        return lambda: [decode(payload, socket.AF_INET) for payload in codec.dumped(chunks)]

    with_ = median(decoding(codec.decode_dest), repeat)
    without = median(decoding(codec._decode_dest_attributes), repeat)
    return resync_row(f"compiled run, decoding {len(messages)} dumped destinations", with_, without)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--services", type=int, default=10_000)
    parser.add_argument("--dests", type=int, default=10)
    parser.add_argument("--passes", type=int, default=3600, help="gc: an hour at 1 change/s")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--hold", choices=("raw", "views"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hold:
        hold(args.hold, args.services, args.dests)
        return
    rows = decode_rows(args.services, args.dests, args.repeat)
    rows += address_rows(args.services, args.repeat)
    rows += generation_rows(args.services, args.dests, args.repeat, "iptables fallback")
    rows += generation_rows(0, 0, args.repeat, "nearly empty")
    state = State(args.services, args.dests)
    rows += partial_rows(state, args.repeat)
    rows += parse_rows(state, args)
    rows += gc_rows(state, args.passes)
    print(
        f"\nwhat each kept optimisation buys, {args.services}x{args.dests} "
        f"(Python {sys.version.split()[0]}, medians of {args.repeat})"
    )
    head = ("optimisation", "with", "without", "what a user sees")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    for row in [head, *rows]:
        print("  ".join(f"{cell:<{w}}" for cell, w in zip(row, widths, strict=True)).rstrip())


if __name__ == "__main__":
    main()
