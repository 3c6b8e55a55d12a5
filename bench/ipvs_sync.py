"""Benchmark ipvsproxy's IPVS backend against the practical floor, `ipvsadm -R`.

Run inside the IPVS VM (scripts/bench does that); prints a table. Every cold load happens in
a fresh network namespace: IPVS state, including the trash list of deleted destinations that
every destination add scans, is per namespace, so no run pays for another's leftovers. Each
load is checked against `ipvsadm-save -n` before its time counts. Figures are medians of
REPEAT runs; compare them only as ratios within one run (the VM emulates every instruction).

  approach                        what is timed
  ipvsadm -R                      loading the rules file (the floor for a cold apply)
  ipvsproxy apply (cold)          plan(desired, empty) + NetlinkKernel.apply
  pyroute2, one call per object   IPVS().service("add")/dest("add") per object (small size)
  ipvsadm -S -n                   dumping the table (the floor for observe)
  ipvsproxy observe               NetlinkKernel().observe(): a service dump, a destination
                                  dump per service
  ipvsproxy no-op sync            observe + plan with nothing to do
  ipvsproxy sync, k changes       observe + plan + apply when k destinations change weight
  VIPs, pyroute2 per address      IPRoute.addr("add"/"del") per address, then get_addr(index=)
  VIPs, ipvsproxy batched         NetlinkKernel.apply of n binds, of n unbinds; the device's
                                  addresses (DummyDevice.addresses)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import cluster_ip, fresh_netns, median, table, timed  # noqa: E402
from integration.lab import inside  # noqa: E402
from ipvsproxy.model import (  # noqa: E402
    EMPTY,
    BindAddress,
    IpvsState,
    RealServer,
    UnbindAddress,
)
from ipvsproxy.netlink import NetlinkKernel  # noqa: E402
from ipvsproxy.netlink.links import DummyDevice  # noqa: E402
from ipvsproxy.saved_table import parse_save, render_save  # noqa: E402
from ipvsproxy.schedulers import Scheduler  # noqa: E402
from ipvsproxy.sync.ownership import Ownership  # noqa: E402
from ipvsproxy.sync.plan import plan  # noqa: E402

OWN = Ownership()


def saved(ns: str) -> IpvsState:
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "ipvsadm-save", "-n"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return parse_save(out)


def check(ns: str, want: IpvsState) -> None:
    got = saved(ns)
    if (got.services, got.dests) != (want.services, want.dests):
        key = next(
            k
            for k in want.services
            if got.services.get(k) != want.services[k] or got.dests.get(k) != want.dests[k]
        )
        raise SystemExit(
            f"bench: the table in {ns} is not what was loaded, e.g. {key}: wanted "
            f"{want.services[key]} {want.dests[key]}, "
            f"got {got.services.get(key)} {got.dests.get(key)}"
        )


def ipvsadm_restore(state: IpvsState) -> float:
    rules = render_save(state).encode()
    with fresh_netns() as ns:
        seconds = timed(
            lambda: subprocess.run(
                ["ip", "netns", "exec", ns, "ipvsadm", "-R"], input=rules, check=True
            )
        )
        check(ns, state)
    return seconds


def ipvsproxy_cold(state: IpvsState) -> float:
    with fresh_netns() as ns:
        with inside(ns):
            kernel = NetlinkKernel(device="bench0")
        with kernel:

            def load() -> None:
                report = kernel.apply(plan(state, EMPTY, ownership=OWN))
                assert report.ok, report.failures[:3]

            seconds = timed(load)
        check(ns, state)
    return seconds


def pyroute2_cold(state: IpvsState) -> float:
    from pyroute2 import IPVS
    from pyroute2.ipvs import IPVSDest, IPVSService

    with fresh_netns() as ns:
        with inside(ns):
            ipvs = IPVS()

        def load() -> None:
            for key in state.services:
                # No scheduler argument: pyroute2's default is wlc, which the small table
                # uses, so both baselines load identical rules.
                svc = IPVSService(addr=str(key.address), port=key.port, protocol=int(key.proto))
                ipvs.service("add", service=svc)
                for rs in state.dests[key].values():
                    dest = IPVSDest(
                        addr=str(rs.key.address), port=rs.key.port, fwd_method=0, weight=rs.weight
                    )
                    ipvs.dest("add", service=svc, dest=dest)

        seconds = timed(load)
        ipvs.close()
        check(ns, state)
    return seconds


def loaded_measures(state: IpvsState, changes: int, repeat: int) -> dict[str, float]:
    """observe, ipvsadm -S, no-op sync and k-change sync on one loaded table.

    The dumps are measured in turns (ipvsadm -S, a first observe by a new NetlinkKernel,
    a second observe by it), `repeat` times, and the medians kept: the VM's speed drifts.
    """
    out: dict[str, float] = {}
    with fresh_netns() as ns:
        with inside(ns):
            kernel = NetlinkKernel(device="bench0")
        with kernel:
            assert kernel.apply(plan(state, EMPTY, ownership=OWN)).ok
            runs: dict[str, list[float]] = {
                "ipvsadm -S -n": [],
                "observe": [],
                "again": [],
            }
            for _ in range(repeat):
                runs["ipvsadm -S -n"].append(
                    timed(
                        lambda: subprocess.run(
                            ["ip", "netns", "exec", ns, "ipvsadm", "-S", "-n"],
                            capture_output=True,
                            check=True,
                        )
                    )
                )
                with inside(ns):
                    fresh = NetlinkKernel(device="bench0")
                with fresh:
                    runs["observe"].append(timed(fresh.observe))  # a new kernel object
                    runs["again"].append(timed(fresh.observe))  # every resync after the first
            out.update({name: statistics.median(times) for name, times in runs.items()})
            kernel.observe()  # the syncs below are resyncs: the kernel object has observed
            out["no-op sync"] = timed(lambda: plan(state, kernel.observe(), ownership=OWN))
            changed = reweighted(state, changes)
            ops: list[int] = []

            def sync() -> None:
                todo = plan(changed, kernel.observe(), ownership=OWN)
                ops.append(len(todo))
                assert kernel.apply(todo).ok

            out["k-change sync"] = timed(sync)
            out["k-change ops"] = ops[0]
            out["k-change apply only"] = timed(
                lambda: kernel.apply(plan(state, changed, ownership=OWN))
            )
        check(ns, state)
    return out


def bound(ns: str, device: str) -> set[str]:
    out = subprocess.run(
        ["ip", "-n", ns, "-o", "addr", "show", "dev", device],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {line.split()[3].split("/")[0] for line in out.splitlines()}


def address_measures(n: int) -> dict[str, float]:
    """n VIPs bound, listed and unbound on the dummy device: pyroute2, a request and its ack
    per address (what links.py did before rtnl.py), against NetlinkKernel's one batch."""
    from contextlib import closing
    from ipaddress import ip_address

    from pyroute2 import IPRoute

    vips = [ip_address(cluster_ip(i)) for i in range(n)]
    want = {str(a) for a in vips}
    out: dict[str, float] = {}
    with fresh_netns() as ns:
        with inside(ns):
            kernel, device, ipr = NetlinkKernel(device="bench0"), DummyDevice("bench0"), IPRoute()
        with kernel, closing(device), ipr:
            assert kernel.apply([BindAddress(vips[0]), UnbindAddress(vips[0])]).ok  # the device
            index = ipr.link_lookup(ifname="bench0")[0]

            def pyroute2(command: str) -> None:
                for a in vips:
                    ipr.addr(command, index=index, address=str(a), prefixlen=32)

            out["pyroute2 bind"] = timed(lambda: pyroute2("add"))
            assert bound(ns, "bench0") == want
            listed: list[frozenset[str]] = []
            out["pyroute2 list"] = timed(
                lambda: listed.append(
                    frozenset(m.get("IFA_ADDRESS") for m in ipr.get_addr(index=index))
                )
            )
            out["pyroute2 unbind"] = timed(lambda: pyroute2("del"))
            assert bound(ns, "bench0") == set()
            reports = []
            out["batched bind"] = timed(
                lambda: reports.append(kernel.apply([BindAddress(a) for a in vips]))
            )
            assert bound(ns, "bench0") == want
            out["batched list"] = timed(
                lambda: listed.append(frozenset(map(str, device.addresses())))
            )
            out["batched unbind"] = timed(
                lambda: reports.append(kernel.apply([UnbindAddress(a) for a in vips]))
            )
            assert all(report.ok for report in reports)
            assert bound(ns, "bench0") == set()
            assert listed == [want, want]
    return out


def reweighted(state: IpvsState, k: int) -> IpvsState:
    dests = {key: dict(d) for key, d in state.dests.items()}
    for key in list(dests)[:k]:
        rs_key = next(iter(dests[key]))
        dests[key][rs_key] = RealServer(rs_key, weight=0)
    return IpvsState(state.services, dests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=1000)
    parser.add_argument("--dests", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--changes", type=int, default=10)
    parser.add_argument("--pyroute2-services", type=int, default=100)
    parser.add_argument("--vips", type=int, default=1000, help="0: no VIP rows")
    parser.add_argument(
        "--only-vips", action="store_true", help="measure only binding and unbinding VIPs"
    )
    args = parser.parse_args()
    vips = address_measures(args.vips) if args.vips else {}
    vip_rows = [
        (what, approach, f"{args.vips}", vips[f"{key} {step}"], vips[f"pyroute2 {step}"])
        for step, what in (("bind", "bind VIPs"), ("unbind", "unbind VIPs"), ("list", "list VIPs"))
        for key, approach in (
            ("pyroute2", "pyroute2, a request per address"),
            ("batched", "ipvsproxy, one batch / one dump"),
        )
        if vips
    ]
    if args.only_vips:
        print_rows(f"ipvsproxy VIP benchmark, kernel {os.uname().release}", vip_rows)
        return
    big = table(args.services, args.dests)
    small = table(args.pyroute2_services, args.dests, Scheduler.WLC)
    size = f"{args.services}x{args.dests}"
    small_size = f"{args.pyroute2_services}x{args.dests}"

    floor = median(lambda: ipvsadm_restore(big), args.repeat)
    ours = median(lambda: ipvsproxy_cold(big), args.repeat)
    small_floor = median(lambda: ipvsadm_restore(small), args.repeat)
    small_pyroute2 = pyroute2_cold(small)
    loaded = loaded_measures(big, args.changes, args.repeat)
    dump_floor = loaded["ipvsadm -S -n"]

    rows = [
        ("cold apply", "ipvsadm -R (floor)", size, floor, floor),
        ("cold apply", "ipvsproxy NetlinkKernel", size, ours, floor),
        ("cold apply", "ipvsadm -R (floor)", small_size, small_floor, small_floor),
        ("cold apply", "pyroute2, a call per object", small_size, small_pyroute2, small_floor),
        ("observe", "ipvsadm -S -n (floor)", size, dump_floor, dump_floor),
        ("observe", "ipvsproxy observe(), first", size, loaded["observe"], dump_floor),
        ("observe", "ipvsproxy observe(), resync", size, loaded["again"], dump_floor),
        ("sync", "no changes (observe+plan)", size, loaded["no-op sync"], dump_floor),
        ("sync", f"{args.changes} changed weights, all", size, loaded["k-change sync"], dump_floor),
        (
            "sync",
            f"{args.changes} changed weights, apply",
            size,
            loaded["k-change apply only"],
            floor,
        ),
        *vip_rows,
    ]
    print_rows(
        f"ipvsproxy IPVS benchmark, kernel {os.uname().release}, "
        f"median of {args.repeat} (pyroute2 and VIPs: 1 run; VIPs: ratio to pyroute2)",
        rows,
    )
    print(
        f"\n{args.changes} changed weights planned as {int(loaded['k-change ops'])} kernel requests"
    )


def print_rows(title: str, rows: list[tuple[str, str, str, float, float]]) -> None:
    print(f"\n{title}")
    print(f"{'what':<11} {'approach':<34} {'size':>8} {'seconds':>9}  ratio to floor")
    for what, approach, sz, seconds, base in rows:
        print(f"{what:<11} {approach:<34} {sz:>8} {seconds:>9.3f}  {seconds / base:>6.2f}")


if __name__ == "__main__":
    main()
