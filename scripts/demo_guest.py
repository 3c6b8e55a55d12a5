"""The main job on the bundled example, run inside the IPVS VM by scripts/demo.

Builds pods for the endpoints of examples/cluster.yaml as network namespaces, starts the real
agent, `ipvsproxy run --manifests` (the long-running loop, with the manifests as its source),
shows the IPVS table and the firewall's nftables table, sends real requests through the VIPs
printing which pod answered each, then edits the manifest (one web pod leaves) and shows the
agent picking that up, checks that a dry run finds nothing to do, and stops the agent with
SIGTERM (the rules stay in place).
Exits non-zero if any of that does not hold.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from integration.lab import Lab, request, udp_request  # noqa: E402
from integration.services import EXAMPLE_NODE_ADDRESS as NODE_ADDRESS  # noqa: E402
from integration.services import EXAMPLE_PODS as PODS  # noqa: E402

IPVSPROXY = str(Path(sys.executable).parent / "ipvsproxy")
NODE = ["--hostname-override", "node-a", "--service-cidr", "10.96.0.0/16"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    print(f"\n$ {' '.join(args)}", flush=True)
    result = subprocess.run(args, capture_output=True, text=True, check=False)
    print(result.stdout + result.stderr, end="", flush=True)
    return result


def eventually(check: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"demo: FAILED: not within {timeout:.0f}s: {what}")
        time.sleep(0.5)


def saved() -> str:
    return subprocess.run(["ipvsadm-save", "-n"], capture_output=True, text=True).stdout


def without_pod(manifest: Path, address: str) -> None:
    """Edit the manifest as a controller would: the pod leaves demo/web's EndpointSlice."""
    docs = list(yaml.safe_load_all(manifest.read_text()))
    for doc in docs:
        if doc and doc.get("kind") == "EndpointSlice" and doc["metadata"]["name"] == "web-x7k2p":
            doc["endpoints"] = [e for e in doc["endpoints"] if e["addresses"] != [address]]
    manifest.write_text(yaml.safe_dump_all(docs))


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="ipvsproxy-demo-"))
    shutil.copytree(ROOT / "examples", work / "examples")
    manifest = work / "examples" / "cluster.yaml"
    log = work / "agent.log"
    lab = Lab()
    agent = None
    try:
        names: dict[str, str] = {}
        for address, ports in PODS.items():
            names[lab.add_backend(address, ports).name] = address
        client = lab.add_client()
        subprocess.run(["ip", "addr", "add", f"{NODE_ADDRESS}/32", "dev", "vc1"], check=True)

        command = [
            IPVSPROXY,
            "run",
            "--manifests",
            str(work / "examples"),
            *NODE,
            "--min-sync-period",
            "200ms",
            "--healthz-bind-address",
            "127.0.0.1:10256",
        ]
        print(f"\n$ {' '.join(command)} &", flush=True)
        with log.open("w") as out:
            agent = subprocess.Popen(command, stdout=out, stderr=out)
        eventually(lambda: "-A -t 203.0.113.10:443" in saved(), "the agent programs the example")
        health = json.load(urllib.request.urlopen("http://127.0.0.1:10256/healthz", timeout=5))
        print(f"healthz: {health}")
        run("ipvsadm", "-Ln")
        run("nft", "list", "table", "inet", "ipvsproxy")  # the firewall rules (docs/firewall.md)

        def show(title: str, answers: list[str]) -> Counter[str]:
            print(f"\n{title}")
            for i, name in enumerate(answers, 1):
                print(f"  request {i}: answered by pod {names[name]}")
            return Counter(names[a] for a in answers)

        web = show(
            "TCP 10.96.0.10:80 (demo/web, rr; the terminating pod gets nothing) from a client pod:",
            [request(client, "10.96.0.10", 80) for _ in range(6)],
        )
        shop = show(
            f"TCP {NODE_ADDRESS}:30080 (demo/shop NodePort, externalTrafficPolicy Local):",
            [request(client, NODE_ADDRESS, 30080) for _ in range(3)],
        )
        dns = show(
            "UDP 10.96.0.53:53 (demo/dns, sh with sh-port) from the client pod:",
            [udp_request(client, "10.96.0.53", 53) for _ in range(2)],
        )
        api = show(
            "TCP 203.0.113.10:443 (demo/api LoadBalancer IP, lc):",
            [request(client, "203.0.113.10", 443) for _ in range(4)],
        )
        ok = (
            web == {"10.244.1.2": 2, "10.244.1.3": 2, "10.244.1.4": 2}
            and shop == {"10.244.1.3": 3}
            and set(dns) <= {"10.244.1.2", "10.244.2.5"}
            and sum(dns.values()) == 2
            and set(api) == {"10.244.1.4", "10.244.2.7"}
        )

        print(f"\nEditing {manifest.name}: pod 10.244.1.4 leaves demo/web's EndpointSlice")
        without_pod(manifest, "10.244.1.4")
        eventually(lambda: "10.96.0.10:80 -r 10.244.1.4" not in saved(), "the agent re-reads")
        web_after = show(
            "TCP 10.96.0.10:80 (demo/web) after the edit:",
            [request(client, "10.96.0.10", 80) for _ in range(4)],
        )
        ok = ok and web_after == {"10.244.1.2": 2, "10.244.1.3": 2}
        in_sync = run(IPVSPROXY, "diff", "--manifests", str(work / "examples"), *NODE)
        agent.send_signal(signal.SIGTERM)
        stopped = agent.wait(timeout=60) == 0
        kept = "-A -t 10.96.0.10:80" in saved()
        print("\nThe agent's log (one line per sync, then the stop):")
        print("".join(f"  {line}" for line in log.read_text().splitlines(True)[-8:]), end="")
        print(f"stopped cleanly: {stopped}; IPVS rules left in place: {kept}")
        good = ok and in_sync.returncode == 0 and stopped and kept
        print("\ndemo:", "OK" if good else "FAILED", flush=True)
        return 0 if good else 1
    finally:
        if agent is not None and agent.poll() is None:
            agent.kill()
        lab.close()


if __name__ == "__main__":
    sys.exit(main())
