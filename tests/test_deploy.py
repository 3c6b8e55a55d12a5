"""The deployment manifests, the container build file and the Vagrant cluster's files.

The manifests are checked against the `kubernetes` client's typed models (an unknown or
misspelt field does not survive the round trip), the RBAC rules against least privilege, and
the DaemonSet's flags against ipvsproxy's own command line. Vagrant, Ruby and ShellCheck come
from Debian's packages (scripts/bootstrap installs them as root); without them these tests
skip, except under CI=true.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from kubernetes.client import ApiClient

from ipvsproxy import agent
from ipvsproxy.cli import main

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
PROVISIONING = sorted((ROOT / "integration" / "vagrant").glob("*.sh"))


def objects() -> list[dict[str, Any]]:
    found = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        found += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def by_kind(kind: str) -> dict[str, Any]:
    (obj,) = [o for o in objects() if o["kind"] == kind]
    return obj


def model_name(obj: dict[str, Any]) -> str:
    version: str = obj["apiVersion"].rsplit("/", 1)[-1]
    return version.capitalize() + str(obj["kind"])


def test_there_is_a_manifest_for_every_object_a_deployment_needs():
    kinds = sorted(o["kind"] for o in objects())
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
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
    role = by_kind("ClusterRole")
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
    binding = by_kind("ClusterRoleBinding")
    account = by_kind("ServiceAccount")["metadata"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["name"], "namespace": account["namespace"]}
    ]


def pod_spec() -> dict[str, Any]:
    spec: dict[str, Any] = by_kind("DaemonSet")["spec"]["template"]["spec"]
    return spec


def test_daemonset_runs_on_every_node_with_host_network_and_few_capabilities():
    spec = pod_spec()
    assert spec["hostNetwork"] is True
    assert {"operator": "Exists"} in spec["tolerations"]
    assert spec["serviceAccountName"] == by_kind("ServiceAccount")["metadata"]["name"]
    (agent_container,) = spec["containers"]
    security = agent_container["securityContext"]
    assert security["privileged"] is False
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN", "NET_RAW"]}
    assert agent_container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert agent_container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    env = {e["name"]: e for e in agent_container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    (init,) = spec["initContainers"]
    assert init["args"][0] == "prepare"
    mounts = {m["mountPath"]: m for m in init["volumeMounts"]}
    assert mounts["/lib/modules"]["readOnly"] is True


def expand(args: list[str], env: list[dict[str, Any]]) -> list[str]:
    """$(VAR) as the kubelet expands it, from the ConfigMap (and a node name)."""
    data = by_kind("ConfigMap")["data"]
    values = {"NODE_NAME": "node-a"}
    for entry in env:
        ref = entry.get("valueFrom", {}).get("configMapKeyRef")
        if ref:
            values[entry["name"]] = data[ref["key"]]
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m[1]], arg) for arg in args]


def test_the_daemonsets_flags_are_valid_for_ipvsproxy_run(monkeypatch):
    (container,) = pod_spec()["containers"]
    args = expand(container["args"], container["env"])
    seen: dict[str, Any] = {}
    monkeypatch.setattr(agent, "run", lambda config, *, source: seen.update(c=config, s=source))
    result = CliRunner().invoke(main, args, env={"NODE_NAME": "node-a"})
    assert result.exit_code == 0, result.output
    config = seen["c"]
    assert config.node_name == "node-a"
    assert config.healthz_bind_address == ("0.0.0.0", 10256)
    assert str(config.service_cidrs[0]) == by_kind("ConfigMap")["data"]["service-cidr"]
    assert seen["s"] == agent.Cluster(None, None)  # in-cluster config


def test_the_init_containers_flags_are_valid_for_ipvsproxy_prepare(monkeypatch):
    (init,) = pod_spec()["initContainers"]
    args = expand(init["args"], init["env"])
    seen: dict[str, Any] = {}
    monkeypatch.setattr(agent, "prepare_host", lambda config: seen.setdefault("c", config) and [])
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert seen["c"].scheduler == by_kind("ConfigMap")["data"]["scheduler"]


def test_containerfile_installs_the_tools_on_a_slim_python_base():
    text = (ROOT / "Containerfile").read_text()
    assert re.search(r"^FROM python:3\.\d+-slim", text, re.M)
    for tool in ("iproute2", "ipset", "iptables", "ipvsadm", "conntrack"):
        assert re.search(rf"apt-get install [^\n]*\b{tool}\b", text), tool
    assert 'ENTRYPOINT ["ipvsproxy"]' in text


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (Debian package; scripts/bootstrap installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but a prerequisite is missing: {message}", pytrace=False)
        pytest.skip(message)
    return path


def check(*args: str) -> None:
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


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


def test_provisioning_scripts_pass_shellcheck_and_skip_kube_proxy():
    assert PROVISIONING
    check(tool("shellcheck"), *map(str, PROVISIONING))
    assert (
        "--skip-phases addon/kube-proxy"
        in (ROOT / "integration/vagrant/control-plane.sh").read_text()
    )


def test_the_projects_own_scripts_pass_shellcheck():
    shells = ("#!/usr/bin/env bash", "#!/bin/sh", "#!/bin/bash")
    scripts = [
        ROOT / ".ci/run",
        *(p for p in (ROOT / "scripts").iterdir() if p.read_text().startswith(shells)),
    ]
    check(tool("shellcheck"), "-x", *map(str, scripts))
