"""The command line: parse options into a `Config`, call the agent, map errors to exit codes.

Exit codes are API: `diff` exits 0 in sync, 1 with changes pending, 2 on any error (with a
one-line message, never a traceback). `run` exits 0 when every operation was applied, 1 when
some failed, 2 on bad input, 3 when it cannot start (no usable kernel backend), 4 when IPVS
is not usable and `--no-fallback` forbids the iptables fallback, 5 when IPVS is usable but
a tool of its firewall rules is missing (and `--allow-no-firewall-rules` was not given).

Imports: click (only here), config, agent, logs, errors.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from ipvsproxy import __version__, agent, kpconfig, logs
from ipvsproxy.backends import FirewallUnavailable
from ipvsproxy.config import (
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
from ipvsproxy.sync.render import render_text, to_json

EXIT_FAILED_OPS = 1
EXIT_ERROR = 2
EXIT_STARTUP_FAILURE = 3
EXIT_NO_FALLBACK = 4
EXIT_NO_COMPANION = 5
log = logging.getLogger("ipvsproxy")

F = TypeVar("F", bound=Callable[..., Any])


def source_options(func: F) -> F:
    """Where Services, EndpointSlices and Nodes come from: files, or the Kubernetes API."""
    options = [
        click.option(
            "--manifests",
            "manifest_paths",
            multiple=True,
            type=click.Path(path_type=Path),
            help="YAML/JSON files or directories with Services, EndpointSlices and Nodes "
            "(repeatable); instead of the API.",
        ),
        click.option(
            "--kubeconfig",
            type=click.Path(path_type=Path),
            help="kubeconfig file (default: in-cluster config, else ~/.kube/config).",
        ),
        click.option("--context", help="The kubeconfig context to use."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def make_source(opts: dict[str, Any]) -> agent.Source:
    paths = tuple(opts.pop("manifest_paths"))
    kubeconfig, context = opts.pop("kubeconfig"), opts.pop("context")
    if paths and (kubeconfig or context):
        raise ConfigError("--manifests and --kubeconfig/--context exclude each other")
    if paths:
        return agent.Manifests(paths)
    return agent.Cluster(kubeconfig, context)


def node_options(func: F) -> F:
    """Options shared by every command that computes desired state for this node."""
    options = [
        click.option(
            "--hostname-override",
            metavar="NAME",
            envvar="NODE_NAME",
            help="This node's name: which endpoints are local (default: $NODE_NAME, else "
            "the host name).",
        ),
        click.option(
            "--nodeport-addresses",
            metavar="CIDR,...|primary",
            default="",
            help="Node addresses NodePorts listen on: this host's addresses in these CIDRs "
            "(a family with none: all of its addresses), or 'primary': the Node's primary IP "
            "per family (default: every address of this host but the dummy device's).",
        ),
        click.option(
            "--scheduler",
            "--ipvs-scheduler",
            "scheduler",
            default="rr",
            show_default=True,
            help="Node-wide default IPVS scheduler (a Service may override it by annotation).",
        ),
        click.option(
            "--service-cidr",
            metavar="CIDR,...",
            default="",
            help="Service VIP ranges: virtual servers there are ipvsproxy's (see Ownership).",
        ),
        click.option(
            "--ipvs-exclude-cidrs",
            metavar="CIDR,...",
            default="",
            help="Virtual servers in these ranges are never changed or deleted.",
        ),
        click.option(
            "--service-node-port-range",
            default="30000-32767",
            show_default=True,
            help="The cluster's NodePort range (ownership of node-address virtual servers).",
        ),
        click.option(
            "--dummy-device",
            default="kube-ipvs0",
            show_default=True,
            help="The dummy device that holds the VIPs.",
        ),
        click.option(
            "--backend",
            type=click.Choice(["auto", "ipvs", "iptables"]),
            default="auto",
            show_default=True,
            help="auto: IPVS when a probe virtual server works, else the iptables fallback.",
        ),
        click.option(
            "--cluster-cidr",
            metavar="CIDR,...",
            default="",
            help="The pod network: ClusterIP traffic from outside it is masqueraded (IPVS).",
        ),
        click.option(
            "--masquerade-all", is_flag=True, help="Masquerade all ClusterIP traffic (IPVS)."
        ),
        click.option(
            "--masquerade-bit",
            "--iptables-masquerade-bit",
            "masquerade_bit",
            type=click.IntRange(0, 31),
            default=14,
            show_default=True,
            help="The fwmark bit that marks packets to masquerade.",
        ),
        click.option(
            "--detect-local-mode",
            type=click.Choice(
                ["ClusterCIDR", "NodeCIDR", "InterfaceNamePrefix", "BridgeInterface"]
            ),
            help="How pod traffic is told apart (default: ClusterCIDR with --cluster-cidr).",
        ),
        click.option(
            "--pod-interface-name-prefix",
            default="",
            help="For --detect-local-mode InterfaceNamePrefix (e.g. veth).",
        ),
        click.option(
            "--pod-bridge-interface",
            default="",
            help="For --detect-local-mode BridgeInterface (e.g. cni0).",
        ),
        click.option(
            "--no-fallback",
            is_flag=True,
            help="With --backend auto: exit (status 4) instead of falling back to iptables.",
        ),
        click.option(
            "--allow-no-firewall-rules",
            is_flag=True,
            help="With IPVS: start even when a tool of the firewall rules (iptables-save, "
            "iptables-restore, ipset) is missing, which is otherwise refused (exit 5). "
            "Then there is no VIP port filter, no loadBalancerSourceRanges, no masquerade.",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def make_config(opts: dict[str, Any]) -> Config:
    """Build and validate the Config from parsed option values."""
    node_name = opts.get("hostname_override")
    cluster_cidrs, mode, interface = local_detection(opts)
    return Config(
        **({"node_name": node_name} if node_name else {}),
        scheduler=parse_scheduler(opts["scheduler"], option="--scheduler"),
        nodeport_cidrs=parse_cidrs(
            "" if opts["nodeport_addresses"].strip() == "primary" else opts["nodeport_addresses"],
            option="--nodeport-addresses",
        ),
        nodeport_primary=opts["nodeport_addresses"].strip() == "primary",
        service_cidrs=parse_cidrs(opts["service_cidr"], option="--service-cidr"),
        exclude_cidrs=parse_cidrs(opts["ipvs_exclude_cidrs"], option="--ipvs-exclude-cidrs"),
        nodeport_range=parse_port_range(
            opts["service_node_port_range"], option="--service-node-port-range"
        ),
        dummy_device=parse_interface_name(opts["dummy_device"], option="--dummy-device"),
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
    cluster_cidrs = parse_cidrs(opts["cluster_cidr"], option="--cluster-cidr")
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
        raise ConfigError(f"--detect-local-mode {mode} needs {needs[mode][0]}")
    for option, prefix in (
        ("--pod-interface-name-prefix", True),
        ("--pod-bridge-interface", False),
    ):
        name = opts[option[2:].replace("-", "_")]
        if name:  # checked whenever given: it is written into iptables-restore input
            parse_interface_name(name, option=option, prefix=prefix)
    interface = needs[mode][1] if mode in ("InterfaceNamePrefix", "BridgeInterface") else ""
    return cluster_cidrs, mode, interface


def kube_proxy_options(func: F) -> F:
    """kube-proxy's configuration file and the flags of its that have no ipvsproxy twin,
    so that a kube-proxy DaemonSet's arguments work as they are."""
    options = [
        click.option(
            "--config",
            "config_file",
            type=click.Path(path_type=Path),
            help="A KubeProxyConfiguration file (kube-proxy's --config, e.g. kubeadm's "
            "config.conf); flags given on the command line win over it.",
        ),
        click.option(
            "--proxy-mode",
            default="",
            metavar="ipvs",
            help="kube-proxy's mode flag: only ipvs (or empty) is accepted.",
        ),
        click.option(
            "--v",
            "-v",
            "v",
            type=click.IntRange(min=0),
            default=0,
            metavar="N",
            help="kube-proxy's (klog's) verbosity: 4 or more logs at debug level.",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def from_config_file(opts: dict[str, Any]) -> None:
    """Fill `opts` from `--config` where the command line (or the environment) gave no
    value, check `--proxy-mode`, apply `--v` and the file's logging format. Precedence:
    command line > environment > file > defaults."""
    ctx = click.get_current_context()
    path = opts.pop("config_file")
    loaded = kpconfig.load(path) if path is not None else kpconfig.Loaded()
    given = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    for name, value in loaded.values.items():
        if name == "log_format":
            root = ctx.find_root()
            if root.get_parameter_source("log_format") not in given:
                logs.set_format(str(value))
        elif name in opts and ctx.get_parameter_source(name) not in given:
            opts[name] = Path(str(value)) if name == "kubeconfig" else value
    if loaded.ignored:
        log.warning("--config %s: ignored (no meaning for ipvsproxy): %s", path,
                    ", ".join(loaded.ignored))  # fmt: skip
    mode = opts.pop("proxy_mode").strip()
    if mode not in ("", "ipvs"):
        raise ConfigError(f"--proxy-mode {mode!r}: ipvsproxy is an IPVS proxy (ipvs only)")
    if opts.pop("v") >= 4:
        logging.getLogger().setLevel(logging.DEBUG)


def errors_to_exit(func: F) -> F:
    """Our errors become one line on stderr and exit status 2; never a traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except FallbackRefused as exc:
            click.echo(f"ipvsproxy: error: {exc}", err=True)
            sys.exit(EXIT_NO_FALLBACK)
        except FirewallUnavailable as exc:
            click.echo(f"ipvsproxy: error: {exc}", err=True)
            sys.exit(EXIT_NO_COMPANION if func.__name__ == "run" else EXIT_ERROR)
        except KernelUnavailable as exc:
            click.echo(f"ipvsproxy: error: {exc}", err=True)
            sys.exit(EXIT_STARTUP_FAILURE if func.__name__ in ("run", "prepare") else EXIT_ERROR)
        except IpvsproxyError as exc:
            click.echo(f"ipvsproxy: error: {exc}", err=True)
            sys.exit(EXIT_ERROR)

    return wrapper  # type: ignore[return-value]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ipvsproxy")
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="json: one JSON object per line (time, level, logger, msg).",
)
def main(log_level: str, log_format: str) -> None:
    """ipvsproxy: Kubernetes Service VIPs with the kernel's IPVS load balancer."""
    logs.configure(log_level, log_format)


@main.command()
@source_options
@click.option(
    "--kernel-state",
    type=click.Path(path_type=Path),
    help="Observed IPVS table: a file with the output of `ipvsadm-save -n` "
    "(default: read the live kernel; needs root and IPVS).",
)
@click.option("--output", "-o", type=click.Choice(["text", "json"]), default="text")
@node_options
@kube_proxy_options
@errors_to_exit
def diff(kernel_state: Path | None, output: str, **opts: Any) -> None:
    """Dry run: print the plan `run` would apply; change nothing.

    Exit status: 0 in sync, 1 changes pending, 2 error.
    """
    from_config_file(opts)
    source = make_source(opts)
    config = make_config(opts)
    result = agent.diff(config, source=source, kernel_state=kernel_state)
    for warning in result.warnings:
        click.echo(f"warning: {warning}", err=True)
    if output == "json":
        doc = to_json(
            result.lines, warnings=result.warnings, notes=result.notes, repairs=result.repairs
        )
        click.echo(doc, nl=False)
    else:
        click.echo(render_text(result.lines, notes=result.notes, repairs=result.repairs), nl=False)
    sys.exit(result.exit_code)


def duration(name: str, default: str, text: str) -> Callable[[F], F]:
    return click.option(name, default=default, show_default=True, metavar="DURATION", help=text)


def conntrack_options(func: F) -> F:
    """kube-proxy's `--conntrack-*` flags, names and defaults (cmd/kube-proxy/app/options.go)."""
    count = click.IntRange(min=0)
    options = [
        click.option(
            "--conntrack-max-per-core",
            type=count,
            default=32768,
            show_default=True,
            help="Maximum number of NAT connections to track per CPU core (0 to leave the "
            "limit as-is and ignore --conntrack-min).",
        ),
        click.option(
            "--conntrack-min",
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
        click.option(
            "--conntrack-tcp-be-liberal",
            is_flag=True,
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
    ]
    for option in reversed(options):
        func = option(func)
    return func


def conntrack_config(opts: dict[str, Any]) -> dict[str, Any]:
    """The `Config` fields of the `--conntrack-*` options (popped from `opts`); durations
    in whole seconds, as kube-proxy truncates them."""

    def seconds(name: str) -> int:
        return int(parse_duration(opts.pop(name), option="--" + name.replace("_", "-")))

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


@main.command()
@source_options
@click.option("--once", is_flag=True, help="Sync once, then exit (0: all applied, 1: failures).")
@click.option(
    "--min-sync-period",
    "--ipvs-min-sync-period",
    "min_sync_period",
    default="1s",
    show_default=True,
    metavar="DURATION",
    help="At most one sync per this (e.g. 1s, 500ms).",
)
@click.option(
    "--sync-period",
    "--ipvs-sync-period",
    "sync_period",
    default="30s",
    show_default=True,
    metavar="DURATION",
    help="At least one full resync per this.",
)
@duration(
    "--drain-timeout",
    "30s",
    "How long a removed endpoint keeps its connections (0: until they end, as kube-proxy).",
)
@click.option(
    "--metrics-bind-address",
    default="127.0.0.1:10249",
    show_default=True,
    metavar="ADDR:PORT",
    help="Where /metrics (Prometheus) is served.",
)
@click.option(
    "--healthz-bind-address",
    default="0.0.0.0:10256",
    show_default=True,
    metavar="ADDR:PORT",
    help="Where /healthz and /livez are served.",
)
@click.option(
    "--strict-arp",
    "--ipvs-strict-arp",
    "strict_arp",
    is_flag=True,
    help="Set arp_ignore=1 and arp_announce=2.",
)
@click.option(
    "--tcp-timeout",
    "--ipvs-tcp-timeout",
    "tcp_timeout",
    default="0s",
    metavar="DURATION",
    help="IPVS TCP timeout (0: leave the kernel's).",
)
@click.option(
    "--tcp-fin-timeout",
    "--ipvs-tcpfin-timeout",
    "tcp_fin_timeout",
    default="0s",
    metavar="DURATION",
    help="IPVS TCP FIN_WAIT timeout (0: leave the kernel's).",
)
@click.option(
    "--udp-timeout",
    "--ipvs-udp-timeout",
    "udp_timeout",
    default="0s",
    metavar="DURATION",
    help="IPVS UDP timeout (0: leave the kernel's).",
)
@conntrack_options
@node_options
@kube_proxy_options
@errors_to_exit
def run(once: bool, **opts: Any) -> None:
    """Program the kernel's IPVS table from Services and EndpointSlices.

    Watches the Kubernetes API (--kubeconfig, else in-cluster, else ~/.kube/config), or
    reads --manifests and re-reads them when they change. Stops on SIGTERM/SIGINT, leaving
    the rules in place. Exit status: 0 stopped (or, with --once, all applied), 1 some
    operations failed (--once), 2 bad input or the API refused us, 3 no usable backend,
    4 no IPVS and --no-fallback, 5 IPVS without a tool its firewall rules need.
    """
    from_config_file(opts)
    source = make_source(opts)
    config = run_config(opts)
    if once:
        if not isinstance(source, agent.Manifests):
            raise ConfigError("--once needs --manifests (the API source is long-running)")
        outcome = agent.run_once(config, manifest_paths=source.paths)
        result = outcome.sync
        click.echo(
            f"applied {result.report.applied} of {len(result.plan)} operations"
            + (f", {len(result.report.failures)} failed" if result.report.failures else "")
            + (f"; {outcome.firewall_changes} firewall changes" if outcome.firewall_changes else "")
        )
        for failure in result.report.failures:
            click.echo(f"failed: {failure.error}", err=True)
        if outcome.firewall_error:
            click.echo(f"failed: firewall rules: {outcome.firewall_error}", err=True)
        sys.exit(0 if outcome.ok else EXIT_FAILED_OPS)
    agent.run(config, source=source)


def run_config(opts: dict[str, Any]) -> Config:
    """`make_config` plus run's own options."""

    def seconds(name: str) -> float:
        return parse_duration(opts.pop(name), option="--" + name.replace("_", "-"))

    def bind(name: str) -> tuple[str, int]:
        return parse_bind_address(opts.pop(name), option="--" + name.replace("_", "-"))

    min_sync, sync_period, drain = (
        seconds(n) for n in ("min_sync_period", "sync_period", "drain_timeout")
    )
    if sync_period <= 0 or min_sync > sync_period:
        raise ConfigError("--sync-period must be positive and at least --min-sync-period")
    return dataclasses.replace(
        make_config(opts),
        strict_arp=opts.pop("strict_arp"),
        tcp_timeout=int(seconds("tcp_timeout")),
        tcp_fin_timeout=int(seconds("tcp_fin_timeout")),
        udp_timeout=int(seconds("udp_timeout")),
        **conntrack_config(opts),
        min_sync_period=min_sync,
        sync_period=sync_period,
        drain_timeout=drain,
        metrics_bind_address=bind("metrics_bind_address"),
        healthz_bind_address=bind("healthz_bind_address"),
    )


@main.command()
@click.option("--dry-run", is_flag=True, help="List what would be removed; change nothing.")
@click.option(
    "--kube-proxy",
    "kube_proxy",
    is_flag=True,
    help="Remove what kube-proxy's IPVS mode left instead: its KUBE-* chains and jumps, "
    "its ipsets; the IPVS table and kube-ipvs0 stay for ipvsproxy to take over in place.",
)
@click.option(
    "--including-ipvs",
    is_flag=True,
    help="With --kube-proxy: also its virtual servers (the ownership rule) and kube-ipvs0.",
)
@node_options
@errors_to_exit
def cleanup(dry_run: bool, kube_proxy: bool, including_ipvs: bool, **opts: Any) -> None:
    """Remove everything ipvsproxy owns, in both backends, and nothing else.

    IPVS: its virtual servers (the ownership rule: VIPs on the dummy device, --service-cidr,
    NodePorts on this host's addresses), the VIPs and the dummy device. iptables: its
    chains (IPVSPX-*) and the jumps into them. With --kube-proxy: kube-proxy's leftovers
    instead (see the README's migration guide). Exit status: 0 done, 2 error.
    """
    if including_ipvs and not kube_proxy:
        raise ConfigError("--including-ipvs goes with --kube-proxy")
    config = make_config(opts)
    if kube_proxy:
        removed = agent.cleanup_kube_proxy(config, dry_run=dry_run, ipvs=including_ipvs)
        whose = "kube-proxy's"
    else:
        removed = agent.cleanup(config, dry_run=dry_run)
        whose = "ipvsproxy's"
    verb = "would remove" if dry_run else "removed"
    for item in removed:
        click.echo(f"{verb}: {item}")
    click.echo(f"{verb} {len(removed)} objects" if removed else f"nothing of {whose} found")


@main.command()
@click.option(
    "--scheduler",
    default="rr",
    show_default=True,
    help="The node-wide default scheduler, whose module is loaded.",
)
@click.option("--strict-arp", is_flag=True, help="Set arp_ignore=1 and arp_announce=2.")
@conntrack_options
@errors_to_exit
def prepare(scheduler: str, strict_arp: bool, **opts: Any) -> None:
    """Load the IPVS modules and set the kernel settings ipvsproxy needs, then exit.

    For a privileged init container, so that the agent itself runs with three capabilities
    and a read-only /proc/sys. `run` checks the same settings at start. Exit 0, or 3 when a
    setting cannot be written (the conntrack ones, `--conntrack-*`, only warn, as in `run`).
    """
    config = Config(
        scheduler=parse_scheduler(scheduler, option="--scheduler"),
        strict_arp=strict_arp,
        **conntrack_config(opts),
    )
    for line in agent.prepare_host(config):
        click.echo(line)
