"""The agent's start, natively: how long a node goes without a proxy that follows changes.

During a migration the old proxy has left and the new one is starting: the kernel's table keeps
serving, but nothing follows endpoint changes until the agent's first full pass. This measures
that window on this host, from the process's start (the command's exec) to each step the health
port shows, polled every 5 ms:

  health port up      /livez answers (the agent is alive for the kubelet)
  lists done          /readyz's waitingFor turns to the first full pass (every kind listed)
  ready               /readyz 200 (the first full pass has completed: the node is served)

Each run is a fresh network namespace with the test API server (tests/kubeapi.py, the real
list/watch protocol over HTTPS) in it, and the agent with `--backend iptables` (this host's
kernel has no IPVS; the start-up up to the first pass is the same code). `--image` runs the
agent from the image `scripts/image` builds (its interpreter and packages, run natively in the
image's filesystem with chroot; load it first: `podman load -i
.cache/image/ipvsproxy-VERSION.oci.tar`). Also printed: the import time of
the `kubernetes` package (the client's configuration loader and its generated models), from
`python -X importtime`, in the same interpreter as the agent.

    python bench/startup.py [--services 100] [--dests 3] [--repeat 5] [--image]

Run as root on a quiet machine; prints a table (median of the runs).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import BENCH_NODE, cluster, fresh_netns  # noqa: E402
from bench.whole_path import api_server  # noqa: E402
from integration.lab import IPVSPROXY, agent_command, inside  # noqa: E402

HEALTH = 10256
STEPS = ("health port up", "lists done", "ready")
IMAGE_ENV = ("PATH=/opt/ipvsproxy/bin:/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONDONTWRITEBYTECODE=1")


def readyz(ns: str) -> tuple[int, dict[str, object]] | None:
    """/readyz in `ns`: its status and body, None while nothing answers."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with inside(ns), opener.open(f"http://127.0.0.1:{HEALTH}/readyz", timeout=2) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def start_command(ns: str, kubeconfig: Path, root: Path | None) -> list[str]:
    """The agent in `ns`: this interpreter's, or with `root` the image's (chroot, the
    kubeconfig copied in); metrics on a port the kernel picks."""
    program: tuple[str, ...] = (IPVSPROXY,)
    if root is not None:
        shutil.copy(kubeconfig, root / "tmp" / "kubeconfig")
        program = ("chroot", str(root), "/usr/bin/env", "-i", *IMAGE_ENV, "ipvsproxy")
        kubeconfig = Path("/tmp/kubeconfig")
    return agent_command(
        "--kubeconfig", str(kubeconfig), netns=ns, program=program, node=BENCH_NODE,
        backend="iptables", min_sync_period=None, health=HEALTH, metrics=None,
        more=("--metrics-bind-address", "127.0.0.1:0"),
    )  # fmt: skip


@contextmanager
def image_root(image: str) -> Iterator[Path]:
    """The image's filesystem, writable (a buildah working container), with /proc, /sys and
    a /run of its own mounted: the image's interpreter and packages, run natively with
    chroot (no container runtime: podman's crun cannot set its rlimits in this sandbox)."""
    container = _out("buildah", "from", "--pull-never", "--quiet", image)
    try:
        root = Path(_out("buildah", "mount", container))
        mounts = [("proc", "proc", "proc"), ("sys", "sysfs", "sys"), ("run", "tmpfs", "run")]
        for source, kind, target in mounts:
            subprocess.run(["mount", "-t", kind, source, str(root / target)], check=True)
        try:
            yield root
        finally:
            for *_, target in reversed(mounts):
                subprocess.run(["umount", "-l", str(root / target)], check=False)
            subprocess.run(["buildah", "umount", container], capture_output=True, check=False)
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True, check=False)


def _out(*command: str) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()


def one_start(objects: list[dict[str, object]], work: Path, root: Path | None) -> list[float]:
    """Seconds from the command's start to each of STEPS."""
    with fresh_netns() as ns, api_server(ns, objects) as api:
        kubeconfig = api.write_kubeconfig(work / "kubeconfig")
        seen: dict[str, float] = {}
        with (work / "agent.log").open("wb") as log:
            started = time.monotonic()
            proc = subprocess.Popen(start_command(ns, kubeconfig, root), stdout=log, stderr=log)
        try:
            while len(seen) < len(STEPS):
                if proc.poll() is not None:
                    tail = (work / "agent.log").read_text()[-2000:]
                    raise SystemExit(f"the agent exited {proc.returncode}:\n{tail}")
                if time.monotonic() - started > 300:
                    raise SystemExit("no first full pass within 300 s")
                answer = readyz(ns)
                now = time.monotonic() - started
                if answer is not None:
                    seen.setdefault("health port up", now)
                    code, body = answer
                    if code == 200 or str(body.get("waitingFor", "")).startswith("the first full"):
                        seen.setdefault("lists done", now)
                    if code == 200:
                        seen.setdefault("ready", now)
                time.sleep(0.005)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    return [seen[step] for step in STEPS]


def measure(objects: list[dict[str, object]], work: Path, repeat: int, root: Path | None
            ) -> list[float]:  # fmt: skip
    """The median of `repeat` starts, after one to warm the page cache."""
    one_start(objects, work, root)
    samples = [one_start(objects, work, root) for _ in range(repeat)]
    return [statistics.median(s[i] for s in samples) for i in range(len(STEPS))]


def import_seconds(module: str) -> float:
    """Cumulative import time of `module` (its own and its imports'), as the agent's
    interpreter reports it: `python -X importtime`."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    for line in done.stderr.splitlines():
        parts = [p.strip() for p in line.removeprefix("import time:").split("|")]
        if len(parts) == 3 and parts[2] == module:
            return int(parts[1]) / 1e6
    raise SystemExit(f"{module}: not in -X importtime's output")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, default=100)
    parser.add_argument("--dests", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--image",
        nargs="?",
        const="localhost/ipvsproxy:0.1.0",
        default=None,
        help="also from this image (default %(const)s)",
    )
    args = parser.parse_args()
    objects = cluster(args.services, args.dests)
    work = Path("/tmp/ipvsproxy-bench-startup")
    work.mkdir(exist_ok=True)
    rows = [("venv", measure(objects, work, args.repeat, None))]
    if args.image:
        with image_root(args.image) as root:
            rows.append((f"image {args.image}", measure(objects, work, args.repeat, root)))
    print(f"\nagent start, {args.services} Services x {args.dests} endpoints, "
          f"median of {args.repeat} (seconds from the command's start)\n")  # fmt: skip
    print(f"| from | {' | '.join(STEPS)} |")
    print("|---|" + "---|" * len(STEPS))
    for name, figures in rows:
        print(f"| {name} | {' | '.join(f'{f:.2f}' for f in figures)} |")
    print()
    for module in ("kubernetes", "ipvsproxy.kube", "ipvsproxy.cli"):
        print(f"import {module}: {import_seconds(module):.3f} s (cumulative)")


if __name__ == "__main__":
    main()
