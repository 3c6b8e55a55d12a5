"""The command line as a kube-proxy drop-in and as a tool to read: every kube-proxy v1.36 flag
is accepted (tests/data/kube-proxy-flags-v1.36.2.txt, taken from kube-proxy's source), the
ones with no meaning here are warned of once as --config's fields are, the logging options
work after the subcommand, and `--help` is grouped, complete and each command's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from ipvsproxy import agent, kpconfig
from ipvsproxy.cli import main
from ipvsproxy.cli.help import IGNORED, KUBE_PROXY, LOGGING

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "examples"
STATE = EXAMPLE / "kernel-state.txt"
FLAGS = Path(__file__).parent / "data" / "kube-proxy-flags-v1.36.2.txt"
KUBE_PROXY_FLAGS = [
    line.strip() for line in FLAGS.read_text().splitlines() if line.strip() and line[0] != "#"
]
# a value each flag without a default takes (the others are given their default)
SAMPLES = {
    "config": "/etc/kube-proxy/config.conf",
    "kubeconfig": "/var/lib/kube-proxy/kubeconfig.conf",
    "master": "https://10.0.0.1:6443",
    "hostname-override": "node-a",
    "detect-local-mode": "ClusterCIDR",
    "write-config-to": "/tmp/written.yaml",
    "feature-gates": "AllAlpha=false",
    "v": "2",
}


def invoke(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


def commands() -> list[click.Command]:
    assert isinstance(main, click.Group)
    return [main, *main.commands.values()]


def param_of(command: click.Command, name: str) -> click.Parameter:
    flag = f"--{name}" if len(name) > 1 else f"-{name}"
    found = [p for p in command.params if flag in p.opts or f"--{name}" in p.opts]
    if not found and name == "help":
        return command.get_help_option(click.Context(command))  # type: ignore[return-value]
    assert found, f"kube-proxy's --{name} is not an option of `{command.name}`"
    return found[0]


def test_the_vendored_list_is_kube_proxys():
    assert len(KUBE_PROXY_FLAGS) == len(set(KUBE_PROXY_FLAGS)) == 57
    for name in ("feature-gates", "bind-address", "master", "oom-score-adj", "kube-api-qps",
                 "kube-api-burst", "logging-format", "healthz-port", "v", "vmodule"):  # fmt: skip
        assert name in KUBE_PROXY_FLAGS


@pytest.mark.parametrize("name", KUBE_PROXY_FLAGS)
def test_every_kube_proxy_flag_is_accepted_by_run(name):
    """`--name=value` (or `--name` for a boolean) parses: no "No such option"."""
    run = main.commands["run"]
    param = param_of(run, name)
    if name in ("help", "version"):
        assert param.is_eager
        return
    if getattr(param, "is_flag", False) or getattr(param, "flag_value", None) is True:
        args = [f"--{name}"]
    else:
        value = SAMPLES.get(name, param.default)
        assert value is not None, name
        args = [f"--{name}={value}"]
    ctx = run.make_context("run", args)
    assert ctx.get_parameter_source(param.name) is click.core.ParameterSource.COMMANDLINE


@pytest.mark.parametrize(
    "name",
    ["masquerade-all", "ipvs-strict-arp", "conntrack-tcp-be-liberal", "cleanup", "init-only",
     "profiling", "iptables-localhost-nodeports", "bind-address-hard-fail",
     "log-text-split-stream"],
)  # fmt: skip
def test_boolean_flags_take_pflags_forms(name):
    """kube-proxy's booleans are pflag's: `--x`, `--x=true`, `--x=false`."""
    run = main.commands["run"]
    param = param_of(run, name)
    for arg, value in ((f"--{name}", True), (f"--{name}=true", True), (f"--{name}=false", False)):
        assert run.make_context("run", [arg]).params[param.name] is value


def test_every_option_of_every_command_has_help():
    missing = [
        f"{command.name}: {param.name}"
        for command in commands()
        for param in command.params
        if isinstance(param, click.Option) and not (param.help or "").strip()
    ]
    assert not missing


def test_help_is_grouped_in_sections():
    text = invoke("run", "--help").output
    titles = [f"{KUBE_PROXY}:", "ipvsproxy options:", "HTTP options (metrics, healthz):",
              f"{LOGGING}:", f"{IGNORED}:"]  # fmt: skip
    positions = [text.index(title) for title in titles]
    assert positions == sorted(positions)
    kube_proxy = text[positions[0] : positions[1]]
    own = text[positions[1] : positions[2]]
    assert "--ipvs-scheduler" in kube_proxy
    assert "--master" in kube_proxy
    assert "--backend" in own
    assert "--manifests" in own
    assert "--backend" not in kube_proxy
    assert "--feature-gates" in text[positions[4] :]
    assert "--metrics-bind-address" in text[positions[2] : positions[3]]
    assert "--logging-format" in text[positions[3] : positions[4]]
    for command in commands():
        for param in command.params:
            assert getattr(param, "section", None) is not None, (command.name, param.name)


@pytest.mark.parametrize(
    ("command", "absent"),
    [
        ("cleanup", ["--scheduler", "--backend", "--pod-bridge-interface", "--cluster-cidr",
                     "--hostname-override", "--no-fallback", "--masquerade-all", "--config",
                     "--kubeconfig", "--conntrack-min"]),
        ("prepare", ["--kubeconfig", "--manifests", "--backend", "--dummy-device", "--proxy-mode",
                     "--metrics-bind-address"]),
        ("diff", ["--conntrack-min", "--metrics-bind-address", "--once", "--sync-period",
                  "--feature-gates", "--cleanup"]),
    ],
)  # fmt: skip
def test_each_command_lists_only_its_own_options(command, absent):
    text = invoke(command, "--help").output
    for option in absent:
        assert f"{option} " not in text, (command, option)
        assert f"{option}," not in text, (command, option)


def agent_run(monkeypatch, *args: str) -> tuple[Any, Any, str]:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(agent, "run", lambda config, *, source: seen.update(c=config, s=source))
    monkeypatch.delenv("NODE_NAME", raising=False)
    result = CliRunner().invoke(main, ["run", *args])
    assert result.exit_code == 0, result.output
    return seen["c"], seen["s"], result.stderr


def test_flags_with_no_meaning_are_warned_of_once_like_the_fields(monkeypatch, tmp_path):
    """Named in one warning, with the words of --config's fields; kube-proxy's defaults (as
    a DaemonSet may spell them out) are not warned of."""
    _, _, quiet = agent_run(
        monkeypatch, "--kubeconfig", "kc", "--kube-api-qps=5", "--kube-api-burst=10",
        "--oom-score-adj=-999", "--bind-address=0.0.0.0", "--profiling=false",
        "--iptables-localhost-nodeports=true", "--config-sync-period=15m0s",
    )  # fmt: skip
    assert "ignored" not in quiet
    config = tmp_path / "config.conf"
    config.write_text(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
        "clientConnection: {qps: 50}\n"
    )
    _, _, stderr = agent_run(
        monkeypatch, "--kubeconfig", "kc", "--config", str(config), "--feature-gates=A=true",
        "--kube-api-qps=50", "--oom-score-adj=-500", "--vmodule=proxier=4", "--profiling",
    )  # fmt: skip
    lines = [line for line in stderr.splitlines() if "no meaning for ipvsproxy" in line]
    assert len(lines) == 2, stderr
    assert lines[0].endswith(
        "ignored (no meaning for ipvsproxy): --feature-gates, --profiling, --kube-api-qps, "
        "--oom-score-adj, --vmodule"
    )
    assert lines[1].endswith(f"--config {config}: ignored (no meaning for ipvsproxy): "
                             "clientConnection.qps")  # fmt: skip


def test_every_ignored_flag_is_one_kube_proxy_knows():
    assert set(kpconfig.IGNORED_FLAGS) <= set(KUBE_PROXY_FLAGS)


def test_master_goes_with_the_source(monkeypatch):
    _, source, _ = agent_run(monkeypatch, "--kubeconfig", "kc", "--master", "https://lb:6443")
    assert source == agent.Cluster(Path("kc"), None, "https://lb:6443")
    result = invoke("run", "--manifests", str(EXAMPLE), "--master", "https://lb:6443")
    assert result.exit_code == 2
    assert "exclude each other" in result.stderr


def test_cleanup_and_init_only_do_what_the_commands_do(monkeypatch):
    monkeypatch.setattr(agent, "run", lambda *a, **k: pytest.fail("the agent started"))
    monkeypatch.setattr(agent, "cleanup", lambda config, *, dry_run: ["IPVS: x"])
    monkeypatch.setattr(agent, "prepare_host", lambda config: ["ip_forward=1"])
    result = invoke("run", "--kubeconfig", "kc", "--cleanup")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == ["removed: IPVS: x", "removed 1 objects"]
    result = invoke("run", "--kubeconfig", "kc", "--init-only=true")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == ["ip_forward=1"]
    result = invoke("run", "--kubeconfig", "kc", "--write-config-to", "/tmp/x.yaml")
    assert result.exit_code == 2
    assert "--write-config-to: ipvsproxy writes no configuration file" in result.stderr


def test_the_deprecated_port_flags_complete_an_address_without_a_port(monkeypatch):
    config, _, _ = agent_run(monkeypatch, "--kubeconfig", "kc", "--healthz-port", "1234",
                             "--metrics-bind-address", "::1", "--metrics-port", "9999")  # fmt: skip
    assert config.healthz_bind_address == ("0.0.0.0", 10256)  # the address has a port: kept
    assert config.metrics_bind_address == ("::1", 9999)
    config, _, _ = agent_run(monkeypatch, "--kubeconfig", "kc", "--healthz-bind-address",
                             "10.0.0.1", "--healthz-port", "1234")  # fmt: skip
    assert config.healthz_bind_address == ("10.0.0.1", 1234)


@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("name", ["--log-format", "--logging-format"])
def test_logging_options_work_after_the_subcommand_too(where, name):
    """`ipvsproxy diff --log-format=json`: a warning logged by the command comes out as
    JSON, whichever side of the subcommand the option is on."""
    diff = [
        "diff",
        "--manifests",
        str(EXAMPLE),
        "--kernel-state",
        str(STATE),
        "--detect-local-mode",
        "ClusterCIDR",
    ]  # fmt: skip  (this logs a warning)
    args = [f"{name}=json", *diff] if where == "before" else [*diff, f"{name}=json"]
    if where == "before" and name == "--logging-format":
        args = ["--logging-format", "json", *diff]
    result = invoke(*args)
    assert result.exit_code == 1, result.output
    logged = [line for line in result.stderr.splitlines() if "detect-local-mode" in line]
    assert logged, result.stderr
    assert logged[0].startswith('{"'), result.stderr


def test_the_level_after_the_subcommand_wins():
    diff = ["diff", "--manifests", str(EXAMPLE), "--kernel-state", str(STATE),
            "--detect-local-mode", "ClusterCIDR"]  # fmt: skip
    assert (
        "detect-local-mode" in invoke("--log-level", "error", *diff, "--log-level", "info").stderr
    )
    assert "detect-local-mode" not in invoke(*diff, "--log-level", "error").stderr
    for command in (["cleanup", "--dry-run"], ["prepare"]):
        ctx = main.commands[command[0]].make_context(command[0], ["--log-level=debug", "-v", "4"])
        assert ctx.params["log_level"] == "debug"


def test_the_warnings_of_the_command_line_come_in_the_format_it_asks_for(monkeypatch):
    _, _, stderr = agent_run(monkeypatch, "--kubeconfig", "kc", "--kube-api-qps=50",
                             "--logging-format=json")  # fmt: skip
    warned = [line for line in stderr.splitlines() if "no meaning for ipvsproxy" in line]
    assert len(warned) == 1, stderr
    assert warned[0].startswith('{"'), stderr


def test_cleanup_keep_ipvs_asks_for_the_rules_only(monkeypatch):
    asked: list[bool] = []

    def cleanup(config, *, dry_run, ipvs, force=False):
        asked.append(ipvs)
        return []

    monkeypatch.setattr(agent, "cleanup", cleanup)
    assert invoke("cleanup", "--keep-ipvs", "--dry-run").exit_code == 0
    assert invoke("cleanup", "--dry-run").exit_code == 0
    assert asked == [False, True]
    refused = invoke("cleanup", "--keep-ipvs", "--kube-proxy")
    assert refused.exit_code == 2
    assert "--keep-ipvs" in refused.output


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["run", "--masquerade-bit", "99"],
         "--masquerade-bit: 99 is not in the range 0<=x<=31 (see 'main run -h')"),
        (["--log-level", "x", "run"],
         "--log-level: 'x' is not one of 'debug', 'info', 'warning', 'error' (see 'main -h')"),
        (["diff", "--bogus"], "no such option '--bogus' (see 'main diff -h')"),
        (["nosuch"], "no such command 'nosuch' (see 'main -h')"),
        (["run", "--sync-period"], "option '--sync-period' requires an argument"),
    ],
)  # fmt: skip
def test_usage_errors_are_one_line_as_the_other_errors(args, line):
    result = invoke(*args)
    assert result.exit_code == 2  # click's
    assert result.stderr == f"ipvsproxy: error: {line}\n"


def test_help_and_a_bare_group_are_left_to_click():
    assert invoke("run", "--help").stdout.startswith("Usage: main run [OPTIONS]")
    result = invoke()
    assert "Commands:" in result.output
    assert "ipvsproxy: error" not in result.output


def test_prepare_help_names_the_agents_capabilities_as_the_daemonset_grants_them():
    import yaml

    daemonset = yaml.safe_load((ROOT / "deploy/base/objects/daemonset.yaml").read_text())
    (agent_container,) = daemonset["spec"]["template"]["spec"]["containers"]
    added = agent_container["securityContext"]["capabilities"]["add"]
    count = {1: "one", 2: "two", 3: "three", 4: "four"}[len(added)]
    text = " ".join(invoke("prepare", "--help").stdout.split())
    assert f"runs with {count} capabilities ({', '.join(added)})" in text
