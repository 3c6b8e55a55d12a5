"""ipvsproxy.kubeclient: what each kind of kubeconfig, and the in-cluster config, makes the
client send, against the test API server; bad input as one `ConfigError` line."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme
import urllib3
from kubernetes.config import incluster_config, kube_config

from ipvsproxy import kubeclient
from ipvsproxy.errors import ConfigError
from ipvsproxy.kubeclient import Deadline, client
from tests.kubeapi import ApiServer
from tests.support import connecting, eventually, never_resolving


@pytest.fixture(scope="module")
def server() -> Iterator[ApiServer]:
    api = ApiServer().start()
    yield api
    api.stop()


@pytest.fixture
def not_in_cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No service account, and the default kubeconfig location empty."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "default"))


def write(path: Path, doc: Any) -> Path:
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def kubeconfig(server: ApiServer, tmp_path: Path, **user: Any) -> dict[str, Any]:
    """The test server's kubeconfig, its user replaced by `user` if given."""
    doc: dict[str, Any] = json.loads(server.write_kubeconfig(tmp_path / "server").read_text())
    if user:
        doc["users"][0]["user"] = user
    return doc


def ca_pem(doc: dict[str, Any]) -> bytes:
    return base64.b64decode(doc["clusters"][0]["cluster"]["certificate-authority-data"])


def get(path: Path | None, context: str | None = None) -> int:
    """The status of one GET through `client()`."""
    with client(kubeconfig=path, context=context) as api:
        response = api.get("/api/v1/services", [("limit", 5), ("watch", False)])
        response.read()
        return int(response.status)


def test_a_token_is_sent(server: ApiServer, tmp_path: Path) -> None:
    assert get(write(tmp_path / "kc", kubeconfig(server, tmp_path))) == 200
    assert server.requests[-1] == ("/api/v1/services", "ok", {"limit": "5", "watch": "false"})


def test_a_token_file_is_read_relative_to_the_kubeconfig_without_its_newline(
    server: ApiServer, tmp_path: Path
) -> None:
    """As kubectl (client-go trims it); the library keeps the newline, no header may hold it."""
    (tmp_path / "token").write_text(server.token + "\n")
    assert get(write(tmp_path / "kc", kubeconfig(server, tmp_path, tokenFile="token"))) == 200


def test_the_context_chooses_cluster_and_user(server: ApiServer, tmp_path: Path) -> None:
    doc = kubeconfig(server, tmp_path)
    doc["users"].append({"name": "stranger", "user": {"token": "wrong"}})
    doc["contexts"].append({"name": "other", "context": {"cluster": "test", "user": "stranger"}})
    doc["current-context"] = "other"
    path = write(tmp_path / "kc", doc)
    assert get(path) == 401
    assert get(path, context="test") == 200


def test_the_ca_is_trusted_from_a_file_and_needed(server: ApiServer, tmp_path: Path) -> None:
    doc = kubeconfig(server, tmp_path)
    (tmp_path / "pki").mkdir()
    (tmp_path / "pki" / "ca.crt").write_bytes(ca_pem(doc))
    cluster = doc["clusters"][0]["cluster"]
    del cluster["certificate-authority-data"]
    with pytest.raises(urllib3.exceptions.MaxRetryError, match="CERTIFICATE_VERIFY_FAILED"):
        get(write(tmp_path / "no-ca", doc))
    cluster["certificate-authority"] = "pki/ca.crt"
    assert get(write(tmp_path / "kc", doc)) == 200


def test_the_tls_server_name_is_checked_instead_of_the_address(
    server: ApiServer, tmp_path: Path
) -> None:
    doc = kubeconfig(server, tmp_path)
    doc["clusters"][0]["cluster"]["tls-server-name"] = "localhost"  # in the server's cert
    assert get(write(tmp_path / "kc", doc)) == 200
    doc["clusters"][0]["cluster"]["tls-server-name"] = "kubernetes.default"  # not in it
    with pytest.raises(urllib3.exceptions.MaxRetryError, match="CERTIFICATE_VERIFY_FAILED"):
        get(write(tmp_path / "kc", doc))


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_insecure_skip_tls_verify_needs_no_ca(server: ApiServer, tmp_path: Path) -> None:
    doc = kubeconfig(server, tmp_path)
    cluster = doc["clusters"][0]["cluster"]
    del cluster["certificate-authority-data"]
    cluster["insecure-skip-tls-verify"] = True
    assert get(write(tmp_path / "kc", doc)) == 200


def test_a_client_certificate_is_presented(server: ApiServer, tmp_path: Path) -> None:
    """The TLS handshake uses it (the test server authenticates tokens only: 401)."""
    issued = trustme.CA().issue_cert("node-a.example")
    cert = b"".join(blob.bytes() for blob in issued.cert_chain_pems)
    key = issued.private_key_pem.bytes()
    user = {
        "client-certificate-data": base64.b64encode(cert).decode(),
        "client-key-data": base64.b64encode(key).decode(),
    }
    path = write(tmp_path / "kc", kubeconfig(server, tmp_path, **user))
    with client(kubeconfig=path, context=None) as api:
        assert Path(api.configuration.cert_file).read_bytes() == cert
        assert Path(api.configuration.key_file).read_bytes() == key
        assert stat.S_IMODE(Path(api.configuration.key_file).stat().st_mode) == 0o600
    assert get(path) == 401
    (tmp_path / "client.crt").write_bytes(key)  # a key where the certificate should be
    (tmp_path / "client.key").write_bytes(key)
    user = {"client-certificate": "client.crt", "client-key": "client.key"}
    with pytest.raises(urllib3.exceptions.MaxRetryError, match="SSL"):
        get(write(tmp_path / "kc", kubeconfig(server, tmp_path, **user)))


def client_pems() -> tuple[bytes, bytes]:
    issued = trustme.CA().issue_cert("node-a.example")
    return b"".join(b.bytes() for b in issued.cert_chain_pems), issued.private_key_pem.bytes()


def holding(directory: Path, secret: bytes) -> list[Path]:
    """The files under `directory` whose content includes `secret`."""
    found = []
    for path in directory.rglob("*"):
        with contextlib.suppress(OSError):
            if path.is_file() and secret in path.read_bytes():
                found.append(path)
    return found


def recent_tmp_files_holding(secret: bytes, since: float) -> list[Path]:
    """Files directly in /tmp, made since `since`, holding `secret` (the library's default)."""
    found = []
    for path in Path("/tmp").iterdir():
        with contextlib.suppress(OSError):
            info = path.stat()
            recent = stat.S_ISREG(info.st_mode) and info.st_mtime >= since
            if recent and info.st_size < 1 << 20 and secret in path.read_bytes():
                found.append(path)
    return found


def test_key_material_from_the_kubeconfig_never_lands_in_a_file_even_after_kill_9(
    server: ApiServer, tmp_path: Path
) -> None:
    """Issue 28: the library wrote client-key-data to a temp file, removed only at a clean
    exit; after `kill -9` the private key stayed in /tmp. Now it lives in memory (memfd)."""
    cert, key = client_pems()
    data = {
        "client-certificate-data": base64.b64encode(cert).decode(),
        "client-key-data": base64.b64encode(key).decode(),
    }
    path = write(tmp_path / "kc", kubeconfig(server, tmp_path, **data))
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    code = (
        "import time; from pathlib import Path; from ipvsproxy.kubeclient import client\n"
        f"c = client(kubeconfig=Path({str(path)!r}), context=None).configuration\n"
        "print(c.key_file, Path(c.key_file).read_bytes().count(b'PRIVATE KEY'), flush=True)\n"
        "time.sleep(60)\n"
    )
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONPATH": os.pathsep.join(sys.path)}
    since = time.time() - 1
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env) as proc:
        try:
            assert proc.stdout is not None
            key_file, marks = proc.stdout.readline().split()
            assert int(marks) >= 2  # loaded: the key is readable through its path
            assert key_file.startswith(b"/proc/self/fd/")
            assert holding(tmpdir, key) == []
            assert recent_tmp_files_holding(key, since) == []
        finally:
            proc.send_signal(signal.SIGKILL)
    assert holding(tmpdir, key) == []
    assert recent_tmp_files_holding(key, since) == []
    assert list(tmpdir.iterdir()) == []


def test_key_material_from_an_exec_plugin_never_lands_in_a_file(
    server: ApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = client_pems()
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    credential = {
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "kind": "ExecCredential",
        "status": {"clientCertificateData": cert.decode(), "clientKeyData": key.decode()},
    }
    answer = write(tmp_path / "credential.json", credential)
    plugin = tmp_path / "plugin"
    plugin.write_text(f"#!/bin/sh\ncat {answer}\n")
    plugin.chmod(0o755)
    exec_ = {
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "command": str(plugin),
        "interactiveMode": "Never",
    }
    path = write(tmp_path / "kc", kubeconfig(server, tmp_path, exec=exec_))
    with client(kubeconfig=path, context=None) as api:
        assert Path(api.configuration.key_file).read_bytes() == key
        assert holding(tmpdir, key) == []
    assert get(path) == 401  # the handshake presents it (the test server takes tokens only)


def test_the_context_chooses_whose_key_material_is_loaded_and_the_file_is_left_as_it_was(
    server: ApiServer, tmp_path: Path
) -> None:
    """The `*-data` fields of the cluster and user the context names go to memory files, and
    no other's; the kubeconfig file is not rewritten."""
    doc = kubeconfig(server, tmp_path)
    keys = {}
    for name in ("first", "second"):
        cert, keys[name] = client_pems()
        data = {"client-certificate-data": cert, "client-key-data": keys[name]}
        user = {field: base64.b64encode(blob).decode() for field, blob in data.items()}
        doc["users"].append({"name": name, "user": user})
        doc["contexts"].append({"name": name, "context": {"cluster": "test", "user": name}})
    doc["current-context"] = "first"
    path = write(tmp_path / "kc", doc)
    text = path.read_text()
    for context in ("second", None):
        with client(kubeconfig=path, context=context) as api:
            key_file = Path(api.configuration.key_file)
            assert str(key_file).startswith("/proc/self/fd/")
            assert key_file.read_bytes() == keys[context or "first"]
            assert Path(api.configuration.ssl_ca_cert).read_bytes() == ca_pem(doc)
    assert path.read_text() == text
    assert get(path, context="test") == 200  # a token beside them, in another context


def test_kubeconfig_files_are_merged_and_relative_paths_resolved_against_their_own_file(
    server: ApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, not_in_cluster: None
) -> None:
    """$KUBECONFIG as a list, as the library reads it: files that do not exist are skipped,
    the first file's entry of a name wins, a relative path is resolved against the directory
    of the file it is in."""
    doc = kubeconfig(server, tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "ca.crt").write_bytes(ca_pem(doc))
    (tmp_path / "b" / "token").write_text(server.token)
    cluster = doc["clusters"][0]["cluster"]
    del cluster["certificate-authority-data"]
    cluster["certificate-authority"] = "ca.crt"  # a/ca.crt
    users = doc.pop("users")
    users[0]["user"] = {"tokenFile": "token"}  # b/token
    write(tmp_path / "a" / "kc", doc)
    cert, key = client_pems()
    data = {"client-certificate-data": cert, "client-key-data": key}
    other = {
        "users": [*users, {"name": "x", "user": {"token": "wrong"}}],
        "clusters": [{"name": "test", "cluster": {"server": "https://192.0.2.1:6443"}}],
        "contexts": [],
    }
    other["users"][1]["user"] |= {k: base64.b64encode(v).decode() for k, v in data.items()}
    write(tmp_path / "b" / "kc", other)
    paths = f"{tmp_path}/a/kc:{tmp_path}/nope:{tmp_path}/b/kc"
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", paths)
    assert get(None) == 200
    assert server.requests[-1][1] == "ok"


def test_an_exec_plugin_is_given_the_cluster_as_the_kubeconfig_has_it(
    server: ApiServer, tmp_path: Path
) -> None:
    """provideClusterInfo: the cluster's own fields (certificate-authority-data), not the
    memory file ipvsproxy names to the library instead."""
    cert, key = client_pems()
    credential = {
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "kind": "ExecCredential",
        "status": {"clientCertificateData": cert.decode(), "clientKeyData": key.decode()},
    }
    answer = write(tmp_path / "credential.json", credential)
    plugin = tmp_path / "plugin"
    plugin.write_text(f'#!/bin/sh\necho "$KUBERNETES_EXEC_INFO" >>{tmp_path}/info\ncat {answer}\n')
    plugin.chmod(0o755)
    exec_ = {
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "command": str(plugin),
        "interactiveMode": "Never",
        "provideClusterInfo": True,
    }
    doc = kubeconfig(server, tmp_path, exec=exec_)
    with client(kubeconfig=write(tmp_path / "kc", doc), context=None) as api:
        assert Path(api.configuration.key_file).read_bytes() == key
    (info,) = (json.loads(line) for line in (tmp_path / "info").read_text().splitlines())
    assert info["spec"]["cluster"] == doc["clusters"][0]["cluster"]


def test_a_user_and_password_are_sent_as_basic_auth(server: ApiServer, tmp_path: Path) -> None:
    path = write(tmp_path / "kc", kubeconfig(server, tmp_path, username="admin", password="s3"))
    with client(kubeconfig=path, context=None) as api:
        (auth,) = api.configuration.auth_settings().values()
        assert auth["value"] == "Basic " + base64.b64encode(b"admin:s3").decode()
    assert get(path) == 401  # the test server takes tokens only


def test_an_exec_plugin_is_run_by_the_library(server: ApiServer, tmp_path: Path) -> None:
    """A token it returns is the library's (which renews it); the plugin runs at most twice
    at load: once by ipvsproxy, looking for a client certificate to keep in memory."""
    credential = {
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "kind": "ExecCredential",
        "status": {"token": server.token},
    }
    plugin = tmp_path / "plugin"
    plugin.write_text(f"#!/bin/sh\necho run >>{tmp_path}/runs\necho '{json.dumps(credential)}'\n")
    plugin.chmod(0o755)
    exec_ = {
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "command": str(plugin),
        "interactiveMode": "Never",
    }
    assert get(write(tmp_path / "kc", kubeconfig(server, tmp_path, exec=exec_))) == 200
    assert 1 <= len((tmp_path / "runs").read_text().split()) <= 2


def test_an_exec_plugins_expired_token_is_renewed_before_a_request(
    server: ApiServer, tmp_path: Path
) -> None:
    """The library's refresh hook, which `Client.get` runs through `auth_settings()`."""
    credential = {
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "kind": "ExecCredential",
        "status": {"token": server.token, "expirationTimestamp": "2000-01-01T00:00:00Z"},
    }
    plugin = tmp_path / "plugin"
    plugin.write_text(f"#!/bin/sh\necho run >>{tmp_path}/runs\necho '{json.dumps(credential)}'\n")
    plugin.chmod(0o755)
    exec_ = {
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "command": str(plugin),
        "interactiveMode": "Never",
    }
    path = write(tmp_path / "kc", kubeconfig(server, tmp_path, exec=exec_))
    with client(kubeconfig=path, context=None) as api:
        loaded = len((tmp_path / "runs").read_text().split())
        for _ in range(2):
            response = api.get("/api/v1/services", [])
            response.read()
            assert response.status == 200
        assert len((tmp_path / "runs").read_text().split()) == loaded + 2


def test_without_kubeconfig_or_cluster_the_default_kubeconfig_is_read(
    server: ApiServer, tmp_path: Path, not_in_cluster: None
) -> None:
    write(Path(kube_config.KUBE_CONFIG_DEFAULT_LOCATION), kubeconfig(server, tmp_path))
    assert get(None) == 200


def test_in_cluster_the_service_account_token_is_sent_and_its_rotation_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, not_in_cluster: None
) -> None:
    """A DaemonSet's path, preferred to the default kubeconfig: the library's in-cluster
    loader, our GETs (its refresh hook runs before each request; the kubelet rotates the
    projected token file)."""
    api = ApiServer(token="first").start()
    try:
        (tmp_path / "token").write_text("first")
        (tmp_path / "ca.crt").write_bytes(ca_pem(kubeconfig(api, tmp_path)))
        write(Path(kube_config.KUBE_CONFIG_DEFAULT_LOCATION), kubeconfig(api, tmp_path, token="x"))
        monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "token"))
        monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(tmp_path / "ca.crt"))
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(api.port))
        with client(kubeconfig=None, context=None) as api_client:
            first = api_client.get("/api/v1/services", [("limit", 5), ("watch", False)])
            assert first.status == 200
            # rotated: read again at the next request, not a minute later as the library's
            # loader would
            (tmp_path / "token").write_text("second")
            api.token = "second"
            second = api_client.get("/api/v1/services", [])
            assert second.status == 200
        assert [(path, ok) for path, ok, _ in api.requests] == [
            ("/api/v1/services", "ok"),
            ("/api/v1/services", "ok"),
        ]
    finally:
        api.stop()


BAD_CA = {
    "current-context": "c",
    "contexts": [{"name": "c", "context": {"cluster": "k"}}],
    "clusters": [
        {"name": "k", "cluster": {"server": "https://h", "certificate-authority-data": "abc"}}
    ],
}
BAD = {
    "malformed YAML": ("clusters: [", "not valid YAML: expected the node content"),
    "empty": ("", "file is empty"),
    "not a mapping": ("[1, 2]", "not a well-formed kubeconfig (list indices"),
    "no current context": ({"clusters": [], "contexts": []}, "Expected key current-context"),
    "bad certificate data": (BAD_CA, "not a well-formed kubeconfig (Incorrect padding)"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_kubeconfig_is_one_line(tmp_path: Path, case: str) -> None:
    doc, words = BAD[case]
    path = write(tmp_path / "kc", doc)
    with pytest.raises(ConfigError) as error:
        client(kubeconfig=path, context=None)
    message = str(error.value)
    assert message.startswith(f"cannot load the Kubernetes client configuration ({path}: ")
    assert words in message
    assert "\n" not in message


def test_an_unknown_context_or_a_missing_file_is_named(server: ApiServer, tmp_path: Path) -> None:
    doc = kubeconfig(server, tmp_path)
    with pytest.raises(ConfigError, match="Expected object with name nope in .*contexts list"):
        client(kubeconfig=write(tmp_path / "kc", doc), context="nope")
    doc["clusters"][0]["cluster"]["certificate-authority"] = "gone.crt"
    del doc["clusters"][0]["cluster"]["certificate-authority-data"]
    with pytest.raises(ConfigError, match=f"File does not exist: {tmp_path}/gone.crt"):
        client(kubeconfig=write(tmp_path / "kc", doc), context=None)
    with pytest.raises(ConfigError, match=f"--kubeconfig {tmp_path}/nope: no such file"):
        client(kubeconfig=tmp_path / "nope", context=None)


def test_no_credentials_anywhere_says_where_it_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, not_in_cluster: None
) -> None:
    with pytest.raises(ConfigError) as error:
        client(kubeconfig=None, context=None)
    assert str(error.value) == (
        "cannot load the Kubernetes client configuration (in-cluster: Service host/port is "
        f"not set.; {tmp_path}/default: Invalid kube-config file. No configuration found.)"
    )
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")  # a Pod without a token
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="in-cluster: Service token file does not exist"):
        client(kubeconfig=None, context=None)


def test_master_overrides_the_kubeconfigs_server(server: ApiServer, tmp_path: Path) -> None:
    """kube-proxy's --master: the kubeconfig's credentials, sent to this address instead."""
    doc = kubeconfig(server, tmp_path)
    url = doc["clusters"][0]["cluster"]["server"]
    doc["clusters"][0]["cluster"]["server"] = "https://192.0.2.1:6443"  # TEST-NET: unreachable
    path = write(tmp_path / "kc", doc)
    with client(kubeconfig=path, context=None, master=url) as api:
        response = api.get("/api/v1/services", [("limit", 5)])
        response.read()
        assert response.status == 200
    assert server.requests[-1][1] == "ok"  # the kubeconfig's token went along


def test_master_alone_is_the_whole_configuration(not_in_cluster: None) -> None:
    """As kube-proxy's createClient: no kubeconfig, no in-cluster credentials, the address
    only (https unless it says otherwise)."""
    with client(kubeconfig=None, context=None, master="10.0.0.1:6443") as api:
        assert api.configuration.host == "https://10.0.0.1:6443"
        assert not api.configuration.api_key
    with client(kubeconfig=None, context=None, master="http://127.0.0.1:8080/") as api:
        assert api.configuration.host == "http://127.0.0.1:8080"


def test_name_resolution_ends_at_the_deadline(server: ApiServer, tmp_path: Path) -> None:
    """A lookup of the server's name that never returns: the request fails at its deadline
    as a connect timeout (what `ipvsproxy.kube` reports as any connection failure), and the
    deadline has expired. Before: the request waited for the lookup (for ever here)."""
    doc = kubeconfig(server, tmp_path)
    doc["clusters"][0]["cluster"]["server"] = "https://api.nowhere.test:6443"
    # the error, and whether the deadline had expired
    outcome: list[tuple[urllib3.exceptions.MaxRetryError, bool]] = []

    def get() -> None:
        api = client(kubeconfig=write(tmp_path / "kc", doc), context=None)
        with api, Deadline(0.5) as deadline:
            try:
                api.get("/api/v1/services", [])
            except urllib3.exceptions.MaxRetryError as exc:
                outcome.append((exc, deadline.expired))

    with never_resolving("api.nowhere.test") as lookups:
        thread = threading.Thread(target=get, daemon=True)
        thread.start()
        thread.join(timeout=30)  # the name never resolves: without the deadline, never
        assert not thread.is_alive(), "still resolving after 30 s"
    assert lookups == ["api.nowhere.test"]
    eventually(lambda: not connecting(), 5)  # the lookup, unblocked, ended its worker
    ((error, expired),) = outcome
    assert expired
    assert isinstance(error.reason, urllib3.exceptions.ConnectTimeoutError)
    assert "no connection to api.nowhere.test:6443 before the 0.5s deadline" in str(error.reason)


def test_connections_given_up_at_the_deadline_hold_a_bounded_number_of_threads() -> None:
    """A resolver that never answers costs at most `_WORKERS` threads, whatever the number of
    attempts; a connection made after its deadline is closed, not leaked."""
    release = threading.Event()
    made: list[socket.socket] = []

    class Connection:
        sock: socket.socket | None = None

        def connect(self) -> None:
            release.wait()
            self.sock, theirs = socket.socketpair()
            theirs.close()
            made.append(self.sock)

        def close(self) -> None:
            if self.sock is not None:
                self.sock.close()

    try:
        for _ in range(kubeclient._WORKERS + 2):
            connection = Connection()
            with Deadline(0.05) as deadline, pytest.raises(TimeoutError):
                deadline.connect(connection.connect, connection.close)
            assert deadline.expired
        assert len(connecting()) == kubeclient._WORKERS
    finally:
        release.set()
    eventually(lambda: not connecting(), 5)
    assert len(made) == kubeclient._WORKERS
    assert all(sock.fileno() == -1 for sock in made)  # closed: made too late


def test_the_deadline_cuts_a_trickling_plain_http_server(not_in_cluster: None) -> None:
    """Over http the connection is made inside the request (no TLS handshake first): its
    socket is watched once made, and a body trickled a byte at a time ends at the deadline."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)  # the request (small, one read)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
            with contextlib.suppress(OSError):
                for _ in range(200):  # 10 s, then the connection closes
                    if stop.wait(0.05):
                        break
                    conn.sendall(b"x")

    threading.Thread(target=serve, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    started = time.monotonic()
    try:
        with client(kubeconfig=None, context=None, master=url) as api, Deadline(0.5) as d:
            with contextlib.suppress(urllib3.exceptions.HTTPError):
                api.get("/api/v1/services", [], timeout=(5, 5)).read()
            assert d.expired
    finally:
        stop.set()
        listener.close()
    assert time.monotonic() - started < 5  # the server's trickle: 10 s


# ---- credentials that follow rotation ----------------------------------------------------

# a service-account token's shape (header.claims.signature) with no `exp` claim: nothing the
# library could read an expiry from (it re-reads a token file only when it can)
NO_EXPIRY = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW06c2VydmljZWFjY291bnQ6a3ViZS1zeXN0ZW06eCJ9.c2ln"


def rotate(path: Path, token: str) -> None:
    """As the kubelet rotates a projected token: a new file swapped in (a new inode)."""
    new = path.with_name(path.name + ".new")
    new.write_text(token)
    new.replace(path)


def rewrite_unseen(path: Path, token: str) -> None:
    """The file's content changed in place, its size and modification time as before: a
    change no `stat` shows."""
    before = path.stat()
    assert len(token) == before.st_size
    with path.open("r+") as f:
        f.write(token)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


@pytest.fixture
def rotating(tmp_path: Path) -> Iterator[tuple[ApiServer, Path]]:
    """A server of its own, whose token a test changes, and a kubeconfig with a tokenFile."""
    api = ApiServer(token=NO_EXPIRY + "1").start()
    (tmp_path / "token").write_text(NO_EXPIRY + "1\n")
    kc = write(tmp_path / "kc", kubeconfig(api, tmp_path, tokenFile="token"))
    try:
        yield api, kc
    finally:
        api.stop()


def statuses(api: ApiServer) -> list[str]:
    return [ok for _, ok, _ in api.requests]


def test_a_rotated_token_file_is_read_again_before_the_next_request(rotating, tmp_path):
    """A token with no expiry: the library would send the first for ever."""
    api, kc = rotating
    with client(kubeconfig=kc, context=None) as api_client:
        assert api_client.get("/api/v1/services", []).status == 200
        rotate(tmp_path / "token", NO_EXPIRY + "2")
        api.token = NO_EXPIRY + "2"  # the old one is refused from now on
        assert api_client.get("/api/v1/services", []).status == 200
    assert statuses(api) == ["ok", "ok"]  # read before it was sent: never refused


def test_a_refusal_reads_the_token_file_again_at_once_and_retries_once(rotating, tmp_path):
    api, kc = rotating
    with client(kubeconfig=kc, context=None) as api_client:
        assert api_client.get("/api/v1/services", []).status == 200
        rewrite_unseen(tmp_path / "token", NO_EXPIRY + "2\n")
        api.token = NO_EXPIRY + "2"
        assert api_client.get("/api/v1/services", []).status == 200
        assert statuses(api) == ["ok", "denied", "ok"]
        api.token = "neither"  # refused for good: the refusal is the answer, after one retry
        assert api_client.get("/api/v1/services", []).status == 401
    assert statuses(api) == ["ok", "denied", "ok", "denied", "denied"]


def test_an_unreadable_or_empty_token_file_keeps_the_token_read_before(rotating, tmp_path, caplog):
    api, kc = rotating
    with client(kubeconfig=kc, context=None) as api_client:
        rotate(tmp_path / "token", "")
        assert api_client.get("/api/v1/services", []).status == 200
        (tmp_path / "token").unlink()
        assert api_client.get("/api/v1/services", []).status == 200
    assert statuses(api) == ["ok", "ok"]
    assert "is empty; the token read before is kept" in caplog.text
    assert "No such file or directory; the token read before is kept" in caplog.text


def test_a_token_in_the_kubeconfig_wins_over_its_token_file(rotating, tmp_path):
    """The library's order: `token` before `tokenFile`; then the file is not followed."""
    api, _ = rotating
    kc = write(
        tmp_path / "kc2",
        kubeconfig(api, tmp_path, token=NO_EXPIRY + "1", tokenFile="token"),
    )
    with client(kubeconfig=kc, context=None) as api_client:
        rotate(tmp_path / "token", NO_EXPIRY + "2")
        assert api_client.get("/api/v1/services", []).status == 200
    assert statuses(api) == ["ok"]


class Certs:
    """A configuration's certificate fields, and what the library hook would be."""

    def __init__(self, cert: str | None, key: str | None) -> None:
        self.cert_file, self.key_file = cert, key
        self.refresh_api_key_hook: Any = None
        self.api_key: dict[str, str] = {}
        self.api_key_prefix: dict[str, str] = {}


def test_rotated_client_certificate_files_make_new_connections_read_them(tmp_path):
    (tmp_path / "crt").write_text("one")
    (tmp_path / "key").write_text("one")
    rotations: list[int] = []
    configuration = Certs(str(tmp_path / "crt"), str(tmp_path / "key"))
    creds = kubeclient.Credentials(
        configuration, token_file=None, on_rotate=lambda: rotations.append(1)
    )
    configuration.refresh_api_key_hook()  # as auth_settings() runs it before each request
    assert rotations == []
    rotate(tmp_path / "key", "two")
    creds.follow()
    creds.follow()
    assert rotations == [1]
    creds.reload()  # a refusal: new connections, changed or not
    assert rotations == [1, 1]


def test_key_material_of_the_kubeconfig_itself_is_not_followed(tmp_path):
    rotations: list[int] = []
    creds = kubeclient.Credentials(
        Certs("/proc/self/fd/7", "/proc/self/fd/8"),
        token_file=None,
        on_rotate=lambda: rotations.append(1),
    )
    creds.follow()
    creds.reload()
    assert rotations == []
