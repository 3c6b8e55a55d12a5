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

from integration.docblocks import blocks as doc_blocks
from tests.test_deploy import KUBEADM_CONFIG, ROOT, check, pod_spec, tool, validate

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


def invocations(text: str) -> int:
    """How many times a block calls kubectl: in a pipe or a command substitution, a line may
    call it more than once (`commands` reads each line's first)."""
    joined = text.replace("\\\n", " ")
    return sum(line.split("#", 1)[0].count("kubectl ") for line in joined.splitlines())


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
        f'#!/bin/sh\nprintf "%s\\n" "$*" >> {log}\ncase "$*" in\n'
        "  *go-template*) echo pod/proxy-abcde ;;\n"
        '  *"-o name"*) echo pod/node-debugger-worker-1-abcde ;;\nesac\n'
    )
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    check("bash", "-euo", "pipefail", "-c", block, cwd=tmp_path, env=env)  # files it saves
    asked = log.read_text().splitlines()
    assert len(asked) == invocations(block), asked
    assert all("$NODE" not in line and "$POD" not in line for line in asked), asked
    assert all("$DEBUGGERS" not in line for line in asked), asked


# ---- step 4, the finish: the commands run on recorded objects ------------------------------

KUBEADM_CONFIG_CM = ROOT / "tests" / "data" / "kubeadm-config-configmap-v1.36.yaml"
COPY = "ipvsproxy-config"  # ipvsproxy's own copy of kubeadm's kube-proxy ConfigMap
# kubeconfig.conf as kubeadm's template writes it (phases/addons/proxy/manifests.go,
# KubeProxyConfigMap19), for a controlPlaneEndpoint of cp.example.com:6443
KUBECONFIG_CONF = """apiVersion: v1
kind: Config
clusters:
- cluster:
    certificate-authority: /var/run/secrets/kubernetes.io/serviceaccount/ca.crt
    server: https://cp.example.com:6443
  name: default
contexts:
- context:
    cluster: default
    namespace: default
    user: default
  name: default
current-context: default
users:
- name: default
  user:
    tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token"""


def finish() -> list[str]:
    return blocks_of("## 4.")


def blocks_of(section: str) -> list[str]:
    return doc_blocks(DOC.read_text(), section)


def line_of(block: str, start: str) -> str:
    """The command of `block` (continuations joined) that starts with `start`."""
    (found,) = [c for c in block.replace("\\\n", " ").splitlines() if c.startswith(start)]
    return found


def run_recorded(command: str, tmp_path, answers: dict[str, str]) -> str:
    """`command` by bash, with a kubectl that answers each `get` matching a key of `answers`
    with its text, runs `create ... --dry-run=client` for real (offline) and keeps what is
    piped to `apply -f -` or `replace -f -`, which it returns."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for i, text in enumerate(answers.values()):
        (tmp_path / f"answer-{i}").write_text(text)
    cases = "".join(
        f"  *{shlex.quote(pattern)}*) cat {tmp_path}/answer-{i} ;;\n"
        for i, pattern in enumerate(answers)
    )
    kept = tmp_path / "kept.yaml"
    shim = bin_dir / "kubectl"
    shim.write_text(
        f'#!/bin/sh\ncase "$*" in\n{cases}'
        f'  "create "*|"-n kube-system create configmap "*) exec {tool("kubectl")} "$@" ;;\n'
        f'  *"-f -") cat > {kept} ;;\n  *) exit 3 ;;\nesac\n'
    )
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "KUBECONFIG": "/nonexistent"}
    check("bash", "-euo", "pipefail", "-c", command, cwd=tmp_path, env=env)
    return kept.read_text() if kept.exists() else ""


def test_the_finish_disables_kubeadms_kube_proxy_addon_and_changes_nothing_else(tmp_path):
    """kubeadm's upgrades skip addon/kube-proxy only when ClusterConfiguration.proxy.disabled
    (cmd/phases/upgrade/addons.go); step 4.2 sets it in kubeadm-config as kubeadm wrote it."""
    (block,) = [b for b in finish() if "kubeadm-config" in b and "replace" in b]
    command = line_of(block, "kubectl -n kube-system get configmap kubeadm-config -o yaml")
    before = yaml.safe_load(KUBEADM_CONFIG_CM.read_text())
    kept = run_recorded(command, tmp_path, {"get configmap kubeadm-config -o yaml":
                                            KUBEADM_CONFIG_CM.read_text()})  # fmt: skip
    after = yaml.safe_load(kept)
    assert after["metadata"] == before["metadata"], "replace: the same object, same version"
    cluster = yaml.safe_load(after["data"]["ClusterConfiguration"])
    assert cluster["proxy"] == {"disabled": True}
    assert {**cluster, "proxy": {}} == yaml.safe_load(before["data"]["ClusterConfiguration"])


def test_the_finish_copies_kubeadms_configmap_to_the_one_the_end_state_mounts(tmp_path):
    (block,) = [b for b in finish() if f"create configmap {COPY}" in b]
    command = line_of(block, f"kubectl -n kube-system create configmap {COPY}")
    config_conf = KUBEADM_CONFIG.read_text()
    kept = run_recorded(command, tmp_path, {
        "get configmap kube-proxy -o jsonpath={.data.config\\.conf}": config_conf,
        "get configmap kube-proxy -o jsonpath={.data.kubeconfig\\.conf}": KUBECONFIG_CONF,
    })  # fmt: skip
    copy = yaml.safe_load(kept)
    validate(copy)
    assert copy["metadata"] == {"name": COPY, "namespace": "kube-system", "creationTimestamp": None}
    assert yaml.safe_load(copy["data"]["config.conf"]) == yaml.safe_load(config_conf)
    assert yaml.safe_load(copy["data"]["kubeconfig.conf"]) == yaml.safe_load(KUBECONFIG_CONF)
    # the end state mounts that copy where the kubeadm overlay mounts kubeadm's
    spec = pod_spec("kubeadm-all-nodes")
    (volume,) = [v for v in spec["volumes"] if v["name"] == "kube-proxy"]
    assert volume["configMap"]["name"] == COPY


def test_the_finish_goes_in_the_safe_order_and_the_end_state_runs_on_every_node():
    """Copy, apply the end state, wait for it, and only then delete kube-proxy's objects;
    the end state's DaemonSet schedules on a node without the label, kubeadm's DaemonSet
    (what an upgrade would write back) is disabled first."""
    order = [" ".join(c) for c in commands("".join(finish()))]

    def at(text: str) -> int:
        (found,) = [i for i, c in enumerate(order) if c.startswith(text)]
        return found

    disabled = at("kubectl -n kube-system get configmap kubeadm-config -o yaml")
    copied = at(f"kubectl -n kube-system create configmap {COPY}")
    applied = at("kubectl apply -k deploy/overlays/kubeadm-all-nodes")
    rolled = at("kubectl -n kube-system rollout status daemonset ipvsproxy")
    saved = at("kubectl -n kube-system get daemonset kube-proxy -o yaml")
    daemonset = at("kubectl -n kube-system delete daemonset kube-proxy")
    configmap = at("kubectl -n kube-system delete configmap kube-proxy")
    assert disabled < daemonset
    assert copied < applied < rolled < saved < daemonset < configmap
    assert schedules(pod_spec("kubeadm-all-nodes"), {"kubernetes.io/os": "linux"})


def test_the_way_back_after_the_finish_restores_kube_proxy_off_every_labelled_node(tmp_path):
    """The DaemonSet saved in 4.6 can be created again (no resourceVersion, no uid), keeps
    kube-proxy off the nodes that the way back labels, and the ConfigMap comes back from the
    copy under kubeadm's name."""
    (save,) = [b for b in finish() if "delete daemonset kube-proxy" in b]
    command = line_of(save, "kubectl -n kube-system get daemonset kube-proxy -o yaml")
    live = patched_kube_proxy()
    live["metadata"].update(resourceVersion="4711", uid="0b6d2d0e-9f3c-4c31-8f1e-5e7c9a0d1f22",
                            generation=3)  # fmt: skip
    run_recorded(command, tmp_path, {"get daemonset kube-proxy -o yaml": yaml.safe_dump(live)})
    file = re.search(r"> (\S+)", command)
    assert file
    saved = yaml.safe_load((tmp_path / file[1]).read_text())
    assert "resourceVersion" not in saved["metadata"]
    assert "uid" not in saved["metadata"]
    del live["metadata"]["resourceVersion"], live["metadata"]["uid"]
    assert saved == live
    (back,) = [b for b in finish() if "label nodes --all" in b]
    back_commands = commands(back)
    assert ["kubectl", "-n", "kube-system", "create", "-f", file[1]] in back_commands
    (labelling,) = [c for c in back_commands if c[:4] == ["kubectl", "label", "nodes", "--all"]]
    key, value = label()
    assert labelling[4] == f"{key}={value}"
    assert not schedules(saved["spec"]["template"]["spec"], {"kubernetes.io/os": "linux",
                                                             key: value})  # fmt: skip
    restore = line_of(back, "kubectl -n kube-system create configmap kube-proxy")
    kept = run_recorded(restore, tmp_path, {
        f"get configmap {COPY} -o jsonpath={{.data.config\\.conf}}": "mode: ipvs\n",
        f"get configmap {COPY} -o jsonpath={{.data.kubeconfig\\.conf}}": KUBECONFIG_CONF,
    })  # fmt: skip
    restored = yaml.safe_load(kept)
    assert restored["metadata"]["name"] == "kube-proxy"
    assert set(restored["data"]) == {"config.conf", "kubeconfig.conf"}
    assert ["kubectl", "apply", "-k", "deploy/overlays/kubeadm"] in back_commands
