"""Benchmark ipvsproxy's iptables fallback against the practical floor, `iptables-restore`.

Runs on this host's own kernel (no VM needed), as root, each load in a fresh network
namespace; prints a table. The floor for a cold apply is `iptables-restore --noflush` loading
the identical payload ipvsproxy writes, from a file; for an observation, `iptables-save -t nat`
alone. Figures are medians of REPEAT runs.

  approach                          what is timed
  iptables-restore (floor)          loading ipvsproxy's cold payload from a file
  ipvsproxy sync, cold              observe (iptables-save + parse) + plan + render + restore
  iptables-save (floor)             dumping the nat table
  ipvsproxy observe()               iptables-save + parse + damage check
  ipvsproxy no-op sync              observe + plan with nothing to do (nothing written)
  ipvsproxy sync, k changes         observe + plan + a restore of the k changed chains only
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import fresh_netns, median, table, timed  # noqa: E402
from ipvsproxy.iptables import Commands, IptablesKernel  # noqa: E402
from ipvsproxy.iptables.parse import Saved  # noqa: E402
from ipvsproxy.iptables.rules import render  # noqa: E402
from ipvsproxy.iptables.transaction import transaction  # noqa: E402
from ipvsproxy.model import IpvsState, RealServer  # noqa: E402
from ipvsproxy.sync.ownership import Ownership  # noqa: E402
from ipvsproxy.sync.plan import plan  # noqa: E402

OWN = Ownership()


def kernel_in(ns: str) -> IptablesKernel:
    kernel = IptablesKernel(commands=Commands(prefix=("ip", "netns", "exec", ns)))
    kernel.check()
    return kernel


def sync(kernel: IptablesKernel, desired: IpvsState) -> int:
    ops = plan(desired, kernel.observe(), ownership=OWN)
    if ops or kernel.damage():
        report = kernel.apply(ops)
        if report.failures:
            raise SystemExit(f"bench: {report.failures[0].error}")
    return len(ops)


def floor_restore(payload: Path) -> float:
    with fresh_netns() as ns, payload.open("rb") as rules:
        return timed(
            lambda: subprocess.run(
                ["ip", "netns", "exec", ns, "iptables-restore", "--noflush"],
                stdin=rules,
                check=True,
            )
        )


def cold(desired: IpvsState) -> float:
    with fresh_netns() as ns:
        kernel = kernel_in(ns)
        seconds = timed(lambda: sync(kernel, desired))
        if kernel_in(ns).observe() != desired:
            raise SystemExit("bench: what was loaded does not read back as desired")
        return seconds


def loaded(desired: IpvsState, changes: int, repeat: int) -> dict[str, float]:
    changed = reweighted(desired, changes)
    with fresh_netns() as ns:
        kernel = kernel_in(ns)
        sync(kernel, desired)

        def save() -> None:
            subprocess.run(
                ["ip", "netns", "exec", ns, "iptables-save", "-t", "nat"],
                capture_output=True,
                check=True,
            )

        def k_changes() -> float:
            sync(kernel, desired)
            return timed(lambda: sync(kernel, changed))

        return {
            "iptables-save": median(lambda: timed(save), repeat),
            "observe": median(lambda: timed(kernel.observe), repeat),
            "no-op sync": median(lambda: timed(lambda: sync(kernel, desired)), repeat),
            "k changes": median(k_changes, repeat),
        }


def reweighted(state: IpvsState, k: int) -> IpvsState:
    dests = {key: dict(d) for key, d in state.dests.items()}
    for key in list(dests)[:k]:
        rs_key = next(iter(dests[key]))
        dests[key][rs_key] = RealServer(rs_key, weight=0)
    return replace(state, dests=dests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=1000)
    parser.add_argument("--dests", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--changes", type=int, default=10)
    args = parser.parse_args()
    base = table(args.services, args.dests)
    desired = replace(base, bound=frozenset(k.address for k in base.services))  # ClusterIPs
    size = f"{args.services}x{args.dests}"
    payload = Path(f"/tmp/ipvsproxy-bench-{args.services}x{args.dests}.rules")
    payload.write_text(transaction(Saved(), render(desired, {}, version=4)))
    rules = sum(1 for line in payload.read_text().splitlines() if line.startswith("-"))

    floor = median(lambda: floor_restore(payload), args.repeat)
    ours = median(lambda: cold(desired), args.repeat)
    seen = loaded(desired, args.changes, args.repeat)
    dump = seen["iptables-save"]
    rows = [
        ("cold apply", "iptables-restore, same payload (floor)", floor, floor),
        ("cold apply", "ipvsproxy sync into empty chains", ours, floor),
        ("observe", "iptables-save -t nat (floor)", dump, dump),
        ("observe", "ipvsproxy observe()", seen["observe"], dump),
        ("sync", "no changes (observe+plan)", seen["no-op sync"], dump),
        ("sync", f"{args.changes} changed weights", seen["k changes"], floor),
    ]
    version = subprocess.run(["iptables", "--version"], capture_output=True, text=True).stdout
    print(
        f"\nipvsproxy iptables benchmark, {size} ({rules} rules), {version.strip()}, "
        f"median of {args.repeat}"
    )
    print(f"{'what':<11} {'approach':<40} {'seconds':>9}  ratio to floor")
    for what, approach, seconds, floor_ in rows:
        print(f"{what:<11} {approach:<40} {seconds:>9.3f}  {seconds / floor_:>6.2f}")
    payload.unlink()


if __name__ == "__main__":
    main()
