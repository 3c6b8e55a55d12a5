"""The command line's options: the sections of `--help`, the option groups the commands
share (source, node, ownership, kube-proxy's flags, conntrack, HTTP, logging), how their
values become a `Config`, the errors' exit codes.

Imports: click (only in ipvsproxy.cli), config, agent, kpconfig, logs, errors.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
from collections.abc import Callable, Sequence
from ipaddress import ip_address
from pathlib import Path
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from ipvsproxy import __version__, agent, kpconfig, logs
from ipvsproxy.backends import FirewallUnavailable
from ipvsproxy.config import (
    DEFAULT_SERVICE_METRICS_MAX_SERIES,
    MAX_DURATION,
    MAX_KERNEL_TIMEOUT,
    Config,
    parse_cidrs,
    parse_duration,
    parse_interface_name,
    parse_port_range,
    parse_scheduler,
)
from ipvsproxy.errors import ConfigError, FallbackRefused, IpvsproxyError, KernelUnavailable
from ipvsproxy.model import IPNetwork
from ipvsproxy.serve import parse_bind_address
from ipvsproxy.sync.slowstart import MAX_WINDOW, ignored

EXIT_FAILED_OPS = 1
EXIT_ERROR = 2
EXIT_STARTUP_FAILURE = 3
EXIT_NO_FALLBACK = 4
EXIT_NO_COMPANION = 5
log = logging.getLogger("ipvsproxy")

F = TypeVar("F", bound=Callable[..., Any])

# The sections of `--help`, in this order; an option names its own (`SectionOption`)
KUBE_PROXY = "kube-proxy compatible options"
OWN = "ipvsproxy options"
HTTP = "HTTP options (metrics, healthz)"
LOGGING = "Logging options"
IGNORED = "kube-proxy flags accepted with no meaning here (warned of unless kube-proxy's default)"
SECTIONS = (KUBE_PROXY, OWN, HTTP, LOGGING, IGNORED)
GIVEN = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
FIELDS = "ipvsproxy.config_fields"  # ctx.meta: option -> "--config FILE: field ipvs.scheduler"


class SectionOption(click.Option):
    """An option that says under which heading of `--help` it is listed."""

    def __init__(self, *args: Any, section: str = OWN, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.section = section


def format_sections(command: click.Command, ctx: click.Context, out: click.HelpFormatter) -> None:
    """The options of `command`, one titled list per section (click has no option groups)."""
    rows: dict[str, list[tuple[str, str]]] = {section: [] for section in SECTIONS}
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is not None:
            rows[getattr(param, "section", OWN)].append(record)
    for title, records in rows.items():
        if records:
            with out.section(title):
                out.write_dl(records)


class SectionArgument(click.Argument):
    """An argument that, as every parameter, names its section (listed in the usage line)."""

    def __init__(self, *args: Any, section: str = OWN, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.section = section


class Command(click.Command):
    """A command whose `--help` lists its options by section."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        format_sections(self, ctx, formatter)


class Group(click.Group):
    """The group: its own options by section, then its commands (each a `Command`)."""

    command_class = Command

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        format_sections(self, ctx, formatter)
        self.format_commands(ctx, formatter)


def option(*decls: str, section: str, **kwargs: Any) -> Callable[[F], F]:
    return click.option(*decls, cls=SectionOption, section=section, **kwargs)


def kube_proxy_flag(*decls: str, help: str, section: str = KUBE_PROXY) -> Callable[[F], F]:
    """A boolean flag as kube-proxy's (pflag's) are: `--name`, `--name=true|false`."""
    return option(*decls, section=section, type=click.BOOL, is_flag=False, flag_value=True,
                  default=False, metavar="[=true|false]", help=help)  # fmt: skip


def apply(func: F, options: Sequence[Callable[[F], F]]) -> F:
    for decorate in reversed(options):
        func = decorate(func)
    return func


def given(ctx: click.Context, name: str) -> bool:
    """Whether the command line (or the environment) gave `name`, not a default or --config."""
    return ctx.get_parameter_source(name) in GIVEN


def flag(name: str, option: str) -> str:
    """How an error names where the value of `name` came from: `option`, or --config's file
    and field ("--config /etc/kp.yaml: field ipvs.scheduler")."""
    ctx = click.get_current_context(silent=True)
    fields: dict[str, str] = ctx.meta.get(FIELDS, {}) if ctx is not None else {}
    return fields.get(name, option)


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


def make_source(opts: dict[str, Any]) -> agent.Source:
    paths = tuple(opts.pop("manifest_paths"))
    kubeconfig, context, master = opts.pop("kubeconfig"), opts.pop("context"), opts.pop("master")
    if paths and (kubeconfig or context or master):
        raise ConfigError("--manifests and --kubeconfig/--context/--master exclude each other")
    if paths:
        return agent.Manifests(paths)
    return agent.Cluster(kubeconfig, context, master or None)


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
            "--allow-no-firewall-rules",
            section=OWN,
            is_flag=True,
            help="With IPVS: start even when a tool of the firewall rules (iptables-save, "
            "iptables-restore, ipset) is missing, which is otherwise refused (exit 5). "
            "Then there is no VIP port filter, no loadBalancerSourceRanges, no masquerade.",
        ),
    ])  # fmt: skip
    return ownership_options(func)


def ownership_config(opts: dict[str, Any]) -> dict[str, Any]:
    """The `Config` fields of `ownership_options`."""
    nodeport = opts["nodeport_addresses"]
    return {
        "nodeport_cidrs": parse_cidrs(
            "" if nodeport.strip() == "primary" else nodeport,
            option=flag("nodeport_addresses", "--nodeport-addresses"),
        ),
        "nodeport_primary": nodeport.strip() == "primary",
        "service_cidrs": parse_cidrs(opts["service_cidr"], option="--service-cidr"),
        "exclude_cidrs": parse_cidrs(
            opts["ipvs_exclude_cidrs"], option=flag("ipvs_exclude_cidrs", "--ipvs-exclude-cidrs")
        ),
        "nodeport_range": parse_port_range(
            opts["service_node_port_range"], option="--service-node-port-range"
        ),
        "dummy_device": parse_interface_name(opts["dummy_device"], option="--dummy-device"),
    }


def make_config(opts: dict[str, Any]) -> Config:
    """Build and validate the Config from parsed option values."""
    node_name = opts.get("hostname_override")
    cluster_cidrs, mode, interface = local_detection(opts)
    return Config(
        **({"node_name": node_name} if node_name else {}),
        scheduler=parse_scheduler(opts["scheduler"], option=flag("scheduler", "--scheduler")),
        **ownership_config(opts),
        backend=opts["backend"],
        fallback=not opts["no_fallback"],
        allow_no_firewall=opts["allow_no_firewall_rules"],
        cluster_cidrs=cluster_cidrs,
        masquerade_all=opts["masquerade_all"],
        masquerade_bit=opts["masquerade_bit"],
        detect_local_mode=mode,
        local_interface=interface,
    )


def local_detection(opts: dict[str, Any]) -> tuple[tuple[IPNetwork, ...], str, str]:
    """--cluster-cidr, --detect-local-mode and the interface it needs, checked together."""
    cluster_cidrs = parse_cidrs(opts["cluster_cidr"], option=flag("cluster_cidr", "--cluster-cidr"))
    mode = opts["detect_local_mode"] or ("ClusterCIDR" if cluster_cidrs else "")
    needs = {
        "ClusterCIDR": ("--cluster-cidr", ",".join(map(str, cluster_cidrs))),
        "InterfaceNamePrefix": ("--pod-interface-name-prefix", opts["pod_interface_name_prefix"]),
        "BridgeInterface": ("--pod-bridge-interface", opts["pod_bridge_interface"]),
    }
    if mode == "ClusterCIDR" and not cluster_cidrs:
        # kube-proxy's getLocalDetector (cmd/kube-proxy/app/server_linux.go): a no-op
        # detector, as in the file `kube-proxy --write-config-to` writes without --cluster-cidr
        log.warning(
            "detect-local-mode ClusterCIDR without a cluster CIDR (--cluster-cidr, or "
            "clusterCIDR in --config): no traffic is detected as local, as in kube-proxy"
        )
        mode = ""
    elif mode in needs and not needs[mode][1]:
        where = flag("detect_local_mode", "--detect-local-mode")
        if where.startswith("--config"):
            field = kpconfig.field_of(needs[mode][0][2:].replace("-", "_"))
            raise ConfigError(f"{where}: {mode} needs {field} (or {needs[mode][0]})")
        raise ConfigError(f"{where} {mode} needs {needs[mode][0]}")
    for option_name, prefix in (
        ("--pod-interface-name-prefix", True),
        ("--pod-bridge-interface", False),
    ):
        name = option_name[2:].replace("-", "_")
        if opts[name]:  # checked whenever given: it is written into iptables-restore input
            parse_interface_name(opts[name], option=flag(name, option_name), prefix=prefix)
    interface = needs[mode][1] if mode in ("InterfaceNamePrefix", "BridgeInterface") else ""
    return cluster_cidrs, mode, interface


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


def from_config_file(opts: dict[str, Any], *, warn: bool = True) -> None:
    """Fill `opts` from `--config` where the command line (or the environment) gave no
    value, check `--proxy-mode`, warn once of what has no meaning here (unless not `warn`:
    `prepare` reads only a few of the file's fields, the agent warns of the file), apply the
    logging options. Precedence: command line > environment > file > defaults. A value from
    the file is checked as its flag is; an error names the file and the field."""
    ctx = click.get_current_context()
    path = opts.pop("config_file")
    loaded = kpconfig.load(path) if path is not None else kpconfig.Loaded()
    params = {param.name: param for param in ctx.command.params}
    fields: dict[str, str] = {}
    for name, value in loaded.values.items():
        if name not in opts or given(ctx, name):
            continue
        if name == "log_format" and given(ctx.find_root(), name):
            continue  # given before the subcommand
        where = f"--config {path}: field {loaded.fields[name]}"
        try:
            opts[name] = params[name].type.convert(value, params[name], ctx)
        except click.BadParameter as exc:
            raise ConfigError(f"{where}: {exc.message}") from None
        fields[name] = where
    ctx.meta[FIELDS] = fields
    apply_logging(opts)  # first: the warnings below come out in the format asked for
    if not warn:
        return
    flags = [
        f"--{name}"
        for name in kpconfig.IGNORED_FLAGS
        if kpconfig.meaningless(
            opts.pop(name.replace("-", "_"), None), kpconfig.IGNORED_FLAGS[name]
        )
    ]
    if flags:
        log.warning("ignored (no meaning for ipvsproxy): %s", ", ".join(flags))
    if loaded.ignored:
        log.warning("--config %s: ignored (no meaning for ipvsproxy): %s", path,
                    ", ".join(loaded.ignored))  # fmt: skip
    mode = opts.pop("proxy_mode").strip()
    if mode not in ("", "ipvs"):
        raise ConfigError(f"--proxy-mode {mode!r}: ipvsproxy is an IPVS proxy (ipvs only)")


def apply_logging(opts: dict[str, Any]) -> None:
    """The logging options of a subcommand (popped from `opts`): given after it (or set by
    --config), they win over those given before it."""
    ctx = click.get_current_context()
    level, log_format, verbosity = opts.pop("log_level"), opts.pop("log_format"), opts.pop("v")
    if given(ctx, "log_level"):
        logs.set_level(level)
    if given(ctx, "log_format") or "log_format" in ctx.meta.get(FIELDS, {}):
        logs.set_format(log_format)
    if verbosity >= 4:
        logging.getLogger().setLevel(logging.DEBUG)


def errors_to_exit(func: F) -> F:
    """Our errors become one line on stderr and exit status 2; never a traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except FallbackRefused as exc:
            click.echo(f"ipvsproxy: error: {logs.escape(str(exc))}", err=True)
            sys.exit(EXIT_NO_FALLBACK)
        except FirewallUnavailable as exc:
            click.echo(f"ipvsproxy: error: {logs.escape(str(exc))}", err=True)
            sys.exit(EXIT_NO_COMPANION if func.__name__ == "run" else EXIT_ERROR)
        except KernelUnavailable as exc:
            click.echo(f"ipvsproxy: error: {logs.escape(str(exc))}", err=True)
            sys.exit(EXIT_STARTUP_FAILURE if func.__name__ in ("run", "prepare") else EXIT_ERROR)
        except IpvsproxyError as exc:
            click.echo(f"ipvsproxy: error: {logs.escape(str(exc))}", err=True)
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


def conntrack_config(opts: dict[str, Any]) -> dict[str, Any]:
    """The `Config` fields of the `--conntrack-*` options (popped from `opts`); durations
    in whole seconds, as kube-proxy truncates them."""

    def seconds(name: str) -> int:
        option = flag(name, "--" + name.replace("_", "-"))
        return int(parse_duration(opts.pop(name), option=option, maximum=MAX_KERNEL_TIMEOUT))

    return {
        "conntrack_max_per_core": opts.pop("conntrack_max_per_core"),
        "conntrack_min": opts.pop("conntrack_min"),
        "conntrack_tcp_be_liberal": opts.pop("conntrack_tcp_be_liberal"),
        **{
            name: seconds(name)
            for name in (
                "conntrack_tcp_timeout_established",
                "conntrack_tcp_timeout_close_wait",
                "conntrack_udp_timeout",
                "conntrack_udp_timeout_stream",
            )
        },
    }


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
            help="Where /healthz and /livez are served.",
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


def run_config(opts: dict[str, Any]) -> Config:
    """`make_config` plus run's own options."""

    def seconds(name: str, maximum: float = MAX_DURATION) -> float:
        option = flag(name, "--" + name.replace("_", "-"))
        return parse_duration(opts.pop(name), option=option, maximum=maximum)

    def bind(name: str) -> tuple[str, int]:
        text = opts.pop(f"{name}_bind_address")
        port = opts.pop(f"{name}_port")
        option_name = flag(f"{name}_bind_address", f"--{name}-bind-address")
        if _is_ip(text):  # kube-proxy's AppendPortIfNeeded: --<name>-port's, by default its own
            text = f"[{text}]:{port}" if ":" in text else f"{text}:{port}"
        return parse_bind_address(text, option=option_name)

    texts = {name: opts[name] for name in ("min_sync_period", "sync_period")}
    min_sync, sync_period, drain = (
        seconds(n) for n in ("min_sync_period", "sync_period", "drain_timeout")
    )
    if sync_period <= 0:
        raise ConfigError(f"{flag('sync_period', '--sync-period')}: must be positive")
    if min_sync > sync_period:
        raise ConfigError(
            f"{flag('min_sync_period', '--min-sync-period')}: {texts['min_sync_period']!r} is "
            f"longer than the sync period ({flag('sync_period', '--sync-period')}: "
            f"{texts['sync_period']!r})"
        )
    config = dataclasses.replace(
        make_config(opts),
        strict_arp=opts.pop("strict_arp"),
        tcp_timeout=int(seconds("tcp_timeout", MAX_KERNEL_TIMEOUT)),
        tcp_fin_timeout=int(seconds("tcp_fin_timeout", MAX_KERNEL_TIMEOUT)),
        udp_timeout=int(seconds("udp_timeout", MAX_KERNEL_TIMEOUT)),
        **conntrack_config(opts),
        min_sync_period=min_sync,
        sync_period=sync_period,
        drain_timeout=drain,
        metrics_bind_address=bind("metrics"),
        healthz_bind_address=bind("healthz"),
        **service_metrics_config(opts),
        slow_start=seconds("slow_start", MAX_WINDOW),
    )
    if config.slow_start and not config.scheduler.honours_weights:
        log.warning(
            "--slow-start: %s: off for the Services that keep the default scheduler",
            ignored(config.scheduler),
        )
    return config


def service_metrics_config(opts: dict[str, Any]) -> dict[str, Any]:
    """The `Config` fields of the traffic metrics' options (popped from `opts`)."""
    service, endpoint = opts.pop("service_metrics"), opts.pop("endpoint_metrics")
    if endpoint and not service:
        raise ConfigError("--endpoint-metrics needs --service-metrics")
    return {
        "service_metrics": service,
        "endpoint_metrics": endpoint,
        "service_metrics_max_series": opts.pop("service_metrics_max_series"),
    }


def _is_ip(text: str) -> bool:
    try:
        ip_address(text.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    return True
