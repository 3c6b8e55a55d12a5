"""The main job on the bundled example, run inside the IPVS VM by scripts/demo.

Builds pods for node-a's endpoints of examples/cluster.yaml as network namespaces, runs the
real `ipvsproxy run --once` on the example, shows the IPVS table, sends real requests through
the VIPs printing which pod answered each, and checks that a dry run then finds nothing to do.
Exits non-zero if any of that does not hold.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from integration.lab import Lab, request, udp_request  # noqa: E402

IPVSPROXY = str(Path(sys.executable).parent / "ipvsproxy")
NODE = ["--hostname-override", "node-a", "--service-cidr", "10.96.0.0/16"]
# The example's pods (node-a's and node-b's), with the ports their EndpointSlices name.
PODS = {
    "10.244.1.2": (8000, 5353),
    "10.244.1.3": (8000,),
    "10.244.1.4": (8000, 8443),
    "10.244.2.5": (5353,),
    "10.244.2.6": (8000,),
    "10.244.2.7": (8443,),
}
NODE_ADDRESS = "172.31.0.10"  # node-a's InternalIP in the example


def run(*args: str) -> subprocess.CompletedProcess[str]:
    print(f"\n$ {' '.join(args)}", flush=True)
    result = subprocess.run(args, capture_output=True, text=True, check=False)
    print(result.stdout + result.stderr, end="", flush=True)
    return result


def main() -> int:
    lab = Lab()
    try:
        names: dict[str, str] = {}
        for address, ports in PODS.items():
            names[lab.add_backend(address, ports).name] = address
        client = lab.add_client()
        subprocess.run(["ip", "addr", "add", f"{NODE_ADDRESS}/32", "dev", "vc1"], check=True)

        if run(IPVSPROXY, "run", "--once", "--manifests", "examples/", *NODE).returncode:
            return 1
        run("ipvsadm", "-Ln")

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
        in_sync = run(IPVSPROXY, "diff", "--manifests", "examples/", *NODE).returncode == 0
        print("\ndemo:", "OK" if ok and in_sync else "FAILED", flush=True)
        return 0 if ok and in_sync else 1
    finally:
        lab.close()


if __name__ == "__main__":
    sys.exit(main())
