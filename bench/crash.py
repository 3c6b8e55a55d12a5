"""Crash safety: `kill -9` the agent at random moments of a first sync and of a large change,
restart it each time; the table always converges to the desired state, a foreign virtual server
is never touched, the restarted agent completes the table within one first sync's time, and
`ipvsproxy diff` is then in sync.

    scripts/vm -- .venv/bin/python bench/crash.py [--services 1000] [--dests 10] [--points 20]
                                                  [--seed N]

Run inside the IPVS VM as root (integration/ipvs/test_crash.py runs a few points of it in CI).
Every round runs in one fresh network namespace, against the test API server (tests/kubeapi.py)
serving a generated cluster (bench/common.py `cluster()`). Rounds alternate: "first sync" (the
table emptied but for the foreign virtual server, the agent started, killed at a random moment
of its first sync) and "large change" (the agent converged, then one in five Services loses half
its endpoints, or gets them back, and the agent is killed at a random moment after the change).
Prints one line per round; exits 1 if any round failed.
"""

from __future__ import annotations

import argparse
import copy
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import BENCH_NODE, RawObject, cluster, fresh_netns  # noqa: E402
from bench.whole_path import (  # noqa: E402
    NODE_FLAGS,
    SERVICE_CIDR,
    ProcIpvs,
    api_server,
    in_ns,
    same_table,
    wait_for,
)
from integration.lab import agent_command  # noqa: E402
from ipvsproxy.config import Config, parse_cidrs  # noqa: E402
from ipvsproxy.model import IpvsState  # noqa: E402
from ipvsproxy.saved_table import parse_save  # noqa: E402
from tests.factories import from_objects  # noqa: E402

FOREIGN = "192.0.2.50:80"  # outside the Service CIDR, on no address of the node: not ipvsproxy's
FOREIGN_SAVED = f"-A -t {FOREIGN} -s wlc\n-a -t {FOREIGN} -r 198.51.100.9:80 -m -w 3\n"


@dataclass
class Round:
    phase: str
    killed_after: float  # seconds after the agent's start, or after the change
    converged_after: float  # seconds after the restart; -1 if it never did
    problem: str = ""  # what broke: not converged, the foreign virtual server touched, diff
    first_sync: float = 0.0  # a clean first sync's seconds, the yardstick for `slow`

    @property
    def slow(self) -> bool:
        """Completed later than one first sync (with slack): a figure of this host's speed too,
        so the benchmark's verdict, not the CI test's (no wall-clock assertion in a test)."""
        return self.converged_after > self.first_sync * 1.5 + 5

    def line(self) -> str:
        verdict = self.problem or "ok"
        if not self.problem and self.slow:
            verdict = f"converged only after one first sync ({self.first_sync:.1f} s)"
        return (
            f"{self.phase:12} killed at {self.killed_after:5.1f} s, restarted agent complete "
            f"after {self.converged_after:5.1f} s: {verdict}"
        )


def desired(objects: list[RawObject]) -> IpvsState:
    config = Config(
        node_name=BENCH_NODE, service_cidrs=parse_cidrs(SERVICE_CIDR, option="service-cidr")
    )
    wanted, _ = from_objects(objects, config)
    return IpvsState(wanted.state.services, wanted.state.dests)


def halved(objects: list[RawObject]) -> list[RawObject]:
    """One in five EndpointSlices with half of its endpoints: a large change."""
    changed = copy.deepcopy(objects)
    slices = [o for o in changed if o["kind"] == "EndpointSlice"]
    for obj in slices[::5]:
        obj["endpoints"] = obj["endpoints"][: max(1, len(obj["endpoints"]) // 2)]
    return changed


class Crashes:
    """The rounds, on one namespace and one API server."""

    def __init__(self, ns: str, api: Any, kubeconfig: Path, work: Path) -> None:
        self.ns, self.api, self.work = ns, api, work
        self.cmd = agent_command(
            "--kubeconfig", str(kubeconfig), netns=ns, node=BENCH_NODE, service_cidr=SERVICE_CIDR,
            min_sync_period="1s", sync_period=30, health=None, metrics=None,
            more=(*NODE_FLAGS, "--metrics-bind-address", "127.0.0.1:0",
                  "--healthz-bind-address", "127.0.0.1:0"),
        )  # fmt: skip
        self.kernel = ProcIpvs(ns)
        self.logs = 0

    def start(self) -> subprocess.Popen[bytes]:
        self.logs += 1
        with (self.work / f"agent-{self.logs}.log").open("wb") as sink:
            return subprocess.Popen(self.cmd, stdout=sink, stderr=sink)

    def foreign_intact(self) -> bool:
        saved = in_ns(self.ns, "ipvsadm-save", "-n", capture_output=True, check=True).stdout
        return all(line in saved for line in FOREIGN_SAVED.splitlines())

    def empty_table(self) -> None:
        in_ns(self.ns, "ipvsadm", "-C", check=True)
        in_ns(self.ns, "ipvsadm-restore", input=FOREIGN_SAVED, check=True)

    def complete(self, want: IpvsState, proc: subprocess.Popen[bytes]) -> Callable[[], bool]:
        counts = (len(want.services), sum(len(d) for d in want.dests.values()))

        def check() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"the agent exited {proc.returncode}: {self.tail()}")
            return self.kernel.counts() == counts and not same_table(self.ns, want)

        return check

    def tail(self) -> str:
        return (self.work / f"agent-{self.logs}.log").read_text(errors="replace")[-2000:]

    def put(self, objects: list[RawObject]) -> None:
        for obj in objects:
            if obj["kind"] == "EndpointSlice":
                self.api.put(obj)

    def close(self) -> None:
        self.kernel.close()


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def crash_rounds(
    services: int, dests: int, points: int, seed: int, say: Callable[[str], None] = print
) -> list[Round]:
    """`points` rounds; each round's verdict (problem '' when it held)."""
    rng = random.Random(seed)
    objects = cluster(services, dests)
    variants = [objects, halved(objects)]
    foreign = parse_save(FOREIGN_SAVED)  # the table holds it too, untouched
    wants = [
        IpvsState({**w.services, **foreign.services}, {**w.dests, **foreign.dests})
        for w in map(desired, variants)
    ]
    rounds: list[Round] = []
    with (
        tempfile.TemporaryDirectory(prefix="crash-") as tmp,
        fresh_netns() as ns,
        api_server(ns, objects) as api,
    ):
        work = Path(tmp)
        crashes = Crashes(ns, api, api.write_kubeconfig(work / "kubeconfig"), work)
        try:
            crashes.empty_table()
            started = time.monotonic()
            proc = crashes.start()
            first = wait_for(crashes.complete(wants[0], proc), 300, 0.25)
            stop(proc)
            if first is None:
                raise RuntimeError(f"no first sync within 300 s: {crashes.tail()}")
            full = first - started
            say(f"{services}x{dests}, seed {seed}: a clean first sync takes {full:.1f} s")
            current = 0
            for n in range(points):
                phase = "first sync" if n % 2 == 0 else "large change"
                if phase == "first sync":
                    crashes.empty_table()
                    proc = crashes.start()
                    moment = rng.uniform(0, full)
                else:
                    proc = crashes.start()
                    if wait_for(crashes.complete(wants[current], proc), 300, 0.25) is None:
                        raise RuntimeError(f"no convergence before the change: {crashes.tail()}")
                    current = 1 - current
                    crashes.put(variants[current])
                    moment = rng.uniform(0, 3.0)
                time.sleep(moment)
                proc.kill()
                proc.wait()
                restarted = time.monotonic()
                proc = crashes.start()
                # a deadline, not a verdict: generous, so a busy host's slow restart is not "never"
                done = wait_for(crashes.complete(wants[current], proc), 4 * full + 120, 0.25)
                took = -1.0 if done is None else done - restarted
                problem = ""
                if done is None:
                    problem = f"not converged: {same_table(ns, wants[current])}"
                if not crashes.foreign_intact():
                    problem += " the foreign virtual server was touched"
                stop(proc)
                rounds.append(Round(phase, moment, took, problem.strip(), full))
                say(rounds[-1].line())
            diff = in_ns(ns, *agent_command(
                "--kubeconfig", str(work / "kubeconfig"), command="diff", node=BENCH_NODE,
                service_cidr=SERVICE_CIDR, min_sync_period=None, health=None, metrics=None,
                more=NODE_FLAGS,
            ), capture_output=True)  # fmt: skip
            if diff.returncode != 0:
                rounds.append(Round("diff", 0, 0, f"diff exit {diff.returncode}: "
                                    f"{diff.stdout[-1500:]}{diff.stderr[-500:]}"))  # fmt: skip
                say(rounds[-1].line())
        finally:
            crashes.close()
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=1000)
    parser.add_argument("--dests", type=int, default=10)
    parser.add_argument("--points", type=int, default=20)
    parser.add_argument("--seed", type=int, default=random.SystemRandom().randrange(1 << 30))
    args = parser.parse_args()
    rounds = crash_rounds(args.services, args.dests, args.points, args.seed)
    failed = [r for r in rounds if r.problem or r.slow]
    print(f"{len(rounds) - len(failed)} of {len(rounds)} rounds held (seed {args.seed})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
