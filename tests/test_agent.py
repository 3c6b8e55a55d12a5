"""The agent (agent.py): its SIGTERM/SIGINT handling (the handler itself takes no lock and logs
nothing), and run_once's order: the manifests are parsed first, and nothing on the node changes
(settings, leftovers, the sync) before the input is known good, nor without a backend; bad
input is reported before a missing backend."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from ipvsproxy import agent
from ipvsproxy.agent import _signals
from ipvsproxy.backends import IPVS, Backend
from ipvsproxy.config import Config
from ipvsproxy.errors import ConfigError, KernelUnavailable
from ipvsproxy.testing import FakeKernel
from tests.factories import ep, node, service, slice_


def test_a_real_sigterm_halts_once_and_is_logged_outside_the_handler(caplog):
    caplog.set_level(logging.INFO, logger="ipvsproxy.agent")
    halted = threading.Event()
    with _signals(halted.set):
        os.kill(os.getpid(), signal.SIGTERM)
        assert halted.wait(5)
    (record,) = [r for r in caplog.records if "received SIGTERM: stopping" in r.message]
    assert record.threadName == "signals"  # not the main thread, where the handler ran


def test_sighup_is_logged_and_asks_for_a_full_resync_without_stopping(caplog):
    """Issue 28: SIGHUP's default action ended the agent mid-pass without a log line."""
    caplog.set_level(logging.INFO, logger="ipvsproxy.agent")
    halted, resynced = threading.Event(), threading.Event()
    before = signal.getsignal(signal.SIGHUP)  # SIG_IGN under nohup
    with _signals(halted.set, resync=resynced.set):
        os.kill(os.getpid(), signal.SIGHUP)
        assert resynced.wait(5)
    assert not halted.is_set()
    (record,) = [r for r in caplog.records if "received SIGHUP" in r.message]
    assert "full resync" in record.message
    assert record.threadName == "signals"
    assert signal.getsignal(signal.SIGHUP) is before  # the old handler is back


def test_the_handler_returns_while_the_main_thread_holds_the_lock_halt_needs(caplog):
    """The deadlock a signal could cause: one arriving while the main thread holds a lock that
    halting (or logging) takes again. The handler must return at once; the halt follows."""
    caplog.set_level(logging.INFO, logger="ipvsproxy.agent")
    lock = threading.Lock()  # stands for the runner's Event lock, or a logging handler's
    halted_by: list[str] = []

    def halt() -> None:
        with lock:
            halted_by.append(threading.current_thread().name)

    with _signals(halt):
        handler = signal.getsignal(signal.SIGINT)
        assert callable(handler)
        with lock:  # the main thread is inside the lock when the signal comes
            before = len(caplog.records)
            started = time.monotonic()
            handler(signal.SIGINT, None)
            # returned (a handler that took the lock would never return: a deadlock)
            assert time.monotonic() - started < 30
            # nothing logged from inside the handler (the "signals" thread may log already:
            # it reads the pipe at once, then waits for the lock in halt())
            main = threading.main_thread().name
            assert not [r for r in caplog.records[before:] if r.threadName == main]
            assert halted_by == []
        deadline = time.monotonic() + 5
        while not halted_by:
            assert time.monotonic() < deadline, "the signal was never acted on"
            time.sleep(0.01)
    assert halted_by == ["signals"]
    assert any("received SIGINT: stopping" in r.message for r in caplog.records)


def test_previous_handlers_come_back():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    with _signals(lambda: None):
        assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_outside_the_main_thread_no_handler_is_installed():
    seen: list[object] = []

    def body() -> None:
        with _signals(lambda: None):
            seen.append(signal.getsignal(signal.SIGTERM))

    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=body)
    thread.start()
    thread.join(5)
    assert seen == [before]


# ---- run_once: input first, then the node ------------------------------------------------


CONFIG = Config(node_name="node-a")


class Node:
    """The fakes' record of what happened on the node, in order."""

    def __init__(self, *, leftovers: tuple[str, ...] = ()) -> None:
        self.steps: list[str] = []
        self.kernel = FakeKernel()
        self.leftovers = list(leftovers)


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> Node:
    host = Node()

    @contextmanager
    def open_backend(config: Config) -> Iterator[Backend]:
        host.steps.append("open backend")
        yield Backend(host.kernel, IPVS, "test")

    def remove_leftovers(backend: Backend, config: Config, *, dry_run: bool = False) -> list[str]:
        host.steps.append("look for leftovers" if dry_run else "remove leftovers")
        found = list(host.leftovers)
        if not dry_run:
            host.leftovers.clear()
        return found

    monkeypatch.setattr(agent, "open_backend", open_backend)
    monkeypatch.setattr(agent, "prepare", lambda backend, config: host.steps.append("prepare"))
    monkeypatch.setattr(agent, "remove_leftovers", remove_leftovers)
    monkeypatch.setattr(agent, "_node_addresses", lambda config: None)
    return host


def good_changes(monkeypatch: pytest.MonkeyPatch, host: Node) -> None:
    """changes_from as the real one, recorded among the steps."""
    real = agent.changes_from

    def parse(source: agent.Source, config: Config) -> Any:
        host.steps.append("parsed")
        return real(source, config)

    monkeypatch.setattr(agent, "changes_from", parse)


def manifest(tmp_path: Path) -> Path:
    import json

    objs = [node("node-a"), service("web", cluster_ips=("10.96.0.10",))]
    objs.append(slice_("web", endpoints=[ep("10.244.0.5", node="node-a")]))
    path = tmp_path / "objects.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}))
    return path


def test_the_input_is_parsed_before_the_backend_opens_and_the_node_is_prepared(
    host, monkeypatch, tmp_path
):
    good_changes(monkeypatch, host)
    result = agent.run_once(CONFIG, manifest_paths=[manifest(tmp_path)])
    assert result.ok
    assert host.steps == ["parsed", "open backend", "prepare", "remove leftovers"]
    assert len(host.kernel.state.services) == 1


def test_leftovers_found_are_removed_after_the_input_is_known_good(host, monkeypatch, tmp_path):
    host.leftovers = ["iptables: chain IPVSPX-SERVICES"]
    good_changes(monkeypatch, host)
    agent.run_once(CONFIG, manifest_paths=[manifest(tmp_path)])
    assert host.steps == ["parsed", "open backend", "prepare", "remove leftovers"]
    assert host.leftovers == []


def test_bad_input_changes_nothing_on_the_node(host, tmp_path):
    host.leftovers = ["iptables: chain IPVSPX-SERVICES"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: [unclosed\n")
    with pytest.raises(ConfigError):
        agent.run_once(CONFIG, manifest_paths=[bad])
    assert "prepare" not in host.steps
    assert "remove leftovers" not in host.steps
    assert host.kernel.applied == []


def test_bad_input_is_reported_before_a_missing_backend(host, monkeypatch, tmp_path):
    @contextmanager
    def no_backend(config: Config) -> Iterator[Backend]:
        raise KernelUnavailable("the kernel has no IPVS")
        yield  # pragma: no cover

    monkeypatch.setattr(agent, "open_backend", no_backend)
    bad = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match="missing.yaml"):
        agent.run_once(CONFIG, manifest_paths=[bad])
    with pytest.raises(KernelUnavailable):  # good input: the backend's error
        agent.run_once(CONFIG, manifest_paths=[manifest(tmp_path)])


@pytest.mark.parametrize("mode", ["ipvs", "iptables"])
def test_the_metrics_port_answers_the_proxy_mode_as_kube_proxy(mode):
    """kube-proxy's metrics server answers /proxyMode with its mode, which tooling reads to
    tell how Services are implemented; ipvsproxy answers the backend in use."""
    import urllib.request

    from ipvsproxy.metrics import Metrics

    config = Config(metrics_bind_address=("127.0.0.1", 0))
    server = agent._serve_metrics(config, Metrics().render, mode=mode)
    try:
        url = f"http://127.0.0.1:{server.port}/proxyMode"
        with urllib.request.urlopen(url, timeout=5) as answer:
            assert answer.read().decode() == mode
    finally:
        server.close()


# ---- cleanup beside a running agent ------------------------------------------------------


def test_cleanup_refuses_while_the_node_lock_is_held_unless_forced(monkeypatch, caplog):
    from ipvsproxy import backends, nodelock

    removed: list[bool] = []

    def cleanup(config: Config, *, dry_run: bool, ipvs: bool) -> list[str]:
        removed.append(dry_run)
        return ["x"]

    monkeypatch.setattr(backends, "cleanup", cleanup)
    with nodelock.hold("run"):
        with pytest.raises(nodelock.NodeBusy, match="stop it first, or give --force"):
            agent.cleanup(CONFIG, dry_run=False)
        assert removed == []
        assert agent.cleanup(CONFIG, dry_run=True) == ["x"]  # a dry run changes nothing
        assert agent.cleanup(CONFIG, dry_run=False, force=True) == ["x"]
    assert removed == [True, False]
    assert any("cleanup --force" in r.message and f"pid {os.getpid()}" in r.message
               for r in caplog.records)  # fmt: skip
    assert agent.cleanup(CONFIG, dry_run=False) == ["x"]  # released: no refusal


def test_run_once_holds_the_node_lock_from_its_first_step(host, monkeypatch, tmp_path):
    from ipvsproxy import nodelock

    with nodelock.hold("run"), pytest.raises(nodelock.NodeBusy):
        agent.run_once(CONFIG, manifest_paths=[manifest(tmp_path)])
    assert host.steps == []
    seen: list[object] = []

    def changes_from(*args: object) -> None:
        seen.append(nodelock.holder())
        raise ConfigError("stop here")

    monkeypatch.setattr(agent, "changes_from", changes_from)
    with pytest.raises(ConfigError, match="stop here"):
        agent.run_once(CONFIG, manifest_paths=[manifest(tmp_path)])
    assert seen
    assert seen[0] is not None


# ---- readiness: "this node is served" ----------------------------------------------------


def _get(port: int, path: str) -> tuple[int, dict[str, Any]]:
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except urllib.error.URLError:  # nothing listens (yet)
        return 0, {}


def test_readyz_waits_for_the_first_full_pass_while_the_api_is_held_back(host, tmp_path, caplog):
    """A restart with the API server out of reach: the health port answers from the first
    moment (/livez and kube-proxy's /healthz 200: alive, "healthy while starting"), /readyz
    503 naming what it waits for, until the lists arrive and a full pass has written the
    table; at its first 200 the table is in the kernel."""
    from ipvsproxy.agent import Cluster
    from tests.kubeapi import ApiServer
    from tests.support import eventually, free_port

    api = ApiServer()
    api.port = free_port()  # nothing listens there yet: the API is held back
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    api.put(node("node-a"))
    api.put(service("web", cluster_ips=("10.96.0.10",)))
    api.put(slice_("web", endpoints=[ep("10.244.0.5", node="node-a")]))
    health = free_port()
    config = Config(
        node_name="node-a",
        min_sync_period=0.0,
        healthz_bind_address=("127.0.0.1", health),
        metrics_bind_address=("127.0.0.1", free_port()),
    )
    stop = threading.Event()
    caplog.set_level(logging.INFO, logger="ipvsproxy")
    run = threading.Thread(
        target=agent.run, args=(config,), kwargs={"source": Cluster(kubeconfig), "stop": stop}
    )
    run.start()
    try:
        eventually(lambda: _get(health, "/livez")[0] == 200, 30, "/livez answers")
        eventually(lambda: "open backend" in host.steps, 30, "the agent has started")
        for _ in range(10):  # however long it waits
            code, body = _get(health, "/readyz")
            assert (code, body["ready"]) == (503, False)
            assert _get(health, "/healthz")[0] == 200
            time.sleep(0.05)
        assert "Services" in body["waitingFor"]
        assert "EndpointSlices" in body["waitingFor"]
        assert host.kernel.state.services == {}
        api.start()
        eventually(lambda: _get(health, "/readyz")[0] == 200, 60, "/readyz turns 200")
        assert len(host.kernel.state.services) == 1, "ready means the table is written"
        assert _get(health, "/readyz")[1]["ready"] is True
    finally:
        stop.set()
        run.join(30)
        api.stop()
    assert not run.is_alive()
    # the server in use is named: at start, and by each retry while it is out of reach
    server = f"https://127.0.0.1:{api.port}"
    assert f"running: Kubernetes API at {server} via {kubeconfig}" in caplog.messages
    assert any(m.startswith(f"watch Service from {server}: ") for m in caplog.messages)


def test_cleanup_kube_proxy_refuses_until_the_agent_is_ready_unless_forced(monkeypatch, caplog):
    """`cleanup --kube-proxy` asks this node's agent (/readyz on its health port) and
    removes nothing until it answers 200: no agent, or one still waiting, is a refusal
    naming what it waits for; --force removes with a warning; a dry run asks nothing."""
    from ipvsproxy import kpcleanup
    from ipvsproxy.serve import Health, HttpServer
    from tests.support import free_port

    removed: list[bool] = []

    def remove(config: Config, *, dry_run: bool, ipvs: bool) -> list[str]:
        removed.append(dry_run)
        return ["chain KUBE-SERVICES"]

    monkeypatch.setattr(kpcleanup, "cleanup_kube_proxy", remove)
    config = Config(healthz_bind_address=("0.0.0.0", free_port()))
    with pytest.raises(agent.NotServed, match="an ipvsproxy agent to answer at http://127.0.0.1"):
        agent.cleanup_kube_proxy(config, dry_run=False, ipvs=False)
    assert agent.cleanup_kube_proxy(config, dry_run=True, ipvs=False) == ["chain KUBE-SERVICES"]
    assert removed == [True]

    health = Health(timeout=60)
    health.waiting("the first list of EndpointSlices from the API")
    server = HttpServer(("127.0.0.1", config.healthz_bind_address[1]), {"/readyz": health.readyz})
    server.start()
    try:
        with pytest.raises(agent.NotServed, match="waiting for the first list of EndpointSlices"):
            agent.cleanup_kube_proxy(config, dry_run=False, ipvs=False)
        assert removed == [True]
        assert agent.cleanup_kube_proxy(config, dry_run=False, ipvs=False, force=True)
        assert removed == [True, False]
        assert any("--force" in r.message for r in caplog.records)
        health.updated(full=False)  # a partial pass does not make the node served
        with pytest.raises(agent.NotServed):
            agent.cleanup_kube_proxy(config, dry_run=False, ipvs=False)
        health.updated(full=True)
        assert agent.cleanup_kube_proxy(config, dry_run=False, ipvs=False)
        assert removed == [True, False, False]
    finally:
        server.close()


def test_the_health_port_answers_while_the_start_up_steps_wait(host, monkeypatch, tmp_path):
    """/livez from the first moment: opening the source and the backend (the kubernetes
    client's and pyroute2's imports, modules loaded, a slow node) may take a minute under a
    slow start; the kubelet's liveness probe must not kill the agent meanwhile."""
    from ipvsproxy.agent import Manifests
    from tests.support import eventually, free_port

    opening = threading.Event()
    release = threading.Event()
    real_open = vars(agent)["open_backend"]  # the `host` fixture's fake backend

    @contextmanager
    def slow_open(config: Config) -> Iterator[Backend]:
        opening.set()
        release.wait(30)
        with real_open(config) as backend:
            yield backend

    monkeypatch.setattr(agent, "open_backend", slow_open)
    health = free_port()
    config = Config(
        node_name="node-a",
        healthz_bind_address=("127.0.0.1", health),
        metrics_bind_address=("127.0.0.1", free_port()),
    )
    stop = threading.Event()
    source = Manifests((manifest(tmp_path),))
    run = threading.Thread(
        target=agent.run, args=(config,), kwargs={"source": source, "stop": stop}
    )
    run.start()
    try:
        assert opening.wait(30)
        assert _get(health, "/livez")[0] == 200
        code, body = _get(health, "/readyz")
        assert code == 503
        assert body["waitingFor"]
        release.set()
        eventually(lambda: _get(health, "/readyz")[0] == 200, 30, "/readyz turns 200")
    finally:
        release.set()
        stop.set()
        run.join(30)
    assert not run.is_alive()


# ---- Agent: built, start(), run(), stop(), close() -----------------------------------------


def lifecycle_config() -> Config:
    from tests.support import free_port

    return Config(
        node_name="node-a",
        min_sync_period=0.0,
        healthz_bind_address=("127.0.0.1", free_port()),
        metrics_bind_address=("127.0.0.1", free_port()),
    )


def test_stop_from_another_thread_ends_run_and_twice_is_harmless(host, tmp_path, caplog):
    """run() in the main thread (signals taken there) until stop() comes from another; it
    returns with everything released (the ports closed, the old handlers back) and the rules
    left; stop() and close() again do nothing."""
    from tests.support import eventually

    caplog.set_level(logging.INFO, logger="ipvsproxy.agent")
    config = lifecycle_config()
    health = config.healthz_bind_address[1]
    before = signal.getsignal(signal.SIGTERM)
    served = threading.Event()
    watchdog = threading.Event()  # ends a run() that stop() did not end, failing the test
    fired = threading.Event()
    the_agent = agent.Agent(config, source=agent.Manifests((manifest(tmp_path),)), stop=watchdog)

    def stop_when_served() -> None:
        eventually(lambda: _get(health, "/readyz")[0] == 200, 30, "/readyz turns 200")
        served.set()
        the_agent.stop()

    stopper = threading.Thread(target=stop_when_served, daemon=True)

    def bark() -> None:
        fired.set()
        watchdog.set()

    timer = threading.Timer(60, bark)
    timer.start()
    try:
        with the_agent:
            the_agent.start()
            stopper.start()
            the_agent.run()
            assert served.is_set(), "run() returned before stop()"
            assert not fired.is_set(), "stop() did not end run()"
            assert _get(health, "/livez")[0] == 0, "run() closed the health port"
            assert signal.getsignal(signal.SIGTERM) == before
            the_agent.stop()
        the_agent.close()
    finally:
        timer.cancel()
    stopper.join(5)
    assert len(host.kernel.state.services) == 1, "the rules are left in place"
    assert caplog.messages.count("stopped; ipvs rules left in place") == 1


def test_stop_before_start_makes_run_return_at_once(host, tmp_path, caplog):
    """As `run(stop=)` with the event already set: started (the node prepared), no pass."""
    caplog.set_level(logging.INFO, logger="ipvsproxy.agent")
    with agent.Agent(lifecycle_config(), source=agent.Manifests((manifest(tmp_path),))) as a:
        a.stop()
        a.stop()
        a.start()
        a.run()
    assert host.steps == ["open backend", "prepare", "remove leftovers"]
    assert host.kernel.state.services == {}
    assert not any(m.startswith("running: ") for m in caplog.messages)
    assert "stopped; ipvs rules left in place" in caplog.messages


def test_a_start_that_fails_releases_what_it_opened(host, tmp_path):
    """The metrics port taken: start() raises ConfigError, and the health port it had opened
    is closed again (no `with` needed); run() without a start() that succeeded is an error."""
    import socket

    config = lifecycle_config()
    health = config.healthz_bind_address[1]
    with socket.socket() as taken:
        taken.bind(config.metrics_bind_address)
        taken.listen()
        failed = agent.Agent(config, source=agent.Manifests((manifest(tmp_path),)))
        with pytest.raises(ConfigError):
            failed.start()
    assert host.steps == ["open backend", "prepare", "remove leftovers"]
    assert _get(health, "/livez")[0] == 0, "the health port is closed"
    with pytest.raises(RuntimeError, match="before start"):
        failed.run()
    with pytest.raises(RuntimeError, match="before start"):
        agent.Agent(config, source=agent.Manifests((manifest(tmp_path),))).run()


def test_the_source_in_words_names_the_api_server_in_use():
    from ipvsproxy.agent import Cluster, describe_source

    assert describe_source(Cluster(master="https://lb:6443")) == (
        "Kubernetes API at https://lb:6443 (--master, no credentials)"
    )
    assert describe_source(Cluster(Path("kc")), server="https://10.0.0.1:6443") == (
        "Kubernetes API at https://10.0.0.1:6443 via kc"
    )
    assert describe_source(Cluster()) == "Kubernetes API via in-cluster or default kubeconfig"


def _metric(port: int, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    (line,) = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[1])


def test_a_rotated_token_is_followed_and_a_refused_one_said_once_past_two_sync_periods(
    host, tmp_path, caplog
):
    """Issue 46: the kubeadm overlay's kubeconfig names the Pod's token file; rewritten under
    the running agent, with the old token refused, the node keeps following. A token the
    server refuses for good (the file not rotated) is said once past 2 sync periods: a
    warning, ipvsproxy_api_stale, /readyz 503 with the detail, /healthz 200 (kube-proxy's);
    the file rotated again, the node follows again."""
    import json

    from ipvsproxy.agent import Cluster
    from tests.kubeapi import ApiServer
    from tests.support import eventually, free_port

    api = ApiServer(token="first").start()
    token = tmp_path / "token"
    token.write_text("first\n")
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    doc = json.loads(kubeconfig.read_text())
    doc["users"][0]["user"] = {"tokenFile": str(token)}
    kubeconfig.write_text(json.dumps(doc))
    api.put(node("node-a"))
    api.put(service("web", cluster_ips=("10.96.0.10",)))
    health, metrics = free_port(), free_port()
    config = Config(
        node_name="node-a",
        min_sync_period=0.0,
        sync_period=1.0,  # the bound: 2 s
        healthz_bind_address=("127.0.0.1", health),
        metrics_bind_address=("127.0.0.1", metrics),
    )
    stop = threading.Event()
    caplog.set_level(logging.INFO, logger="ipvsproxy")
    run = threading.Thread(
        target=agent.run, args=(config,), kwargs={"source": Cluster(kubeconfig), "stop": stop}
    )
    run.start()

    def rotate(value: str) -> None:
        (tmp_path / "token.new").write_text(value + "\n")
        (tmp_path / "token.new").replace(token)

    def vips() -> set[str]:
        return {str(key.address) for key in host.kernel.state.services}

    try:
        eventually(lambda: _get(health, "/readyz")[0] == 200, 60, "/readyz turns 200")
        # every kind's watch open: none in flight with the old token when it is refused
        eventually(lambda: len(api.watched()) >= 3, 60, "the three watches open", interval=0.1)
        # and the first Services' own lists done (a thread of their own at start, once)
        eventually(
            lambda: any(
                ok == "ok" and "kube-dns" in query.get("labelSelector", "")
                for _, ok, query in api.requests
            ),
            60,
            "the first Services' lists read",
            interval=0.1,
        )
        # as a rotation goes: the new token valid at once, the old one refused afterwards
        api.also_accepted = {"second"}
        rotate("second")
        api.token, api.also_accepted = "second", set()  # the first is refused from now on
        api.end_watches()  # every watch asks again, with whatever token it has
        api.put(service("db", cluster_ips=("10.96.0.11",)))
        eventually(lambda: "10.96.0.11" in vips(), 30, "the new Service is followed")
        assert api.refused_for_good() == []  # one in flight at the rotation is asked again
        assert _metric(metrics, "ipvsproxy_api_stale") == 0

        api.token = "revoked"  # refused for good: the file is not rotated
        api.end_watches()
        api.put(service("cache", cluster_ips=("10.96.0.12",)))
        eventually(lambda: _get(health, "/readyz")[0] == 503, 60, "/readyz turns 503")
        code, body = _get(health, "/healthz")
        assert code == 200, body  # kube-proxy's meaning: the rules in place serve traffic
        assert body["api"]["following"] is False
        assert "401" in body["api"]["error"]
        assert body["api"]["unreadSeconds"] >= 2
        assert _get(health, "/readyz")[1]["api"]["following"] is False
        assert _metric(metrics, "ipvsproxy_api_stale") == 1
        assert _metric(metrics, "ipvsproxy_api_unread_seconds") >= 2
        assert "10.96.0.12" not in vips()
        time.sleep(1.5)  # more passes and retries: still one warning per resource
        stale = [m for m in caplog.messages if m.startswith("API: ") and "not read for" in m]
        assert len(stale) == len({m.split("s not read")[0] for m in stale}), stale
        assert any(m.startswith("API: Services not read for") for m in stale), stale

        rotate("revoked")
        eventually(lambda: _get(health, "/readyz")[0] == 200, 60, "/readyz 200 again")
        eventually(lambda: "10.96.0.12" in vips(), 30, "the change made meanwhile arrives")
        assert _metric(metrics, "ipvsproxy_api_stale") == 0
        assert "api" not in _get(health, "/healthz")[1]
        (again,) = [m for m in caplog.messages if m.startswith("API: Services read again after")]
        assert int(again.removeprefix("API: Services read again after ").rstrip("s")) >= 2
    finally:
        stop.set()
        run.join(30)
        api.stop()
    assert not run.is_alive()
