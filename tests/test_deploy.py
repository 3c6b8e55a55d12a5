"""The deployment manifests, the container build file and the Vagrant cluster's files.

deploy/ is a kustomize base (deploy/base: its objects in objects/, which `kubectl apply -f`
takes as they are), two overlays (deploy/overlays/standalone, deploy/overlays/kubeadm), a
node-by-node component and deploy/monitoring. Each is rendered with `kubectl kustomize` and
every rendered object is validated offline against the Kubernetes v1.36 schemas
(`kubernetes-validate`, strict: an unknown or misspelt field fails); `kubectl apply -f`/`-k`
run with `--dry-run=client` against a discovery-only stub server (kubectl maps kinds through
the server's discovery even for a client-side dry run). The DaemonSets' arguments are parsed
by ipvsproxy's own command line (with kubeadm's and kubespray's config.conf for the kubeadm
overlay), and the shell blocks of docs/deployment.md's install sections and of docs/monitoring.md
("kube-prometheus-stack", "During a migration") are run as written.
The base objects are also checked against the `kubernetes` client's typed models and the RBAC
rules against least privilege. kubectl, Vagrant, Ruby and ShellCheck come from Debian's
packages or the build host (scripts/bootstrap installs them as root); without them these
tests skip, except under CI=true.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner
from kubernetes.client import ApiClient

from integration.docblocks import blocks
from ipvsproxy import agent
from ipvsproxy.cli import main
from ipvsproxy.config import Config

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
BASE_OBJECTS = DEPLOY / "base" / "objects"
KUSTOMIZATIONS = {
    "deploy": DEPLOY,  # the base again, for `kubectl apply -k deploy/`
    "base": DEPLOY / "base",
    "standalone": DEPLOY / "overlays" / "standalone",
    "kubeadm": DEPLOY / "overlays" / "kubeadm",
    "kubeadm-all-nodes": DEPLOY / "overlays" / "kubeadm-all-nodes",  # the migration's end
    "monitoring": DEPLOY / "monitoring",
}
AGENTS = ("deploy", "base", "standalone", "kubeadm", "kubeadm-all-nodes")  # with a DaemonSet
KUBEADM = ("kubeadm", "kubeadm-all-nodes")  # configured by a kubeadm kube-proxy ConfigMap
KUBERNETES = "1.36.0"  # the schemas kubernetes-validate ships closest to the tested API
CRD_KINDS = {"PodMonitor", "PrometheusRule"}  # the Prometheus Operator's: no core schema
IMAGE = "localhost/ipvsproxy:0.1.0"
NODE_LABEL = {"ipvsproxy.io/proxy": "ipvsproxy"}  # the overlays run on labelled nodes only
KUBEADM_CONFIG = (
    ROOT / "tests" / "data" / "kube-proxy-config" / "kubeadm-v1.36.2-init-defaults.yaml"
)
PROVISIONING = sorted((ROOT / "integration" / "vagrant").glob("*.sh"))


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (Debian package; scripts/bootstrap installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but a prerequisite is missing: {message}", pytrace=False)
        pytest.skip(message)
    return path


def check(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


# ---- the base's objects, as files -----------------------------------------------------------


def objects() -> list[dict[str, Any]]:
    found = []
    for path in sorted(BASE_OBJECTS.iterdir()):
        found += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def by_kind(
    kind: str, found: list[dict[str, Any]] | None = None, *, name: str | None = None
) -> dict[str, Any]:
    (obj,) = [
        o
        for o in (objects() if found is None else found)
        if o["kind"] == kind and name in (None, o["metadata"]["name"])
    ]
    return obj


def model_name(obj: dict[str, Any]) -> str:
    version: str = obj["apiVersion"].rsplit("/", 1)[-1]
    return version.capitalize() + str(obj["kind"])


def test_the_base_objects_directory_holds_only_kubernetes_objects():
    """So `kubectl apply -f deploy/base/objects/` works: kubectl reads every file of a
    directory as objects, a kustomization.yaml (or a dashboard's JSON) included."""
    for path in BASE_OBJECTS.iterdir():
        assert path.suffix == ".yaml", path
        for doc in yaml.safe_load_all(path.read_text()):
            assert {"apiVersion", "kind", "metadata"} <= set(doc), path


def test_the_base_kustomization_lists_exactly_the_objects_directory():
    """`kubectl apply -k deploy/base` and `-f deploy/base/objects/` apply the same objects."""
    kustomization = yaml.safe_load((DEPLOY / "base" / "kustomization.yaml").read_text())
    assert set(kustomization) == {"apiVersion", "kind", "resources"}
    files = {f"objects/{p.name}" for p in BASE_OBJECTS.iterdir()}
    assert sorted(kustomization["resources"]) == sorted(files)


def test_there_is_a_manifest_for_every_object_a_deployment_needs():
    kinds = sorted(o["kind"] for o in objects())
    assert kinds == [
        "ClusterRole",
        "ClusterRole",  # ipvsproxy:metrics-reader, for scrapers
        "ClusterRoleBinding",
        "ClusterRoleBinding",  # ipvsproxy:auth-delegator, for the secure metrics port
        "ConfigMap",
        "DaemonSet",
        "Namespace",
        "ServiceAccount",
    ]


@pytest.mark.parametrize("obj", objects(), ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_every_object_deserialises_into_the_typed_model_without_unknown_fields(obj):
    client = ApiClient()
    deserialize = getattr(client, "_ApiClient__deserialize")  # noqa: B009 (the client's decoder)
    typed = deserialize(obj, model_name(obj))
    assert type(typed).__name__ == model_name(obj)
    assert client.sanitize_for_serialization(typed) == obj


def test_rbac_grants_exactly_get_list_watch_on_services_endpointslices_nodes():
    role = by_kind("ClusterRole", name="ipvsproxy")
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted == {
        (group, resource, verb)
        for group, resource in [
            ("", "services"),
            ("", "nodes"),
            ("discovery.k8s.io", "endpointslices"),
        ]
        for verb in ("get", "list", "watch")
    }
    assert all(set(rule) == {"apiGroups", "resources", "verbs"} for rule in role["rules"])
    binding = by_kind("ClusterRoleBinding", name="ipvsproxy")
    account = by_kind("ServiceAccount")["metadata"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["name"], "namespace": account["namespace"]}
    ]


def test_rbac_lets_the_agent_review_tokens_and_scrapers_get_metrics_and_nothing_more():
    """The secure metrics port: the agent creates TokenReviews and SubjectAccessReviews
    (system:auth-delegator, built in); a scraper bound to ipvsproxy:metrics-reader may get
    /metrics and nothing else; the monitoring kustomization binds Prometheus to it."""
    account = by_kind("ServiceAccount")["metadata"]
    delegator = by_kind("ClusterRoleBinding", name="ipvsproxy:auth-delegator")
    assert delegator["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
        "name": "system:auth-delegator",
    }  # fmt: skip
    assert delegator["subjects"] == [
        {"kind": "ServiceAccount", "name": account["name"], "namespace": account["namespace"]}
    ]
    reader = by_kind("ClusterRole", name="ipvsproxy:metrics-reader")
    assert reader["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
    found = rendered("monitoring")
    binding = by_kind("ClusterRoleBinding", found)
    assert binding["roleRef"]["name"] == "ipvsproxy:metrics-reader"
    (scraper,) = binding["subjects"]
    token = by_kind("Secret", found)
    assert token["type"] == "kubernetes.io/service-account-token"
    assert (
        token["metadata"]["annotations"]["kubernetes.io/service-account.name"] == (scraper["name"])
    )
    assert token["metadata"]["namespace"] == scraper["namespace"] == "monitoring"


def test_the_configmap_has_no_api_server_address_to_forget():
    """No lab default: the agent refuses to start until the operator sets it."""
    assert by_kind("ConfigMap")["data"]["apiserver-host"] == ""


# ---- rendered with kustomize, validated against the schemas ---------------------------------


@functools.cache
def _render(name: str) -> tuple[dict[str, Any], ...]:
    text = check(tool("kubectl"), "kustomize", str(KUSTOMIZATIONS[name]))
    return tuple(doc for doc in yaml.safe_load_all(text) if doc)


def rendered(name: str) -> list[dict[str, Any]]:
    copy: list[dict[str, Any]] = json.loads(json.dumps(_render(name)))  # each test's own
    return copy


def pod_spec(name: str) -> dict[str, Any]:
    spec: dict[str, Any] = by_kind("DaemonSet", rendered(name))["spec"]["template"]["spec"]
    return spec


def validate(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, KUBERNETES, strict=True)


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_rendered_object_validates_against_the_kubernetes_schemas(name):
    found = rendered(name)
    assert found
    for obj in found:
        if obj["kind"] in CRD_KINDS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                validate(obj)  # not core: checked by the metric tests and by its shape below
            continue
        validate(obj)


def test_the_schema_validation_is_strict_enough_to_catch_a_misspelt_field():
    daemonset = by_kind("DaemonSet", rendered("base"))
    daemonset["spec"]["template"]["spec"]["hostNetwrok"] = True
    with pytest.raises(kubernetes_validate.ValidationError, match="hostNetwrok"):
        validate(daemonset)
    daemonset = by_kind("DaemonSet", rendered("base"))
    daemonset["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["timeoutSeconds"] = "5"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(daemonset)


@pytest.mark.parametrize("name", AGENTS)
def test_the_daemonset_runs_the_local_image_with_probe_timeouts_and_room_for_50k_services(name):
    spec = pod_spec(name)
    for container in spec["initContainers"] + spec["containers"]:
        assert container["image"] == IMAGE
        assert container["imagePullPolicy"] == "IfNotPresent"
    (agent_container,) = spec["containers"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert agent_container[probe]["timeoutSeconds"] >= 2, probe  # the kubelet's default: 1
    # 392 MiB RSS measured at 50,000 Services x 5 endpoints (docs/performance.md)
    limit = agent_container["resources"]["limits"]["memory"]
    assert limit.endswith("Gi")
    assert int(limit[:-2]) * 1024 >= 2 * 392


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_no_lab_or_private_addresses(name):
    text = json.dumps(rendered(name))
    allowed = {"127.0.0.1", "0.0.0.0", "10.96.0.0/12"}  # loopback, any, Kubernetes' default
    found = set(re.findall(r"\b\d{1,3}(?:\.\d{1,3}){3}(?:/\d+)?", text))
    assert found <= allowed, found - allowed


@pytest.mark.parametrize("name", AGENTS)
def test_daemonset_runs_with_host_network_and_few_capabilities(name):
    found = rendered(name)
    spec = pod_spec(name)
    assert spec["hostNetwork"] is True
    assert {"operator": "Exists"} in spec["tolerations"]
    assert spec["serviceAccountName"] == by_kind("ServiceAccount", found)["metadata"]["name"]
    (agent_container,) = spec["containers"]
    security = agent_container["securityContext"]
    assert security["privileged"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN", "NET_RAW"]}
    assert agent_container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert agent_container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    env = {e["name"]: e for e in agent_container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    (init,) = spec["initContainers"]
    assert init["args"][0] == "prepare"
    assert init["securityContext"] == {"privileged": True}
    mounts = {m["mountPath"]: m for m in init["volumeMounts"]}
    assert mounts["/lib/modules"]["readOnly"] is True
    account = by_kind("ServiceAccount", found)["metadata"]
    for binding in (o for o in found if o["kind"] == "ClusterRoleBinding"):
        assert binding["subjects"][0]["namespace"] == account["namespace"]


def test_the_base_runs_on_every_node_and_the_overlays_on_labelled_nodes():
    assert rendered("deploy") == rendered("base")
    assert pod_spec("base")["nodeSelector"] == {"kubernetes.io/os": "linux"}
    for overlay in ("standalone", "kubeadm"):
        assert pod_spec(overlay)["nodeSelector"] == {"kubernetes.io/os": "linux", **NODE_LABEL}


def test_standalone_has_its_own_namespace_and_configmap():
    found = rendered("standalone")
    assert by_kind("Namespace", found)["metadata"]["name"] == "ipvsproxy"
    assert by_kind("ConfigMap", found)["metadata"]["namespace"] == "ipvsproxy"
    assert {o["metadata"].get("namespace", "ipvsproxy") for o in found} == {"ipvsproxy"}


def test_kubeadm_reads_kubeadms_kube_proxy_configmap_and_configures_nothing_twice():
    found = rendered("kubeadm")
    assert "Namespace" not in {o["kind"] for o in found}
    assert "ConfigMap" not in {o["kind"] for o in found}  # kubeadm's kube-proxy is the one
    assert {o["metadata"]["namespace"] for o in found if o["kind"] not in ("ClusterRole",
            "ClusterRoleBinding")} == {"kube-system"}  # fmt: skip
    spec = pod_spec("kubeadm")
    (container,) = spec["containers"]
    assert container["args"] == [
        "run",
        "--config=/var/lib/kube-proxy/config.conf",
        "--metrics-bind-address=127.0.0.1:10249",  # whatever config.conf says
        "--secure-metrics-bind-address=0.0.0.0:10263",  # the PodMonitor's port
    ]
    assert [e["name"] for e in container["env"]] == ["NODE_NAME"]  # no flag from elsewhere
    assert spec["initContainers"][0]["args"] == [
        "prepare",
        "--config=/var/lib/kube-proxy/config.conf",
    ]
    assert "env" not in spec["initContainers"][0]
    init_mounts = {m["name"]: m for m in spec["initContainers"][0]["volumeMounts"]}
    assert init_mounts["kube-proxy"]["mountPath"] == "/var/lib/kube-proxy"
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["kube-proxy"] == {
        "name": "kube-proxy", "mountPath": "/var/lib/kube-proxy", "readOnly": True
    }  # fmt: skip
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["kube-proxy"]["configMap"] == {"name": "kube-proxy"}
    # kubeadm's config.conf names the kubeconfig this mount holds (kubeadm's manifests.go)
    config = yaml.safe_load(KUBEADM_CONFIG.read_text())
    assert config["clientConnection"]["kubeconfig"] == "/var/lib/kube-proxy/kubeconfig.conf"


def test_the_end_state_is_the_kubeadm_overlay_on_every_node_on_ipvsproxys_own_configmap():
    """deploy/overlays/kubeadm-all-nodes (docs/migration.md, step 4): no label or affinity
    limits its nodes, it mounts ipvsproxy's copy of kubeadm's ConfigMap where the kubeadm
    overlay mounts kubeadm's, and every other field of every object is the kubeadm overlay's."""
    end, kubeadm = rendered("kubeadm-all-nodes"), rendered("kubeadm")
    spec = pod_spec("kubeadm-all-nodes")
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert "affinity" not in spec
    assert {"operator": "Exists"} in spec["tolerations"]  # tainted nodes too
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["kube-proxy"]["configMap"] == {"name": "ipvsproxy-config"}
    assert "ConfigMap" not in {o["kind"] for o in end}  # the copy is the operator's object
    daemonset = by_kind("DaemonSet", kubeadm)
    template = daemonset["spec"]["template"]["spec"]
    del template["nodeSelector"]["ipvsproxy.io/proxy"]
    (volume,) = [v for v in template["volumes"] if v["name"] == "kube-proxy"]
    volume["configMap"]["name"] = "ipvsproxy-config"
    assert end == kubeadm


def test_the_monitoring_kustomization_ships_the_dashboard_for_grafanas_sidecar():
    found = rendered("monitoring")
    assert sorted(o["kind"] for o in found) == [
        "ClusterRoleBinding", "ConfigMap", "PodMonitor", "PrometheusRule", "Secret"
    ]  # fmt: skip
    dashboard = by_kind("ConfigMap", found)
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["metadata"]["name"] == "ipvsproxy-dashboard"  # no hash: no stale copies
    (text,) = dashboard["data"].values()
    assert json.loads(text) == json.loads(
        (DEPLOY / "monitoring/dashboards/ipvsproxy.json").read_text()
    )
    monitor = by_kind("PodMonitor", found)["spec"]
    assert monitor["selector"]["matchLabels"] == {"app.kubernetes.io/name": "ipvsproxy"}
    assert set(monitor["namespaceSelector"]["matchNames"]) == {"ipvsproxy", "kube-system"}
    (endpoint,) = monitor["podMetricsEndpoints"]
    ports = {p["name"] for p in pod_spec("base")["containers"][0]["ports"]}
    assert endpoint["port"] in ports
    # the secure port: HTTPS, the Prometheus ServiceAccount's token (scraper.yaml)
    assert endpoint["scheme"] == "https"
    assert endpoint["authorization"] == {
        "type": "Bearer", "credentials": {"name": "ipvsproxy-scraper-token", "key": "token"}
    }  # fmt: skip
    assert endpoint["tlsConfig"] == {"insecureSkipVerify": True}  # self-signed at each start
    # the job kube-prometheus' KubeProxyDown and the mixin's proxy dashboard select
    assert {"action": "replace", "targetLabel": "job", "replacement": "kube-proxy"} in endpoint[
        "relabelings"
    ]
    # --service-metrics' `namespace` (the Service's) is not replaced by the agent Pod's
    assert endpoint["honorLabels"] is True


# ---- the DaemonSets' arguments, parsed by ipvsproxy's command line -------------------------


def expand(args: list[str], env: list[dict[str, Any]], found: list[dict[str, Any]]) -> list[str]:
    """$(VAR) as the kubelet expands it, from the ConfigMap (and a node name)."""
    values = {"NODE_NAME": "node-a"}
    for entry in env:
        ref = entry.get("valueFrom", {}).get("configMapKeyRef")
        if ref:
            values[entry["name"]] = by_kind("ConfigMap", found)["data"][ref["key"]]
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m[1]], arg) for arg in args]


def run_as_the_daemonset(
    name: str, monkeypatch: pytest.MonkeyPatch, mounted: Path
) -> tuple[Config, agent.Source]:
    """The Config and source `ipvsproxy run` builds from the rendered DaemonSet's arguments,
    parsed by the real click command line, with `mounted` as the kubeadm overlay's
    config.conf (the file kubeadm's `kube-proxy` ConfigMap holds)."""
    found = rendered(name)
    (container,) = pod_spec(name)["containers"]
    args = expand(container["args"], container.get("env", []), found)
    args = [a.replace("/var/lib/kube-proxy/config.conf", str(mounted)) for a in args]
    node = {  # the downward API's, as the kubelet sets them: the Pod's node is node-a
        e["name"]: "node-a"
        for e in container.get("env", [])
        if e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "spec.nodeName"
    }
    seen: dict[str, Any] = {}
    monkeypatch.setattr(agent, "run", lambda config, *, source: seen.update(c=config, s=source))
    result = CliRunner().invoke(main, args, env=node)
    assert result.exit_code == 0, result.output
    return seen["c"], seen["s"]


@pytest.mark.parametrize("name", AGENTS)
def test_the_daemonsets_flags_are_valid_for_ipvsproxy_run(name, monkeypatch, tmp_path):
    """The real click command line parses the DaemonSet's arguments (a renamed or removed
    flag fails here); the kubeadm overlay's --config is kubeadm's own file, mounted."""
    found = rendered(name)
    mounted = tmp_path / "config.conf"
    shutil.copy(KUBEADM_CONFIG, mounted)
    config, source = run_as_the_daemonset(name, monkeypatch, mounted)
    assert config.node_name == "node-a"
    assert config.healthz_bind_address == ("0.0.0.0", 10256)
    if name in KUBEADM:  # kubeadm's kubeconfig.conf: its control-plane endpoint
        assert source == agent.Cluster(Path("/var/lib/kube-proxy/kubeconfig.conf"), None)
    else:
        data = by_kind("ConfigMap", found)["data"]
        assert str(config.service_cidrs[0]) == data["service-cidr"]
        assert source == agent.Cluster(None, None)  # in-cluster config
    assert config.metrics_bind_address == ("127.0.0.1", 10249)  # kube-proxy's: loopback only
    assert config.secure_metrics_bind_address == ("0.0.0.0", 10263)  # for the PodMonitor


# kubeadm's config.conf as kubeadm v1.36.2 writes it (metricsBindAddress "", which kube-proxy
# and ipvsproxy take as 127.0.0.1:10249), and with kubespray's default
# (roles/kubernetes/control-plane/defaults/main/kube-proxy.yml: kube_proxy_metrics_bind_address
# 127.0.0.1:10249, written into the ConfigMap by its kubeadm-config.v1beta4.yaml.j2)
METRICS_IN_CONFIG = {"kubeadm": "", "kubespray": "127.0.0.1:10249", "operator's": "0.0.0.0:9100"}


@pytest.mark.parametrize("name", AGENTS)
@pytest.mark.parametrize("in_file", METRICS_IN_CONFIG.values(), ids=list(METRICS_IN_CONFIG))
def test_every_agent_serves_metrics_where_the_podmonitor_scrapes(
    name, in_file, monkeypatch, tmp_path
):
    """The PodMonitor scrapes the Pod's IP (the node's: host network) at the container port
    named by its endpoint: the agent must bind that port (the secure one) on every address,
    whatever the kube-proxy ConfigMap's metricsBindAddress says, or nothing is scraped,
    IpvsproxyDown fires, and kube-prometheus' KubeProxyDown once kube-proxy is gone; and the
    plain port on the loopback only, whatever the file says (an operator's 0.0.0.0 too)."""
    config = yaml.safe_load(KUBEADM_CONFIG.read_text())
    config["metricsBindAddress"] = in_file
    mounted = tmp_path / "config.conf"
    mounted.write_text(yaml.safe_dump(config))
    agent_config, _ = run_as_the_daemonset(name, monkeypatch, mounted)
    (endpoint,) = by_kind("PodMonitor", rendered("monitoring"))["spec"]["podMetricsEndpoints"]
    (container,) = pod_spec(name)["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert agent_config.secure_metrics_bind_address == ("0.0.0.0", ports[endpoint["port"]])
    assert agent_config.metrics_bind_address == ("127.0.0.1", 10249)


# What kubespray writes into kubeadm's KubeProxyConfiguration with its defaults
# (kubernetes-sigs/kubespray 46dbdd39: roles/kubernetes/control-plane/templates/
# kubeadm-config.v1beta4.yaml.j2, the kube_proxy_* defaults of roles/kubernetes/control-plane/
# defaults/main/kube-proxy.yml and roles/kubespray_defaults/defaults/main/main.yml), over
# kubeadm's own file: kubeadm then fills clientConnection.kubeconfig, which kubespray leaves "".
# hostnameOverride is the first control plane's inventory name (kube_override_hostname), in the
# one ConfigMap every node reads.
KUBESPRAY_DEFAULTS: dict[str, Any] = {
    "bindAddress": "0.0.0.0",
    "clientConnection": {"acceptContentTypes": "", "burst": 10,
                         "contentType": "application/vnd.kubernetes.protobuf", "qps": 5},
    "clusterCIDR": "10.233.64.0/18",
    "configSyncPeriod": "15m0s",
    "conntrack": {"maxPerCore": 32768, "min": 131072, "tcpCloseWaitTimeout": "1h0m0s",
                  "tcpEstablishedTimeout": "24h0m0s"},
    "enableProfiling": False,
    "healthzBindAddress": "0.0.0.0:10256",
    "hostnameOverride": "node1",
    "iptables": {"masqueradeAll": False, "masqueradeBit": 14, "minSyncPeriod": "0s",
                 "syncPeriod": "30s"},
    "ipvs": {"excludeCIDRs": [], "minSyncPeriod": "0s", "scheduler": "rr", "syncPeriod": "30s",
             "strictARP": False, "tcpTimeout": "0s", "tcpFinTimeout": "0s", "udpTimeout": "0s"},
    "metricsBindAddress": "127.0.0.1:10249",
    "mode": "ipvs",
    "nodePortAddresses": [],
    "oomScoreAdj": -999,
    "portRange": "",
}  # fmt: skip


def test_the_kubeadm_overlay_runs_on_kubesprays_kube_proxy_configmap(monkeypatch, tmp_path):
    """kubespray's config.conf (its defaults) is read as it is, but for the metrics address
    (the overlay's flag) and the node's name (the Pod's, not the hostnameOverride kubespray
    wrote for its first control plane)."""
    config = yaml.safe_load(KUBEADM_CONFIG.read_text())
    for key, value in KUBESPRAY_DEFAULTS.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    mounted = tmp_path / "config.conf"
    mounted.write_text(yaml.safe_dump(config))
    agent_config, source = run_as_the_daemonset("kubeadm", monkeypatch, mounted)
    assert agent_config.node_name == "node-a"
    assert agent_config.metrics_bind_address == ("127.0.0.1", 10249)
    assert agent_config.secure_metrics_bind_address == ("0.0.0.0", 10263)
    assert agent_config.healthz_bind_address == ("0.0.0.0", 10256)
    assert str(agent_config.scheduler) == "rr"
    assert [str(c) for c in agent_config.cluster_cidrs] == ["10.233.64.0/18"]
    assert agent_config.sync_period == 30
    assert source == agent.Cluster(Path("/var/lib/kube-proxy/kubeconfig.conf"), None)


@pytest.mark.parametrize("name", AGENTS)
def test_the_init_containers_flags_are_valid_for_ipvsproxy_prepare(name, monkeypatch, tmp_path):
    """...and the kubeadm overlay's init container reads kubeadm's config.conf, as the agent:
    a scheduler set there is the module it loads."""
    found = rendered(name)
    (init,) = pod_spec(name)["initContainers"]
    args = expand(init["args"], init.get("env", []), found)
    mounted = tmp_path / "config.conf"
    config = yaml.safe_load(KUBEADM_CONFIG.read_text())
    config["ipvs"]["scheduler"] = "lc"
    mounted.write_text(yaml.safe_dump(config))
    args = [a.replace("/var/lib/kube-proxy/config.conf", str(mounted)) for a in args]
    seen: dict[str, Any] = {}
    monkeypatch.setattr(agent, "prepare_host", lambda config: seen.setdefault("c", config) and [])
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert seen["c"].scheduler == ("lc" if name in KUBEADM else "rr")


# ---- kubectl apply -f / -k, against a discovery-only server ---------------------------------

RESOURCES = {  # group/version -> (plural, kind, namespaced): what the manifests hold
    "v1": [
        ("namespaces", "Namespace", False),
        ("configmaps", "ConfigMap", True),
        ("serviceaccounts", "ServiceAccount", True),
        ("secrets", "Secret", True),
    ],
    "apps/v1": [("daemonsets", "DaemonSet", True)],
    "rbac.authorization.k8s.io/v1": [
        ("clusterroles", "ClusterRole", False),
        ("clusterrolebindings", "ClusterRoleBinding", False),
    ],
    "monitoring.coreos.com/v1": [
        ("podmonitors", "PodMonitor", True),
        ("prometheusrules", "PrometheusRule", True),
    ],
}


def _discovery(path: str) -> dict[str, Any] | None:
    """The legacy discovery documents kube-apiserver serves for RESOURCES."""
    groups = [gv for gv in RESOURCES if "/" in gv]
    if path == "/api":
        return {"kind": "APIVersions", "versions": ["v1"]}
    if path == "/apis":
        return {
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [
                {
                    "name": gv.split("/")[0],
                    "versions": [{"groupVersion": gv, "version": "v1"}],
                    "preferredVersion": {"groupVersion": gv, "version": "v1"},
                }
                for gv in groups
            ],
        }
    gv = path.removeprefix("/api/").removeprefix("/apis/")
    if gv not in RESOURCES:
        return None
    verbs = ["create", "get", "list", "patch"]
    resources = [
        {"name": n, "singularName": "", "namespaced": ns, "kind": k, "verbs": verbs}
        for n, k, ns in RESOURCES[gv]
    ]
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": gv,
        "resources": resources,
    }


class _Discovery(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        doc = _discovery(self.path.split("?")[0])
        code = 200 if doc else 404  # every object: not there yet (apply would create it)
        body = json.dumps(doc or {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                  "reason": "NotFound", "code": 404}).encode()  # fmt: skip
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def kubeconfig(tmp_path: Path) -> Iterator[Path]:
    """A kubeconfig for a server that only answers discovery (and 404 for any object)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Discovery)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    path = tmp_path / "kubeconfig"
    url = f"http://127.0.0.1:{server.server_address[1]}"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "stub",
        "clusters": [{"name": "stub", "cluster": {"server": url}}],
        "users": [{"name": "stub", "user": {}}],
        "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub"}}],
    }))  # fmt: skip
    yield path
    server.shutdown()
    server.server_close()


def dry_run(kubeconfig: Path, *args: str, cwd: Path = ROOT) -> str:
    """`kubectl apply ARGS` as a client-side dry run (no schema download: validated above)."""
    kubectl = tool("kubectl")
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    return check(kubectl, "apply", *args, "--dry-run=client", "--validate=false", cwd=cwd, env=env)


def test_kubectl_apply_f_takes_the_base_objects_directory(kubeconfig):
    out = dry_run(kubeconfig, "-f", "deploy/base/objects/")
    assert out.count("created (dry run)") == len(objects())


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_kubectl_apply_k_takes_each_kustomization(name, kubeconfig):
    out = dry_run(kubeconfig, "-k", str(KUSTOMIZATIONS[name].relative_to(ROOT)))
    assert out.count("created (dry run)") == len(rendered(name))


def test_vagrantfile_is_valid_ruby_and_valid_for_vagrant():
    check(tool("ruby"), "-c", "Vagrantfile")
    check(tool("vagrant"), "validate")


def test_vagrant_defaults_to_a_control_plane_and_two_workers_and_takes_a_count():
    text = (ROOT / "Vagrantfile").read_text()
    assert 'Integer(ENV.fetch("IPVSPROXY_WORKERS", "2"))' in text
    for provider in ("virtualbox", "libvirt"):
        assert f'config.vm.provider "{provider}"' in text
    for script in PROVISIONING:
        assert f"integration/vagrant/{script.name}" in text or script.stem in text


def test_provisioning_scripts_pass_shellcheck_and_install_kube_proxy_the_kubeadm_way():
    assert PROVISIONING
    check(tool("shellcheck"), *map(str, PROVISIONING))
    init = (ROOT / "integration/vagrant/control-plane.sh").read_text()
    assert "kubeadm init --config" in init
    assert "skip-phases" not in init  # kube-proxy is there first, as on the clusters that move
    assert "kind: KubeProxyConfiguration" in init


def test_the_vagrant_takeover_runs_the_migration_pages_own_commands():
    """takeover.sh runs migration.md's steps 1, 2 and 3 from the page (docblocks.py): the
    sections it names exist, each once, and hold the commands of the procedure; the
    Vagrantfile runs it once the last node is up."""
    script = (ROOT / "integration/vagrant/takeover.sh").read_text()
    sections = re.findall(r"doc '(## [^']+)'", script)
    assert sections == ["## 1.", "## 2.", "## 3."]
    text = (ROOT / "docs/migration.md").read_text()
    one, two, three = ("".join(blocks(text, s)) for s in sections)
    assert "kubectl -n kube-system patch daemonset kube-proxy" in one
    assert "kubectl apply -k deploy/overlays/kubeadm" in two
    assert re.search(r"^NODE=", three, flags=re.MULTILINE)  # the example node, replaced
    assert 'kubectl label node "$NODE" ipvsproxy.io/proxy=ipvsproxy' in three
    assert "ipvsproxy cleanup --kube-proxy" in three
    vagrantfile = (ROOT / "Vagrantfile").read_text()
    assert "trigger.after [:up, :provision]" in vagrantfile
    assert "/vagrant/integration/vagrant/takeover.sh" in vagrantfile


def test_the_projects_own_scripts_pass_shellcheck():
    shells = ("#!/usr/bin/env bash", "#!/bin/sh", "#!/bin/bash")
    scripts = [
        ROOT / ".ci/run",
        *(p for p in (ROOT / "scripts").iterdir() if p.read_text().startswith(shells)),
    ]
    check(tool("shellcheck"), "-x", *map(str, scripts))


# ---- docs/deployment.md's install commands, run as written ---------------------------------


def doc_blocks(page: str, heading: str) -> list[str]:
    """The shell blocks of the `## heading` section of docs/`page` (that heading exactly)."""
    return blocks((ROOT / "docs" / page).read_text(), f"## {heading}\n")


INSTALL_SECTIONS = ("Install", "Install on kubeadm", "kubespray")  # docs/deployment.md's


def install_blocks() -> list[str]:
    """The shell blocks of docs/deployment.md's install sections."""
    return [block for heading in INSTALL_SECTIONS for block in doc_blocks("deployment.md", heading)]


def test_the_install_sections_cover_every_kustomization_and_label_nodes():
    """Applying an overlay alone schedules nothing (a node runs ipvsproxy once labelled): the
    install commands label a node, and the kubeadm path keeps kube-proxy off it first."""
    commands = "\n".join(install_blocks())
    kubeadm = "\n".join(doc_blocks("deployment.md", "Install on kubeadm"))
    patch = kubeadm.index("--patch-file deploy/migration/kube-proxy-off-ipvsproxy-nodes.yaml")
    assert patch < kubeadm.index("kubectl apply -k deploy/overlays/kubeadm")
    (key, value), *_ = NODE_LABEL.items()
    assert kubeadm.index("kubectl apply -k") < kubeadm.index(
        f"kubectl label node worker-1 {key}={value}"
    )
    assert f"kubectl label node worker-1 {key}={value}" in "\n".join(
        doc_blocks("deployment.md", "Install")
    )
    assert "kubectl apply -k deploy/overlays/kubeadm" in commands
    assert "../deploy/overlays/standalone" in commands
    assert "kubectl apply -f deploy/base/objects/" in commands
    assert "kubectl apply -k deploy/monitoring" in commands


def run_block(block: str, kubeconfig: Path, tmp_path: Path) -> tuple[Path, list[str]]:
    """A doc's shell block in a copy of the tree, by bash, with `kubectl` a shim: `apply` is
    the real kubectl's as a client-side dry run against the discovery stub (so a kustomization
    that does not build, or an object kubectl cannot map, fails), anything else is recorded,
    not run. The copy's directory, and the commands recorded."""
    real = tool("kubectl")
    work = tmp_path / "checkout"
    shutil.copytree(DEPLOY, work / "deploy")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "not-run"
    shim = bin_dir / "kubectl"
    shim.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = apply ]; then exec {real} "$@" --dry-run=client --validate=false; fi\n'
        f'echo "$*" >> {log}\n'
    )
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "KUBECONFIG": str(kubeconfig)}
    out = check("bash", "-euo", "pipefail", "-c", block, cwd=work, env=env)
    assert "created (dry run)" in out
    return work, log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("block", install_blocks(), ids=lambda b: b.splitlines()[0])
def test_the_install_commands_work_as_written(block, kubeconfig, tmp_path):
    """Each block run by `run_block` (what is not `apply` only recorded: rollout status, get,
    node labels, the patch that keeps kube-proxy off labelled nodes, whose file must be there);
    the overlays the block writes are rendered and validated too."""
    real = tool("kubectl")
    work, not_run = run_block(block, kubeconfig, tmp_path)
    for line in not_run:
        words = line.split()
        if words[:2] == ["label", "node"]:
            assert words[3:] == ["ipvsproxy.io/proxy=ipvsproxy"], line
        elif words[2:6] == ["patch", "daemonset", "kube-proxy", "--patch-file"]:
            assert (work / words[6]).is_file(), line
        else:
            assert words[0] == "-n", line
            assert words[2] in ("rollout", "get"), line
    for written in work.glob("my-*"):  # the operator's own overlays
        found = [doc for doc in yaml.safe_load_all(check(real, "kustomize", str(written))) if doc]
        for obj in found:
            validate(obj)
            for container in (
                obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
            ):
                assert container["image"] == "registry.example.com/ipvsproxy:0.1.0"
        if "standalone" in (written / "kustomization.yaml").read_text():
            assert by_kind("ConfigMap", found)["data"]["apiserver-host"] == "192.0.2.10"


def test_kube_prometheus_stacks_release_label_reaches_the_podmonitor_and_the_rules(
    kubeconfig, tmp_path
):
    """docs/monitoring.md's overlay for kube-prometheus-stack, run as written: both objects
    its Prometheus selects by `release` carry the label, and nothing else changes (the
    PodMonitor's Pod selector, its endpoint with honorLabels, the rules)."""
    (block,) = doc_blocks("monitoring.md", "kube-prometheus-stack")
    work, not_run = run_block(block, kubeconfig, tmp_path)
    assert not_run == []
    found = [
        doc
        for doc in yaml.safe_load_all(
            check(tool("kubectl"), "kustomize", str(work / "my-ipvsproxy-monitoring"))
        )
        if doc
    ]
    shipped = {o["kind"]: o for o in rendered("monitoring")}
    for kind in ("PodMonitor", "PrometheusRule"):
        obj = by_kind(kind, found)
        assert obj["metadata"]["labels"] == {
            **shipped[kind]["metadata"]["labels"],
            "release": "kube-prometheus-stack",
        }
        assert obj["spec"] == shipped[kind]["spec"]
    assert by_kind("PodMonitor", found)["spec"]["podMetricsEndpoints"][0]["honorLabels"] is True


def test_the_migration_watch_commands_run_as_written(tmp_path):
    """docs/monitoring.md's "During a migration" block, by bash with kubectl recording (it
    answers the pod lookup): it runs on the kubeadm overlay's Pods, and the commands it runs
    in the agent's container exist there."""
    (block,) = doc_blocks("monitoring.md", "During a migration")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "asked"
    shim = bin_dir / "kubectl"
    shim.write_text(f'#!/bin/sh\necho "$*" >> {log}\necho pod/ipvsproxy-abcde\n')
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    check("bash", "-euo", "pipefail", "-c", block, env=env)
    asked = log.read_text().splitlines()
    assert asked[0].startswith("-n kube-system get pod -l app.kubernetes.io/name=ipvsproxy ")
    assert "spec.nodeName=worker-1" in asked[0]
    execs = [line.split(" -- ", 1)[1].split() for line in asked[1:]]
    assert all(line.startswith("-n kube-system exec pod/ipvsproxy-abcde --") for line in asked[1:])
    assert execs == [["ipvsproxy", "status"], ["ipvsadm", "-Ln"]]
    labels = by_kind("DaemonSet", rendered("kubeadm"))["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "ipvsproxy"
    assert CliRunner().invoke(main, ["status", "--help"]).exit_code == 0
