"""ipvsproxy.kubeclient: the simple kubeconfig read as the library reads it, the rest delegated,
and the `kubernetes` package imported without the parts the agent does not use."""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipvsproxy.errors import ConfigError
from ipvsproxy.kubeclient import client

CA = b"-----BEGIN CERTIFICATE-----\nca\n-----END CERTIFICATE-----\n"
CERT = b"-----BEGIN CERTIFICATE-----\nclient\n-----END CERTIFICATE-----\n"
KEY = b"-----BEGIN PRIVATE KEY-----\nkey\n-----END PRIVATE KEY-----\n"
FIELDS = ("host", "verify_ssl", "tls_server_name", "proxy")
FILES = ("ssl_ca_cert", "cert_file", "key_file")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def library(path: Path, context: str | None = None) -> Any:
    from kubernetes.client import Configuration
    from kubernetes.config.kube_config import load_kube_config

    configuration = Configuration()
    load_kube_config(config_file=str(path), context=context, client_configuration=configuration)
    return configuration


def ours(path: Path, context: str | None = None) -> Any:
    api = client(kubeconfig=path, context=context)
    try:
        return api.configuration
    finally:
        api.close()


def seen(configuration: Any) -> dict[str, Any]:
    """What the client sends and trusts: fields, and the files' contents (not their names)."""
    out = {key: getattr(configuration, key) for key in FIELDS}
    out["api_key"] = dict(configuration.api_key)
    for key in FILES:
        name = getattr(configuration, key)
        out[key] = Path(name).read_bytes() if name else None
    return out


def kubeconfig(
    cluster: dict[str, Any],
    user: dict[str, Any] | None,
    *,
    context: str = "main",
    extra_contexts: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster}],
        "contexts": [{"name": "main", "context": {"cluster": "c", "user": "u"}}]
        + (extra_contexts or []),
        "current-context": context,
    }
    if user is not None:
        doc["users"] = [{"name": "u", "user": user}]
    return doc


@pytest.fixture
def files(tmp_path: Path) -> Path:
    """A kubeconfig directory with its relative files."""
    (tmp_path / "pki").mkdir()
    (tmp_path / "pki" / "ca.crt").write_bytes(CA)
    (tmp_path / "pki" / "client.crt").write_bytes(CERT)
    (tmp_path / "pki" / "client.key").write_bytes(KEY)
    (tmp_path / "token").write_text("from-file")
    return tmp_path


CASES = {
    "token and CA data (the test API server's)": kubeconfig(
        {"server": "https://10.0.0.1:6443", "certificate-authority-data": b64(CA)},
        {"token": "abc"},
    ),
    "kubeadm: client certificate data": kubeconfig(
        {"server": "https://10.0.0.1:6443/", "certificate-authority-data": b64(CA)},
        {"client-certificate-data": b64(CERT), "client-key-data": b64(KEY)},
    ),
    "relative files and a token file": kubeconfig(
        {"server": "https://api.example:443", "certificate-authority": "pki/ca.crt"},
        {
            "tokenFile": "token",
            "client-certificate": "pki/client.crt",
            "client-key": "./pki/client.key",
        },
    ),
    "user and password, no TLS verification, server name, proxy": kubeconfig(
        {
            "server": "https://10.0.0.1",
            "insecure-skip-tls-verify": True,
            "tls-server-name": "kubernetes",
            "proxy-url": "http://proxy:3128",
        },
        {"username": "admin", "password": "s3cret"},
    ),
    "plain http: no certificates read": kubeconfig(
        {"server": "http://127.0.0.1:8080", "certificate-authority": "missing.crt"},
        {"token": "t", "client-certificate": "missing.crt"},
    ),
    "an empty token: user and password": kubeconfig(
        {"server": "https://h"}, {"token": "", "username": "a", "password": "b"}
    ),
    "no users section": kubeconfig({"server": "https://h"}, None),
    "the context's user is not listed": kubeconfig(
        {"server": "https://h"},
        {"token": "x"},
        context="other",
        extra_contexts=[{"name": "other", "context": {"cluster": "c", "user": "nobody"}}],
    ),  # fmt: skip
    "empty data fields": kubeconfig(
        {"server": "https://h", "certificate-authority-data": ""},
        {"client-certificate-data": "", "client-key-data": ""},
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_a_simple_kubeconfig_configures_the_client_as_the_library_does(
    files: Path, name: str
) -> None:
    path = files / "kubeconfig"
    path.write_text(json.dumps(CASES[name]))
    assert seen(ours(path)) == seen(library(path))


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    scheme=st.sampled_from(["https", "http"]),
    slash=st.booleans(),
    ca=st.sampled_from([None, "data", "file"]),
    cert=st.sampled_from([None, "data", "file"]),
    token=st.sampled_from([None, "", "tok"]),
    token_file=st.booleans(),
    basic=st.booleans(),
    insecure=st.sampled_from([None, True, False]),
    server_name=st.booleans(),
    proxy=st.booleans(),
    with_user=st.booleans(),
)
def test_any_simple_kubeconfig_configures_the_client_as_the_library_does(
    files: Path, **choice: Any
) -> None:
    cluster = random_cluster(files, choice)
    user: dict[str, Any] = {}
    if choice["cert"] == "data":
        user |= {"client-certificate-data": b64(CERT), "client-key-data": b64(KEY)}
    elif choice["cert"] == "file":
        user |= {"client-certificate": "pki/client.crt", "client-key": "pki/client.key"}
    if choice["token"] is not None:
        user["token"] = choice["token"]
    if choice["token_file"]:
        user["tokenFile"] = "token"
    if choice["basic"]:
        user |= {"username": "u", "password": "p"}
    path = files / "kubeconfig"
    path.write_text(json.dumps(kubeconfig(cluster, user if choice["with_user"] else None)))
    assert seen(ours(path)) == seen(library(path))


def random_cluster(files: Path, choice: dict[str, Any]) -> dict[str, Any]:
    cluster: dict[str, Any] = {"server": f"{choice['scheme']}://h:6443" + "/" * choice["slash"]}
    if choice["ca"] == "data":
        cluster["certificate-authority-data"] = b64(CA)
    elif choice["ca"] == "file":
        cluster["certificate-authority"] = str(files / "pki" / "ca.crt")  # absolute
    if choice["insecure"] is not None:
        cluster["insecure-skip-tls-verify"] = choice["insecure"]
    if choice["server_name"]:
        cluster["tls-server-name"] = "kubernetes.default"
    if choice["proxy"]:
        cluster["proxy-url"] = "http://proxy:3128"
    return cluster


def test_a_token_file_is_read_without_its_trailing_newline(files: Path) -> None:
    """As kubectl (client-go trims it); the library would send "Bearer tok\\n"."""
    (files / "token").write_text("tok\n")
    path = files / "kubeconfig"
    path.write_text(json.dumps(kubeconfig({"server": "https://h"}, {"tokenFile": "token"})))
    assert ours(path).api_key == {"BearerToken": "Bearer tok"}


def test_certificate_data_is_written_to_private_files_removed_at_exit(tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    doc = kubeconfig(
        {"server": "https://h", "certificate-authority-data": b64(CA)},
        {"client-certificate-data": b64(CERT), "client-key-data": b64(KEY)},
    )
    path.write_text(json.dumps(doc))
    code = (
        "import sys; from pathlib import Path; from ipvsproxy.kubeclient import client\n"
        f"c = client(kubeconfig=Path({str(path)!r}), context=None).configuration\n"
        "print(c.ssl_ca_cert, c.cert_file, c.key_file)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    names = run.stdout.split()
    assert len(names) == 3
    assert not any(Path(name).exists() for name in names)  # removed when the process ended
    configuration = ours(path)
    key = Path(configuration.key_file)
    assert key.read_bytes() == KEY
    assert stat.S_IMODE(key.stat().st_mode) == 0o600


def test_an_exec_plugin_is_left_to_the_library(tmp_path: Path) -> None:
    """The library runs the plugin: its token is the one sent."""
    credential = {
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "kind": "ExecCredential",
        "status": {"token": "from-exec"},
    }
    plugin = tmp_path / "plugin"
    plugin.write_text(f"#!/bin/sh\necho '{json.dumps(credential)}'\n")
    plugin.chmod(0o755)
    user = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1beta1",
            "command": str(plugin),
            "interactiveMode": "Never",
        }
    }
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(kubeconfig({"server": "https://h"}, user)))
    assert ours(path).api_key["BearerToken"] == "Bearer from-exec"


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        ({"clusters": [], "contexts": []}, "current-context"),
        (kubeconfig({"server": "https://h"}, {"token": "t"}, context="nope"), "name nope"),
        (kubeconfig({"server": "https://h", "certificate-authority": "gone.crt"}, {}), "gone.crt"),
        ([1, 2], "list indices"),  # the library's own words, as before
    ],
)
def test_a_bad_kubeconfig_is_one_error_in_the_librarys_words(
    tmp_path: Path, doc: Any, words: str
) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="cannot load the Kubernetes client configuration") as e:
        ours(path)
    assert words in str(e.value)


def test_the_agent_imports_no_oauth_pydantic_websocket_or_dynamic_client() -> None:
    """The deferred package __init__s: what importing the API source costs at start-up."""
    code = (
        "import sys, ipvsproxy.kube\n"
        "heavy = ['oauthlib', 'requests_oauthlib', 'requests', 'websocket', 'pydantic',\n"
        "         'dateutil', 'kubernetes.client.api_client',\n"
        "         'kubernetes.utils.create_from_yaml',\n"
        "         'kubernetes.config.kube_config', 'kubernetes.stream', 'kubernetes.dynamic',\n"
        "         'kubernetes.leaderelection', 'kubernetes.informer']\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "from kubernetes import config\n"  # anybody else still gets the whole package
        "import kubernetes\n"
        "print(callable(config.load_kube_config), kubernetes.__version__ > '0',\n"
        "      callable(kubernetes.watch.Watch), 'oauthlib' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert run.stdout.splitlines() == ["[]", "True True True True"]


def test_in_cluster_the_service_account_token_is_sent_and_its_rotation_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DaemonSet's path: the library's in-cluster loader, our GETs (its refresh hook runs
    before each request; the kubelet rotates the projected token file)."""
    import datetime

    from kubernetes.config import incluster_config

    from tests.kubeapi import ApiServer

    api = ApiServer(token="first").start()
    try:
        (tmp_path / "token").write_text("first")
        (tmp_path / "ca.crt").write_bytes(api._ca.cert_pem.bytes())
        monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "token"))
        monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(tmp_path / "ca.crt"))
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(api.port))
        with client(kubeconfig=None, context=None) as api_client:
            first = api_client.get("/api/v1/services", [("limit", 5), ("watch", False)])
            assert first.status == 200
            # rotated; the loader re-reads the file once its minute is over
            (tmp_path / "token").write_text("second")
            api.token = "second"

            class Later(datetime.datetime):
                @classmethod
                def now(cls, tz: Any = None) -> Any:  # noqa: ANN401
                    return datetime.datetime.now(tz) + datetime.timedelta(minutes=2)

            fake = type("datetime_module", (), {"datetime": Later, "timedelta": datetime.timedelta})
            monkeypatch.setattr(incluster_config, "datetime", fake)
            second = api_client.get("/api/v1/services", [])
            assert second.status == 200
        assert [(path, ok) for path, ok, _ in api.requests] == [
            ("/api/v1/services", "ok"),
            ("/api/v1/services", "ok"),
        ]
        assert api.requests[0][2] == {"limit": "5", "watch": "false"}
    finally:
        api.stop()


def test_threads_reading_the_deferred_packages_at_once_all_get_their_names() -> None:
    code = (
        "import sys, threading, ipvsproxy.kubeclient\n"
        "import kubernetes\n"
        "barrier, got = threading.Barrier(8), []\n"
        "def read(i):\n"
        "    barrier.wait()\n"
        "    if i % 2:\n"
        "        got.append(callable(kubernetes.config.load_kube_config))\n"
        "    else:\n"
        "        got.append(kubernetes.__version__ > '0')\n"
        "        got.append(callable(kubernetes.utils.parse_quantity))\n"
        "threads = [threading.Thread(target=read, args=(i,)) for i in range(8)]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "print(got.count(True))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert (run.returncode, run.stdout.strip(), run.stderr) == (0, "12", "")
