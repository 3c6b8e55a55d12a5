"""`ipvsproxy diff`: readable and JSON output, exit codes 0/1/2, clear errors."""

from __future__ import annotations

import json
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ipvsproxy.cli import main
from ipvsproxy.config import Config
from ipvsproxy.saved_table import render_save
from tests.factories import desired_from_manifests

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "examples"
STATE = EXAMPLE / "kernel-state.txt"
NODE = ["--hostname-override", "node-a", "--service-cidr", "10.96.0.0/16"]


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_diff_readable_plan_and_exit_1():
    result = run("diff", "--manifests", str(EXAMPLE), "--kernel-state", str(STATE), *NODE)
    assert result.exit_code == 1, result.output
    out = result.stdout
    assert "~ ipvsadm -E -t 10.96.0.10:80 -s rr" in out
    assert "# demo/web:http (was: -t 10.96.0.10:80 -s wlc)" in out
    assert "+ ipvsadm -A -t 172.31.0.10:30080 -s rr -p 600" in out
    assert "- ipvsadm -d -t 10.96.0.10:80 -r 10.244.1.9:8000" in out
    assert "- ipvsadm -D -t 10.96.0.99:8080" in out
    # foreign: keepalived-style VIP and a fwmark service are never in the plan
    assert "192.168.7.100" not in out
    assert "-f 100" not in out
    assert out.strip().splitlines()[-1].startswith("Plan: 30 to add, 1 to change, 2 to delete")
    assert "demo/signalling" in result.stderr
    assert "'fastest'" in result.stderr


def test_diff_json():
    result = run(
        "diff", "-o", "json", "--manifests", str(EXAMPLE), "--kernel-state", str(STATE), *NODE
    )
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["in_sync"] is False
    assert doc["summary"]["add-service"] == 11
    assert doc["summary"]["delete-service"] == 1
    first = doc["operations"][0]
    assert first == {
        "op": "update-service",
        "command": "ipvsadm -E -t 10.96.0.10:80 -s rr",
        "cause": "demo/web:http",
        "before": "-t 10.96.0.10:80 -s wlc",
    }
    assert any("fastest" in w for w in doc["warnings"])


def test_diff_in_sync_exits_0(tmp_path):
    desired, _ = desired_from_manifests([EXAMPLE], Config(node_name="node-a"))
    saved = tmp_path / "saved.txt"
    saved.write_text(render_save(desired.state))
    result = run("diff", "--manifests", str(EXAMPLE), "--kernel-state", str(saved), *NODE)
    assert result.exit_code == 0, result.output
    assert "In sync: no changes." in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kernel-state", "/nonexistent"], "cannot read"),
        (["--scheduler", "fastest"], "--scheduler: 'fastest' is not an IPVS scheduler"),
        (["--nodeport-addresses", "10.0.0.0/33"], "--nodeport-addresses: '10.0.0.0/33'"),
        (["--service-node-port-range", "3-2"], "--service-node-port-range"),
        (["--cluster-cidr", "10.244.0.0/33"], "--cluster-cidr: '10.244.0.0/33'"),
        (["--first-services", "kube-dns"], "--first-services: 'kube-dns' is not NAMESPACE/NAME"),
        (
            ["--detect-local-mode", "InterfaceNamePrefix"],
            "--detect-local-mode InterfaceNamePrefix needs --pod-interface-name-prefix",
        ),
        (["--backend", "ipvs"], "IPVS"),  # no saved table: the live kernel, which lacks IPVS
    ],
)
def test_diff_errors_exit_2_with_one_clear_line(args, message):
    live = "--kernel-state" in args or "--backend" in args
    state = [] if live else ["--kernel-state", str(STATE)]
    result = run("diff", "--manifests", str(EXAMPLE), *state, *args)
    assert result.exit_code == 2
    assert message in result.stderr
    assert "Traceback" not in result.output


def test_diff_bad_manifest_exits_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: Service\nmetadata: {name: x\n")
    result = run("diff", "--manifests", str(bad), "--kernel-state", str(STATE))
    assert result.exit_code == 2
    assert "bad.yaml: invalid YAML" in result.stderr
    assert "Traceback" not in result.output


def test_diff_bad_kernel_state_exits_2(tmp_path):
    bad = tmp_path / "state.txt"
    bad.write_text("-A -t 10.0.0.1:80 -s rr\n-a -t 10.0.0.1:80 -r nonsense -m\n")
    result = run("diff", "--manifests", str(EXAMPLE), "--kernel-state", str(bad))
    assert result.exit_code == 2
    assert "line 2" in result.stderr


def test_malformed_object_in_manifests_is_a_warning_not_an_error(tmp_path):
    (tmp_path / "svc.yaml").write_text(
        "kind: Service\nmetadata: {name: bad, namespace: x}\n"
        "spec: {clusterIP: 10.96.0.1, ports: [{port: 0}]}\n---\n"
        "kind: Service\nmetadata: {name: good, namespace: x}\n"
        "spec: {clusterIP: 10.96.0.2, ports: [{port: 80}]}\n"
    )
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    result = run("diff", "--manifests", str(tmp_path / "svc.yaml"), "--kernel-state", str(empty))
    assert result.exit_code == 1
    assert "ipvsadm -A -t 10.96.0.2:80 -s rr  # x/good:80" in result.stdout
    assert "skipping malformed Service x/bad: spec.ports[0].port 0" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sync-period", "soon"], "--sync-period: 'soon' is not a duration"),
        (["--min-sync-period", "1m", "--sync-period", "30s"], "--min-sync-period: '1m' is longer"),
        (["--sync-period", "0s"], "--sync-period: must be positive"),
        (["--metrics-bind-address", "localhost"], "is not ADDRESS:PORT"),
        (["--healthz-bind-address", "1.2.3.4:70000"], "is not ADDRESS:PORT"),
        (["--kubeconfig", "/nonexistent", "--manifests", "x"], "exclude each other"),
        (["--kubeconfig", "/nonexistent", "--once"], "--once needs --manifests"),
        (["--slow-start", "2h"], "--slow-start: '2h' is longer than 3600s"),
        (["--slow-start", "warm"], "--slow-start: 'warm' is not a duration"),
    ],
)
def test_run_rejects_bad_options_clearly(args, message):
    result = run("run", *args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert "Traceback" not in result.output


def test_run_hands_the_parsed_config_and_source_to_the_agent(monkeypatch):
    from ipvsproxy import agent

    seen: dict[str, Any] = {}
    monkeypatch.setattr(agent, "run", lambda config, *, source: seen.update(c=config, s=source))
    monkeypatch.setenv("NODE_NAME", "node-from-env")
    result = run(
        "run", "--kubeconfig", "kc.yaml", "--context", "prod", "--min-sync-period", "500ms",
        "--sync-period", "1m30s", "--drain-timeout", "0", "--metrics-bind-address", "[::1]:0",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    config = seen["c"]
    assert (config.min_sync_period, config.sync_period, config.drain_timeout) == (0.5, 90, 0)
    assert config.metrics_bind_address == ("::1", 0)
    assert config.healthz_bind_address == ("0.0.0.0", 10256)  # kube-proxy's default
    assert config.node_name == "node-from-env"
    assert seen["s"] == agent.Cluster(Path("kc.yaml"), "prod")


def test_slow_start_is_off_by_default_and_warned_about_with_a_scheduler_ignoring_weights(
    monkeypatch,
):
    from ipvsproxy import agent

    seen: list[Config] = []
    monkeypatch.setattr(agent, "run", lambda config, *, source: seen.append(config))
    result = run("run", "--kubeconfig", "kc.yaml")
    assert (result.exit_code, seen[-1].slow_start) == (0, 0)
    assert "slow start" not in result.stderr
    result = run("run", "--kubeconfig", "kc.yaml", "--slow-start", "1m30s", "--scheduler", "wrr")
    assert (result.exit_code, seen[-1].slow_start) == (0, 90)
    assert "slow start" not in result.stderr
    result = run("run", "--kubeconfig", "kc.yaml", "--slow-start", "30s")
    # kept: a Service choosing wrr by annotation still ramps
    assert (result.exit_code, seen[-1].slow_start) == (0, 30)
    assert "--slow-start: slow start has no effect with scheduler rr" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (["--backend", "ipvs"], 3, "IPVS"),
        (["--no-fallback"], 4, "--no-fallback forbids the iptables fallback"),
    ],
)
def test_run_without_ipvs_exits_before_touching_anything(args, status, message):
    """This host's kernel has no IPVS: --backend ipvs exits 3, auto with --no-fallback 4."""
    from pathlib import Path as P

    if P("/proc/net/ip_vs").exists():
        pytest.skip("this kernel has IPVS")
    result = run("run", "--manifests", str(EXAMPLE), "--metrics-bind-address", "127.0.0.1:0",
                 "--healthz-bind-address", "127.0.0.1:0", *args)  # fmt: skip
    assert result.exit_code == status, result.output
    assert message in result.stderr
    assert "Traceback" not in result.output


def test_run_once_exit_codes(monkeypatch):
    from ipvsproxy import agent
    from ipvsproxy.errors import KernelUnavailable, NotFound
    from ipvsproxy.kernel import ApplyReport, Failure
    from ipvsproxy.model import EMPTY, UnbindAddress
    from ipvsproxy.proxier import PassResult
    from ipvsproxy.sync.ipvs_pass import IpvsResult

    def unavailable(config, *, manifest_paths):
        raise KernelUnavailable("the kernel has no IPVS")

    monkeypatch.setattr(agent, "run_once", unavailable)
    result = run("run", "--once", "--manifests", str(EXAMPLE))
    assert result.exit_code == 3
    assert "the kernel has no IPVS" in result.stderr

    op = UnbindAddress(ip_address("10.96.0.1"))
    failed = PassResult(
        True, IpvsResult((op,), ApplyReport(0, (Failure(op, NotFound("gone")),)), EMPTY)
    )
    monkeypatch.setattr(agent, "run_once", lambda config, *, manifest_paths: failed)
    result = run("run", "--once", "--manifests", str(EXAMPLE))
    assert result.exit_code == 1
    assert "failed: gone" in result.stderr

    done = PassResult(True, IpvsResult((op,), ApplyReport(1), EMPTY))
    monkeypatch.setattr(agent, "run_once", lambda config, *, manifest_paths: done)
    result = run("run", "--once", "--manifests", str(EXAMPLE), "--tcp-timeout", "900s")
    assert result.exit_code == 0
    assert "applied 1 of 1 operations" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pod-interface-name-prefix", "a" * 15], "holds at most 14"),  # + the wildcard
        (["--pod-interface-name-prefix", "veth+"], "without the '+'"),
        (["--pod-interface-name-prefix", "veth -j ACCEPT"], "contains ' '"),
        (["--pod-interface-name-prefix", "ve\nth"], "not allowed in an interface name prefix"),
        (["--pod-interface-name-prefix", 'v"e'], "contains '\"'"),
        (["--pod-interface-name-prefix", "!veth"], "contains '!'"),
        (["--pod-interface-name-prefix", "é" * 8], "16 bytes"),  # bytes, not characters
        (["--pod-bridge-interface", "a" * 16], "holds at most 15"),
        (["--pod-bridge-interface", "cni/0"], "contains '/'"),
        (["--pod-bridge-interface", "cni:0"], "contains ':'"),
        (["--pod-bridge-interface", ".."], "not a valid interface name"),
        (["--pod-bridge-interface", "br#0"], "contains '#'"),
        (["--dummy-device", "kube ipvs0"], "--dummy-device"),
    ],
)
def test_interface_names_are_checked_as_the_kernel_does_exit_2(args, message):
    """Every interface name ipvsproxy writes into iptables-restore input (or gives the
    kernel) is checked first: a clear one-line error and exit 2, never a traceback, for
    `diff`, `run` and `cleanup` (which takes only the dummy device's) alike."""
    mode = ["--detect-local-mode", "InterfaceNamePrefix"] if "prefix" in args[0] else []
    commands = [
        ["diff", "--manifests", str(EXAMPLE), "--kernel-state", str(STATE)],
        ["run", "--once", "--manifests", str(EXAMPLE)],
    ]
    if args[0] == "--dummy-device":
        commands.append(["cleanup", "--dry-run"])
    for command in commands:
        result = run(*command, *mode, *args)
        assert result.exit_code == 2, (command, result.output)
        assert args[0] in result.stderr
        assert message in result.stderr
        assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("name", "prefix"),
    [("veth", True), ("a" * 14, True), ("cali", True), ("cni0", False), ("a" * 15, False),
     ("br-1.2_x@y", False), ("é" * 7, True)],
)  # fmt: skip
def test_valid_interface_names_pass(name, prefix):
    from ipvsproxy.config import parse_interface_name

    assert parse_interface_name(name, option="--x", prefix=prefix) == name


def test_run_refuses_to_start_without_the_firewall_tools_exit_5(monkeypatch, tmp_path):
    """`run` exits 5, naming the tool, when IPVS is usable but its firewall rules are not."""
    from ipvsproxy import agent
    from ipvsproxy.backends import FirewallUnavailable

    def refused(*args: Any, **kwargs: Any) -> None:
        raise FirewallUnavailable("iptables-restore not found on PATH")

    monkeypatch.setattr(agent, "run_once", refused)
    monkeypatch.setattr(agent, "run", refused)
    for args in (["--once", "--manifests", str(EXAMPLE)], ["--manifests", str(EXAMPLE)]):
        result = run("run", *args)
        assert result.exit_code == 5, result.output
        assert "iptables-restore not found on PATH" in result.stderr
        assert "Traceback" not in result.output


def test_the_firewall_flag_is_passed_and_its_help_says_what_is_lost(monkeypatch):
    from ipvsproxy import agent

    seen: list[Config] = []
    monkeypatch.setattr(agent, "run", lambda config, source: seen.append(config))
    assert run("run", "--manifests", str(EXAMPLE)).exit_code == 0
    assert run("run", "--manifests", str(EXAMPLE), "--allow-no-firewall-rules").exit_code == 0
    assert [config.allow_no_firewall for config in seen] == [False, True]
    text = " ".join(run("run", "--help").output.split())
    assert "--allow-no-firewall-rules" in text
    assert "no VIP port filter, no loadBalancerSourceRanges, no masquerade" in text


def test_run_takes_kube_proxys_conntrack_flags_with_its_defaults(monkeypatch):
    from ipvsproxy import agent

    seen: dict[str, Any] = {}
    monkeypatch.setattr(agent, "run", lambda config, *, source: seen.update(c=config))
    assert run("run", "--kubeconfig", "kc.yaml").exit_code == 0
    default = seen["c"]
    assert (default.conntrack_max_per_core, default.conntrack_min) == (32768, 131072)
    assert default.conntrack_tcp_timeout_established == 86400
    assert default.conntrack_tcp_timeout_close_wait == 3600
    assert not default.conntrack_tcp_be_liberal
    assert (default.conntrack_udp_timeout, default.conntrack_udp_timeout_stream) == (0, 0)
    result = run(
        "run", "--kubeconfig", "kc.yaml", "--conntrack-max-per-core", "0",
        "--conntrack-min", "1000", "--conntrack-tcp-timeout-established", "2h30m",
        "--conntrack-tcp-timeout-close-wait", "0s", "--conntrack-tcp-be-liberal",
        "--conntrack-udp-timeout", "1m30s",
        "--conntrack-udp-timeout-stream", "1500ms",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    config = seen["c"]
    assert (config.conntrack_max_per_core, config.conntrack_min) == (0, 1000)
    assert config.conntrack_tcp_timeout_established == 9000
    assert config.conntrack_tcp_timeout_close_wait == 0
    assert config.conntrack_tcp_be_liberal
    assert config.conntrack_udp_timeout == 90
    assert config.conntrack_udp_timeout_stream == 1  # whole seconds, as kube-proxy truncates


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--conntrack-udp-timeout", "soon"], "--conntrack-udp-timeout: 'soon' is not a duration"),
        (["--conntrack-max-per-core", "-1"], "--conntrack-max-per-core"),
    ],
)
def test_bad_conntrack_flags_exit_2(args, message):
    result = run("run", "--kubeconfig", "kc.yaml", *args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr


def test_prepare_takes_the_conntrack_flags_too(monkeypatch):
    """The privileged init container makes the writes the agent (read-only /proc/sys)
    cannot, so it needs the same flags."""
    from ipvsproxy import agent

    seen: dict[str, Any] = {}
    monkeypatch.setattr(agent, "prepare_host", lambda config: seen.update(c=config) or ["ok"])
    result = run("prepare", "--conntrack-min", "262144", "--conntrack-tcp-be-liberal")
    assert result.exit_code == 0, result.output
    assert seen["c"].conntrack_min == 262144
    assert seen["c"].conntrack_tcp_be_liberal
    assert seen["c"].conntrack_tcp_timeout_established == 86400


@pytest.mark.parametrize("content", [None, "not: [a kubeconfig", "apiVersion: v1\nkind: Config\n"])
def test_run_changes_nothing_on_the_node_before_the_credentials_load(
    monkeypatch, tmp_path, content
):
    """A missing or malformed kubeconfig fails (exit 2, one line) before the backend's probe
    or any kernel setting (ip_forward, conntrack) is written."""
    from ipvsproxy import agent, backends

    touched: list[str] = []

    def record(name: str) -> Any:
        def touch(*args: Any, **kwargs: Any) -> Any:
            touched.append(name)
            raise AssertionError(f"{name} called before the credentials were loaded")

        return touch

    monkeypatch.setattr(agent, "open_backend", record("open_backend"))
    monkeypatch.setattr(agent, "prepare", record("prepare"))
    monkeypatch.setattr(backends, "prepare_node", record("prepare_node"))
    kubeconfig = tmp_path / "kubeconfig"
    if content is not None:
        kubeconfig.write_text(content)
    result = run("run", "--kubeconfig", str(kubeconfig), "--healthz-bind-address", "127.0.0.1:0",
                 "--metrics-bind-address", "127.0.0.1:0")  # fmt: skip
    assert result.exit_code == 2, result.output
    assert touched == []
    assert str(kubeconfig) in result.stderr
    assert "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1


def test_an_empty_apiserver_host_names_the_configmap_key_in_one_json_line(tmp_path):
    """The DaemonSet's ConfigMap as shipped (apiserver-host ""): the agent's last words name
    the key to set and, under --log-format json (the DaemonSet's), are one JSON object."""
    env = {"KUBERNETES_SERVICE_HOST": "", "KUBERNETES_SERVICE_PORT": "6443", "HOME": str(tmp_path)}
    args = ["diff", "--kernel-state", str(STATE), *NODE]
    result = CliRunner().invoke(main, ["--log-format", "json", *args], env=env)
    assert result.exit_code == 2
    (line,) = result.stderr.splitlines()
    entry = json.loads(line)
    assert (entry["level"], entry["logger"]) == ("error", "ipvsproxy")
    assert entry["msg"].startswith("KUBERNETES_SERVICE_HOST is set but empty")
    assert "key 'apiserver-host' of ConfigMap 'ipvsproxy'" in entry["msg"]
    result = CliRunner().invoke(main, args, env=env)  # text: the usual one line
    assert result.exit_code == 2
    assert result.stderr.startswith("ipvsproxy: error: KUBERNETES_SERVICE_HOST is set but empty")
    assert result.stderr.count("\n") == 1


def duration_flags(command: str) -> list[str]:
    """The options of `command` that take a duration and mean something here."""
    from ipvsproxy.cli.help import IGNORED

    cmd = main.commands[command]
    return [
        p.opts[0]
        for p in cmd.params
        if getattr(p, "metavar", None) == "DURATION" and getattr(p, "section", "") != IGNORED
    ]


@pytest.mark.parametrize("flag", [*duration_flags("run"), "--interval"])
def test_a_duration_without_a_unit_is_refused_as_kube_proxy_refuses_it(monkeypatch, flag):
    """Go's time.ParseDuration takes `30s`, and `0`, never `30`: every duration flag says so
    in one line naming itself."""
    from ipvsproxy import agent

    monkeypatch.setattr(agent, "run", lambda config, *, source: None)
    command = "status" if flag == "--interval" else "run"
    result = run(command, "--manifests", str(EXAMPLE), flag, "30")
    assert result.exit_code == 2
    assert result.stderr == (
        f"ipvsproxy: error: {flag}: '30' has no unit: give a duration like 30s, 500ms or 1m30s\n"
    )
    if command == "run":  # 0 is a duration (--sync-period's own check refuses it)
        assert "unit" not in run(command, "--manifests", str(EXAMPLE), flag, "0").stderr


def test_a_config_files_duration_without_a_unit_is_refused_naming_the_field(tmp_path):
    """kube-proxy's file has metav1.Durations: the same rule as the flags."""
    path = tmp_path / "kp.yaml"
    path.write_text(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
        'ipvs:\n  syncPeriod: "30"\n'  # a number (30) is refused as one already
    )
    result = run("run", "--manifests", str(EXAMPLE), "--config", str(path))
    assert result.exit_code == 2
    assert result.stderr == (
        f"ipvsproxy: error: --config {path}: field ipvs.syncPeriod: '30' has no unit: give a "
        "duration like 30s, 500ms or 1m30s\n"
    )


EXTERNAL = (
    "kind: Service\nmetadata: {name: web, namespace: x}\n"
    "spec: {clusterIP: 10.96.0.2, externalIPs: [198.51.100.7, 203.0.113.9, '2001:db8::7'],"
    " ports: [{port: 80}]}\n"
)


@pytest.mark.parametrize(
    ("cidrs", "programmed", "refused"),
    [
        ([], ["198.51.100.7", "203.0.113.9"], []),  # default: any externalIP, as kube-proxy
        (
            ["--external-ip-cidrs", "198.51.100.0/24"],
            ["198.51.100.7"],
            ["203.0.113.9", "2001:db8::7"],
        ),  # fmt: skip
        (
            ["--external-ip-cidrs", " 198.51.100.7/32 , 2001:db8::/32"],
            ["198.51.100.7"],
            ["203.0.113.9"],
        ),  # fmt: skip
        (["--external-ip-cidrs", "none"], [], ["198.51.100.7", "203.0.113.9", "2001:db8::7"]),
    ],
)
def test_diff_refuses_external_ips_outside_the_allowed_ranges(tmp_path, cidrs, programmed, refused):
    (tmp_path / "svc.yaml").write_text(EXTERNAL)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    result = run("diff", "--manifests", str(tmp_path / "svc.yaml"), "--kernel-state", str(empty),
                 *cidrs)  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "ipvsadm -A -t 10.96.0.2:80" in result.stdout
    for ip in programmed:
        assert f"ipvsadm -A -t {ip}:80" in result.stdout
    for ip in refused:
        assert f" {ip}:80" not in result.stdout
        assert f"Service x/web: externalIP {ip} is outside --external-ip-cidrs" in result.stderr
    assert result.stderr.count("--external-ip-cidrs") == len(refused)


@pytest.mark.parametrize("command", ["run", "diff", "status"])
@pytest.mark.parametrize("bad", ["198.51.100.0/33", "10.0.0.0/8,nonsense", "2001:db8::/129"])
def test_a_bad_external_ip_cidr_is_one_clear_line_and_exit_2(command, bad):
    result = run(command, "--external-ip-cidrs", bad)
    assert result.exit_code == 2, result.output
    assert "--external-ip-cidrs: " in result.stderr
    assert "is not a CIDR" in result.stderr
    assert "Traceback" not in result.output
