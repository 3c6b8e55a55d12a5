"""The cluster's side of docs/migration.md (integration/ipvs/test_migration.py runs the node's
side in the IPVS VM): its patch applies to kube-proxy's DaemonSet as kubeadm v1.36 writes it
and the result validates; with the label its commands set, a node runs exactly one proxy,
ipvsproxy, and without it exactly kube-proxy; its shell blocks run as written (kubectl recorded,
not run, but `patch`, which runs for real, locally)."""

from __future__ import annotations

import json
import os
import re
import shlex
from typing import Any

import pytest
import yaml

from tests.test_deploy import ROOT, check, pod_spec, tool, validate

DOC = ROOT / "docs" / "migration.md"
KUBEADM_KUBE_PROXY = ROOT / "tests" / "data" / "kubeadm-kube-proxy-daemonset.yaml"


def blocks() -> list[str]:
    return re.findall(r"```sh\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


def commands(text: str | None = None) -> list[list[str]]:
    """Every kubectl command of the page (or of one block), its lines joined, split as the
    shell would."""
    joined = ("\n".join(blocks()) if text is None else text).replace("\\\n", " ")
    found = []
    for line in joined.splitlines():
        line = line.split("#", 1)[0].strip()
        if "kubectl " in line:
            found.append(shlex.split(line[line.index("kubectl ") :]))
    return found


def the(prefix: list[str]) -> list[str]:
    (found,) = [c for c in commands() if c[: len(prefix)] == prefix]
    return found


def patched_kube_proxy() -> dict[str, Any]:
    """The page's `kubectl patch`, run locally on kubeadm's kube-proxy DaemonSet."""
    command = the(["kubectl", "-n", "kube-system", "patch", "daemonset", "kube-proxy"])
    patch = command[command.index("--patch-file") + 1]
    out = check(tool("kubectl"), "patch", "--local", "-f", str(KUBEADM_KUBE_PROXY),
                "--patch-file", patch, "-o", "json")  # fmt: skip
    obj: dict[str, Any] = json.loads(out)
    return obj


def label() -> tuple[str, str]:
    """The label step 3 sets on a node."""
    (setting,) = [c[-1] for c in commands() if c[:4] == ["kubectl", "label", "node", "$NODE"]
                  and "=" in c[-1]]  # fmt: skip
    key, _, value = setting.partition("=")
    return key, value


def matches(term: dict[str, Any], labels: dict[str, str]) -> bool:
    for expression in term.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values")
        present = key in labels
        ok = {
            "In": present and labels.get(key) in (values or []),
            "NotIn": not present or labels.get(key) not in (values or []),
            "Exists": present,
            "DoesNotExist": not present,
        }[operator]
        if not ok:
            return False
    return True


def schedules(spec: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether the scheduler may put a DaemonSet's pod on a node with these labels (its
    nodeSelector, and its required node affinity: any term, all expressions)."""
    if any(labels.get(k) != v for k, v in spec.get("nodeSelector", {}).items()):
        return False
    required = (
        spec.get("affinity", {})
        .get("nodeAffinity", {})
        .get("requiredDuringSchedulingIgnoredDuringExecution")
    )
    return required is None or any(matches(t, labels) for t in required["nodeSelectorTerms"])


def test_the_patch_applies_to_kubeadm_s_kube_proxy_and_validates():
    obj = patched_kube_proxy()
    validate(obj)
    containers = obj["spec"]["template"]["spec"]["containers"]
    assert containers[0]["image"] == "registry.k8s.io/kube-proxy:v1.36.2", "the rest is kept"


@pytest.mark.parametrize("overlay", ["kubeadm", "standalone"])
def test_a_node_runs_exactly_one_proxy_labelled_or_not(overlay):
    assert ["kubectl", "apply", "-k", "deploy/overlays/kubeadm"] in commands()
    kube_proxy = patched_kube_proxy()["spec"]["template"]["spec"]
    ipvsproxy = pod_spec(overlay)
    key, value = label()
    plain = {"kubernetes.io/os": "linux", "kubernetes.io/hostname": "worker-1"}
    moved = {**plain, key: value}
    assert schedules(ipvsproxy, moved)
    assert not schedules(kube_proxy, moved)
    assert schedules(kube_proxy, plain)
    assert not schedules(ipvsproxy, plain)
    # the way back removes that same label
    assert the(["kubectl", "label", "node", "$NODE", f"{key}-"])


def test_the_scheduling_check_can_tell():
    """Without the patch, kube-proxy would share a moved node with ipvsproxy."""
    unpatched = yaml.safe_load(KUBEADM_KUBE_PROXY.read_text())
    key, value = label()
    assert schedules(
        unpatched["spec"]["template"]["spec"], {"kubernetes.io/os": "linux", key: value}
    )


def test_the_node_commands_are_the_ones_the_vm_test_runs():
    execs = [c[c.index("--") + 1 :] for c in commands() if "--" in c and "ipvsproxy" in c]
    assert execs == [
        ["ipvsproxy", "cleanup", "--kube-proxy", "--dry-run"],
        ["ipvsproxy", "cleanup", "--kube-proxy"],
        ["ipvsproxy", "cleanup", "--keep-ipvs"],  # the way back from IPVS mode
        ["ipvsproxy", "cleanup"],  # ...from iptables and nftables modes
    ]
    test = (ROOT / "integration" / "ipvs" / "test_migration.py").read_text()
    assert "doc_commands()" in test, "the VM test reads them from docs/migration.md"


def test_readiness_is_awaited_on_the_new_pod_by_name():
    """Issue 38: `kubectl wait pod -l ... --field-selector` exited 1 (NotFound) on a pod of the
    previous proxy that was still terminating; the page waits on one pod, by name, found
    among those not being deleted, in both directions."""
    waits = [c for c in commands() if c[:4] == ["kubectl", "-n", "kube-system", "wait"]]
    ready = [c for c in waits if "--for=condition=Ready" in c]
    assert [c[4] for c in ready] == ["$POD", "$POD"]
    assert all("-l" not in c for c in ready)
    finds = [c for c in commands() if "get" in c and "go-template" in c]
    assert [c[c.index("-l") + 1] for c in finds] == [
        "app.kubernetes.io/name=ipvsproxy", "k8s-app=kube-proxy"]  # fmt: skip
    assert all(any("if not .metadata.deletionTimestamp" in w for w in c) for c in finds)


def test_the_debugger_pods_are_deleted_and_the_patch_rollout_awaited():
    debugs = [c for c in commands() if c[:2] == ["kubectl", "debug"]]
    assert len(debugs) == 4
    # the way back from iptables or nftables mode waits for kube-proxy's first sync before
    # ipvsproxy's table goes (on the real node a slow kube-proxy left 52 s unserved)
    waits = [i for i, c in enumerate(debugs) if "until" in " ".join(c)]
    (cleanup,) = [i for i, c in enumerate(debugs) if c[-2:] == ["ipvsproxy", "cleanup"]]
    assert waits
    assert waits[0] < cleanup
    assert "KUBE-SERVICES" in " ".join(debugs[waits[0]])
    assert "service-ips" in " ".join(debugs[waits[0]])
    assert ["kubectl", "delete", "$DEBUGGERS"] in commands()
    assert ["kubectl", "-n", "kube-system", "rollout", "status", "daemonset", "kube-proxy",
            "--timeout=15m"] in commands()  # fmt: skip


@pytest.mark.parametrize("block", blocks(), ids=lambda b: b.splitlines()[0])
def test_each_block_runs_as_written(block, tmp_path):
    """By bash, with kubectl recording what it is asked (a cluster is not here) and naming a
    pod where the page looks one up (by template: a proxy's; by name: a debugger)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "asked"
    shim = bin_dir / "kubectl"
    shim.write_text(
        f'#!/bin/sh\necho "$*" >> {log}\ncase "$*" in\n'
        "  *go-template*) echo pod/proxy-abcde ;;\n"
        '  *"-o name"*) echo pod/node-debugger-worker-1-abcde ;;\nesac\n'
    )
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    check("bash", "-euo", "pipefail", "-c", block, cwd=ROOT, env=env)
    asked = log.read_text().splitlines()
    assert len(asked) == len(commands(block)), asked
    assert all("$NODE" not in line and "$POD" not in line for line in asked), asked
    assert all("$DEBUGGERS" not in line for line in asked), asked
