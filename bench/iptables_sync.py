"""Benchmark ipvsproxy's iptables fallback against its floors and targets.

Runs on this host's own kernel (no VM needed), as root, each load in a fresh network
namespace; prints a table. Figures are medians of REPEAT runs, wall-clock and CPU (this
process plus the tools it ran); each row is a ratio to its floor, measured in the same run
(on a shared, loaded host wall-clock is noisy: compare ratios and CPU).

  row           ipvsproxy does                               floor
  first sync    observe + plan + apply into an empty netns   iptables-restore --noflush of a
                                                             kube-proxy iptables-mode payload
                                                             of the same Services (and of
                                                             ipvsproxy's own payload, for the
                                                             record)
  one change    plan + apply of one endpoint's weight        iptables-restore --noflush of the
                (a partial sync: no iptables-save)           same payload ipvsproxy wrote
  idle resync   observe + plan, nothing to write             iptables-save + ip6tables-save
  restart       observe() of a loaded table by a new kernel  iptables-save + ip6tables-save
                (decodes and renders every chain)

The kube-proxy payload follows pkg/proxy/iptables/proxier.go (kubernetes v1.3x): chain
declarations first (KUBE-SERVICES, KUBE-MARK-MASQ, KUBE-POSTROUTING, then per Service its
KUBE-SVC chain and KUBE-SEP chains), then per Service its KUBE-SERVICES rule, its SVC chain
(masquerade off-cluster sources, then `statistic --mode random` per endpoint) and its SEP
chains (hairpin mark, DNAT), every rule with a comment.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import fresh_netns, table  # noqa: E402
from integration.lab import inside  # noqa: E402
from ipvsproxy.fallback import IptablesKernel  # noqa: E402
from ipvsproxy.fallback.chains import JUMPS, render  # noqa: E402
from ipvsproxy.host.commands import Commands  # noqa: E402
from ipvsproxy.iptables.parse import Saved  # noqa: E402
from ipvsproxy.iptables.transaction import transaction  # noqa: E402
from ipvsproxy.model import IpvsState  # noqa: E402
from ipvsproxy.sync.ownership import Ownership  # noqa: E402
from ipvsproxy.sync.plan import plan  # noqa: E402

OWN = Ownership()


@dataclass(frozen=True)
class Recording(Commands):
    """Commands that keep what was written (to replay it as a floor)."""

    written: list[str] = field(default_factory=list)

    def run(self, args, *, stdin=None):
        if stdin is not None:
            self.written.append(stdin)
        return super().run(args, stdin=stdin)


@dataclass(frozen=True)
class Time:
    """Wall-clock seconds and CPU seconds (this process and the tools it ran)."""

    wall: float
    cpu: float


def _cpu() -> float:
    me, tools = (
        resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return me.ru_utime + me.ru_stime + tools.ru_utime + tools.ru_stime


def timed(fn: Callable[[], object]) -> Time:
    cpu, start = _cpu(), time.perf_counter()
    fn()
    return Time(time.perf_counter() - start, _cpu() - cpu)


def median(fn: Callable[[], Time], repeat: int) -> Time:
    runs = [fn() for _ in range(repeat)]
    return Time(statistics.median(r.wall for r in runs), statistics.median(r.cpu for r in runs))


def kernel_in(ns: str) -> IptablesKernel:
    """The fallback as the agent runs it: in the node's namespace (the tools without an
    `ip netns exec` prefix), where it can also read nf_tables' generation."""
    with inside(ns):
        kernel = IptablesKernel(commands=Recording())
        kernel.check()
    return kernel


def sync(kernel: IptablesKernel, desired: IpvsState) -> int:
    ops = plan(desired, kernel.observe(), ownership=OWN)
    if ops or kernel.damage():
        report = kernel.apply(ops)
        if report.failures:
            raise SystemExit(f"bench: {report.failures[0].error}")
    return len(ops)


def restore(ns: str, payload: Path) -> Time:
    with payload.open("rb") as rules:
        return timed(
            lambda: subprocess.run(
                ["ip", "netns", "exec", ns, "iptables-restore", "--noflush"],
                stdin=rules,
                check=True,
            )
        )


def floor_restore(payload: Path) -> Time:
    with fresh_netns() as ns:
        return restore(ns, payload)


def saves(ns: str) -> None:
    for tool in ("iptables-save", "ip6tables-save"):
        subprocess.run(["ip", "netns", "exec", ns, tool, "-t", "nat"], capture_output=True)


def cold(desired: IpvsState) -> Time:
    with fresh_netns() as ns, inside(ns):
        kernel = kernel_in(ns)
        seconds = timed(lambda: sync(kernel, desired))
        if kernel_in(ns).observe() != desired:
            raise SystemExit("bench: what was loaded does not read back as desired")
        return seconds


def loaded(desired: IpvsState, repeat: int) -> dict[str, Time]:
    """Times on one netns holding `desired`: a one-endpoint change (and its payload
    replayed), an idle resync, a restart's first observation, and their floors."""
    key = next(iter(desired.services))
    rs = next(iter(desired.dests[key].values()))
    one = IpvsState({key: desired.services[key]}, {key: desired.dests[key]})
    with fresh_netns() as ns, inside(ns):
        kernel = kernel_in(ns)
        sync(kernel, desired)
        payload = Path(f"/tmp/ipvsproxy-bench-change-{ns}.rules")

        weights = [rs.weight]
        commands = kernel._commands  # noqa: SLF001
        assert isinstance(commands, Recording)

        def with_weight(weight: int) -> IpvsState:
            return replace(one, dests={key: {**one.dests[key], rs.key: replace(rs, weight=weight)}})

        def change() -> Time:
            old, new = weights[-1], 0 if weights[-1] else 1
            ops = plan(with_weight(new), with_weight(old), ownership=OWN)
            commands.written.clear()
            seconds = timed(lambda: kernel.apply(ops))
            (written,) = commands.written
            payload.write_text(written)
            weights.append(new)
            return seconds

        def replay() -> Time:
            change()
            return restore(ns, payload)

        out = {
            "one change": median(change, repeat),
            "one change floor": median(replay, repeat),
            "idle resync": median(lambda: timed(lambda: sync(kernel, desired)), repeat),
            "saves": median(lambda: timed(lambda: saves(ns)), repeat),
            "restart": median(lambda: timed(kernel_in(ns).observe), repeat),
        }
        payload.unlink()
        return out


def _h(text: str) -> str:
    return base64.b32encode(hashlib.sha256(text.encode()).digest()[:10]).decode()


def kube_proxy_payload(state: IpvsState) -> str:
    """The nat payload kube-proxy's iptables mode writes on its first sync (see above)."""
    chains = ["KUBE-SERVICES", "KUBE-MARK-MASQ", "KUBE-POSTROUTING", "KUBE-NODEPORTS"]
    rules = [
        "-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000",
        "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN",
        "-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000",
        '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring '
        'SNAT" -j MASQUERADE --random-fully',
    ]
    for n, (key, dests) in enumerate(state.dests.items()):
        name, vip = f"ns{n}/svc{n}:http", f"{key.address}/32"
        svc = "KUBE-SVC-" + _h(name)
        chains.append(svc)
        rules.append(
            f'-A KUBE-SERVICES -d {vip} -p tcp -m comment --comment "{name} cluster IP" '
            f"-m tcp --dport {key.port} -j {svc}"
        )
        rules.append(
            f'-A {svc} ! -s 10.244.0.0/16 -d {vip} -p tcp -m comment --comment "{name} '
            f'cluster IP" -m tcp --dport {key.port} -j KUBE-MARK-MASQ'
        )
        endpoints = list(dests)
        for i, rs in enumerate(endpoints):
            ep = f"{rs.address}:{rs.port}"
            sep = "KUBE-SEP-" + _h(name + ep)
            chains.append(sep)
            odds = int(0x80000000 / (len(endpoints) - i) + 0.5) / 0x80000000
            pick = f"-m statistic --mode random --probability {odds:.11f} " if odds < 1 else ""
            rules.append(f'-A {svc} -m comment --comment "{name} -> {ep}" {pick}-j {sep}')
            rules.append(f'-A {sep} -s {rs.address}/32 -m comment --comment "{name}" '
                         "-j KUBE-MARK-MASQ")  # fmt: skip
            rules.append(f'-A {sep} -p tcp -m comment --comment "{name}" -m tcp '
                         f"-j DNAT --to-destination {ep}")  # fmt: skip
    rules.append(
        '-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this '
        'must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS'
    )
    jumps = [
        '-I PREROUTING 1 -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        '-I OUTPUT 1 -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        '-I POSTROUTING 1 -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING',
    ]
    lines = ["*nat", *(f":{c} - [0:0]" for c in chains), *rules, *jumps, "COMMIT", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=1000)
    parser.add_argument("--dests", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    base = table(args.services, args.dests)
    desired = replace(base, bound=frozenset(k.address for k in base.services))  # ClusterIPs
    size = f"{args.services}x{args.dests}"
    ours = Path(f"/tmp/ipvsproxy-bench-{size}.rules")
    ours.write_text(transaction(Saved(), render(desired, {}, version=4), jumps=JUMPS))
    kube = Path(f"/tmp/ipvsproxy-bench-{size}-kube-proxy.rules")
    kube.write_text(kube_proxy_payload(desired))
    rules = sum(1 for line in ours.read_text().splitlines() if line.startswith("-"))
    kube_rules = sum(1 for line in kube.read_text().splitlines() if line.startswith("-"))

    kube_floor = median(lambda: floor_restore(kube), args.repeat)
    own_floor = median(lambda: floor_restore(ours), args.repeat)
    first = median(lambda: cold(desired), args.repeat)
    seen = loaded(desired, args.repeat)
    dump = seen["saves"]
    change = seen["one change floor"]
    rows = [
        (
            "first sync",
            f"restore, kube-proxy layout ({kube_rules} rules)",
            kube_floor,
            kube_floor,
            "",
        ),
        ("first sync", "restore, ipvsproxy's payload", own_floor, kube_floor, ""),
        ("first sync", "ipvsproxy observe+plan+apply, empty", first, kube_floor, "5.1"),
        ("one change", "restore of the same payload (floor)", change, change, ""),
        ("one change", "ipvsproxy plan+apply, 1 weight", seen["one change"], change, "0.15"),
        ("idle resync", "iptables-save + ip6tables-save (floor)", dump, dump, ""),
        ("idle resync", "ipvsproxy observe+plan, no write", seen["idle resync"], dump, "0.5"),
        ("restart", "ipvsproxy observe() by a new kernel", seen["restart"], dump, ""),
    ]
    version = subprocess.run(["iptables", "--version"], capture_output=True, text=True).stdout
    print(
        f"\nipvsproxy iptables benchmark, {size} ({rules} rules), {version.strip()}, "
        f"median of {args.repeat}"
    )
    print(f"{'what':<12} {'approach':<42} {'wall s':>7} {'ratio':>6} {'target':>6} "
          f"{'cpu s':>7} {'ratio':>6}")  # fmt: skip
    for what, approach, t, floor, target in rows:
        print(
            f"{what:<12} {approach:<42} {t.wall:>7.3f} {t.wall / floor.wall:>6.2f} {target:>6} "
            f"{t.cpu:>7.3f} {t.cpu / floor.cpu:>6.2f}"
        )
    ours.unlink()
    kube.unlink()


if __name__ == "__main__":
    main()
