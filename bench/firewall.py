"""The firewall step of IPVS mode alone, nftables against iptables + ipset, in one run
(docs/performance.md, docs/firewall.md): for each size, in a fresh network namespace per
implementation, the sets and rules of bench/common.cluster(S, D) as the agent's pass makes
them (firewall/set_index.py, from the translated desired state):

  first write     observe + plan + write, into an empty namespace (a node's first pass)
  idle full pass  observe + plan, nothing to write (the periodic resync; nftables: the
                  generation number says nothing was committed, so nothing is read)
  one change      one new ClusterIP Service's entries written, nothing read (a partial pass)

Each figure is the median of --repeat runs, wall-clock seconds, with the CPU of this
process and the tools it ran beside it. Run it in the IPVS VM from the tmpfs copy:
`scripts/vm --tmpfs -- python bench/firewall.py` (the kernel and the tools of the VM; only
ratios between rows of one run mean anything there).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from ipaddress import IPv4Address, ip_network
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import BENCH_NODE, POD_NETWORK, cluster, fresh_netns  # noqa: E402
from integration.lab import inside  # noqa: E402
from ipvsproxy.backends import iptables_firewall  # noqa: E402
from ipvsproxy.config import Config  # noqa: E402
from ipvsproxy.firewall.firewall_plan import HostFirewall  # noqa: E402
from ipvsproxy.firewall.nft_firewall import NftFirewall  # noqa: E402
from ipvsproxy.firewall.set_index import SetIndex  # noqa: E402
from ipvsproxy.firewall.sets import SetState, entries_for  # noqa: E402
from ipvsproxy.host.commands import Commands  # noqa: E402
from ipvsproxy.model import Proto, VSKey  # noqa: E402
from ipvsproxy.policy import node_policy  # noqa: E402
from tests.factories import from_objects  # noqa: E402

IMPLEMENTATIONS = ("iptables", "nftables")


def cpu() -> float:
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def measured(fn: Callable[[], object]) -> tuple[float, float]:
    wall, used = time.perf_counter(), cpu()
    fn()
    return time.perf_counter() - wall, cpu() - used


def opened(name: str) -> HostFirewall:
    """The firewall as backends._firewall opens it, in this thread's namespace."""
    firewall: HostFirewall = NftFirewall() if name == "nftables" else iptables_firewall(Commands())
    firewall.check()
    return firewall


def write_all(firewall: HostFirewall, wanted: SetState) -> None:
    """A full pass's firewall step: observe, plan, write."""
    firewall.apply(firewall.plan(wanted))


def one_size(services: int, dests: int, repeat: int) -> list[tuple[str, str, float, float]]:
    config = Config(node_name=BENCH_NODE, cluster_cidrs=(ip_network(POD_NETWORK),))
    desired, _ = from_objects(cluster(services, dests), config)
    state, access, local = desired.state, desired.access, desired.local_endpoints
    rows = []
    for name in IMPLEMENTATIONS:
        runs: dict[str, list[tuple[float, float]]] = {"first": [], "idle": [], "change": []}
        entries = 0
        for _ in range(repeat):
            with fresh_netns() as ns, inside(ns):  # the tools run in it, as a node's agent's
                firewall = opened(name)
                try:
                    firewall.options = node_policy(config)
                    index = SetIndex(versions=firewall.versions)
                    index.reset(state, access, local=local)
                    wanted = index.wanted()
                    entries = sum(len(found) for _, _, found in wanted.sets.values())
                    runs["first"].append(measured(partial(write_all, firewall, wanted)))
                    firewall.observe()  # the agent's next full pass reads it once
                    runs["idle"].append(measured(partial(firewall.plan, wanted)))
                    index.seed(firewall.observe_sets())
                    key = VSKey(IPv4Address("10.96.255.250"), 80, Proto.TCP)
                    index.update(key, entries_for(key, None, (), local=local, bound=True))
                    changes = index.take()
                    runs["change"].append(measured(partial(firewall.write_sets, changes)))
                finally:
                    firewall.close()
        for step, label in (("first", "first write"), ("idle", "idle full pass"),
                            ("change", "one change")):  # fmt: skip
            wall = statistics.median(w for w, _ in runs[step])
            used = statistics.median(c for _, c in runs[step])
            rows.append((f"{services}x{dests} ({entries} entries)", f"{label}, {name}", wall, used))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default="1000x10,10000x10", help="SxD,... (Services x endpoints)"
    )
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"{'size':<28} {'step':<28} {'seconds':>8} {'cpu s':>7}")
    for size in args.sizes.split(","):
        services, dests = (int(n) for n in size.split("x"))
        for where, step, wall, used in one_size(services, dests, args.repeat):
            print(f"{where:<28} {step:<28} {wall:>8.3f} {used:>7.3f}", flush=True)


if __name__ == "__main__":
    main()
