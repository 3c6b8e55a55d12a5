"""The DaemonSet's pod as a kubelet would run it, with podman: the test of the image runs the
containers of deploy/'s rendered DaemonSet with exactly its settings (host network, the
privileged init container, the agent's capabilities, read-only root filesystem, volumes,
environment from the ConfigMap, `$(VAR)` expansion of the arguments, the service account's
token), in the IPVS VM.

Container storage lives on a tmpfs of the guest (/run): the guest's root filesystem is the host's,
shared read-only over 9p, where overlay mounts do not work.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PODMAN = [
    "podman", "--root", "/run/podman-root", "--runroot", "/run/podman-run",
    "--storage-driver", "overlay", "--cgroup-manager", "cgroupfs", "--events-backend", "none",
]  # fmt: skip
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


def podman(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PODMAN, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def load(archive: Path) -> str:
    """Load an OCI archive (scripts/image's) into the guest's storage; the image's name."""
    done = podman("load", "--quiet", "--input", str(archive), timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().rpartition(" ")[2]


@dataclass
class Pod:
    """What a kubelet gives the pod's containers on this node."""

    spec: dict[str, Any]
    configmaps: dict[str, dict[str, str]]
    node_name: str
    api_host: str
    api_port: int
    token: str
    ca_pem: bytes
    namespace: str
    work: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pod-")))

    def _service_account(self) -> Path:
        directory = self.work / "serviceaccount"
        directory.mkdir(exist_ok=True)
        (directory / "token").write_text(self.token)
        (directory / "ca.crt").write_bytes(self.ca_pem)
        (directory / "namespace").write_text(self.namespace)
        return directory

    def _env(self, container: dict[str, Any]) -> dict[str, str]:
        # the kubelet's service links for the `kubernetes` Service come first; the pod's own
        # environment overrides them
        env = {"KUBERNETES_SERVICE_HOST": self.api_host,
               "KUBERNETES_SERVICE_PORT": str(self.api_port)}  # fmt: skip
        for var in container.get("env", []):
            source = var.get("valueFrom")
            if source is None:
                env[var["name"]] = expand(var.get("value", ""), env)
            elif "configMapKeyRef" in source:
                ref = source["configMapKeyRef"]
                env[var["name"]] = self.configmaps[ref["name"]][ref["key"]]
            elif source.get("fieldRef", {}).get("fieldPath") == "spec.nodeName":
                env[var["name"]] = self.node_name
            else:
                raise AssertionError(f"no kubelet here for env {var}")
        return env

    def _volumes(self, container: dict[str, Any]) -> list[str]:
        volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        args: list[str] = []
        for mount in container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            read_only = ":ro" if mount.get("readOnly") else ""
            if "hostPath" in volume:
                path = volume["hostPath"]["path"]
                if volume["hostPath"].get("type") == "FileOrCreate" and not Path(path).exists():
                    Path(path).touch()
                args += ["--volume", f"{path}:{mount['mountPath']}{read_only}"]
            elif "emptyDir" in volume:
                args += ["--tmpfs", mount["mountPath"]]
            elif "configMap" in volume:
                directory = self.work / mount["name"]
                directory.mkdir(exist_ok=True)
                for key, value in self.configmaps[volume["configMap"]["name"]].items():
                    (directory / key).write_text(value)
                args += ["--volume", f"{directory}:{mount['mountPath']}:ro"]
            else:
                raise AssertionError(f"no kubelet here for volume {volume}")
        return args

    def _security(self, container: dict[str, Any]) -> list[str]:
        context = container.get("securityContext", {})
        if context.get("privileged"):
            return ["--privileged"]
        args: list[str] = []
        capabilities = context.get("capabilities", {})
        for cap in capabilities.get("drop", []):
            args += ["--cap-drop", cap]
        for cap in capabilities.get("add", []):
            args += ["--cap-add", cap]
        if context.get("readOnlyRootFilesystem"):
            args.append("--read-only")
        if context.get("allowPrivilegeEscalation") is False:
            args += ["--security-opt", "no-new-privileges"]
        return args

    def podman_args(self, container: dict[str, Any]) -> list[str]:
        """`podman run` arguments for one of the pod's containers (without run itself)."""
        assert self.spec.get("hostNetwork") is True, "the agent runs in the host's network"
        env = self._env(container)
        args = ["--pull=never", "--network", "host", "--name", container["name"]]
        for name, value in env.items():
            args += ["--env", f"{name}={value}"]
        args += self._volumes(container) + self._security(container)
        if self.spec.get("serviceAccountName") and self.spec.get(
            "automountServiceAccountToken", True
        ):
            args += ["--volume", f"{self._service_account()}:{SERVICE_ACCOUNT}:ro"]
        args.append(container["image"])
        args += [expand(arg, env) for arg in container.get("args", [])]
        return args


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion of a container's arguments ($$ escapes)."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)
