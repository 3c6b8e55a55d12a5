"""The image scripts/image builds, run as deploy/'s DaemonSet runs it: podman in the IPVS VM starts
the rendered standalone overlay's init container (`prepare`, privileged) and agent container
(host network, NET_ADMIN and NET_RAW only, read-only root filesystem, its volumes, its ConfigMap's
settings, the service account's token) against the test API server serving the bundled example;
the example is programmed, real traffic passes, the probes answer, and SIGTERM stops it cleanly
with the rules left in place. Run by scripts/vm-test inside the IPVS VM.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from integration.host import STUCK, clean_ipvs, skip_unless_ci
from integration.lab import Lab, request, udp_request
from integration.pods import Pod, load, podman
from integration.services import EXAMPLE_NODE_ADDRESS, EXAMPLE_PODS
from tests import support
from tests.kubeapi import ApiServer

pytestmark = pytest.mark.vm

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "deploy" / "overlays" / "standalone"


def archive() -> Path:
    version = subprocess.run(
        ["sed", "-n", 's/^version = "\\(.*\\)"/\\1/p', str(ROOT / "pyproject.toml")],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    return ROOT / ".cache" / "image" / f"ipvsproxy-{version}.oci.tar"


def rendered() -> list[dict[str, Any]]:
    """The standalone overlay as `kubectl apply -k` would send it."""
    if shutil.which("kubectl") is None:
        skip_unless_ci("kubectl (with kustomize) is not installed")
    out = subprocess.run(
        ["kubectl", "kustomize", str(OVERLAY)], capture_output=True, text=True, check=True
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def example_objects() -> Iterator[dict[str, Any]]:
    for doc in yaml.safe_load_all((ROOT / "examples" / "cluster.yaml").read_text()):
        if doc:
            yield from doc["items"] if doc["kind"] == "List" else [doc]


def saved() -> str:
    return subprocess.run(["ipvsadm-save", "-n"], capture_output=True, text=True).stdout


def get(url: str, timeout: float) -> tuple[int, str]:
    """The status and body, whatever the status (a readiness probe answers 503 until the
    agent's first full pass)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def probe(container: dict[str, Any], name: str) -> tuple[int, str]:
    """One of the container's probes, as the kubelet sends it (its host, port, path, timeout)."""
    spec = container[name]
    http = spec["httpGet"]
    return get(f"http://{http['host']}:{http['port']}{http['path']}", spec["timeoutSeconds"])


BUILD_STATE = ROOT / ".cache" / "image-build.state"  # scripts/test's build of the image
BUILD_WAIT = 900.0  # s: about 1.5 min quiet, several times that beside the VM on a busy host


def wait_for_build() -> str:
    """scripts/test builds the image while this suite runs: its state file says "building
    SINCE" (epoch seconds) until the build ends, then "exit N". '' when no build is running
    (none started, or one begun too long ago: a stopped run's leftover)."""
    deadline = time.monotonic() + BUILD_WAIT
    while time.monotonic() < deadline:
        try:
            state = BUILD_STATE.read_text().split()
        except OSError:
            return ""
        if state[:1] != ["building"] or len(state) < 2 or not state[1].isdigit():
            return " ".join(state)
        if time.time() - int(state[1]) > BUILD_WAIT:
            return ""
        time.sleep(2)
    return f"still building after {BUILD_WAIT:g} s"


@pytest.fixture
def image() -> str:
    built = wait_for_build()
    if built not in ("", "exit 0"):
        skip_unless_ci(f"scripts/image: {built} (.cache/image-build.log)")
    path = archive()
    if not path.exists():
        skip_unless_ci(f"{path} is missing: build it with scripts/image")
    if shutil.which("podman") is None:
        skip_unless_ci("podman is not installed")
    return load(path)


def test_the_image_runs_as_the_daemonset_runs_it(image: str) -> None:
    objects = rendered()
    daemonset = next(o for o in objects if o["kind"] == "DaemonSet")
    configmaps = {o["metadata"]["name"]: o["data"] for o in objects if o["kind"] == "ConfigMap"}
    spec = daemonset["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    (agent,) = spec["containers"]
    assert init["image"] == agent["image"] == image, "the overlay names scripts/image's image"

    api = ApiServer().start()
    for obj in example_objects():
        api.put(obj)
    # what the operator sets in the ConfigMap (deploy/ ships the API server empty on purpose)
    settings = configmaps["ipvsproxy"]
    settings.update({"apiserver-host": "127.0.0.1", "apiserver-port": str(api.port),
                     "service-cidr": "10.96.0.0/16"})  # fmt: skip
    pod = Pod(spec, configmaps, node_name="node-a", api_host="10.96.0.1", api_port=443,
              token=api.token, ca_pem=api.ca_pem,
              namespace=daemonset["metadata"]["namespace"])  # fmt: skip
    lab = Lab()
    clean_ipvs()
    try:
        names = {lab.add_backend(address, ports).name: address
                 for address, ports in EXAMPLE_PODS.items()}  # fmt: skip
        client = lab.add_client()
        node_address = f"{EXAMPLE_NODE_ADDRESS}/32"
        subprocess.run(["ip", "addr", "add", node_address, "dev", "vc1"], check=True)

        prepared = podman("run", "--rm", *pod.podman_args(init))
        assert prepared.returncode == 0, prepared.stdout + prepared.stderr
        started = podman("run", "--detach", *pod.podman_args(agent))
        assert started.returncode == 0, started.stderr

        def logs() -> str:
            return podman("logs", agent["name"]).stderr[-4000:]

        support.eventually(
            lambda: "-A -t 203.0.113.10:443" in saved(), STUCK, "the example is programmed",
            interval=0.5, detail=lambda: saved() + logs(),
        )  # fmt: skip
        assert probe(agent, "livenessProbe")[0] == 200
        # Ready once the first full pass is done (/readyz): a deadline a loaded machine meets
        support.eventually(lambda: probe(agent, "readinessProbe")[0] == 200, STUCK, "ready")
        # the plain metrics port: loopback only, as kube-proxy's default (the Pod's ports list
        # the secure one, https-metrics)
        (bind,) = [a for a in agent["args"] if a.startswith("--metrics-bind-address=")]
        assert bind == "--metrics-bind-address=127.0.0.1:10249"
        assert get("http://127.0.0.1:10249/proxyMode", 5) == (200, "ipvs")
        assert "https-metrics" in {p["name"] for p in agent["ports"]}

        web = {names[request(client, "10.96.0.10", 80)] for _ in range(6)}
        assert web == {"10.244.1.2", "10.244.1.3", "10.244.1.4"}, logs()
        assert {names[request(client, EXAMPLE_NODE_ADDRESS, 30080)]} == {"10.244.1.3"}
        assert names[udp_request(client, "10.96.0.53", 53)] in {"10.244.1.2", "10.244.2.5"}
        # --firewall auto: the image's libnftables takes the table (no iptables rule written)
        table = subprocess.run(["nft", "list", "table", "inet", "ipvsproxy"],
                               capture_output=True, text=True)  # fmt: skip
        assert "10.96.0.10 . tcp . 80" in table.stdout, table.stderr + logs()

        # the container is what the DaemonSet says: read-only, no capability beyond its two
        inspect = json.loads(podman("inspect", agent["name"]).stdout)[0]
        assert inspect["HostConfig"]["ReadonlyRootfs"] is True
        assert set(inspect["EffectiveCaps"]) == {"CAP_NET_ADMIN", "CAP_NET_RAW"}
        assert podman("exec", agent["name"], "touch", "/opt/x").returncode != 0

        stopped = podman("stop", "--time", "30", agent["name"])
        assert stopped.returncode == 0, stopped.stderr
        exit_code = podman("inspect", "--format", "{{.State.ExitCode}}", agent["name"]).stdout
        assert exit_code.strip() == "0", logs()
        assert "-A -t 10.96.0.10:80" in saved(), "SIGTERM leaves the rules in place"
    finally:
        podman("rm", "--force", agent["name"])
        lab.close()
        api.stop()
        clean_ipvs()
