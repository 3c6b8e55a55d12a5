"""`ipvsproxy status` on the command line: the agent's /status when one answers, else the
same computed from manifests and the kernel (said on stderr), else exit 2 in one line; exit 1
on drift; --watch in place on a terminal, plain blocks otherwise, Ctrl-C exits 0."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ipvsproxy.cli import main, status_command
from ipvsproxy.model import DeleteDest
from tests.status.scene import HERE, OBJECTS, WEB_VIP, valid
from tests.status.test_endpoint import Served
from tests.support import free_port


def run(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture
def served():
    s = Served()
    yield s
    s.server.close()


@pytest.fixture
def objects(tmp_path: Path) -> str:
    path = tmp_path / "objects.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": OBJECTS}))
    return str(path)


NO_AGENT = ("--agent", "http://127.0.0.1:1")  # nothing listens on port 1


def test_reads_the_agent_as_json(served):
    result = run("status", "--agent", served.url, "-o", "json", "demo/web")
    assert result.exit_code == 0, result.output
    doc = valid(json.loads(result.stdout))
    assert (doc["source"], [s["name"] for s in doc["services"]]) == ("agent", ["web"])


def test_finds_the_agent_at_the_metrics_bind_address(served):
    address = f"127.0.0.1:{served.server.port}"
    result = run("status", "--metrics-bind-address", address, "demo/db")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("demo/db:pg  TCP  rr  in sync\n")
    assert "from agent" in result.stdout


def test_a_one_shot_waits_for_the_kernel_to_refresh_its_counters_for_rates(served, monkeypatch):
    from tests.status.scene import count

    count(served.agent.kernel, WEB_VIP, HERE, conns=1)
    slept: list[float] = []

    def sleep(seconds: float) -> None:  # the agent's clock moves instead
        slept.append(seconds)
        served.clock.now += seconds

    monkeypatch.setattr("time.sleep", sleep)
    result = run("status", "--agent", served.url, "-o", "json")
    assert result.exit_code == 0, result.output
    assert slept == [2.0]
    assert json.loads(result.stdout)["rateWindowSeconds"] == 2.0


def test_without_an_agent_computes_from_manifests_and_says_so(host, objects):
    result = run("status", *NO_AGENT, "--manifests", objects, "--hostname-override", "node-a")
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("ipvsproxy: no agent at http://127.0.0.1:1: computing from")
    assert len(result.stderr.splitlines()) == 1
    assert "from local" in result.stdout


def test_drift_exits_1(host, objects):
    host.apply([DeleteDest(WEB_VIP, HERE)])
    result = run("status", *NO_AGENT, "--manifests", objects, "--hostname-override", "node-a")
    assert result.exit_code == 1, result.output
    assert "DRIFT" in result.stdout


def test_a_saved_table_instead_of_the_kernel(objects, tmp_path):
    saved = tmp_path / "ipvsadm.txt"
    saved.write_text(
        "-A -t 10.96.0.20:5432 -s rr\n-a -t 10.96.0.20:5432 -r 10.244.1.20:5432 -m -w 1\n"
    )
    result = run("status", "--manifests", objects, "--kernel-state", str(saved),
                 "--hostname-override", "node-a", "-o", "json", "demo/db")  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = valid(json.loads(result.stdout))
    assert (doc["source"], doc["backend"], doc["inSync"]) == ("kernel-state", None, True)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ((*NO_AGENT,), "give --kubeconfig or --manifests"),
        (("--agent", "http://127.0.0.1:1", "web"), "is not NAMESPACE/NAME"),
        (("--interval", "0s"), "--interval"),
        (("--kernel-state", "x.txt"), "--kernel-state needs"),
        (("--agent", "ftp://x"), "ftp"),
    ],
)
def test_errors_are_one_line_and_exit_2(args, says):
    result = run("status", *args)
    assert result.exit_code == 2, result.output
    assert says in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_the_default_agent_address_when_none_runs():
    port = free_port()
    result = run("status", "--metrics-bind-address", f"127.0.0.1:{port}")
    assert result.exit_code == 2
    assert f"no agent answers at http://127.0.0.1:{port}" in result.stderr


def test_watch_prints_plain_blocks_when_not_a_terminal_and_ctrl_c_exits_0(served, monkeypatch):
    frames = []

    def sleep(seconds: float) -> None:
        frames.append(seconds)
        if len(frames) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr("time.sleep", sleep)
    result = run("status", "--agent", served.url, "--watch", "--interval", "0.5s", "demo/db")
    assert result.exit_code == 0, result.output
    assert frames == [0.5, 0.5, 0.5]
    assert result.stdout.count("demo/db:pg") == 3
    assert "\x1b" not in result.stdout


def test_watch_refreshes_in_place_on_a_terminal(served, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    monkeypatch.setattr(sys, "stdout", screen)
    sleeps = iter([None, KeyboardInterrupt])

    def sleep(seconds: float) -> None:
        if (step := next(sleeps)) is not None:
            raise step

    monkeypatch.setattr("time.sleep", sleep)
    from ipvsproxy.status.client import fetch

    read = lambda selector: fetch(served.url, selector)  # noqa: E731
    with pytest.raises(KeyboardInterrupt):
        status_command._show_status(read, None, output="table", watch=True, interval=1.0)
    frames = screen.getvalue().split("\x1b[H\x1b[2J")
    assert frames[0] == ""
    assert len(frames) == 3
    assert frames[1].startswith("demo/db:pg")


@pytest.mark.parametrize(
    ("host", "url"),
    [("127.0.0.1", "http://127.0.0.1:10249"), ("0.0.0.0", "http://127.0.0.1:10249"),
     ("::", "http://[::1]:10249"), ("fd00::1", "http://[fd00::1]:10249")],
)  # fmt: skip
def test_the_agents_url_from_its_bind_address(host, url):
    from ipvsproxy.status.client import agent_url

    assert agent_url(host, 10249) == url


def test_the_agents_address_from_configs_metrics_bind_address(tmp_path):
    port = free_port()
    config = tmp_path / "kp.yaml"
    config.write_text(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
        f"metricsBindAddress: 0.0.0.0:{port}\n"
    )
    result = run("status", "--config", str(config))
    assert result.exit_code == 2
    assert f"no agent answers at http://127.0.0.1:{port}" in result.stderr


def test_a_service_that_is_not_there_is_an_error_not_in_sync(served, objects, tmp_path):
    """A typo in the selector exits 2 naming it (from the agent and computed alike); it never
    reads "in sync", exit 0."""
    result = run("status", "--agent", served.url, "demo/typo")
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == "ipvsproxy: error: no Service demo/typo\n"
    result = run("status", "--agent", served.url, "demo/web:nope")
    assert result.exit_code == 2
    assert result.stderr == "ipvsproxy: error: no Service demo/web with a port 'nope'\n"
    saved = tmp_path / "ipvsadm.txt"
    saved.write_text("")
    result = run("status", "--manifests", objects, "--kernel-state", str(saved),
                 "--hostname-override", "node-a", "-o", "json", "prod/web")  # fmt: skip
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == "ipvsproxy: error: no Service prod/web\n"


def test_wide_piped_is_never_cut(monkeypatch):
    """-o wide into a pipe or a file keeps every column whole (the terminal's width is for a
    terminal); the default table is still sized."""
    monkeypatch.setenv("COLUMNS", "80")
    examples = Path(__file__).parent.parent.parent / "examples"
    state = str(examples / "kernel-state.txt")
    args = ["status", "--manifests", str(examples), "--kernel-state", state,
            "--hostname-override", "node-a", "demo/web"]  # fmt: skip
    wide = run(*args, "-o", "wide").stdout.splitlines()
    assert max(map(len, wide)) > 100
    assert not any(line.endswith("~") for line in wide)
    assert "terminating, and ready endpoints exist" in "\n".join(wide)
    table = run(*args).stdout.splitlines()
    assert max(map(len, table)) <= 80
