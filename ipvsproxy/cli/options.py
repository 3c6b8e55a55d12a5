"""The command line's options: the option groups the commands share (source, node,
ownership, kube-proxy's flags, conntrack, HTTP, logging) and the errors' exit codes. Their
sections of `--help` are in `cli.help`; how their values become a `Config`, in `cli.settings`.

Imports: click (only in ipvsproxy.cli), backends, config, kpconfig, logs, errors, cli.help.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ipvsproxy import __version__, kpconfig, logs
from ipvsproxy.backends import FirewallUnavailable
from ipvsproxy.cli.help import (
    HTTP,
    IGNORED,
    KUBE_PROXY,
    LOGGING,
    OWN,
    F,
    SectionOption,
    apply,
    kube_proxy_flag,
    option,
)
from ipvsproxy.config import DEFAULT_SERVICE_METRICS_MAX_SERIES
from ipvsproxy.errors import FallbackRefused, IpvsproxyError, KernelUnavailable

EXIT_FAILED_OPS = 1
EXIT_ERROR = 2
EXIT_STARTUP_FAILURE = 3
EXIT_NO_FALLBACK = 4
EXIT_NO_COMPANION = 5


def source_options(func: F) -> F:
    """Where Services, EndpointSlices and Nodes come from: files, or the Kubernetes API."""
    return apply(func, [
        option(
            "--manifests",
            "manifest_paths",
            section=OWN,
            multiple=True,
            type=click.Path(path_type=Path),
            help="YAML/JSON files or directories with Services, EndpointSlices and Nodes "
            "(repeatable); instead of the API.",
        ),
        option(
            "--kubeconfig",
            section=KUBE_PROXY,
            type=click.Path(path_type=Path),
            help="kubeconfig file (default: in-cluster config, else ~/.kube/config).",
        ),
        option(
            "--master",
            section=KUBE_PROXY,
            metavar="URL",
            help="The API server's address; overrides the kubeconfig's server (without "
            "--kubeconfig: the only configuration, no credentials), as kube-proxy's.",
        ),
        option("--context", section=OWN, help="The kubeconfig context to use."),
    ])  # fmt: skip


def ownership_options(func: F) -> F:
    """What says which virtual servers are ipvsproxy's: every command that changes or
    removes them (`cleanup` too) takes these."""
    return apply(func, [
        option(
            "--nodeport-addresses",
            section=KUBE_PROXY,
            metavar="CIDR,...|primary",
            default="",
            help="Node addresses NodePorts listen on: this host's addresses in these CIDRs "
            "(a family with none: all of its addresses), or 'primary': the Node's primary IP "
            "per family (default: every address of this host but the dummy device's).",
        ),
        option(
            "--service-cidr",
            section=OWN,
            metavar="CIDR,...",
            default="",
            help="Service VIP ranges: virtual servers there are ipvsproxy's (see Ownership).",
        ),
        option(
            "--ipvs-exclude-cidrs",
            section=KUBE_PROXY,
            metavar="CIDR,...",
            default="",
            help="Virtual servers in these ranges are never changed or deleted.",
        ),
        option(
            "--service-node-port-range",
            section=OWN,
            default="30000-32767",
            show_default=True,
            help="The cluster's NodePort range (ownership of node-address virtual servers).",
        ),
        option(
            "--dummy-device",
            section=OWN,
            default="kube-ipvs0",
            show_default=True,
            help="The dummy device that holds the VIPs.",
        ),
    ])  # fmt: skip


def node_options(func: F) -> F:
    """Options shared by every command that computes desired state for this node."""
    func = apply(func, [
        option(
            "--hostname-override",
            section=KUBE_PROXY,
            metavar="NAME",
            envvar="NODE_NAME",
            help="This node's name: which endpoints are local (default: $NODE_NAME, else "
            "the host name).",
        ),
        option(
            "--scheduler",
            "--ipvs-scheduler",
            "scheduler",
            section=KUBE_PROXY,
            default="rr",
            show_default=True,
            help="Node-wide default IPVS scheduler (a Service may override it by annotation).",
        ),
        option(
            "--backend",
            section=OWN,
            type=click.Choice(["auto", "ipvs", "iptables"]),
            default="auto",
            show_default=True,
            help="auto: IPVS when a probe virtual server works, else the iptables fallback.",
        ),
        option(
            "--cluster-cidr",
            section=KUBE_PROXY,
            metavar="CIDR,...",
            default="",
            help="The pod network: ClusterIP traffic from outside it is masqueraded (IPVS).",
        ),
        option(
            "--external-ip-cidrs",
            section=OWN,
            metavar="CIDR,...|none",
            default="",
            help="The ranges a Service's spec.externalIPs may use; an externalIP outside them "
            "gets no virtual server, firewall entry or bound address, with a warning naming "
            "the Service. 'none': no externalIP at all. Default: any address, as kube-proxy "
            "(docs/kubernetes.md, externalIPs). LoadBalancer ingress IPs are not affected.",
        ),
        kube_proxy_flag("--masquerade-all", help="Masquerade all ClusterIP traffic (IPVS)."),
        option(
            "--masquerade-bit",
            "--iptables-masquerade-bit",
            "masquerade_bit",
            section=KUBE_PROXY,
            type=click.IntRange(0, 31),
            default=14,
            show_default=True,
            help="The fwmark bit that marks packets to masquerade.",
        ),
        option(
            "--detect-local-mode",
            section=KUBE_PROXY,
            type=click.Choice(
                ["ClusterCIDR", "NodeCIDR", "InterfaceNamePrefix", "BridgeInterface"]
            ),
            help="How pod traffic is told apart (default: ClusterCIDR with --cluster-cidr).",
        ),
        option(
            "--pod-interface-name-prefix",
            section=KUBE_PROXY,
            default="",
            help="For --detect-local-mode InterfaceNamePrefix (e.g. veth).",
        ),
        option(
            "--pod-bridge-interface",
            section=KUBE_PROXY,
            default="",
            help="For --detect-local-mode BridgeInterface (e.g. cni0).",
        ),
        option(
            "--no-fallback",
            section=OWN,
            is_flag=True,
            help="With --backend auto: exit (status 4) instead of falling back to iptables.",
        ),
        option(
            "--firewall",
            section=OWN,
            type=click.Choice(["auto", "nftables", "iptables"]),
            default="auto",
            show_default=True,
            help="With IPVS: where its firewall rules live: nftables (one table, inet "
            "ipvsproxy), iptables (IPVSPROXY-* chains and ipsets), or auto: nftables where the "
            "kernel takes the table and nft works, else iptables (docs/firewall.md).",
        ),
        option(
            "--first-services",
            section=OWN,
            metavar="NS/NAME,...",
            default="default/kubernetes,kube-system/kube-dns",
            show_default=True,
            help="Served before the rest of the table when a node's table is not complete "
            "yet, so that a node joining a large cluster reaches the API and the cluster DNS "
            "within seconds; empty: none.",
        ),
        option(
            "--allow-no-firewall-rules",
            section=OWN,
            is_flag=True,
            help="With IPVS: start even when the firewall rules cannot be written (no nft, or "
            "no iptables-save, iptables-restore or ipset), which is otherwise refused (exit 5). "
            "Then there is no VIP port filter, no loadBalancerSourceRanges, no masquerade.",
        ),
    ])  # fmt: skip
    return ownership_options(func)


def kube_proxy_options(func: F) -> F:
    """kube-proxy's configuration file and the flags of its that have no ipvsproxy twin,
    so that a kube-proxy DaemonSet's arguments work as they are."""
    return apply(func, [
        option(
            "--config",
            "config_file",
            section=KUBE_PROXY,
            type=click.Path(path_type=Path),
            help="A KubeProxyConfiguration file (kube-proxy's --config, e.g. kubeadm's "
            "config.conf); flags given on the command line win over it.",
        ),
        option(
            "--proxy-mode",
            section=KUBE_PROXY,
            default="",
            metavar="ipvs",
            help="kube-proxy's mode flag: only ipvs (or empty) is accepted.",
        ),
    ])  # fmt: skip


# kube-proxy's flags with no meaning here: (name, click settings, why); accepted, and named
# in one warning when given a value other than kube-proxy's default (kpconfig.IGNORED_FLAGS,
# the same rule as --config's fields)
_DURATION = {"metavar": "DURATION"}
_BOOL = {"type": click.BOOL}
IGNORED_FLAGS: tuple[tuple[str, dict[str, Any], str], ...] = (
    ("feature-gates", {"metavar": "KEY=BOOL,..."}, "ipvsproxy has no feature gates."),
    ("bind-address", {"metavar": "IP"}, "The node's primary IP comes from its Node object."),
    ("bind-address-hard-fail", _BOOL, "A port that cannot be bound always stops ipvsproxy."),
    ("profiling", _BOOL, "No /debug/pprof."),
    ("show-hidden-metrics-for-version", {"metavar": "X.Y"}, "No metric is hidden."),
    ("iptables-localhost-nodeports", _BOOL, "kube-proxy's iptables mode only."),
    ("iptables-sync-period", _DURATION, "kube-proxy's iptables mode (see --sync-period)."),
    ("iptables-min-sync-period", _DURATION, "kube-proxy's iptables mode (see --min-sync-period)."),
    ("kube-api-content-type", {}, "ipvsproxy asks for JSON."),
    ("kube-api-qps", {"type": float}, "No client-side rate limit (docs/kube-proxy-compat.md)."),
    ("kube-api-burst", {"type": int}, "No client-side rate limit (docs/kube-proxy-compat.md)."),
    ("oom-score-adj", {"type": click.IntRange(-1000, 1000)},
     "The kubelet sets it (-997: system-node-critical)."),
    ("config-sync-period", _DURATION, "The watches have no periodic relist."),
    ("vmodule", {"metavar": "PATTERN=N,..."}, "klog's per-file verbosity."),
    ("log-flush-frequency", _DURATION, "ipvsproxy's logs are not buffered."),
    ("log-text-split-stream", _BOOL, "One stream: stderr."),
    ("log-text-info-buffer-size", {"metavar": "SIZE"}, "Not buffered."),
    ("log-json-split-stream", _BOOL, "One stream: stderr."),
    ("log-json-info-buffer-size", {"metavar": "SIZE"}, "Not buffered."),
)  # fmt: skip


def ignored_flag_options(func: F) -> F:
    """The options of `IGNORED_FLAGS`, with kube-proxy's defaults."""
    options = []
    for name, settings, why in IGNORED_FLAGS:
        defaults = kpconfig.IGNORED_FLAGS[name]
        if settings is _BOOL:
            options.append(kube_proxy_flag(f"--{name}", help=why, section=IGNORED))
            continue
        options.append(
            option(
                f"--{name}",
                section=IGNORED,
                default=defaults[0] if defaults else "",
                show_default=bool(defaults),
                help=why,
                **settings,
            )  # fmt: skip
        )
    return apply(func, options)


def log_level_option() -> Callable[[F], F]:
    return option(
        "--log-level",
        section=LOGGING,
        type=click.Choice(logs.LEVELS),
        default="info",
        show_default=True,
        help="Log lines of this level and above.",
    )


def log_format_option(more: str = "") -> Callable[[F], F]:
    return option(
        "--log-format",
        "--logging-format",
        "log_format",
        section=LOGGING,
        type=click.Choice(logs.FORMATS),
        default="text",
        show_default=True,
        help="json: one JSON object per line (time, level, logger, msg and the record's fields, "
        "docs/logging.md). --logging-format is kube-proxy's name." + more,
    )


def logging_options(func: F) -> F:
    """The logging options, accepted after the subcommand too (there they win over the ones
    before it)."""
    return apply(func, [
        log_level_option(),
        log_format_option(),
        option(
            "--v",
            "-v",
            "v",
            section=LOGGING,
            type=click.IntRange(min=0),
            default=0,
            metavar="N",
            help="kube-proxy's (klog's) verbosity: 4 or more logs at debug level.",
        ),
    ])  # fmt: skip


def errors_to_exit(func: F) -> F:
    """Our errors become one line on stderr (a JSON object under --log-format json) and an
    exit status (`EXIT_ERROR` unless more precise); never a traceback."""
    in_run = func.__name__ == "run"

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except IpvsproxyError as exc:
            click.echo(logs.error_line(str(exc)), err=True)
            if isinstance(exc, FallbackRefused):
                sys.exit(EXIT_NO_FALLBACK)
            if isinstance(exc, FirewallUnavailable):
                sys.exit(EXIT_NO_COMPANION if in_run else EXIT_ERROR)
            if isinstance(exc, KernelUnavailable):
                startup = func.__name__ in ("run", "prepare")
                sys.exit(EXIT_STARTUP_FAILURE if startup else EXIT_ERROR)
            sys.exit(EXIT_ERROR)

    return wrapper  # type: ignore[return-value]


def duration(name: str, default: str, text: str, *names: str) -> Callable[[F], F]:
    """A kube-proxy duration option (Go syntax: 1m30s, 500ms)."""
    return option(name, *names, section=KUBE_PROXY, default=default, show_default=True,
                  metavar="DURATION", help=text)  # fmt: skip


def conntrack_options(func: F) -> F:
    """kube-proxy's `--conntrack-*` flags, names and defaults (cmd/kube-proxy/app/options.go)."""
    count = click.IntRange(0, 2**31 - 1)  # the kernel's int sysctls
    return apply(func, [
        option(
            "--conntrack-max-per-core",
            section=KUBE_PROXY,
            type=count,
            default=32768,
            show_default=True,
            help="Maximum number of NAT connections to track per CPU core (0 to leave the "
            "limit as-is and ignore --conntrack-min).",
        ),
        option(
            "--conntrack-min",
            section=KUBE_PROXY,
            type=count,
            default=131072,
            show_default=True,
            help="Minimum number of conntrack entries to allocate, regardless of "
            "--conntrack-max-per-core.",
        ),
        duration(
            "--conntrack-tcp-timeout-established",
            "24h0m0s",
            "Idle timeout for established TCP connections (0 to leave as-is).",
        ),
        duration(
            "--conntrack-tcp-timeout-close-wait",
            "1h0m0s",
            "NAT timeout for TCP connections in the CLOSE_WAIT state (0 to leave as-is).",
        ),
        kube_proxy_flag(
            "--conntrack-tcp-be-liberal",
            help="Enable liberal mode for tracking TCP packets (nf_conntrack_tcp_be_liberal=1).",
        ),
        duration(
            "--conntrack-udp-timeout",
            "0s",
            "Idle timeout for UNREPLIED UDP connections (0 to leave as-is).",
        ),
        duration(
            "--conntrack-udp-timeout-stream",
            "0s",
            "Idle timeout for ASSURED UDP connections (0 to leave as-is).",
        ),
    ])  # fmt: skip


def http_options(func: F) -> F:
    """The metrics and health endpoints, with kube-proxy's names and defaults."""
    return apply(func, [
        option(
            "--metrics-bind-address",
            section=HTTP,
            default="127.0.0.1:10249",
            show_default=True,
            metavar="ADDR[:PORT]",
            help="Where /metrics (Prometheus) and /proxyMode are served.",
        ),
        option(
            "--healthz-bind-address",
            section=HTTP,
            default="0.0.0.0:10256",
            show_default=True,
            metavar="ADDR[:PORT]",
            help="Where /healthz, /livez and /readyz are served.",
        ),
        option(
            "--metrics-port",
            section=HTTP,
            type=click.IntRange(0, 65535),
            default=10249,
            help="kube-proxy's deprecated flag: the port of a --metrics-bind-address given "
            "without one.",
        ),
        option(
            "--healthz-port",
            section=HTTP,
            type=click.IntRange(0, 65535),
            default=10256,
            help="kube-proxy's deprecated flag: the port of a --healthz-bind-address given "
            "without one.",
        ),
        option(
            "--service-metrics",
            section=HTTP,
            is_flag=True,
            help="Export connections, packets and bytes per Service port and virtual server "
            "on /metrics, read from the IPVS counters at scrape time (none in the iptables "
            "fallback).",
        ),
        option(
            "--endpoint-metrics",
            section=HTTP,
            is_flag=True,
            help="With --service-metrics: the same per endpoint.",
        ),
        option(
            "--status-remote",
            section=HTTP,
            is_flag=True,
            help="Answer /status (every Service, endpoint, pod and node) to clients on other "
            "hosts too; without it, only to the node's loopback (`ipvsproxy status`).",
        ),
        option(
            "--secure-metrics-bind-address",
            section=HTTP,
            default="",
            metavar="ADDR:PORT",
            help="Also serve /metrics over HTTPS here (e.g. 0.0.0.0:10263; off by default), "
            "to clients whose bearer token the API server authenticates (TokenReview) and "
            "allows to get /metrics (SubjectAccessReview), as kube-scheduler's secure port.",
        ),
        option(
            "--tls-cert-file",
            section=HTTP,
            type=click.Path(path_type=Path),
            help="The secure metrics port's certificate (PEM, its chain after it); without "
            "it and --tls-private-key-file, a self-signed one made at start.",
        ),
        option(
            "--tls-private-key-file",
            section=HTTP,
            type=click.Path(path_type=Path),
            help="The private key of --tls-cert-file (PEM).",
        ),
        option(
            "--service-metrics-max-series",
            section=HTTP,
            type=click.IntRange(1, 1_000_000),
            default=DEFAULT_SERVICE_METRICS_MAX_SERIES,
            show_default=True,
            help="At most this many series of the traffic metrics per scrape; the rest are "
            "dropped (in sorted order) and counted.",
        ),
    ])  # fmt: skip


def once_options(func: F) -> F:
    """kube-proxy's flags that make it do one thing and exit, and ipvsproxy's --once."""
    return apply(func, [
        option(
            "--once",
            section=OWN,
            is_flag=True,
            help="Sync once, then exit (0: all applied, 1: failures).",
        ),
        kube_proxy_flag(
            "--cleanup",
            help="Remove ipvsproxy's rules and exit, as `ipvsproxy cleanup` (kube-proxy's "
            "--cleanup removes its own).",
        ),
        kube_proxy_flag(
            "--init-only",
            help="Make the node settings that need privileges and exit, as `ipvsproxy prepare`.",
        ),
        option(
            "--write-config-to",
            section=KUBE_PROXY,
            metavar="FILE",
            help="kube-proxy's; refused (exit 2): ipvsproxy writes no configuration file.",
        ),
        click.version_option(__version__, prog_name="ipvsproxy", cls=SectionOption,
                             section=KUBE_PROXY),  # fmt: skip
    ])  # fmt: skip
