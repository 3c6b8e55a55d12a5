"""kube-proxy's configuration file (`--config`) and flag names: the two real files of
tests/data/kube-proxy-config (written by kube-proxy v1.36.2 and by kubeadm v1.36.2), the
precedence of command line over file over defaults, and a kube-proxy DaemonSet's
arguments."""

from __future__ import annotations

import json
from ipaddress import ip_network
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from ipvsproxy import kpconfig
from ipvsproxy.cli import main
from ipvsproxy.errors import ConfigError
from ipvsproxy.schedulers import Scheduler

FILES = Path(__file__).parent / "data" / "kube-proxy-config"
WRITTEN = FILES / "written-by-kube-proxy-v1.36.2.yaml"
KUBEADM = FILES / "kubeadm-v1.36.2-init-defaults.yaml"


def agent_config(monkeypatch, *args: str) -> tuple[Any, Any]:
    """What `ipvsproxy run ARGS` hands the agent (its config and source)."""
    config, source, _ = agent_run(monkeypatch, *args)
    return config, source


def agent_run(monkeypatch, *args: str) -> tuple[Any, Any, str]:
    """`agent_config`, with what the command wrote to stderr."""
    from ipvsproxy import agent

    seen: dict[str, Any] = {}
    monkeypatch.setattr(agent, "run", lambda config, *, source: seen.update(c=config, s=source))
    monkeypatch.delenv("NODE_NAME", raising=False)
    result = CliRunner().invoke(main, ["run", *args])
    assert result.exit_code == 0, result.output
    return seen["c"], seen["s"], result.stderr


def test_the_file_kube_proxy_writes_loads_with_every_meaningful_field(monkeypatch):
    config, _ = agent_config(monkeypatch, "--config", str(WRITTEN))
    assert config.scheduler is Scheduler.LC
    assert config.strict_arp is True
    assert config.cluster_cidrs == (ip_network("10.244.0.0/16"),)
    assert config.detect_local_mode == "ClusterCIDR"
    assert (config.sync_period, config.min_sync_period) == (30, 1)
    assert config.healthz_bind_address == ("0.0.0.0", 10256)
    assert config.metrics_bind_address == ("127.0.0.1", 10249)
    assert (config.conntrack_max_per_core, config.conntrack_min) == (32768, 131072)
    assert config.conntrack_tcp_timeout_established == 86400
    assert config.conntrack_tcp_timeout_close_wait == 3600
    assert config.masquerade_bit == 14


def test_cluster_cidr_detection_without_a_cluster_cidr_detects_nothing_as_kube_proxy(
    monkeypatch, tmp_path
):
    """`kube-proxy --write-config-to` without --cluster-cidr writes `detectLocalMode:
    ClusterCIDR` with `clusterCIDR: ""`; kube-proxy runs with it, detecting nothing as local
    (a no-op detector) and saying so once: so does ipvsproxy, instead of refusing it."""
    written = tmp_path / "config.conf"
    written.write_text(WRITTEN.read_text().replace("clusterCIDR: 10.244.0.0/16", 'clusterCIDR: ""'))
    config, _, stderr = agent_run(monkeypatch, "--config", str(written))
    assert config.detect_local_mode == ""
    assert config.cluster_cidrs == ()
    assert stderr.count("detect-local-mode ClusterCIDR without a cluster CIDR") == 1


def test_kubeadms_file_loads_its_zero_values_unset(monkeypatch):
    loaded = kpconfig.load(KUBEADM)
    assert loaded.ignored == ()
    config, source = agent_config(monkeypatch, "--config", str(KUBEADM))
    assert source.kubeconfig == Path("/var/lib/kube-proxy/kubeconfig.conf")
    assert config.scheduler is Scheduler.RR  # "" -> the default
    assert (config.sync_period, config.min_sync_period) == (30, 1)
    assert config.masquerade_bit == 14  # null -> the default
    assert config.conntrack_max_per_core == 32768
    assert config.healthz_bind_address == ("0.0.0.0", 10256)


def test_a_flag_on_the_command_line_wins_over_the_file(monkeypatch):
    config, source = agent_config(
        monkeypatch, "--config", str(WRITTEN), "--ipvs-scheduler", "sh",
        "--sync-period", "1m", "--kubeconfig", "mine.conf",
    )  # fmt: skip
    assert config.scheduler is Scheduler.SH
    assert config.sync_period == 60
    assert config.strict_arp is True  # not on the command line: the file's
    assert source.kubeconfig == Path("mine.conf")


def test_the_environment_wins_over_the_file(monkeypatch, tmp_path):
    path = tmp_path / "config.conf"
    doc = yaml.safe_load(WRITTEN.read_text())
    doc["hostnameOverride"] = "from-file"
    path.write_text(json.dumps(doc))
    config, _ = agent_config(monkeypatch, "--config", str(path))
    assert config.node_name == "from-file"
    monkeypatch.setenv("NODE_NAME", "from-env")
    from ipvsproxy import agent

    seen: dict[str, Any] = {}
    monkeypatch.setattr(agent, "run", lambda config, *, source: seen.update(c=config))
    assert CliRunner().invoke(main, ["run", "--config", str(path)]).exit_code == 0
    assert seen["c"].node_name == "from-env"


def test_a_kube_proxy_daemonsets_arguments_work_as_they_are(monkeypatch):
    config, _ = agent_config(
        monkeypatch,
        "--proxy-mode=ipvs", "--v=2", "--hostname-override=node-a",
        "--ipvs-scheduler=wrr", "--ipvs-strict-arp", "--ipvs-exclude-cidrs=10.0.0.0/8",
        "--ipvs-sync-period=45s", "--ipvs-min-sync-period=2s", "--ipvs-tcp-timeout=15m0s",
        "--ipvs-tcpfin-timeout=30s", "--ipvs-udp-timeout=5m", "--iptables-masquerade-bit=15",
        "--masquerade-all", "--cluster-cidr=10.244.0.0/16",
        "--conntrack-tcp-timeout-established=12h0m0s",
    )  # fmt: skip
    assert config.node_name == "node-a"
    assert config.scheduler is Scheduler.WRR
    assert config.strict_arp is True
    assert config.exclude_cidrs == (ip_network("10.0.0.0/8"),)
    assert (config.sync_period, config.min_sync_period) == (45, 2)
    assert (config.tcp_timeout, config.tcp_fin_timeout, config.udp_timeout) == (900, 30, 300)
    assert (config.masquerade_bit, config.masquerade_all) == (15, True)
    assert config.conntrack_tcp_timeout_established == 43200


def test_v_4_logs_at_debug_level(monkeypatch):
    import logging

    agent_config(monkeypatch, "--v=4")
    assert logging.getLogger().level == logging.DEBUG
    agent_config(monkeypatch, "--v=2")
    assert logging.getLogger().level == logging.INFO


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mode": "kernelspace"}, "field mode: 'kernelspace': not a mode of kube-proxy on Linux"),
        ({"kind": "KubeletConfiguration"}, "expected kubeproxy.config.k8s.io/v1alpha1"),
        ({"ipvs": {"schedular": "rr"}}, "field ipvs.schedular: unknown field"),
        ({"nodePortAdresses": []}, "field nodePortAdresses: unknown field"),
        ({"ipvs": {"strictARP": "yes"}}, "field ipvs.strictARP: expected true or false"),
        ({"conntrack": {"min": -1}}, "field conntrack.min: expected a non-negative integer"),
        ({"ipvs": {"scheduler": 5}}, "field ipvs.scheduler: expected a string, got int"),
        ({"ipvs": {"scheduler": "fastest"}}, "field ipvs.scheduler: 'fastest' is not an IPVS"),
        ({"ipvs": {"syncPeriod": "soon"}}, "field ipvs.syncPeriod: 'soon' is not a duration"),
        ({"ipvs": {"minSyncPeriod": "2m"}}, "field ipvs.minSyncPeriod: '2m' is longer than"),
        ({"ipvs": {"tcpTimeout": "1x"}}, "field ipvs.tcpTimeout: '1x' is not a duration"),
        ({"ipvs": {"excludeCIDRs": ["10.0.0.0/33"]}}, "field ipvs.excludeCIDRs: '10.0.0.0/33'"),
        ({"ipvs": []}, "field ipvs: expected an object"),
        ({"iptables": {"masqueradeBit": 40}}, "field iptables.masqueradeBit: 40 is not in"),
        ({"detectLocalMode": "Pods"}, "field detectLocalMode: 'Pods' is not one of"),
        ({"detectLocalMode": "BridgeInterface"},
         "field detectLocalMode: BridgeInterface needs detectLocal.bridgeInterface"),
        ({"detectLocal": {"interfaceNamePrefix": "veth+"}},
         "field detectLocal.interfaceNamePrefix: give the prefix without the '+'"),
        ({"clusterCIDR": "10.244.0.0/99"}, "field clusterCIDR: '10.244.0.0/99' is not a CIDR"),
        ({"metricsBindAddress": "localhost"}, "field metricsBindAddress: 'localhost' is not"),
        ({"conntrack": {"udpTimeout": "forever"}}, "field conntrack.udpTimeout: 'forever'"),
        ({"logging": {"format": "xml"}}, "field logging.format: 'xml' is not one of"),
        ({"nodePortAddresses": ["300.0.0.0/8"]}, "field nodePortAddresses: '300.0.0.0/8'"),
    ],
)  # fmt: skip
def test_a_bad_file_is_one_clear_error_naming_the_file_and_the_field(tmp_path, change, message):
    """Exit 2, one line naming the file and the field (not the flag that means the same),
    no traceback: for wrong types, unknown fields and values the flag would refuse."""
    doc = yaml.safe_load(WRITTEN.read_text())
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            doc[key].update(value)
        else:
            doc[key] = value
    path = tmp_path / "config.conf"
    path.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(main, ["run", "--config", str(path)])
    assert result.exit_code == 2, result.output
    if "kind" not in change:
        assert f"--config {path}: {message}" in result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize("mode", ["", "ipvs", "iptables", "nftables"])
def test_kube_proxys_file_in_any_of_its_modes_is_read(tmp_path, mode):
    """The overlays read kube-proxy's own ConfigMap while a cluster moves node by node, so
    its mode is kube-proxy's (kubeadm's file says iptables mode as ""): each is accepted,
    and the node is served with IPVS. The masquerade fields are the mode's own: in nftables
    mode the nftables section's, as kube-proxy reads them; the iptables section's are then
    another mode's fields, named in the warning."""
    doc = yaml.safe_load(KUBEADM.read_text())
    doc["mode"] = mode
    doc["iptables"] = {**(doc.get("iptables") or {}), "masqueradeAll": True}
    doc["nftables"] = {**(doc.get("nftables") or {}), "masqueradeAll": True}
    path = tmp_path / "config.conf"
    path.write_text(yaml.safe_dump(doc))
    loaded = kpconfig.load(path)
    assert loaded.values["masquerade_all"] is True
    assert loaded.fields["masquerade_all"] == (
        "nftables.masqueradeAll" if mode == "nftables" else "iptables.masqueradeAll"
    )
    assert ("iptables.masqueradeAll" in loaded.ignored) == (mode == "nftables")
    assert ("nftables.masqueradeAll" in loaded.ignored) == (mode != "nftables")


def test_a_file_that_is_not_there_or_not_yaml(tmp_path):
    with pytest.raises(ConfigError, match="--config .*missing"):
        kpconfig.load(tmp_path / "missing")
    bad = tmp_path / "bad.conf"
    bad.write_text("kind: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        kpconfig.load(bad)


def test_fields_with_no_meaning_here_are_named_once(tmp_path, caplog):
    doc = yaml.safe_load(WRITTEN.read_text())
    doc["enableProfiling"] = True
    doc["winkernel"]["enableDSR"] = True
    doc["nftables"]["masqueradeAll"] = True
    loaded = kpconfig.parse(doc)
    assert loaded.ignored == ("enableProfiling", "nftables.masqueradeAll", "winkernel.enableDSR")


def test_proxy_mode_other_than_ipvs_is_refused():
    result = CliRunner().invoke(main, ["run", "--proxy-mode", "nftables"])
    assert result.exit_code == 2
    assert "--proxy-mode 'nftables': ipvsproxy is an IPVS proxy" in result.stderr


def test_manifests_on_the_command_line_win_over_the_files_kubeconfig(tmp_path):
    """kubeadm's config.conf names clientConnection.kubeconfig; `diff --manifests` with it
    reads the manifests (flags win over the file, as in kube-proxy), no conflict."""
    root = Path(__file__).parent.parent / "examples"
    args = ["diff", "--config", str(KUBEADM), "--manifests", str(root / "cluster.yaml")]
    more = ["--kernel-state", str(root / "kernel-state.txt"), "--hostname-override", "node-a"]
    result = CliRunner().invoke(main, [*args, *more])
    assert result.exit_code == 1, result.output  # changes pending: the manifests were read
    assert "exclude each other" not in result.stderr
    result = CliRunner().invoke(main, [*args, "--kubeconfig", str(tmp_path / "kc"), *more])
    assert result.exit_code == 2  # given on the command line: still a conflict
    assert "--manifests and --kubeconfig/--context/--master exclude each other" in result.stderr


def test_a_missing_kubeconfig_named_by_the_file_is_named_as_its_field(tmp_path):
    path = tmp_path / "config.conf"
    doc = yaml.safe_load(KUBEADM.read_text())
    doc["clientConnection"]["kubeconfig"] = str(tmp_path / "kubeconfig.conf")
    path.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(main, ["diff", "--config", str(path)])
    assert result.exit_code == 2
    assert result.stderr == (
        f"ipvsproxy: error: --config {path}: field clientConnection.kubeconfig: "
        f"{tmp_path}/kubeconfig.conf: no such file\n"
    )


def test_an_unreadable_kubeconfig_named_by_the_file_is_named_as_its_field(tmp_path):
    kubeconfig = tmp_path / "kubeconfig.conf"
    kubeconfig.write_text("foo: [\n")
    path = tmp_path / "config.conf"
    doc = yaml.safe_load(KUBEADM.read_text())
    doc["clientConnection"]["kubeconfig"] = str(kubeconfig)
    path.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(main, ["diff", "--config", str(path)])
    assert result.exit_code == 2
    assert result.stderr.startswith(
        "ipvsproxy: error: cannot load the Kubernetes client configuration (--config "
        f"{path}: field clientConnection.kubeconfig: {kubeconfig}: not valid YAML"
    )


@pytest.mark.parametrize("field", ["maxPerCore", "min"])
def test_a_conntrack_zero_in_the_file_stays_zero_leave_the_kernels_limit_alone(
    monkeypatch, tmp_path, field
):
    """kube-proxy's 0: do not touch nf_conntrack_max (read as unset, the agent would write
    the default's 32768 per core)."""
    path = tmp_path / "config.conf"
    path.write_text(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
        f"conntrack:\n  {field}: 0\n"
    )
    config, _ = agent_config(monkeypatch, "--config", str(path))
    got = config.conntrack_max_per_core if field == "maxPerCore" else config.conntrack_min
    assert got == 0
